#include "train/step.h"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "core/setting.h"

namespace bertrain::train {

// A rank's sums over a step's micro-batches, summed over the ranks in one allreduce with the
// gradients' phase (doubles only: the struct travels as an array).
struct StepStats {
  double loss = 0, mlm_correct = 0, mlm_weight = 0, nsp_correct = 0, cls_correct = 0;
  double examples = 0;
  double nonfinite_losses = 0;  // micro-batches whose loss was not finite
  double grad_sum_squares = 0;  // sharded optimizer: the squared gradient norm of this rank's part
  double real_tokens = 0, computed_tokens = 0, token_slots = 0;

  static constexpr size_t kCount = 11;
  void allreduce_sum(comm::Communicator& c) {
    auto a = std::bit_cast<std::array<double, kCount>>(*this);
    c.allreduce_sum(a.data(), static_cast<int64_t>(kCount));
    *this = std::bit_cast<StepStats>(a);
  }
};
static_assert(sizeof(StepStats) == StepStats::kCount * sizeof(double));

// What a deferred step's device results come back into (page-locked host memory, a ring).
struct StepRecord {
  model::StepSums sums;
  kernels::GradientGate gate;
};
// (a step makes at least 5 marks, so no more than this many wait for a read; run() checks both)
constexpr int64_t kRecords = kernels::Backend::kMarks / 5;

// A deferred step: what the host knew when it issued it, and where the rest lands.
struct PendingStep {
  int64_t step = 0;
  StepStats stats;
  StepReport r;
  std::vector<Step::Phases> phases;
  int64_t optimizer_begin = 0, optimizer_end = 0, record = 0;
  std::string hint;
};

ShardedMasterGather::ShardedMasterGather(const model::BertModel& m, std::vector<int64_t> counts)
    : counts_(std::move(counts)), small_counts_(counts_.size(), 0) {
  BT_CHECK(m.dims().master_shard, "ShardedMasterGather: the model's master is not sharded");
  std::vector<int64_t> cuts(1, 0);
  for (int64_t c : counts_) cuts.push_back(cuts.back() + c);
  // Each rank's elements of [b, e), in rank order (the parts are consecutive).
  auto parts = [&](int64_t b, int64_t e, std::vector<int64_t>& into) {
    for (size_t r = 0; r < counts_.size(); ++r)
      into[r] += std::max<int64_t>(0, std::min(e, cuts[r + 1]) - std::max(b, cuts[r]));
  };
  constexpr int64_t kInPlace = int64_t{1} << 20;  // floats: gathered where they lie
  int64_t packed = 0;
  for (const auto& [b, e] : m.table().fp32_read_ranges()) {
    if (e - b >= kInPlace) {
      in_place_.push_back({b, e, std::vector<int64_t>(counts_.size(), 0)});
      parts(b, e, in_place_.back().counts);
    } else {
      small_.push_back({b, e});
      parts(b, e, small_counts_);
      packed += e - b;
    }
  }
  packed_.resize(static_cast<size_t>(packed));
}

void ShardedMasterGather::run(model::BertModel& m, comm::Communicator& comm) {
  comm.allgather(m.weights16(), m.table().total(), counts_);
  float* params = m.params();
  for (const Range& r : in_place_) comm.allgather(params + r.begin, r.end - r.begin, r.counts);
  // Packed in offset order, every rank's elements of the small tensors are one run.
  float* to = packed_.data();
  for (const auto& [b, e] : small_) to = std::copy(params + b, params + e, to);
  comm.allgather(packed_.data(), static_cast<int64_t>(packed_.size()), small_counts_);
  const float* from = packed_.data();
  for (const auto& [b, e] : small_) {
    std::copy(from, from + (e - b), params + b);
    from += e - b;
  }
}

Step::Step(model::BertModel& m, Optimizer& opt, LossScaler& scaler, comm::Communicator& comm,
           const StepSettings& s, obs::Timeline* timeline)
    : m_(m), opt_(opt), scaler_(scaler), comm_(comm), s_(s), tl_(timeline) {
  if (s_.accumulation <= 0) fail("accumulation must be positive, got ", s_.accumulation);
  m_.set_graphs(s_.graphs);
  update_graphs_mode_ = s_.graphs;
  if (!(s_.predivide > 0)) fail("the gradient predivide factor must be positive");
  const int64_t P = m_.table().total();
  if (comm_.size() > 1 && m_.backend().host_memory() == comm_.device_memory())
    fail("data parallelism across ", comm_.size(), " ranks: the model's memory is ",
         m_.backend().host_memory() ? "the host's" : str("the ", m_.backend().name(), " device's"),
         ", the ", comm_.name(), " communicator reduces ",
         comm_.device_memory() ? "device memory" : "host memory",
         m_.backend().host_memory() ? "" : " (a GPU's gradients go through NCCL)");
  if (opt_.sharded()) {
    if (opt_.shard().world != comm_.size() || opt_.shard().rank != comm_.rank())
      fail("the optimizer is sharded for rank ", opt_.shard().rank, " of ", opt_.shard().world,
           ", this is rank ", comm_.rank(), " of ", comm_.size());
    counts_ = shard_counts(P, comm_.size());
    if (m_.dims().master_shard) master_gather_ = std::make_unique<ShardedMasterGather>(m_, counts_);
  }
  const model::ModelDims& d = m_.dims();
  if (d.master_shard &&
      (!opt_.sharded() || opt_.shard().begin != d.master_begin || opt_.shard().end != d.master_end))
    fail("the model holds the fp32 master of [", d.master_begin, ", ", d.master_end,
         "), the optimizer updates ", opt_.sharded() ? "another part" : "all parameters",
         ": a sharded master needs the optimizer sharded the same way");
  if (opt_.sharded()) {
    owners_.assign(1, 0);
    for (int64_t c : counts_) owners_.push_back(owners_.back() + c);
  }
  if (comm_.size() > 1 && s_.overlap) {
    std::vector<std::pair<int64_t, int64_t>> layers;
    for (int64_t l = 0; l < m_.config().num_hidden_layers; ++l) layers.push_back(m_.layer_range(l));
    reducer_ = std::make_unique<comm::Reducer>(comm_, m_.grads(), P, layers, s_.bucket_bytes, tl_,
                                               owners_);
  }
}

Step::~Step() {
  if (!pending_.empty()) m_.backend().wait_to_host();  // (the copies into records_ land first)
}

bool Step::deferring() const {
  return s_.defer && !m_.backend().host_memory() && comm_.size() == 1 && !opt_.sharded();
}

std::string Step::graphs_summary() const {
  if (!m_.backend().graphs()) return "";
  const char* what =
      s_.graphs == model::GraphMode::Off ? ""
      : !m_.graph_shapes()
          ? (deferring() ? " (the update; not forward and backward: the padding skipped without "
                           "the fused attention)"
                         : " (none: the padding skipped without the fused attention)")
          : (deferring() ? " (forward, backward and the update)" : " (forward and backward)");
  return str(", CUDA graphs ", model::graph_mode_name(s_.graphs), what);
}

GradientScale Step::scale() const {
  // Deferred, the loss scale is the gate's on the device (1 here: the factors read it there).
  const bool on_device = deferring() && scaler_.enabled();
  const double world = comm_.size(), loss_scale = on_device ? 1.0 : scaler_.scale();
  const double pre = world > 1 ? s_.predivide : 1.0;
  GradientScale g;
  g.backward = static_cast<float>(loss_scale / static_cast<double>(s_.accumulation));
  if (on_device) g.backward.times = &opt_.device_gate()->scale.scale;
  g.prescale = static_cast<float>(1.0 / pre);
  g.unscale = static_cast<float>(pre / (loss_scale * world));
  return g;
}

void Step::reduce(const GradientScale& g, StepReport& r) {
  if (comm_.size() == 1) return;
  if (reducer_) {
    const double exposed = reducer_->finish();  // the rest of the buckets, then wait
    r.t_hidden = std::max(0.0, reducer_->busy_seconds() - exposed);
    return;
  }
  const int64_t P = m_.table().total();
  float* grad = m_.grads();
  if (g.prescale != 1.0f && comm_.device_memory()) {
    comm_.scale(grad, P, g.prescale);
  } else if (g.prescale != 1.0f) {
    const float pre = g.prescale;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < P; ++i) grad[i] *= pre;
  }
  comm_.set_label("all gradients (one bucket)");
  if (opt_.sharded())
    comm_.reduce_scatter_sum(grad, P, counts_);
  else
    comm_.allreduce_sum(grad, P);
  comm_.set_label("");
}

