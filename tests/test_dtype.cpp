// fp32 <-> bf16/fp16 conversion: exhaustive over every 16-bit pattern for the widening direction,
// and against independent oracles for rounding (GCC's _Float16 for fp16; an exact
// nearest-even reference in double for bf16).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/dtype.h"
#include "core/error.h"

namespace bertrain {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_from_name("BF16"), DType::BF16);
  EXPECT_THROW(dtype_from_name("F8_E4M3"), Error);
}

TEST(Fp16, EveryValueRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(static_cast<uint16_t>(h));
    _Float16 ref;
    uint16_t hh = static_cast<uint16_t>(h);
    std::memcpy(&ref, &hh, 2);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(ref)));
      continue;
    }
    ASSERT_EQ(f32_bits(f), f32_bits(static_cast<float>(ref))) << std::hex << h;
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
}

TEST(Fp16, RoundsToNearestEvenLikeTheHardware) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    // Random bit patterns cover every exponent, subnormals and overflow.
    float f = bits_f32(bits(rng));
    if (std::isnan(f)) continue;
    _Float16 ref = static_cast<_Float16>(f);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    ASSERT_EQ(f32_to_f16(f), rb) << f;
  }
  // Ties: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10 -> even (1.0).
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even (0)
}

uint16_t bf16_reference(float f) {
  // Candidates are the two bf16 values around f; pick the nearer, ties to even mantissa.
  uint32_t u = f32_bits(f);
  uint16_t lo = static_cast<uint16_t>(u >> 16);
  uint16_t hi = static_cast<uint16_t>(lo + 1);
  double dlo = std::fabs(static_cast<double>(bf16_to_f32(lo)) - f);
  double dhi = std::fabs(static_cast<double>(bf16_to_f32(hi)) - f);
  if ((u & 0xffff) == 0) return lo;
  if ((lo & 0x7f80) == 0x7f80) return lo;                                      // already inf
  if (std::isinf(bf16_to_f32(hi))) dhi = std::ldexp(1.0, 128) - std::fabs(f);  // distance to 2^128
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Bf16, RoundsToNearestEven) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    float f = bits_f32(bits(rng));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_bf16(f), bf16_reference(f)) << f;
  }
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      ASSERT_EQ(f32_to_bf16(f), h);
    }
  }
}

TEST(Convert, BulkMatchesScalar) {
  std::vector<float> x(100000);
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0, 100);
  for (auto& v : x) v = d(rng);
  // Specials and ties in the vector bodies' lanes: NaNs (quiet and signalling, both signs),
  // infinities, denormals, exact bf16 ties (0x8000 low bits, odd and even), the largest floats.
  const uint32_t specials[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0xff800000u, 0x7f800000u,
                               0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u, 0x7f7fffffu,
                               0xff7fffffu, 0x00000000u, 0x80000000u, 0x7f7f8000u};
  for (size_t i = 0; i < std::size(specials); ++i) std::memcpy(&x[i * 7 + 3], &specials[i], 4);
  std::vector<uint16_t> b(x.size()), h(x.size());
  std::vector<float> back(x.size());
  convert_f32_to_bf16(x.data(), b.data(), x.size());
  convert_f32_to_f16(x.data(), h.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(b[i], f32_to_bf16(x[i])) << i;
    ASSERT_EQ(h[i], f32_to_f16(x[i])) << i;
  }
  // Short tails (lengths that are not multiples of the vector width) convert exactly too.
  for (size_t n : {1, 15, 17, 33}) {
    std::vector<uint16_t> t(n + 1, 0xabcd);
    convert_f32_to_bf16(x.data(), t.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(t[i], f32_to_bf16(x[i]));
    ASSERT_EQ(t[n], 0xabcd) << "wrote past the end";
  }
  convert_bf16_to_f32(b.data(), back.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnormal(x[i]) && std::fabs(x[i]) < 1e38f) {
      ASSERT_LE(std::fabs(back[i] - x[i]), std::fabs(x[i]) * 0x1p-8f);
    }
  }
}

}  // namespace
}  // namespace bertrain
