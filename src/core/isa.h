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
inline bool use_avx512() {
  return cpu_isa() == Isa::Avx512;
}
// The AVX2 + FMA bodies: on CPUs that have AVX2 but not AVX-512 (or with BERTRAIN_ISA=avx2).
inline bool use_avx2() {
  return cpu_isa() == Isa::Avx2;
}

// Tests: lowers (never raises) the ISA our own kernels use in this process, to compare the
// bodies side by side; reset_isa_override() undoes it. oneDNN is not affected.
void set_isa_override(Isa isa);
void reset_isa_override();

}  // namespace bertrain
