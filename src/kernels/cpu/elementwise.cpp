#include "kernels/cpu/elementwise.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "core/isa.h"
#include "core/parallel.h"
#include "core/simd_avx2.h"
#include "core/simd_avx512.h"
#include "kernels/row_math.h"

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

BT_AVX512 void gelu_forward(isa::Avx512, float* out, const float* inp, int64_t b, int64_t e) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = tail_mask(e - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, inp + i);
    const __m512 cdf = gelu_cdf_avx512(x);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(x, cdf));
  }
}

BT_AVX512 void gelu_forward_bf16(isa::Avx512, uint16_t* out, uint16_t* inp16, const float* inp,
                                 int64_t b, int64_t e) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = tail_mask(e - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, inp + i);
    const __m512 cdf = gelu_cdf_avx512(x);
    _mm256_mask_storeu_epi16(out + i, m, f32_to_bf16_16(_mm512_mul_ps(x, cdf)));
    if (inp16) _mm256_mask_storeu_epi16(inp16 + i, m, f32_to_bf16_16(x));
  }
}

BT_AVX512 void gelu_backward(isa::Avx512, float* dinp, const float* inp, const float* dout,
                             int64_t b, int64_t e) {
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

BT_AVX512 void dropout_rows(isa::Avx512, float* dx, const float* dy, int64_t b, int64_t e, float p,
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

BT_AVX2 void gelu_forward(isa::Avx2, float* out, const float* inp, int64_t b, int64_t e) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 8) {
    const __m256 x = load8(inp + i, e - i);
    store8(out + i, e - i, _mm256_mul_ps(x, gelu_cdf_avx2(x)));
  }
}

BT_AVX2 void gelu_backward(isa::Avx2, float* dinp, const float* inp, const float* dout, int64_t b,
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

BT_AVX2 void dropout_rows(isa::Avx2, float* dx, const float* dy, int64_t b, int64_t e, float p,
                          uint64_t key, uint64_t offset) {
  using namespace simd;
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = b; i < e; i += 8)
    store8(dx + i, e - i,
           _mm256_mul_ps(load8(dy + i, e - i), dropout_scale8(p, scale, key, offset + i)));
}

}  // namespace

namespace {
constexpr int64_t kBlock = 4096;  // elements per stack block in the 16-bit activation passes

// One thread's share (no OpenMP), the portable formulas (kernels/row_math.h: the GPU's too).
void activation_forward_serial(Activation a, float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = row_math::activation(a, inp[i]);
}
void activation_backward_serial(Activation a, float* dinp, const float* inp, const float* dout,
                                int64_t n) {
  for (int64_t i = 0; i < n; ++i) dinp[i] = row_math::activation_grad(a, inp[i], dout[i]);
}
// GELU's portable bodies: activation_*_serial's formulas (the vector bodies are above).
void gelu_forward(isa::Portable, float* out, const float* inp, int64_t b, int64_t e) {
  activation_forward_serial(Activation::GeluErf, out + b, inp + b, e - b);
}
void gelu_backward(isa::Portable, float* dinp, const float* inp, const float* dout, int64_t b,
                   int64_t e) {
  activation_backward_serial(Activation::GeluErf, dinp + b, inp + b, dout + b, e - b);
}
void dropout_rows(isa::Portable, float* dx, const float* dy, int64_t b, int64_t e, float p,
                  uint64_t key, uint64_t offset) {
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = b; i < e; ++i) dx[i] = dropout_keep(p, key, offset + i) ? dy[i] * scale : 0.0f;
}

// The activation on [b, e) on one thread, the ISA's GELU body or the portable formulas.
template <typename Tag>
void forward_rows(Tag tag, Activation a, float* out, const float* inp, int64_t b, int64_t e) {
  if (a == Activation::GeluErf) return gelu_forward(tag, out, inp, b, e);
  activation_forward_serial(a, out + b, inp + b, e - b);
}
template <typename Tag>
void backward_rows(Tag tag, Activation a, float* dinp, const float* inp, const float* dout,
                   int64_t b, int64_t e) {
  // GELU: d/dx [x Phi(x)] = Phi(x) + x phi(x)
  if (a == Activation::GeluErf) return gelu_backward(tag, dinp, inp, dout, b, e);
  activation_backward_serial(a, dinp + b, inp + b, dout + b, e - b);
}

