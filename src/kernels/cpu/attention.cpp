#include "kernels/cpu/attention.h"

#include <omp.h>
#include <algorithm>

#include <cmath>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/isa.h"
#include "core/simd_avx2.h"
#include "core/simd_avx512.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/scratch.h"

namespace bertrain::kernels {

void attention_forward_reference(float* ctx, float* probs, const float* qkv, const int32_t* mask,
                                 const AttentionShape& s, float dropout_p, uint64_t key,
                                 uint64_t offset) {
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, HD = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
#pragma omp parallel
  {
    std::vector<float> row(T);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h) {
        const float* base = qkv + b * T * C3 + h * HD;
        for (int64_t i = 0; i < T; ++i) {
          const float* q = base + i * C3;
          float mx = -INFINITY;
          for (int64_t j = 0; j < T; ++j) {
            const float* k = base + j * C3 + C;
            float d = 0.0f;
#pragma omp simd reduction(+ : d)
            for (int64_t e = 0; e < HD; ++e) d += q[e] * k[e];
            d = d * scale + (mask[b * T + j] ? 0.0f : -10000.0f);
            row[j] = d;
            mx = std::max(mx, d);
          }
          float sum = 0.0f;
          for (int64_t j = 0; j < T; ++j) {
            row[j] = std::exp(row[j] - mx);
            sum += row[j];
          }
          const float inv = 1.0f / sum;
          float* p = probs + ((b * NH + h) * T + i) * T;
          float* o = ctx + (b * T + i) * C + h * HD;
          for (int64_t e = 0; e < HD; ++e) o[e] = 0.0f;
          const uint64_t idx0 = offset + s.dropout_row(b * NH + h, i);
          for (int64_t j = 0; j < T; ++j) {
            p[j] = row[j] * inv;
            float w = p[j];
            if (dropout_p > 0.0f)
              w = dropout_keep(dropout_p, key, idx0 + j) ? w * keep_scale : 0.0f;
            const float* v = base + j * C3 + 2 * C;
#pragma omp simd
            for (int64_t e = 0; e < HD; ++e) o[e] += w * v[e];
          }
        }
      }
  }
}

void attention_backward_reference(float* dqkv, const float* dctx, const float* qkv,
                                  const float* probs, const AttentionShape& s, float dropout_p,
                                  uint64_t key, uint64_t offset) {
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, HD = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
#pragma omp parallel
  {
    std::vector<float> dp(T);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h) {
        const float* base = qkv + b * T * C3 + h * HD;
        float* dbase = dqkv + b * T * C3 + h * HD;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t e = 0; e < HD; ++e) {
            dbase[t * C3 + e] = 0.0f;
            dbase[t * C3 + C + e] = 0.0f;
            dbase[t * C3 + 2 * C + e] = 0.0f;
          }
        for (int64_t i = 0; i < T; ++i) {
          const float* p = probs + ((b * NH + h) * T + i) * T;
          const float* dy = dctx + (b * T + i) * C + h * HD;
          const uint64_t idx0 = offset + s.dropout_row(b * NH + h, i);
          // dV[j] += pd[i,j] dy ; dpd[i,j] = dy . V[j] ; dp = dpd * mask/(1-p)
          float dot = 0.0f;
          for (int64_t j = 0; j < T; ++j) {
            bool keep = dropout_p <= 0.0f || dropout_keep(dropout_p, key, idx0 + j);
            float m = keep ? keep_scale : 0.0f;
            const float* v = base + j * C3 + 2 * C;
            float* dv = dbase + j * C3 + 2 * C;
            float w = p[j] * m;
            float d = 0.0f;
#pragma omp simd reduction(+ : d)
            for (int64_t e = 0; e < HD; ++e) {
              d += dy[e] * v[e];
              dv[e] += w * dy[e];
            }
            dp[j] = d * m;
            dot += dp[j] * p[j];
          }
          // softmax backward, then through the scaled dot product
          const float* q = base + i * C3;
          float* dq = dbase + i * C3;
          for (int64_t j = 0; j < T; ++j) {
            float ds = p[j] * (dp[j] - dot) * scale;
            if (ds == 0.0f) continue;
            const float* k = base + j * C3 + C;
            float* dk = dbase + j * C3 + C;
#pragma omp simd
            for (int64_t e = 0; e < HD; ++e) {
              dq[e] += ds * k[e];
              dk[e] += ds * q[e];
            }
          }
        }
      }
  }
}

