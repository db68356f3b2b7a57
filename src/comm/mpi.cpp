#include "comm/mpi.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <mpi.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/arena.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/setting.h"

namespace bertrain::comm {

Algorithm parse_algorithm(const std::string& s) {
  // auto: zero-copy shared memory within a node, hierarchical once ranks span nodes.
  if (s == "auto") return Algorithm::Shm;
  if (s == "mpi") return Algorithm::Mpi;
  if (s == "ring") return Algorithm::Ring;
  if (s == "shm") return Algorithm::Shm;
  if (s == "hierarchical") return Algorithm::Hierarchical;
  fail(setting("allreduce"), " must be auto, shm, ring, hierarchical or mpi, got '", s, "'");
}

Precision parse_wire(const std::string& s) {
  if (s == "none" || s == "fp32") return Precision::FP32;
  if (s == "fp16") return Precision::FP16;
  if (s == "bf16") return Precision::BF16;
  fail(setting("compression"), " must be none, fp16 or bf16, got '", s, "'");
}

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::Mpi:
      return "mpi";
    case Algorithm::Ring:
      return "ring";
    case Algorithm::Shm:
      return "shm";
    case Algorithm::Hierarchical:
      return "hierarchical";
  }
  return "?";
}

const char* wire_name(Precision w) {
  return w == Precision::FP32 ? "none" : w == Precision::FP16 ? "fp16" : "bf16";
}

std::string mpi_library_version() {
  char v[MPI_MAX_LIBRARY_VERSION_STRING];
  int n = 0;
  if (MPI_Get_library_version(v, &n) != MPI_SUCCESS) return "unknown";
  std::string s(v, static_cast<size_t>(n));
  if (const size_t nl = s.find_first_of("\r\n,"); nl != std::string::npos) s.resize(nl);
  return s;
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

namespace {

// x with `digits` decimals, for messages.
std::string fixed(double x, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

constexpr int64_t kShmSlotFloats = kShmSlotBytes / 4;  // per rank and pass
constexpr int64_t kRingSegment = int64_t{1} << 18;     // floats per message (1 MiB: in L2)

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fail("MPI error in ", what, ": ", std::string(msg, len));
  }
}

}  // namespace

struct MpiCommunicator::Impl {
  MPI_Comm node = MPI_COMM_NULL, leaders = MPI_COMM_NULL;
  MPI_Win win = MPI_WIN_NULL;
  float* slot0 = nullptr;  // this rank's slot; peers at slot0 + (r - local_rank) * stride
  std::vector<float*> slots;
  MPI_Win progress_win = MPI_WIN_NULL;
  volatile int64_t* progress = nullptr;  // per local rank: collectives entered
  std::vector<uint16_t> wire_send, wire_recv;
  std::vector<float> recv;
  std::vector<float> part;  // MPI_Reduce_scatter's result before it moves into place
  bool owns_mpi = false;
  std::vector<std::string> hosts;  // per world rank
  // Liveness probe, outside MPI: every rank listens on a TCP port (never read; the watchdog
  // accepts and closes), and knows every rank's IPv4 addresses and port.
  static constexpr int kProbeAddrs = 4;
  struct ProbeAddress {
    uint32_t addr[kProbeAddrs] = {};  // network order; 0 = unused
    uint16_t port = 0;
  };
  int probe_fd = -1;
  std::vector<ProbeAddress> probe;  // per world rank
  struct SharedBuffer {
    MPI_Win win = MPI_WIN_NULL;
    std::vector<float*> base;  // per local rank
    int64_t n = 0;
  };
  std::vector<SharedBuffer> shared;
  std::vector<float*> peer_ptrs;  // allreduce_shm's view of one range in every rank's buffer
  // The shared buffer that holds [data, data + n) of local rank lr, if any.
  const SharedBuffer* shared_buffer_of(const float* data, int64_t n, int lr) const {
    for (const auto& b : shared)
      if (data >= b.base[lr] && data + n <= b.base[lr] + b.n) return &b;
    return nullptr;
  }
};

namespace {

// ptrs[q]: local rank q's copy of the same floats. This rank sums [b, e) over all copies (in
// rank order: any split of the range among ranks gives the same bits) and writes the sum into
// every copy (an allreduce's share), or into its own copy only (a reduce-scatter's part, when
// `all` is false). The caller fences with barriers.
void reduce_share(const std::vector<float*>& ptrs, int64_t b, int64_t e, int lr, bool all) {
  const int p = static_cast<int>(ptrs.size());
  constexpr int64_t kBlock = 4096;  // floats: the partial sum stays in L1
#pragma omp parallel for schedule(static) if (e - b > (int64_t{1} << 18))
  for (int64_t blk = b; blk < e; blk += kBlock) {
    const int64_t len = std::min(kBlock, e - blk);
    alignas(64) float sum[kBlock];
    const float* p0 = ptrs[0] + blk;
    for (int64_t i = 0; i < len; ++i) sum[i] = p0[i];
    for (int q = 1; q < p; ++q) {
      const float* pq = ptrs[q] + blk;
      for (int64_t i = 0; i < len; ++i) sum[i] += pq[i];
    }
    if (all)
      for (int q = 0; q < p; ++q) std::memcpy(ptrs[q] + blk, sum, len * sizeof(float));
    else
      std::memcpy(ptrs[lr] + blk, sum, len * sizeof(float));
  }
}

// An allreduce's share of k floats for local rank lr of p.
void reduce_share_into_all(const std::vector<float*>& ptrs, int64_t k, int lr) {
  const int p = static_cast<int>(ptrs.size());
  reduce_share(ptrs, k * lr / p, k * (lr + 1) / p, lr, true);
}

}  // namespace

