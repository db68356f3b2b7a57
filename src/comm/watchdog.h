// The MPI communicator's stall watchdog (comm/mpi.h): a thread that aborts the whole job
// (MPI_Abort, non-zero exit on every rank) when a collective waits longer than the stall
// timeout, naming the collective, what it was for (the label) and whom it waits for: the ranks
// of this node that have not reached it (a shared-memory progress table), or, when a ring step
// waits on a rank of another host, that host and its ranks (dead, hung or cut off), with what a
// TCP probe outside MPI found (process gone, host silent, this host's link down). It also ends
// a collective that a stop request (Incidents) leaves waiting past its grace. If the launcher
// cannot be reached to abort (a host's link is down), the rank exits anyway. Private to comm.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <mpi.h>

namespace bertrain::comm {

class MpiTransport;

class StallWatchdog {
 public:
  // Collective over the world (the probe addresses, the node's progress table).
  explicit StallWatchdog(const MpiTransport& t);
  ~StallWatchdog();
  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;

  void set_stall_timeout(double seconds) { stall_timeout_ = seconds; }
  // What the next collectives are for ("gradient bucket 3 (...)").
  void set_label(const std::string& label);

  // A collective begins (`what` a string literal) and ends.
  void enter(const char* what);
  void leave();
  // The collective now waits on this world rank (a ring's left neighbour) until the returned
  // guard ends.
  struct Waiting {
    std::atomic<int>& on;
    ~Waiting() { on = -1; }
  };
  [[nodiscard]] Waiting waiting_on(int world_rank);

 private:
  void loop();
  void on_interrupt(int sig, double since, const char* what, double& signalled_at) const;
  [[noreturn]] void on_stall(double since, const char* what);
  [[noreturn]] void abort_job(int code) const;
  std::string waited_for(bool* remote) const;
  // Liveness probe over plain TCP (works when MPI's transport is stuck).
  void open_probe();
  std::vector<int> probe_ranks(double timeout_s) const;
  std::string probe_report(double timeout_s) const;

  const MpiTransport& t_;
  double stall_timeout_ = 60.0;
  MPI_Win progress_win_ = MPI_WIN_NULL;
  volatile int64_t* progress_ = nullptr;  // per local rank: collectives entered
  // Every rank listens on a TCP port (never read; the watchdog accepts and closes), and knows
  // every rank's IPv4 addresses and port.
  static constexpr int kProbeAddrs = 4;
  struct ProbeAddress {
    uint32_t addr[kProbeAddrs] = {};  // network order; 0 = unused
    uint16_t port = 0;
  };
  int probe_fd_ = -1;
  std::vector<ProbeAddress> probe_;  // per world rank
  std::atomic<double> in_since_{0};
  std::atomic<const char*> in_what_{nullptr};
  std::atomic<int> waiting_on_{-1};  // the world rank a ring step receives from, or -1
  std::atomic<bool> stop_{false};
  std::mutex label_mu_;
  std::string label_;  // under label_mu_
  std::thread thread_;
};

}  // namespace bertrain::comm
