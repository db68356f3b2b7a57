#include "dist/mpi.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace bertrain::dist {

Algorithm parse_algorithm(const std::string& s) {
  if (s == "mpi") return Algorithm::Mpi;
  if (s == "ring") return Algorithm::Ring;
  if (s == "shm") return Algorithm::Shm;
  if (s == "hierarchical") return Algorithm::Hierarchical;
  fail("--allreduce must be mpi, ring, shm or hierarchical, got '", s, "'");
}

Wire parse_wire(const std::string& s) {
  if (s == "none" || s == "fp32") return Wire::F32;
  if (s == "fp16") return Wire::F16;
  if (s == "bf16") return Wire::BF16;
  fail("--compression must be none, fp16 or bf16, got '", s, "'");
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

const char* wire_name(Wire w) {
  return w == Wire::F32 ? "none" : w == Wire::F16 ? "fp16" : "bf16";
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

namespace {

constexpr int64_t kShmSlotFloats = int64_t{8} << 20;  // 32 MiB per rank and pass
constexpr int64_t kRingSegment = int64_t{1} << 20;    // floats per message

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
  bool owns_mpi = false;
};

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
  check(
      MPI_Comm_split(MPI_COMM_WORLD, local_rank_ == 0 ? 0 : MPI_UNDEFINED, rank_, &impl_->leaders),
      "MPI_Comm_split(leaders)");
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
  MPI_Barrier(MPI_COMM_WORLD);
  if (impl_->win != MPI_WIN_NULL) MPI_Win_free(&impl_->win);
  if (impl_->progress_win != MPI_WIN_NULL) MPI_Win_free(&impl_->progress_win);
  if (impl_->leaders != MPI_COMM_NULL) MPI_Comm_free(&impl_->leaders);
  if (impl_->node != MPI_COMM_NULL) MPI_Comm_free(&impl_->node);
  if (impl_->owns_mpi) MPI_Finalize();
}

std::string MpiCommunicator::name() const {
  return str("MPI, ", size_, " ranks (", size_ / std::max(1, local_size_), " node(s) x ",
             local_size_, "), allreduce ", algorithm_name(algo_),
             algo_ == Algorithm::Ring || algo_ == Algorithm::Hierarchical
                 ? str(", wire ", wire_name(wire_))
                 : "");
}

void MpiCommunicator::enter(const char* what) {
  impl_->progress[local_rank_] = impl_->progress[local_rank_] + 1;
  in_what_ = what;
  in_since_ = now_s();
}

void MpiCommunicator::leave() {
  in_since_ = 0;
}

void MpiCommunicator::watchdog_loop() {
  while (!stop_) {
    ::usleep(100 * 1000);
    const double since = in_since_.load();
    if (since == 0 || stall_timeout_ <= 0 || now_s() - since < stall_timeout_) continue;
    const int64_t mine = impl_->progress[local_rank_];
    std::string label;
    {
      std::lock_guard<std::mutex> lock(label_mu_);
      label = label_;
    }
    std::string missing;
    for (int r = 0; r < local_size_; ++r)
      if (impl_->progress[r] < mine)
        missing += str(missing.empty() ? "" : ", ", rank_ - local_rank_ + r);
    std::fprintf(
        stderr,
        "bertrain: rank %d: collective '%s'%s%s (#%lld) has waited %.0f s (--stall-timeout %.0f "
        "s); "
        "ranks on this node that have not joined: %s%s. A rank died, hangs, or runs another step; "
        "aborting the job.\n",
        rank_, in_what_.load() ? in_what_.load() : "?", label.empty() ? "" : " of ", label.c_str(),
        (long long)mine, now_s() - since, stall_timeout_,
        missing.empty() ? "none" : missing.c_str(),
        size_ > local_size_ ? " (ranks on other nodes are not visible from here)" : "");
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::_Exit(3);
  }
}

void MpiCommunicator::allreduce_mpi(float* data, int64_t n) {
  for (int64_t off = 0; off < n; off += int64_t{1} << 30) {
    const int c = static_cast<int>(std::min<int64_t>(n - off, int64_t{1} << 30));
    check(MPI_Allreduce(MPI_IN_PLACE, data + off, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
          "MPI_Allreduce");
  }
}

void MpiCommunicator::allreduce_ring(float* data, int64_t n, Wire wire, void* comm_ptr) {
  MPI_Comm comm = *static_cast<MPI_Comm*>(comm_ptr);
  int r, p;
  MPI_Comm_rank(comm, &r);
  MPI_Comm_size(comm, &p);
  if (p == 1 || n == 0) return;
  const int right = (r + 1) % p, left = (r - 1 + p) % p;
  auto chunk_begin = [&](int c) { return n * c / p; };
  auto chunk_len = [&](int c) { return chunk_begin(c + 1) - chunk_begin(c); };
  const bool compress = wire != Wire::F32;
  impl_->recv.resize(std::min<int64_t>(kRingSegment, n / p + 1));
  if (compress) {
    impl_->wire_send.resize(impl_->recv.size());
    impl_->wire_recv.resize(impl_->recv.size());
  }
  auto encode = [&](const float* src, uint16_t* dst, int64_t k) {
    if (wire == Wire::F16)
      convert_f32_to_f16(src, dst, k);
    else
      convert_f32_to_bf16(src, dst, k);
  };
  auto decode_add = [&](const uint16_t* src, float* dst, int64_t k) {
    if (wire == Wire::F16)
      accumulate_f16(src, dst, k);
    else
      accumulate_bf16(src, dst, k);
  };
  // Step s of a phase: send chunk `sc` to the right, receive chunk `rc` from the left, in
  // segments; reduce (add) or gather (copy) the received data.
  auto exchange = [&](int sc, int rc, bool add) {
    const int64_t slen = chunk_len(sc), rlen = chunk_len(rc);
    const int64_t segs = std::max((slen + kRingSegment - 1) / kRingSegment,
                                  (rlen + kRingSegment - 1) / kRingSegment);
    for (int64_t s = 0; s < segs; ++s) {
      const int64_t so = s * kRingSegment, ro = s * kRingSegment;
      const int64_t sk = std::max<int64_t>(0, std::min(kRingSegment, slen - so));
      const int64_t rk = std::max<int64_t>(0, std::min(kRingSegment, rlen - ro));
      float* sp = data + chunk_begin(sc) + so;
      float* rp = data + chunk_begin(rc) + ro;
      // Each direction has its own segment count (that of the chunk it carries), so a send
      // and a receive are posted independently: a zero-length side posts nothing.
      MPI_Request req[2];
      int nreq = 0;
      if (compress) {
        if (rk > 0)
          check(MPI_Irecv(impl_->wire_recv.data(), static_cast<int>(rk), MPI_UINT16_T, left, 7,
                          comm, &req[nreq++]),
                "MPI_Irecv");
        if (sk > 0) {
          encode(sp, impl_->wire_send.data(), sk);
          check(MPI_Isend(impl_->wire_send.data(), static_cast<int>(sk), MPI_UINT16_T, right, 7,
                          comm, &req[nreq++]),
                "MPI_Isend");
        }
        check(MPI_Waitall(nreq, req, MPI_STATUSES_IGNORE), "MPI_Waitall");
        if (rk == 0) continue;
        if (add) {
          decode_add(impl_->wire_recv.data(), rp, rk);
        } else if (wire == Wire::F16) {
          convert_f16_to_f32(impl_->wire_recv.data(), rp, rk);
        } else {
          convert_bf16_to_f32(impl_->wire_recv.data(), rp, rk);
        }
      } else {
        if (rk > 0)
          check(MPI_Irecv(add ? impl_->recv.data() : rp, static_cast<int>(rk), MPI_FLOAT, left, 7,
                          comm, &req[nreq++]),
                "MPI_Irecv");
        if (sk > 0)
          check(MPI_Isend(sp, static_cast<int>(sk), MPI_FLOAT, right, 7, comm, &req[nreq++]),
                "MPI_Isend");
        check(MPI_Waitall(nreq, req, MPI_STATUSES_IGNORE), "MPI_Waitall");
        if (add)
          for (int64_t i = 0; i < rk; ++i) rp[i] += impl_->recv[i];
      }
    }
  };
  for (int s = 0; s < p - 1; ++s) exchange((r - s + p) % p, (r - s - 1 + p) % p, true);
  // This rank now owns the reduced chunk (r + 1) % p. With compression every rank must end
  // with the same values: the owner rounds its own chunk to the wire format too.
  if (compress) {
    const int own = (r + 1) % p;
    float* op = data + chunk_begin(own);
    const int64_t k = chunk_len(own);
    for (int64_t o = 0; o < k; o += kRingSegment) {
      const int64_t len = std::min(kRingSegment, k - o);
      encode(op + o, impl_->wire_send.data(), len);
      if (wire == Wire::F16)
        convert_f16_to_f32(impl_->wire_send.data(), op + o, len);
      else
        convert_bf16_to_f32(impl_->wire_send.data(), op + o, len);
    }
  }
  for (int s = 0; s < p - 1; ++s) exchange((r + 1 - s + p) % p, (r - s + p) % p, false);
}

void MpiCommunicator::allreduce_shm(float* data, int64_t n) {
  const int p = local_size_, lr = local_rank_;
  if (p == 1) return;
  for (int64_t off = 0; off < n; off += kShmSlotFloats) {
    const int64_t k = std::min(kShmSlotFloats, n - off);
    std::memcpy(impl_->slots[lr], data + off, k * sizeof(float));
    MPI_Win_sync(impl_->win);
    MPI_Barrier(impl_->node);
    MPI_Win_sync(impl_->win);
    // Reduce my share [b, e) across all slots into my slot.
    const int64_t b = k * lr / p, e = k * (lr + 1) / p;
    float* mine = impl_->slots[lr];
#pragma omp parallel for schedule(static)
    for (int64_t i = b; i < e; ++i) {
      float s = 0.0f;
      for (int q = 0; q < p; ++q) s += impl_->slots[q][i];  // same order on every rank
      mine[i] = s;
    }
    MPI_Win_sync(impl_->win);
    MPI_Barrier(impl_->node);
    MPI_Win_sync(impl_->win);
    for (int q = 0; q < p; ++q) {
      const int64_t qb = k * q / p, qe = k * (q + 1) / p;
      std::memcpy(data + off + qb, impl_->slots[q] + qb, (qe - qb) * sizeof(float));
    }
    MPI_Barrier(impl_->node);  // the slots may be overwritten only after everyone has copied
  }
}

void MpiCommunicator::allreduce_hierarchical(float* data, int64_t n) {
  allreduce_shm(data, n);
  if (impl_->leaders != MPI_COMM_NULL) allreduce_ring(data, n, wire_, &impl_->leaders);
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

}  // namespace bertrain::dist
