#include "kernels/cpu/optimizer.h"

#include <omp.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/isa.h"
#include "core/parallel.h"
#include "core/simd_avx2.h"
#include "core/simd_avx512.h"
#include "kernels/cpu/scratch.h"
#include "kernels/row_math.h"

namespace bertrain::kernels {
namespace {

// Why the AVX-512 bodies below and the AVX2 ones after them have the same shape (the duplicate
// pairs a reading of the tree finds here): each is the portable loop's operations, in its order
// and without FMA where the portable loop has none, on that ISA's vector type, so that every
// body gives the portable loop's bits (tests/test_optimizer.cpp:
// AdamWIsa.VectorBodiesEqualPortable, Optimizer.LambVectorBodiesMatchPortable check them against
// each other in one process). A width-generic wrapper would hide which intrinsic runs, which is
// what those bit-for-bit guarantees depend on; the element math itself is written once
// (kernels/row_math.h) and the portable bodies call it.

// sum of (g * s)^2 in double, 8 lanes.
BT_AVX512 double sum_squares_rows(isa::Avx512, const float* g, int64_t n, double s) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  const __m512d vs = _mm512_set1_pd(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512d a = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(g + i)), vs);
    const __m512d b = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(g + i + 8)), vs);
    acc0 = _mm512_fmadd_pd(a, a, acc0);
    acc1 = _mm512_fmadd_pd(b, b, acc1);
  }
  double sum = _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
  for (; i < n; ++i) {
    const double x = static_cast<double>(g[i]) * s;
    sum += x * x;
  }
  return sum;
}

// Adam's moments on 16 lanes, the portable loops' operations in their order (no FMA), so both
// bodies give the same bits: m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g g, stored back.
BT_AVX512 inline void adam_moments16(__m512 gi, float* m, float* v, __mmask16 k, float b1, float b2,
                                     __m512& mi, __m512& vi) {
  mi = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(b1), _mm512_maskz_loadu_ps(k, m)),
                     _mm512_mul_ps(_mm512_set1_ps(1.0f - b1), gi));
  vi = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(b2), _mm512_maskz_loadu_ps(k, v)),
                     _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(1.0f - b2), gi), gi));
  _mm512_mask_storeu_ps(m, k, mi);
  _mm512_mask_storeu_ps(v, k, vi);
}

// LAMB's update direction u = m / bc1 / (sqrt(v / bc2) + eps) + wd p on 16 lanes.
BT_AVX512 inline __m512 lamb_direction16(__m512 mi, __m512 vi, __m512 pi, float ibc1, float ibc2,
                                         float eps, float wd) {
  return _mm512_add_ps(
      _mm512_div_ps(_mm512_mul_ps(mi, _mm512_set1_ps(ibc1)),
                    _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(vi, _mm512_set1_ps(ibc2))),
                                  _mm512_set1_ps(eps))),
      _mm512_mul_ps(_mm512_set1_ps(wd), pi));
}

// acc += x^2 over 16 floats, in double (two 8-lane halves).
BT_AVX512 inline __m512d add_squares16(__m512d acc, __m512 x) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
  return _mm512_add_pd(acc, _mm512_add_pd(_mm512_mul_pd(lo, lo), _mm512_mul_pd(hi, hi)));
}

// The new parameters, and their 16-bit copy when asked for (bf16, or fp16: vcvtps2ph rounds to
// nearest even as f32_to_f16 does).
BT_AVX512 inline void store_params16(float* p, uint16_t* p16, bool f16, __mmask16 k, __m512 x) {
  _mm512_mask_storeu_ps(p, k, x);
  if (!p16) return;
  _mm256_mask_storeu_epi16(p16, k,
                           f16 ? _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                               : simd::f32_to_bf16_16(x));
}

BT_AVX512 void adamw_rows(isa::Avx512, float* p, uint16_t* p16, bool f16, const float* g, float* m,
                          float* v, int64_t b, int64_t e, float gscale, float b1, float b2,
                          float step_size, float sqrt_bc2, float eps, float decay) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 k = tail_mask(e - i);
    const __m512 gi = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, g + i), _mm512_set1_ps(gscale));
    __m512 mi, vi;
    adam_moments16(gi, m + i, v + i, k, b1, b2, mi, vi);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(sqrt_bc2)),
                                       _mm512_set1_ps(eps));
    const __m512 pi =
        _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + i), _mm512_set1_ps(decay)),
                      _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(step_size), mi), denom));
    store_params16(p + i, p16 ? p16 + i : nullptr, f16, k, pi);
  }
}

