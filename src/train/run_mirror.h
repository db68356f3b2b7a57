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

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace bertrain::train {

class RunMirror {
 public:
  // `url`: s3://bucket/prefix or oss://...; `stage`: the local directory the run writes.
  RunMirror(const std::string& url, const std::string& stage);
  const std::string& url() const { return url_; }
  const std::string& stage() const { return stage_; }

  // Uploads checkpoint directory `dir` (one of the stage's), commits it, points `latest` at it,
  // then deletes the committed checkpoints older than the newest `keep` (0: none deleted) and
  // what older uploads left uncommitted.
  void publish_checkpoint(const std::string& dir, int keep);
  // Uploads the logs (metrics.jsonl, TensorBoard events, incidents.log) that grew since the last
  // call; at most once per `min_interval_s` unless `force`.
  void sync_logs(bool force, double min_interval_s = 30.0);
  // The latest committed checkpoint fetched into the stage (stage/<name>, stage/latest written);
  // returns its local directory, or "" when the bucket holds none.
  std::string fetch_latest();
  // Checkpoints committed in the bucket, oldest first (their names).
  std::vector<std::string> committed() const;

 private:
  std::string object(const std::string& name) const;  // url_/name
  void prune(const std::string& newest, int keep);
  std::string url_, stage_;
  std::map<std::string, uint64_t> uploaded_sizes_;  // log file -> size at its last upload
  double last_sync_ = -1e30;
};

// Where a run published to `url` is staged on this host: $TMPDIR (else /tmp)/bertrain-stage/
// <scheme>/<bucket>/<prefix>.
std::string default_stage_dir(const std::string& url);

}  // namespace bertrain::train