void Step::span(const char* name, const char* category, Clock::time_point begin) const {
  if (!tl_ || !tl_->enabled()) return;
  const int64_t end = tl_->now_us();
  tl_->add(name, category, end - static_cast<int64_t>(seconds_since(begin) * 1e6), end);
}

StepReport Step::run(int64_t step, double lr, const NextBatch& next_batch, const std::string& hint,
                     bool ahead) {
  const auto t_step = Clock::now();
  StepReport r;
  if (interrupted_ahead_) {
    r.interrupted = true;
    return r;
  }
  r.step = step;
  const bool defer = deferring();
  // A deferred step keeps 3 marks a micro-batch and 2 for its update until it is read.
  const int64_t marks = 3 * s_.accumulation + 2;
  if (defer && (static_cast<int64_t>(pending_.size()) == kRecords ||
                pending_marks_ + marks > kernels::Backend::kMarks))
    settle_pending();
  if (defer) opt_.start_gate(scaler_.state());  // (before backward reads the gate's scale)
  const GradientScale g = scale();
  r.loss_scale = scaler_.scale();  // (deferred: the device's, at settle)
  if (reducer_) reducer_->set_prescale(g.prescale);
  m_.zero_grads();
  phases_.clear();
  StepStats stats;
  for (int64_t micro = 0; micro < s_.accumulation; ++micro)
    if (!micro_batch(step, micro, g, next_batch, ahead, stats, r)) {
      m_.read_step_sums();  // (the sums of the micro-batches that ran: dropped)
      return r;
    }
  if (defer) {
    if (!records_) {
      const kernels::Backend* be = &m_.backend();
      records_ = std::shared_ptr<void>(be->allocate_host(kRecords * sizeof(StepRecord)),
                                       [be](void* p) { be->release_host(p); });
    }
    m_.read_step_sums(&static_cast<StepRecord*>(records_.get())[next_record_].sums);
    update_deferred(step, lr, g, stats, hint, r);
    r.t_total = seconds_since(t_step);
    pending_.back().r.t_total = r.t_total;
    span(("step " + std::to_string(step)).c_str(), "step", t_step);
    return r;
  }
  m_.read_step_sums();  // (lands with the next synchronisation: collect waits only if not)
  sum_over_ranks(g, stats, r);
  update(step, lr, g, stats, hint, r);
  r.t_total = seconds_since(t_step);
  span(("step " + std::to_string(step)).c_str(), "step", t_step);
  return r;
}

