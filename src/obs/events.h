// Run metrics where users look for them:
// - TensorBoard event files (EventWriter): dir/events.out.tfevents.<unix time>.<host>, TFRecord
//   framing of tensorflow.Event protos: the "brain.Event:2" version record, then one Event of
//   scalar summaries (simple_value) per logged step. Flushed after every write, so TensorBoard
//   shows a running job. A resumed run opens a new file that starts with a SessionLog START at
//   the resumed step: TensorBoard then drops the older files' events from that step on (those
//   of the steps the run repeats after its last checkpoint).
// - metrics.jsonl (MetricsLog): one JSON object per logged step with the same values and
//   rank_step_ms, each rank's mean step time less its exposed wait for the others in the
//   gradient sum (a straggler's is the largest); a resume drops the rows past the resumed step.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace bertrain::obs {

using Scalars = std::vector<std::pair<std::string, double>>;

class EventWriter {
 public:
  // Creates the directory if needed and a new event file in it. resumed_step >= 0: the run
  // continues from that step (writes the SessionLog START record).
  explicit EventWriter(const std::string& dir, int64_t resumed_step = -1);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  // One Event at `step` with these scalars (tag -> value), written and flushed.
  void scalars(int64_t step, const Scalars& values);
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& serialized);
  std::string path_;
  std::FILE* f_ = nullptr;
};

class MetricsLog {
 public:
  // Opens dir/<name> for appending; resumed_step >= 0 first drops rows whose "step" is beyond it
  // (rewritten atomically).
  explicit MetricsLog(const std::string& dir, int64_t resumed_step = -1,
                      const std::string& name = "metrics.jsonl");
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const nlohmann::json& row);  // one line, flushed
  // The row {"step": step, tag: value..., extra's fields...}: what EventWriter::scalars logs.
  void write(int64_t step, const Scalars& values, nlohmann::json extra = nlohmann::json::object());
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace bertrain::obs
