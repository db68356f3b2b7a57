// Activations (the CPU's portable formulas: kernels/row_math.h), dropout and 16-bit rounding on
// the GPU. Dropout uses the same counter-based hash as the CPU (core/rng.h), so a mask is
// identical on either backend for the same (key, index).
#include <cuda_fp16.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/row_math.h"

namespace bertrain::cuda {

namespace {

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

__global__ void scale_kernel(float* x, int64_t n, kernels::Multiplier s) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s.value();
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
  if (i < n) dst[i] = to_16(Precision::BF16, src[i]);
}

__global__ void round_f16_kernel(uint16_t* dst, const float* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = to_16(Precision::FP16, src[i]);
}

// Element i's dropout index: i, or its row's mapped row (rows: Dropout::rows) and column.
__device__ inline uint64_t dropout_index(int64_t i, const int32_t* rows, int64_t C) {
  if (!rows) return static_cast<uint64_t>(i);
  return static_cast<uint64_t>(rows[i / C]) * static_cast<uint64_t>(C) +
         static_cast<uint64_t>(i % C);
}

__global__ void dropout_kernel(float* x, int64_t n, float p, float scale, uint64_t key,
                               uint64_t offset, const int32_t* rows, int64_t C,
                               const uint64_t* at) {
  step_key(key, offset, at);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  x[i] = rng_uniform(key, offset + dropout_index(i, rows, C)) >= p ? x[i] * scale : 0.0f;
}

__device__ inline float widen_half(uint16_t b) {
  return __half2float(__ushort_as_half(b));
}
__device__ inline uint16_t to_half(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

__global__ void dropout_backward_kernel(float* dx, const float* dy, int64_t n, float p,
                                        uint64_t key, uint64_t offset, const int32_t* rows,
                                        int64_t C, const uint64_t* at) {
  step_key(key, offset, at);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n)
    dx[i] = kernels::row_math::dropout(dy[i], p, kernels::row_math::keep_scale_of(p), key,
                                       offset + dropout_index(i, rows, C));
}

// FP16 storage: x rounded to fp16 in place, its bits kept.
__global__ void keep_f16_kernel(float* x, uint16_t* bits, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint16_t b = to_half(x[i]);
  if (bits) bits[i] = b;
  x[i] = widen_half(b);
}

// The activation in the kept precision (kernels/backend.h): BF16 writes out16 = bf16(act(x))
// and in16 = bf16(x); FP16 rounds the input first, then the output (bits and value). `in` null:
// the input is its 16-bit copy alone (what its product wrote: Backend::linear_forward_16), x
// that copy's value.
__global__ void activation_forward_16_kernel(Precision p, kernels::Activation a, float* out,
                                             uint16_t* out16, const float* in, uint16_t* in16,
                                             int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (p == Precision::BF16) {
    // (in null: the product wrote the input's 16-bit copy alone; its activation at that value)
    out16[i] = f32_to_bf16(kernels::row_math::activation(a, in ? in[i] : bf16_to_f32(in16[i])));
    if (in && in16) in16[i] = f32_to_bf16(in[i]);
    return;
  }
  const uint16_t xb = in ? to_half(in[i]) : in16[i];
  if (in && in16) in16[i] = xb;
  const uint16_t yb = to_half(kernels::row_math::activation(a, widen_half(xb)));
  if (out16) out16[i] = yb;
  if (out) out[i] = widen_half(yb);
}

// dinp = dout * act'(x) at the kept 16-bit input.
__global__ void activation_backward_16_kernel(Precision p, kernels::Activation a, float* dinp,
                                              const uint16_t* in16, const float* dout, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = p == Precision::BF16 ? bf16_to_f32(in16[i]) : widen_half(in16[i]);
  dinp[i] = kernels::row_math::activation_grad(a, x, dout[i]);
}

}  // namespace

void activation_forward(kernels::Activation a, float* out, const float* inp, int64_t n,
                        void* stream) {
  BT_EACH_ON(stream, activation_forward_kernel, n, a, out, inp, n);
}

void activation_backward(kernels::Activation a, float* dinp, const float* inp, const float* dout,
                         int64_t n, void* stream) {
  BT_EACH_ON(stream, activation_backward_kernel, n, a, dinp, inp, dout, n);
}

void activation_forward(Precision p, kernels::Activation a, kernels::Kept out, kernels::Kept in,
                        int64_t n, void* stream) {
  if (p == Precision::FP32) return activation_forward(a, out.f32, in.f32, n, stream);
  BT_EACH_ON(stream, activation_forward_16_kernel, n, p, a, out.f32, out.bits,
             static_cast<const float*>(in.f32), in.bits, n);
}

void activation_backward(Precision p, kernels::Activation a, float* dinp, kernels::Kept in,
                         const float* dout, int64_t n, void* stream) {
  if (p == Precision::FP32) return activation_backward(a, dinp, in.f32, dout, n, stream);
  BT_EACH_ON(stream, activation_backward_16_kernel, n, p, a, dinp,
             static_cast<const uint16_t*>(in.bits), dout, n);
}

void keep(Precision p, kernels::Kept x, int64_t n, void* stream) {
  if (p == Precision::BF16) round_to_16(p, x.bits, x.f32, n, stream);
  if (p == Precision::FP16) BT_EACH_ON(stream, keep_f16_kernel, n, x.f32, x.bits, n);
}

void dropout_forward(float* x, int64_t N, int64_t C, const kernels::Dropout& d, void* stream) {
  if (d.p <= 0.0f) return;
  const int64_t n = N * C;
  BT_EACH_ON(stream, dropout_kernel, n, x, n, d.p, 1.0f / (1.0f - d.p), d.key, d.offset, d.rows, C,
             d.at);
}

void dropout_backward(float* dx, const float* dy, int64_t N, int64_t C, const kernels::Dropout& d,
                      void* stream) {
  const int64_t n = N * C;
  if (d.p <= 0.0f) {
    if (dx != dy && n > 0)
      BT_CUDA_CHECK(cudaMemcpyAsync(dx, dy, static_cast<size_t>(n) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, as_stream(stream)));
    return;
  }
  BT_EACH_ON(stream, dropout_backward_kernel, n, dx, dy, n, d.p, d.key, d.offset, d.rows, C, d.at);
}

void scale(float* x, int64_t n, kernels::Multiplier s, void* stream) {
  BT_EACH_ON(stream, scale_kernel, n, x, n, s);
}

void round_to_16(Precision p, uint16_t* dst, const float* src, int64_t n, void* stream) {
  BT_CHECK(p != Precision::FP32, "round_to_16: fp32 is not a 16-bit precision");
  if (p == Precision::BF16)
    BT_EACH_ON(stream, round_bf16_kernel, n, dst, src, n);
  else
    BT_EACH_ON(stream, round_f16_kernel, n, dst, src, n);
}

void widen_from_16(Precision p, float* dst, const uint16_t* src, int64_t n, void* stream) {
  BT_CHECK(p != Precision::FP32, "widen_from_16: fp32 is not a 16-bit precision");
  if (p == Precision::BF16)
    BT_EACH_ON(stream, widen_bf16_kernel, n, dst, src, n);
  else
    BT_EACH_ON(stream, widen_f16_kernel, n, dst, src, n);
}

}  // namespace bertrain::cuda