bool Step::micro_batch(int64_t step, int64_t micro, const GradientScale& g,
                       const NextBatch& next_batch, bool ahead, StepStats& stats, StepReport& r) {
  const int rank = comm_.rank(), world = comm_.size();
  model::Batch& batch = batches_[cur_];
  auto t0 = Clock::now();
  if (held_) {
    held_ = false;  // read and staged during the backward before
  } else {
    if (!next_batch(batch)) {
      r.interrupted = true;
      return false;
    }
    r.t_input += seconds_since(t0);
    span("input wait", "input", t0);
  }
  // Each rank's and micro-batch's own dropout streams: a packed batch's instance count varies,
  // so it counts its most (the model's planned batch).
  const int64_t per_batch = batch.packed_rows > 0 ? m_.dims().batch : batch.B;
  const model::StepOptions so{true, s_.seed, static_cast<uint64_t>(step),
                              static_cast<uint64_t>((micro * world + rank) * per_batch),
                              /*device_sums=*/true};
  const kernels::Backend& be = m_.backend();
  Phases ph;
  ph.host_begin_us = tl_ && tl_->enabled() ? tl_->now_us() : 0;
  ph.forward = be.mark();
  const model::Losses l = m_.forward(batch, so);
  ph.backward = be.mark();
  // The loss sums are the device's (collect); what the host computed (a regression head's
  // squared error) is added here.
  stats.loss += l.loss;
  if (!std::isfinite(l.loss)) stats.nonfinite_losses += 1;
  stats.mlm_weight += l.mlm_weight;
  stats.examples += static_cast<double>(batch.B);
  stats.real_tokens += static_cast<double>(l.real_tokens);
  stats.computed_tokens += static_cast<double>(l.computed_tokens);
  stats.token_slots += static_cast<double>(batch.token_slots());
  r.flops += m_.last_step_flops();
  const bool last = micro + 1 == s_.accumulation;
  if (reducer_ && last)
    m_.backward(batch, so, g.backward, [&](int64_t layer) { reducer_->layer_done(layer); });
  else
    m_.backward(batch, so, g.backward);
  ph.end = be.mark();
  phases_.push_back(ph);
  const bool next_here = micro + 1 < s_.accumulation;
  if (m_.stages_ahead() && (next_here || ahead) && !read_ahead(next_batch, next_here, r))
    return false;
  // Several ranks: the exposed communication is what the reducer waits for after backward.
  if (world > 1 && last) be.synchronize();
  // A GPU keeps the last Backend::kMarks marks: a long accumulation times its phases early.
  if (static_cast<int64_t>(phases_.size()) * 3 + 8 > kernels::Backend::kMarks) time_phases(r);
  return true;
}

