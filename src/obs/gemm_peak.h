// The GEMM ceiling that utilisation is reported against: at one shape, measured now, the
// fastest of the [M,K]x[K,N] products (bf16 operands or fp32) run for `seconds`. Benchmarks and
// the trainer report model FLOP utilisation against it.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/backend.h"

namespace bertrain::obs {

double measure_gemm_peak_gflops(int64_t M, int64_t N, int64_t K, bool bf16, double seconds);

// The same on the device a backend runs on: the CPU's above, or a GPU's (cuBLASLt, measured
// with CUDA events: kernels/cuda/cuda.h gemm_tflops).
double measure_gemm_peak_gflops(const kernels::Backend& be, int64_t M, int64_t N, int64_t K,
                                bool bf16, double seconds);
// A line naming that device for run headers: "cpu  <model; kernels; oneDNN>" or "gpu  <name>".
std::string device_description(const kernels::Backend& be);

}  // namespace bertrain::obs
