// What a rank does when a collective cannot finish, apart from the transport that noticed: the
// stop request it honours (SIGTERM's flag, and how long a collective may still wait once it is
// raised) and where failure messages go (stderr, and an incident log every rank appends to: a
// launcher that is ending the job after losing a host stops forwarding the ranks' output, the
// file keeps it). One per process, as the signal and stderr are: the trainer sets it, the
// transports' watchdogs (MPI's stall watchdog, NCCL's wait loop) read it.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

namespace bertrain::comm {

class Incidents {
 public:
  static Incidents& process();

  // A stop request and its grace: peers that received the same signal finish the step within
  // grace_s; past it (a peer hangs or never got the signal) the job ends at once, the last
  // complete checkpoint standing. Null: no stop request is watched.
  void set_interrupt(const std::atomic<int>* flag, double grace_s);
  // The raised signal (0: none) and the grace.
  int interrupt() const;
  double grace_s() const { return grace_s_.load(); }
  // The incident log ("" : stderr only).
  void set_log(const std::string& path);
  // One line to stderr and, whole (one append, fsynced), to the incident log.
  void report(const std::string& line) const;

 private:
  std::atomic<const std::atomic<int>*> interrupt_{nullptr};
  std::atomic<double> grace_s_{5.0};
  mutable std::mutex mu_;
  std::string log_;  // under mu_
};

}  // namespace bertrain::comm
