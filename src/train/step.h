// The training step: what pretraining, fine-tuning and `bertrain bench` all run, once.
//   zero gradients -> per micro-batch: input, forward, backward (the reducer hears of each
//   finished layer on the last one) -> reduce across ranks -> finite check (all ranks) and loss
//   scaler -> optimizer (unscale, clip, update, 16-bit weight copy) .
// Deferred (StepSettings::defer, one GPU): the finite check, clipping, the update's skip and
// fp16's loss scale are the device's (kernels::GradientGate) and the host reads the step's
// results later, at settle(), where the loss scaler replays the device's decisions.
// With a sharded optimizer (ZeRO stage 1: Optimizer's Shard) the sum across ranks is a
// reduce-scatter (each rank receives the sum of its part), the norm and finite check add the
// parts' squared norms, each rank updates its part, and an allgather gives every rank all the
// updated parameters: the bytes of one allreduce, and 1/world of the optimizer state per rank.
// It alone owns the gradient scale. Backward computes the gradient of
//   loss * loss_scale / accumulation                      (GradientScale::backward)
// on each rank; before the sum over ranks every gradient is multiplied by 1 / predivide
// (Horovod's gradient_predivide_factor; in the reducer's thread while backward runs, or in one
// pass), and the optimizer unscales by predivide / (loss_scale * world), so the update sees the
// mean over ranks and micro-batches of the unscaled gradient.
#pragma once

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/reducer.h"
#include "model/bert.h"
#include "obs/timeline.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"

namespace bertrain::train {

struct StepSettings {
  int64_t accumulation = 1;  // micro-batches per step
  double predivide = 1.0;    // gradients x 1/predivide before the sum over ranks
  bool overlap = true;       // several ranks: reduce buckets while backward runs
  int64_t bucket_bytes = int64_t{64} << 20;
  uint64_t seed = 0;  // dropout streams (with the step, layer and example)
  // The step's results read later, where that spares the device a host synchronisation: on a
  // backend with memory of its own (a GPU), one rank and an unsharded optimizer, run() returns a
  // pending report and the norm, the finite check, clipping, fp16's loss scale and the losses
  // stay on the device until settle() (Step::run says how). Else (and by default) each step is
  // read when it ends.
  bool defer = false;
  // Forward and backward launched as CUDA graphs where the model can (BertModel::graph_shapes:
  // a GPU; padded batches, or unpadded with the fused attention; every head),
  // and a deferred step's update (Optimizer::gated_step:
  // any model), captured at their first use.
  model::GraphMode graphs = model::GraphMode::Off;
};

// The factors of one step (see the header comment). Deferred with a loss scaler, the loss scale
// is the device's: backward's factor reads it there (1 / accumulation x the gate's scale) and
// unscale leaves it to the gate (kernels::next_gate divides by it).
struct GradientScale {
  kernels::Multiplier backward = 1.0f;  // loss scale / accumulation: backward's loss factor
  float prescale = 1.0f;  // 1 / predivide, applied before the sum over ranks (1: not applied)
  float unscale = 1.0f;   // predivide / (loss scale * world): the optimizer's factor
};

// What one step did, summed over micro-batches and ranks (identical on every rank).
struct StepReport {
  int64_t step = -1;         // the step counter run() was given
  bool interrupted = false;  // the input was interrupted (stop signal): nothing was applied
  // Deferred (StepSettings::defer): only the host's fields (examples, tokens, flops, t_input)
  // are set; settle() returns the whole report.
  bool pending = false;
  bool applied = false;  // false: skipped by the loss scaler (non-finite gradients)
  double loss = 0;       // mean over micro-batches and ranks
  double mlm_correct = 0, mlm_weight = 0, nsp_correct = 0, cls_correct = 0;
  double examples = 0;  // sequences in the step, all ranks
  // Token rows of the step, all ranks: the real tokens and those the encoder computed (with
  // padding when the model runs padded; model::Losses).
  double real_tokens = 0, computed_tokens = 0;
  // The token positions of the step's batches, all ranks: rows x seq_len, a row per sequence
  // (padded) or per packed row (data/packing.h). Padding is what of them real tokens leave.
  double token_slots = 0;
  double flops = 0;         // model FLOPs this rank computed (BertModel::last_step_flops)
  double grad_norm = 0;     // of the unscaled, averaged gradients, before clipping
  float loss_scale = 1.0f;  // the scale this step ran with
  // Seconds of this rank: waiting for input, forward, backward, exposed communication (gradient
  // sum and the step's statistics), optimizer; hidden = communication that ran behind backward;
  // input_hidden = input read ahead while the device still ran backward (Step::run: part of
  // backward's time, which the device set). Forward, backward and optimizer are the device's
  // time between phase marks (Backend::mark: a GPU's events; the CPU's clock).
  double t_input = 0, t_forward = 0, t_backward = 0, t_comm = 0, t_optimizer = 0, t_hidden = 0;
  double t_input_hidden = 0;
  double t_total = 0;
};

// For a model with a sharded fp32 master (ModelDims::master_shard): every rank's part of the
// weights to every rank, `counts` the optimizer's parts. The bf16 copy goes whole (2 bytes a
// parameter instead of the fp32 allgather's 4) and the tensors read in fp32 as fp32 (the
// embeddings in place, the small ones packed into one message). The layout is worked out once;
// run() is collective.
class ShardedMasterGather {
 public:
  ShardedMasterGather(const model::BertModel& m, std::vector<int64_t> counts);
  void run(model::BertModel& m, comm::Communicator& comm);

