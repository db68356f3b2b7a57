// `bertrain report`: one self-contained HTML page (inline SVG, no scripts, nothing fetched) from
// run directories' metrics.jsonl (obs/events.h) and their latest checkpoint's settings: loss and
// accuracy curves (runs overlaid), throughput, learning rate and loss scale, the step-time
// breakdown over the run (stacked), every rank's step time, memory, and the settings.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace bertrain::obs {

// One span of the Chrome timeline (train --timeline), in ms from the start of its step.
struct TraceSpan {
  std::string name, cat;
  double start_ms = 0, dur_ms = 0;
  int64_t thread = 0;  // 0: the training thread; 1: the gradient reducer's
};

struct RunMetrics {
  std::string dir, name;
  std::vector<nlohmann::json> rows;  // metrics.jsonl's logged steps, in step order
  // metrics.jsonl's elastic restarts and growths ({"event": "restart"|"grow", "step", ...}: the
  // trainer's record of launch --elastic's restarts), in file order
  std::vector<nlohmann::json> events;
  std::vector<nlohmann::json> evals;  // eval.jsonl (bertrain eval of the run), in step order
  nlohmann::json settings;            // the latest checkpoint's trainer settings (may be null)
  // The last complete step of rank 0 in dir/timeline.json (train --timeline RUN/timeline.json),
  // when there is one: what ran when, on which thread.
  std::string trace_step;  // "step 41"
  double trace_step_ms = 0;
  std::vector<TraceSpan> trace;
};

// Reads dir/metrics.jsonl (an error naming the file when absent or empty) and, when present,
// the settings of dir's latest checkpoint and the last step of dir/timeline.json.
RunMetrics load_run(const std::string& dir);

std::string render_report(const std::vector<RunMetrics>& runs);

// The timeline step's communication: allreduce time on the reducer thread, the part of it that
// ran during backward (hidden), and the training thread's wait for the sum (exposed), in ms.
struct TraceOverlap {
  double comm = 0, hidden = 0, exposed = 0;
};
TraceOverlap trace_overlap(const RunMetrics& r);

}  // namespace bertrain::obs