// The device's time in each forward and backward of the step so far, from their marks (the
// host waits for the last one only if the device has not passed it), and their timeline spans:
// each forward from the moment it was issued, its backward after it.
void Step::time_phases(StepReport& r) {
  const kernels::Backend& be = m_.backend();
  for (const Phases& ph : phases_) {
    const double fwd = be.seconds_between(ph.forward, ph.backward);
    const double bwd = be.seconds_between(ph.backward, ph.end);
    r.t_forward += fwd;
    r.t_backward += bwd;
    if (!tl_ || !tl_->enabled()) continue;
    const int64_t f_end = ph.host_begin_us + static_cast<int64_t>(fwd * 1e6);
    tl_->add("forward", "compute", ph.host_begin_us, f_end);
    tl_->add("backward", "compute", f_end, f_end + static_cast<int64_t>(bwd * 1e6));
  }
  phases_.clear();
}

// The next micro-batch (this step's, or with next_here false the next step's first) read and
// staged while the device runs this backward. Where the device still ran it when the read ended,
// the read was hidden (behind the backward's device time); else the read is input's time (the
// device waited for it at most that long).
bool Step::read_ahead(const NextBatch& next_batch, bool next_here, StepReport& r) {
  const auto t_read = Clock::now();
  model::Batch& next = batches_[1 - cur_];
  reading_ahead_ = !next_here;
  const bool got = next_batch(next);
  reading_ahead_ = false;
  const double read = seconds_since(t_read);
  if (m_.backend().busy()) {
    r.t_input_hidden += read;
    span("input read ahead", "input", t_read);
  } else {
    r.t_input += read;
    span("input wait", "input", t_read);
  }
  if (got) {
    m_.stage(next);
    cur_ = 1 - cur_;
    held_ = true;
  } else if (next_here) {
    m_.backend().synchronize();
    r.interrupted = true;
    return false;
  } else {
    interrupted_ahead_ = true;  // this step completes; the next stops at once
  }
  return true;
}

// The gradients summed over the ranks; the step's statistics travel in the same phase.
void Step::sum_over_ranks(const GradientScale& g, StepStats& stats, StepReport& r) {
  const int world = comm_.size();
  const auto t0 = Clock::now();
  reduce(g, r);
  m_.bind_kernel_scratch();  // the optimizer's reductions take their partial sums from it
  if (opt_.sharded()) stats.grad_sum_squares = opt_.sum_squares(m_.grads(), g.unscale);  // part
  if (world > 1) {
    collect(stats, r);
    stats.allreduce_sum(comm_);  // (grad_sum_squares: 0 unsharded)
  }
  r.t_comm = seconds_since(t0);
  span("allreduce gradients", "communication", t0);
}

