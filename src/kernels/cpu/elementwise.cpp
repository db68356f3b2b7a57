#include "kernels/cpu/elementwise.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/isa.h"
#include "core/parallel.h"
#include "core/simd_avx2.h"
#include "core/simd_avx512.h"

namespace bertrain::kernels {
namespace {
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;

// Phi(x) = (1 + erf(x / sqrt 2)) / 2 on 16 lanes.
BT_AVX512 inline __m512 gelu_cdf_avx512(__m512 x) {
  return _mm512_fmadd_ps(_mm512_set1_ps(0.5f),
                         simd::erf_ps(_mm512_mul_ps(x, _mm512_set1_ps(kInvSqrt2))),
                         _mm512_set1_ps(0.5f));
}

BT_AVX512 void gelu_forward_avx512(float* out, const float* inp, int64_t b, int64_t e) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = tail_mask(e - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, inp + i);
    const __m512 cdf = gelu_cdf_avx512(x);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(x, cdf));
  }
}

BT_AVX512 void gelu_forward_bf16_avx512(uint16_t* out, uint16_t* inp16, const float* inp, int64_t b,
                                        int64_t e) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = tail_mask(e - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, inp + i);
    const __m512 cdf = gelu_cdf_avx512(x);
    _mm256_mask_storeu_epi16(out + i, m, f32_to_bf16_16(_mm512_mul_ps(x, cdf)));
    if (inp16) _mm256_mask_storeu_epi16(inp16 + i, m, f32_to_bf16_16(x));
  }
}

BT_AVX512 void gelu_backward_avx512(float* dinp, const float* inp, const float* dout, int64_t b,
                                    int64_t e) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = tail_mask(e - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, inp + i);
    const __m512 cdf = gelu_cdf_avx512(x);
    const __m512 pdf =
        _mm512_mul_ps(_mm512_set1_ps(kInvSqrt2Pi),
                      exp_ps(_mm512_mul_ps(_mm512_set1_ps(-0.5f), _mm512_mul_ps(x, x))));
    _mm512_mask_storeu_ps(
        dinp + i, m,
        _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dout + i), _mm512_fmadd_ps(x, pdf, cdf)));
  }
}

BT_AVX512 void dropout_avx512(float* dx, const float* dy, int64_t b, int64_t e, float p,
                              uint64_t key, uint64_t offset) {
  using namespace simd;
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = tail_mask(e - i);
    _mm512_mask_storeu_ps(dx + i, m,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dy + i),
                                        dropout_scale16(p, scale, key, offset + i)));
  }
}

// The AVX2 twins: 8 lanes, the same formulas (exp8/erf8 give exp_ps/erf_ps's bits).
BT_AVX2 inline __m256 gelu_cdf_avx2(__m256 x) {
  return _mm256_fmadd_ps(_mm256_set1_ps(0.5f),
                         simd::erf8(_mm256_mul_ps(x, _mm256_set1_ps(kInvSqrt2))),
                         _mm256_set1_ps(0.5f));
}

BT_AVX2 void gelu_forward_avx2(float* out, const float* inp, int64_t b, int64_t e) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 8) {
    const __m256 x = load8(inp + i, e - i);
    store8(out + i, e - i, _mm256_mul_ps(x, gelu_cdf_avx2(x)));
  }
}

BT_AVX2 void gelu_backward_avx2(float* dinp, const float* inp, const float* dout, int64_t b,
                                int64_t e) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 8) {
    const __m256 x = load8(inp + i, e - i);
    const __m256 pdf =
        _mm256_mul_ps(_mm256_set1_ps(kInvSqrt2Pi),
                      exp8(_mm256_mul_ps(_mm256_set1_ps(-0.5f), _mm256_mul_ps(x, x))));
    store8(dinp + i, e - i,
           _mm256_mul_ps(load8(dout + i, e - i), _mm256_fmadd_ps(x, pdf, gelu_cdf_avx2(x))));
  }
}

BT_AVX2 void dropout_avx2(float* dx, const float* dy, int64_t b, int64_t e, float p, uint64_t key,
                          uint64_t offset) {
  using namespace simd;
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = b; i < e; i += 8)
    store8(dx + i, e - i,
           _mm256_mul_ps(load8(dy + i, e - i), dropout_scale8(p, scale, key, offset + i)));
}

}  // namespace

