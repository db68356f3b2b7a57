#include "kernels/cpu/layernorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <omp.h>

#include "core/isa.h"
#include "core/simd_avx2.h"
#include "core/simd_avx512.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/scratch.h"

namespace bertrain::kernels {
namespace {

// One row: statistics in double (two passes: stable for the magnitudes BERT sees), output
// (x - m) * r * gamma + beta in float.
void ln_row_portable(float* o, float* m_out, float* r_out, const float* x, const float* gamma,
                     const float* beta, int64_t C, float eps) {
  double s = 0.0;
  for (int64_t c = 0; c < C; ++c) s += x[c];
  const float m = static_cast<float>(s / C);
  double v = 0.0;
  for (int64_t c = 0; c < C; ++c) {
    const float d = x[c] - m;
    v += static_cast<double>(d) * d;
  }
  const float r = static_cast<float>(1.0 / std::sqrt(v / C + eps));
  for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * r * gamma[c] + beta[c];
  *m_out = m;
  *r_out = r;
}

// The same row with 16 lanes (double sums in 2 x 8 lanes), optionally first forming
// x = dropout(x) + residual in place (residual non-null).
BT_AVX512 void ln_row(isa::Avx512, float* o, float* m_out, float* r_out, float* x,
                      const float* residual, const float* gamma, const float* beta, int64_t C,
                      float eps, float p, float keep_scale, uint64_t key, uint64_t idx0) {
  using namespace simd;
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 k = tail_mask(C - c);
    __m512 xv = _mm512_maskz_loadu_ps(k, x + c);
    if (residual) {
      if (p > 0.0f) xv = _mm512_mul_ps(xv, dropout_scale16(p, keep_scale, key, idx0 + c));
      xv = _mm512_add_ps(xv, _mm512_maskz_loadu_ps(k, residual + c));
      _mm512_mask_storeu_ps(x + c, k, xv);
    }
    s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(xv)));
    s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(xv, 1)));
  }
  const float m = static_cast<float>(_mm512_reduce_add_pd(_mm512_add_pd(s0, s1)) / C);
  const __m512 vm = _mm512_set1_ps(m);
  __m512d v0 = _mm512_setzero_pd(), v1 = _mm512_setzero_pd();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 k = tail_mask(C - c);
    const __m512 d = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + c), vm);
    const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(d));
    const __m512d d1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(d, 1));
    v0 = _mm512_add_pd(v0, _mm512_mul_pd(d0, d0));
    v1 = _mm512_add_pd(v1, _mm512_mul_pd(d1, d1));
  }
  const double var = _mm512_reduce_add_pd(_mm512_add_pd(v0, v1)) / C;
  const float r = static_cast<float>(1.0 / std::sqrt(var + eps));
  const __m512 vr = _mm512_set1_ps(r);
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 k = tail_mask(C - c);
    const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), vm), vr);
    _mm512_mask_storeu_ps(o + c, k,
                          _mm512_add_ps(_mm512_mul_ps(xhat, _mm512_maskz_loadu_ps(k, gamma + c)),
                                        _mm512_maskz_loadu_ps(k, beta + c)));
  }
  *m_out = m;
  *r_out = r;
}

// The AVX2 twin: 8 lanes, double sums in 2 x 4 lanes.
BT_AVX2 void ln_row(isa::Avx2, float* o, float* m_out, float* r_out, float* x,
                    const float* residual, const float* gamma, const float* beta, int64_t C,
                    float eps, float p, float keep_scale, uint64_t key, uint64_t idx0) {
  using namespace simd;
  __m256d s = _mm256_setzero_pd();
  for (int64_t c = 0; c < C; c += 8) {
    __m256 xv = load8(x + c, C - c);
    if (residual) {
      if (p > 0.0f) xv = _mm256_mul_ps(xv, dropout_scale8(p, keep_scale, key, idx0 + c));
      xv = _mm256_add_ps(xv, load8(residual + c, C - c));
      store8(x + c, C - c, xv);
    }
    s = add_wide8(s, xv);
  }
  const float m = static_cast<float>(hsum4d(s) / C);
  const __m256 vm = _mm256_set1_ps(m);
  __m256d v = _mm256_setzero_pd();
  for (int64_t c = 0; c < C; c += 8) {
    const __m256 d =
        _mm256_and_ps(_mm256_sub_ps(load8(x + c, C - c), vm), _mm256_castsi256_ps(tail8(C - c)));
    v = add_squares8(v, d);
  }
  const float r = static_cast<float>(1.0 / std::sqrt(hsum4d(v) / C + eps));
  const __m256 vr = _mm256_set1_ps(r);
  for (int64_t c = 0; c < C; c += 8) {
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load8(x + c, C - c), vm), vr);
    store8(o + c, C - c,
           _mm256_add_ps(_mm256_mul_ps(xhat, load8(gamma + c, C - c)), load8(beta + c, C - c)));
  }
  *m_out = m;
  *r_out = r;
}

