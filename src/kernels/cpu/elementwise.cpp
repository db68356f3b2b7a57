#include "kernels/cpu/elementwise.h"

#include <cmath>

namespace bertrain::kernels {
namespace {
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
}  // namespace

void activation_forward(Activation a, float* out, const float* inp, int64_t n) {
  switch (a) {
    case Activation::GeluErf:
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float x = inp[i];
        out[i] = 0.5f * x * (1.0f + std::erf(x * kInvSqrt2));
      }
      break;
    case Activation::GeluTanh:
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float x = inp[i];
        out[i] = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
      }
      break;
    case Activation::Relu:
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) out[i] = inp[i] > 0.0f ? inp[i] : 0.0f;
      break;
  }
}

void activation_backward(Activation a, float* dinp, const float* inp, const float* dout,
                         int64_t n) {
  switch (a) {
    case Activation::GeluErf:
      // d/dx [x Phi(x)] = Phi(x) + x phi(x)
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float x = inp[i];
        float cdf = 0.5f * (1.0f + std::erf(x * kInvSqrt2));
        float pdf = kInvSqrt2Pi * std::exp(-0.5f * x * x);
        dinp[i] = dout[i] * (cdf + x * pdf);
      }
      break;
    case Activation::GeluTanh:
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float x = inp[i];
        float u = kSqrt2OverPi * (x + 0.044715f * x * x * x);
        float t = std::tanh(u);
        float du = kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] = dout[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
      }
      break;
    case Activation::Relu:
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) dinp[i] = inp[i] > 0.0f ? dout[i] : 0.0f;
      break;
  }
}

void tanh_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = std::tanh(inp[i]);
}

void tanh_backward(float* dinp, const float* out, const float* dout, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dinp[i] = dout[i] * (1.0f - out[i] * out[i]);
}

void add(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void add_inplace(float* out, const float* a, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] += a[i];
}

void dropout_forward(float* x, int64_t n, float p, uint64_t key, uint64_t offset) {
  if (p <= 0.0f) return;
  const float scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = dropout_keep(p, key, offset + i) ? x[i] * scale : 0.0f;
}

void dropout_backward(float* dx, const float* dy, int64_t n, float p, uint64_t key,
                      uint64_t offset) {
  if (p <= 0.0f) {
    if (dx != dy)
      for (int64_t i = 0; i < n; ++i) dx[i] = dy[i];
    return;
  }
  const float scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dx[i] = dropout_keep(p, key, offset + i) ? dy[i] * scale : 0.0f;
}

}  // namespace bertrain::kernels
