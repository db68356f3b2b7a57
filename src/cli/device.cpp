// --device: which backend the model runs on (kernels/backend.h); what the commands report
// about it is obs/gemm_peak.h's (its GEMM ceiling, a line naming it).
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "kernels/cuda/scratch.h"
#ifdef BERTRAIN_CUDA
#include "kernels/cuda/cuda.h"
#endif

namespace bertrain::cli {

void add_device_option(CLI::App* c, std::string& device) {
  c->add_option("--device", device,
                "cpu, cuda or auto (auto: the GPU where this build has the CUDA backend and a "
                "GPU is visible, else the CPU)")
      ->capture_default_str();
}

namespace {
void check_device(const std::string& device) {
  if (device != "cpu" && device != "cuda" && device != "auto")
    fail("--device must be cpu, cuda or auto, got '", device, "'");
}
}  // namespace

const kernels::Backend* visible_gpu() {
#ifdef BERTRAIN_CUDA
  if (cuda::device_count() > 0) return &cuda::cuda_backend();
#endif
  return nullptr;
}

const kernels::Target& device_target(const std::string& device) {
  check_device(device);
  if (device == "cpu") return kernels::cpu_backend();
  if (const kernels::Backend* gpu = visible_gpu()) return *gpu;
  return device == "cuda" ? cuda::target() : kernels::cpu_backend();
}

const kernels::Backend& device_backend(const std::string& device) {
  check_device(device);
  if (device == "cpu") return kernels::cpu_backend();
  if (const kernels::Backend* gpu = visible_gpu()) return *gpu;
#ifdef BERTRAIN_CUDA
  if (device == "cuda")
    fail(
        "--device cuda: no CUDA device is visible here (nvidia-smi lists them; check "
        "CUDA_VISIBLE_DEVICES); run with --device cpu");
#else
  if (device == "cuda")
    fail(
        "--device cuda: this bertrain is built without the CUDA backend; build it with "
        "CMAKE_ARGS=\"-DBERTRAIN_CUDA=ON\" scripts/setup.sh (needs the CUDA toolkit's nvcc)");
#endif
  return kernels::cpu_backend();
}

}  // namespace bertrain::cli
