// The emulated device's fp16 (cuda_emu/README.md): __half as its bits, converted by the
// compiler's IEEE binary16 (_Float16: round to nearest even, subnormals, infinities and NaN as a
// GPU's conversion instructions).
#pragma once

#include <cstdint>

struct __half {
  uint16_t bits;
};

inline float __half2float(__half h) {
  _Float16 f;
  __builtin_memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
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