// One block of the bf16 forward: the fp32 activation on the stack, rounded; inp16 (if non-null)
// gets the input's bf16 bits. AVX-512 computes GELU straight into bf16 (below).
template <typename Tag>
void forward_bf16_block(Tag tag, Activation a, uint16_t* out16, uint16_t* inp16, const float* inp,
                        int64_t k) {
  float tmp[kBlock];
  forward_rows(tag, a, tmp, inp, 0, k);
  for (int64_t i = 0; i < k; ++i) out16[i] = f32_to_bf16(tmp[i]);
  if (inp16)
    for (int64_t i = 0; i < k; ++i) inp16[i] = f32_to_bf16(inp[i]);
}
void forward_bf16_block(isa::Avx512 tag, Activation a, uint16_t* out16, uint16_t* inp16,
                        const float* inp, int64_t k) {
  if (a == Activation::GeluErf) return gelu_forward_bf16(tag, out16, inp16, inp, 0, k);
  forward_bf16_block<isa::Avx512>(tag, a, out16, inp16, inp, k);
}

// The backward at 16-bit inputs: blocks widened to fp32 on the stack (widen(src, dst, k)).
template <typename Widen>
void activation_backward_widened(Activation a, float* dinp, const uint16_t* inp16,
                                 const float* dout, int64_t n, Widen widen) {
  with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; b += kBlock) {
      float x[kBlock];
      const int64_t k = std::min<int64_t>(kBlock, n - b);
      widen(inp16 + b, x, k);
      backward_rows(tag, a, dinp + b, x, dout + b, 0, k);
    }
  });
}

}  // namespace

void activation_forward(Activation a, float* out, const float* inp, int64_t n) {
  with_isa([&](auto tag) {
    parallel_chunks(n, [&](int64_t b, int64_t e) { forward_rows(tag, a, out, inp, b, e); });
  });
}

void activation_backward(Activation a, float* dinp, const float* inp, const float* dout,
                         int64_t n) {
  with_isa([&](auto tag) {
    parallel_chunks(n, [&](int64_t b, int64_t e) { backward_rows(tag, a, dinp, inp, dout, b, e); });
  });
}

namespace {

void forward_bf16(Activation a, uint16_t* out16, const float* inp, int64_t n, uint16_t* inp16) {
  with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; b += kBlock)
      forward_bf16_block(tag, a, out16 + b, inp16 ? inp16 + b : nullptr, inp + b,
                         std::min<int64_t>(kBlock, n - b));
  });
}

void backward_bf16(Activation a, float* dinp, const uint16_t* inp16, const float* dout, int64_t n) {
  activation_backward_widened(a, dinp, inp16, dout, n, [](const uint16_t* h, float* x, int64_t k) {
    for (int64_t i = 0; i < k; ++i) x[i] = bf16_to_f32(h[i]);
  });
}

void forward_f16(Activation a, float* out, uint16_t* out16, const float* inp, uint16_t* inp16,
                 int64_t n) {
  // Per stack block: the input rounded (bits kept), the activation of the rounded values, the
  // result rounded (bits kept) and widened into out where given (products reading fp32, a
  // CPU's; fp16 operands read the bits alone). F16C conversions where the CPU has it.
  with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; b += kBlock) {
      float x[kBlock], y[kBlock];
      const size_t k = static_cast<size_t>(std::min<int64_t>(kBlock, n - b));
      convert_f32_to_f16(inp + b, inp16 + b, k);
      convert_f16_to_f32(inp16 + b, x, k);
      forward_rows(tag, a, y, x, 0, static_cast<int64_t>(k));
      convert_f32_to_f16(y, out16 + b, k);
      if (out) convert_f16_to_f32(out16 + b, out + b, k);
    }
  });
}

