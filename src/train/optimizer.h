// Optimizers over the flat parameter/gradient buffers: AdamW (PyTorch's torch.optim.AdamW) and
// LAMB (NVIDIA's BERT LAMB, as apex FusedLAMB: bias correction, decoupled decay inside the
// update, per-tensor trust ratio ||p|| / ||u|| for tensors with weight decay). One step is two
// passes: a parallel reduction giving the global gradient norm and whether every gradient is
// finite (for the fp16 loss scaler), then the fused update with unscaling and clipping folded
// in (PyTorch's clip_grad_norm_ rule: coef = max_norm / (norm + 1e-6), at most 1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/params.h"

namespace bertrain::train {

struct ParamSlice {
  std::string name;
  int64_t offset = 0, numel = 0;
  bool decay = true;  // false: LayerNorm weights and biases (BERT's exclusion)
};

// One slice per parameter of a model's table, with its weight-decay flag.
std::vector<ParamSlice> param_slices(const model::ParamTable& table);

enum class OptimizerKind { AdamW, Lamb };
OptimizerKind parse_optimizer(const std::string& s);  // "adamw" | "lamb"
const char* optimizer_name(OptimizerKind k);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::AdamW;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-6f;
  float weight_decay = 0.01f;
  float max_grad_norm = 1.0f;  // 0: no clipping
};

struct StepResult {
  bool finite = true;
  double grad_norm = 0;  // of the unscaled gradients, before clipping
  double clip_coef = 1;
};

class Optimizer {
 public:
  Optimizer(std::vector<ParamSlice> slices, int64_t total, const OptimizerConfig& cfg);

  // Reduction pass only: global norm of grads * inv_scale, and whether all are finite.
  StepResult measure(const float* grads, float inv_scale) const;
  // Updates params from grads * inv_scale with the clipping of `r` (from measure). Increments
  // the step count (bias correction uses it).
  // params_bf16 (optional): also receives the updated parameters rounded to bf16, in the same
  // pass (the bf16 model's weight copy, so its forward need not convert them again).
  void apply(float* params, const float* grads, float lr, float inv_scale, const StepResult& r,
             uint16_t* params_bf16 = nullptr);
  // measure + apply unless a gradient is non-finite (then nothing changes).
  StepResult step(float* params, const float* grads, float lr, float inv_scale,
                  uint16_t* params_bf16 = nullptr);

  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  std::vector<float>& m() { return m_; }
  std::vector<float>& v() { return v_; }
  const std::vector<float>& m() const { return m_; }
  const std::vector<float>& v() const { return v_; }
  const OptimizerConfig& config() const { return cfg_; }
  const std::vector<ParamSlice>& slices() const { return slices_; }

 private:
  std::vector<ParamSlice> slices_;
  OptimizerConfig cfg_;
  std::vector<float> m_, v_;
  int64_t steps_ = 0;
};

// Linear warmup to the peak, then polynomial decay to end_lr at total_steps (power 1: linear,
// as BERT). warmup_steps may be 0.
struct LrSchedule {
  double peak = 1e-4, end = 0.0, power = 1.0;
  int64_t warmup_steps = 0, total_steps = 1;
  double at(int64_t step) const;  // lr used for optimizer step `step` (0-based)
};

}  // namespace bertrain::train
