// CRC32C (Castagnoli), as TFRecord framing uses it: the SSE4.2 crc32 instruction where the CPU
// has it (selected at run time), a slicing-by-8 table otherwise. masked_crc32c is TensorFlow's
// masking: rotate right by 15 and add 0xa282ead8.
#pragma once

#include <cstddef>
#include <cstdint>

namespace bertrain::data {

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const void* data, size_t n) {
  return crc32c_extend(0, data, n);
}
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);  // the fallback, for tests
bool crc32c_hardware_available();

inline uint32_t mask_crc(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}
inline uint32_t masked_crc32c(const void* data, size_t n) {
  return mask_crc(crc32c(data, n));
}

}  // namespace bertrain::data
