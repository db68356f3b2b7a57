// Loads and stores of attention rows in fp32, bf16 (raw bits) or fp16 (F16), scalar and 16
// lanes: the row passes of the full and the blocked attention kernels write their matmul
// operands (and saved probabilities) in these types through these.
#pragma once

#include <cstdint>

#include <cstring>

#include "core/dtype.h"
#include "core/simd_avx2.h"
#include "core/simd_avx512.h"

namespace bertrain::kernels::rows {

// fp16 bits, a type of their own so that overloads take fp16's conversions (uint16_t is bf16).
struct F16 {
  uint16_t bits;
};

inline void put(float* p, float v) {
  *p = v;
}
inline void put(uint16_t* p, float v) {
  *p = f32_to_bf16(v);
}
inline void put(F16* p, float v) {
  p->bits = f32_to_f16(v);
}

BT_AVX512 inline void put16(float* p, __mmask16 m, __m512 v) {
  _mm512_mask_storeu_ps(p, m, v);
}
BT_AVX512 inline void put16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, simd::f32_to_bf16_16(v));
}
BT_AVX512 inline void put16(F16* p, __mmask16 m, __m512 v) {  // rounds to nearest even
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Saved probabilities are fp32, or bf16 / fp16 (16-bit training: half the memory).
inline float get(const float* p) {
  return *p;
}
inline float get(const uint16_t* p) {
  return bf16_to_f32(*p);
}
inline float get(const F16* p) {
  return f16_to_f32(p->bits);
}
BT_AVX512 inline __m512 get16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
BT_AVX512 inline __m512 get16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
BT_AVX512 inline __m512 get16(const F16* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// 8 lanes (AVX2 + F16C): the first min(n, 8) values; fp16 rows are only saved probabilities.
BT_AVX2 inline __m256 get8(const float* p, int64_t n) {
  return simd::load8(p, n);
}
BT_AVX2 inline __m256 get8(const F16* p, int64_t n) {
  if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t t[8] = {};
  std::memcpy(t, p, static_cast<size_t>(n) * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}
// Stores the first min(n, 8) lanes of v rounded to fp16 (nearest even) and returns them widened.
BT_AVX2 inline __m256 round8(F16* p, int64_t n, __m256 v) {
  const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  } else {
    alignas(16) uint16_t t[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
    std::memcpy(p, t, static_cast<size_t>(n) * sizeof(uint16_t));
  }
  return _mm256_cvtph_ps(h);
}

}  // namespace bertrain::kernels::rows
