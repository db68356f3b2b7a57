// The emulated device's NCCL (cuda_emu/README.md), built as libnccl.so.2: a communicator's ranks
// are threads of this process, each with its emulated GPU; a collective is queued on the CUDA
// stream and run by that device's executor, which waits there until every rank's device has
// reached the same collective (as a NCCL kernel spins until its peers arrive), checks that they
// agree (kind, count, type, root), and computes this rank's result from every rank's input in
// rank order (16-bit sums rounded after each addition, as a ring's steps round). An abort
// releases every waiting rank with an error. Groups run their operations in issue order, which
// every rank shares.
#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_fp16.h"
#include "nccl.h"
#include "runtime.h"

namespace cuda_emu {
namespace {

enum class Kind { AllReduce, Reduce, Broadcast, ReduceScatter, AllGather };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce:
      return "ncclAllReduce";
    case Kind::Reduce:
      return "ncclReduce";
    case Kind::Broadcast:
      return "ncclBroadcast";
    case Kind::ReduceScatter:
      return "ncclReduceScatter";
    default:
      return "ncclAllGather";
  }
}

struct Call {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
};

size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 4;
  }
}

// Element i of a buffer as a double, and back (rounded to the type).
double load(const void* p, size_t i, ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return static_cast<const int8_t*>(p)[i];
    case ncclUint8:
      return static_cast<const uint8_t*>(p)[i];
    case ncclInt32:
      return static_cast<const int32_t*>(p)[i];
    case ncclUint32:
      return static_cast<const uint32_t*>(p)[i];
    case ncclInt64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case ncclUint64:
      return static_cast<double>(static_cast<const uint64_t*>(p)[i]);
    case ncclFloat32:
      return static_cast<const float*>(p)[i];
    case ncclFloat64:
      return static_cast<const double*>(p)[i];
    case ncclFloat16: {
      return cuda_emu::half_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    }
    case ncclBfloat16: {
      const uint32_t u = uint32_t{static_cast<const uint16_t*>(p)[i]} << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
  }
  return 0;
}

void store(void* p, size_t i, ncclDataType_t t, double v) {
  switch (t) {
    case ncclInt8:
      static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v);
      break;
    case ncclUint8:
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v);
      break;
    case ncclInt32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      break;
    case ncclUint32:
      static_cast<uint32_t*>(p)[i] = static_cast<uint32_t>(v);
      break;
    case ncclInt64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      break;
    case ncclUint64:
      static_cast<uint64_t*>(p)[i] = static_cast<uint64_t>(v);
      break;
    case ncclFloat32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case ncclFloat64:
      static_cast<double*>(p)[i] = v;
      break;
    case ncclFloat16: {
      const _Float16 h = static_cast<_Float16>(static_cast<float>(v));
      std::memcpy(static_cast<uint16_t*>(p) + i, &h, 2);
      break;
    }
    case ncclBfloat16: {
      const float f = static_cast<float>(v);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (inputs are finite sums)
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(u >> 16);
      break;
    }
  }
}

// a + b in the type's arithmetic: fp32 adds in fp32, 16-bit formats round each sum.
double combine(double a, double b, ncclRedOp_t op, ncclDataType_t t) {
  double r = 0;
  switch (op) {
    case ncclSum:
      r = a + b;
      break;
    case ncclProd:
      r = a * b;
      break;
    case ncclMax:
      r = std::max(a, b);
      break;
    case ncclMin:
      r = std::min(a, b);
      break;
  }
  if (t == ncclFloat32) return static_cast<float>(r);
  if (t == ncclFloat16 || t == ncclBfloat16) {
    uint16_t bits;
    store(&bits, 0, t, r);
    return load(&bits, 0, t);
  }
  return r;
}

// The ranks of one communicator.
struct Clique {
  int size;
  std::mutex mu;
  std::condition_variable cv;
  int joined = 0;
  bool aborted = false;
  std::string abort_reason;
  // The collective meeting: each rank's call, and a generation per phase.
  std::vector<Call> calls;
  int arrived = 0;
  uint64_t generation = 0;
  explicit Clique(int n) : size(n), calls(static_cast<size_t>(n)) {}

  // Until every rank has arrived (mu held by `lock`); an abort ends the wait with a Fault.
  void meet(std::unique_lock<std::mutex>& lock, const char* what) {
    const uint64_t g = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != g || aborted; });
    }
    if (aborted)
      throw Fault(std::string(what) + ": the communicator was aborted (" + abort_reason + ")");
  }
};

