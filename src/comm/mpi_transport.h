// The MPI communicator's transport (comm/mpi.h), under its algorithms: MPI started (or joined),
// the world, this node's ranks (MPI_Comm_split_type(SHARED), or BERTRAIN_LOCAL_SIZE=k
// consecutive ranks) and the node leaders as communicators; every rank's host; this node's
// shared memory: one staging slot per local rank and the zero-copy buffers of
// allocate_shared. Private to comm.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace bertrain::comm {

// Fails with MPI's message for rc, naming the call.
void mpi_check(int rc, const char* what);

class MpiTransport {
 public:
  MpiTransport(int* argc, char*** argv);
  ~MpiTransport();
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  MPI_Comm node() const { return node_; }
  int node_index() const { return node_index_; }  // the nodes numbered in their first ranks' order
  MPI_Comm leaders() const { return leaders_; }   // MPI_COMM_NULL on ranks that lead no node

  // The host each rank runs on (its hostname, gathered at start) and a host with its ranks:
  // "h1 (ranks 2-3)". Failure messages name hosts this way.
  const std::string& host_of(int rank) const { return hosts_.at(rank); }
  std::string host_and_ranks(int rank) const;
  int host_count() const;
  // Hosts with their ranks in rank order, the first four: "h0 (ranks 0-1), h1 (ranks 2-3)"
  // (others: every host but this rank's).
  std::string hosts_summary(bool others) const;

  // Each local rank's staging slot of the node's shared window (kShmSlotBytes each).
  const std::vector<float*>& slots() const { return slots_; }
  MPI_Win slot_window() const { return slot_win_; }
  // allocate_shared's buffers: a window with every local rank's part.
  struct SharedBuffer {
    MPI_Win win = MPI_WIN_NULL;
    std::vector<float*> base;  // per local rank
    int64_t n = 0;
  };
  // Collective over the node (Communicator::allocate_shared): n zeroed floats in a window every
  // local rank reads, or null when the node's shared memory has no room for them.
  float* allocate_shared(int64_t n);
  // The shared buffer that holds [data, data + n) of local rank lr, if any.
  const SharedBuffer* shared_buffer_of(const float* data, int64_t n, int lr) const;
  // Every local rank's writes to win are visible to every other (sync, node barrier, sync).
  void node_fence(MPI_Win win) const;

 private:
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, node_index_ = 0;
  bool owns_mpi_ = false;
  MPI_Comm node_ = MPI_COMM_NULL, leaders_ = MPI_COMM_NULL;
  std::vector<std::string> hosts_;  // per world rank
  MPI_Win slot_win_ = MPI_WIN_NULL;
  std::vector<float*> slots_;
  std::vector<SharedBuffer> shared_;
};

}  // namespace bertrain::comm
