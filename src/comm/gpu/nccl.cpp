#include "comm/nccl.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/gpu_placement.h"
#include "comm/incidents.h"
#include "core/error.h"
#include "core/host.h"
#include "kernels/backend.h"

namespace bertrain::comm {

namespace {

// The GPU backend (kernels/backend.h), whose conversions and scaling run on this communicator's
// stream for the 16-bit wire.
const kernels::Backend& gpu() {
  const kernels::Backend* be = kernels::gpu_backend();
  BT_CHECK(be, "a NCCL communicator without a visible GPU");
  return *be;
}

// The NCCL functions this communicator calls, from libnccl.so.2 loaded at run time.
struct Nccl {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRank) CommInitRank;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;  // null before NCCL 2.14
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclReduce) Reduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
};

const Nccl& nccl() {
  static const Nccl n = [] {
    void* h = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!h) h = ::dlopen("libnccl.so", RTLD_NOW | RTLD_GLOBAL);
    if (!h)
      fail("NCCL is needed for data parallelism across GPUs and cannot be loaded (", ::dlerror(),
           "): install it (the CUDA toolkit's libnccl2 package, or pip's nvidia-nccl-cu*) and put "
           "its directory on LD_LIBRARY_PATH, or run one GPU per job");
    Nccl f{};
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
      if (!fn) fail("libnccl.so.2 has no ", name, ": NCCL 2.12 or newer is needed");
    };
    load(f.GetVersion, "ncclGetVersion");
    load(f.GetUniqueId, "ncclGetUniqueId");
    load(f.CommInitRank, "ncclCommInitRank");
    f.CommInitRankConfig =
        reinterpret_cast<decltype(f.CommInitRankConfig)>(::dlsym(h, "ncclCommInitRankConfig"));
    load(f.CommDestroy, "ncclCommDestroy");
    load(f.CommAbort, "ncclCommAbort");
    load(f.CommGetAsyncError, "ncclCommGetAsyncError");
    load(f.GetErrorString, "ncclGetErrorString");
    load(f.GetLastError, "ncclGetLastError");
    load(f.AllReduce, "ncclAllReduce");
    load(f.Reduce, "ncclReduce");
    load(f.Broadcast, "ncclBroadcast");
    load(f.ReduceScatter, "ncclReduceScatter");
    load(f.AllGather, "ncclAllGather");
    load(f.GroupStart, "ncclGroupStart");
    load(f.GroupEnd, "ncclGroupEnd");
    return f;
  }();
  return n;
}

// NCCL's settings that decide how ranks reach each other (what to look at when they cannot).
constexpr const char* kSettings[] = {"NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",  "NCCL_IB_HCA",
                                     "NCCL_IB_GID_INDEX",  "NCCL_SHM_DISABLE", "NCCL_P2P_DISABLE",
                                     "NCCL_NET",           "NCCL_ALGO",        "NCCL_PROTO"};

std::string settings_line() {
  std::string out;
  for (const char* k : kSettings) {
    const char* v = std::getenv(k);
    out += str(out.empty() ? "" : " ", k, "=", v ? v : "(unset)");
  }
  return out;
}

