#include "obs/timeline.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/safetensors.h"

namespace bertrain::obs {

void Timeline::add(const std::string& name, const char* cat, int64_t begin_us, int64_t end_us,
                   int tid) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back({name, cat, begin_us, end_us - begin_us, tid});
}

namespace {
std::string events_json(const std::vector<nlohmann::json>& evs) {
  std::string out;
  for (const auto& e : evs) out += (out.empty() ? "" : ",\n") + e.dump();
  return out;
}
}  // namespace

void Timeline::write(const std::string& path, int world) const {
  std::vector<nlohmann::json> evs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    evs.push_back({{"name", "process_name"},
                   {"ph", "M"},
                   {"pid", rank_},
                   {"args", {{"name", str("rank ", rank_)}}}});
    for (const auto& e : events_)
      evs.push_back({{"name", e.name},
                     {"cat", e.cat},
                     {"ph", "X"},
                     {"ts", e.ts},
                     {"dur", e.dur},
                     {"pid", rank_},
                     {"tid", e.tid}});
  }
  if (world <= 1) {
    write_file_atomic(path, "{\"traceEvents\": [\n" + events_json(evs) + "\n]}\n");
  } else {
    write_file_atomic(path + ".rank" + std::to_string(rank_) + ".part", events_json(evs));
  }
}

void Timeline::merge(const std::string& path, int world) {
  std::string all;
  for (int r = 0; r < world; ++r) {
    const std::string part = path + ".rank" + std::to_string(r) + ".part";
    std::ifstream in(part);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!ss.str().empty()) all += (all.empty() ? "" : ",\n") + ss.str();
    std::error_code ec;
    std::filesystem::remove(part, ec);
  }
  write_file_atomic(path, "{\"traceEvents\": [\n" + all + "\n]}\n");
}

}  // namespace bertrain::obs
