#include "comm/incidents.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>

namespace bertrain::comm {

Incidents& Incidents::process() {
  static Incidents incidents;
  return incidents;
}

void Incidents::set_interrupt(const std::atomic<int>* flag, double grace_s) {
  grace_s_ = grace_s;
  interrupt_ = flag;
}

int Incidents::interrupt() const {
  const std::atomic<int>* flag = interrupt_.load();
  return flag ? flag->load() : 0;
}

void Incidents::set_log(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  log_ = path;
}

void Incidents::report(const std::string& line) const {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  std::string path;
  {
    std::lock_guard<std::mutex> lock(mu_);
    path = log_;
  }
  if (path.empty()) return;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return;
  const std::string l = line + "\n";
  [[maybe_unused]] const ssize_t w = ::write(fd, l.data(), l.size());  // one append: whole lines
  ::fsync(fd);
  ::close(fd);
}

}  // namespace bertrain::comm