MpiCommunicator::MpiCommunicator(int* argc, char*** argv) : impl_(new Impl) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    impl_->owns_mpi = true;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  if (const char* ls = std::getenv("BERTRAIN_LOCAL_SIZE")) {
    const int k = std::max(1, std::atoi(ls));
    check(MPI_Comm_split(MPI_COMM_WORLD, rank_ / k, rank_, &impl_->node), "MPI_Comm_split");
  } else {
    check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL,
                              &impl_->node),
          "MPI_Comm_split_type");
  }
  MPI_Comm_rank(impl_->node, &local_rank_);
  MPI_Comm_size(impl_->node, &local_size_);
  {  // every rank's hostname, for messages that name a host
    constexpr int kName = 64;
    std::vector<char> all(static_cast<size_t>(kName) * size_, '\0');
    char mine[kName] = {};
    ::gethostname(mine, kName - 1);
    check(MPI_Allgather(mine, kName, MPI_CHAR, all.data(), kName, MPI_CHAR, MPI_COMM_WORLD),
          "MPI_Allgather(hostnames)");
    for (int r = 0; r < size_; ++r)
      impl_->hosts.emplace_back(all.data() + static_cast<size_t>(r) * kName,
                                ::strnlen(all.data() + static_cast<size_t>(r) * kName, kName));
  }
  check(
      MPI_Comm_split(MPI_COMM_WORLD, local_rank_ == 0 ? 0 : MPI_UNDEFINED, rank_, &impl_->leaders),
      "MPI_Comm_split(leaders)");
  open_probe();
  // Shared window: one slot per local rank, plus the progress table.
  float* base = nullptr;
  check(MPI_Win_allocate_shared(kShmSlotFloats * sizeof(float), sizeof(float), MPI_INFO_NULL,
                                impl_->node, &base, &impl_->win),
        "MPI_Win_allocate_shared");
  impl_->slots.resize(local_size_);
  for (int r = 0; r < local_size_; ++r) {
    MPI_Aint sz;
    int disp;
    MPI_Win_shared_query(impl_->win, r, &sz, &disp, &impl_->slots[r]);
  }
  int64_t* prog = nullptr;
  check(
      MPI_Win_allocate_shared(local_rank_ == 0 ? local_size_ * sizeof(int64_t) : 0, sizeof(int64_t),
                              MPI_INFO_NULL, impl_->node, &prog, &impl_->progress_win),
      "MPI_Win_allocate_shared(progress)");
  MPI_Aint sz;
  int disp;
  MPI_Win_shared_query(impl_->progress_win, 0, &sz, &disp, &prog);
  impl_->progress = prog;
  if (local_rank_ == 0)
    for (int r = 0; r < local_size_; ++r) impl_->progress[r] = 0;
  MPI_Barrier(MPI_COMM_WORLD);
  if (const char* t = std::getenv("BERTRAIN_STALL_TIMEOUT")) stall_timeout_ = std::atof(t);
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

MpiCommunicator::~MpiCommunicator() {
  stop_ = true;
  if (watchdog_.joinable()) watchdog_.join();
  if (impl_->probe_fd >= 0) ::close(impl_->probe_fd);
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto& b : impl_->shared) MPI_Win_free(&b.win);
  if (impl_->win != MPI_WIN_NULL) MPI_Win_free(&impl_->win);
  if (impl_->progress_win != MPI_WIN_NULL) MPI_Win_free(&impl_->progress_win);
  if (impl_->leaders != MPI_COMM_NULL) MPI_Comm_free(&impl_->leaders);
  if (impl_->node != MPI_COMM_NULL) MPI_Comm_free(&impl_->node);
  if (impl_->owns_mpi) MPI_Finalize();
}

const std::string& MpiCommunicator::host_of(int rank) const {
  return impl_->hosts.at(rank);
}

int MpiCommunicator::host_count() const {
  std::vector<std::string> h = impl_->hosts;
  std::sort(h.begin(), h.end());
  return static_cast<int>(std::unique(h.begin(), h.end()) - h.begin());
}

