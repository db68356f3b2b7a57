#include "core/precision.h"

#include "core/error.h"
#include "core/setting.h"

namespace bertrain {

Precision parse_precision(const std::string& s) {
  if (s == "fp32") return Precision::FP32;
  if (s == "bf16") return Precision::BF16;
  if (s == "fp16") return Precision::FP16;
  fail(setting("precision"), " must be fp32, bf16 or fp16, got '", s, "'");
}

const char* precision_name(Precision p) {
  return p == Precision::FP32 ? "fp32" : p == Precision::BF16 ? "bf16" : "fp16";
}

}  // namespace bertrain
