// Errors in two tiers (STYLE.md §5).
// BT_CHECK: a programming error (broken invariant) -> message with expression, file, line, hint;
// then abort. bertrain::Error: a user or environment error (bad config, file, shape) carrying
// what was wrong, where, and what to do; the CLI prints its message on one line and exits 1.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace bertrain {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
[[noreturn]] void check_failed(const char* expr, const char* file, int line,
                               const std::string& msg);

inline void format_into(std::ostringstream&) {}
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  format_into(os, rest...);
}
}  // namespace detail

// Concatenates the arguments with operator<<: str("bad dim ", d, " in ", name).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::format_into(os, args...);
  return os.str();
}

// Throws bertrain::Error with the concatenated message.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(str(args...));
}

}  // namespace bertrain

#define BT_CHECK(cond, ...)                                                             \
  do {                                                                                  \
    if (!(cond))                                                                        \
      ::bertrain::detail::check_failed(#cond, __FILE__, __LINE__,                       \
                                       ::bertrain::str("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
