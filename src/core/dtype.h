// Storage dtypes and fp32 <-> bf16/fp16 conversion with round-to-nearest-even.
// NaN stays NaN (quiet) and overflow rounds to infinity, as the IEEE formats require;
// fp16 subnormals are produced and read exactly.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/host_device.h"

namespace bertrain {

enum class DType : uint8_t { F32, F16, BF16, F64, I64, I32 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);          // safetensors spelling: "F32", "BF16", ...
DType dtype_from_name(std::string_view name);  // throws Error for names it does not know

// These also run in CUDA kernels (the optimizer writes the 16-bit weight copy on either device).
BT_HOST_DEVICE inline uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
BT_HOST_DEVICE inline float bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// bf16 is the top half of an fp32; rounding adds 0x7fff plus the lowest kept bit.
BT_HOST_DEVICE inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
BT_HOST_DEVICE inline float bf16_to_f32(uint16_t h) {
  return bits_f32(static_cast<uint32_t>(h) << 16);
}

// fp16: 1 sign, 5 exponent (bias 15), 10 mantissa bits (also in CUDA kernels: the optimizer
// writes FP16's weight copy on the GPU).
BT_HOST_DEVICE inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x47800000u) {
    // >= 65536: either infinity, or a value that rounds to infinity.
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in fp16: value = m * 2^-24 with m < 1024.
    // Shift the full 24-bit significand into place and round to nearest even.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to 0
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 113 - exp + 13
    uint32_t half = 1u << (shift - 1);
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t m = mant >> shift;
    if (rem > half || (rem == half && (m & 1u))) m += 1;
    return static_cast<uint16_t>(sign | m);
  }
  // Normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits.
  uint32_t v = abs - (112u << 23);
  uint32_t rem = v & 0x1fffu;
  uint32_t h = v >> 13;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1;  // may carry into inf: correct
  return static_cast<uint16_t>(sign | h);
}

BT_HOST_DEVICE inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Bulk conversions (used by checkpoints and the mixed-precision paths).
void convert_f32_to_bf16(const float* src, uint16_t* dst, size_t n);
void convert_bf16_to_f32(const uint16_t* src, float* dst, size_t n);
void convert_f32_to_f16(const float* src, uint16_t* dst, size_t n);
void convert_f16_to_f32(const uint16_t* src, float* dst, size_t n);
// dst[i] += value of src[i] (the receive side of a compressed reduction).
void accumulate_f16(const uint16_t* src, float* dst, size_t n);
void accumulate_bf16(const uint16_t* src, float* dst, size_t n);

}  // namespace bertrain
