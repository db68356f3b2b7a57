// Coefficients shared by the AVX-512 and AVX2 bodies of exp and erf, so both widths evaluate
// the same polynomials in the same order (and give the same bits lane for lane).
#pragma once

namespace bertrain::simd {

// exp(x) = 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two for exactness),
// p(r) = 1 + r + r^2 (c0 + c1 r + ... + c5 r^5) evaluated from c0 (Cephes' expf).
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kExpHi = 88.72f;   // exp overflows to inf above this
inline constexpr float kExpLo = -110.0f;  // and is 0 below (denormal between -87.3 and this)
inline constexpr float kExpPoly[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                      4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

// erf(x) = x p(x^2) / q(x^2) on [-4, 4], +-1 outside (Eigen's rational approximation),
// both polynomials evaluated from their first coefficient.
inline constexpr float kErfClamp = 4.0f;
inline constexpr float kErfP[7] = {
    -2.72614225801306e-10f, 2.77068142495902e-08f,  -2.10102402082508e-06f, -5.69250639462346e-05f,
    -7.34990630326855e-04f, -2.95459980854025e-03f, -1.60960333262415e-02f};
inline constexpr float kErfQ[5] = {-1.45660718464996e-05f, -2.13374055278905e-04f,
                                   -1.68282697438203e-03f, -7.37332916720468e-03f,
                                   -1.42647390514189e-02f};

// mix64's multipliers and rng_u64's index multiplier (core/rng.h).
inline constexpr unsigned long long kMixMul1 = 0xbf58476d1ce4e5b9ull;
inline constexpr unsigned long long kMixMul2 = 0x94d049bb133111ebull;
inline constexpr unsigned long long kGolden = 0x9e3779b97f4a7c15ull;

}  // namespace bertrain::simd
