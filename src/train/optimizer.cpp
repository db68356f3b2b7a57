#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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
    void* p = backend.allocate_for(  // zeroed
        bytes, str("the optimizer's moments (", human_bytes(static_cast<double>(bytes)), ")"));
    device_state_ = std::shared_ptr<void>(p, [be = &backend](void* q) { be->release(q); });
    state_ = Arena(plan_, "optimizer", static_cast<std::byte*>(p));
  }
  m_ = state_.f32("optimizer.m");
  gate_ = reinterpret_cast<kernels::GradientGate*>(state_.f32("optimizer.gate"));
  write_gate(carried_);  // no update applied, loss scale 1
  v_ = state_.f32("optimizer.v");
  pieces_ = pieces();
  for (const Piece& q : pieces_) spans_.push_back({q.offset, q.offset - shard_.begin, q.numel});
  adamw_.resize(pieces_.size());
  lamb_.resize(pieces_.size());
  pn_.resize(pieces_.size());
  un_.resize(pieces_.size());
  trust_.resize(pieces_.size());
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
  be_->add_sum_squares(sum, grads, spans_.data(), count(), inv_scale);
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
                      const StepResult& r, kernels::WeightCopy copy,
                      const SumOverRanks& sum_over_ranks) {
  // (kernels::gradient_gate's factor: the same float from the same doubles)
  update(params, grads, lr, static_cast<float>(inv_scale * r.clip_coef), copy, sum_over_ranks);
}

void Optimizer::write_gate(const kernels::GradientGate& g) {
  if (be_->host_memory())
    *gate_ = g;
  else
    be_->to_device(gate_, &g, sizeof g);
  carried_ = g;
}

void Optimizer::set_steps(int64_t s) {
  BT_CHECK(gated_in_flight_ == 0, "Optimizer::set_steps: ", gated_in_flight_,
           " gated step(s) not read yet");
  steps_ = s;
}

void Optimizer::start_gate(const kernels::LossScale& scale) {
  if (gated_in_flight_ > 0 ||
      (carried_.steps == steps_ && std::memcmp(&carried_.scale, &scale, sizeof scale) == 0))
    return;
  kernels::GradientGate g;
  g.steps = steps_;
  g.scale = scale;
  write_gate(g);
}

void Optimizer::gated_step(float* params, const float* grads, float inv_scale, float lr,
                           kernels::WeightCopy copy, const Issue& run) {
  BT_CHECK(!sharded(), "Optimizer::gated_step: a sharded optimizer's norm needs every rank's part");
  ++gated_in_flight_;
  ++steps_;
  fill_steps(lr, 1.0f, copy);
  const bool adamw = cfg_.kind == OptimizerKind::AdamW;
  if (adamw)
    be_->stage_update(adamw_.data(), spans_.data(), count());
  else
    be_->stage_update(lamb_.data(), spans_.data(), count());
  run([&] {
    be_->gate_gradients(gate_, grads, spans_.data(), count(), inv_scale, cfg_.max_grad_norm);
    if (adamw)
      be_->adamw_update(adamw_.data(), params, copy.bits, grads, m_, v_, spans_.data(), count(),
                        gate_);
    else
      be_->lamb_update(lamb_.data(), params, copy.bits, grads, m_, v_, spans_.data(), count(),
                       gate_);
  });
}

void Optimizer::gate_read(const kernels::GradientGate& last) {
  carried_ = last;
  steps_ = last.steps;
  gated_in_flight_ = 0;
}

void Optimizer::fill_steps(float lr, float gscale, kernels::WeightCopy copy) {
  const float b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps;
  // (bias corrections of update steps_; under a gate the device's count replaces it: gated)
  if (cfg_.kind == OptimizerKind::AdamW) {
    // torch.optim.AdamW: p *= 1 - lr*wd; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const float wd = slices_[pieces_[i].slice].decay ? cfg_.weight_decay : 0.0f;
      adamw_[i] = {gscale, b1, b2, 0.0f, 0.0f, eps, 1.0f - lr * wd, copy.f16, lr};
      kernels::bias_correct(adamw_[i], steps_);
    }
    return;
  }
  // LAMB: u = m_hat / (sqrt(v_hat) + eps) + wd * p; p -= lr * trust * u
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const float wd = slices_[pieces_[i].slice].decay ? cfg_.weight_decay : 0.0f;
    lamb_[i] = {gscale, b1, b2, 0.0f, 0.0f, eps, wd, lr, copy.f16};
    kernels::bias_correct(lamb_[i], steps_);
  }
}

void Optimizer::update(float* params, const float* grads, float lr, float gscale,
                       kernels::WeightCopy copy, const SumOverRanks& sum_over_ranks) {
  ++steps_;
  fill_steps(lr, gscale, copy);
  if (cfg_.kind == OptimizerKind::AdamW) {
    be_->adamw_update(adamw_.data(), params, copy.bits, grads, m_, v_, spans_.data(), count(),
                      nullptr);
    return;
  }
  if (!sharded()) {
    be_->lamb_update(lamb_.data(), params, copy.bits, grads, m_, v_, spans_.data(), count(),
                     nullptr);
    return;
  }
  // A tensor may be split between ranks: its trust ratio needs the norms of all its parts.
  BT_CHECK(static_cast<bool>(sum_over_ranks), "a sharded LAMB step needs sum_over_ranks");
  std::fill(pn_.begin(), pn_.end(), 0.0);
  std::fill(un_.begin(), un_.end(), 0.0);
  be_->lamb_moments(lamb_.data(), params, grads, m_, v_, spans_.data(), count(), pn_.data(),
                    un_.data());
  std::vector<double> norms(2 * slices_.size(), 0.0);
  for (size_t i = 0; i < pieces_.size(); ++i) {
    norms[2 * pieces_[i].slice] = pn_[i];
    norms[2 * pieces_[i].slice + 1] = un_[i];
  }
  sum_over_ranks(norms.data(), static_cast<int64_t>(norms.size()));
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const int64_t q = pieces_[i].slice;
    trust_[i] = lamb_[i].lr * kernels::lamb_trust(lamb_[i], norms[2 * q], norms[2 * q + 1]);
  }
  be_->lamb_apply(lamb_.data(), params, copy.bits, m_, v_, spans_.data(), count(), trust_.data());
}

StepResult Optimizer::step(float* params, const float* grads, float lr, float inv_scale,
                           kernels::WeightCopy copy) {
  StepResult r = measure(grads, inv_scale);
  if (r.finite) apply(params, grads, lr, inv_scale, r, copy);
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