// The device's loss sums (BertModel::step_sums, read at the end of the micro-batches) added to
// the rank's statistics, and the phases' device times: by now the device has passed both, or
// the host waits here once.
void Step::collect(StepStats& stats, StepReport& r) {
  const model::StepSums s = m_.step_sums();
  stats.loss += s.loss;
  stats.mlm_correct += s.mlm_correct;
  stats.nsp_correct += s.nsp_correct;
  stats.cls_correct += s.cls_correct;
  stats.nonfinite_losses += s.nonfinite;
  time_phases(r);
}

void Step::report(const StepStats& stats, StepReport& r) const {
  r.loss = stats.loss / static_cast<double>(s_.accumulation) / comm_.size();
  r.mlm_correct = stats.mlm_correct;
  r.mlm_weight = stats.mlm_weight;
  r.nsp_correct = stats.nsp_correct;
  r.cls_correct = stats.cls_correct;
  r.examples = stats.examples;
  r.real_tokens = stats.real_tokens;
  r.computed_tokens = stats.computed_tokens;
  r.token_slots = stats.token_slots;
}

// A deferred step's update, nothing read: the gate and the gated update on the device, the
// record's copy queued behind them.
void Step::update_deferred(int64_t step, double lr, const GradientScale& g, const StepStats& stats,
                           const std::string& hint, StepReport& r) {
  const auto t0 = Clock::now();
  const kernels::Backend& be = m_.backend();
  m_.bind_kernel_scratch();  // the gate's partial sums come from it
  PendingStep p;
  p.optimizer_begin = be.mark();
  // (the loss scale: the gate's own; the update as a graph where the backend has them)
  Optimizer::Issue run = Optimizer::run_now;
  if (update_graphs_mode_ != model::GraphMode::Off && be.graphs())
    run = [&](const std::function<void()>& issue) {
      update_graphs_.run(be, update_graphs_mode_, {g.unscale}, "optimizer's update", issue);
    };
  opt_.gated_step(m_.params(), m_.grads(), g.unscale, static_cast<float>(lr), m_.weight_copy(),
                  run);
  m_.weights16_updated();
  p.optimizer_end = be.mark();
  auto* record = static_cast<StepRecord*>(records_.get()) + next_record_;
  be.to_host_async(&record->gate, opt_.device_gate(), sizeof(kernels::GradientGate));
  p.step = step;
  p.stats = stats;
  r.pending = true;  // (what the host knows: report() completes it at settle_pending)
  r.mlm_weight = stats.mlm_weight;
  r.examples = stats.examples;
  r.real_tokens = stats.real_tokens;
  r.computed_tokens = stats.computed_tokens;
  r.token_slots = stats.token_slots;
  p.r = r;
  p.phases = std::move(phases_);
  phases_.clear();
  p.record = next_record_;
  p.hint = hint;
  pending_marks_ += 3 * static_cast<int64_t>(p.phases.size()) + 2;
  pending_.push_back(std::move(p));
  next_record_ = (next_record_ + 1) % kRecords;
  span("optimizer (issued)", "optimizer", t0);
}

// The deferred steps' results, the host waiting once (for the last record's copy: every earlier
// one, and every mark the steps made, is before it in the device's queue).
void Step::settle_pending() {
  if (pending_.empty()) return;
  const kernels::Backend& be = m_.backend();
  be.wait_to_host();
  const auto* records = static_cast<const StepRecord*>(records_.get());
  for (PendingStep& p : pending_) {
    const StepRecord& rec = records[p.record];
    StepReport& r = p.r;
    p.stats.loss += rec.sums.loss;
    p.stats.mlm_correct += rec.sums.mlm_correct;
    p.stats.nsp_correct += rec.sums.nsp_correct;
    p.stats.cls_correct += rec.sums.cls_correct;
    p.stats.nonfinite_losses += rec.sums.nonfinite;
    const int64_t first = p.phases.empty() ? p.optimizer_begin : p.phases.front().forward;
    phases_ = std::move(p.phases);
    time_phases(r);
    r.t_optimizer = be.seconds_between(p.optimizer_begin, p.optimizer_end);
    // The step's time: its input wait and the device's from its first mark to its last.
    r.t_total = r.t_input + be.seconds_between(first, p.optimizer_end);
    report(p.stats, r);
    r.grad_norm = std::sqrt(rec.gate.sum_squares);
    r.pending = false;
    // The device ran the scaler's rule from the scaler's state: the host's replay (judge) agrees.
    BT_CHECK(rec.gate.loss_scale == scaler_.scale(), "step ", p.step, ": the device's loss scale ",
             rec.gate.loss_scale, " is not the loss scaler's ", scaler_.scale());
    r.loss_scale = rec.gate.loss_scale;
    judge(p.step, rec.gate.apply != 0, p.stats, p.hint, r);
    settled_.push_back(r);
  }
  opt_.gate_read(records[pending_.back().record].gate);
  pending_.clear();
  pending_marks_ = 0;
}

