#include "obs/gemm_peak.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/matmul.h"
#ifdef BERTRAIN_CUDA
#include "kernels/cuda/cuda.h"
#endif

namespace bertrain::obs {

double measure_gemm_peak_gflops(int64_t M, int64_t N, int64_t K, bool bf16, double seconds) {
  std::vector<float> a(M * K, 0.01f), w(N * K, 0.02f), c(M * N);
  std::vector<uint16_t> a16(bf16 ? M * K : 0, 0x3c23), w16(bf16 ? N * K : 0, 0x3ca3);
  auto run = [&] {
    if (bf16)
      kernels::gemm_bf16(false, true, M, N, K, a16.data(), K, w16.data(), K, c.data(), N, nullptr,
                         false);
    else
      kernels::linear_forward(c.data(), a.data(), w.data(), nullptr, M, N, K);
  };
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  run();  // create the primitive
  // The fastest run: a ceiling, so noise from the rest of the machine must not lower it.
  double best = 1e30;
  const auto start = Clock::now();
  do {
    const auto t0 = Clock::now();
    run();
    best = std::min(best, since(t0));
  } while (since(start) < seconds);
  return 2.0 * M * N * K / best / 1e9;
}

const char* gemm_operands(const kernels::Target& be, kernels::Precision p) {
  if (p == kernels::Precision::BF16) return "bf16";
  if (p == kernels::Precision::FP16 && be.fp16_operands()) return "fp16";
  return "fp32";
}

double measure_gemm_peak_gflops(const kernels::Backend& be, int64_t M, int64_t N, int64_t K,
                                kernels::Precision p, double seconds) {
  const bool bf16 = p == kernels::Precision::BF16,
             f16 = p == kernels::Precision::FP16 && be.fp16_operands();  // as gemm_operands
#ifdef BERTRAIN_CUDA
  if (!be.host_memory())
    return 1e3 * cuda::gemm_tflops(bf16  ? cuda::Operands::BF16
                                   : f16 ? cuda::Operands::FP16
                                         : cuda::Operands::FP32,
                                   M, N, K, seconds);
#endif
  BT_CHECK(!f16, "no fp16 GEMM ceiling on the CPU");
  return measure_gemm_peak_gflops(M, N, K, bf16, seconds);
}

std::string device_description(const kernels::Backend& be) {
#ifdef BERTRAIN_CUDA
  if (!be.host_memory()) return "gpu        " + cuda::device_name() + " (CUDA backend, cuBLASLt)";
#endif
  return "cpu        " + kernels::cpu_description();
}

}  // namespace bertrain::obs