// ---- The fast path: oneDNN batched matmuls over the heads of one sequence (strides read the
// heads straight out of the QKV rows and write ctx in place, no transposes), and one fused
// pass per score row for mask + softmax + dropout (forward) or dropout + softmax backward.
// With bf16 the matmul operands are bf16 (fp32 accumulation): the row passes write the dropped
// probabilities and dS straight in bf16; scores and sums stay fp32, and the saved probabilities
// too unless the caller asks for them in bf16 (AttentionBf16::saved). fp32 operands may keep
// the saved probabilities in fp16 (saved_f16).

namespace {

using rows::get;
using rows::get16;
using rows::put;
using rows::put16;

// Forward row: s[j] (scaled scores) + bias[j] -> softmax, saved in s, or rounded to bf16 / fp16
// (S) in saved when non-null (the dropped row is then made from the rounded values, as backward
// regenerates it); the dropped row (keep / (1 - p) or 0 per element; the row itself when
// p == 0) goes to out if non-null. out may be s.
template <typename O, typename S>
void softmax_row(isa::Portable, float* s, S* saved, const float* bias, O* out, int64_t T, float p,
                 float keep_scale, uint64_t key, uint64_t idx0) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < T; ++j) {
    s[j] += bias[j];
    mx = std::max(mx, s[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < T; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < T; ++j) s[j] *= inv;
  if (saved)
    for (int64_t j = 0; j < T; ++j) {
      put(saved + j, s[j]);
      s[j] = get(saved + j);
    }
  if (out)
    for (int64_t j = 0; j < T; ++j)
      put(out + j, p <= 0.0f ? s[j] : dropout_keep(p, key, idx0 + j) ? s[j] * keep_scale : 0.0f);
}

template <typename O, typename S>
BT_AVX512 void softmax_row(isa::Avx512, float* s, S* saved, const float* bias, O* out, int64_t T,
                           float p, float keep_scale, uint64_t key, uint64_t idx0) {
  using namespace simd;
  __m512 vmx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    __m512 x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_maskz_loadu_ps(m, bias + j));
    _mm512_mask_storeu_ps(s + j, m, x);
    vmx = _mm512_mask_max_ps(vmx, m, vmx, x);
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mx));
    _mm512_mask_storeu_ps(s + j, m, e);
    vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv);
    if (saved) {
      put16(saved + j, m, y);
      y = get16(saved + j, m);
    } else {
      _mm512_mask_storeu_ps(s + j, m, y);
    }
    if (out)
      put16(out + j, m,
            p <= 0.0f ? y : _mm512_mul_ps(y, dropout_scale16(p, keep_scale, key, idx0 + j)));
  }
}

// Backward row: g[j] = dL/d(dropped prob) in; ds[j] = dL/d(scaled score) * scale out (ds may
// be g itself).
template <typename O, typename P>
void softmax_backward_row(isa::Portable, float* g, O* ds, const P* prob, int64_t T, float p,
                          float keep_scale, uint64_t key, uint64_t idx0, float scale) {
  float dot = 0.0f;
  for (int64_t j = 0; j < T; ++j) {
    if (p > 0.0f) g[j] = dropout_keep(p, key, idx0 + j) ? g[j] * keep_scale : 0.0f;
    dot += g[j] * get(prob + j);
  }
  for (int64_t j = 0; j < T; ++j) put(ds + j, get(prob + j) * (g[j] - dot) * scale);
}

template <typename O, typename P>
BT_AVX512 void softmax_backward_row(isa::Avx512, float* g, O* ds, const P* prob, int64_t T, float p,
                                    float keep_scale, uint64_t key, uint64_t idx0, float scale) {
  using namespace simd;
  __m512 vdot = _mm512_setzero_ps();
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    __m512 x = _mm512_maskz_loadu_ps(m, g + j);
    if (p > 0.0f) {
      x = _mm512_mul_ps(x, dropout_scale16(p, keep_scale, key, idx0 + j));
      _mm512_mask_storeu_ps(g + j, m, x);
    }
    vdot = _mm512_fmadd_ps(x, get16(prob + j, m), vdot);
  }
  const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(vdot)), vs = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    const __m512 y = _mm512_mul_ps(
        _mm512_mul_ps(get16(prob + j, m), _mm512_sub_ps(_mm512_maskz_loadu_ps(m, g + j), dot)), vs);
    put16(ds + j, m, y);
  }
}

