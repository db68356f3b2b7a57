// A run directory in object storage (--output s3://bucket/run/, or oss://): the run writes a
// local staging directory as it writes any run directory (checkpoints made atomic there, logs),
// and rank 0 publishes it to the bucket:
//   run/checkpoint-000100/<file>   each file of the checkpoint, uploaded first
//   run/checkpoint-000100/COMMIT   then this object: JSON naming every file with its size and
//                                  SHA-256. A checkpoint is complete when its COMMIT exists.
//   run/latest                     then this: the newest committed checkpoint's name
//   run/metrics.jsonl, run/events.out.tfevents.*, run/incidents.log: uploaded as they grow
// A reader (--resume) reads `latest`, the COMMIT it names, and fetches those files, checking
// each size and digest: it never sees half a checkpoint, and a crash or an outage mid-upload
// leaves the previous checkpoint as `latest`. Checkpoints beyond keep-last K are deleted COMMIT
// first, so a half-deleted one is invisible too; the parts of a checkpoint never committed go
// once a later one commits.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"

namespace bertrain::train {

// The other hosts' shards of a checkpoint staged per host (save_checkpoint's host_shards):
// each such host uploads its own, then a manifest url/checkpoint-N/PARTS-rank-R (R: the
// host's first rank) naming them with size and SHA-256 and the job's `attempt`.
struct HostParts {
  int hosts = 0;        // manifests to wait for (the hosts besides rank 0's)
  std::string attempt;  // this job's (a manifest of an earlier job at this step is not ours)
  double timeout_s = 900;
};

class RunMirror {
 public:
  // `url`: s3://bucket/prefix or oss://...; `stage`: the local directory the run writes.
  RunMirror(const std::string& url, const std::string& stage);
  const std::string& url() const { return url_; }
  const std::string& stage() const { return stage_; }

  // Uploads checkpoint directory `dir` (one of the stage's), waits for `parts` (their files join
  // the commit), commits it, points `latest` at it, then deletes the committed checkpoints older
  // than the newest `keep` (0: none deleted) and what older uploads left uncommitted.
  void publish_checkpoint(const std::string& dir, int keep, const HostParts& parts = {});
  // This host's part of checkpoint `name`: the files of `dir`, then their manifest (HostParts).
  void publish_shards(const std::string& dir, const std::string& name, const std::string& attempt,
                      int first_rank);
  // A model directory (finetune's output: the stage's `names`) at the prefix itself: its
  // COMMIT object removed first, the files uploaded, then COMMIT again naming each with its size
  // and SHA-256: a reader that finds COMMIT finds the model it names, never half of it.
  void publish_model(const std::vector<std::string>& names);
  // Uploads the logs (metrics.jsonl, TensorBoard events, incidents.log) that grew since the last
  // call; at most once per `min_interval_s` unless `force`.
  void sync_logs(bool force, double min_interval_s = 30.0);
  // The latest committed checkpoint fetched into the stage (stage/<name>, stage/latest written),
  // and the run's logs (metrics.jsonl, incidents.log, events) where the bucket's are longer than
  // the stage's; returns the checkpoint's local directory, or "" when the bucket holds none.
  std::string fetch_latest();

 private:
  std::string object(const std::string& name) const;  // url_/name
  // The files of parts.hosts manifests of checkpoint `name` carrying parts.attempt; `manifests`:
  // the keys of every manifest seen (an earlier job's too), to delete once committed.
  std::vector<nlohmann::ordered_json> wait_for_parts(const std::string& name,
                                                     const HostParts& parts,
                                                     std::vector<std::string>& manifests);
  void prune(const std::string& newest, int keep);
  std::string url_, stage_;
  std::map<std::string, uint64_t> uploaded_sizes_;  // log file -> size at its last upload
  bool synced_ = false;
  Clock::time_point last_sync_;
};

// One job per run prefix in a bucket: a lease object, url/bertrain.lock, naming its holder (host,
// pid, start, command line) and when the lease expires. Taken with a conditional PUT (only where
// none is), renewed every ttl/3 over the version this job wrote (If-Match), deleted at the end.
// A second job stops naming the holder; a lease its holder stopped renewing (killed, its host
// lost) expires after ttl_s and is taken over (over that version: two jobs cannot both take it),
// said in note(). A job that finds its lease taken (it could not renew for ttl_s, and another
// job took over) stops at its next checkpoint (check()).
class RunLease {
 public:
  RunLease(const std::string& url, double ttl_s);
  ~RunLease();
  RunLease(const RunLease&) = delete;
  RunLease& operator=(const RunLease&) = delete;
  const std::string& note() const { return note_; }
  // Error when the lease was taken by another job.
  void check() const;

 private:
  std::string body(double expires) const;
  void renew_loop();
  std::string url_, holder_, nonce_, etag_, note_;
  std::string job_;  // BERTRAIN_ELASTIC_JOB: the elastic job every attempt of which holds this
  double ttl_s_;
  std::atomic<bool> lost_{false};
  mutable std::mutex mu_;
  std::string lost_to_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread renewer_;
};

// Where a run published to `url` is staged on this host: $TMPDIR (else /tmp)/bertrain-stage/
// <scheme>/<bucket>/<prefix>.
std::string default_stage_dir(const std::string& url);

}  // namespace bertrain::train
