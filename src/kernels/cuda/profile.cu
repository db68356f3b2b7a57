// BERTRAIN_CUDA_PROFILE=1 (profile.cuh): events around each backend operation, their times
// summed by name and read back every kFold operations.
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/profile.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/common.cuh"

namespace bertrain::cuda {

namespace {

class Profile {
 public:
  static Profile& get() {
    static Profile p;
    return p;
  }
  bool on() const { return on_; }
  cudaEvent_t event() {
    std::lock_guard<std::mutex> lock(mu_);
    if (pool_.empty()) {
      cudaEvent_t e = nullptr;
      BT_CUDA_CHECK(cudaEventCreate(&e));
      return e;
    }
    cudaEvent_t e = pool_.back();
    pool_.pop_back();
    return e;
  }
  void add(const char* name, cudaEvent_t a, cudaEvent_t b) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back({name, a, b});
    if (pending_.size() >= kFold) fold();
  }
  std::string table(int64_t steps) {
    std::lock_guard<std::mutex> lock(mu_);
    fold();
    double all = 0;
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [name, t] : totals_) {
      all += t.ms;
      rows.push_back({t.ms, name});
    }
    std::sort(rows.rbegin(), rows.rend());
    const double per = static_cast<double>(std::max<int64_t>(steps, 1));
    std::string out;
    char line[160];
    std::snprintf(line, sizeof line, "    %-30s %10s %10s %7s\n", "operation", "calls/step",
                  "ms/step", "share");
    out += line;
    for (const auto& [ms, name] : rows) {
      std::snprintf(line, sizeof line, "    %-30s %10.1f %10.3f %6.1f%%\n", name.c_str(),
                    static_cast<double>(totals_[name].calls) / per, ms / per,
                    all > 0 ? 100.0 * ms / all : 0.0);
      out += line;
    }
    std::snprintf(line, sizeof line, "    %-30s %10s %10.3f\n", "all operations", "", all / per);
    out += line;
    totals_.clear();
    return out;
  }

 private:
  static constexpr size_t kFold = 4096;
  struct Span {
    const char* name;
    cudaEvent_t a, b;
  };
  struct Total {
    double ms = 0;
    int64_t calls = 0;
  };
  Profile() {
    const char* e = std::getenv("BERTRAIN_CUDA_PROFILE");
    on_ = e && *e && std::strcmp(e, "0") != 0;
  }
  void fold() {  // (mu_ held)
    for (const Span& s : pending_) {
      float ms = 0;
      BT_CUDA_WAIT(cudaEventSynchronize(s.b));
      BT_CUDA_CHECK(cudaEventElapsedTime(&ms, s.a, s.b));
      Total& t = totals_[s.name];
      t.ms += ms;
      ++t.calls;
      pool_.push_back(s.a);
      pool_.push_back(s.b);
    }
    pending_.clear();
  }
  bool on_ = false;
  std::mutex mu_;
  std::vector<Span> pending_;
  std::vector<cudaEvent_t> pool_;
  std::map<std::string, Total> totals_;
};

}  // namespace

bool profile_on() {
  return Profile::get().on();
}

std::string profile_table(int64_t steps) {
  return profile_on() ? Profile::get().table(steps) : std::string();
}

Op::Op(const char* name) : name_(name) {
  // (inside a CUDA graph's capture the events would be the graph's: the graph is timed whole)
  if (!profile_on() || capturing()) return;
  start_ = Profile::get().event();
  BT_CUDA_CHECK(cudaEventRecord(start_, compute_stream()));
}

Op::~Op() {
  if (!start_) return;
  try {  // (a CUDA error here: the operation's own check, or the next one, reports it)
    Profile& p = Profile::get();
    cudaEvent_t end = p.event();
    BT_CUDA_CHECK(cudaEventRecord(end, compute_stream()));
    p.add(name_, start_, end);
  } catch (const Error&) {
  }
}

}  // namespace bertrain::cuda