std::vector<StepReport> Step::settle() {
  settle_pending();
  return std::exchange(settled_, {});
}

void Step::judge(int64_t step, bool finite, const StepStats& stats, const std::string& hint,
                 StepReport& r) {
  const int world = comm_.size();
  // A non-finite loss with finite gradients (an overflowing cross-entropy whose softmax
  // gradient stays bounded) would train on silently in fp32/bf16; fp16's scaler handles both.
  if (finite && stats.nonfinite_losses > 0 && !scaler_.enabled())
    fail("step ", step, ": the loss is not finite",
         world > 1 ? str(" on ", stats.nonfinite_losses, " micro-batch(es) of ", world, " ranks")
                   : std::string(),
         "; lower ", setting("lr"), " or raise ", setting("warmup"),
         " and resume from the last good checkpoint", hint);
  r.applied = scaler_.update(finite, step);  // fails after too many skips, or at once in fp32
}

// The finite check on every rank (all skip together), then the update.
void Step::update(int64_t step, double lr, const GradientScale& g, StepStats& stats,
                  const std::string& hint, StepReport& r) {
  const int world = comm_.size();
  const bool sharded = opt_.sharded();
  const auto t0 = Clock::now();
  const kernels::Backend& be = m_.backend();
  const int64_t begin = be.mark();
  // Sharded: the norm of every part, summed with the statistics (the same value on every rank;
  // a NaN or inf anywhere makes it non-finite everywhere).
  const StepResult measured =
      sharded ? opt_.result(stats.grad_sum_squares) : opt_.measure(m_.grads(), g.unscale);
  if (world == 1) collect(stats, r);  // (the norm's read brought them along)
  report(stats, r);
  const bool finite = world > 1 && !sharded ? comm_.all(measured.finite) : measured.finite;
  r.grad_norm = measured.grad_norm;
  judge(step, finite, stats, hint, r);
  if (r.applied) {
    // Clipping uses the same global norm on every rank: gradients are identical after the sum.
    opt_.apply(m_.params(), m_.grads(), static_cast<float>(lr), g.unscale, measured,
               m_.weight_copy(), [&](double* v, int64_t n) { comm_.allreduce_sum(v, n); });
    if (sharded) gather_parameters(r);
    m_.weights16_updated();
  }
  const int64_t end = be.mark();
  be.synchronize();
  r.t_optimizer = be.seconds_between(begin, end);
  span("optimizer", "optimizer", t0);
}

// Each rank updated its part: every rank gets every part. With a sharded master, the bf16
// weights and the fp32-read tensors; else the fp32 parameters (exact), whose parts updated
// elsewhere each rank rounds into its bf16 copy.
void Step::gather_parameters(StepReport& r) {
  const auto t0 = Clock::now();
  comm_.set_label("updated parameters");
  if (m_.dims().master_shard) {
    master_gather_->run(m_, comm_);
  } else {
    comm_.allgather(m_.params(), m_.table().total(), counts_);
    const Shard& own = opt_.shard();
    m_.refresh_weights16(0, own.begin);
    m_.refresh_weights16(own.end, m_.table().total());
  }
  comm_.set_label("");
  r.t_comm += seconds_since(t0);
  span("allgather parameters", "communication", t0);
}

}  // namespace bertrain::train