namespace {
constexpr int64_t kBlock = 4096;  // elements per stack block in the bf16 activation passes

// One thread's share (no OpenMP), the portable formulas.
void activation_forward_serial(Activation a, float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    switch (a) {
      case Activation::GeluErf:
        out[i] = 0.5f * x * (1.0f + std::erf(x * kInvSqrt2));
        break;
      case Activation::GeluTanh:
        out[i] = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
        break;
      case Activation::Relu:
        out[i] = x > 0.0f ? x : 0.0f;
        break;
    }
  }
}
void activation_backward_serial(Activation a, float* dinp, const float* inp, const float* dout,
                                int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    switch (a) {
      case Activation::GeluErf:
        dinp[i] = dout[i] * (0.5f * (1.0f + std::erf(x * kInvSqrt2)) +
                             x * (kInvSqrt2Pi * std::exp(-0.5f * x * x)));
        break;
      case Activation::GeluTanh: {
        const float t = std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x));
        const float du = kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] = dout[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
        break;
      }
      case Activation::Relu:
        dinp[i] = x > 0.0f ? dout[i] : 0.0f;
        break;
    }
  }
}
}  // namespace

void activation_forward(Activation a, float* out, const float* inp, int64_t n) {
  if (a == Activation::GeluErf && use_avx512())
    return parallel_chunks(n, [&](int64_t b, int64_t e) { gelu_forward_avx512(out, inp, b, e); });
  if (a == Activation::GeluErf && use_avx2())
    return parallel_chunks(n, [&](int64_t b, int64_t e) { gelu_forward_avx2(out, inp, b, e); });
  parallel_chunks(
      n, [&](int64_t b, int64_t e) { activation_forward_serial(a, out + b, inp + b, e - b); });
}

void activation_forward_bf16(Activation a, uint16_t* out16, const float* inp, int64_t n,
                             uint16_t* inp16) {
  if (a == Activation::GeluErf && use_avx512()) {
    parallel_chunks(
        n, [&](int64_t b, int64_t e) { gelu_forward_bf16_avx512(out16, inp16, inp, b, e); });
    return;
  }
  // Other activations and CPUs: the fp32 activation (activation_forward's body) in blocks,
  // then rounded.
  const bool avx2 = a == Activation::GeluErf && use_avx2();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    float tmp[kBlock];
    const int64_t k = std::min<int64_t>(kBlock, n - b);
    if (avx2)
      gelu_forward_avx2(tmp, inp + b, 0, k);
    else
      activation_forward_serial(a, tmp, inp + b, k);
    for (int64_t i = 0; i < k; ++i) out16[b + i] = f32_to_bf16(tmp[i]);
    if (inp16)
      for (int64_t i = 0; i < k; ++i) inp16[b + i] = f32_to_bf16(inp[b + i]);
  }
}

namespace {
// activation_forward's / activation_backward's body for this CPU on one block (no OpenMP).
void forward_block(Activation a, float* out, const float* inp, int64_t k) {
  if (a == Activation::GeluErf && use_avx512()) return gelu_forward_avx512(out, inp, 0, k);
  if (a == Activation::GeluErf && use_avx2()) return gelu_forward_avx2(out, inp, 0, k);
  activation_forward_serial(a, out, inp, k);
}
void backward_block(Activation a, float* dinp, const float* inp, const float* dout, int64_t k) {
  if (a == Activation::GeluErf && use_avx512()) return gelu_backward_avx512(dinp, inp, dout, 0, k);
  if (a == Activation::GeluErf && use_avx2()) return gelu_backward_avx2(dinp, inp, dout, 0, k);
  activation_backward_serial(a, dinp, inp, dout, k);
}

// The backward at 16-bit inputs: blocks widened to fp32 on the stack (widen(src, dst, k)).
template <typename Widen>
void activation_backward_widened(Activation a, float* dinp, const uint16_t* inp16,
                                 const float* dout, int64_t n, Widen widen) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    float x[kBlock];
    const int64_t k = std::min<int64_t>(kBlock, n - b);
    widen(inp16 + b, x, k);
    backward_block(a, dinp + b, x, dout + b, k);
  }
}
}  // namespace