// The portable twin of the vector rows: dropout + residual in place first (residual non-null).
void ln_row(isa::Portable, float* o, float* m_out, float* r_out, float* x, const float* residual,
            const float* gamma, const float* beta, int64_t C, float eps, float p, float keep_scale,
            uint64_t key, uint64_t idx0) {
  if (residual)
    for (int64_t c = 0; c < C; ++c) {
      const float y = p > 0.0f && !dropout_keep(p, key, idx0 + c) ? 0.0f
                      : p > 0.0f                                  ? x[c] * keep_scale
                                                                  : x[c];
      x[c] = y + residual[c];
    }
  ln_row_portable(o, m_out, r_out, x, gamma, beta, C, eps);
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps) {
  with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i)
      ln_row(tag, out + i * C, mean + i, rstd + i, const_cast<float*>(inp + i * C), nullptr, gamma,
             beta, C, eps, 0.0f, 1.0f, 0, 0);
  });
}

void residual_layernorm_forward(float* out, float* mean, float* rstd, float* x,
                                const float* residual, const float* gamma, const float* beta,
                                int64_t N, int64_t C, float eps, const Dropout& d) {
  const float dropout_p = d.p;
  const Dropout at = resolved(d);  // (the step's arguments' key and offset, where given)
  const uint64_t key = at.key, offset = at.offset;
  const int32_t* rows = d.rows;
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
  with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i)
      ln_row(tag, out + i * C, mean + i, rstd + i, x + i * C, residual + i * C, gamma, beta, C, eps,
             dropout_p, keep_scale, key, offset + static_cast<uint64_t>((rows ? rows[i] : i) * C));
  });
}

namespace {

// out[0, C) *= keep / (1 - p) or 0, elements keyed idx0 + c (as dropout_forward).
BT_AVX512 void dropout_row(isa::Avx512, float* out, int64_t C, float p, float keep_scale,
                           uint64_t key, uint64_t idx0) {
  using namespace simd;
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 k = tail_mask(C - c);
    _mm512_mask_storeu_ps(out + c, k,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(k, out + c),
                                        dropout_scale16(p, keep_scale, key, idx0 + c)));
  }
}

BT_AVX2 void dropout_row(isa::Avx2, float* out, int64_t C, float p, float keep_scale, uint64_t key,
                         uint64_t idx0) {
  using namespace simd;
  for (int64_t c = 0; c < C; c += 8)
    store8(out + c, C - c,
           _mm256_mul_ps(load8(out + c, C - c), dropout_scale8(p, keep_scale, key, idx0 + c)));
}

void dropout_row(isa::Portable, float* out, int64_t C, float p, float keep_scale, uint64_t key,
                 uint64_t idx0) {
  for (int64_t c = 0; c < C; ++c)
    out[c] = dropout_keep(p, key, idx0 + c) ? out[c] * keep_scale : 0.0f;
}

}  // namespace

