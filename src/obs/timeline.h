// Timeline: spans of work (input wait, forward/backward per layer, allreduce, optimizer,
// checkpoint) per rank and thread, written as a Chrome trace (chrome://tracing, Perfetto).
// With several ranks every rank writes its part and rank 0 merges them into one file, so one
// view shows the whole step on every rank (pid = rank).
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace bertrain::obs {

class Timeline {
 public:
  struct Event {
    std::string name;
    const char* cat;
    int64_t ts, dur;  // us since the timeline began
    int tid;
  };
  bool enabled() const { return enabled_; }
  void enable(int rank) {
    enabled_ = true;
    rank_ = rank;
  }
  int64_t now_us() const {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                                 t0_)
        .count();
  }
  void add(const std::string& name, const char* cat, int64_t begin_us, int64_t end_us, int tid = 0);
  std::vector<Event> events() const {  // this rank's, in the order added
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  // Writes this rank's events to path (world == 1) or to path.rankN.part; merge() on rank 0
  // after a barrier joins the parts into path.
  void write(const std::string& path, int world) const;
  static void merge(const std::string& path, int world);

  // RAII span: Span s(tl, "forward", "compute");
  class Span {
   public:
    Span(Timeline* tl, std::string name, const char* cat)
        : tl_(tl && tl->enabled() ? tl : nullptr),
          name_(std::move(name)),
          cat_(cat),
          begin_(tl_ ? tl_->now_us() : 0) {}
    ~Span() {
      if (tl_) tl_->add(name_, cat_, begin_, tl_->now_us());
    }

   private:
    Timeline* tl_;
    std::string name_;
    const char* cat_;
    int64_t begin_;
  };

 private:
  bool enabled_ = false;
  int rank_ = 0;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  mutable std::mutex mu_;
  std::vector<Event> events_;
};

}  // namespace bertrain::obs
