#include "core/error.h"

#include <cstdio>
#include <cstdlib>

namespace bertrain::detail {

void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "bertrain: internal check failed: %s\n  at %s:%d\n", expr, file, line);
  if (!msg.empty()) std::fprintf(stderr, "  %s\n", msg.c_str());
  std::fprintf(stderr, "  This is a bug in bertrain; please report it with the command line.\n");
  std::fflush(stderr);
  std::abort();
}

}  // namespace bertrain::detail
