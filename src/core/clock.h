// The monotonic clock every timing in bertrain reads, and the seconds since a time point on it.
#pragma once

#include <chrono>

namespace bertrain {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace bertrain
