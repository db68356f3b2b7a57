// LayerNorm on the GPU: one warp per row (C up to a few thousand), fp32 statistics.
// Backward: dinp per row in the same warp; dgamma/dbeta by a column kernel over all rows
// (deterministic: no atomics).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"

namespace bertrain::cuda {

namespace {

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp,
                                         const float* gamma, const float* beta, int64_t N,
                                         int64_t C, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* x = inp + row * C;
  float s = 0.0f;
  for (int64_t c = lane; c < C; c += 32) s += x[c];
  const float m = warp_sum(s) / C;
  float v = 0.0f;
  for (int64_t c = lane; c < C; c += 32) {
    float d = x[c] - m;
    v += d * d;
  }
  const float r = rsqrtf(warp_sum(v) / C + eps);
  float* o = out + row * C;
  for (int64_t c = lane; c < C; c += 32) o[c] = (x[c] - m) * r * gamma[c] + beta[c];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

__global__ void layernorm_backward_dinp_kernel(float* dinp, const float* dout, const float* inp,
                                               const float* gamma, const float* mean,
                                               const float* rstd, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* x = inp + row * C;
  const float* dy = dout + row * C;
  const float m = mean[row], r = rstd[row];
  float a = 0.0f, b = 0.0f;
  for (int64_t c = lane; c < C; c += 32) {
    const float xhat = (x[c] - m) * r;
    const float gdy = gamma[c] * dy[c];
    a += gdy;
    b += gdy * xhat;
  }
  a = warp_sum(a) / C;
  b = warp_sum(b) / C;
  float* dx = dinp + row * C;
  for (int64_t c = lane; c < C; c += 32) {
    const float xhat = (x[c] - m) * r;
    dx[c] = r * (gamma[c] * dy[c] - a - xhat * b);
  }
}

__global__ void layernorm_backward_params_kernel(float* dgamma, float* dbeta, const float* dout,
                                                 const float* inp, const float* mean,
                                                 const float* rstd, int64_t N, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float g = 0.0f, bsum = 0.0f;
  for (int64_t i = 0; i < N; ++i) {
    const float dy = dout[i * C + c];
    g += dy * (inp[i * C + c] - mean[i]) * rstd[i];
    bsum += dy;
  }
  dgamma[c] += g;
  dbeta[c] += bsum;
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps, void* stream) {
  constexpr unsigned kThreads = 256, kRowsPerBlock = kThreads / 32;
  layernorm_forward_kernel<<<blocks_for(N, kRowsPerBlock), kThreads, 0, as_stream(stream)>>>(
      out, mean, rstd, inp, gamma, beta, N, C, eps);
  BT_CUDA_CHECK(cudaGetLastError());
}

void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                        const float* inp, const float* gamma, const float* mean, const float* rstd,
                        int64_t N, int64_t C, void* stream) {
  constexpr unsigned kThreads = 256, kRowsPerBlock = kThreads / 32;
  layernorm_backward_dinp_kernel<<<blocks_for(N, kRowsPerBlock), kThreads, 0, as_stream(stream)>>>(
      dinp, dout, inp, gamma, mean, rstd, N, C);
  BT_CUDA_CHECK(cudaGetLastError());
  layernorm_backward_params_kernel<<<blocks_for(C, kThreads), kThreads, 0, as_stream(stream)>>>(
      dgamma, dbeta, dout, inp, mean, rstd, N, C);
  BT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace bertrain::cuda
