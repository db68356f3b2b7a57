// Activations and dropout on the GPU. Dropout uses the same counter-based hash as the CPU
// (core/rng.h), so a mask is identical on either backend for the same (key, index).
#include <cuda_fp16.h>

#include "core/dtype.h"
#include "core/rng.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"

namespace bertrain::cuda {

namespace {

constexpr unsigned kThreads = 256;

__global__ void activation_forward_kernel(int a, float* out, const float* inp, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  if (a == 0)
    out[i] = 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
  else if (a == 1)
    out[i] = 0.5f * x * (1.0f + tanhf(0.79788456080286535588f * (x + 0.044715f * x * x * x)));
  else
    out[i] = x > 0.0f ? x : 0.0f;
}

__global__ void activation_backward_kernel(int a, float* dinp, const float* inp, const float* dout,
                                           int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  float d;
  if (a == 0) {
    const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
    const float pdf = 0.39894228040143267794f * expf(-0.5f * x * x);
    d = cdf + x * pdf;
  } else if (a == 1) {
    const float u = 0.79788456080286535588f * (x + 0.044715f * x * x * x);
    const float t = tanhf(u);
    const float du = 0.79788456080286535588f * (1.0f + 3.0f * 0.044715f * x * x);
    d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
  } else {
    d = x > 0.0f ? 1.0f : 0.0f;
  }
  dinp[i] = dout[i] * d;
}

__global__ void round_bf16_kernel(uint16_t* dst, const float* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = f32_to_bf16(src[i]);
}

__global__ void round_f16_kernel(uint16_t* dst, const float* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __half_as_ushort(__float2half_rn(src[i]));
}

__global__ void dropout_kernel(float* x, int64_t n, float p, float scale, uint64_t key,
                               uint64_t offset) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  x[i] = rng_uniform(key, offset + i) >= p ? x[i] * scale : 0.0f;
}

}  // namespace

void activation_forward(kernels::Activation a, float* out, const float* inp, int64_t n,
                        void* stream) {
  if (n == 0) return;
  activation_forward_kernel<<<blocks_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(
      static_cast<int>(a), out, inp, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void activation_backward(kernels::Activation a, float* dinp, const float* inp, const float* dout,
                         int64_t n, void* stream) {
  if (n == 0) return;
  activation_backward_kernel<<<blocks_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(
      static_cast<int>(a), dinp, inp, dout, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void dropout_forward(float* x, int64_t n, float p, uint64_t key, uint64_t offset, void* stream) {
  if (n == 0 || p <= 0.0f) return;
  dropout_kernel<<<blocks_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(
      x, n, p, 1.0f / (1.0f - p), key, offset);
  BT_CUDA_CHECK(cudaGetLastError());
}

void round_to_bf16(uint16_t* dst, const float* src, int64_t n, void* stream) {
  if (n == 0) return;
  round_bf16_kernel<<<blocks_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(dst, src, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void round_to_f16(uint16_t* dst, const float* src, int64_t n, void* stream) {
  if (n == 0) return;
  round_f16_kernel<<<blocks_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(dst, src, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace bertrain::cuda
