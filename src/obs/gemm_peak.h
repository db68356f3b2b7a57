// The GEMM ceiling that utilisation is reported against: at one shape, measured now, the
// fastest of the [M,K]x[K,N] products (bf16 operands or fp32) run for `seconds`. Benchmarks and
// the trainer report model FLOP utilisation against it.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/backend.h"

namespace bertrain::obs {

double measure_gemm_peak_gflops(int64_t M, int64_t N, int64_t K, bool bf16, double seconds);

// The same on the device a backend runs on, with the operands the precision's matmuls take
// there (gemm_operands): the CPU's above, or a GPU's (cuBLASLt, measured with CUDA events:
// kernels/cuda/cuda.h gemm_tflops).
double measure_gemm_peak_gflops(const kernels::Backend& be, int64_t M, int64_t N, int64_t K,
                                kernels::Precision p, double seconds);
// The operands of precision p's matmuls on that device: "bf16"; "fp16" in FP16 where the backend
// multiplies fp16 (Target::fp16_operands); "fp32" otherwise (the CPU's FP16 computes in fp32).
const char* gemm_operands(const kernels::Target& be, kernels::Precision p);
// A line naming that device for run headers: "cpu  <model; kernels; oneDNN>" or "gpu  <name>".
std::string device_description(const kernels::Backend& be);

}  // namespace bertrain::obs
