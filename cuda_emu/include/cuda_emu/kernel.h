// The CUDA kernel language for the emulated device (cuda_emu/README.md): what a .cu file's
// kernels use, compiled by a C++ compiler. A launch runs every block of the grid, each block's
// threads as fibers that switch only at __syncthreads and warp collectives; the built-in indices
// are the running fiber's. __shared__ variables are function statics: one block runs at a time
// in the process, so a block has them to itself, and AddressSanitizer sees their bounds.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
// The vector types a kernel loads and stores 8 or 16 bytes at a time with (CUDA's
// vector_types.h; the address must be aligned to the type's size, which UBSan checks here).
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct CUstream_st;

namespace cuda_emu {

// The running thread of a kernel (set while its fiber runs).
struct ThreadIndex {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
};
const ThreadIndex& current();

// A block's barrier: returns when every thread of the block has reached one.
void syncthreads();

// The warp collectives: every lane named in `mask` must reach the same collective with the same
// mask (a lane that exited, waits at a barrier or is missing from the mask is an error naming
// both lanes); each lane gets the value of its source lane (shuffles) or the vote.
enum class Collective : int { ShflXor, Shfl, ShflUp, ShflDown, Ballot, Any, All, SyncWarp };
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width);

// A misuse the kernel's own code finds (a header's check, as a GPU's hardware would trap): the
// calling thread stops and the kernel fails with `why` (a string that outlives the kernel).
void kernel_fault(const char* why);

template <class T>
T shuffle(Collective kind, unsigned mask, T v, int arg, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>,
                "a shuffle moves 8 bytes at most");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = warp_collective(kind, mask, bits, arg, width);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

// A kernel's launch: the grid's blocks, each thread running body() with its indices, queued on
// the stream (nullptr: the current device's legacy default stream). An invalid configuration is
// the calling thread's last error (cudaGetLastError), as on a GPU.
using Body = void (*)(const void* closure);
void launch_kernel(const char* name, dim3 grid, dim3 block, size_t shared, CUstream_st* stream,
                   void* closure, Body body, void (*destroy)(void*));

template <class F>
struct Launch {
  const char* name;
  F kernel;
  dim3 grid, block;
  size_t shared;
  CUstream_st* stream;
  template <class... A>
  void operator()(A... args) const {
    // The arguments are copied at launch, as a GPU copies a kernel's parameters.
    auto call = [k = kernel, args...]() { k(args...); };
    using Call = decltype(call);
    launch_kernel(
        name, grid, block, shared, stream, new Call(std::move(call)),
        [](const void* c) { (*static_cast<const Call*>(c))(); },
        [](void* c) { delete static_cast<Call*>(c); });
  }
};

template <class F>
Launch<F> make_launch(const char* name, F kernel, dim3 grid, dim3 block, size_t shared = 0,
                      CUstream_st* stream = nullptr) {
  return {name, kernel, grid, block, shared, stream};
}

}  // namespace cuda_emu

#define threadIdx (::cuda_emu::current().thread)
#define blockIdx (::cuda_emu::current().block)
#define blockDim (::cuda_emu::current().block_dim)
#define gridDim (::cuda_emu::current().grid_dim)
inline constexpr int warpSize = 32;

// kernel<<<grid, block, shared, stream>>>(args) on a GPU; bertrain's BT_LAUNCH
// (kernels/cuda/common.cuh) counts the launch and then makes this one.
#define CUDA_EMU_LAUNCH(kernel, ...) \
  ::cuda_emu::make_launch(           \
      #kernel, [=](auto... a_) { kernel(a_...); }, __VA_ARGS__)
#ifndef BT_LAUNCH
#define BT_LAUNCH CUDA_EMU_LAUNCH
#endif

inline void __syncthreads() {
  ::cuda_emu::syncthreads();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::cuda_emu::warp_collective(::cuda_emu::Collective::SyncWarp, mask, 0, 0, 32);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::cuda_emu::shuffle(::cuda_emu::Collective::ShflXor, mask, v, lane_mask, width);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return ::cuda_emu::shuffle(::cuda_emu::Collective::Shfl, mask, v, src_lane, width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::cuda_emu::shuffle(::cuda_emu::Collective::ShflUp, mask, v, static_cast<int>(delta),
                             width);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::cuda_emu::shuffle(::cuda_emu::Collective::ShflDown, mask, v, static_cast<int>(delta),
                             width);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(
      ::cuda_emu::warp_collective(::cuda_emu::Collective::Ballot, mask, predicate != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(
      ::cuda_emu::warp_collective(::cuda_emu::Collective::Any, mask, predicate != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(
      ::cuda_emu::warp_collective(::cuda_emu::Collective::All, mask, predicate != 0, 0, 32));
}

// Atomics: one block runs at a time and its threads switch only at barriers and collectives, so
// a read-modify-write is indivisible.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
T atomicMax(T* p, T v) {
  const T old = *p;
  *p = old < v ? v : old;
  return old;
}
template <class T>
T atomicMin(T* p, T v) {
  const T old = *p;
  *p = v < old ? v : old;
  return old;
}
template <class T>
T atomicExch(T* p, T v) {
  const T old = *p;
  *p = v;
  return old;
}
template <class T>
T atomicCAS(T* p, T compare, T v) {
  const T old = *p;
  if (old == compare) *p = v;
  return old;
}

// Memory fences: one block runs at a time, so its writes are visible to every later block.
inline void __threadfence() {}

inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline int __float_as_int(float f) {
  int x;
  std::memcpy(&x, &f, 4);
  return x;
}
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned x;
  std::memcpy(&x, &f, 4);
  return x;
}