// Regenerates the dropped row (the row itself when p == 0) from the saved probabilities.
template <typename O, typename P>
void dropout_row(isa::Portable, O* out, const P* prob, int64_t T, float p, float keep_scale,
                 uint64_t key, uint64_t idx0) {
  for (int64_t j = 0; j < T; ++j)
    put(out + j, p <= 0.0f                        ? get(prob + j)
                 : dropout_keep(p, key, idx0 + j) ? get(prob + j) * keep_scale
                                                  : 0.0f);
}

template <typename O, typename P>
BT_AVX512 void dropout_row(isa::Avx512, O* out, const P* prob, int64_t T, float p, float keep_scale,
                           uint64_t key, uint64_t idx0) {
  using namespace simd;
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    const __m512 x = get16(prob + j, m);
    put16(out + j, m,
          p <= 0.0f ? x : _mm512_mul_ps(x, dropout_scale16(p, keep_scale, key, idx0 + j)));
  }
}

// The AVX2 twins, fp32 operands only (bf16 operands need AVX-512: matmul.h); saved
// probabilities in fp32 or fp16.
BT_AVX2 void softmax_row_avx2(float* s, rows::F16* saved, const float* bias, float* out, int64_t T,
                              float p, float keep_scale, uint64_t key, uint64_t idx0) {
  using namespace simd;
  __m256 vmx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < T; j += 8) {
    const __m256 x = _mm256_add_ps(load8(s + j, T - j), load8(bias + j, T - j));
    store8(s + j, T - j, x);
    vmx = _mm256_max_ps(
        vmx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, _mm256_castsi256_ps(tail8(T - j))));
  }
  const __m256 mx = _mm256_set1_ps(hmax8(vmx));
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < T; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(load8_or(s + j, T - j, -INFINITY), mx));  // 0 past T
    store8(s + j, T - j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum8(vsum));
  for (int64_t j = 0; j < T; j += 8) {
    __m256 y = _mm256_mul_ps(load8(s + j, T - j), inv);
    if (saved) y = rows::round8(saved + j, T - j, y);
    store8(s + j, T - j, y);
    if (out)
      store8(out + j, T - j,
             p <= 0.0f ? y : _mm256_mul_ps(y, dropout_scale8(p, keep_scale, key, idx0 + j)));
  }
}

template <typename P>
BT_AVX2 void softmax_backward_row_avx2(float* g, float* ds, const P* prob, int64_t T, float p,
                                       float keep_scale, uint64_t key, uint64_t idx0, float scale) {
  using namespace simd;
  __m256 vdot = _mm256_setzero_ps();
  for (int64_t j = 0; j < T; j += 8) {
    __m256 x = load8(g + j, T - j);
    if (p > 0.0f) {
      x = _mm256_mul_ps(x, dropout_scale8(p, keep_scale, key, idx0 + j));
      store8(g + j, T - j, x);
    }
    vdot = _mm256_fmadd_ps(x, rows::get8(prob + j, T - j), vdot);
  }
  const __m256 dot = _mm256_set1_ps(hsum8(vdot)), vs = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < T; j += 8) {
    const __m256 y = _mm256_mul_ps(
        _mm256_mul_ps(rows::get8(prob + j, T - j), _mm256_sub_ps(load8(g + j, T - j), dot)), vs);
    store8(ds + j, T - j, y);
  }
}

template <typename P>
BT_AVX2 void dropout_row_avx2(float* out, const P* prob, int64_t T, float p, float keep_scale,
                              uint64_t key, uint64_t idx0) {
  using namespace simd;
  for (int64_t j = 0; j < T; j += 8) {
    const __m256 x = rows::get8(prob + j, T - j);
    store8(out + j, T - j,
           p <= 0.0f ? x : _mm256_mul_ps(x, dropout_scale8(p, keep_scale, key, idx0 + j)));
  }
}

