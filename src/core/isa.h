// Run-time instruction-set dispatch. One binary runs on every node of a cluster: kernels have
// an AVX-512 body and an AVX2 + FMA (+ F16C) body (function-level target attributes), taken only
// when the CPU and OS support them, and a portable body otherwise.
// BERTRAIN_ISA=portable|avx2|avx512 caps what is used (oneDNN's JIT too: kernels/cpu/matmul.cpp
// passes the cap on), so the fallbacks are tested on machines that have AVX-512.
#pragma once

#include <string>

namespace bertrain {

enum class Isa { Portable = 0, Avx2 = 1, Avx512 = 2 };

// Detected once (cpuid + xgetbv), capped by BERTRAIN_ISA. Avx512 means F, BW, DQ and VL.
Isa cpu_isa();
bool cpu_has_avx512_bf16();  // AVX-512 BF16 (vdpbf16ps), within the cap
bool isa_capped_by_env();    // BERTRAIN_ISA lowered the detected ISA (matmul.cpp caps oneDNN)
const char* isa_name(Isa isa);
// The processor's brand string (cpuid), e.g. "AMD EPYC 7B13 64-Core Processor".
std::string cpu_model_name();

// The one point where a kernel's instruction set is chosen. Kernels overload each vector body
// on these tags: `body(isa::Avx512, ...)` (AVX-512 F/BW/DQ/VL), `body(isa::Avx2, ...)` (AVX2 + FMA
// + F16C), `body(isa::Portable, ...)` (plain loops, every x86-64 CPU). Avx512 derives from Avx2
// and Avx2 from Portable, so where an instruction set has no body for some operands (the AVX2
// rows take fp32 operands only), overload resolution takes the next one down, at compile time.
// A generic fallback must be a template on the tag (`template <class Tag> body(Tag, ...)`), so
// that what it calls still sees the caller's instruction set.
namespace isa {
struct Portable {};
struct Avx2 : Portable {};
struct Avx512 : Avx2 {};
}  // namespace isa

// Calls f with the tag of cpu_isa() (detected, capped by BERTRAIN_ISA, lowered by the tests'
// override): once per kernel call, outside its loops. Nothing else asks which ISA runs.
template <typename F>
decltype(auto) with_isa(F&& f) {
  switch (cpu_isa()) {
    case Isa::Avx512:
      return f(isa::Avx512{});
    case Isa::Avx2:
      return f(isa::Avx2{});
    case Isa::Portable:
      break;
  }
  return f(isa::Portable{});
}

// Tests: lowers (never raises) the ISA our own kernels use in this process, to compare the
// bodies side by side; reset_isa_override() undoes it. oneDNN is not affected.
void set_isa_override(Isa isa);
void reset_isa_override();

}  // namespace bertrain
