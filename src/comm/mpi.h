// Communicator over MPI (Open MPI's mpirun, Slurm's srun, a Kubernetes MPIJob).
//
// allreduce_sum picks an algorithm (--allreduce):
//   mpi          MPI_Allreduce, the baseline.
//   ring         reduce-scatter + allgather between neighbours over point-to-point messages,
//                chunked; optional fp16/bf16 wire compression (accumulation stays fp32, and
//                every rank ends with identical values).
//   shm          within one node, through MPI-3 shared memory: each rank sums its 1/size share
//                straight from every peer's buffer and writes the sum into every peer's buffer
//                (one read and one write of the data per rank, two barriers). Zero-copy when
//                the buffer was allocated by allocate_shared() (the trainer puts its gradients
//                there); other buffers are staged through a window slot.
//   hierarchical shm within each node, ring among the node leaders, shm broadcast in the node.
// Nodes come from MPI_Comm_split_type(SHARED): the launcher's placement of ranks on hosts
// (real hosts, or tests/cluster's network namespaces); BERTRAIN_LOCAL_SIZE=k pretends every k
// consecutive ranks share a node (to exercise hierarchical on one host).
//
// A stall watchdog thread aborts the whole job (MPI_Abort, non-zero exit on every rank) when a
// collective waits longer than the stall timeout, naming the collective and the ranks of this
// node that have not reached it (read from a shared-memory progress table) and, when a ring
// step waits on a rank of another host, that host and its ranks (dead, hung or cut off).
// If the launcher cannot be reached to abort (a host's link is down), the rank exits anyway.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/precision.h"

namespace bertrain::comm {

enum class Algorithm { Mpi, Ring, Shm, Hierarchical };
// Each rank's slot in the node's shared window (staging for buffers outside shared memory):
// memory every MPI rank holds besides its plan (estimate counts it).
inline constexpr int64_t kShmSlotBytes = int64_t{32} << 20;
Algorithm parse_algorithm(const std::string& s);
// --compression: none (Precision::FP32), fp16 or bf16: what gradient sums travel and add in.
Precision parse_wire(const std::string& s);
const char* algorithm_name(Algorithm a);
const char* wire_name(Precision w);

// True when this process was started by an MPI launcher (mpirun, srun with PMI, MPIJob).
bool launched_by_mpi();
// The MPI library's version line (MPI_Get_library_version; callable before MPI_Init).
std::string mpi_library_version();

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(int* argc, char*** argv);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  void allreduce_sum(float* data, int64_t n) override;
  void allreduce_sum(double* data, int64_t n) override;
  void broadcast(void* data, int64_t bytes, int root) override;
  void barrier() override;
  std::string name() const override;
  float* allocate_shared(int64_t n) override;
  // mpi: MPI_Reduce_scatter / MPI_Allgatherv. ring: the allreduce's two phases with the
  // parts as chunks (compression narrows the reduce-scatter; the allgather stays fp32). shm on
  // one node: each rank sums its part from its peers' buffers (zero-copy for shared buffers);
  // across nodes the reduce-scatter is the hierarchical allreduce. Allgather: MPI_Allgatherv.
  // The 16-bit allgather is MPI_Allgatherv on every algorithm.
  void reduce_scatter_sum(float* data, int64_t n, std::span<const int64_t> counts) override;
  void allgather(float* data, int64_t n, std::span<const int64_t> counts) override;
  void allgather(uint16_t* data, int64_t n, std::span<const int64_t> counts) override;

  void set_algorithm(Algorithm a) { algo_ = a; }
  void set_wire(Precision w) { wire_ = w; }
  // Whether the allreduce sends gradients over a wire that --compression narrows: the ring, and
  // the ring between node leaders of shm/hierarchical once ranks span nodes. Within one node
  // shm reads peers' memory directly and nothing is compressed.
  bool wire_in_use() const {
    return algo_ == Algorithm::Ring ||
           ((algo_ == Algorithm::Shm || algo_ == Algorithm::Hierarchical) && local_size_ != size_);
  }
  void set_stall_timeout(double seconds) { stall_timeout_ = seconds; }
  void set_interrupt(const std::atomic<int>* flag, double grace_s) override {
    interrupt_grace_ = grace_s;
    interrupt_ = flag;
  }
  void set_incident_log(const std::string& path) override {
    std::lock_guard<std::mutex> lock(label_mu_);
    incident_log_ = path;
  }
  void set_label(const std::string& label) override {
    std::lock_guard<std::mutex> lock(label_mu_);
    label_ = label;
  }
  Algorithm algorithm() const { return algo_; }
  // The host each rank runs on (its hostname, gathered at start) and a host with its ranks:
  // "h1 (ranks 2-3)". Failure messages name hosts this way.
  const std::string& host_of(int rank) const;
  std::string host_and_ranks(int rank) const;
  int host_count() const;

  // Individual algorithms (tests and benchmarks call them directly).
  void allreduce_mpi(float* data, int64_t n);
  void allreduce_ring(float* data, int64_t n, Precision wire, void* comm);  // comm: MPI_Comm*
  void allreduce_shm(float* data, int64_t n);
  void allreduce_hierarchical(float* data, int64_t n);
  void reduce_scatter_shm(float* data, int64_t n, std::span<const int64_t> counts);

 private:
  // The ring over comm (MPI_Comm*), chunks [cuts[c], cuts[c + 1]): a reduce-scatter leaving
  // chunk (rank + own_shift) % size summed here, then an allgather of the summed chunks.
  void ring(float* data, const std::vector<int64_t>& cuts, Precision wire, void* comm,
            int own_shift, bool reduce, bool gather);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  Algorithm algo_ = Algorithm::Ring;
  Precision wire_ = Precision::FP32;
  double stall_timeout_ = 60.0;
  // Watchdog state.
  void enter(const char* what);
  void leave();
  void watchdog_loop();
  [[noreturn]] void abort_job(int code);
  // Hosts with their ranks in rank order, the first four: "h0 (ranks 0-1), h1 (ranks 2-3)"
  // (others: every host but this rank's).
  std::string hosts_summary(bool others) const;
  std::string waited_for(bool* remote) const;
  // Liveness probe over plain TCP (works when MPI's transport is stuck): see mpi.cpp.
  void open_probe();
  std::vector<int> probe_ranks(double timeout_s) const;
  std::string probe_report(double timeout_s) const;  // remote: the ranks waited for are elsewhere
  std::atomic<double> in_since_{0};
  std::atomic<const char*> in_what_{nullptr};
  std::atomic<int> waiting_on_{-1};  // the world rank a ring step receives from, or -1
  std::atomic<bool> stop_{false};
  std::atomic<const std::atomic<int>*> interrupt_{nullptr};
  std::atomic<double> interrupt_grace_{5.0};
  std::thread watchdog_;
  std::mutex label_mu_;
  std::string label_, incident_log_;     // under label_mu_
  void report(const std::string& line);  // stderr and the incident log
};

}  // namespace bertrain::comm