 private:
  struct Range {
    int64_t begin, end;
    std::vector<int64_t> counts;  // each rank's elements of it
  };
  std::vector<int64_t> counts_;
  std::vector<Range> in_place_;                     // large fp32 tensors, gathered where they lie
  std::vector<std::pair<int64_t, int64_t>> small_;  // packed in offset order
  std::vector<int64_t> small_counts_;               // each rank's elements of them, one run each
  std::vector<float> packed_;
};

struct StepStats;    // a rank's sums over a step's micro-batches (step.cpp)
struct PendingStep;  // a deferred step not yet read (step.cpp)

class Step {
 public:
  // next_batch fills the next micro-batch; it returns false when the input was interrupted (the
  // step then returns at once with interrupted = true).
  using NextBatch = std::function<bool(model::Batch&)>;

  // comm may be a SingleProcess. timeline may be null. The model's gradients must already be
  // where they stay (BertModel::place_gradients), since the reducer holds their address.
  Step(model::BertModel& m, Optimizer& opt, LossScaler& scaler, comm::Communicator& comm,
       const StepSettings& s, obs::Timeline* timeline = nullptr);
  ~Step();

  // Runs step `step` (0-based, the dropout and scaler counter) with learning rate lr.
  // Non-finite loss in fp32/bf16 is an error naming the step and rank; `hint` (e.g. the last
  // checkpoint to resume from) is appended to it.
  // On a model that stages ahead (BertModel::stages_ahead: a GPU's), each micro-batch after the
  // first is read and staged while the kernels still run the backward before it: its copy to
  // the device overlaps them. With `ahead` (a step follows this one) the next step's first
  // micro-batch too: next_batch is then called once during this step for the next one
  // (reading_ahead() is true during that call, and holds_next() after the step).
  // Deferred (deferring()): the step's norm, finite check, clipping and loss scale run on the
  // device (Optimizer::gate, apply_gated: a non-finite step changes nothing there but the loss
  // scale), its loss sums and gate are copied behind it into page-locked memory, its phases end
  // at marks, and the host waits for none of them: run() returns a pending report. settle()
  // waits once for all the pending steps and returns their reports in step order; the loss
  // scaler replays each step's verdict there (a non-finite step in fp32/bf16, or too many
  // skipped in fp16, fails there, naming its step). (run() settles on its own when the marks or
  // records kept would run out: the reports wait in settle()'s list.)
  StepReport run(int64_t step, double lr, const NextBatch& next_batch, const std::string& hint = "",
                 bool ahead = false);
  std::vector<StepReport> settle();
  bool deferring() const;
  // What runs as CUDA graphs, for a run's header: ", CUDA graphs auto (forward, backward and the
  // update)" and the like; empty on a backend that captures none.
  std::string graphs_summary() const;
  bool reading_ahead() const { return reading_ahead_; }
  // Whether the next step's first micro-batch is already read (the input position after this
  // step is then the one before that read).
  bool holds_next() const { return held_; }