// LAMB's first pass on 16 lanes: moments updated, and the squared norms of p and of the update
// direction accumulated in double (in lanes: another summation order than the portable loop,
// so the trust ratio may differ in its last bits).
BT_AVX512 void lamb_moments_rows(isa::Avx512, const float* p, const float* g, float* m, float* v,
                                 int64_t b, int64_t e, float gscale, float b1, float b2, float ibc1,
                                 float ibc2, float eps, float wd, double* pn, double* un) {
  using namespace simd;
  __m512d ap = _mm512_setzero_pd(), au = _mm512_setzero_pd();
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 k = tail_mask(e - i);
    const __m512 gi = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, g + i), _mm512_set1_ps(gscale));
    __m512 mi, vi;
    adam_moments16(gi, m + i, v + i, k, b1, b2, mi, vi);
    const __m512 pi = _mm512_maskz_loadu_ps(k, p + i);
    ap = add_squares16(ap, pi);
    au = add_squares16(au, lamb_direction16(mi, vi, pi, ibc1, ibc2, eps, wd));
  }
  *pn += _mm512_reduce_add_pd(ap);
  *un += _mm512_reduce_add_pd(au);
}

BT_AVX512 void lamb_update_rows(isa::Avx512, float* p, uint16_t* p16, bool f16, const float* m,
                                const float* v, int64_t b, int64_t e, float ibc1, float ibc2,
                                float eps, float wd, float step) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 k = tail_mask(e - i);
    const __m512 pi = _mm512_maskz_loadu_ps(k, p + i);
    const __m512 u = lamb_direction16(_mm512_maskz_loadu_ps(k, m + i),
                                      _mm512_maskz_loadu_ps(k, v + i), pi, ibc1, ibc2, eps, wd);
    store_params16(p + i, p16 ? p16 + i : nullptr, f16, k,
                   _mm512_sub_ps(pi, _mm512_mul_ps(_mm512_set1_ps(step), u)));
  }
}

// The AVX2 twins (8 lanes, the same operations in the same order as the AVX-512 bodies). The
// 16-bit copy is rounded per element: a CPU model has one only in bf16, which needs AVX-512, so
// in practice only tests ask for it here.
BT_AVX2 double sum_squares_rows(isa::Avx2, const float* g, int64_t n, double s) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  const __m256d vs = _mm256_set1_pd(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256d a = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(g + i)), vs);
    const __m256d b = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(g + i + 4)), vs);
    acc0 = _mm256_fmadd_pd(a, a, acc0);
    acc1 = _mm256_fmadd_pd(b, b, acc1);
  }
  double sum = simd::hsum4d(_mm256_add_pd(acc0, acc1));
  for (; i < n; ++i) {
    const double x = static_cast<double>(g[i]) * s;
    sum += x * x;
  }
  return sum;
}

BT_AVX2 inline void adam_moments8(__m256 gi, float* m, float* v, int64_t n, float b1, float b2,
                                  __m256& mi, __m256& vi) {
  using namespace simd;
  mi = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(b1), load8(m, n)),
                     _mm256_mul_ps(_mm256_set1_ps(1.0f - b1), gi));
  vi = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(b2), load8(v, n)),
                     _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(1.0f - b2), gi), gi));
  store8(m, n, mi);
  store8(v, n, vi);
}

BT_AVX2 inline __m256 lamb_direction8(__m256 mi, __m256 vi, __m256 pi, float ibc1, float ibc2,
                                      float eps, float wd) {
  return _mm256_add_ps(
      _mm256_div_ps(_mm256_mul_ps(mi, _mm256_set1_ps(ibc1)),
                    _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi, _mm256_set1_ps(ibc2))),
                                  _mm256_set1_ps(eps))),
      _mm256_mul_ps(_mm256_set1_ps(wd), pi));
}

BT_AVX2 inline void store_params8(float* p, uint16_t* p16, bool f16, int64_t n, __m256 x) {
  simd::store8(p, n, x);
  if (p16)
    for (int64_t l = 0; l < std::min<int64_t>(n, 8); ++l)
      p16[l] = f16 ? f32_to_f16(p[l]) : f32_to_bf16(p[l]);
}

