// `bertrain report`: one self-contained HTML page (inline SVG, no scripts, nothing fetched) from
// run directories' metrics.jsonl (obs/events.h) and their latest checkpoint's settings: loss and
// accuracy curves (runs overlaid), throughput, learning rate and loss scale, the step-time
// breakdown over the run (stacked), every rank's step time, memory, and the settings.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace bertrain::obs {

struct RunMetrics {
  std::string dir, name;
  std::vector<nlohmann::json> rows;   // metrics.jsonl, in step order
  std::vector<nlohmann::json> evals;  // eval.jsonl (bertrain eval of the run), in step order
  nlohmann::json settings;            // the latest checkpoint's trainer settings (may be null)
};

// Reads dir/metrics.jsonl (an error naming the file when absent or empty) and, when present,
// the settings of dir's latest checkpoint.
RunMetrics load_run(const std::string& dir);

std::string render_report(const std::vector<RunMetrics>& runs);

}  // namespace bertrain::obs