// What every rank must agree on, one line each: versions and settings.
std::vector<std::string> identity(int nccl_version) {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::vector<std::string> v = {str("NCCL ", nccl_version), str("CUDA runtime ", runtime),
                                str("CUDA driver ", driver)};
  for (const char* k : kSettings) {
    const char* x = std::getenv(k);
    v.push_back(str(k, "=", x ? x : "(unset)"));
  }
  return v;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& bootstrap, double stall_timeout_s, Precision wire)
      : wire_(wire),
        boot_(bootstrap),
        rank_(bootstrap.rank()),
        size_(bootstrap.size()),
        device_(rank_gpu(bootstrap)),
        host_(host_name()),
        stall_s_(stall_timeout_s) {
    const Nccl& n = nccl();
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    n.GetVersion(&version_);
    check_ranks_agree();
    check_one_rank_per_gpu();
    ncclUniqueId id{};
    if (rank_ == 0) check(n.GetUniqueId(&id), "ncclGetUniqueId");
    boot_.broadcast(&id, sizeof id, 0);
    init(id);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaEventCreateWithFlags(&queued_, cudaEventDisableTiming), "cudaEventCreate");
    for (cudaEvent_t& e : points_)
      check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  }

  ~NcclCommunicator() override {
    if (comm_) nccl().CommDestroy(comm_);
    if (staging_) cudaFree(staging_);
    if (pinned_) cudaFreeHost(pinned_);
    if (wire_buffer_) cudaFree(wire_buffer_);
    if (queued_) cudaEventDestroy(queued_);
    for (cudaEvent_t e : points_)
      if (e) cudaEventDestroy(e);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return boot_.local_rank(); }
  int local_size() const override { return boot_.local_size(); }
  int node() const override { return boot_.node(); }
  bool device_memory() const override { return true; }
  std::string name() const override {
    return str(
        "NCCL ", version_, ", ", size_, " ranks (GPU ", device_, " on ", host_, " here",
        wire_ == Precision::FP32 ? "" : str("; gradients in ", wire_name(wire_), " on the wire"),
        ")");
  }
  void set_label(const std::string& label) override {
    std::lock_guard<std::mutex> lock(mu_);
    label_ = label;
  }

  void allreduce_sum(float* data, int64_t n) override {
    if (wire_ == Precision::FP32 || !on_device(data)) return allreduce(data, n, ncclFloat32, 4);
    // 16 bits on the wire: rounded on this stream after the queued work, summed, widened back.
    select_device();
    after_queued_work();
    uint16_t* w = wire_buffer(static_cast<size_t>(n));
    const bool bf16 = wire_ == Precision::BF16;
    gpu().round_to_16(bf16 ? Precision::BF16 : Precision::FP16, w, data, n, stream_);
    enqueued(nccl().AllReduce(w, w, static_cast<size_t>(n), bf16 ? ncclBfloat16 : ncclFloat16,
                              ncclSum, comm_, stream_),
             "allreduce", n * 2);
    gpu().widen_from_16(bf16 ? Precision::BF16 : Precision::FP16, data, w, n, stream_);
    wait("allreduce", n * 2);
  }
  void allreduce_sum(double* data, int64_t n) override { allreduce(data, n, ncclFloat64, 8); }

  void broadcast(void* data, int64_t bytes, int root) override {
    run("broadcast", data, bytes, [&](void* d) {
      return nccl().Broadcast(d, d, static_cast<size_t>(bytes), ncclUint8, root, comm_, stream_);
    });
  }

  void barrier() override { boot_.barrier(); }
  // (host memory: over the MPI communicator that bootstrapped this one)
  void pass(void* data, int64_t bytes, int from, int to) override {
    boot_.pass(data, bytes, from, to);
  }

  void reduce_scatter_sum(float* data, int64_t n, std::span<const int64_t> counts) override {
    const bool even = equal_parts(n, counts);
    run("reduce-scatter", data, n * 4, [&](void* d) {
      float* f = static_cast<float*>(d);
      if (even)  // in place: this rank's part of the buffer receives its sum
        return nccl().ReduceScatter(f, f + rank_ * counts[0], static_cast<size_t>(counts[0]),
                                    ncclFloat32, ncclSum, comm_, stream_);
      return grouped(
          [&](int r, int64_t at, int64_t count) {
            return nccl().Reduce(f + at, f + at, static_cast<size_t>(count), ncclFloat32, ncclSum,
                                 r, comm_, stream_);
          },
          counts);
    });
  }

  void allgather(float* data, int64_t n, std::span<const int64_t> counts) override {
    gather(data, n, counts, ncclFloat32, 4);
  }
  void allgather(uint16_t* data, int64_t n, std::span<const int64_t> counts) override {
    gather(data, n, counts, ncclFloat16, 2);  // (bits moved, never added)
  }

  // A ready point: an event recorded on the kernels' stream (Backend::queue), from a ring of
  // kPoints. One recorded again before its wait was issued (more than
  // kPoints points ahead) is a later point of the same stream: the wait is longer, never short.
  int64_t ready_point() override {
    select_device();
    const int64_t k = next_point_.fetch_add(1);
    check_cuda(cudaEventRecord(points_[k % kPoints], kernels_queue()), "cudaEventRecord");
    return k;
  }
  void ready_after(int64_t point) override { ready_ = point; }
  void wait_point(int64_t point) override {
    if (point < 0) return;
    select_device();
    const cudaError_t e = cudaEventSynchronize(points_[point % kPoints]);
    if (e == cudaSuccess) return;
    cudaGetLastError();
    die(str("the computation before a gradient bucket failed on the GPU: ", cudaGetErrorString(e)),
        0);
  }

  void scale(float* data, int64_t n, float s) override {
    select_device();
    after_queued_work();
    gpu().scale_on(data, n, s, stream_);
    wait("scale", 0);
  }

 private:
  template <class Enqueue>
  void run(const char* what, void* data, int64_t bytes, Enqueue enqueue) {
    select_device();
    // Host memory (a step's statistics and flags) crosses through the staging buffer, by way of
    // page-locked memory: a copy into pageable memory would block the host until the stream ran
    // the collective, so a collective that never completes would hang it there, out of the
    // watchdog's reach (wait).
    const bool host = !on_device(data);
    void* d = data;
    if (host) {
      d = staging(static_cast<size_t>(bytes));
      std::memcpy(pinned(static_cast<size_t>(bytes)), data, static_cast<size_t>(bytes));
      check_cuda(
          cudaMemcpyAsync(d, pinned_, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync");
    } else {
      after_queued_work();
    }
    enqueued(enqueue(d), what, bytes);
    if (host)
      check_cuda(
          cudaMemcpyAsync(pinned_, d, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync");
    wait(what, bytes);
    if (host) std::memcpy(data, pinned_, static_cast<size_t>(bytes));
  }

  void allreduce(void* data, int64_t n, ncclDataType_t type, int64_t el) {
    run("allreduce", data, n * el, [&](void* d) {
      return nccl().AllReduce(d, d, static_cast<size_t>(n), type, ncclSum, comm_, stream_);
    });
  }

  void gather(void* data, int64_t n, std::span<const int64_t> counts, ncclDataType_t type,
              int64_t el) {
    const bool even = equal_parts(n, counts);
    run("allgather", data, n * el, [&](void* d) {
      char* c = static_cast<char*>(d);
      if (even)  // in place: this rank's part is already where every rank's part goes
        return nccl().AllGather(c + rank_ * counts[0] * el, c, static_cast<size_t>(counts[0]), type,
                                comm_, stream_);
      return grouped(
          [&](int r, int64_t at, int64_t count) {
            return nccl().Broadcast(c + at * el, c + at * el, static_cast<size_t>(count), type, r,
                                    comm_, stream_);
          },
          counts);
    });
  }

  bool equal_parts(int64_t n, std::span<const int64_t> counts) const {
    BT_CHECK(static_cast<int>(counts.size()) == size_, "one part per rank: ", counts.size(),
             " parts for ", size_, " ranks");
    int64_t sum = 0;
    bool even = true;
    for (int64_t c : counts) {
      sum += c;
      even &= c == counts[0];
    }
    BT_CHECK(sum == n, "the parts cover ", sum, " of ", n, " values");
    return even;
  }

  // One operation per rank's part, as one NCCL group (parts of unequal size).
  template <class Op>
  ncclResult_t grouped(Op op, std::span<const int64_t> counts) {
    ncclResult_t r = nccl().GroupStart();
    int64_t at = 0;
    for (int k = 0; k < size_ && r == ncclSuccess; ++k) {
      if (counts[k] > 0) r = op(k, at, counts[k]);
      at += counts[k];
    }
    const ncclResult_t e = nccl().GroupEnd();
    return r != ncclSuccess ? r : e;
  }

  void select_device() { check_cuda(cudaSetDevice(device_), "cudaSetDevice"); }
  // The kernels' stream on this communicator's GPU (select_device first).
  static cudaStream_t kernels_queue() { return static_cast<cudaStream_t>(gpu().queue()); }

  // The collective's stream waits for what the kernels' stream has queued (the gradients it reads
  // were written there), or, after ready_after(point), for that point only.
  void after_queued_work() {
    if (ready_ >= 0) {
      check_cuda(cudaStreamWaitEvent(stream_, points_[ready_ % kPoints], 0), "cudaStreamWaitEvent");
      return;
    }
    check_cuda(cudaEventRecord(queued_, kernels_queue()), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_, queued_, 0), "cudaStreamWaitEvent");
  }

  static bool on_device(const void* p) {
    cudaPointerAttributes a{};
    const bool device =
        cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeDevice;
    cudaGetLastError();
    return device;
  }

  uint16_t* wire_buffer(size_t n) {
    if (n > wire_elems_) {
      if (wire_buffer_) cudaFree(wire_buffer_);
      wire_buffer_ = nullptr;
      check_cuda(cudaMalloc(&wire_buffer_, n * 2), "cudaMalloc (the 16-bit wire buffer)");
      wire_elems_ = n;
    }
    return static_cast<uint16_t*>(wire_buffer_);
  }

  // Page-locked host memory the host buffers cross through (run), grown when needed (the
  // stream has run every copy from it: each collective is waited for).
  void* pinned(size_t bytes) {
    if (bytes > pinned_bytes_) {
      if (pinned_) cudaFreeHost(pinned_);
      pinned_ = nullptr;
      check_cuda(cudaHostAlloc(&pinned_, bytes, cudaHostAllocDefault),
                 "cudaHostAlloc (the host buffers' staging)");
      pinned_bytes_ = bytes;
    }
    return pinned_;
  }

  void* staging(size_t bytes) {
    if (bytes > staging_bytes_) {
      if (staging_) cudaFree(staging_);
      staging_ = nullptr;
      check_cuda(cudaMalloc(&staging_, bytes), "cudaMalloc (the host buffers' staging)");
      staging_bytes_ = bytes;
    }
    return staging_;
  }

  // Until the stream has run the collective: NCCL's asynchronous errors, the stall timeout and a
  // stop request past its grace end the rank (after aborting the communicator) with the reason.
  void wait(const char* what, int64_t bytes) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    double stopped_at = -1;
    for (int spin = 0;; ++spin) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        cudaGetLastError();
        die(str(what, " failed on the GPU: ", cudaGetErrorString(q)), bytes);
      }
      ncclResult_t async = ncclSuccess;
      nccl().CommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        die(str(what, ": NCCL error ", nccl().GetErrorString(async), " (",
                nccl().GetLastError(comm_), ")"),
            bytes);
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (stall_s_ > 0 && waited > stall_s_)
        die(str(what, " has not completed in ", static_cast<int64_t>(waited), " s (",
                "stall_timeout ", stall_s_,
                " s): a rank died, hangs, runs another step, or "
                "cannot be reached over NCCL's transport"),
            bytes);
      if (const int sig = Incidents::process().interrupt(); sig != 0) {
        if (stopped_at < 0) stopped_at = waited;
        if (waited - stopped_at >= Incidents::process().grace_s())
          die(str("stopped by signal ", sig, " while ", what,
                  " waited for the other ranks: the step cannot finish, so the job ends now; the "
                  "last complete checkpoint stands (continue with resume)"),
              bytes);
      }
      if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  [[noreturn]] void die(const std::string& why, int64_t bytes) {
    std::string label;
    {
      std::lock_guard<std::mutex> lock(mu_);
      label = label_;
    }
    nccl().CommAbort(comm_);  // no rank stays in a collective with this one gone
    comm_ = nullptr;
    const std::string line =
        str("bertrain: rank ", rank_, " on host ", host_, " (GPU ", device_, "): ", why,
            label.empty() ? "" : " of ", label, bytes > 0 ? str(" (", bytes, " bytes)") : "",
            "; NCCL ", version_, ", ", settings_line(),
            "; ending the job (continue from the last checkpoint with resume)");
    Incidents::process().report(line);
    std::_Exit(3);
  }

  // NCCL's initialisation, which waits for every rank: non-blocking where NCCL has it (2.14 on:
  // ncclCommInitRankConfig), polled like a collective, so a rank that died after the id's
  // broadcast, or one NCCL cannot reach, ends this one within the stall timeout with the ranks
  // and settings named instead of a hang (the communicator aborted). Older NCCL blocks.
  void init(const ncclUniqueId& id) {
    const Nccl& n = nccl();
    if (!n.CommInitRankConfig)
      return check(n.CommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = n.CommInitRankConfig(&comm_, size_, id, rank_, &config);
    // (a failed initialisation's communicator aborted: its resources freed, no rank left in it)
    auto abandon = [&] {
      if (comm_) n.CommAbort(comm_);
      comm_ = nullptr;
    };
    if (r != ncclInProgress && r != ncclSuccess) {
      const std::string why = str(n.GetErrorString(r));
      abandon();
      fail("rank ", rank_, " on host ", host_, " (GPU ", device_,
           "): ncclCommInitRankConfig: NCCL error ", why, "; NCCL ", version_, ", ",
           settings_line(), "; NCCL_DEBUG=INFO prints what NCCL tried");
    }
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    for (int spin = 0;; ++spin) {
      ncclResult_t state = ncclInProgress;
      n.CommGetAsyncError(comm_, &state);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        const std::string last = n.GetLastError(comm_);
        const std::string why = str(n.GetErrorString(state), last.empty() ? "" : " (" + last + ")");
        abandon();
        fail("rank ", rank_, " on host ", host_, " (GPU ", device_, "): NCCL's initialisation of ",
             size_, " ranks failed: ", why,
             " (another rank gave up, or NCCL cannot reach it over its transport); NCCL ", version_,
             ", ", settings_line(), "; NCCL_DEBUG=INFO prints what NCCL tried");
      }
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (stall_s_ > 0 && waited > stall_s_) {
        abandon();
        fail("rank ", rank_, " on host ", host_, " (GPU ", device_, "): NCCL's initialisation of ",
             size_, " ranks has not completed in ", static_cast<int64_t>(waited),
             " s (stall_timeout ", stall_s_,
             " s): a rank died before joining, or NCCL cannot reach it over its transport; NCCL ",
             version_, ", ", settings_line(), "; NCCL_DEBUG=INFO prints what NCCL tried");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 1000 ? 10 : 1000));
    }
  }

  // A collective NCCL refused to enqueue ends the rank as a failed one does (die): the
  // communicator aborted, so no peer stays in a collective with this rank gone.
  void enqueued(ncclResult_t r, const char* what, int64_t bytes) {
    if (r == ncclSuccess) return;
    const std::string last = nccl().GetLastError(comm_);
    die(str(what, " could not be enqueued: NCCL error ", nccl().GetErrorString(r),
            last.empty() ? "" : " (" + last + ")"),
        bytes);
  }

  void check(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return;
    fail("rank ", rank_, " on host ", host_, " (GPU ", device_, "): ", what, ": NCCL error ",
         nccl().GetErrorString(r), comm_ ? str(" (", nccl().GetLastError(comm_), ")") : "",
         "; NCCL ", version_, ", ", settings_line(), "; NCCL_DEBUG=INFO prints what NCCL tried");
  }

  void check_cuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    cudaGetLastError();
    fail("rank ", rank_, " on host ", host_, " (GPU ", device_, "): ", what, ": CUDA error ",
         cudaGetErrorString(e));
  }

  // Every rank's host and GPU, each rank's broadcast in turn: two ranks on one GPU is an error
  // naming both and the fix (comm/gpu_placement.h), before NCCL meets them.
  void check_one_rank_per_gpu() {
    char bus[64] = {};
    check_cuda(cudaDeviceGetPCIBusId(bus, sizeof bus, device_), "cudaDeviceGetPCIBusId");
    const std::string mine = str(host_, "\n", bus, "\n", device_, "\n", kernels::gpu_count());
    std::vector<GpuPlacement> all(static_cast<size_t>(size_));
    std::vector<char> buf(512);
    for (int r = 0; r < size_; ++r) {
      std::fill(buf.begin(), buf.end(), '\0');
      if (r == rank_) std::strncpy(buf.data(), mine.c_str(), buf.size() - 1);
      boot_.broadcast(buf.data(), static_cast<int64_t>(buf.size()), r);
      std::istringstream in(buf.data());
      GpuPlacement& p = all[static_cast<size_t>(r)];
      std::getline(in, p.host);
      std::getline(in, p.bus_id);
      in >> p.device >> p.visible;
    }
    const std::string shared = shared_gpu(all);
    if (!shared.empty()) fail("rank ", rank_, ": ", shared);
  }

  // Every rank's versions and settings against rank 0's, which rank 0 broadcasts.
  void check_ranks_agree() {
    const std::vector<std::string> mine = identity(version_);
    std::string joined;
    for (const auto& l : mine) joined += l + "\n";
    std::vector<char> buf(4096, '\0');
    if (rank_ == 0) std::strncpy(buf.data(), joined.c_str(), buf.size() - 1);
    boot_.broadcast(buf.data(), static_cast<int64_t>(buf.size()), 0);
    const std::string zero(buf.data());
    if (rank_ == 0 || zero == joined) return;
    size_t a = 0, b = 0;
    while (true) {
      const size_t ea = zero.find('\n', a), eb = joined.find('\n', b);
      if (ea == std::string::npos || eb == std::string::npos) break;
      const std::string x = zero.substr(a, ea - a), y = joined.substr(b, eb - b);
      if (x != y)
        fail("rank ", rank_, " on host ", host_, " has ", y, ", rank 0 has ", x,
             ": every rank needs the same NCCL, CUDA and NCCL settings (the job's "
             "environment and image)");
      a = ea + 1;
      b = eb + 1;
    }
  }

  const Precision wire_;
  Communicator& boot_;
  const int rank_, size_, device_;
  const std::string host_;
  const double stall_s_;
  int version_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t queued_ = nullptr;
  static constexpr int64_t kPoints = 256;
  cudaEvent_t points_[kPoints] = {};
  std::atomic<int64_t> next_point_{0};
  int64_t ready_ = -1;  // the issuing thread's ready point (ready_after), or -1
  void* staging_ = nullptr;
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  size_t staging_bytes_ = 0;
  void* wire_buffer_ = nullptr;
  size_t wire_elems_ = 0;
  std::mutex mu_;
  std::string label_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap,
                                                     double stall_timeout_s, Precision wire) {
  return std::make_unique<NcclCommunicator>(bootstrap, stall_timeout_s, wire);
}

}  // namespace bertrain::comm