BT_AVX2 void adamw_rows(isa::Avx2, float* p, uint16_t* p16, bool f16, const float* g, float* m,
                        float* v, int64_t b, int64_t e, float gscale, float b1, float b2,
                        float step_size, float sqrt_bc2, float eps, float decay) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 8) {
    const int64_t n = e - i;
    const __m256 gi = _mm256_mul_ps(load8(g + i, n), _mm256_set1_ps(gscale));
    __m256 mi, vi;
    adam_moments8(gi, m + i, v + i, n, b1, b2, mi, vi);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(sqrt_bc2)),
                                       _mm256_set1_ps(eps));
    const __m256 pi =
        _mm256_sub_ps(_mm256_mul_ps(load8(p + i, n), _mm256_set1_ps(decay)),
                      _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(step_size), mi), denom));
    store_params8(p + i, p16 ? p16 + i : nullptr, f16, n, pi);
  }
}

BT_AVX2 void lamb_moments_rows(isa::Avx2, const float* p, const float* g, float* m, float* v,
                               int64_t b, int64_t e, float gscale, float b1, float b2, float ibc1,
                               float ibc2, float eps, float wd, double* pn, double* un) {
  using namespace simd;
  __m256d ap = _mm256_setzero_pd(), au = _mm256_setzero_pd();
  for (int64_t i = b; i < e; i += 8) {
    const int64_t n = e - i;
    const __m256 gi = _mm256_mul_ps(load8(g + i, n), _mm256_set1_ps(gscale));
    __m256 mi, vi;
    adam_moments8(gi, m + i, v + i, n, b1, b2, mi, vi);
    const __m256 pi = load8(p + i, n);  // 0 past e, so the direction is 0 there too
    ap = add_squares8(ap, pi);
    au = add_squares8(au, lamb_direction8(mi, vi, pi, ibc1, ibc2, eps, wd));
  }
  *pn += hsum4d(ap);
  *un += hsum4d(au);
}

BT_AVX2 void lamb_update_rows(isa::Avx2, float* p, uint16_t* p16, bool f16, const float* m,
                              const float* v, int64_t b, int64_t e, float ibc1, float ibc2,
                              float eps, float wd, float step) {
  using namespace simd;
  for (int64_t i = b; i < e; i += 8) {
    const int64_t n = e - i;
    const __m256 pi = load8(p + i, n);
    const __m256 u = lamb_direction8(load8(m + i, n), load8(v + i, n), pi, ibc1, ibc2, eps, wd);
    store_params8(p + i, p16 ? p16 + i : nullptr, f16, n,
                  _mm256_sub_ps(pi, _mm256_mul_ps(_mm256_set1_ps(step), u)));
  }
}

// Per-thread partial sums of the reductions (per_thread doubles a thread, zeroed): each thread's
// part of the kernel scratch (scratch.h); thread t's at block.as<double>(t).
ScratchBlock thread_partials(int per_thread) {
  const int threads = omp_get_max_threads();
  const ScratchBlock block =
      scratch_block(ScratchPart::Optimizer, per_thread * int64_t{sizeof(double)}, threads);
  for (int t = 0; t < threads; ++t) std::fill_n(block.as<double>(t), per_thread, 0.0);
  return block;
}
}  // namespace

