#include "kernels/cpu/attention.h"

#include <cmath>
#include <vector>

#include "core/isa.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/simd_avx512.h"

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
          const uint64_t idx0 = offset + static_cast<uint64_t>(((b * NH + h) * T + i) * T);
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
          const uint64_t idx0 = offset + static_cast<uint64_t>(((b * NH + h) * T + i) * T);
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

namespace {

// Forward row: s[j] (scaled scores) + bias[j] -> softmax, saved in s; the dropped row
// (keep / (1 - p) or 0 per element) goes to out (null when p == 0).
void softmax_row_portable(float* s, const float* bias, float* out, int64_t T, float p,
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
  if (out)
    for (int64_t j = 0; j < T; ++j)
      out[j] = dropout_keep(p, key, idx0 + j) ? s[j] * keep_scale : 0.0f;
}

BT_AVX512 void softmax_row_avx512(float* s, const float* bias, float* out, int64_t T, float p,
                                  float keep_scale, uint64_t key, uint64_t idx0) {
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
    const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv);
    _mm512_mask_storeu_ps(s + j, m, y);
    if (out)
      _mm512_mask_storeu_ps(out + j, m,
                            _mm512_mul_ps(y, dropout_scale16(p, keep_scale, key, idx0 + j)));
  }
}

// Backward row: g[j] = dL/d(dropped prob) in, dL/d(scaled score) * scale out.
void softmax_backward_row_portable(float* g, const float* prob, int64_t T, float p,
                                   float keep_scale, uint64_t key, uint64_t idx0, float scale) {
  float dot = 0.0f;
  for (int64_t j = 0; j < T; ++j) {
    if (p > 0.0f) g[j] = dropout_keep(p, key, idx0 + j) ? g[j] * keep_scale : 0.0f;
    dot += g[j] * prob[j];
  }
  for (int64_t j = 0; j < T; ++j) g[j] = prob[j] * (g[j] - dot) * scale;
}

BT_AVX512 void softmax_backward_row_avx512(float* g, const float* prob, int64_t T, float p,
                                           float keep_scale, uint64_t key, uint64_t idx0,
                                           float scale) {
  using namespace simd;
  __m512 vdot = _mm512_setzero_ps();
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    __m512 x = _mm512_maskz_loadu_ps(m, g + j);
    if (p > 0.0f) {
      x = _mm512_mul_ps(x, dropout_scale16(p, keep_scale, key, idx0 + j));
      _mm512_mask_storeu_ps(g + j, m, x);
    }
    vdot = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, prob + j), vdot);
  }
  const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(vdot)), vs = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    const __m512 y =
        _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, prob + j),
                                    _mm512_sub_ps(_mm512_maskz_loadu_ps(m, g + j), dot)),
                      vs);
    _mm512_mask_storeu_ps(g + j, m, y);
  }
}

// Regenerates the dropped row from the saved probabilities.
void dropout_row(float* out, const float* prob, int64_t T, float p, float keep_scale, uint64_t key,
                 uint64_t idx0) {
  for (int64_t j = 0; j < T; ++j)
    out[j] = dropout_keep(p, key, idx0 + j) ? prob[j] * keep_scale : 0.0f;
}

BT_AVX512 void dropout_row_avx512(float* out, const float* prob, int64_t T, float p,
                                  float keep_scale, uint64_t key, uint64_t idx0) {
  using namespace simd;
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    _mm512_mask_storeu_ps(out + j, m,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(m, prob + j),
                                        dropout_scale16(p, keep_scale, key, idx0 + j)));
  }
}

}  // namespace

