#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "core/isa.h"
#include "core/simd_avx2.h"
#include "core/simd_avx512.h"

namespace bertrain::kernels {
namespace {

struct RowMax {
  float max;
  int64_t arg;  // first index of the maximum
};

// The row's maximum from per-lane maxima and their first indices (the lowest index on ties).
RowMax first_max_of_lanes(const float* mx, const int32_t* ag, int lanes) {
  RowMax r{-INFINITY, 0};
  for (int l = 0; l < lanes; ++l)
    if (mx[l] > r.max || (mx[l] == r.max && ag[l] < r.arg)) r = {mx[l], ag[l]};
  if (r.max == -INFINITY) r.arg = 0;
  return r;
}

BT_AVX512 RowMax row_max(isa::Avx512, const float* x, int64_t V) {
  using namespace simd;
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __m512i varg = _mm512_setzero_si512(),
          idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = tail_mask(V - v);
    const __m512 xv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + v);
    const __mmask16 gt = _mm512_cmp_ps_mask(xv, vmax, _CMP_GT_OQ);  // strict: first per lane
    vmax = _mm512_mask_mov_ps(vmax, gt, xv);
    varg = _mm512_mask_mov_epi32(varg, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  alignas(64) float mx[16];
  alignas(64) int32_t ag[16];
  _mm512_store_ps(mx, vmax);
  _mm512_store_si512(ag, varg);
  return first_max_of_lanes(mx, ag, 16);
}

// sum_v exp(x[v] - mx); also writes the exponentials to e when non-null (e may alias x).
BT_AVX512 double sum_exp(isa::Avx512, float* e, const float* x, int64_t V, float mx) {
  using namespace simd;
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = tail_mask(V - v);
    const __m512 ex = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + v), vm));
    acc = _mm512_mask_add_ps(acc, m, acc, ex);
    if (e) _mm512_mask_storeu_ps(e + v, m, ex);
  }
  return _mm512_reduce_add_ps(acc);
}

BT_AVX512 void scale(isa::Avx512, float* d, int64_t V, float s) {
  using namespace simd;
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = tail_mask(V - v);
    _mm512_mask_storeu_ps(d + v, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, d + v), vs));
  }
}

BT_AVX2 RowMax row_max(isa::Avx2, const float* x, int64_t V) {
  using namespace simd;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  __m256i varg = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  for (int64_t v = 0; v < V; v += 8) {
    const __m256 xv = load8_or(x + v, V - v, -INFINITY);
    const __m256 gt = _mm256_cmp_ps(xv, vmax, _CMP_GT_OQ);  // strict: first per lane
    vmax = _mm256_blendv_ps(vmax, xv, gt);
    varg = _mm256_blendv_epi8(varg, idx, _mm256_castps_si256(gt));
    idx = _mm256_add_epi32(idx, step);
  }
  alignas(32) float mx[8];
  alignas(32) int32_t ag[8];
  _mm256_store_ps(mx, vmax);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ag), varg);
  return first_max_of_lanes(mx, ag, 8);
}

BT_AVX2 double sum_exp(isa::Avx2, float* e, const float* x, int64_t V, float mx) {
  using namespace simd;
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t v = 0; v < V; v += 8) {
    // Lanes past V load -inf: exp gives 0 there.
    const __m256 ex = exp8(_mm256_sub_ps(load8_or(x + v, V - v, -INFINITY), vm));
    acc = _mm256_add_ps(acc, ex);
    if (e) store8(e + v, V - v, ex);
  }
  return hsum8(acc);
}

BT_AVX2 void scale(isa::Avx2, float* d, int64_t V, float s) {
  using namespace simd;
  const __m256 vs = _mm256_set1_ps(s);
  for (int64_t v = 0; v < V; v += 8) store8(d + v, V - v, _mm256_mul_ps(load8(d + v, V - v), vs));
}

// One row's loss (the return value), its prediction and, if d is non-null, its gradient. The
// vector rows take three passes: max (and argmax), exp-sum writing the exponentials into d,
// scale; fp32 lane sums of terms <= 1 (relative error ~1e-6 at V = 30522).
template <typename Tag>
double loss_row(Tag tag, float* d, float* loss_out, int32_t* correct, const float* x, int32_t y,
                float w, int64_t V, float dscale) {
  const RowMax rm = row_max(tag, x, V);
  const float xy = x[y];
  const double sum = sum_exp(tag, d, x, V, rm.max);
  const double loss = std::log(sum) + rm.max - xy;
  if (loss_out) *loss_out = static_cast<float>(loss);
  if (correct) *correct = rm.arg == y;
  if (d) {
    const float g = w * dscale;
    scale(tag, d, V, static_cast<float>(g / sum));
    d[y] -= g;
  }
  return loss;
}

// The portable row: the sum in double.
double loss_row(isa::Portable, float* d, float* loss_out, int32_t* correct, const float* x,
                int32_t y, float w, int64_t V, float dscale) {
  float mx = -INFINITY;
  int64_t arg = 0;
  for (int64_t v = 0; v < V; ++v)
    if (x[v] > mx) {
      mx = x[v];
      arg = v;
    }
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(x[v] - mx));
  const double loss = std::log(sum) + mx - x[y];
  if (loss_out) *loss_out = static_cast<float>(loss);
  if (correct) *correct = arg == y;
  if (d) {
    const float inv = static_cast<float>(1.0 / sum);
    const float g = w * dscale;
    for (int64_t v = 0; v < V; ++v) d[v] = std::exp(x[v] - mx) * inv * g;
    d[y] -= g;
  }
  return loss;
}

}  // namespace

double cross_entropy_forward_backward(float* dlogits, float* losses, int32_t* correct,
                                      const float* logits, const int32_t* targets,
                                      const float* weights, int64_t N, Classes c, float dscale) {
  double total = 0.0;
  with_isa([&](auto tag) {
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < N; ++i) {
      const float w = weights ? weights[i] : 1.0f;
      float* d = dlogits ? dlogits + i * c.stride : nullptr;
      total += w * loss_row(tag, d, losses ? losses + i : nullptr, correct ? correct + i : nullptr,
                            logits + i * c.stride, targets[i], w, c.V, dscale);
      if (d) std::fill(d + c.V, d + c.stride, 0.0f);
    }
  });
  return total;
}

}  // namespace bertrain::kernels