namespace {
// Each entry point on the ISA's vector rows (split over the threads); the portable tag takes the
// _reference loops.
template <typename Tag>
void add_sum_squares_on(Tag tag, double& sum, const float* g, int64_t n, double scale) {
  const ScratchBlock part = thread_partials(1);
  const int threads = omp_get_max_threads();
  parallel_chunks(n, [&](int64_t b, int64_t e) {
    *part.as<double>(omp_get_thread_num()) = sum_squares_rows(tag, g + b, e - b, scale);
  });
  for (int t = 0; t < threads; ++t) sum += *part.as<double>(t);
}
void add_sum_squares_on(isa::Portable, double& sum, const float* g, int64_t n, double scale) {
  add_sum_squares_reference(sum, g, n, scale);
}

template <typename Tag>
void adamw_on(Tag tag, const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m,
              float* v, int64_t n) {
  parallel_chunks(n, [&](int64_t b, int64_t e) {
    adamw_rows(tag, p, p16, a.f16_copy, g, m, v, b, e, a.gscale, a.beta1, a.beta2, a.step_size,
               a.sqrt_bc2, a.eps, a.decay);
  });
}
void adamw_on(isa::Portable, const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m,
              float* v, int64_t n) {
  adamw_update_reference(a, p, p16, g, m, v, n);
}

template <typename Tag>
void lamb_moments_on(Tag tag, const LambStep& a, const float* p, const float* g, float* m, float* v,
                     int64_t n, double& pn, double& un) {
  const ScratchBlock part = thread_partials(2);
  const int threads = omp_get_max_threads();
  parallel_chunks(n, [&](int64_t b, int64_t e) {
    double* mine = part.as<double>(omp_get_thread_num());
    lamb_moments_rows(tag, p, g, m, v, b, e, a.gscale, a.beta1, a.beta2, a.ibc1, a.ibc2, a.eps,
                      a.wd, &mine[0], &mine[1]);
  });
  for (int t = 0; t < threads; ++t) {
    pn += part.as<double>(t)[0];
    un += part.as<double>(t)[1];
  }
}
void lamb_moments_on(isa::Portable, const LambStep& a, const float* p, const float* g, float* m,
                     float* v, int64_t n, double& pn, double& un) {
  lamb_moments_reference(a, p, g, m, v, n, pn, un);
}

template <typename Tag>
void lamb_apply_on(Tag tag, const LambStep& a, float* p, uint16_t* p16, const float* m,
                   const float* v, int64_t n, float step) {
  parallel_chunks(n, [&](int64_t b, int64_t e) {
    lamb_update_rows(tag, p, p16, a.f16_copy, m, v, b, e, a.ibc1, a.ibc2, a.eps, a.wd, step);
  });
}
void lamb_apply_on(isa::Portable, const LambStep& a, float* p, uint16_t* p16, const float* m,
                   const float* v, int64_t n, float step) {
  lamb_apply_reference(a, p, p16, m, v, n, step);
}
}  // namespace

void add_sum_squares(double& sum, const float* g, int64_t n, double scale) {
  with_isa([&](auto tag) { add_sum_squares_on(tag, sum, g, n, scale); });
}

void add_sum_squares_reference(double& sum, const float* g, int64_t n, double scale) {
  double part = 0;
#pragma omp parallel for reduction(+ : part) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(g[i]) * scale;
    part += x * x;
  }
  sum += part;
}

void adamw_update(const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m, float* v,
                  int64_t n) {
  with_isa([&](auto tag) { adamw_on(tag, a, p, p16, g, m, v, n); });
}

void adamw_update_reference(const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m,
                            float* v, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) row_math::adamw(a, p, p16, g, m, v, i);
}

void lamb_moments(const LambStep& a, const float* p, const float* g, float* m, float* v, int64_t n,
                  double& pn, double& un) {
  with_isa([&](auto tag) { lamb_moments_on(tag, a, p, g, m, v, n, pn, un); });
}

void lamb_apply(const LambStep& a, float* p, uint16_t* p16, const float* m, const float* v,
                int64_t n, float step) {
  with_isa([&](auto tag) { lamb_apply_on(tag, a, p, p16, m, v, n, step); });
}

void lamb_update(const LambStep& a, float* p, uint16_t* p16, const float* g, float* m, float* v,
                 int64_t n) {
  double pn = 0, un = 0;
  lamb_moments(a, p, g, m, v, n, pn, un);
  lamb_apply(a, p, p16, m, v, n, a.lr * lamb_trust(a, pn, un));
}

void lamb_moments_reference(const LambStep& a, const float* p, const float* g, float* m, float* v,
                            int64_t n, double& pn_out, double& un_out) {
  double pn = 0, un = 0;
#pragma omp parallel for reduction(+ : pn, un) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float u = row_math::lamb_moments(a, p, g, m, v, i);
    pn += static_cast<double>(p[i]) * p[i];
    un += static_cast<double>(u) * u;
  }
  pn_out += pn;
  un_out += un;
}

void lamb_apply_reference(const LambStep& a, float* p, uint16_t* p16, const float* m,
                          const float* v, int64_t n, float step) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) row_math::lamb_apply(a, p, p16, m, v, i, step);
}

void lamb_update_reference(const LambStep& a, float* p, uint16_t* p16, const float* g, float* m,
                           float* v, int64_t n) {
  double pn = 0, un = 0;
  lamb_moments_reference(a, p, g, m, v, n, pn, un);
  lamb_apply_reference(a, p, p16, m, v, n, a.lr * lamb_trust(a, pn, un));
}

}  // namespace bertrain::kernels
