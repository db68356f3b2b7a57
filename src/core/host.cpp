#include "core/host.h"

#include <unistd.h>

namespace bertrain {

std::string host_name() {
  char h[256] = {};
  ::gethostname(h, sizeof h - 1);
  return h;
}

}  // namespace bertrain
