// Loads and stores of attention rows in fp32 or bf16 (raw bits), scalar and 16 lanes: the row
// passes of the full and the blocked attention kernels write their matmul operands (and saved
// probabilities) in either type through these.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/simd_avx512.h"

namespace bertrain::kernels::rows {

inline void put(float* p, float v) {
  *p = v;
}
inline void put(uint16_t* p, float v) {
  *p = f32_to_bf16(v);
}

BT_AVX512 inline void put16(float* p, __mmask16 m, __m512 v) {
  _mm512_mask_storeu_ps(p, m, v);
}
BT_AVX512 inline void put16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, simd::f32_to_bf16_16(v));
}

// Saved probabilities are fp32, or bf16 (bf16 training: half the memory).
inline float get(const float* p) {
  return *p;
}
inline float get(const uint16_t* p) {
  return bf16_to_f32(*p);
}
BT_AVX512 inline __m512 get16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
BT_AVX512 inline __m512 get16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

}  // namespace bertrain::kernels::rows
