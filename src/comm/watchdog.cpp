#include "comm/watchdog.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "comm/incidents.h"
#include "comm/mpi_transport.h"
#include "core/error.h"
#include "core/setting.h"

namespace bertrain::comm {

namespace {

// x with `digits` decimals, for messages.
std::string fixed(double x, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

StallWatchdog::StallWatchdog(const MpiTransport& t) : t_(t) {
  open_probe();
  int64_t* prog = nullptr;
  const int ls = t_.local_size();
  mpi_check(
      MPI_Win_allocate_shared(t_.local_rank() == 0 ? ls * sizeof(int64_t) : 0, sizeof(int64_t),
                              MPI_INFO_NULL, t_.node(), &prog, &progress_win_),
      "MPI_Win_allocate_shared(progress)");
  MPI_Aint sz;
  int disp;
  MPI_Win_shared_query(progress_win_, 0, &sz, &disp, &prog);
  progress_ = prog;
  if (t_.local_rank() == 0)
    for (int r = 0; r < ls; ++r) progress_[r] = 0;
  MPI_Barrier(MPI_COMM_WORLD);
  if (const char* s = std::getenv("BERTRAIN_STALL_TIMEOUT")) stall_timeout_ = std::atof(s);
  thread_ = std::thread([this] { loop(); });
}

StallWatchdog::~StallWatchdog() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (probe_fd_ >= 0) ::close(probe_fd_);
  MPI_Barrier(MPI_COMM_WORLD);
  if (progress_win_ != MPI_WIN_NULL) MPI_Win_free(&progress_win_);
}

void StallWatchdog::set_label(const std::string& label) {
  std::lock_guard<std::mutex> lock(label_mu_);
  label_ = label;
}

void StallWatchdog::enter(const char* what) {
  progress_[t_.local_rank()] = progress_[t_.local_rank()] + 1;
  in_what_ = what;
  in_since_ = now_s();
}

void StallWatchdog::leave() {
  in_since_ = 0;
  waiting_on_ = -1;
}

StallWatchdog::Waiting StallWatchdog::waiting_on(int world_rank) {
  waiting_on_ = world_rank;
  return Waiting{waiting_on_};
}

void StallWatchdog::open_probe() {
  ProbeAddress mine;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof sa;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
      ::listen(fd, 64) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0) {
    probe_fd_ = fd;
    mine.port = ntohs(sa.sin_port);
    ifaddrs* ifs = nullptr;
    int k = 0;
    if (::getifaddrs(&ifs) == 0) {
      for (ifaddrs* i = ifs; i && k < kProbeAddrs; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) &&
            !(i->ifa_flags & IFF_LOOPBACK))
          mine.addr[k++] = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr;
      ::freeifaddrs(ifs);
    }
    if (k == 0) mine.addr[0] = htonl(INADDR_LOOPBACK);
  } else if (fd >= 0) {
    ::close(fd);
  }
  probe_.resize(t_.size());
  mpi_check(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, probe_.data(), sizeof mine, MPI_BYTE,
                          MPI_COMM_WORLD),
            "MPI_Allgather(probe addresses)");
}

