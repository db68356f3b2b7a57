#include "data/crc32c.h"

#include <nmmintrin.h>
#include <cstdlib>
#include <cstring>

namespace bertrain::data {

namespace {

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}

using CrcFn = uint32_t (*)(uint32_t, const void*, size_t);

CrcFn select() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2") ? crc32c_sse42 : crc32c_portable;
}

}  // namespace

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  const Tables& T = tables();
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = T.t[7][lo & 0xff] ^ T.t[6][(lo >> 8) & 0xff] ^ T.t[5][(lo >> 16) & 0xff] ^
        T.t[4][lo >> 24] ^ T.t[3][hi & 0xff] ^ T.t[2][(hi >> 8) & 0xff] ^
        T.t[1][(hi >> 16) & 0xff] ^ T.t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ T.t[0][(c ^ *p++) & 0xff];
  return ~c;
}

bool crc32c_hardware_available() {
  return select() != crc32c_portable;
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  static const CrcFn fn = getenv("BERTRAIN_NO_SSE42") ? crc32c_portable : select();
  return fn(crc, data, n);
}

}  // namespace bertrain::data