std::mutex g_cliques_mu;
std::map<uint64_t, std::shared_ptr<Clique>> g_cliques;

}  // namespace
}  // namespace cuda_emu

struct ncclComm {
  std::shared_ptr<cuda_emu::Clique> clique;
  int rank = 0, device = 0;
  ncclResult_t async = ncclSuccess;
  std::string last_error;
};

namespace cuda_emu {
namespace {

// Destroyed and aborted communicators, kept (work queued on a stream may still name them).
void keep_communicator(ncclComm* c) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<ncclComm>> kept;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& k : kept)
    if (k.get() == c) return;  // (aborted, then destroyed)
  kept.emplace_back(c);
}

// This rank's part of a collective, on its device's executor.
void run(ncclComm* c, const Call& mine) {
  Clique& q = *c->clique;
  std::unique_lock<std::mutex> lock(q.mu);
  q.calls[static_cast<size_t>(c->rank)] = mine;
  q.meet(lock, kind_name(mine.kind));
  const std::vector<Call> all = q.calls;
  lock.unlock();
  for (int r = 0; r < q.size; ++r) {
    const Call& o = all[static_cast<size_t>(r)];
    if (o.kind != mine.kind || o.count != mine.count || o.type != mine.type ||
        o.root != mine.root || o.op != mine.op)
      throw Fault(std::string("rank ") + std::to_string(c->rank) + " runs " + kind_name(mine.kind) +
                  " of " + std::to_string(mine.count) + " while rank " + std::to_string(r) +
                  " runs " + kind_name(o.kind) + " of " + std::to_string(o.count) +
                  ": every rank must issue the same collectives in the "
                  "same order");
  }
  const size_t el = type_bytes(mine.type), n = mine.count;
  std::vector<char> out;
  auto reduce_into = [&](size_t first, size_t count) {
    out.resize(count * el);
    for (size_t i = 0; i < count; ++i) {
      double v = load(all[0].send, first + i, mine.type);
      for (int r = 1; r < q.size; ++r)
        v = combine(v, load(all[static_cast<size_t>(r)].send, first + i, mine.type), mine.op,
                    mine.type);
      store(out.data(), i, mine.type, v);
    }
  };
  const int size = q.size, rank = c->rank;
  switch (mine.kind) {
    case Kind::AllReduce:
      reduce_into(0, n);
      break;
    case Kind::Reduce:
      if (rank == mine.root) reduce_into(0, n);
      break;
    case Kind::ReduceScatter:
      reduce_into(static_cast<size_t>(rank) * n, n);
      break;
    case Kind::Broadcast: {
      const char* src = static_cast<const char*>(all[static_cast<size_t>(mine.root)].send);
      out.assign(src, src + n * el);
      break;
    }
    case Kind::AllGather:
      out.resize(static_cast<size_t>(size) * n * el);
      for (int r = 0; r < size; ++r)
        std::memcpy(out.data() + static_cast<size_t>(r) * n * el, all[static_cast<size_t>(r)].send,
                    n * el);
      break;
  }
  lock.lock();
  q.meet(lock, kind_name(mine.kind));  // every rank has read every input
  lock.unlock();
  if (!out.empty()) std::memcpy(mine.recv, out.data(), out.size());
}

// CUDA_EMU_NCCL_REFUSE=1 (tests): every collective refused, as NCCL refuses one it cannot
// enqueue (ncclSystemError, the reason in ncclGetLastError).
ncclResult_t issue(ncclComm* c, Call call, cudaStream_t stream) {
  if (!c) return ncclInvalidArgument;
  if (c->async != ncclSuccess) return c->async;
  if (const char* refuse = std::getenv("CUDA_EMU_NCCL_REFUSE"); refuse && refuse[0] == '1') {
    c->last_error = "refused (CUDA_EMU_NCCL_REFUSE=1)";
    return ncclSystemError;
  }
  const size_t el = type_bytes(call.type), n = call.count;
  const size_t in = call.kind == Kind::ReduceScatter ? n * static_cast<size_t>(c->clique->size) : n;
  const size_t out = call.kind == Kind::AllGather ? n * static_cast<size_t>(c->clique->size) : n;
  const bool writes = call.kind != Kind::Reduce || c->rank == call.root;
  std::string why = n == 0 ? "" : device_range_problem(call.send, in * el, "its input");
  if (why.empty() && n > 0 && writes) why = device_range_problem(call.recv, out * el, "its output");
  if (!why.empty()) {
    c->last_error = std::string(kind_name(call.kind)) + ": " + why;
    return ncclInvalidArgument;
  }
  const cudaError_t e = enqueue(stream, kind_name(call.kind), [c, call] { run(c, call); });
  if (e != cudaSuccess) {
    c->last_error = cudaGetErrorString(e);
    return ncclUnhandledCudaError;
  }
  return ncclSuccess;
}

}  // namespace
}  // namespace cuda_emu

