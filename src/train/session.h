// What a training run trains, assembled once from its settings: the model on its backend, the
// optimizer over its parameters (this rank's shard of the state with a sharded optimizer), the
// fp16 loss scaler, and the one training step over them (train/step.h). Pretraining (Trainer),
// fine-tuning, autotune's trials and bench all build it here, so a setting such as
// --max-skipped-steps or the sharded master means the same in each.
#pragma once

#include <memory>
#include <optional>

#include "comm/communicator.h"
#include "model/bert.h"
#include "obs/timeline.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace bertrain::train {

struct SessionSettings {
  model::Head head = model::Head::Pretraining;
  // The shapes and the precision (dims.precision). With shard_optimizer, bf16 on the CPU also
  // shards the fp32 master (plan::with_master_shard: this rank's part).
  model::ModelDims dims;
  const kernels::Backend* backend = nullptr;  // null: the CPU
  OptimizerConfig optimizer;
  bool shard_optimizer = false;  // ZeRO stage 1 over the communicator's ranks
  // fp16: skipped steps in a row (non-finite gradients) before the run is declared diverged.
  int64_t max_skipped_steps = 20;
};

class Session {
 public:
  // On a backend with memory of its own the training plan is checked against the device's free
  // memory before anything is allocated (plan::check_device_fits). The parameters are
  // initialised from `init_seed`; none: the caller loads them (a resumed run) or initialises them.
  Session(const model::BertConfig& mc, const SessionSettings& s, comm::Communicator& comm,
          std::optional<uint64_t> init_seed);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // The one training step over the model, optimizer and scaler. Made once the gradients are
  // where they stay (Trainer places them in the communicator's shared memory first).
  Step& start(const StepSettings& st, obs::Timeline* timeline = nullptr);
  Step& step() const;

  model::BertModel m;
  Optimizer opt;
  LossScaler scaler;

 private:
  comm::Communicator& comm_;
  std::unique_ptr<Step> step_;
};

}  // namespace bertrain::train
