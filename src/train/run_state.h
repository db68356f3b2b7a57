// Training checkpoints in a run directory:
//   run/checkpoint-000100/  model.safetensors + config.json (HuggingFace BertForPreTraining),
//                           optimizer.safetensors (m, v), trainer_state.json (format version,
//                           step, loss scale, optimizer steps, input-pipeline position per rank,
//                           the settings a resume must match)
//   run/latest              name of the newest complete checkpoint
// A checkpoint is written into a temporary directory, fsynced and renamed into place, then
// `latest` is replaced atomically: a crash or a full disk leaves the previous one intact.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/pipeline.h"
#include "model/bert.h"
#include "train/optimizer.h"

namespace bertrain::train {

inline constexpr int kTrainerStateVersion = 1;

struct TrainerState {
  int64_t step = 0;  // optimizer steps completed
  float loss_scale = 1.0f;
  int64_t scaler_good = 0, scaler_skipped = 0;
  int64_t optimizer_steps = 0;
  std::vector<data::PipelinePosition> positions;  // per rank
  nlohmann::json settings;  // batch, seq, precision, optimizer, world size, ... (must match)
};

// Writes run_dir/checkpoint-<step>/ and updates run_dir/latest; keeps the newest `keep` (0: all).
// Returns the checkpoint directory.
std::string save_checkpoint(const std::string& run_dir, const model::BertModel& m,
                            const Optimizer& opt, const TrainerState& st, int keep);

// The checkpoint directory `path` names: a checkpoint itself, or a run directory (its latest).
// Empty if a run directory has no checkpoint yet.
std::string resolve_checkpoint(const std::string& path);

// Loads model parameters, optimizer moments and the trainer state; checks the format version
// and that the checkpoint's model matches `m`.
TrainerState load_checkpoint(const std::string& dir, model::BertModel& m, Optimizer* opt);

}  // namespace bertrain::train