using cuda_emu::Call;
using cuda_emu::Kind;

extern "C" {

ncclResult_t ncclGetVersion(int* v) {
  *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  std::strcpy(id->internal, "cuda_emu");
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  const uint64_t key = rng();
  std::memcpy(id->internal + 16, &key, sizeof key);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  ncclConfig_t blocking = NCCL_CONFIG_INITIALIZER;
  return ncclCommInitRankConfig(comm, nranks, id, rank, &blocking);
}

// With config->blocking 0: the communicator at once, ncclInProgress until every rank has joined
// (a thread waits for them), or until an abort. CUDA_EMU_NCCL_ABSENT_RANK=r (tests): rank r of
// every clique never joins (a rank that died before its initialisation), so the others never
// become ready.
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  *comm = nullptr;
  if (std::strcmp(id.internal, "cuda_emu") != 0 || nranks < 1 || rank < 0 || rank >= nranks)
    return ncclInvalidArgument;
  uint64_t key;
  std::memcpy(&key, id.internal + 16, sizeof key);
  std::shared_ptr<cuda_emu::Clique> q;
  {
    std::lock_guard<std::mutex> lock(cuda_emu::g_cliques_mu);
    auto& slot = cuda_emu::g_cliques[key];
    if (!slot) slot = std::make_shared<cuda_emu::Clique>(nranks);
    q = slot;
  }
  if (q->size != nranks) return ncclInvalidArgument;
  const char* absent = std::getenv("CUDA_EMU_NCCL_ABSENT_RANK");
  const bool joins = !absent || std::atoi(absent) != rank;
  if (config && config->blocking == 0) {
    auto* c = new ncclComm;
    c->clique = q;
    c->rank = rank;
    c->device = cuda_emu::current_device();
    c->async = ncclInProgress;
    std::lock_guard<std::mutex> lock(q->mu);
    if (joins) {
      ++q->joined;
      q->cv.notify_all();
      std::thread([c, q, nranks] {
        std::unique_lock<std::mutex> held(q->mu);
        q->cv.wait(held, [&] { return q->joined >= nranks || q->aborted; });
        if (!q->aborted) c->async = ncclSuccess;
      }).detach();
    }
    *comm = c;
    return ncclInProgress;
  }
  if (!joins) return ncclSystemError;
  {
    // Every rank joins before any returns, as NCCL's initialisation does.
    std::unique_lock<std::mutex> lock(q->mu);
    ++q->joined;
    q->cv.notify_all();
    q->cv.wait(lock, [&] { return q->joined >= nranks; });
  }
  auto* c = new ncclComm;
  c->clique = q;
  c->rank = rank;
  c->device = cuda_emu::current_device();
  *comm = c;
  return ncclSuccess;
}

// (The communicator's memory is kept, and reachable: work queued on a stream may still name it.)
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  cuda_emu::keep_communicator(comm);
  comm->async = ncclInvalidUsage;
  comm->last_error = "the communicator was destroyed";
  return ncclSuccess;
}

// (The communicator is kept, reachable, as a destroyed one is: its caller drops it.)
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  cuda_emu::keep_communicator(comm);
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  comm->clique->aborted = true;
  comm->clique->abort_reason = "rank " + std::to_string(comm->rank) + " called ncclCommAbort";
  comm->clique->cv.notify_all();
  comm->async = ncclRemoteError;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  if (!comm) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  *error = comm->clique->aborted ? ncclRemoteError : comm->async;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    default:
      return "operation in progress";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  return comm ? comm->last_error.c_str() : "";
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return cuda_emu::issue(comm, Call{Kind::AllReduce, send, recv, count, type, op, 0}, stream);
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return cuda_emu::issue(comm, Call{Kind::Reduce, send, recv, count, type, op, root}, stream);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return cuda_emu::issue(comm, Call{Kind::Broadcast, send, recv, count, type, ncclSum, root},
                         stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return cuda_emu::issue(comm, Call{Kind::ReduceScatter, send, recv, count, type, op, 0}, stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  return cuda_emu::issue(comm, Call{Kind::AllGather, send, recv, count, type, ncclSum, 0}, stream);
}

ncclResult_t ncclGroupStart() {
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  return ncclSuccess;
}

}  // extern "C"
