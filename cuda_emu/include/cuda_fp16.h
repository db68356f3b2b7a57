// The emulated device's fp16 (cuda_emu/README.md): __half as its bits, rounded from fp32 by the
// compiler's IEEE binary16 (_Float16: round to nearest even, subnormals, infinities and NaN as a
// GPU's conversion instructions) and widened bit by bit (exact: every binary16 value is one of
// fp32's; a NaN stays a NaN of its payload, made quiet, as _Float16's widening does). Not
// _Float16's widening: without AVX512-FP16 GCC calls libgcc's __extendhfsf2 for it, which took
// 73% of an fp16 step of the fused attention (its fragments widened in each product).
#pragma once

#include <cstdint>

struct __half {
  uint16_t bits;
};

namespace cuda_emu {
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, exponent = (h >> 10) & 0x1fu,
                 mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {  // infinity, or NaN made quiet
    bits = sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u);
  } else if (exponent != 0) {  // normal: the exponent rebiased (15 -> 127)
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa x 2^-24, exact in fp32
    const float f = static_cast<float>(mantissa) * 0x1p-24f;
    __builtin_memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
}  // namespace cuda_emu

inline float __half2float(__half h) {
  return cuda_emu::half_bits_to_float(h.bits);
}
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);
  __half h;
  __builtin_memcpy(&h.bits, &f, 2);
  return h;
}
inline __half __float2half(float x) {
  return __float2half_rn(x);
}
inline __half __ushort_as_half(unsigned short b) {
  return __half{b};
}
inline unsigned short __half_as_ushort(__half h) {
  return h.bits;
}
