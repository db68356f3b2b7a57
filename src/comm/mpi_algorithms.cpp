#include "comm/mpi_algorithms.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "comm/mpi.h"
#include "comm/mpi_transport.h"
#include "comm/watchdog.h"
#include "core/dtype.h"

namespace bertrain::comm {

namespace {

constexpr int64_t kShmSlotFloats = kShmSlotBytes / 4;  // per rank and pass
constexpr int64_t kRingSegment = int64_t{1} << 18;     // floats per message (1 MiB: in L2)

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

std::pair<int64_t, int64_t> part_of(std::span<const int64_t> counts, int r) {
  int64_t b = 0;
  for (int q = 0; q < r; ++q) b += counts[q];
  return {b, b + counts[r]};
}

void RingAllreduce::allreduce(float* data, int64_t n, Precision wire, MPI_Comm comm) {
  int p;
  MPI_Comm_size(comm, &p);
  std::vector<int64_t> cuts(p + 1);
  for (int c = 0; c <= p; ++c) cuts[c] = n * c / p;
  run(data, cuts, wire, comm, 1, true, true);
}

namespace {

void encode(Precision wire, const float* src, uint16_t* dst, int64_t k) {
  if (wire == Precision::FP16)
    convert_f32_to_f16(src, dst, k);
  else
    convert_f32_to_bf16(src, dst, k);
}

void decode(Precision wire, const uint16_t* src, float* dst, int64_t k) {
  if (wire == Precision::FP16)
    convert_f16_to_f32(src, dst, k);
  else
    convert_bf16_to_f32(src, dst, k);
}

void decode_add(Precision wire, const uint16_t* src, float* dst, int64_t k) {
  if (wire == Precision::FP16)
    accumulate_f16(src, dst, k);
  else
    accumulate_bf16(src, dst, k);
}

int64_t segment_length(int64_t len, int64_t s) {
  return std::min(kRingSegment, len - s * kRingSegment);
}

}  // namespace

void RingAllreduce::run(float* data, const std::vector<int64_t>& cuts, Precision wire,
                        MPI_Comm comm, int own_shift, bool reduce, bool gather) {
  int r, p;
  MPI_Comm_rank(comm, &r);
  MPI_Comm_size(comm, &p);
  if (p == 1 || cuts.back() == 0) return;
  const Link link{comm, (r - 1 + p) % p, (r + 1) % p, wire};
  int w = -1;  // the watchdog names the host of the rank this ring receives from
  {
    MPI_Group g, world;
    MPI_Comm_group(comm, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_translate_ranks(g, 1, &link.left, world, &w);
    MPI_Group_free(&g);
    MPI_Group_free(&world);
  }
  // The ring's wait ends with it (hierarchical goes on within the host).
  const StallWatchdog::Waiting waiting = w_.waiting_on(w);
  const bool compress = wire != Precision::FP32;
  recv_.resize(2 * kRingSegment);  // two segments in flight
  if (compress) {
    wire_send_.resize(2 * kRingSegment);
    wire_recv_.resize(2 * kRingSegment);
  }
  // The chunk this rank holds reduced after the first phase (and sends first in the second).
  const int own = (r + own_shift) % p;
  auto at = [&](int c) { return ((c % p) + p) % p; };
  // Send chunk sc to the right, receive chunk rc from the left.
  auto step = [&](int sc, int rc, bool add) {
    exchange(link, data + cuts[sc], cuts[sc + 1] - cuts[sc], data + cuts[rc],
             cuts[rc + 1] - cuts[rc], add);
  };
  if (reduce)
    for (int s = 0; s < p - 1; ++s) step(at(own - 1 - s), at(own - 2 - s), true);
  // This rank now owns the reduced chunk `own`. With compression every rank must end with the
  // same values: the owner rounds its own chunk to the wire format too (before an allgather of
  // it; a reduce-scatter's owner keeps its fp32 sum, which nobody else holds).
  if (compress && reduce && gather) {
    float* op = data + cuts[own];
    const int64_t k = cuts[own + 1] - cuts[own];
    for (int64_t o = 0; o < k; o += kRingSegment) {
      const int64_t len = std::min(kRingSegment, k - o);
      encode(wire, op + o, wire_send_.data(), len);
      decode(wire, wire_send_.data(), op + o, len);
    }
  }
  if (gather)
    for (int s = 0; s < p - 1; ++s) step(at(own - s), at(own - 1 - s), false);
}

// Two segments are in flight in each direction (double buffering), so encoding and reducing
// overlap the transfers. Each direction has its own segment count (that of the chunk it
// carries): a zero-length side posts nothing.
void RingAllreduce::exchange(const Link& link, float* send, int64_t slen, float* recv, int64_t rlen,
                             bool add) {
  const bool compress = link.wire != Precision::FP32;
  const int64_t ssegs = (slen + kRingSegment - 1) / kRingSegment;
  const int64_t rsegs = (rlen + kRingSegment - 1) / kRingSegment;
  MPI_Request sreq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Request rreq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  auto post_recv = [&](int64_t s) {
    const int slot = static_cast<int>(s & 1);
    const int k = static_cast<int>(segment_length(rlen, s));
    if (compress)
      mpi_check(MPI_Irecv(wire_recv_.data() + slot * kRingSegment, k, MPI_UINT16_T, link.left, 7,
                          link.comm, &rreq[slot]),
                "MPI_Irecv");
    else
      mpi_check(MPI_Irecv(add ? recv_.data() + slot * kRingSegment : recv + s * kRingSegment, k,
                          MPI_FLOAT, link.left, 7, link.comm, &rreq[slot]),
                "MPI_Irecv");
  };
  auto post_send = [&](int64_t s) {
    const int slot = static_cast<int>(s & 1);
    const int64_t k = segment_length(slen, s);
    float* sp = send + s * kRingSegment;
    mpi_check(MPI_Wait(&sreq[slot], MPI_STATUS_IGNORE), "MPI_Wait");  // the slot is free again
    if (compress) {
      uint16_t* w = wire_send_.data() + slot * kRingSegment;
      encode(link.wire, sp, w, k);
      mpi_check(
          MPI_Isend(w, static_cast<int>(k), MPI_UINT16_T, link.right, 7, link.comm, &sreq[slot]),
          "MPI_Isend");
    } else {
      mpi_check(
          MPI_Isend(sp, static_cast<int>(k), MPI_FLOAT, link.right, 7, link.comm, &sreq[slot]),
          "MPI_Isend");
    }
  };
  for (int64_t s = 0; s < std::min<int64_t>(2, rsegs); ++s) post_recv(s);
  for (int64_t s = 0; s < std::min<int64_t>(2, ssegs); ++s) post_send(s);
  for (int64_t s = 0; s < std::max(ssegs, rsegs); ++s) {
    const int slot = static_cast<int>(s & 1);
    if (s < rsegs) {
      mpi_check(MPI_Wait(&rreq[slot], MPI_STATUS_IGNORE), "MPI_Wait");
      const int64_t k = segment_length(rlen, s);
      float* rp = recv + s * kRingSegment;
      if (compress) {
        const uint16_t* w = wire_recv_.data() + slot * kRingSegment;
        if (add)
          decode_add(link.wire, w, rp, k);
        else
          decode(link.wire, w, rp, k);
      } else if (add) {
        const float* q = recv_.data() + slot * kRingSegment;
        for (int64_t i = 0; i < k; ++i) rp[i] += q[i];
      }
      if (s + 2 < rsegs) post_recv(s + 2);
    }
    if (s + 2 < ssegs) post_send(s + 2);
  }
  mpi_check(MPI_Waitall(2, sreq, MPI_STATUSES_IGNORE), "MPI_Waitall");
}

void ShmAllreduce::allreduce(float* data, int64_t n) {
  const int p = t_.local_size(), lr = t_.local_rank();
  if (p == 1 || n == 0) return;
  auto fence = [&](MPI_Win win) { t_.node_fence(win); };
  if (const auto* b = t_.shared_buffer_of(data, n, lr)) {
    // Zero copy: every rank reduces the same range of its shared buffer.
    std::vector<float*>& ptrs = peer_ptrs_;  // kept: no allocation per bucket
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
    std::memcpy(t_.slots()[lr], data + off, k * sizeof(float));
    fence(t_.slot_window());
    reduce_share_into_all(t_.slots(), k, lr);
    fence(t_.slot_window());
    std::memcpy(data + off, t_.slots()[lr], k * sizeof(float));
  }
}

void ShmAllreduce::reduce_scatter(float* data, int64_t n, std::span<const int64_t> counts) {
  const int p = t_.local_size(), lr = t_.local_rank();
  if (p == 1 || n == 0) return;
  const auto [b, e] = part_of(counts, lr);
  auto fence = [&](MPI_Win win) { t_.node_fence(win); };
  if (const auto* sb = t_.shared_buffer_of(data, n, lr)) {
    std::vector<float*>& ptrs = peer_ptrs_;
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
    std::memcpy(t_.slots()[lr], data + off, k * sizeof(float));
    fence(t_.slot_window());
    const int64_t cb = std::clamp(b - off, int64_t{0}, k), ce = std::clamp(e - off, int64_t{0}, k);
    if (ce > cb) reduce_share(t_.slots(), cb, ce, lr, false);
    fence(t_.slot_window());
    if (ce > cb) std::memcpy(data + off + cb, t_.slots()[lr] + cb, (ce - cb) * sizeof(float));
  }
}

void HierarchicalAllreduce::allreduce(float* data, int64_t n, Precision wire) {
  shm_.allreduce(data, n);
  if (t_.leaders() != MPI_COMM_NULL) ring_.allreduce(data, n, wire, t_.leaders());
  if (const auto* b = t_.shared_buffer_of(data, n, t_.local_rank())) {
    // The node's other ranks copy the result straight from the leader's buffer.
    MPI_Win_sync(b->win);
    mpi_check(MPI_Barrier(t_.node()), "MPI_Barrier(node)");
    MPI_Win_sync(b->win);
    if (t_.local_rank() != 0)
      std::memcpy(data, b->base[0] + (data - b->base[t_.local_rank()]), n * sizeof(float));
    mpi_check(MPI_Barrier(t_.node()), "MPI_Barrier(node)");
    return;
  }
  for (int64_t off = 0; off < n; off += int64_t{1} << 30) {
    const int c = static_cast<int>(std::min<int64_t>(n - off, int64_t{1} << 30));
    mpi_check(MPI_Bcast(data + off, c, MPI_FLOAT, 0, t_.node()), "MPI_Bcast");
  }
}

}  // namespace bertrain::comm
