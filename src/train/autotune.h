// train --autotune: before the first step, time full training steps of a throwaway copy of the
// run's model (same config, batch, precision, recomputation and padding, its own optimizer and
// initialisation, the run's first batches read by a pipeline of its own) under candidate
// settings, one knob after the other, and keep the fastest value of each (a value other than
// the default only when it is more than 2% faster: the noise of a step time): the attention
// kernel (full or blocked), the compute threads per rank (OpenMP), and with several ranks the
// gradient bucket size of the overlapped allreduce. The run's own model, optimizer and input
// position are untouched by the trials, so the run computes exactly what the same settings given as
// flags compute. The input pipeline's reader and prefetch counts tune themselves while it runs
// (data/pipeline.h, AUTOTUNE). With --pack auto (TrainConfig::autotune_pack), first the
// instances a packed row holds at most (2, 3 or 4, each on its own packed batches): by real
// tokens per second, since the step's tokens differ; unlike the other knobs it changes what a
// step trains on, so it is tuned only where asked for. The choice is stored in every
// checkpoint's trainer state: a resumed run takes it from there instead of measuring again.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "train/trainer.h"

namespace bertrain::train {

struct Tuning {
  model::ModelDims::Attention attention = model::ModelDims::Attention::Auto;
  int threads = 0;  // compute threads per rank
  int64_t bucket_mb = 0;
  int64_t pack = -1;  // instances a packed row (--pack auto); -1: not tuned
  // Each trial: what was tried, its mean step time over the ranks (ms) and, for the pack
  // trials, the real tokens per second over all ranks.
  struct Trial {
    std::string knob, value;
    double step_ms = 0, tokens_per_s = 0;
  };
  std::vector<Trial> trials;
  std::string source;  // "measured", or the checkpoint it was read from

  nlohmann::json to_json() const;
  static Tuning from_json(const nlohmann::json& j);
  // The settings into a run's configuration (and the OpenMP thread count of this process).
  void apply(TrainConfig& cfg) const;
  // Lines for the log: every trial, then the choice.
  std::string report() const;
};

// The tuning of the checkpoint a resumed run continues (its trainer state's "autotune"), if any.
bool stored_tuning(const TrainConfig& cfg, Tuning& out);

// Measures as described above (collective: every rank runs the same trials; rank 0's choice
// on the mean over the ranks is every rank's). Each trial: `steps` batches, once to warm up and
// once timed.
Tuning autotune(const TrainConfig& cfg, comm::Communicator& comm, int steps = 3);

}  // namespace bertrain::train
