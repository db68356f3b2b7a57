// The GEMM ceiling that utilisation is reported against: at one shape, measured now, the
// fastest of the [M,K]x[K,N] products (bf16 operands or fp32) run for `seconds`. Benchmarks and
// the trainer report model FLOP utilisation against it.
#pragma once

#include <cstdint>

namespace bertrain::obs {

double measure_gemm_peak_gflops(int64_t M, int64_t N, int64_t K, bool bf16, double seconds);

}  // namespace bertrain::obs
