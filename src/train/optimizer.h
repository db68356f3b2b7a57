// Optimizers over the flat parameter/gradient buffers: AdamW (PyTorch's torch.optim.AdamW) and
// LAMB (NVIDIA's BERT LAMB, as apex FusedLAMB: bias correction, decoupled decay inside the
// update, per-tensor trust ratio ||p|| / ||u|| for tensors with weight decay). One step is two
// passes: a parallel reduction giving the global gradient norm and whether every gradient is
// finite (for the fp16 loss scaler), then the fused update with unscaling and clipping folded
// in (PyTorch's clip_grad_norm_ rule: coef = max_norm / (norm + 1e-6), at most 1).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/arena.h"
#include "kernels/backend.h"
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
  // The update kernels run on `backend` (the CPU's unless told), over its memory.
  Optimizer(std::vector<ParamSlice> slices, int64_t total, const OptimizerConfig& cfg,
            const kernels::Backend& backend = kernels::cpu_backend());

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
  // The moments, in the optimizer group of the memory plan (plan::plan_optimizer_state).
  std::span<float> m() const { return {m_, static_cast<size_t>(total_)}; }
  std::span<float> v() const { return {v_, static_cast<size_t>(total_)}; }
  const MemoryPlan& plan() const { return plan_; }
  size_t allocated_bytes() const { return state_.bytes(); }
  const OptimizerConfig& config() const { return cfg_; }
  const std::vector<ParamSlice>& slices() const { return slices_; }

 private:
  std::vector<ParamSlice> slices_;
  OptimizerConfig cfg_;
  const kernels::Backend* be_;
  int64_t total_;
  MemoryPlan plan_;
  Arena state_;
  float *m_, *v_;
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
