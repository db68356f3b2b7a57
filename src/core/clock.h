// The monotonic clock every timing in bertrain reads, and the seconds since a time point on it;
// and wall-clock time as unix seconds, for records other processes compare (metrics.jsonl,
// the elastic supervisor's failure times).
#pragma once

#include <chrono>

namespace bertrain {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

inline double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace bertrain
