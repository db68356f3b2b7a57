// CUDA error checking: a failed call is an environment error (driver, memory), reported with
// the call, file and line as a bertrain::Error.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/precision.h"
#include "kernels/cuda/scratch.h"

#define BT_CUDA_CHECK(call)                                                                      \
  do {                                                                                           \
    cudaError_t err_ = (call);                                                                   \
    if (err_ != cudaSuccess)                                                                     \
      ::bertrain::fail("CUDA error ", cudaGetErrorString(err_), " in ", #call, " at ", __FILE__, \
                       ":", __LINE__);                                                           \
  } while (0)

// A kernel launch: BT_LAUNCH(kernel, grid, block[, shared bytes, stream])(args...), counted
// (device_counts). On a GPU the triple chevrons; the emulated device (cuda_emu/, which C++
// compilers build) has its own.
#ifdef CUDA_EMU_LAUNCH
#define BT_KERNEL_LAUNCH(kernel, ...) CUDA_EMU_LAUNCH(kernel, __VA_ARGS__)
#else
#define BT_KERNEL_LAUNCH(kernel, ...) kernel<<<__VA_ARGS__>>>
#endif
#undef BT_LAUNCH
#define BT_LAUNCH(kernel, ...) \
  ::bertrain::cuda::count_launch(), BT_KERNEL_LAUNCH(kernel, __VA_ARGS__)

// A call in which the host waits for the device (a synchronisation, a blocking copy, a free),
// counted (device_counts): BT_CUDA_WAIT(cudaStreamSynchronize(s)).
#define BT_CUDA_WAIT(call)               \
  do {                                   \
    ::bertrain::cuda::count_host_sync(); \
    BT_CUDA_CHECK(call);                 \
  } while (0)

// A wait for host memory the device still copies from, the host ahead of it (DeviceCounts::
// ahead_waits): BT_CUDA_WAIT_AHEAD(cudaEventSynchronize(copied)).
#define BT_CUDA_WAIT_AHEAD(call)          \
  do {                                    \
    ::bertrain::cuda::count_ahead_wait(); \
    BT_CUDA_CHECK(call);                  \
  } while (0)

namespace bertrain::cuda {
// v rounded to p's 16-bit operand (round to nearest even): bf16 bits in BF16, fp16 bits in FP16
// (round_to_16's rounding, where a producer writes the 16-bit copy itself).
__device__ inline uint16_t to_16(Precision p, float v) {
  return p == Precision::BF16 ? f32_to_bf16(v) : __half_as_ushort(__float2half_rn(v));
}

// The counts of device_counts (cuda.h): a kernel or library product queued, a host wait, a wait
// of the host ahead.
void count_launch();
void count_host_sync();
void count_ahead_wait();
// Device memory freed (cudaFree, a host synchronisation: counted): what a record of device
// memory's contents kept by address (rows.cu, the optimizer's tables) must not outlive. The
// generation counts the frees so far.
void count_free();
uint64_t memory_generation();

// Whether a query (cudaStreamQuery, cudaEventQuery) found the work done: false while it still
// runs, a bertrain::Error on an error. A host wait behind it is made only where it is false.
inline bool done(cudaError_t query) {
  if (query == cudaErrorNotReady) return false;
  if (query != cudaSuccess)
    ::bertrain::fail("CUDA error ", cudaGetErrorString(query), " in a stream or event query");
  return true;
}

inline cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}
inline unsigned blocks_for(int64_t n, unsigned threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// Element-wise kernels: a thread per element, kElementThreads a block; BT_FOR_EACH(n) opens such
// a kernel with its element's index i (returning past n), launch / launch_on run one over n
// elements on the default stream or the given one (nothing when n is 0).
constexpr unsigned kElementThreads = 256;
#define BT_FOR_EACH(n)                                                           \
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
  if (i >= (n)) return

inline void check_launch() {
  BT_CUDA_CHECK(cudaGetLastError());
}

template <class K, class... A>
void launch_on(void* stream, K kernel, int64_t n, A... args) {
  if (n == 0) return;
  BT_LAUNCH(kernel, blocks_for(n, kElementThreads), kElementThreads, 0, as_stream(stream))
  (args...);
  check_launch();
}

template <class K, class... A>
void launch(K kernel, int64_t n, A... args) {
  launch_on(nullptr, kernel, n, args...);
}
}  // namespace bertrain::cuda
