// Activations (the CPU's portable formulas: kernels/row_math.h), dropout and 16-bit rounding on
// the GPU. Dropout uses the same counter-based hash as the CPU (core/rng.h), so a mask is
// identical on either backend for the same (key, index).
#include <cuda_fp16.h>

#include "core/dtype.h"
#include "core/rng.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/row_math.h"

namespace bertrain::cuda {

namespace {

constexpr unsigned kThreads = 256;

__global__ void activation_forward_kernel(kernels::Activation a, float* out, const float* inp,
                                          int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = kernels::row_math::activation(a, inp[i]);
}

__global__ void activation_backward_kernel(kernels::Activation a, float* dinp, const float* inp,
                                           const float* dout, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dinp[i] = kernels::row_math::activation_grad(a, inp[i], dout[i]);
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}

__global__ void widen_bf16_kernel(float* dst, const uint16_t* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = bf16_to_f32(src[i]);
}

__global__ void widen_f16_kernel(float* dst, const uint16_t* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __half2float(__ushort_as_half(src[i]));
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
  BT_LAUNCH(activation_forward_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))
  (a, out, inp, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void activation_backward(kernels::Activation a, float* dinp, const float* inp, const float* dout,
                         int64_t n, void* stream) {
  if (n == 0) return;
  BT_LAUNCH(activation_backward_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))
  (a, dinp, inp, dout, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void dropout_forward(float* x, int64_t n, float p, uint64_t key, uint64_t offset, void* stream) {
  if (n == 0 || p <= 0.0f) return;
  BT_LAUNCH(dropout_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))
  (x, n, p, 1.0f / (1.0f - p), key, offset);
  BT_CUDA_CHECK(cudaGetLastError());
}

void scale(float* x, int64_t n, float s, void* stream) {
  if (n == 0) return;
  BT_LAUNCH(scale_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))(x, n, s);
  BT_CUDA_CHECK(cudaGetLastError());
}

void widen_from_bf16(float* dst, const uint16_t* src, int64_t n, void* stream) {
  if (n == 0) return;
  BT_LAUNCH(widen_bf16_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))
  (dst, src, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void widen_from_f16(float* dst, const uint16_t* src, int64_t n, void* stream) {
  if (n == 0) return;
  BT_LAUNCH(widen_f16_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))(dst, src, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void round_to_bf16(uint16_t* dst, const float* src, int64_t n, void* stream) {
  if (n == 0) return;
  BT_LAUNCH(round_bf16_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))
  (dst, src, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

void round_to_f16(uint16_t* dst, const float* src, int64_t n, void* stream) {
  if (n == 0) return;
  BT_LAUNCH(round_f16_kernel, blocks_for(n, kThreads), kThreads, 0, as_stream(stream))(dst, src, n);
  BT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace bertrain::cuda