void embedding_layernorm_forward(float* out, float* sum, float* mean, float* rstd,
                                 const int32_t* ids, const int32_t* segment,
                                 const int32_t* positions, const float* word, const float* position,
                                 const float* token_type, const float* gamma, const float* beta,
                                 int64_t B, int64_t T, int64_t C, float eps, const Dropout& d) {
  const float dropout_p = d.p;
  const Dropout at = resolved(d);  // (the step's arguments' key and offset, where given)
  const uint64_t key = at.key, offset = at.offset;
  const int32_t* rows = d.rows;
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
  with_isa([&](auto tag) {
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      float* x = sum + bt * C;
      float* o = out + bt * C;
      embedding_sum_row(x, ids[bt], segment[bt], positions ? positions[bt] : bt % T, word, position,
                        token_type, C);
      ln_row(tag, o, mean + bt, rstd + bt, x, nullptr, gamma, beta, C, eps, 0.0f, 1.0f, 0, 0);
      if (dropout_p > 0.0f)
        dropout_row(tag, o, C, dropout_p, keep_scale, key,
                    offset + static_cast<uint64_t>((rows ? rows[bt] : bt) * C));
    }
  });
}

namespace {

BT_AVX512 void ln_backward_row(isa::Avx512, float* dx, float* ddrop, float* pg, float* pb,
                               const float* dy, const float* x, const float* gamma, float m,
                               float r, int64_t C, bool accumulate, float p, float keep_scale,
                               uint64_t key, uint64_t idx0) {
  using namespace simd;
  const __m512 vm = _mm512_set1_ps(m), vr = _mm512_set1_ps(r);
  __m512 sg = _mm512_setzero_ps(), sgx = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 k = tail_mask(C - c);
    const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), vm), vr);
    const __m512 d = _mm512_maskz_loadu_ps(k, dy + c);
    const __m512 gdy = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, gamma + c), d);
    sg = _mm512_add_ps(sg, gdy);
    sgx = _mm512_add_ps(sgx, _mm512_mul_ps(gdy, xhat));
    _mm512_mask_storeu_ps(pg + c, k,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(k, pg + c), _mm512_mul_ps(d, xhat)));
    _mm512_mask_storeu_ps(pb + c, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, pb + c), d));
  }
  const __m512 a = _mm512_set1_ps(_mm512_reduce_add_ps(sg) / C);
  const __m512 b = _mm512_set1_ps(_mm512_reduce_add_ps(sgx) / C);
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 k = tail_mask(C - c);
    const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), vm), vr);
    const __m512 gdy =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(k, gamma + c), _mm512_maskz_loadu_ps(k, dy + c));
    __m512 g = _mm512_mul_ps(vr, _mm512_sub_ps(_mm512_sub_ps(gdy, a), _mm512_mul_ps(xhat, b)));
    if (accumulate) g = _mm512_add_ps(_mm512_maskz_loadu_ps(k, dx + c), g);
    _mm512_mask_storeu_ps(dx + c, k, g);
    if (ddrop)
      _mm512_mask_storeu_ps(
          ddrop + c, k,
          p > 0.0f ? _mm512_mul_ps(g, dropout_scale16(p, keep_scale, key, idx0 + c)) : g);
  }
}

BT_AVX2 void ln_backward_row(isa::Avx2, float* dx, float* ddrop, float* pg, float* pb,
                             const float* dy, const float* x, const float* gamma, float m, float r,
                             int64_t C, bool accumulate, float p, float keep_scale, uint64_t key,
                             uint64_t idx0) {
  using namespace simd;
  const __m256 vm = _mm256_set1_ps(m), vr = _mm256_set1_ps(r);
  __m256 sg = _mm256_setzero_ps(), sgx = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load8(x + c, n), vm), vr);
    const __m256 d = load8(dy + c, n);  // 0 past the row: the sums see nothing there
    const __m256 gdy = _mm256_mul_ps(load8(gamma + c, n), d);
    sg = _mm256_add_ps(sg, gdy);
    sgx = _mm256_add_ps(sgx, _mm256_mul_ps(gdy, xhat));
    store8(pg + c, n, _mm256_add_ps(load8(pg + c, n), _mm256_mul_ps(d, xhat)));
    store8(pb + c, n, _mm256_add_ps(load8(pb + c, n), d));
  }
  const __m256 a = _mm256_set1_ps(hsum8(sg) / C);
  const __m256 b = _mm256_set1_ps(hsum8(sgx) / C);
  for (int64_t c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 xhat = _mm256_mul_ps(_mm256_sub_ps(load8(x + c, n), vm), vr);
    const __m256 gdy = _mm256_mul_ps(load8(gamma + c, n), load8(dy + c, n));
    __m256 g = _mm256_mul_ps(vr, _mm256_sub_ps(_mm256_sub_ps(gdy, a), _mm256_mul_ps(xhat, b)));
    if (accumulate) g = _mm256_add_ps(load8(dx + c, n), g);
    store8(dx + c, n, g);
    if (ddrop)
      store8(ddrop + c, n,
             p > 0.0f ? _mm256_mul_ps(g, dropout_scale8(p, keep_scale, key, idx0 + c)) : g);
  }
}

