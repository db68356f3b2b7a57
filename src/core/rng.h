// Counter-based random numbers: value = hash(key, index), no state to carry. Dropout masks and
// MLM masking are keyed by (seed, step, layer, site) so a resumed run, a recomputation in
// backward and a different thread count all see the same bits.
#pragma once

#include <cstdint>

// The same functions on the host and in CUDA kernels: a dropout mask is identical on both.
#include "core/host_device.h"

namespace bertrain {

BT_HOST_DEVICE inline uint64_t mix64(
    uint64_t x) {  // splitmix64 finaliser: a bijection with full avalanche
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Combines fields into one stream key; different tuples give unrelated streams.
BT_HOST_DEVICE inline uint64_t rng_key(uint64_t seed, uint64_t a = 0, uint64_t b = 0,
                                       uint64_t c = 0) {
  uint64_t k = mix64(seed + 0x9e3779b97f4a7c15ull);
  k = mix64(k ^ (a + 0x632be59bd9b4e019ull));
  k = mix64(k ^ (b + 0x85157af5ull));
  return mix64(k ^ (c + 0x2545f4914f6cdd1dull));
}

BT_HOST_DEVICE inline uint64_t rng_u64(uint64_t key, uint64_t index) {
  return mix64(key ^ mix64(index * 0x9e3779b97f4a7c15ull + 1));
}

// Uniform in [0, 1) with 24 random bits (exact in float).
BT_HOST_DEVICE inline float rng_uniform(uint64_t key, uint64_t index) {
  return static_cast<float>(rng_u64(key, index) >> 40) * (1.0f / 16777216.0f);
}

}  // namespace bertrain
