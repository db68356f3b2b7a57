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

Shard shard_of(int64_t total, int rank, int world) {
  BT_CHECK(world >= 1 && rank >= 0 && rank < world, "shard_of: rank ", rank, " of ", world);
  const auto [begin, end] = plan::shard_range(total, rank, world);
  return {rank, world, begin, end};
}

std::vector<int64_t> shard_counts(int64_t total, int world) {
  std::vector<int64_t> counts;
  for (int r = 0; r < world; ++r) counts.push_back(shard_of(total, r, world).size());
  return counts;
}

Optimizer::Optimizer(std::vector<ParamSlice> slices, int64_t total, const OptimizerConfig& cfg,
                     const kernels::Backend& backend, Shard shard)
    : slices_(std::move(slices)),
      shard_(shard.world > 1 ? shard : shard_of(total, 0, 1)),
      cfg_(cfg),
      be_(&backend),
      total_(total) {
  BT_CHECK(shard_.begin >= 0 && shard_.end <= total && shard_.begin <= shard_.end,
           "optimizer shard [", shard_.begin, ", ", shard_.end, ") outside ", total, " parameters");
  plan::plan_optimizer_state(plan_, shard_.size(), 2);
  if (backend.host_memory()) {
    state_ = Arena(plan_, "optimizer");  // zeroed
  } else {
    const size_t bytes = std::max<size_t>(plan_.group_span("optimizer"), kAlign);
    void* p = nullptr;
    try {
      p = backend.allocate(bytes);  // zeroed
    } catch (const Error& e) {
      fail("the optimizer's moments (", human_bytes(static_cast<double>(bytes)), ") on the ",
           backend.name(), " device: ", e.what(), "; `bertrain estimate --device ", backend.name(),
           "` prints the plan and the largest batch that fits");
    }
    device_state_ = std::shared_ptr<void>(p, [be = &backend](void* q) { be->release(q); });
    state_ = Arena(plan_, "optimizer", static_cast<std::byte*>(p));
  }
  m_ = state_.f32("optimizer.m");
  v_ = state_.f32("optimizer.v");
}

std::vector<Optimizer::Piece> Optimizer::pieces() const {
  std::vector<Piece> out;
  for (size_t i = 0; i < slices_.size(); ++i) {
    const int64_t b = std::max(slices_[i].offset, shard_.begin);
    const int64_t e = std::min(slices_[i].offset + slices_[i].numel, shard_.end);
    if (e > b) out.push_back({static_cast<int64_t>(i), b, e - b});
  }
  return out;
}

double Optimizer::sum_squares(const float* grads, float inv_scale) const {
  double sum = 0;
  for (const Piece& p : pieces()) be_->add_sum_squares(sum, grads + p.offset, p.numel, inv_scale);
  return sum;
}

StepResult Optimizer::measure(const float* grads, float inv_scale) const {
  return result(sum_squares(grads, inv_scale));
}

StepResult Optimizer::result(double sum) const {
  // Any inf/NaN gradient makes the sum non-finite; one test covers every element.
  StepResult r;
  r.finite = std::isfinite(sum);
  r.grad_norm = std::sqrt(sum);
  if (r.finite && cfg_.max_grad_norm > 0 && r.grad_norm > cfg_.max_grad_norm)
    r.clip_coef = cfg_.max_grad_norm / (r.grad_norm + 1e-6);
  return r;
}

void Optimizer::apply(float* params, const float* grads, float lr, float inv_scale,
                      const StepResult& r, uint16_t* params_bf16,
                      const SumOverRanks& sum_over_ranks) {
  ++steps_;
  const float b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps;
  const double bc1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(steps_));
  const float gscale = static_cast<float>(inv_scale * r.clip_coef);
  const std::vector<Piece> parts = pieces();
  auto lamb_step = [&](const ParamSlice& s) {
    const float wd = s.decay ? cfg_.weight_decay : 0.0f;
    return kernels::LambStep{
        gscale, b1, b2, static_cast<float>(1.0 / bc1), static_cast<float>(1.0 / bc2), eps, wd, lr};
  };
  if (cfg_.kind == OptimizerKind::Lamb && sharded()) {
    // A tensor may be split between ranks: its trust ratio needs the norms of all its parts.
    BT_CHECK(static_cast<bool>(sum_over_ranks), "a sharded LAMB step needs sum_over_ranks");
    std::vector<double> norms(2 * slices_.size(), 0.0);
    for (const Piece& q : parts)
      be_->lamb_moments(lamb_step(slices_[q.slice]), params + q.offset, grads + q.offset,
                        m_ + (q.offset - shard_.begin), v_ + (q.offset - shard_.begin), q.numel,
                        norms[2 * q.slice], norms[2 * q.slice + 1]);
    sum_over_ranks(norms.data(), static_cast<int64_t>(norms.size()));
    for (const Piece& q : parts) {
      const kernels::LambStep a = lamb_step(slices_[q.slice]);
      be_->lamb_apply(a, params + q.offset, params_bf16 ? params_bf16 + q.offset : nullptr,
                      m_ + (q.offset - shard_.begin), v_ + (q.offset - shard_.begin), q.numel,
                      a.lr * kernels::lamb_trust(a, norms[2 * q.slice], norms[2 * q.slice + 1]));
    }
    return;
  }
  for (const Piece& q : parts) {
    const ParamSlice& s = slices_[q.slice];
    float* p = params + q.offset;
    uint16_t* p16 = params_bf16 ? params_bf16 + q.offset : nullptr;
    const float* g = grads + q.offset;
    float* m = m_ + (q.offset - shard_.begin);
    float* v = v_ + (q.offset - shard_.begin);
    if (cfg_.kind == OptimizerKind::AdamW) {
      // torch.optim.AdamW: p *= 1 - lr*wd; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
      const float wd = s.decay ? cfg_.weight_decay : 0.0f;
      const kernels::AdamwStep a{gscale,
                                 b1,
                                 b2,
                                 static_cast<float>(lr / bc1),
                                 static_cast<float>(std::sqrt(bc2)),
                                 eps,
                                 1.0f - lr * wd};
      be_->adamw_update(a, p, p16, g, m, v, q.numel);
    } else {
      // LAMB: u = m_hat / (sqrt(v_hat) + eps) + wd * p; p -= lr * trust * u
      be_->lamb_update(lamb_step(s), p, p16, g, m, v, q.numel);
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
