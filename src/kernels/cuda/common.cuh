// CUDA error checking: a failed call is an environment error (driver, memory), reported with
// the call, file and line as a bertrain::Error.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"
#include "kernels/cuda/scratch.h"

#define BT_CUDA_CHECK(call)                                                                      \
  do {                                                                                           \
    cudaError_t err_ = (call);                                                                   \
    if (err_ != cudaSuccess)                                                                     \
      ::bertrain::fail("CUDA error ", cudaGetErrorString(err_), " in ", #call, " at ", __FILE__, \
                       ":", __LINE__);                                                           \
  } while (0)

// A kernel launch: BT_LAUNCH(kernel, grid, block[, shared bytes, stream])(args...). On a GPU the
// triple chevrons; the emulated device (cuda_emu/, which C++ compilers build) defines its own.
#ifndef BT_LAUNCH
#define BT_LAUNCH(kernel, ...) kernel<<<__VA_ARGS__>>>
#endif

namespace bertrain::cuda {
inline cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}
inline unsigned blocks_for(int64_t n, unsigned threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}
}  // namespace bertrain::cuda