void activation_backward_bf16(Activation a, float* dinp, const uint16_t* inp16, const float* dout,
                              int64_t n) {
  activation_backward_widened(a, dinp, inp16, dout, n, [](const uint16_t* h, float* x, int64_t k) {
    for (int64_t i = 0; i < k; ++i) x[i] = bf16_to_f32(h[i]);
  });
}

void activation_forward_f16(Activation a, float* out, uint16_t* out16, const float* inp,
                            uint16_t* inp16, int64_t n) {
  // Per stack block: the input rounded (bits kept), the activation of the rounded values, the
  // result rounded (bits kept) and widened into out. F16C conversions where the CPU has them.
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    float x[kBlock], y[kBlock];
    const size_t k = static_cast<size_t>(std::min<int64_t>(kBlock, n - b));
    convert_f32_to_f16(inp + b, inp16 + b, k);
    convert_f16_to_f32(inp16 + b, x, k);
    forward_block(a, y, x, static_cast<int64_t>(k));
    convert_f32_to_f16(y, out16 + b, k);
    convert_f16_to_f32(out16 + b, out + b, k);
  }
}

void activation_backward_f16(Activation a, float* dinp, const uint16_t* inp16, const float* dout,
                             int64_t n) {
  activation_backward_widened(a, dinp, inp16, dout, n, [](const uint16_t* h, float* x, int64_t k) {
    convert_f16_to_f32(h, x, static_cast<size_t>(k));
  });
}

void activation_backward(Activation a, float* dinp, const float* inp, const float* dout,
                         int64_t n) {
  // GELU: d/dx [x Phi(x)] = Phi(x) + x phi(x)
  if (a == Activation::GeluErf && use_avx512())
    return parallel_chunks(
        n, [&](int64_t b, int64_t e) { gelu_backward_avx512(dinp, inp, dout, b, e); });
  if (a == Activation::GeluErf && use_avx2())
    return parallel_chunks(
        n, [&](int64_t b, int64_t e) { gelu_backward_avx2(dinp, inp, dout, b, e); });
  parallel_chunks(n, [&](int64_t b, int64_t e) {
    activation_backward_serial(a, dinp + b, inp + b, dout + b, e - b);
  });
}

void round_to_f16(float* out, const float* x, int64_t n, uint16_t* bits16) {
  // Blocks small enough that the round trip stays in L1 (F16C where the CPU has it).
  parallel_chunks(n, [&](int64_t b, int64_t e) {
    uint16_t tmp[kBlock];
    for (int64_t i = b; i < e; i += kBlock) {
      const size_t k = static_cast<size_t>(std::min<int64_t>(kBlock, e - i));
      uint16_t* h = bits16 ? bits16 + i : tmp;
      convert_f32_to_f16(x + i, h, k);
      convert_f16_to_f32(h, out + i, k);
    }
  });
}

void widen_f16(float* out, const uint16_t* bits16, int64_t n) {
  parallel_chunks(n, [&](int64_t b, int64_t e) {
    convert_f16_to_f32(bits16 + b, out + b, static_cast<size_t>(e - b));
  });
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
  if (use_avx512())
    return parallel_chunks(
        n, [&](int64_t b, int64_t e) { dropout_avx512(x, x, b, e, p, key, offset); });
  if (use_avx2())
    return parallel_chunks(n,
                           [&](int64_t b, int64_t e) { dropout_avx2(x, x, b, e, p, key, offset); });
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
  if (use_avx512())
    return parallel_chunks(
        n, [&](int64_t b, int64_t e) { dropout_avx512(dx, dy, b, e, p, key, offset); });
  if (use_avx2())
    return parallel_chunks(
        n, [&](int64_t b, int64_t e) { dropout_avx2(dx, dy, b, e, p, key, offset); });
  const float scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dx[i] = dropout_keep(p, key, offset + i) ? dy[i] * scale : 0.0f;
}

}  // namespace bertrain::kernels