std::string MpiCommunicator::host_and_ranks(int rank) const {
  const std::string& h = host_of(rank);
  std::string ranks;
  for (int r = 0; r < size_;) {
    if (impl_->hosts[r] != h) {
      ++r;
      continue;
    }
    int e = r;
    while (e + 1 < size_ && impl_->hosts[e + 1] == h) ++e;
    ranks += str(ranks.empty() ? "" : ", ", r, e > r ? str("-", e) : "");
    r = e + 1;
  }
  return str(h, " (rank", ranks.find_first_of("-,") == std::string::npos ? " " : "s ", ranks, ")");
}

std::string MpiCommunicator::hosts_summary(bool others) const {
  std::string out;
  int shown = 0, more = 0;
  for (int r = 0; r < size_; ++r) {
    if ((others && host_of(r) == host_of(rank_)) || (r > 0 && host_of(r) == host_of(r - 1)))
      continue;
    if (shown < 4)
      out += str(shown++ == 0 ? "" : ", ", host_and_ranks(r));
    else
      ++more;
  }
  return more > 0 ? str(out, " and ", more, " more host(s)") : out;
}

std::string MpiCommunicator::name() const {
  const int nh = host_count();
  const std::string hosts = nh > 1 ? str(" on ", nh, " hosts: ", hosts_summary(false)) : "";
  return str(
      "MPI, ", size_, " ranks (", size_ / std::max(1, local_size_), " node(s) x ", local_size_,
      hosts, "), allreduce ",
      algo_ == Algorithm::Shm && local_size_ != size_ ? "hierarchical" : algorithm_name(algo_),
      wire_in_use() ? str(", wire ", wire_name(wire_)) : "");
}

void MpiCommunicator::enter(const char* what) {
  impl_->progress[local_rank_] = impl_->progress[local_rank_] + 1;
  in_what_ = what;
  in_since_ = now_s();
}

void MpiCommunicator::leave() {
  in_since_ = 0;
  waiting_on_ = -1;
}

void MpiCommunicator::open_probe() {
  Impl::ProbeAddress mine;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof sa;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
      ::listen(fd, 64) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0) {
    impl_->probe_fd = fd;
    mine.port = ntohs(sa.sin_port);
    ifaddrs* ifs = nullptr;
    int k = 0;
    if (::getifaddrs(&ifs) == 0) {
      for (ifaddrs* i = ifs; i && k < Impl::kProbeAddrs; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) &&
            !(i->ifa_flags & IFF_LOOPBACK))
          mine.addr[k++] = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr;
      ::freeifaddrs(ifs);
    }
    if (k == 0) mine.addr[0] = htonl(INADDR_LOOPBACK);
  } else if (fd >= 0) {
    ::close(fd);
  }
  impl_->probe.resize(size_);
  check(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, impl_->probe.data(), sizeof mine, MPI_BYTE,
                      MPI_COMM_WORLD),
        "MPI_Allgather(probe addresses)");
}