// The AVX2 rows for what they cover (fp32 operands; fp16 or no saved probabilities; saved
// probabilities in fp32 or fp16 for backward); other operands take the portable rows.
template <typename S>
void softmax_row(isa::Avx2, float* s, S* saved, const float* bias, float* out, int64_t T, float p,
                 float keep_scale, uint64_t key, uint64_t idx0) {
  if constexpr (std::is_same_v<S, rows::F16>)
    return softmax_row_avx2(s, saved, bias, out, T, p, keep_scale, key, idx0);
  else if (!saved)
    return softmax_row_avx2(s, nullptr, bias, out, T, p, keep_scale, key, idx0);
  softmax_row(isa::Portable{}, s, saved, bias, out, T, p, keep_scale, key, idx0);
}

template <typename P>
void softmax_backward_row(isa::Avx2, float* g, float* ds, const P* prob, int64_t T, float p,
                          float keep_scale, uint64_t key, uint64_t idx0, float scale) {
  if constexpr (std::is_same_v<P, uint16_t>)
    softmax_backward_row(isa::Portable{}, g, ds, prob, T, p, keep_scale, key, idx0, scale);
  else
    softmax_backward_row_avx2(g, ds, prob, T, p, keep_scale, key, idx0, scale);
}

template <typename P>
void dropout_row(isa::Avx2, float* out, const P* prob, int64_t T, float p, float keep_scale,
                 uint64_t key, uint64_t idx0) {
  if constexpr (std::is_same_v<P, uint16_t>)
    dropout_row(isa::Portable{}, out, prob, T, p, keep_scale, key, idx0);
  else
    dropout_row_avx2(out, prob, T, p, keep_scale, key, idx0);
}

// Products over the NH heads (strides sa, sb, sc) of all B sequences (strides oa, ob, oc) in one
// oneDNN call, fp32 or bf16 operands.
struct HeadGemm {
  int64_t B, NH;
  template <typename X>
  void operator()(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const X* A,
                  int64_t lda, int64_t sa, int64_t oa, const X* Bm, int64_t ldb, int64_t sb,
                  int64_t ob, float* C, int64_t ldc, int64_t sc, int64_t oc) const {
    const OuterBatch outer{B, oa, ob, oc};
    if constexpr (std::is_same_v<X, float>)
      gemm_batched(NH, ta, tb, M, N, K, alpha, A, lda, sa, Bm, ldb, sb, C, ldc, sc, outer);
    else
      gemm_batched(NH, ta, tb, M, N, K, alpha, A, lda, sa, Bm, ldb, sb, C, ldc, sc, outer);
  }
};

// scores: fp32 [B,NH,T,T], the saved probabilities too unless saved (bf16 or fp16, S) is given.
// dropped may be scores (in place).
template <typename X, typename S>
void forward_impl(float* ctx, float* scores, S* saved, X* dropped, const X* qkv,
                  const int32_t* mask, const AttentionShape& s, float dropout_p, uint64_t key,
                  uint64_t offset) {
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, HD = C / NH, C3 = 3 * C, TT = T * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
  const HeadGemm gemm{B, NH};
  const int64_t sq = T * C3, sp = NH * TT, sctx = T * C;  // per-sequence strides
  // probs = scale * Q K^T over every sequence and head (head h: columns h*HD of Q and K).
  gemm(false, true, T, T, HD, scale, qkv, C3, HD, sq, qkv + C, C3, HD, sq, scores, T, TT, sp);
  const bool query = GemmScratchQuery::active();  // attention_scratch: the products only
  // The additive mask row: each thread's part of the kernel scratch.
  const ScratchBlock rows =
      query ? ScratchBlock{} : scratch_block(ScratchPart::MaskRow, T * 4, omp_get_max_threads());
  if (!query)
    with_isa([&](auto tag) {
#pragma omp parallel
      {
        float* bias = rows.as<float>(omp_get_thread_num());
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * NH; ++bh) {
          const int64_t b = bh / NH;
          for (int64_t j = 0; j < T; ++j) bias[j] = mask[b * T + j] ? 0.0f : -10000.0f;
          for (int64_t i = 0; i < T; ++i) {
            const int64_t r = (bh * T + i) * T;
            X* out = dropped ? dropped + r : nullptr;
            const uint64_t idx0 = offset + s.dropout_row(bh, i);
            softmax_row(tag, scores + r, saved ? saved + r : nullptr, bias, out, T, dropout_p,
                        keep_scale, key, idx0);
          }
        }
      }
    });
  // ctx[b, :, h*HD:(h+1)*HD] = dropped probs · V_h
  const X* pd = dropped;
  if constexpr (std::is_same_v<X, float>)
    if (!pd) pd = scores;
  gemm(false, false, T, HD, T, 1.0f, pd, T, TT, sp, qkv + 2 * C, C3, HD, sq, ctx, C, HD, sctx);
}