void ln_backward_row(isa::Portable, float* dx, float* dd, float* pg, float* pb, const float* dy,
                     const float* x, const float* gamma, float m, float r, int64_t C,
                     bool accumulate, float p, float keep_scale, uint64_t key, uint64_t idx0) {
  float sum_gdy = 0.0f, sum_gdy_xhat = 0.0f;
  for (int64_t c = 0; c < C; ++c) {
    float xhat = (x[c] - m) * r;
    float gdy = gamma[c] * dy[c];
    sum_gdy += gdy;
    sum_gdy_xhat += gdy * xhat;
    pg[c] += dy[c] * xhat;
    pb[c] += dy[c];
  }
  float a = sum_gdy / C, b = sum_gdy_xhat / C;
  for (int64_t c = 0; c < C; ++c) {
    float xhat = (x[c] - m) * r;
    float g = r * (gamma[c] * dy[c] - a - xhat * b);
    dx[c] = accumulate ? dx[c] + g : g;
    if (dd)
      dd[c] = p > 0.0f && !dropout_keep(p, key, idx0 + c) ? 0.0f
              : p > 0.0f                                  ? dx[c] * keep_scale
                                                          : dx[c];
  }
}

}  // namespace

void layernorm_dropout_backward(float* dinp, float* ddropped, float* dgamma, float* dbeta,
                                const float* dout, const float* inp, const float* gamma,
                                const float* mean, const float* rstd, int64_t N, int64_t C,
                                bool accumulate_dinp, const Dropout& d) {
  const float dropout_p = d.p;
  const Dropout at = resolved(d);  // (the step's arguments' key and offset, where given)
  const uint64_t key = at.key, offset = at.offset;
  const int32_t* rows = d.rows;
  // dx = rstd * (g*dy - mean(g*dy) - xhat * mean(g*dy*xhat)), xhat = (x - mean) * rstd
  const float keep_scale = dropout_p > 0.0f ? 1.0f / (1.0f - dropout_p) : 1.0f;
  const int nthreads = omp_get_max_threads();
  // Per-thread dgamma/dbeta partials: each thread's part of the kernel scratch (scratch.h).
  const ScratchBlock partial =
      scratch_block(ScratchPart::LayerNorm, 2 * C * int64_t{sizeof(float)}, nthreads);
  for (int t = 0; t < nthreads; ++t) std::fill_n(partial.as<float>(t), 2 * C, 0.0f);
  with_isa([&](auto tag) {
#pragma omp parallel
    {
      float* pg = partial.as<float>(omp_get_thread_num());
      float* pb = pg + C;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N; ++i)
        ln_backward_row(tag, dinp + i * C, ddropped ? ddropped + i * C : nullptr, pg, pb,
                        dout + i * C, inp + i * C, gamma, mean[i], rstd[i], C, accumulate_dinp,
                        dropout_p, keep_scale, key,
                        offset + static_cast<uint64_t>((rows ? rows[i] : i) * C));
    }
  });
  for (int t = 0; t < nthreads; ++t) {
    const float* pg = partial.as<float>(t);
    for (int64_t c = 0; c < C; ++c) {
      dgamma[c] += pg[c];
      dbeta[c] += pg[C + c];
    }
  }
}

void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                        const float* inp, const float* gamma, const float* mean, const float* rstd,
                        int64_t N, int64_t C, bool accumulate_dinp) {
  layernorm_dropout_backward(dinp, nullptr, dgamma, dbeta, dout, inp, gamma, mean, rstd, N, C,
                             accumulate_dinp, Dropout{});
}

}  // namespace bertrain::kernels
