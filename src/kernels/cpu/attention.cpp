#include "kernels/cpu/attention.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/elementwise.h"

namespace bertrain::kernels {

void attention_forward(float* ctx, float* probs, const float* qkv, const int32_t* mask,
                       const AttentionShape& s, float dropout_p, uint64_t key, uint64_t offset) {
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

void attention_backward(float* dqkv, const float* dctx, const float* qkv, const float* probs,
                        const AttentionShape& s, float dropout_p, uint64_t key, uint64_t offset) {
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

}  // namespace bertrain::kernels
