#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace bertrain::train {

OptimizerKind parse_optimizer(const std::string& s) {
  if (s == "adamw") return OptimizerKind::AdamW;
  if (s == "lamb") return OptimizerKind::Lamb;
  fail("--optimizer must be adamw or lamb, got '", s, "'");
}

const char* optimizer_name(OptimizerKind k) {
  return k == OptimizerKind::AdamW ? "adamw" : "lamb";
}

Optimizer::Optimizer(std::vector<ParamSlice> slices, int64_t total, const OptimizerConfig& cfg)
    : slices_(std::move(slices)), cfg_(cfg), m_(total, 0.0f), v_(total, 0.0f) {}

StepResult Optimizer::measure(const float* grads, float inv_scale) const {
  double sum = 0;
  bool finite = true;
  for (const auto& s : slices_) {
    const float* g = grads + s.offset;
    double part = 0;
#pragma omp parallel for reduction(+ : part) schedule(static) if (s.numel > 65536)
    for (int64_t i = 0; i < s.numel; ++i) {
      const double x = static_cast<double>(g[i]) * inv_scale;
      part += x * x;
    }
    sum += part;
  }
  // Any inf/NaN gradient makes the sum non-finite; one test covers every element.
  finite = std::isfinite(sum);
  StepResult r;
  r.finite = finite;
  r.grad_norm = std::sqrt(sum);
  if (finite && cfg_.max_grad_norm > 0 && r.grad_norm > cfg_.max_grad_norm)
    r.clip_coef = cfg_.max_grad_norm / (r.grad_norm + 1e-6);
  return r;
}

void Optimizer::apply(float* params, const float* grads, float lr, float inv_scale,
                      const StepResult& r) {
  ++steps_;
  const float b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps;
  const double bc1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(steps_));
  const float gscale = static_cast<float>(inv_scale * r.clip_coef);
  for (const auto& s : slices_) {
    float* p = params + s.offset;
    const float* g = grads + s.offset;
    float* m = m_.data() + s.offset;
    float* v = v_.data() + s.offset;
    const float wd = s.decay ? cfg_.weight_decay : 0.0f;
    const int64_t n = s.numel;
    if (cfg_.kind == OptimizerKind::AdamW) {
      // torch.optim.AdamW: p *= 1 - lr*wd; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
      const float step_size = static_cast<float>(lr / bc1);
      const float sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
      const float decay = 1.0f - lr * wd;
#pragma omp parallel for simd schedule(static) if (n > 65536)
      for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i] * gscale;
        m[i] = b1 * m[i] + (1.0f - b1) * gi;
        v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
        p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) / sqrt_bc2 + eps);
      }
    } else {
      // LAMB: u = m_hat / (sqrt(v_hat) + eps) + wd * p; p -= lr * trust * u
      const float ibc1 = static_cast<float>(1.0 / bc1), ibc2 = static_cast<float>(1.0 / bc2);
      double pn = 0, un = 0;
#pragma omp parallel for reduction(+ : pn, un) schedule(static) if (n > 65536)
      for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i] * gscale;
        m[i] = b1 * m[i] + (1.0f - b1) * gi;
        v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
        const float u = (m[i] * ibc1) / (std::sqrt(v[i] * ibc2) + eps) + wd * p[i];
        pn += static_cast<double>(p[i]) * p[i];
        un += static_cast<double>(u) * u;
      }
      float trust = 1.0f;
      if (wd != 0.0f && pn > 0 && un > 0) trust = static_cast<float>(std::sqrt(pn) / std::sqrt(un));
      const float step = lr * trust;
#pragma omp parallel for simd schedule(static) if (n > 65536)
      for (int64_t i = 0; i < n; ++i) {
        const float u = (m[i] * ibc1) / (std::sqrt(v[i] * ibc2) + eps) + wd * p[i];
        p[i] -= step * u;
      }
    }
  }
}

StepResult Optimizer::step(float* params, const float* grads, float lr, float inv_scale) {
  StepResult r = measure(grads, inv_scale);
  if (r.finite) apply(params, grads, lr, inv_scale, r);
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
