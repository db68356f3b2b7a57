// The device registry (kernels/backend.h): which backends this build and this machine have. The
// one place above the backends that knows whether the GPU backend is built; the rest of bertrain
// asks these functions.
#include "core/error.h"
#include "kernels/backend.h"
#include "kernels/cuda/scratch.h"
#ifdef BERTRAIN_CUDA
#include "kernels/cuda/cuda.h"
#endif

namespace bertrain::kernels {

bool gpu_built() {
#ifdef BERTRAIN_CUDA
  return true;
#else
  return false;
#endif
}

int gpu_count() {
#ifdef BERTRAIN_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

const Backend* gpu_backend() {
#ifdef BERTRAIN_CUDA
  if (cuda::device_count() > 0) return &cuda::cuda_backend();
#endif
  return nullptr;
}

const Target& gpu_target() {
  return cuda::target();
}

void select_gpu(int device) {
#ifdef BERTRAIN_CUDA
  cuda::set_device(device);
#else
  fail("GPU ", device, " asked for, but this bertrain is built without the CUDA backend (",
       "CMAKE_ARGS=\"-DBERTRAIN_CUDA=ON\" scripts/setup.sh builds it)");
#endif
}

const char* gemm_operands(const Target& t, Precision p) {
  if (p == Precision::BF16) return "bf16";
  if (p == Precision::FP16 && t.fp16_operands()) return "fp16";
  return "fp32";
}

std::string device_line(const Backend& be) {
  return (be.host_memory() ? "cpu        " : "gpu        ") + be.description();
}

}  // namespace bertrain::kernels
