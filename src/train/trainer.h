// The pretraining loop: input pipeline -> forward -> backward (gradient accumulation) ->
// gradient averaging across ranks -> loss-scale check -> optimizer -> checkpoint.
// Prints the resolved configuration, a progress line, and at the end a step-time breakdown
// with model FLOP utilisation against a GEMM rate measured in the same run.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "data/pipeline.h"
#include "model/bert.h"
#include "train/optimizer.h"
#include "train/precision.h"
#include "train/session.h"

namespace bertrain::train {

struct TrainConfig {
  std::string model_config, init_checkpoint, data, output;
  // An object-store run directory (s3://bucket/run, oss://...): `output` is then the local
  // staging directory the run writes, and rank 0 publishes it there (train/run_mirror.h).
  std::string publish_to;
  double lease_seconds = 120;  // publish_to's lease (RunLease): its time without renewal
  int64_t batch_size = 32;     // per rank, per micro-batch
  int64_t seq_len = 128, max_predictions = 20;
  int64_t steps = 1000, accumulation = 1;
  Precision precision = Precision::FP32;
  model::ModelDims::Attention attention = model::ModelDims::Attention::Auto;
  bool recompute_layers = false;                     // model::ModelDims::recompute_layers
  bool unpadded = true;                              // model::ModelDims::unpadded
  model::GraphMode graphs = model::GraphMode::Auto;  // train::StepSettings::graphs
  OptimizerConfig optimizer;
  double lr = 1e-3, warmup = 0.1, end_lr = 0.0, power = 1.0;  // warmup < 1: fraction of steps
  uint64_t seed = 42;
  int64_t save_every = 0, keep_last = 3, log_every = 10;
  bool resume = false;
  int64_t stop_after = 0;  // > 0: run at most this many steps in this invocation, then checkpoint
                           // and return (time-sliced or preemptible jobs; resume continues)
  data::PipelineOptions input;  // files, shuffle, interleave, corrupt policy
  int64_t max_skipped_steps = 20;
  double predivide =
      1.0;  // Horovod's gradient_predivide_factor: x 1/f before the sum, f/size after
  bool quiet = false;
  std::string timeline;  // Chrome trace of the run (merged over ranks), "" = off
  // Each rank appends "step epoch fingerprint" per example it trains on to <trace_input>.rank-R
  // (the fingerprint: FNV-1a of its token ids), to audit what a run, or a resumed one, read.
  std::string trace_input;
  bool overlap = true;     // with several ranks: allreduce buckets while backward runs
  int64_t bucket_mb = 64;  // gradient bucket size for the overlap (Horovod's fusion threshold)
  bool shard_optimizer = false;  // ZeRO stage 1: each rank holds 1/world of the optimizer state
  // Measure and choose the attention kernel, threads and bucket size first (train/autotune.h);
  // a resumed run keeps the choice its checkpoint stores, flag or not.
  bool autotune = false;
  // --pack auto: autotune also chooses input.pack_per_row (instances a row) by real tokens/s.
  // It changes the instances a step trains on, so only where asked for.
  bool autotune_pack = false;
  // Where the model, its gradients and the optimizer state live and run (null: the CPU's
  // backend). A backend with memory of its own (the GPU's) trains on one rank, with the full
  // attention kernel.
  const kernels::Backend* backend = nullptr;
};
const kernels::Backend& backend_of(const TrainConfig& c);

// The model's dims for a training run: its batch, precision, attention, recompute, padding and
// packing (--pack: batch_size packed rows of up to pack_per_row instances each, unpadded), and
// for rank `rank` of `world` (-1: the one whose parameters hold the most), bf16 with a sharded
// optimizer: the fp32 master of its part only (plan::with_master_shard).
model::ModelDims model_dims(const TrainConfig& c, int rank = 0, int world = 1);
// What a rank of the run trains (train/session.h): model_dims and the optimizer, sharding and
// fp16 settings.
SessionSettings session_settings(const TrainConfig& c, int rank = 0, int world = 1);

struct TrainResult {
  int64_t steps_done = 0;
  double first_loss = 0, last_loss = 0;  // averaged over the first / last log window
  std::vector<double> losses;            // loss of every step (rank-averaged)
  std::string last_checkpoint;
  bool interrupted = false;
};

// Set on SIGTERM/SIGINT/SIGUSR1 once install_signal_handlers ran; the loop finishes the current
// step (or stops waiting for input), checkpoints and returns with interrupted = true. (SIGUSR1:
// mpirun forwards it to every rank, where SIGTERM makes it kill the ranks a second later; the
// elastic supervisor stops a job with it.)
extern std::atomic<int> g_stop_signal;
// Blocks SIGTERM/SIGINT/SIGUSR1 in every thread and receives them on a thread of its own
// (trainer.cpp says why): call before any other thread is started.
void install_signal_handlers();

// A pretraining run: the constructor sets it up (model, optimizer, resume or init, the ranks'
// agreement, input), run() is the loop (step, progress, checkpoint), and the CLI prints
// banner() before and summary() after it.
class Trainer {
 public:
  Trainer(const TrainConfig& cfg, comm::Communicator& comm);
  ~Trainer();
  // The resolved configuration (model, data, batch, optimizer, precision, memory, CPU).
  std::string banner() const;
  TrainResult run();
  // After run(): how it stopped, the step-time breakdown, utilisation and the bottleneck.
  std::string summary() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// A Trainer's run, without banner and summary (progress lines unless cfg.quiet).
TrainResult train(const TrainConfig& cfg, comm::Communicator& comm);

// --warmup as steps: below 1 a fraction of `steps`, rounded up (so never 0 for a fraction > 0);
// from 1 a step count.
int64_t warmup_steps(double warmup, int64_t steps);

}  // namespace bertrain::train
