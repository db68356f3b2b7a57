// Training precision, shared by pretraining and fine-tuning: fp32; bf16 (bf16 matmuls, fp32
// master weights and optimizer state); fp16 (activations kept in fp16, dynamic loss scaling; fp32
// kernels on a CPU, fp16 matmuls with an fp16 weight copy on a GPU). What each keeps and computes
// is ModelDims' bf16 / fp16 (model/bert.h).
#pragma once

#include <string>

#include "model/bert.h"

namespace bertrain::train {

enum class Precision { FP32, BF16, FP16 };
Precision parse_precision(const std::string& s);  // "fp32" | "bf16" | "fp16", else a clear error
const char* precision_name(Precision p);
// The model dimensions with the precision's flags set.
inline model::ModelDims with_precision(model::ModelDims d, Precision p) {
  d.bf16 = p == Precision::BF16;
  d.fp16 = p == Precision::FP16;
  return d;
}

// The kernels' name for it (kernels/types.h).
inline kernels::Precision kernel_precision(Precision p) {
  return p == Precision::BF16   ? kernels::Precision::BF16
         : p == Precision::FP16 ? kernels::Precision::FP16
                                : kernels::Precision::FP32;
}

}  // namespace bertrain::train