void attention_forward(float* ctx, float* probs, float* work, const float* qkv, const int32_t* mask,
                       const AttentionShape& s, float dropout_p, uint64_t key, uint64_t offset) {
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, HD = C / NH, C3 = 3 * C, TT = T * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
  const bool fast = use_avx512();
  // probs = scale * Q K^T, per sequence, batched over heads (head h: columns h*HD of Q and K).
  for (int64_t b = 0; b < B; ++b) {
    const float* base = qkv + b * T * C3;
    gemm_batched(NH, false, true, T, T, HD, scale, base, C3, HD, base + C, C3, HD,
                 probs + b * NH * TT, T, TT);
  }
  const float* dropped = dropout_p > 0.0f ? work : probs;
#pragma omp parallel
  {
    std::vector<float> bias(T);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * NH; ++bh) {
      const int64_t b = bh / NH;
      for (int64_t j = 0; j < T; ++j) bias[j] = mask[b * T + j] ? 0.0f : -10000.0f;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t r = (bh * T + i) * T;
        float* out = dropout_p > 0.0f ? work + r : nullptr;
        const uint64_t idx0 = offset + static_cast<uint64_t>(r);
        if (fast)
          softmax_row_avx512(probs + r, bias.data(), out, T, dropout_p, keep_scale, key, idx0);
        else
          softmax_row_portable(probs + r, bias.data(), out, T, dropout_p, keep_scale, key, idx0);
      }
    }
  }
  // ctx[b, :, h*HD:(h+1)*HD] = dropped probs · V_h
  for (int64_t b = 0; b < B; ++b)
    gemm_batched(NH, false, false, T, HD, T, 1.0f, dropped + b * NH * TT, T, TT,
                 qkv + b * T * C3 + 2 * C, C3, HD, ctx + b * T * C, C, HD);
}

void attention_backward(float* dqkv, float* work, const float* dctx, const float* qkv,
                        const float* probs, const AttentionShape& s, float dropout_p, uint64_t key,
                        uint64_t offset) {
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, HD = C / NH, C3 = 3 * C, TT = T * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
  const bool fast = use_avx512();
  // dV = dropped^T · dctx (the dropped probabilities regenerated into work).
  if (dropout_p > 0.0f) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < B * NH * T; ++r) {
      const uint64_t idx0 = offset + static_cast<uint64_t>(r * T);
      if (fast)
        dropout_row_avx512(work + r * T, probs + r * T, T, dropout_p, keep_scale, key, idx0);
      else
        dropout_row(work + r * T, probs + r * T, T, dropout_p, keep_scale, key, idx0);
    }
  }
  const float* dropped = dropout_p > 0.0f ? work : probs;
  for (int64_t b = 0; b < B; ++b)
    gemm_batched(NH, true, false, T, HD, T, 1.0f, dropped + b * NH * TT, T, TT, dctx + b * T * C, C,
                 HD, dqkv + b * T * C3 + 2 * C, C3, HD);
  // d(dropped) = dctx · V^T into work, then through dropout and softmax, scaled: dS.
  for (int64_t b = 0; b < B; ++b)
    gemm_batched(NH, false, true, T, T, HD, 1.0f, dctx + b * T * C, C, HD, qkv + b * T * C3 + 2 * C,
                 C3, HD, work + b * NH * TT, T, TT);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < B * NH * T; ++r) {
    const uint64_t idx0 = offset + static_cast<uint64_t>(r * T);
    if (fast)
      softmax_backward_row_avx512(work + r * T, probs + r * T, T, dropout_p, keep_scale, key, idx0,
                                  scale);
    else
      softmax_backward_row_portable(work + r * T, probs + r * T, T, dropout_p, keep_scale, key,
                                    idx0, scale);
  }
  // dQ = dS · K, dK = dS^T · Q.
  for (int64_t b = 0; b < B; ++b) {
    const float* base = qkv + b * T * C3;
    float* dbase = dqkv + b * T * C3;
    gemm_batched(NH, false, false, T, HD, T, 1.0f, work + b * NH * TT, T, TT, base + C, C3, HD,
                 dbase, C3, HD);
    gemm_batched(NH, true, false, T, HD, T, 1.0f, work + b * NH * TT, T, TT, base, C3, HD,
                 dbase + C, C3, HD);
  }
}

}  // namespace bertrain::kernels
