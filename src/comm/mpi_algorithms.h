// The MPI communicator's allreduce algorithms (comm/mpi.h), each over the transport
// (mpi_transport.h) and reporting its waits to the watchdog (watchdog.h). Private to comm.
//   RingAllreduce          reduce-scatter + allgather between neighbours over point-to-point
//                          messages, in segments with two in flight; optional fp16/bf16 wire
//                          (accumulation stays fp32; every rank ends with identical values).
//   ShmAllreduce           within one node, through MPI-3 shared memory: each rank sums its
//                          1/size share straight from every peer's buffer and writes the sum
//                          into every peer's buffer; zero-copy for allocate_shared's buffers,
//                          others staged through the window slots.
//   HierarchicalAllreduce  shm within each node, the ring among the node leaders, then the
//                          leader's result to the node.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "core/precision.h"

namespace bertrain::comm {

class MpiTransport;
class StallWatchdog;

// [begin, end) of rank r's part of a buffer cut into consecutive parts of counts[r].
std::pair<int64_t, int64_t> part_of(std::span<const int64_t> counts, int r);

class RingAllreduce {
 public:
  RingAllreduce(const MpiTransport& t, StallWatchdog& w) : t_(t), w_(w) {}
  // Over comm: the sum of [data, data + n) everywhere, in equal chunks.
  void allreduce(float* data, int64_t n, Precision wire, MPI_Comm comm);
  // Over comm, chunks [cuts[c], cuts[c + 1]): a reduce-scatter leaving chunk
  // (rank + own_shift) % size summed here (reduce), then an allgather of the summed chunks
  // (gather); either phase alone is the collective of that name.
  void run(float* data, const std::vector<int64_t>& cuts, Precision wire, MPI_Comm comm,
           int own_shift, bool reduce, bool gather);

 private:
  struct Link {
    MPI_Comm comm;
    int left, right;  // the ranks in comm this rank receives from and sends to
    Precision wire;
  };
  // One step of a phase: sends [send, send + slen) to the right and receives rlen floats from the
  // left into recv, in segments, adding them (the reduce-scatter) or copying (the allgather).
  void exchange(const Link& link, float* send, int64_t slen, float* recv, int64_t rlen, bool add);
  const MpiTransport& t_;
  StallWatchdog& w_;
  std::vector<uint16_t> wire_send_, wire_recv_;
  std::vector<float> recv_;
};

class ShmAllreduce {
 public:
  explicit ShmAllreduce(const MpiTransport& t) : t_(t) {}
  void allreduce(float* data, int64_t n);
  // This local rank's part (counts: one per local rank) summed over the node.
  void reduce_scatter(float* data, int64_t n, std::span<const int64_t> counts);

 private:
  const MpiTransport& t_;
  std::vector<float*> peer_ptrs_;  // one range in every local rank's buffer (kept: no allocation)
};

class HierarchicalAllreduce {
 public:
  HierarchicalAllreduce(const MpiTransport& t, ShmAllreduce& shm, RingAllreduce& ring)
      : t_(t), shm_(shm), ring_(ring) {}
  void allreduce(float* data, int64_t n, Precision wire);

 private:
  const MpiTransport& t_;
  ShmAllreduce& shm_;
  RingAllreduce& ring_;
};

}  // namespace bertrain::comm