// Connects to every other rank's probe port (all its addresses at once) within timeout_s:
// per rank 1 answered, 0 refused (the host is up, the process gone), -1 no answer (the host
// is down or cut off), -2 no route from here (this host's link is down), 2 not probed (this
// rank, or a rank without a probe port).
std::vector<int> MpiCommunicator::probe_ranks(double timeout_s) const {
  std::vector<int> state(size_, 2);
  struct Try {
    int fd, rank;
  };
  std::vector<Try> tries;
  for (int r = 0; r < size_; ++r) {
    const Impl::ProbeAddress& p = impl_->probe[r];
    if (r == rank_ || p.port == 0) continue;
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
std::string MpiCommunicator::probe_report(double timeout_s) const {
  const std::vector<int> st = probe_ranks(timeout_s);
  std::string out;
  int answered = 0, silent = 0, no_route = 0, elsewhere_answered = 0;
  for (int r = 0; r < size_; ++r) {
    answered += st[r] == 1;
    silent += st[r] == -1;
    no_route += st[r] == -2;
    elsewhere_answered += st[r] == 1 && host_of(r) != host_of(rank_);
  }
  if (no_route > 0 && elsewhere_answered == 0)
    return str("no route from this host (", host_of(rank_), ") to the others: its link is down");
  if (answered == 0 && silent > 1)
    return str("no rank answered a TCP probe (a firewall between the hosts?)");
  for (int r = 0; r < size_;) {  // runs of ranks with the same host and state
    if (st[r] == 1 || st[r] == 2 || st[r] == -2) {
      ++r;
      continue;
    }
    int e = r;
    while (e + 1 < size_ && st[e + 1] == st[r] && host_of(e + 1) == host_of(r)) ++e;
    out += str(out.empty() ? "" : "; ", e > r ? str("ranks ", r, "-", e) : str("rank ", r),
               " on host ", host_of(r),
               st[r] == 0 ? ": process gone (connection refused)"
                          : ": no answer (the host is down or its link is cut)");
    r = e + 1;
  }
  return out;
}

// Whom this rank waits for in the collective it is in: the rank a ring step receives from when
// it is on another host; else this host's ranks that have not joined (the shared progress
// table); else, with every local rank there, the ranks of the other hosts.
std::string MpiCommunicator::waited_for(bool* remote) const {
  *remote = true;
  const int peer = waiting_on_.load();
  if (peer >= 0 && host_of(peer) != host_of(rank_))
    return str("rank ", peer, " on host ", host_and_ranks(peer));
  const int64_t mine = impl_->progress[local_rank_];
  std::string missing;
  for (int r = 0; r < local_size_; ++r)
    if (impl_->progress[r] < mine)
      missing += str(missing.empty() ? "" : ", ", rank_ - local_rank_ + r);
  if (size_ > local_size_ && missing.empty()) return str("the ranks on ", hosts_summary(true));
  *remote = false;
  return missing.empty() ? "" : str("rank(s) ", missing, " on this host");
}

void MpiCommunicator::watchdog_loop() {
  double signalled_at = 0;  // when this thread first saw the stop request
  while (!stop_) {
    ::usleep(100 * 1000);
    if (impl_->probe_fd >= 0)  // peers' probes: accept and close
      for (int c; (c = ::accept4(impl_->probe_fd, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;)
        ::close(c);
    const double since = in_since_.load();
    const std::atomic<int>* flag = interrupt_.load();
    const int sig = flag ? flag->load() : 0;
    const char* what = in_what_.load() ? in_what_.load() : "?";
    if (sig != 0 && signalled_at == 0) {
      signalled_at = now_s();
      // A launcher that lost a host ends the others with SIGTERM and, a second later, SIGKILL:
      // say at once whom this rank waited for and which ranks are gone (a TCP probe of 0.3 s).
      // A stop that every rank received (preemption) finds every rank answering: no message.
      if (size_ > 1) {
        bool remote = false;
        const std::string who = since != 0 ? waited_for(&remote) : "";
        const std::string gone = probe_report(0.3);
        if (!gone.empty() || remote)
          report(str("bertrain: rank ", rank_, " on host ", host_of(rank_), ": signal ", sig,
                     since != 0 ? str(" while collective '", what, "' waited ",
                                      fixed(signalled_at - since, 1), " s for ", who)
                                : std::string(" outside a collective"),
                     gone.empty() ? "" : "; probe: ", gone));
      }
    }
    if (sig != 0 && since != 0 && now_s() - std::max(since, signalled_at) >= interrupt_grace_) {
      report(str("bertrain: rank ", rank_, ": stopped by signal ", sig, " while collective '", what,
                 "' waited ", fixed(now_s() - since, 0),
                 " s for the other ranks: the step cannot finish, so the job ends now; the last "
                 "complete checkpoint stands (continue with ",
                 setting("resume"), ")"));
      abort_job(128 + sig);
    }
    if (since == 0 || stall_timeout_ <= 0 || now_s() - since < stall_timeout_) continue;
    std::string label;
    {
      std::lock_guard<std::mutex> lock(label_mu_);
      label = label_;
    }
    bool remote = false;
    const std::string who = waited_for(&remote);
    const std::string gone = probe_report(1.0);
    report(str("bertrain: rank ", rank_, " on host ", host_of(rank_), ": collective '", what, "'",
               label.empty() ? "" : " of ", label, " (#", impl_->progress[local_rank_],
               ") has waited ", fixed(now_s() - since, 0), " s (", setting("stall_timeout"), " ",
               fixed(stall_timeout_, 0), " s) for ", who.empty() ? "the other ranks" : who, ": ",
               remote ? "a host died, hangs, or its link is down"
                      : "a rank died, hangs, or runs another step",
               gone.empty() ? "" : "; probe: ", gone,
               "; aborting the job (continue from the last checkpoint with ", setting("resume"),
               ", on the hosts left if one is lost)."));
    abort_job(3);
  }
}

void MpiCommunicator::report(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  std::string path;
  {
    std::lock_guard<std::mutex> lock(label_mu_);
    path = incident_log_;
  }
  if (path.empty()) return;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return;
  const std::string l = line + "\n";
  [[maybe_unused]] const ssize_t w = ::write(fd, l.data(), l.size());  // one append: whole lines
  ::fsync(fd);
  ::close(fd);
}

// MPI_Abort asks the launcher to end every rank; when the launcher cannot be reached (this
// host's link is down) it may never return, so the rank exits by itself after a grace period.
void MpiCommunicator::abort_job(int code) {
  std::thread([code] {
    ::sleep(5);
    std::_Exit(code);
  }).detach();
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void MpiCommunicator::allreduce_mpi(float* data, int64_t n) {
  for (int64_t off = 0; off < n; off += int64_t{1} << 30) {
    const int c = static_cast<int>(std::min<int64_t>(n - off, int64_t{1} << 30));
    check(MPI_Allreduce(MPI_IN_PLACE, data + off, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
          "MPI_Allreduce");
  }
}

void MpiCommunicator::allreduce_ring(float* data, int64_t n, Precision wire, void* comm_ptr) {
  int p;
  MPI_Comm_size(*static_cast<MPI_Comm*>(comm_ptr), &p);
  std::vector<int64_t> cuts(p + 1);
  for (int c = 0; c <= p; ++c) cuts[c] = n * c / p;
  ring(data, cuts, wire, comm_ptr, 1, true, true);
}

void MpiCommunicator::ring(float* data, const std::vector<int64_t>& cuts, Precision wire,
                           void* comm_ptr, int own_shift, bool reduce, bool gather) {
  MPI_Comm comm = *static_cast<MPI_Comm*>(comm_ptr);
  int r, p;
  MPI_Comm_rank(comm, &r);
  MPI_Comm_size(comm, &p);
  if (p == 1 || cuts.back() == 0) return;
  const int right = (r + 1) % p, left = (r - 1 + p) % p;
  {  // the watchdog names the host of the rank this ring receives from
    MPI_Group g, world;
    MPI_Comm_group(comm, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int w = -1;
    MPI_Group_translate_ranks(g, 1, &left, world, &w);
    MPI_Group_free(&g);
    MPI_Group_free(&world);
    waiting_on_ = w;
  }
  struct Done {  // the ring's wait ends with it (hierarchical goes on within the host)
    std::atomic<int>& w;
    ~Done() { w = -1; }
  } done{waiting_on_};
  auto chunk_begin = [&](int c) { return cuts[c]; };
  auto chunk_len = [&](int c) { return cuts[c + 1] - cuts[c]; };
  // The chunk this rank holds reduced after the first phase (and sends first in the second).
  const int own = (r + own_shift) % p;
  auto at = [&](int c) { return ((c % p) + p) % p; };
  const bool compress = wire != Precision::FP32;
  impl_->recv.resize(2 * kRingSegment);  // two segments in flight
  if (compress) {
    impl_->wire_send.resize(2 * kRingSegment);
    impl_->wire_recv.resize(2 * kRingSegment);
  }
  auto encode = [&](const float* src, uint16_t* dst, int64_t k) {
    if (wire == Precision::FP16)
      convert_f32_to_f16(src, dst, k);
    else
      convert_f32_to_bf16(src, dst, k);
  };
  auto decode_add = [&](const uint16_t* src, float* dst, int64_t k) {
    if (wire == Precision::FP16)
      accumulate_f16(src, dst, k);
    else
      accumulate_bf16(src, dst, k);
  };
  // Step s of a phase: send chunk `sc` to the right, receive chunk `rc` from the left, in
  // segments; reduce (add) or gather (copy) the received data. Two segments are in flight in
  // each direction (double buffering), so encoding and reducing overlap the transfers. Each
  // direction has its own segment count (that of the chunk it carries): a zero-length side
  // posts nothing.
  auto exchange = [&](int sc, int rc, bool add) {
    const int64_t slen = chunk_len(sc), rlen = chunk_len(rc);
    const int64_t ssegs = (slen + kRingSegment - 1) / kRingSegment;
    const int64_t rsegs = (rlen + kRingSegment - 1) / kRingSegment;
    float* sbase = data + chunk_begin(sc);
    float* rbase = data + chunk_begin(rc);
    auto seg_len = [](int64_t len, int64_t s) {
      return std::min(kRingSegment, len - s * kRingSegment);
    };
    MPI_Request sreq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    MPI_Request rreq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    auto post_recv = [&](int64_t s) {
      const int slot = static_cast<int>(s & 1);
      const int k = static_cast<int>(seg_len(rlen, s));
      if (compress)
        check(MPI_Irecv(impl_->wire_recv.data() + slot * kRingSegment, k, MPI_UINT16_T, left, 7,
                        comm, &rreq[slot]),
              "MPI_Irecv");
      else
        check(MPI_Irecv(add ? impl_->recv.data() + slot * kRingSegment : rbase + s * kRingSegment,
                        k, MPI_FLOAT, left, 7, comm, &rreq[slot]),
              "MPI_Irecv");
    };
    auto post_send = [&](int64_t s) {
      const int slot = static_cast<int>(s & 1);
      const int64_t k = seg_len(slen, s);
      float* sp = sbase + s * kRingSegment;
      if (compress) {
        check(MPI_Wait(&sreq[slot], MPI_STATUS_IGNORE), "MPI_Wait");  // the slot is free again
        uint16_t* w = impl_->wire_send.data() + slot * kRingSegment;
        encode(sp, w, k);
        check(MPI_Isend(w, static_cast<int>(k), MPI_UINT16_T, right, 7, comm, &sreq[slot]),
              "MPI_Isend");
      } else {
        check(MPI_Wait(&sreq[slot], MPI_STATUS_IGNORE), "MPI_Wait");
        check(MPI_Isend(sp, static_cast<int>(k), MPI_FLOAT, right, 7, comm, &sreq[slot]),
              "MPI_Isend");
      }
    };
    for (int64_t s = 0; s < std::min<int64_t>(2, rsegs); ++s) post_recv(s);
    for (int64_t s = 0; s < std::min<int64_t>(2, ssegs); ++s) post_send(s);
    for (int64_t s = 0; s < std::max(ssegs, rsegs); ++s) {
      const int slot = static_cast<int>(s & 1);
      if (s < rsegs) {
        check(MPI_Wait(&rreq[slot], MPI_STATUS_IGNORE), "MPI_Wait");
        const int64_t k = seg_len(rlen, s);
        float* rp = rbase + s * kRingSegment;
        if (compress) {
          const uint16_t* w = impl_->wire_recv.data() + slot * kRingSegment;
          if (add)
            decode_add(w, rp, k);
          else if (wire == Precision::FP16)
            convert_f16_to_f32(w, rp, k);
          else
            convert_bf16_to_f32(w, rp, k);
        } else if (add) {
          const float* q = impl_->recv.data() + slot * kRingSegment;
          for (int64_t i = 0; i < k; ++i) rp[i] += q[i];
        }
        if (s + 2 < rsegs) post_recv(s + 2);
      }
      if (s + 2 < ssegs) post_send(s + 2);
    }
    check(MPI_Waitall(2, sreq, MPI_STATUSES_IGNORE), "MPI_Waitall");
  };
  if (reduce)
    for (int s = 0; s < p - 1; ++s) exchange(at(own - 1 - s), at(own - 2 - s), true);
  // This rank now owns the reduced chunk `own`. With compression every rank must end with the
  // same values: the owner rounds its own chunk to the wire format too (before an allgather of
  // it; a reduce-scatter's owner keeps its fp32 sum, which nobody else holds).
  if (compress && reduce && gather) {
    float* op = data + chunk_begin(own);
    const int64_t k = chunk_len(own);
    for (int64_t o = 0; o < k; o += kRingSegment) {
      const int64_t len = std::min(kRingSegment, k - o);
      encode(op + o, impl_->wire_send.data(), len);
      if (wire == Precision::FP16)
        convert_f16_to_f32(impl_->wire_send.data(), op + o, len);
      else
        convert_bf16_to_f32(impl_->wire_send.data(), op + o, len);
    }
  }
  if (gather)
    for (int s = 0; s < p - 1; ++s) exchange(at(own - s), at(own - 1 - s), false);
}

float* MpiCommunicator::allocate_shared(int64_t n) {
  int64_t range[2] = {-n, n};
  check(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT64_T, MPI_MAX, impl_->node),
        "MPI_Allreduce(allocate_shared)");
  if (-range[0] != range[1])
    fail("allocate_shared: ranks of one node asked for different sizes (", -range[0], " to ",
         range[1], " floats); every rank must allocate the same gradient buffer");
  // The window lives in a shared-memory file (Open MPI: the session directory or /dev/shm). A
  // container's small /dev/shm (Docker's default is 64 MB) would turn the first touch into a
  // SIGBUS: without room for every rank's buffer, keep the gradients in private memory (the
  // shm algorithm then stages them through the window slots). BERTRAIN_SHM_GRADIENTS=0 opts out.
  auto room = [](const char* dir) {
    struct statvfs st {};
    return dir && ::statvfs(dir, &st) == 0 ? static_cast<double>(st.f_bavail) * st.f_frsize : 0.0;
  };
  const double need = 1.1 * local_size_ * (n * 4.0 + 64);
  const char* tmp = std::getenv("TMPDIR");
  int ok = room("/dev/shm") >= need || room(tmp ? tmp : "/tmp") >= need;
  if (const char* e = std::getenv("BERTRAIN_SHM_GRADIENTS"); e && std::string(e) == "0") ok = 0;
  check(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, impl_->node),
        "MPI_Allreduce(allocate_shared)");
  if (!ok) {
    if (rank_ == 0 && !std::getenv("BERTRAIN_SHM_GRADIENTS"))
      std::fprintf(stderr,
                   "bertrain: not enough shared memory for zero-copy gradients (%s for %d ranks "
                   "on a node; /dev/shm and the temp dir are too small): gradients stay in "
                   "private memory and the shm allreduce copies them. Enlarge /dev/shm (e.g. "
                   "docker --shm-size, an emptyDir with medium: Memory) to avoid the copies.\n",
                   human_bytes(need).c_str(), local_size_);
    return nullptr;
  }
  Impl::SharedBuffer b;
  b.n = n;
  float* mine = nullptr;
  // 64 bytes spare per rank: every rank's buffer starts at a 64-byte boundary of its part
  // (segments are page-mapped, so the alignment offset is the same in every process).
  const int64_t bytes = std::max<int64_t>(n, 1) * 4 + 64;
  check(MPI_Win_allocate_shared(bytes, sizeof(float), MPI_INFO_NULL, impl_->node, &mine, &b.win),
        "MPI_Win_allocate_shared (gradient buffer)");
  b.base.resize(local_size_);
  for (int r = 0; r < local_size_; ++r) {
    MPI_Aint sz;
    int disp;
    float* raw = nullptr;
    MPI_Win_shared_query(b.win, r, &sz, &disp, &raw);
    b.base[r] = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(raw) + 63) / 64 * 64);
  }
  mine = b.base[local_rank_];
  std::memset(mine, 0, n * sizeof(float));
  impl_->shared.push_back(std::move(b));
  MPI_Barrier(impl_->node);
  return mine;
}

void MpiCommunicator::allreduce_shm(float* data, int64_t n) {
  const int p = local_size_, lr = local_rank_;
  if (p == 1 || n == 0) return;
  auto fence = [&](MPI_Win win) {
    MPI_Win_sync(win);
    check(MPI_Barrier(impl_->node), "MPI_Barrier(node)");
    MPI_Win_sync(win);
  };
  if (const auto* b = impl_->shared_buffer_of(data, n, lr)) {
    // Zero copy: every rank reduces the same range of its shared buffer.
    std::vector<float*>& ptrs = impl_->peer_ptrs;  // kept: no allocation per bucket
    ptrs.resize(p);
    for (int q = 0; q < p; ++q) ptrs[q] = b->base[q] + (data - b->base[lr]);
    fence(b->win);  // every rank's range is written
    reduce_share_into_all(ptrs, n, lr);
    fence(b->win);  // every share is summed into every copy
    return;
  }
  // Staged through the window slots, a slot-sized chunk at a time. Peers touch this rank's slot
  // only between the two fences, so the copy out and the next copy in need no third barrier.
  for (int64_t off = 0; off < n; off += kShmSlotFloats) {
    const int64_t k = std::min(kShmSlotFloats, n - off);
    std::memcpy(impl_->slots[lr], data + off, k * sizeof(float));
    fence(impl_->win);
    reduce_share_into_all(impl_->slots, k, lr);
    fence(impl_->win);
    std::memcpy(data + off, impl_->slots[lr], k * sizeof(float));
  }
}

void MpiCommunicator::allreduce_hierarchical(float* data, int64_t n) {
  allreduce_shm(data, n);
  if (impl_->leaders != MPI_COMM_NULL) allreduce_ring(data, n, wire_, &impl_->leaders);
  if (const auto* b = impl_->shared_buffer_of(data, n, local_rank_)) {
    // The node's other ranks copy the result straight from the leader's buffer.
    MPI_Win_sync(b->win);
    check(MPI_Barrier(impl_->node), "MPI_Barrier(node)");
    MPI_Win_sync(b->win);
    if (local_rank_ != 0)
      std::memcpy(data, b->base[0] + (data - b->base[local_rank_]), n * sizeof(float));
    check(MPI_Barrier(impl_->node), "MPI_Barrier(node)");
    return;
  }
  for (int64_t off = 0; off < n; off += int64_t{1} << 30) {
    const int c = static_cast<int>(std::min<int64_t>(n - off, int64_t{1} << 30));
    check(MPI_Bcast(data + off, c, MPI_FLOAT, 0, impl_->node), "MPI_Bcast");
  }
}

void MpiCommunicator::allreduce_sum(float* data, int64_t n) {
  enter("allreduce");
  switch (algo_) {
    case Algorithm::Mpi:
      allreduce_mpi(data, n);
      break;
    case Algorithm::Ring: {
      MPI_Comm w = MPI_COMM_WORLD;
      allreduce_ring(data, n, wire_, &w);
      break;
    }
    case Algorithm::Shm:
      if (local_size_ == size_)
        allreduce_shm(data, n);
      else
        allreduce_hierarchical(data, n);
      break;
    case Algorithm::Hierarchical:
      allreduce_hierarchical(data, n);
      break;
  }
  leave();
}

namespace {
// [begin, end) of rank r's part, and the parts as MPI's int counts and displacements.
std::pair<int64_t, int64_t> part_of(std::span<const int64_t> counts, int r) {
  int64_t b = 0;
  for (int q = 0; q < r; ++q) b += counts[q];
  return {b, b + counts[r]};
}
// The parts as chunk boundaries: cuts[r] .. cuts[r + 1] is rank r's.
std::vector<int64_t> cuts_of(std::span<const int64_t> counts) {
  std::vector<int64_t> cuts(counts.size() + 1, 0);
  for (size_t r = 0; r < counts.size(); ++r) cuts[r + 1] = cuts[r] + counts[r];
  return cuts;
}
// MPI_Allgatherv in place over MPI_COMM_WORLD, rank r's part counts[r] elements of `type`.
void allgatherv_in_place(void* data, std::span<const int64_t> counts, MPI_Datatype type) {
  std::vector<int> rc(counts.begin(), counts.end()), displ(counts.size() + 1, 0);
  for (size_t r = 0; r < counts.size(); ++r) displ[r + 1] = displ[r] + rc[r];
  check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, rc.data(), displ.data(), type,
                       MPI_COMM_WORLD),
        "MPI_Allgatherv");
}

void check_parts(std::span<const int64_t> counts, int64_t n, int size, const char* what) {
  int64_t sum = 0;
  for (int64_t c : counts) sum += c;
  if (static_cast<int>(counts.size()) != size || sum != n)
    fail(what, ": the parts (", counts.size(), " of them, ", sum,
         " floats) must be one per rank and cover the buffer (", n, " floats)");
  if (n > INT32_MAX) fail(what, ": ", n, " floats exceed MPI's int count; use smaller buckets");
}
}  // namespace

void MpiCommunicator::reduce_scatter_shm(float* data, int64_t n, std::span<const int64_t> counts) {
  const int p = local_size_, lr = local_rank_;
  if (p == 1 || n == 0) return;
  const auto [b, e] = part_of(counts, lr);
  auto fence = [&](MPI_Win win) {
    MPI_Win_sync(win);
    check(MPI_Barrier(impl_->node), "MPI_Barrier(node)");
    MPI_Win_sync(win);
  };
  if (const auto* sb = impl_->shared_buffer_of(data, n, lr)) {
    std::vector<float*>& ptrs = impl_->peer_ptrs;
    ptrs.resize(p);
    for (int q = 0; q < p; ++q) ptrs[q] = sb->base[q] + (data - sb->base[lr]);
    fence(sb->win);  // every rank's range is written
    reduce_share(ptrs, b, e, lr, false);
    fence(sb->win);  // nobody reads a peer's range any more (it may be overwritten next)
    return;
  }
  // Staged through the window slots, a slot-sized chunk at a time: this rank sums the part of
  // the chunk that is its own, into its own slot, and copies it out.
  for (int64_t off = 0; off < n; off += kShmSlotFloats) {
    const int64_t k = std::min(kShmSlotFloats, n - off);
    std::memcpy(impl_->slots[lr], data + off, k * sizeof(float));
    fence(impl_->win);
    const int64_t cb = std::clamp(b - off, int64_t{0}, k), ce = std::clamp(e - off, int64_t{0}, k);
    if (ce > cb) reduce_share(impl_->slots, cb, ce, lr, false);
    fence(impl_->win);
    if (ce > cb) std::memcpy(data + off + cb, impl_->slots[lr] + cb, (ce - cb) * sizeof(float));
  }
}

void MpiCommunicator::reduce_scatter_sum(float* data, int64_t n, std::span<const int64_t> counts) {
  check_parts(counts, n, size_, "reduce-scatter");
  if (size_ == 1) return;
  enter("reduce-scatter");
  switch (algo_) {
    case Algorithm::Mpi: {
      const auto [b, e] = part_of(counts, rank_);
      std::vector<int> rc(counts.begin(), counts.end());
      impl_->part.resize(std::max<int64_t>(1, e - b));
      check(MPI_Reduce_scatter(data, impl_->part.data(), rc.data(), MPI_FLOAT, MPI_SUM,
                               MPI_COMM_WORLD),
            "MPI_Reduce_scatter");
      std::memcpy(data + b, impl_->part.data(), (e - b) * sizeof(float));
      break;
    }
    case Algorithm::Ring: {
      MPI_Comm w = MPI_COMM_WORLD;
      ring(data, cuts_of(counts), wire_, &w, 0, true, false);
      break;
    }
    case Algorithm::Shm:
    case Algorithm::Hierarchical:
      // One node: each rank sums its own part straight from its peers' buffers. Across nodes,
      // the hierarchical allreduce (a superset: the leaders' ring carries every byte).
      if (local_size_ == size_)
        reduce_scatter_shm(data, n, counts);
      else
        allreduce_hierarchical(data, n);
      break;
  }
  leave();
}

void MpiCommunicator::allgather(float* data, int64_t n, std::span<const int64_t> counts) {
  check_parts(counts, n, size_, "allgather");
  if (size_ == 1) return;
  enter("allgather");
  if (algo_ == Algorithm::Ring) {
    // Always fp32: the parts are what every rank must hold bit for bit (the parameters).
    MPI_Comm w = MPI_COMM_WORLD;
    ring(data, cuts_of(counts), Precision::FP32, &w, 0, false, true);
  } else {
    allgatherv_in_place(data, counts, MPI_FLOAT);
  }
  leave();
}

void MpiCommunicator::allgather(uint16_t* data, int64_t n, std::span<const int64_t> counts) {
  check_parts(counts, n, size_, "allgather (16-bit)");
  if (size_ == 1) return;
  enter("allgather(16-bit)");
  allgatherv_in_place(data, counts, MPI_UINT16_T);
  leave();
}

void MpiCommunicator::allreduce_sum(double* data, int64_t n) {
  enter("allreduce(f64)");
  check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD),
        "MPI_Allreduce");
  leave();
}

void MpiCommunicator::broadcast(void* data, int64_t bytes, int root) {
  enter("broadcast");
  char* p = static_cast<char*>(data);
  for (int64_t off = 0; off < bytes; off += int64_t{1} << 30) {
    const int c = static_cast<int>(std::min<int64_t>(bytes - off, int64_t{1} << 30));
    check(MPI_Bcast(p + off, c, MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
  }
  leave();
}

void MpiCommunicator::barrier() {
  enter("barrier");
  check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  leave();
}

}  // namespace bertrain::comm
