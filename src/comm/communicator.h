// Communicator: what data parallelism needs from the transport (rank, size, allreduce,
// broadcast, barrier). SingleProcess is the identity; the MPI implementation (mpi.cpp) runs
// under mpirun/srun/MPIJob. Collectives operate in place on fp32/fp64 buffers.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace bertrain::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int local_rank() const { return rank(); }
  virtual int local_size() const { return size(); }
  // This rank's node (the ranks local_rank counts), 0 .. nodes - 1 in the order of the nodes'
  // first ranks.
  virtual int node() const { return 0; }
  // Sum over ranks, in place.
  virtual void allreduce_sum(float* data, int64_t n) = 0;
  virtual void allreduce_sum(double* data, int64_t n) = 0;
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  // `bytes` of rank `from`'s buffer into rank `to`'s, host memory. Every rank calls it, like a
  // collective; the other ranks' `data` is not touched (may be null). The default broadcasts
  // from `from` (the others into scratch); MPI sends point to point.
  virtual void pass(void* data, int64_t bytes, int from, int to) {
    if (from == to) return;
    std::vector<char> scratch;
    if (rank() != from && rank() != to) {
      scratch.resize(static_cast<size_t>(bytes));
      data = scratch.data();
    }
    broadcast(data, bytes, from);
  }
  virtual void barrier() = 0;
  virtual std::string name() const = 0;
  // What the next collectives are for ("gradient bucket 3 (...)"): the stall watchdog names it.
  // (What a stop request or a failed collective does is the process's policy: incidents.h.)
  virtual void set_label(const std::string&) {}
  // Collective: n floats of zeroed memory that the communicator can reduce without copying
  // (an MPI-3 shared-memory window for the shm algorithm), owned by the communicator and valid
  // until it is destroyed; nullptr when the transport has no such memory (or not enough of it:
  // callers keep private memory then). allreduce_sum on any
  // sub-range of it (the same range on every rank) takes the zero-copy path.
  virtual float* allocate_shared(int64_t n) { return nullptr; }
  // ZeRO's halves of the allreduce (the sharded optimizer, train::Step), in place over
  // [data, data + n), cut into consecutive parts of counts[r] floats for rank r (they sum to n;
  // a part may be empty). reduce_scatter_sum leaves in this rank's part the sum over ranks and
  // the rest of the buffer undefined; allgather copies every rank's part into every rank's
  // buffer. These defaults are right on any transport but move an allreduce's bytes each; the
  // MPI communicator implements them per algorithm.
  virtual void reduce_scatter_sum(float* data, int64_t n, std::span<const int64_t> counts) {
    allreduce_sum(data, n);
  }
  virtual void allgather(float* data, int64_t n, std::span<const int64_t> counts) {
    int64_t begin = 0;
    for (int r = 0; r < rank(); ++r) begin += counts[r];
    const int64_t end = begin + counts[rank()];
    std::fill(data, data + begin, 0.0f);  // x + 0 + ... + 0 == x: the owner's bits arrive
    std::fill(data + end, data + n, 0.0f);
    allreduce_sum(data, n);
  }
  // The allgather of 16-bit data (a sharded master's bf16 weights), counts in elements. The
  // default broadcasts each part from its owner.
  virtual void allgather(uint16_t* data, int64_t n, std::span<const int64_t> counts) {
    int64_t begin = 0;
    for (int r = 0; r < size(); ++r) {
      broadcast(data + begin, counts[r] * static_cast<int64_t>(sizeof(uint16_t)), r);
      begin += counts[r];
    }
  }
  // A device communicator's collectives wait for the device work the issuing thread queued
  // before them (comm/nccl.h: the gradients they read are written there). When the data is
  // complete earlier than that, on another thread, that thread takes a ready point there (a
  // GPU's: an event on its compute stream) and the issuing thread's ready_after(point) makes its
  // next operations wait for that point instead, until ready_after(-1). The Reducer does so per
  // bucket: backward is queued far ahead of the GPU, and a bucket issued on the communication
  // thread would otherwise wait for every layer queued by then, not for its own. Host
  // communicators: their data is complete when a collective is called (-1, nothing to wait for).
  virtual int64_t ready_point() { return -1; }
  virtual void ready_after(int64_t point) { (void)point; }
  // Returns once the device has reached the point (a GPU's: its event completed). The Reducer
  // times a bucket's communication from there: on a GPU the wait before it is backward's
  // compute, which neither its busy time nor its timeline span may count.
  virtual void wait_point(int64_t point) { (void)point; }
  // Whether the collectives take device memory (a GPU's: NCCL, comm/nccl.h) instead of the
  // host's. A model on a backend with memory of its own trains across ranks only through such a
  // communicator; the scalars of a step (statistics, flags, norms) stay host memory either way.
  virtual bool device_memory() const { return false; }
  // data *= s over n values where the collectives read them (the predivide factor before a sum):
  // on the host by the calling thread here, on the device for a device communicator.
  virtual void scale(float* data, int64_t n, float s);
  // Logical AND of a flag over ranks (e.g. "all gradients finite").
  bool all(bool flag) {
    double v = flag ? 0.0 : 1.0;
    allreduce_sum(&v, 1);
    return v == 0.0;
  }
};

class SingleProcess : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void allreduce_sum(float*, int64_t) override {}
  void allreduce_sum(double*, int64_t) override {}
  void reduce_scatter_sum(float*, int64_t, std::span<const int64_t>) override {}
  void allgather(float*, int64_t, std::span<const int64_t>) override {}
  void allgather(uint16_t*, int64_t, std::span<const int64_t>) override {}
  void broadcast(void*, int64_t, int) override {}
  void barrier() override {}
  std::string name() const override { return "single process"; }
};

}  // namespace bertrain::comm
