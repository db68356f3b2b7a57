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

// These four also run in CUDA kernels (the optimizer writes the bf16 copy on either device).
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

uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);

// Bulk conversions (used by checkpoints and the mixed-precision paths).
void convert_f32_to_bf16(const float* src, uint16_t* dst, size_t n);
void convert_bf16_to_f32(const uint16_t* src, float* dst, size_t n);
void convert_f32_to_f16(const float* src, uint16_t* dst, size_t n);
void convert_f16_to_f32(const uint16_t* src, float* dst, size_t n);
// dst[i] += value of src[i] (the receive side of a compressed reduction).
void accumulate_f16(const uint16_t* src, float* dst, size_t n);
void accumulate_bf16(const uint16_t* src, float* dst, size_t n);

}  // namespace bertrain