void backward_f16(Activation a, float* dinp, const uint16_t* inp16, const float* dout, int64_t n) {
  activation_backward_widened(a, dinp, inp16, dout, n, [](const uint16_t* h, float* x, int64_t k) {
    convert_f16_to_f32(h, x, static_cast<size_t>(k));
  });
}

}  // namespace

void activation_forward(Precision p, Activation a, Kept out, Kept in, int64_t n) {
  switch (p) {
    case Precision::FP32:
      return activation_forward(a, out.f32, in.f32, n);
    case Precision::BF16:
      return forward_bf16(a, out.bits, in.f32, n, in.bits);
    case Precision::FP16:
      return forward_f16(a, out.f32, out.bits, in.f32, in.bits, n);
  }
}

void activation_backward(Precision p, Activation a, float* dinp, Kept in, const float* dout,
                         int64_t n) {
  switch (p) {
    case Precision::FP32:
      return activation_backward(a, dinp, in.f32, dout, n);
    case Precision::BF16:
      return backward_bf16(a, dinp, in.bits, dout, n);
    case Precision::FP16:
      return backward_f16(a, dinp, in.bits, dout, n);
  }
}

void keep(Precision p, Kept x, int64_t n) {
  if (p == Precision::BF16) convert_f32_to_bf16(x.f32, x.bits, static_cast<size_t>(n));
  if (p == Precision::FP16) round_to_f16(x.f32, x.f32, n, x.bits);
}

void copy_weights(Precision p, const float* master, uint16_t* copy, int64_t n) {
  if (p == Precision::BF16) convert_f32_to_bf16(master, copy, static_cast<size_t>(n));
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

void dropout_forward(float* x, int64_t n, const Dropout& d) {
  BT_CHECK(!d.rows, "dropout_forward: a row map needs the row width (N rows of C)");
  const float p = d.p;
  const Dropout at = resolved(d);  // (the step's arguments' key and offset, where given)
  const uint64_t key = at.key, offset = at.offset;
  if (p <= 0.0f) return;
  with_isa([&](auto tag) {
    parallel_chunks(n,
                    [&](int64_t b, int64_t e) { dropout_rows(tag, x, x, b, e, p, key, offset); });
  });
}

void dropout_backward(float* dx, const float* dy, int64_t n, const Dropout& d) {
  BT_CHECK(!d.rows, "dropout_backward: a row map needs the row width (N rows of C)");
  const float p = d.p;
  const Dropout at = resolved(d);  // (the step's arguments' key and offset, where given)
  const uint64_t key = at.key, offset = at.offset;
  if (p <= 0.0f) {
    if (dx != dy)
      for (int64_t i = 0; i < n; ++i) dx[i] = dy[i];
    return;
  }
  with_isa([&](auto tag) {
    parallel_chunks(n,
                    [&](int64_t b, int64_t e) { dropout_rows(tag, dx, dy, b, e, p, key, offset); });
  });
}

void dropout_backward(float* dx, const float* dy, int64_t N, int64_t C, const Dropout& d) {
  if (!d.rows || d.p <= 0.0f) {
    Dropout flat = d;
    flat.rows = nullptr;
    return dropout_backward(dx, dy, N * C, flat);
  }
  // Row r drawing as row rows[r]: a flat pass of its own in one thread, the rows spread over the
  // threads.
  const Dropout at = resolved(d);
  with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; ++r)
      dropout_rows(tag, dx + r * C, dy + r * C, 0, C, at.p, at.key,
                   at.offset + static_cast<uint64_t>(at.rows[r]) * static_cast<uint64_t>(C));
  });
}

void dropout_forward(float* x, int64_t N, int64_t C, const Dropout& d) {
  dropout_backward(x, x, N, C, d);  // (the same mask, in place)
}

}  // namespace bertrain::kernels
