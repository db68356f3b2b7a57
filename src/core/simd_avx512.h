// AVX-512 building blocks for the fused kernels: exp, erf, the counter-based dropout RNG, and
// masked row loads, all inline and compiled for AVX-512 only inside functions marked
// BT_AVX512 (the rest of the binary stays baseline x86-64; isa.h decides at run time).
// Accuracy: exp within 2 ulp of expf on [-87, 88.7] (denormal or 0 below); erf within 3e-7
// absolute (Eigen's rational approximation on [-4, 4], +/-1 outside). Tests hold both to
// the libm functions.
#pragma once

// GCC 12 reports its own _mm512_undefined_* placeholders inside the intrinsics as
// "may be used uninitialized" once they are inlined; the warning is about the header, not us.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstdint>

#include "core/simd_consts.h"

#define BT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))

namespace bertrain::simd {

BT_AVX512 inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpHi)), _mm512_set1_ps(kExpLo));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);  // p * 2^n, underflows to 0 and handles the full range
}

BT_AVX512 inline __m512 erf_ps(__m512 a) {
  const __m512 x =
      _mm512_max_ps(_mm512_min_ps(a, _mm512_set1_ps(kErfClamp)), _mm512_set1_ps(-kErfClamp));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(kErfP[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(kErfP[i]));
  p = _mm512_mul_ps(x, p);
  __m512 q = _mm512_set1_ps(kErfQ[0]);
  for (int i = 1; i < 5; ++i) q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(kErfQ[i]));
  return _mm512_div_ps(p, q);
}

// mix64 (core/rng.h) on 8 lanes.
BT_AVX512 inline __m512i mix64_epi64(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 30));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64(static_cast<long long>(kMixMul1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 27));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64(static_cast<long long>(kMixMul2)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
}

// rng_uniform(key, index0 + i) for i = 0..15: bit-identical to the scalar function.
BT_AVX512 inline __m512 rng_uniform16(uint64_t key, uint64_t index0) {
  const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i k = _mm512_set1_epi64(static_cast<long long>(key));
  const __m512i g = _mm512_set1_epi64(static_cast<long long>(kGolden));
  __m256 half[2];
  for (int h = 0; h < 2; ++h) {
    __m512i idx = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(index0 + 8 * h)), lane);
    __m512i u = mix64_epi64(_mm512_add_epi64(_mm512_mullo_epi64(idx, g), _mm512_set1_epi64(1)));
    u = mix64_epi64(_mm512_xor_si512(k, u));
    half[h] = _mm256_mul_ps(_mm512_cvtepi64_ps(_mm512_srli_epi64(u, 40)),
                            _mm256_set1_ps(1.0f / 16777216.0f));
  }
  return _mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1);
}

// Dropout multiplier for 16 elements: keep / (1 - p) or 0.
BT_AVX512 inline __m512 dropout_scale16(float p, float keep_scale, uint64_t key, uint64_t index0) {
  const __mmask16 keep =
      _mm512_cmp_ps_mask(rng_uniform16(key, index0), _mm512_set1_ps(p), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, _mm512_set1_ps(keep_scale));
}

// Round to bf16 (nearest even, NaN kept quiet): the same bits as core/dtype.h f32_to_bf16.
BT_AVX512 inline __m256i f32_to_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  __m512i r = _mm512_add_epi32(
      u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_mov_epi32(r, nan,
                            _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// Mask of the first n (< 16) lanes, or all 16.
BT_AVX512 inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

}  // namespace bertrain::simd
