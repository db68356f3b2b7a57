// The one precision type: what a run trains in, what the model keeps, what the kernels' matmuls
// read and what gradients travel in on the wire.
//   FP32  everything fp32.
//   BF16  matmuls on bf16 operands (a bf16 copy of the weights and of the kept activations) with
//         fp32 accumulation; fp32 master weights and optimizer state.
//   FP16  the kept activations stored in fp16 under a dynamic loss scale; the kernels compute in
//         fp32 on a CPU, a GPU's matmuls take fp16 operands (kernels::Target::fp16_operands).
// Gradients, LayerNorm, softmax and losses are fp32 in every precision (kernels/backend.h says
// the rules). As a wire format (comm, --compression): the 16 bits gradient sums travel and add
// in; FP32 is no compression.
#pragma once

#include <cstdint>
#include <string>

namespace bertrain {

enum class Precision : uint8_t { FP32, BF16, FP16 };

// "fp32" | "bf16" | "fp16"; anything else a clear error naming the precision setting.
Precision parse_precision(const std::string& s);
const char* precision_name(Precision p);
// Bytes of one value as the precision stores it: 4, or 2 for the 16-bit ones.
inline int precision_bytes(Precision p) {
  return p == Precision::FP32 ? 4 : 2;
}

}  // namespace bertrain
