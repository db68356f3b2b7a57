#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/setting.h"
#include "plan/memory.h"

namespace bertrain::train {

std::vector<ParamSlice> param_slices(const model::ParamTable& table) {
  std::vector<ParamSlice> slices;
  for (const auto& p : table.params()) slices.push_back({p.name, p.offset, p.numel(), p.decay});
  return slices;
}

OptimizerKind parse_optimizer(const std::string& s) {
  if (s == "adamw") return OptimizerKind::AdamW;
  if (s == "lamb") return OptimizerKind::Lamb;
  fail(setting("optimizer"), " must be adamw or lamb, got '", s, "'");
}

const char* optimizer_name(OptimizerKind k) {
  return k == OptimizerKind::AdamW ? "adamw" : "lamb";
}

Optimizer::Optimizer(std::vector<ParamSlice> slices, int64_t total, const OptimizerConfig& cfg,
                     const kernels::Backend& backend)
    : slices_(std::move(slices)), cfg_(cfg), be_(&backend), total_(total) {
  plan::plan_optimizer_state(plan_, total, 2);
  state_ = Arena(plan_, "optimizer");  // zeroed
  m_ = state_.f32("optimizer.m");
  v_ = state_.f32("optimizer.v");
}

StepResult Optimizer::measure(const float* grads, float inv_scale) const {
  double sum = 0;
  for (const auto& s : slices_) be_->add_sum_squares(sum, grads + s.offset, s.numel, inv_scale);
  // Any inf/NaN gradient makes the sum non-finite; one test covers every element.
  StepResult r;
  r.finite = std::isfinite(sum);
  r.grad_norm = std::sqrt(sum);
  if (r.finite && cfg_.max_grad_norm > 0 && r.grad_norm > cfg_.max_grad_norm)
    r.clip_coef = cfg_.max_grad_norm / (r.grad_norm + 1e-6);
  return r;
}

void Optimizer::apply(float* params, const float* grads, float lr, float inv_scale,
                      const StepResult& r, uint16_t* params_bf16) {
  ++steps_;
  const float b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps;
  const double bc1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(steps_));
  const float gscale = static_cast<float>(inv_scale * r.clip_coef);
  for (const auto& s : slices_) {
    float* p = params + s.offset;
    uint16_t* p16 = params_bf16 ? params_bf16 + s.offset : nullptr;
    const float* g = grads + s.offset;
    float* m = m_ + s.offset;
    float* v = v_ + s.offset;
    const float wd = s.decay ? cfg_.weight_decay : 0.0f;
    if (cfg_.kind == OptimizerKind::AdamW) {
      // torch.optim.AdamW: p *= 1 - lr*wd; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
      const kernels::AdamwStep a{gscale,
                                 b1,
                                 b2,
                                 static_cast<float>(lr / bc1),
                                 static_cast<float>(std::sqrt(bc2)),
                                 eps,
                                 1.0f - lr * wd};
      be_->adamw_update(a, p, p16, g, m, v, s.numel);
    } else {
      // LAMB: u = m_hat / (sqrt(v_hat) + eps) + wd * p; p -= lr * trust * u
      const kernels::LambStep a{
          gscale, b1, b2, static_cast<float>(1.0 / bc1), static_cast<float>(1.0 / bc2),
          eps,    wd, lr};
      be_->lamb_update(a, p, p16, g, m, v, s.numel);
    }
  }
}

StepResult Optimizer::step(float* params, const float* grads, float lr, float inv_scale,
                           uint16_t* params_bf16) {
  StepResult r = measure(grads, inv_scale);
  if (r.finite) apply(params, grads, lr, inv_scale, r, params_bf16);
  return r;
}

double LrSchedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return peak * static_cast<double>(step + 1) / warmup_steps;
  const double span = std::max<int64_t>(1, total_steps - warmup_steps);
  const double frac = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return (peak - end) * std::pow(1.0 - frac, power) + end;
}

}  // namespace bertrain::train
