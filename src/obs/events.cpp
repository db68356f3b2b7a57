#include "obs/events.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/safetensors.h"
#include "data/tfrecord.h"
#include "tensorflow/core/util/event.pb.h"

namespace bertrain::obs {

namespace fs = std::filesystem;

namespace {

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::FILE* open_append(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "ab");
  if (!f) fail("cannot open ", path, " for writing: ", std::strerror(errno));
  return f;
}

void write_all(std::FILE* f, const std::string& bytes, const std::string& path) {
  if (std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fflush(f) != 0) {
    const int e = errno;
    fail("cannot write ", path, ": ", std::strerror(e),
         e == ENOSPC ? " (the disk is full; free space in the run directory)" : "");
  }
}

}  // namespace

EventWriter::EventWriter(const std::string& dir, int64_t resumed_step) {
  fs::create_directories(dir);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double now = wall_time();
  // One file per process start; a second writer within the same second gets a suffix.
  std::string base = (fs::path(dir) / ("events.out.tfevents." +
                                       std::to_string(static_cast<int64_t>(now)) + "." + host))
                         .string();
  path_ = base;
  for (int i = 1; fs::exists(path_); ++i) path_ = base + "." + std::to_string(i);
  f_ = open_append(path_);
  tensorflow::Event version;
  version.set_wall_time(now);
  version.set_file_version("brain.Event:2");
  write_event(version.SerializeAsString());
  if (resumed_step >= 0) {
    // TensorBoard's EventAccumulator purges the events at and after this step.
    tensorflow::Event start;
    start.set_wall_time(now);
    start.set_step(resumed_step);
    start.mutable_session_log()->set_status(tensorflow::SessionLog::START);
    write_event(start.SerializeAsString());
  }
}

EventWriter::~EventWriter() {
  if (f_) std::fclose(f_);
}

void EventWriter::write_event(const std::string& serialized) {
  std::string framed;
  data::append_tfrecord_frame(framed, serialized);
  write_all(f_, framed, path_);
}

void EventWriter::scalars(int64_t step, const Scalars& values) {
  tensorflow::Event e;
  e.set_wall_time(wall_time());
  e.set_step(step);
  for (const auto& [tag, v] : values) {
    tensorflow::Summary::Value* sv = e.mutable_summary()->add_value();
    sv->set_tag(tag);
    sv->set_simple_value(static_cast<float>(v));
  }
  write_event(e.SerializeAsString());
}

MetricsLog::MetricsLog(const std::string& dir, int64_t resumed_step, const std::string& name) {
  fs::create_directories(dir);
  path_ = (fs::path(dir) / name).string();
  if (resumed_step >= 0 && fs::exists(path_)) {
    std::ifstream in(path_);
    std::string line, kept;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
      // A torn last line (the process died while writing it) goes too.
      if (row.is_discarded() || !row.contains("step")) continue;
      if (row["step"].get<int64_t>() <= resumed_step) kept += line + "\n";
    }
    write_file_atomic(path_, kept);
  }
  f_ = open_append(path_);
}

MetricsLog::~MetricsLog() {
  if (f_) std::fclose(f_);
}

void MetricsLog::write(const nlohmann::json& row) {
  write_all(f_, row.dump() + "\n", path_);
}

void MetricsLog::write(int64_t step, const Scalars& values, nlohmann::json extra) {
  extra["step"] = step;
  for (const auto& [tag, v] : values) extra[tag] = v;
  write(extra);
}

}  // namespace bertrain::obs
