// The CUDA backend's host interface: device buffers and the kernel families ported so far
// (LayerNorm, activations, dropout with the same counter-based masks as the CPU). Plain C++
// header, no CUDA types, so CPU code can include it; compiled only with -DBERTRAIN_CUDA=ON.
// Kernels run on the default stream unless a stream (cudaStream_t as void*) is given.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/elementwise.h"

namespace bertrain::cuda {

// Number of usable CUDA devices (0 when no driver or no GPU: callers skip, never crash).
int device_count();

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  float* f32() const { return static_cast<float*>(ptr_); }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* host, size_t bytes);
  void download(void* host, size_t bytes) const;

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

void synchronize();

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps, void* stream = nullptr);
// dinp (=), dgamma and dbeta (+=), as the CPU kernel.
void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                        const float* inp, const float* gamma, const float* mean, const float* rstd,
                        int64_t N, int64_t C, void* stream = nullptr);

void activation_forward(kernels::Activation a, float* out, const float* inp, int64_t n,
                        void* stream = nullptr);
void activation_backward(kernels::Activation a, float* dinp, const float* inp, const float* dout,
                         int64_t n, void* stream = nullptr);

void dropout_forward(float* x, int64_t n, float p, uint64_t key, uint64_t offset,
                     void* stream = nullptr);

}  // namespace bertrain::cuda
