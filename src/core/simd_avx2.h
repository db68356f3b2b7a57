// AVX2 + FMA (+ F16C) building blocks: the 8-lane twins of simd_avx512.h for CPUs without AVX-512
// (AMD Zen 2/3, older Intel). Compiled only inside functions marked BT_AVX2; isa.h decides at
// run time. exp and erf evaluate the same polynomials in the same order as the 16-lane versions
// (simd_consts.h), so both widths give the same bits lane for lane; the dropout RNG is
// bit-identical to the scalar rng_uniform (64-bit products built from 32-bit ones: AVX2 has no
// 64-bit multiply).
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstdint>

#include "core/simd_consts.h"

#define BT_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace bertrain::simd {

// Lanes [0, n) set (all 8 when n >= 8).
BT_AVX2 inline __m256i tail8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The first min(n, 8) floats at p; the other lanes 0 (never read).
BT_AVX2 inline __m256 load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail8(n));
}

// The same, with `fill` in the lanes past n.
BT_AVX2 inline __m256 load8_or(const float* p, int64_t n, float fill) {
  if (n >= 8) return _mm256_loadu_ps(p);
  const __m256i m = tail8(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}

// Stores the first min(n, 8) lanes.
BT_AVX2 inline void store8(float* p, int64_t n, __m256 v) {
  if (n >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, tail8(n), v);
}

BT_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

BT_AVX2 inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

BT_AVX2 inline double hsum4d(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

// acc + x^2 over 8 floats, in double (two 4-lane halves).
BT_AVX2 inline __m256d add_squares8(__m256d acc, __m256 x) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  return _mm256_add_pd(acc, _mm256_add_pd(_mm256_mul_pd(lo, lo), _mm256_mul_pd(hi, hi)));
}

// acc + x over 8 floats, in double.
BT_AVX2 inline __m256d add_wide8(__m256d acc, __m256 x) {
  return _mm256_add_pd(acc, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                                          _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))));
}

// 2^n for integral n in [-126, 127], as a float.
BT_AVX2 inline __m256 pow2i8(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

// exp on 8 lanes: exp_ps's steps; p * 2^n as two exact halves of the exponent (AVX2 has no
// scalef), so underflow to denormals and 0 rounds once, as scalef does.
BT_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpHi)), _mm256_set1_ps(kExpLo));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2i8(n1)), pow2i8(_mm256_sub_epi32(ni, n1)));
}

BT_AVX2 inline __m256 erf8(__m256 a) {
  const __m256 x =
      _mm256_max_ps(_mm256_min_ps(a, _mm256_set1_ps(kErfClamp)), _mm256_set1_ps(-kErfClamp));
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(kErfP[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(kErfP[i]));
  p = _mm256_mul_ps(x, p);
  __m256 q = _mm256_set1_ps(kErfQ[0]);
  for (int i = 1; i < 5; ++i) q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(kErfQ[i]));
  return _mm256_div_ps(p, q);
}

// a * c modulo 2^64 on 4 lanes, from three 32 x 32 -> 64-bit products.
BT_AVX2 inline __m256i mullo64(__m256i a, unsigned long long c) {
  const __m256i clo = _mm256_set1_epi64x(static_cast<long long>(c & 0xffffffffull));
  const __m256i chi = _mm256_set1_epi64x(static_cast<long long>(c >> 32));
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), clo), _mm256_mul_epu32(a, chi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, clo), _mm256_slli_epi64(cross, 32));
}

// mix64 (core/rng.h) on 4 lanes.
BT_AVX2 inline __m256i mix64_4(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 30));
  x = mullo64(x, kMixMul1);
  x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 27));
  x = mullo64(x, kMixMul2);
  return _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
}

// rng_uniform(key, index0 + i) for i = 0..7: bit-identical to the scalar function.
BT_AVX2 inline __m256 rng_uniform8(uint64_t key, uint64_t index0) {
  const __m256i k = _mm256_set1_epi64x(static_cast<long long>(key));
  const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // low dwords first
  __m128i bits[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i idx = _mm256_add_epi64(_mm256_set1_epi64x(static_cast<long long>(index0 + 4 * h)),
                                         _mm256_setr_epi64x(0, 1, 2, 3));
    __m256i u = mix64_4(_mm256_add_epi64(mullo64(idx, kGolden), _mm256_set1_epi64x(1)));
    u = mix64_4(_mm256_xor_si256(k, u));
    // The top 24 bits fit the low dword of each lane.
    bits[h] = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_srli_epi64(u, 40), pick));
  }
  const __m256i all = _mm256_inserti128_si256(_mm256_castsi128_si256(bits[0]), bits[1], 1);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(all), _mm256_set1_ps(1.0f / 16777216.0f));
}

// Dropout multiplier for 8 elements: keep / (1 - p) or 0.
BT_AVX2 inline __m256 dropout_scale8(float p, float keep_scale, uint64_t key, uint64_t index0) {
  const __m256 keep = _mm256_cmp_ps(rng_uniform8(key, index0), _mm256_set1_ps(p), _CMP_GE_OQ);
  return _mm256_and_ps(keep, _mm256_set1_ps(keep_scale));
}

}  // namespace bertrain::simd
