// Optimizers over the flat parameter/gradient buffers: AdamW (PyTorch's torch.optim.AdamW) and
// LAMB (NVIDIA's BERT LAMB, as apex FusedLAMB: bias correction, decoupled decay inside the
// update, per-tensor trust ratio ||p|| / ||u|| for tensors with weight decay). One step is two
// passes: a parallel reduction giving the global gradient norm and whether every gradient is
// finite (for the fp16 loss scaler), then the fused update with unscaling and clipping folded
// in (PyTorch's clip_grad_norm_ rule: coef = max_norm / (norm + 1e-6), at most 1).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
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

// The part of the flat parameters whose optimizer state a rank holds (ZeRO stage 1, DeepSpeed's
// partitioning of the flat buffer): rank r of `world` owns [begin, end); the parts are
// consecutive, near-equal, cut at multiples of 16 floats (64 bytes), and cover [0, total).
struct Shard {
  int rank = 0, world = 1;
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
Shard shard_of(int64_t total, int rank, int world);
// Every rank's part size, in rank order (the counts of Communicator::reduce_scatter_sum).
std::vector<int64_t> shard_counts(int64_t total, int world);

struct StepResult {
  bool finite = true;
  double grad_norm = 0;  // of the unscaled gradients, before clipping
  double clip_coef = 1;
};

class Optimizer {
 public:
  // The update kernels run on `backend` (the CPU's unless told), over its memory.
  // A sharded optimizer (shard.world > 1) holds the moments of [shard.begin, shard.end) only
  // and updates only those parameters; params and grads stay the whole flat buffers.
  Optimizer(std::vector<ParamSlice> slices, int64_t total, const OptimizerConfig& cfg,
            const kernels::Backend& backend = kernels::cpu_backend(), Shard shard = {});

  // Reduction pass only: global norm of grads * inv_scale, and whether all are finite.
  // Sharded: sum_squares over this rank's part, summed over ranks by the caller, then result().
  StepResult measure(const float* grads, float inv_scale) const;
  double sum_squares(const float* grads, float inv_scale) const;
  StepResult result(double sum_squares) const;
  // Updates params from grads * inv_scale with the clipping of `r` (from measure). Increments
  // the step count (bias correction uses it).
  // copy (optional): the model's 16-bit weight copy (bf16 or fp16 bits: BertModel::weight_copy)
  // also receives the updated parameters rounded, in the same pass, so its forward need not
  // convert them again.
  // Sharded LAMB needs the per-tensor norms of every rank: sum_over_ranks sums 2 doubles per
  // parameter tensor in place (a Communicator's allreduce_sum).
  using SumOverRanks = std::function<void(double*, int64_t)>;
  void apply(float* params, const float* grads, float lr, float inv_scale, const StepResult& r,
             kernels::WeightCopy copy = {}, const SumOverRanks& sum_over_ranks = {});
  // measure + apply unless a gradient is non-finite (then nothing changes).
  StepResult step(float* params, const float* grads, float lr, float inv_scale,
                  kernels::WeightCopy copy = {});

  // measure and apply decided where the gradients are, the host reading nothing (a GPU's: no
  // synchronisation): gated_step() writes the step's gate (kernels::GradientGate: the norm,
  // whether every gradient is finite, the factor of unscaling and clipping, the updates applied
  // and the loss scale on) in the backend's memory, then updates as apply() would with
  // measure()'s result, or leaves everything as it was where a gradient is not finite. The
  // gradients carry the gate's loss scale (inv_scale does not count it). Unsharded only.
  // Its kernels are issued through `run`, which calls the function it is given once (run_now),
  // or inside a capture whose graph it launches (a graph may hold them: the step's arguments,
  // its learning rate, are staged on the backend before, Backend::stage_update), or launches
  // the graph it captured before without calling it: the host's part of the step is done
  // either way.
  // start_gate() before a step's backward: where no gated step is in flight (unread: gate_read)
  // and the gate carries another count than steps() or another scale than `scale` (the first
  // gated step, a resume), the gate starts from them; else it goes on from its own.
  void start_gate(const kernels::LossScale& scale);
  using Issue = std::function<void(const std::function<void()>&)>;
  static void run_now(const std::function<void()>& issue) { issue(); }
  void gated_step(float* params, const float* grads, float inv_scale, float lr,
                  kernels::WeightCopy copy = {}, const Issue& run = run_now);
  const kernels::GradientGate* device_gate() const { return gate_; }
  // The host read the gate of the last gated step issued (its copy of device_gate()): every
  // gated step is read, and steps() becomes the gate's count (skipped steps not counted).
  void gate_read(const kernels::GradientGate& last);

  // Updates applied (bias corrections count them). A gated step counts when issued and is
  // taken back if its gate skipped it, when read (gate_read).
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s);
  const Shard& shard() const { return shard_; }
  bool sharded() const { return shard_.world > 1; }
  // The moments of shard().begin .. end, in the optimizer group of the memory plan
  // (plan::plan_optimizer_state): the backend's memory (a GPU's, when it has its own).
  std::span<float> m() const { return {m_, static_cast<size_t>(shard_.size())}; }
  std::span<float> v() const { return {v_, static_cast<size_t>(shard_.size())}; }
  int64_t total() const { return total_; }  // parameters of the model
  const MemoryPlan& plan() const { return plan_; }
  size_t allocated_bytes() const { return state_.bytes(); }
  const OptimizerConfig& config() const { return cfg_; }
  const kernels::Backend& backend() const { return *be_; }
  const std::vector<ParamSlice>& slices() const { return slices_; }

 private:
  // A slice's part inside the shard: [offset, offset + numel) clipped to it (numel 0: none).
  struct Piece {
    int64_t slice, offset, numel;
  };
  std::vector<Piece> pieces() const;
  // The update of apply() with gradient factor gscale (gated_step issues its own).
  void update(float* params, const float* grads, float lr, float gscale, kernels::WeightCopy copy,
              const SumOverRanks& sum_over_ranks);
  // The step's per-tensor arguments (adamw_ or lamb_) for update steps_.
  void fill_steps(float lr, float gscale, kernels::WeightCopy copy);
  std::vector<ParamSlice> slices_;
  Shard shard_;
  // The pieces (fixed by the shard) as the backend's tensor spans, and each step's per-tensor
  // arguments (kept: a step allocates nothing).
  std::vector<Piece> pieces_;
  std::vector<kernels::TensorSpan> spans_;
  std::vector<kernels::AdamwStep> adamw_;
  std::vector<kernels::LambStep> lamb_;
  std::vector<double> pn_, un_;
  std::vector<float> trust_;
  int64_t count() const { return static_cast<int64_t>(spans_.size()); }
  OptimizerConfig cfg_;
  const kernels::Backend* be_;
  int64_t total_;
  MemoryPlan plan_;
  std::shared_ptr<void> device_state_;  // the state's block, a backend with memory of its own
  kernels::GradientGate* gate_;         // gate()'s: the plan's optimizer.gate
  // What the gate carries as far as the host knows (steps, scale), and the gated steps issued
  // since the host last read one.
  kernels::GradientGate carried_;
  int64_t gated_in_flight_ = 0;
  void write_gate(const kernels::GradientGate& g);
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
