// --device: which backend the model runs on (kernels/backend.h's device registry: what this build
// and this machine have).
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"

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

const kernels::Target& device_target(const std::string& device) {
  check_device(device);
  if (device == "cpu") return kernels::cpu_backend();
  if (const kernels::Backend* gpu = kernels::gpu_backend()) return *gpu;
  return device == "cuda" ? kernels::gpu_target() : kernels::cpu_backend();
}

const kernels::Backend& device_backend(const std::string& device) {
  check_device(device);
  if (device == "cpu") return kernels::cpu_backend();
  if (const kernels::Backend* gpu = kernels::gpu_backend()) return *gpu;
  if (device == "cuda" && kernels::gpu_built())
    fail(
        "--device cuda: no CUDA device is visible here (nvidia-smi lists them; check "
        "CUDA_VISIBLE_DEVICES); run with --device cpu");
  if (device == "cuda")
    fail(
        "--device cuda: this bertrain is built without the CUDA backend; build it with "
        "CMAKE_ARGS=\"-DBERTRAIN_CUDA=ON\" scripts/setup.sh (needs the CUDA toolkit's nvcc)");
  return kernels::cpu_backend();
}

}  // namespace bertrain::cli
