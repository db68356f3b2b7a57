#include "core/dtype.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>

#include "core/error.h"
#include "core/isa.h"
#include "core/parallel.h"
#include "core/simd_avx512.h"

namespace bertrain {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::F16:
      return 2;
    case DType::BF16:
      return 2;
    case DType::F64:
      return 8;
    case DType::I64:
      return 8;
    case DType::I32:
      return 4;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
    case DType::F64:
      return "F64";
    case DType::I64:
      return "I64";
    case DType::I32:
      return "I32";
  }
  return "?";
}

DType dtype_from_name(std::string_view name) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64, DType::I32})
    if (dtype_name(t) == name) return t;
  fail("unsupported dtype '", name, "' (bertrain reads F32, F16, BF16, F64, I64, I32)");
}

namespace {
BT_AVX512 void f32_to_bf16_rows(isa::Avx512, const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 m = simd::tail_mask(static_cast<int64_t>(n - i));
    _mm256_mask_storeu_epi16(dst + i, m, simd::f32_to_bf16_16(_mm512_maskz_loadu_ps(m, src + i)));
  }
}
void f32_to_bf16_rows(isa::Portable, const float* src, uint16_t* dst, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
}  // namespace

void convert_f32_to_bf16(const float* src, uint16_t* dst, size_t n) {
  with_isa([&](auto tag) {
    parallel_chunks(static_cast<int64_t>(n), [&](int64_t b, int64_t e) {
      f32_to_bf16_rows(tag, src + b, dst + b, static_cast<size_t>(e - b));
    });
  });
}
void convert_bf16_to_f32(const uint16_t* src, float* dst, size_t n) {
#pragma omp parallel for simd schedule(static) if (n > (1u << 16))
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
namespace {
// F16C (vcvtps2ph / vcvtph2ps) with the AVX2 bodies (every AVX2 CPU has it; isa.cpp checks); the
// instruction rounds to nearest even exactly as f32_to_f16 does (tests compare both).
#define BT_F16C __attribute__((target("f16c,avx")))
BT_F16C void f32_to_f16_rows(isa::Avx2, const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
void f32_to_f16_rows(isa::Portable, const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
BT_F16C void f16_to_f32_rows(isa::Avx2, const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
void f16_to_f32_rows(isa::Portable, const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
BT_F16C void f16_add_rows(isa::Avx2, const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(
        dst + i,
        _mm256_add_ps(_mm256_loadu_ps(dst + i),
                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)))));
  for (; i < n; ++i) dst[i] += f16_to_f32(src[i]);
}
void f16_add_rows(isa::Portable, const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += f16_to_f32(src[i]);
}
#undef BT_F16C
}  // namespace

void convert_f32_to_f16(const float* src, uint16_t* dst, size_t n) {
  with_isa([&](auto tag) { f32_to_f16_rows(tag, src, dst, n); });
}
void convert_f16_to_f32(const uint16_t* src, float* dst, size_t n) {
  with_isa([&](auto tag) { f16_to_f32_rows(tag, src, dst, n); });
}
void accumulate_f16(const uint16_t* src, float* dst, size_t n) {
  with_isa([&](auto tag) { f16_add_rows(tag, src, dst, n); });
}
void accumulate_bf16(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += bf16_to_f32(src[i]);
}

}  // namespace bertrain
