// The machine a process runs on, as messages name it.
#pragma once

#include <string>

namespace bertrain {

// This host's name (gethostname), for messages and file names that say where something ran.
std::string host_name();

}  // namespace bertrain