// work: fp32 [B,NH,T,T]; pd: the dropped probabilities and then dS, in X (may be work).
// probs: the saved probabilities, fp32, bf16 or fp16 (P).
template <typename X, typename P>
void backward_impl(float* dqkv, float* work, X* pd, const X* dctx, const X* qkv, const P* probs,
                   const AttentionShape& s, float dropout_p, uint64_t key, uint64_t offset) {
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, HD = C / NH, C3 = 3 * C, TT = T * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
  const HeadGemm gemm{B, NH};
  const int64_t sq = T * C3, sp = NH * TT, sctx = T * C;  // per-sequence strides
  // dV = dropped^T · dctx (the dropped probabilities regenerated into pd).
  const X* dropped = pd;
  if constexpr (std::is_same_v<X, P>)
    if (dropout_p <= 0.0f) dropped = probs;       // without dropout the saved row is the operand
  const bool query = GemmScratchQuery::active();  // attention_scratch: the products only
  if (dropped == pd && !query)
    with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < B * NH * T; ++r) {
        const uint64_t idx0 = offset + s.dropout_row(r / T, r % T);
        dropout_row(tag, pd + r * T, probs + r * T, T, dropout_p, keep_scale, key, idx0);
      }
    });
  gemm(true, false, T, HD, T, 1.0f, dropped, T, TT, sp, dctx, C, HD, sctx, dqkv + 2 * C, C3, HD,
       sq);
  // d(dropped) = dctx · V^T into work, then through dropout and softmax, scaled: dS into pd.
  gemm(false, true, T, T, HD, 1.0f, dctx, C, HD, sctx, qkv + 2 * C, C3, HD, sq, work, T, TT, sp);
  if (!query)
    with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < B * NH * T; ++r) {
        const uint64_t idx0 = offset + s.dropout_row(r / T, r % T);
        softmax_backward_row(tag, work + r * T, pd + r * T, probs + r * T, T, dropout_p, keep_scale,
                             key, idx0, scale);
      }
    });
  // dQ = dS · K, dK = dS^T · Q.
  gemm(false, false, T, HD, T, 1.0f, pd, T, TT, sp, qkv + C, C3, HD, sq, dqkv, C3, HD, sq);
  gemm(true, false, T, HD, T, 1.0f, pd, T, TT, sp, qkv, C3, HD, sq, dqkv + C, C3, HD, sq);
}

}  // namespace

void attention_forward(float* ctx, float* probs, float* work, const float* qkv, const int32_t* mask,
                       const AttentionShape& s, float dropout_p, uint64_t key, uint64_t offset,
                       const AttentionBf16* bf16, uint16_t* saved_f16) {
  if (bf16) {
    convert_f32_to_bf16(qkv, bf16->qkv, static_cast<size_t>(s.B * s.T * 3 * s.C));
    return forward_impl<uint16_t>(ctx, bf16->saved ? work : probs, bf16->saved, bf16->probs,
                                  bf16->qkv, mask, s, dropout_p, key, offset);
  }
  if (saved_f16)  // scores, then the (dropped) rounded probabilities, in place in work
    return forward_impl<float>(ctx, work, reinterpret_cast<rows::F16*>(saved_f16), work, qkv, mask,
                               s, dropout_p, key, offset);
  forward_impl<float>(ctx, probs, static_cast<uint16_t*>(nullptr),
                      dropout_p > 0.0f ? work : nullptr, qkv, mask, s, dropout_p, key, offset);
}