  GradientScale scale() const;  // for the scaler's current loss scale (or the device's)
  const comm::Reducer* reducer() const { return reducer_.get(); }
  const StepSettings& settings() const { return s_; }

 private:
  using Clock = std::chrono::steady_clock;
  // The pieces of run(), in order (step.cpp says each one's part).
  bool micro_batch(int64_t step, int64_t micro, const GradientScale& g, const NextBatch& next_batch,
                   bool ahead, StepStats& stats, StepReport& r);
  bool read_ahead(const NextBatch& next_batch, bool next_here, StepReport& r);
  void sum_over_ranks(const GradientScale& g, StepStats& stats, StepReport& r);
  void collect(StepStats& stats, StepReport& r);
  void report(const StepStats& stats, StepReport& r) const;
  void time_phases(StepReport& r);
  void update(int64_t step, double lr, const GradientScale& g, StepStats& stats,
              const std::string& hint, StepReport& r);
  void update_deferred(int64_t step, double lr, const GradientScale& g, const StepStats& stats,
                       const std::string& hint, StepReport& r);
  // The finite check's verdict on the step (fails where training cannot go on), r.applied.
  void judge(int64_t step, bool finite, const StepStats& stats, const std::string& hint,
             StepReport& r);
  void settle_pending();  // into settled_
  void gather_parameters(StepReport& r);
  void reduce(const GradientScale& g, StepReport& r);
  // A timeline span from `begin` to now (when the timeline is on).
  void span(const char* name, const char* category, Clock::time_point begin) const;

  model::BertModel& m_;
  Optimizer& opt_;
  LossScaler& scaler_;
  comm::Communicator& comm_;
  StepSettings s_;
  obs::Timeline* tl_;
  std::unique_ptr<comm::Reducer> reducer_;
  // Sharded optimizer: every rank's part of the flat buffers, and the cuts between them.
  std::vector<int64_t> counts_, owners_;
  std::unique_ptr<ShardedMasterGather> master_gather_;  // a sharded master's allgather
  // The micro-batch the model runs, and the next one read ahead (held_: batches_[cur_] is read
  // and staged for the coming micro-batch). interrupted_ahead_: the read ahead of the next
  // step's first micro-batch was interrupted, so that step stops at once.
  std::array<model::Batch, 2> batches_;
  // A micro-batch's phases as the device ran them (Backend::mark): forward from `forward` to
  // `backward`, backward from there to `end`; timed once the device has passed them
  // (time_phases). host_begin_us: the timeline's clock when the forward was issued.
  friend struct PendingStep;
  struct Phases {
    int64_t forward = 0, backward = 0, end = 0, host_begin_us = 0;
  };
  std::vector<Phases> phases_;
  // Deferred steps not yet read, their records (loss sums and gate, in page-locked memory, a
  // ring of kRecords), the marks they hold, and the reports settled on run()'s own.
  std::vector<PendingStep> pending_;
  std::shared_ptr<void> records_;
  int64_t next_record_ = 0, pending_marks_ = 0;
  std::vector<StepReport> settled_;
  int cur_ = 0;
  bool held_ = false, reading_ahead_ = false, interrupted_ahead_ = false;
  // The deferred update's graphs (Optimizer::gated_step), by what their launches hold besides
  // the model's and the optimizer's memory: the gradients' unscaling factor.
  struct UpdateKey {
    float unscale;
    bool operator<(const UpdateKey& o) const { return unscale < o.unscale; }
  };
  model::GraphCache<UpdateKey> update_graphs_;
  model::GraphMode update_graphs_mode_ = model::GraphMode::Off;
};

}  // namespace bertrain::train
