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
// (a kernel passed on by value, launched under the name it was given: the emulator's counts and
// traces name kernels)
#define BT_KERNEL_LAUNCH_NAMED(name, kernel, ...) \
  ::cuda_emu::make_launch(                        \
      name, [=](auto... a_) { kernel(a_...); }, __VA_ARGS__)
#else
#define BT_KERNEL_LAUNCH(kernel, ...) kernel<<<__VA_ARGS__>>>
#define BT_KERNEL_LAUNCH_NAMED(name, kernel, ...) kernel<<<__VA_ARGS__>>>
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
// p's 16-bit operand bits widened (exactly) to fp32.
__device__ inline float from_16(Precision p, uint16_t b) {
  return p == Precision::BF16 ? bf16_to_f32(b) : __half2float(__ushort_as_half(b));
}

// A dropout site's key and first index where a kernel runs: the step's arguments' where given
// (kernels::Dropout::at: {key, offset}, the offset added), else the launch's.
__device__ inline void step_key(uint64_t& key, uint64_t& offset, const uint64_t* at) {
  if (!at) return;
  key = at[0];
  offset += at[1];
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

// The kernels' stream on the calling thread's current device (device.cu): every operation a
// model issues runs on it, in order. A stream of its own, not the legacy default stream, so that
// a step can be captured as a CUDA graph (the legacy stream cannot capture); blocking, so that
// what still runs on the legacy stream (a synchronous copy or memset) stays in order with it.
cudaStream_t compute_stream();
// A stream given as void*: null is the kernels' own (compute_stream).
inline cudaStream_t as_stream(void* s) {
  return s ? static_cast<cudaStream_t>(s) : compute_stream();
}
inline unsigned blocks_for(int64_t n, unsigned threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// Element-wise kernels: a thread per element, kElementThreads a block; BT_FOR_EACH(n) opens such
// a kernel with its element's index i (returning past n), BT_EACH(kernel, n, args...) /
// BT_EACH_ON(stream, kernel, n, args...) run one over n elements on the kernels' stream or the
// given one (nothing when n is 0), under the kernel's own name (the emulator's counts and
// traces, the traffic model's rows: plan/traffic.h).
constexpr unsigned kElementThreads = 256;
#define BT_FOR_EACH(n)                                                           \
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
  if (i >= (n)) return
#define BT_EACH_ON(stream, kernel, n, ...) \
  ::bertrain::cuda::launch_on(#kernel, stream, kernel, n, __VA_ARGS__)
#define BT_EACH(kernel, n, ...) BT_EACH_ON(nullptr, kernel, n, __VA_ARGS__)

inline void check_launch() {
  BT_CUDA_CHECK(cudaGetLastError());
}

template <class K, class... A>
void launch_on([[maybe_unused]] const char* name, void* stream, K kernel, int64_t n, A... args) {
  if (n == 0) return;
  count_launch();
  BT_KERNEL_LAUNCH_NAMED(name, kernel, blocks_for(n, kElementThreads), kElementThreads, 0,
                         as_stream(stream))
  (args...);
  check_launch();
}
}  // namespace bertrain::cuda