// Connects to every other rank's probe port (all its addresses at once) within timeout_s:
// per rank 1 answered, 0 refused (the host is up, the process gone), -1 no answer (the host
// is down or cut off), -2 no route from here (this host's link is down), 2 not probed (this
// rank, or a rank without a probe port).
std::vector<int> StallWatchdog::probe_ranks(double timeout_s) const {
  std::vector<int> state(t_.size(), 2);
  struct Try {
    int fd, rank;
  };
  std::vector<Try> tries;
  for (int r = 0; r < t_.size(); ++r) {
    const ProbeAddress& p = probe_[r];
    if (r == t_.rank() || p.port == 0) continue;
    state[r] = -1;
    for (uint32_t a : p.addr) {
      if (a == 0) continue;
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(p.port);
      sa.sin_addr.s_addr = a;
      if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) {
        state[r] = 1;
        ::close(fd);
      } else if (errno == EINPROGRESS) {
        tries.push_back({fd, r});
      } else {  // refused: the host answered; no route: this host's own link
        if (state[r] != 1) state[r] = errno == ECONNREFUSED ? 0 : -2;
        ::close(fd);
      }
    }
  }
  const double deadline = now_s() + timeout_s;
  while (!tries.empty() && now_s() < deadline) {
    std::vector<pollfd> fds;
    for (const auto& t : tries) fds.push_back({t.fd, POLLOUT, 0});
    ::poll(fds.data(), fds.size(), 20);
    std::vector<Try> still;
    for (size_t i = 0; i < tries.size(); ++i) {
      if (fds[i].revents == 0) {
        still.push_back(tries[i]);
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(tries[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      int& st = state[tries[i].rank];
      if (err == 0)
        st = 1;
      else if (st != 1 && err == ECONNREFUSED)
        st = 0;
      ::close(tries[i].fd);
    }
    tries.swap(still);
  }
  for (const auto& t : tries) ::close(t.fd);
  return state;
}

// What a probe found, for the ranks that did not answer: "ranks 2-3 on host h1: process gone
// (connection refused)" or "...: no answer (...)"; that this host has no route to the others;
// empty when every rank answered or none could be probed.
std::string StallWatchdog::probe_report(double timeout_s) const {
  const std::vector<int> st = probe_ranks(timeout_s);
  std::string out;
  int answered = 0, silent = 0, no_route = 0, elsewhere_answered = 0;
  for (int r = 0; r < t_.size(); ++r) {
    answered += st[r] == 1;
    silent += st[r] == -1;
    no_route += st[r] == -2;
    elsewhere_answered += st[r] == 1 && t_.host_of(r) != t_.host_of(t_.rank());
  }
  if (no_route > 0 && elsewhere_answered == 0)
    return str("no route from this host (", t_.host_of(t_.rank()),
               ") to the others: its link is down");
  if (answered == 0 && silent > 1)
    return str("no rank answered a TCP probe (a firewall between the hosts?)");
  for (int r = 0; r < t_.size();) {  // runs of ranks with the same host and state
    if (st[r] == 1 || st[r] == 2 || st[r] == -2) {
      ++r;
      continue;
    }
    int e = r;
    while (e + 1 < t_.size() && st[e + 1] == st[r] && t_.host_of(e + 1) == t_.host_of(r)) ++e;
    out += str(out.empty() ? "" : "; ", e > r ? str("ranks ", r, "-", e) : str("rank ", r),
               " on host ", t_.host_of(r),
               st[r] == 0 ? ": process gone (connection refused)"
                          : ": no answer (the host is down or its link is cut)");
    r = e + 1;
  }
  return out;
}

// Whom this rank waits for in the collective it is in: the rank a ring step receives from when
// it is on another host; else this host's ranks that have not joined (the shared progress
// table); else, with every local rank there, the ranks of the other hosts.
std::string StallWatchdog::waited_for(bool* remote) const {
  *remote = true;
  const int peer = waiting_on_.load();
  if (peer >= 0 && t_.host_of(peer) != t_.host_of(t_.rank()))
    return str("rank ", peer, " on host ", t_.host_and_ranks(peer));
  const int64_t mine = progress_[t_.local_rank()];
  std::string missing;
  for (int r = 0; r < t_.local_size(); ++r)
    if (progress_[r] < mine)
      missing += str(missing.empty() ? "" : ", ", t_.rank() - t_.local_rank() + r);
  if (t_.size() > t_.local_size() && missing.empty())
    return str("the ranks on ", t_.hosts_summary(true));
  *remote = false;
  return missing.empty() ? "" : str("rank(s) ", missing, " on this host");
}

void StallWatchdog::loop() {
  double signalled_at = 0;  // when this thread first saw the stop request
  while (!stop_) {
    ::usleep(100 * 1000);
    if (probe_fd_ >= 0)  // peers' probes: accept and close
      for (int c; (c = ::accept4(probe_fd_, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) ::close(c);
    const double since = in_since_.load();
    const int sig = Incidents::process().interrupt();
    const char* what = in_what_.load() ? in_what_.load() : "?";
    if (sig != 0) on_interrupt(sig, since, what, signalled_at);
    if (since != 0 && stall_timeout_ > 0 && now_s() - since >= stall_timeout_)
      on_stall(since, what);
  }
}

// A stop request: said once, with whom this rank waited for; the job ends when the collective
// still waits past the grace.
void StallWatchdog::on_interrupt(int sig, double since, const char* what,
                                 double& signalled_at) const {
  const Incidents& incidents = Incidents::process();
  if (signalled_at == 0) {
    signalled_at = now_s();
    // A launcher that lost a host ends the others with SIGTERM and, a second later, SIGKILL:
    // say at once whom this rank waited for and which ranks are gone (a TCP probe of 0.3 s).
    // A stop that every rank received (preemption) finds every rank answering: no message.
    if (t_.size() > 1) {
      bool remote = false;
      const std::string who = since != 0 ? waited_for(&remote) : "";
      const std::string gone = probe_report(0.3);
      if (!gone.empty() || remote)
        incidents.report(str("bertrain: rank ", t_.rank(), " on host ", t_.host_of(t_.rank()),
                             ": signal ", sig,
                             since != 0 ? str(" while collective '", what, "' waited ",
                                              fixed(signalled_at - since, 1), " s for ", who)
                                        : std::string(" outside a collective"),
                             gone.empty() ? "" : "; probe: ", gone));
    }
  }
  if (since != 0 && now_s() - std::max(since, signalled_at) >= incidents.grace_s()) {
    incidents.report(str("bertrain: rank ", t_.rank(), ": stopped by signal ", sig,
                         " while collective '", what, "' waited ", fixed(now_s() - since, 0),
                         " s for the other ranks: the step cannot finish, so the job ends now; "
                         "the last complete checkpoint stands (continue with ",
                         setting("resume"), ")"));
    abort_job(128 + sig);
  }
}

void StallWatchdog::on_stall(double since, const char* what) {
  std::string label;
  {
    std::lock_guard<std::mutex> lock(label_mu_);
    label = label_;
  }
  bool remote = false;
  const std::string who = waited_for(&remote);
  const std::string gone = probe_report(1.0);
  Incidents::process().report(
      str("bertrain: rank ", t_.rank(), " on host ", t_.host_of(t_.rank()), ": collective '", what,
          "'", label.empty() ? "" : " of ", label, " (#", progress_[t_.local_rank()],
          ") has waited ", fixed(now_s() - since, 0), " s (", setting("stall_timeout"), " ",
          fixed(stall_timeout_, 0), " s) for ", who.empty() ? "the other ranks" : who, ": ",
          remote ? "a host died, hangs, or its link is down"
                 : "a rank died, hangs, or runs another step",
          gone.empty() ? "" : "; probe: ", gone,
          "; aborting the job (continue from the last checkpoint with ", setting("resume"),
          ", on the hosts left if one is lost)."));
  abort_job(3);
}

// MPI_Abort asks the launcher to end every rank; when the launcher cannot be reached (this
// host's link is down) it may never return, so the rank exits by itself after a grace period.
void StallWatchdog::abort_job(int code) const {
  std::thread([code] {
    ::sleep(5);
    std::_Exit(code);
  }).detach();
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace bertrain::comm
