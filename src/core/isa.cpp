#include "core/isa.h"

#include <cpuid.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace bertrain {
namespace {

struct Detected {
  Isa isa = Isa::Portable;
  bool bf16 = false;
  bool capped = false;  // BERTRAIN_ISA lowered it
};

uint64_t xcr0() {
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

Detected detect() {
  Detected d;
  unsigned a, b, c, dx;
  if (!__get_cpuid(1, &a, &b, &c, &dx)) return d;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return d;
  const uint64_t x = xcr0();
  const bool ymm_state = (x & 6) == 6, zmm_state = (x & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &dx)) return d;
  const bool avx2 = b & (1u << 5);
  const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  if (avx2 && fma && f16c && ymm_state) d.isa = Isa::Avx2;  // every AVX2 CPU has F16C
  // AVX-512 bodies may fall back to AVX2 ones (isa.h), so Avx512 includes Avx2.
  if (d.isa == Isa::Avx2 && f && dq && bw && vl && zmm_state) d.isa = Isa::Avx512;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (d.isa == Isa::Avx512 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) d.bf16 = a1 & (1u << 5);
  return d;
}

Detected capped() {
  Detected d = detect();
  const char* env = std::getenv("BERTRAIN_ISA");
  if (!env || !*env) return d;
  Isa cap;
  if (!std::strcmp(env, "portable"))
    cap = Isa::Portable;
  else if (!std::strcmp(env, "avx2"))
    cap = Isa::Avx2;
  else if (!std::strcmp(env, "avx512"))
    cap = Isa::Avx512;
  else
    fail("BERTRAIN_ISA must be portable, avx2 or avx512, got '", env, "'");
  if (cap < d.isa) {
    d.isa = cap;
    d.bf16 = false;
    d.capped = true;
  }
  return d;
}

const Detected& detected() {
  static const Detected d = capped();
  return d;
}

std::atomic<int> g_override{-1};

}  // namespace

Isa cpu_isa() {
  const int o = g_override.load(std::memory_order_relaxed);
  const Isa d = detected().isa;
  return o >= 0 && static_cast<Isa>(o) < d ? static_cast<Isa>(o) : d;
}

void set_isa_override(Isa isa) {
  g_override = static_cast<int>(isa);
}

void reset_isa_override() {
  g_override = -1;
}

bool isa_capped_by_env() {
  return detected().capped;
}

bool cpu_has_avx512_bf16() {
  return detected().bf16;
}

std::string cpu_model_name() {
  unsigned r[12] = {};
  unsigned top = __get_cpuid_max(0x80000000, nullptr);
  if (top < 0x80000004) return "unknown CPU";
  for (unsigned i = 0; i < 3; ++i)
    __get_cpuid(0x80000002 + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
  std::string s(reinterpret_cast<const char*>(r), sizeof r);
  s = s.c_str();  // up to the first NUL
  const size_t b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
  return b == std::string::npos ? "unknown CPU" : s.substr(b, e - b + 1);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Portable:
      return "portable";
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
  }
  return "?";
}

}  // namespace bertrain
