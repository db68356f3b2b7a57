// Training checkpoints in a run directory:
//   run/checkpoint-000100/  model.safetensors + config.json (HuggingFace BertForPreTraining),
//                           optimizer.safetensors (m, v) or, from a sharded optimizer, one
//                           optimizer.rank-RRRRR-of-NNNNN.safetensors per rank (m, v of its
//                           range, the range in its metadata), trainer_state.json (format version,
//                           step, loss scale, optimizer steps, input-pipeline position per rank,
//                           the settings a resume must match)
//   run/latest              name of the newest complete checkpoint
// A checkpoint is written into a temporary directory, fsynced and renamed into place, then
// `latest` is replaced atomically: a crash or a full disk leaves the previous one intact.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator.h"
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

// One job per run directory: run_dir/bertrain.lock, held (flock) by the job's rank 0 for the
// process's life and released by the kernel when it ends, however it ends (a kill, the OOM
// killer); the file names the holder (host, pid, start time, command line). A second job on the
// directory stops with an error naming the holder; a lock file whose holder is gone is taken
// over, said in note(). Local and shared file systems (NFSv4, Lustre and GPFS pass flock
// between hosts); an object-store prefix (s3://, oss://) takes no lock.
// "host h0, pid 123, started 2026-12-03 05:00:00 UTC: bertrain train ...": who holds a run.
std::string job_holder();

class RunDirLock {
 public:
  explicit RunDirLock(const std::string& run_dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  // "took over <dir>/bertrain.lock from <holder>, which is gone", or "".
  const std::string& note() const { return note_; }

 private:
  int fd_ = -1;
  std::string note_;
};

// Writes run_dir/checkpoint-<step>/ and updates run_dir/latest; keeps the newest `keep` (0: all).
// Returns the checkpoint directory. A sharded optimizer's checkpoint is written by every rank
// (collective over comm: each rank its own shard, rank 0 the rest), into a directory every rank
// sees; an unsharded one by rank 0 alone (comm may be null).
// `host_shards` (sharded; non-null on every rank): each host stages its own run_dir instead (a
// run published to a bucket from several hosts, RunMirror). Rank 0's checkpoint then holds the
// model, the state and its host's shards (a sharded master's model assembled from parts the
// other hosts pass over comm); on each other host the first rank gets in *host_shards the
// directory of its host's ranks' shards, to upload (RunMirror::publish_shards) and remove.
std::string save_checkpoint(const std::string& run_dir, const model::BertModel& m,
                            const Optimizer& opt, const TrainerState& st, int keep,
                            comm::Communicator* comm = nullptr, std::string* host_shards = nullptr);

// A model with a sharded fp32 master (ModelDims::master_shard) saved as save_pretrained saves
// a whole one, by all ranks: each writes its part into dir, rank 0 assembles
// model.safetensors and config.json from the parts, then removes them. Collective. The parts
// rank 0 does not see in dir (each host its own directory, no shared file system) come to it
// over comm.
void save_pretrained_sharded(const model::BertModel& m, const std::string& dir,
                             comm::Communicator& comm);

// The optimizer state of checkpoint `dir` into `opt`, whatever the partition it was saved
// with and `opt` has (re-partitioning: 4 shards into 2, shards into one, one into shards).
void load_optimizer_state(const std::string& dir, Optimizer& opt);
// Its files (optimizer.safetensors, or the shards' files); empty if there are none.
std::vector<std::string> optimizer_state_files(const std::string& dir);
// Writes this rank's optimizer state into checkpoint directory `dir` (the whole file, or its
// shard's) and returns the path. `master` (a model with a sharded fp32 master): the fp32
// parameters of the shard's range, stored beside the moments as "master" (rank 0 assembles
// model.safetensors from them).
std::string save_optimizer_state(const std::string& dir, const Optimizer& opt,
                                 const float* master = nullptr);

// The staging directories of checkpoint writes that never finished (.checkpoint-N.tmp-HOST-PID,
// whose writer on this host is gone: killed mid-write by SIGKILL, preemption, the OOM killer),
// removed; returns their paths. Another host's, and a live writer's, are left alone.
std::vector<std::string> remove_abandoned_checkpoint_writes(const std::string& run_dir);

// The checkpoint directory `path` names: a checkpoint itself, or a run directory (its latest).
// Empty if a run directory has no checkpoint yet.
std::string resolve_checkpoint(const std::string& path);

// Loads model parameters, optimizer moments and the trainer state; checks the format version
// and that the checkpoint's model matches `m`.
TrainerState load_checkpoint(const std::string& dir, model::BertModel& m, Optimizer* opt);

}  // namespace bertrain::train
