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
// In Horovod's shape: a thin transport (mpi_transport.h: the communicators, hosts and the node's
// shared memory), each algorithm a class over it (mpi_algorithms.h), and a stall watchdog of its
// own (watchdog.h) that aborts the whole job, naming the collective and whom it waits for, when
// a collective waits longer than the stall timeout. What a stop request or an incident does is
// the process's policy (incidents.h), not the communicator's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/precision.h"

namespace bertrain::comm {

class MpiTransport;
class StallWatchdog;
class RingAllreduce;
class ShmAllreduce;
class HierarchicalAllreduce;

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

  int rank() const override;
  int size() const override;
  int local_rank() const override;
  int local_size() const override;
  int node() const override;
  void allreduce_sum(float* data, int64_t n) override;
  void allreduce_sum(double* data, int64_t n) override;
  void broadcast(void* data, int64_t bytes, int root) override;
  void pass(void* data, int64_t bytes, int from, int to) override;  // MPI_Send / MPI_Recv
  void barrier() override;
  std::string name() const override;
  void set_label(const std::string& label) override;
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
  Algorithm algorithm() const { return algo_; }
  void set_wire(Precision w) { wire_ = w; }
  // Whether the allreduce sends gradients over a wire that --compression narrows: the ring, and
  // the ring between node leaders of shm/hierarchical once ranks span nodes. Within one node
  // shm reads peers' memory directly and nothing is compressed.
  bool wire_in_use() const;
  void set_stall_timeout(double seconds);

 private:
  // The allreduce across nodes: shm within one node, hierarchical across them.
  bool spans_nodes() const;
  // The members in construction order (destroyed in reverse: the watchdog stops before the
  // transport finalizes MPI).
  std::unique_ptr<MpiTransport> t_;
  std::unique_ptr<StallWatchdog> watchdog_;
  std::unique_ptr<RingAllreduce> ring_;
  std::unique_ptr<ShmAllreduce> shm_;
  std::unique_ptr<HierarchicalAllreduce> hierarchical_;
  std::vector<float> part_;  // MPI_Reduce_scatter's result before it moves into place
  Algorithm algo_ = Algorithm::Ring;
  Precision wire_ = Precision::FP32;
};

}  // namespace bertrain::comm