void attention_backward(float* dqkv, float* work, const float* dctx, const float* qkv,
                        const float* probs, const AttentionShape& s, float dropout_p, uint64_t key,
                        uint64_t offset, const AttentionBf16* bf16, const uint16_t* probs_f16) {
  if (bf16) {
    if (qkv) convert_f32_to_bf16(qkv, bf16->qkv, static_cast<size_t>(s.B * s.T * 3 * s.C));
    convert_f32_to_bf16(dctx, bf16->dctx, static_cast<size_t>(s.B * s.T * s.C));
    if (bf16->saved)
      return backward_impl<uint16_t, uint16_t>(dqkv, work, bf16->probs, bf16->dctx, bf16->qkv,
                                               bf16->saved, s, dropout_p, key, offset);
    return backward_impl<uint16_t, float>(dqkv, work, bf16->probs, bf16->dctx, bf16->qkv, probs, s,
                                          dropout_p, key, offset);
  }
  if (probs_f16)
    return backward_impl<float, rows::F16>(dqkv, work, work, dctx, qkv,
                                           reinterpret_cast<const rows::F16*>(probs_f16), s,
                                           dropout_p, key, offset);
  backward_impl<float, float>(dqkv, work, work, dctx, qkv, probs, s, dropout_p, key, offset);
}

AttentionScratch attention_scratch(const AttentionShape& s, bool bf16, bool blocked) {
  if (blocked) return attention_blocked_scratch(s, bf16);
  AttentionScratch a;
  a.mask_row = s.T * 4;
  GemmScratchQuery q;  // the kernels' own calls: products only, on placeholder operands
  float* f = q.placeholder<float>();
  uint16_t* h = q.placeholder<uint16_t>();
  const int32_t* m = q.placeholder<int32_t>();
  if (bf16) {
    forward_impl<uint16_t>(f, f, h, h, h, m, s, 0.1f, 0, 0);
    backward_impl<uint16_t, uint16_t>(f, f, h, h, h, h, s, 0.1f, 0, 0);
  } else {
    forward_impl<float>(f, f, h, f, f, m, s, 0.1f, 0, 0);
    backward_impl<float, float>(f, f, f, f, f, f, s, 0.1f, 0, 0);
  }
  a.caller_gemm = q.bytes();
  return a;
}

void attention_forward(Precision p, float* ctx, AttentionSaved saved, Kept qkv, const int32_t* mask,
                       const AttentionShape& s, const Dropout& site, const Workspace& ws) {
  const Dropout d = resolved(site);
  if (p == Precision::FP16) round_to_f16(qkv.f32, qkv.f32, s.B * s.T * 3 * s.C, qkv.bits);
  // BF16: the kernels round QKV into qkv.bits themselves and keep the probabilities in bf16.
  const AttentionBf16 a16{qkv.bits, ws.attn_probs16, ws.attn_dctx16, saved.probs16};
  const AttentionBf16* bf16 = p == Precision::BF16 ? &a16 : nullptr;
  if (saved.blocked())
    return attention_blocked_forward(ctx, saved.lse, qkv.f32, mask, s, d.p, d.key, d.offset, bf16);
  attention_forward(ctx, saved.probs, ws.attn_work, qkv.f32, mask, s, d.p, d.key, d.offset, bf16,
                    p == Precision::FP16 ? saved.probs16 : nullptr);
}

void attention_backward(Precision p, float* dqkv, const float* dctx, Kept qkv, AttentionSaved saved,
                        const int32_t* mask, const AttentionShape& s, const Dropout& site,
                        const Workspace& ws) {
  const Dropout d = resolved(site);
  const AttentionBf16 a16{qkv.bits, ws.attn_probs16, ws.attn_dctx16, saved.probs16};
  const AttentionBf16* bf16 = p == Precision::BF16 ? &a16 : nullptr;
  const float* x = qkv.f32;  // BF16: null, the kernels read a16.qkv (forward's rounding)
  if (p == Precision::BF16) x = nullptr;
  if (p == Precision::FP16) {
    widen_f16(ws.wide, qkv.bits, s.B * s.T * 3 * s.C);
    x = ws.wide;
  }
  if (saved.blocked())
    return attention_blocked_backward(dqkv, dctx, x, saved.lse, mask, s, d.p, d.key, d.offset,
                                      bf16);
  attention_backward(dqkv, ws.attn_work, dctx, x, saved.probs, s, d.p, d.key, d.offset, bf16,
                     p == Precision::FP16 ? saved.probs16 : nullptr);
}

}  // namespace bertrain::kernels
