// The emulated device's runtime (cuda_emu/README.md): devices, memory, streams and events.
// Each device has an executor thread that runs its streams' work: a stream in order, an
// operation only after what it depends on (the events it waits for; the legacy default stream
// after earlier work on the blocking streams, and they after it). Which ready operation runs
// first is the schedule (CUDA_EMU_SCHEDULE):
//   late  (default) an operation runs only when the host waits for it, or for work that depends
//         on it (a synchronize, a query, a blocking copy): the latest a GPU may run it, so a
//         kernel that reads a copy it never waited for reads what was there before;
//   eager an operation runs as soon as it is ready: the earliest, so a copy into a buffer that
//         kernels still read, without a wait for them, overwrites it under them.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime.h"

struct CUevent_st;

namespace cuda_emu {

namespace {

using Clock = std::chrono::steady_clock;

struct Device;
struct Stream;

struct Op {
  uint64_t seq = 0;
  std::vector<std::pair<Stream*, uint64_t>> deps;  // (stream, sequence number) completed first
  std::function<void()> work;                      // empty: a marker (an event record or wait)
  CUevent_st* record = nullptr;                    // the event this marker records
  const char* what = "";
};

// A stream capture in progress (cudaStreamBeginCapture): the work issued to the stream, in order,
// or why the capture was invalidated (guarded by g_capture_mu).
struct Node {
  const char* what = "";
  std::function<void()> work;
};
struct Capture {
  std::vector<Node> nodes;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  std::string invalid;  // why a call invalidated it; "" while valid
};

struct Stream {
  Device* device = nullptr;
  bool legacy = false, blocking = true;
  std::deque<Op> ops;
  bool destroyed = false;
  std::shared_ptr<Capture> capture;  // while capturing (g_capture_mu)
  uint64_t issued = 0, demanded = 0;
  std::atomic<uint64_t> completed{0};
};

}  // namespace
}  // namespace cuda_emu

struct CUstream_st {
  cuda_emu::Stream s;
};

struct CUevent_st {
  cuda_emu::Stream* stream = nullptr;  // the latest record's
  uint64_t seq = 0;
  bool timing = true;
  double ms = 0;                                // when the latest record ran
  std::shared_ptr<cuda_emu::Capture> captured;  // recorded into this capture (g_capture_mu)
};

struct CUgraph_st {
  std::vector<cuda_emu::Node> nodes;
};
struct CUgraphExec_st {
  std::shared_ptr<const std::vector<cuda_emu::Node>> nodes;
};

namespace cuda_emu {

namespace {

bool late_schedule() {
  static const bool late = [] {
    const char* e = std::getenv("CUDA_EMU_SCHEDULE");
    if (!e || !*e || std::strcmp(e, "late") == 0) return true;
    if (std::strcmp(e, "eager") == 0) return false;
    std::fprintf(stderr, "cuda_emu: CUDA_EMU_SCHEDULE=%s: expected late or eager\n", e);
    std::abort();
  }();
  return late;
}

double now_ms() {
  static const Clock::time_point start = Clock::now();
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

struct Device {
  int index = 0;
  size_t total = 0, allocated = 0;
  std::mutex mu;
  std::condition_variable cv;
  CUstream_st legacy;
  std::vector<Stream*> streams;                       // live ones, the legacy stream first
  std::vector<std::unique_ptr<CUstream_st>> retired;  // destroyed ones (see cudaStreamDestroy)
  cudaError_t sticky = cudaSuccess;
  std::string message;
  size_t next = 0;  // round-robin start of the eager schedule

  explicit Device(int i, size_t bytes) : index(i), total(bytes) {
    legacy.s.device = this;
    legacy.s.legacy = true;
    streams.push_back(&legacy.s);
    std::thread([this] { run(); }).detach();
  }

  static bool done(const std::pair<Stream*, uint64_t>& d) {
    return d.first->completed.load() >= d.second;
  }

  // The stream whose first operation runs next, or null (mu held). Late: demands travel from an
  // operation to what it waits for.
  Stream* pick() {
    if (!late_schedule()) {
      for (size_t k = 0; k < streams.size(); ++k) {
        Stream* s = streams[(next + k) % streams.size()];
        if (!s->ops.empty() &&
            std::all_of(s->ops.front().deps.begin(), s->ops.front().deps.end(), done)) {
          next = (next + k + 1) % streams.size();
          return s;
        }
      }
      return nullptr;
    }
    for (bool changed = true; changed;) {
      changed = false;
      for (Stream* s : streams) {
        if (s->ops.empty() || s->demanded < s->ops.front().seq) continue;
        bool ready = true;
        for (const auto& d : s->ops.front().deps)
          if (!done(d)) {
            ready = false;
            if (d.first->demanded < d.second) {
              d.first->demanded = d.second;
              changed = true;
            }
          }
        if (ready) return s;
      }
    }
    return nullptr;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      Stream* s = pick();
      if (!s) {
        cv.wait(lock);
        continue;
      }
      Op op = std::move(s->ops.front());
      s->ops.pop_front();
      const bool failed = sticky != cudaSuccess;
      lock.unlock();
      std::string fault;
      if (op.work && !failed) try {
          op.work();
        } catch (const std::exception& e) {
          fault = e.what();
        }
      const double t = now_ms();
      lock.lock();
      if (!fault.empty() && sticky == cudaSuccess) {
        sticky = cudaErrorLaunchFailure;
        message = fault;
        std::fprintf(stderr, "cuda_emu: device %d: %s: %s\n", index, op.what, fault.c_str());
      }
      if (op.record && op.record->stream == s && op.record->seq == op.seq) op.record->ms = t;
      s->completed.store(op.seq);
      cv.notify_all();
    }
  }

  // Queues an operation (mu held): the legacy stream after the blocking streams' work so far,
  // a blocking stream after the legacy stream's.
  uint64_t push(Stream* s, Op op) {
    for (Stream* t : streams) {
      if (t == s || t->issued == t->completed.load()) continue;
      if ((s->legacy && t->blocking) || (t->legacy && s->blocking))
        op.deps.push_back({t, t->issued});
    }
    op.seq = ++s->issued;
    s->ops.push_back(std::move(op));
    cv.notify_all();
    return s->issued;
  }

  // The sequence number of the stream's latest operation.
  uint64_t tail(Stream* s) {
    std::lock_guard<std::mutex> lock(mu);
    return s->issued;
  }

  // Until the stream has run through `seq`: the device's sticky error, if any.
  cudaError_t wait(Stream* s, uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu);
    if (s->demanded < seq) {
      s->demanded = seq;
      cv.notify_all();
    }
    cv.wait(lock, [&] { return s->completed.load() >= seq; });
    return sticky;
  }

  // A query: done, or one more operation demanded (a host that polls makes the device progress).
  cudaError_t query(Stream* s, uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu);
    if (sticky != cudaSuccess) return sticky;
    const uint64_t c = s->completed.load();
    if (c >= seq) return cudaSuccess;
    s->demanded = std::max(s->demanded, c + 1);
    cv.notify_all();
    return cudaErrorNotReady;
  }

  cudaError_t synchronize() {
    std::vector<std::pair<Stream*, uint64_t>> tails;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (Stream* s : streams) tails.push_back({s, s->issued});
    }
    cudaError_t e = cudaSuccess;
    for (auto [s, seq] : tails) e = wait(s, seq);
    return e;
  }
};

int count_devices() {
  static const int n = [] {
    const char* e = std::getenv("CUDA_EMU_DEVICES");
    return e && *e ? std::max(0, std::atoi(e)) : 2;
  }();
  return n;
}

Device& device(int i) {
  static std::mutex mu;
  static std::vector<Device*> devices;  // never destroyed: their executors run until exit
  std::lock_guard<std::mutex> lock(mu);
  if (devices.empty()) {
    const char* e = std::getenv("CUDA_EMU_MEMORY_GIB");
    const double gib = e && *e ? std::atof(e) : 16.0;
    for (int k = 0; k < count_devices(); ++k)
      devices.push_back(new Device(k, static_cast<size_t>(gib * (1ull << 30))));
  }
  return *devices[static_cast<size_t>(i)];
}

thread_local int t_device = 0;
thread_local cudaError_t t_last = cudaSuccess;
thread_local std::string t_detail;  // what the thread's latest error of t_detail_code was
thread_local cudaError_t t_detail_code = cudaSuccess;

Device& current_dev() {
  return device(t_device);
}

Stream* stream_of(cudaStream_t s) {
  return s ? &s->s : &current_dev().legacy.s;
}

// Memory: every allocation by address, to check copies and library operands and to tell device
// pointers from host ones.
struct Allocation {
  size_t bytes;
  int device;          // -1: page-locked host memory
  bool paged = false;  // made while touch counting was on: page-aligned, whole pages
};
size_t whole_pages(size_t bytes) {
  return (bytes + kTouchPage - 1) / kTouchPage * kTouchPage;
}
std::mutex g_memory_mu;
std::map<uintptr_t, Allocation> g_memory;

const std::pair<const uintptr_t, Allocation>* find(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = g_memory.upper_bound(a);
  if (it == g_memory.begin()) return nullptr;
  --it;
  return a < it->first + std::max<size_t>(it->second.bytes, 1) ? &*it : nullptr;
}

bool is_device(const void* p) {
  std::lock_guard<std::mutex> lock(g_memory_mu);
  const auto* a = find(p);
  return a && a->second.device >= 0;
}

bool is_pinned(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_memory_mu);
  const auto* a = find(p);
  return a && a->second.device < 0 &&
         reinterpret_cast<uintptr_t>(p) + bytes <= a->first + a->second.bytes;
}

cudaError_t no_device() {
  return count_devices() == 0 ? set_error(cudaErrorNoDevice, "CUDA_EMU_DEVICES=0") : cudaSuccess;
}

const char* kind_name(cudaMemcpyKind k) {
  switch (k) {
    case cudaMemcpyHostToDevice:
      return "host to device";
    case cudaMemcpyDeviceToHost:
      return "device to host";
    case cudaMemcpyDeviceToDevice:
      return "device to device";
    default:
      return "host to host";
  }
}

// The copy's operands against its kind: a device side inside one allocation, a host side not in
// device memory.
cudaError_t check_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                       const char* call) {
  if (bytes == 0) return cudaSuccess;
  if (kind == cudaMemcpyDefault)
    kind = is_device(dst) ? (is_device(src) ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                          : (is_device(src) ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  std::string why;
  if (dst_dev) why = device_range_problem(dst, bytes, "its destination");
  if (why.empty() && src_dev) why = device_range_problem(src, bytes, "its source");
  if (why.empty() && !dst_dev && is_device(dst)) why = "its destination is device memory";
  if (why.empty() && !src_dev && is_device(src)) why = "its source is device memory";
  if (why.empty()) return cudaSuccess;
  return set_error(cudaErrorInvalidValue, std::string(call) + " of " + std::to_string(bytes) +
                                              " bytes " + kind_name(kind) + ": " + why);
}

// The streams capturing now, every device's.
std::mutex g_capture_mu;
std::vector<Stream*> g_capturing;

const char* mode_name(cudaStreamCaptureMode m) {
  return m == cudaStreamCaptureModeGlobal        ? "global"
         : m == cudaStreamCaptureModeThreadLocal ? "thread-local"
                                                 : "relaxed";
}

// Invalidates the capture with why (g_capture_mu held); the first reason is kept.
void invalidate(Capture& c, const std::string& why) {
  if (c.invalid.empty()) c.invalid = why;
}

}  // namespace

cudaError_t set_error(cudaError_t e, const std::string& detail) {
  t_last = e;
  t_detail = detail;
  t_detail_code = e;
  return e;
}

int current_device() {
  return t_device;
}

std::vector<std::pair<char*, size_t>> paged_allocations(int device) {
  std::vector<std::pair<char*, size_t>> out;
  std::lock_guard<std::mutex> lock(g_memory_mu);
  for (const auto& [p, a] : g_memory)
    if (a.paged && a.device == device)
      out.push_back({reinterpret_cast<char*>(p), whole_pages(a.bytes)});
  return out;
}

std::string device_range_problem(const void* p, size_t bytes, const char* what) {
  std::lock_guard<std::mutex> lock(g_memory_mu);
  const auto* a = find(p);
  const auto at = reinterpret_cast<uintptr_t>(p);
  if (!a || a->second.device < 0)
    return std::string(what) + " (" + std::to_string(at) + ") is not device memory";
  const size_t offset = at - a->first;
  if (offset + bytes > a->second.bytes)
    return std::string(what) + " runs " + std::to_string(offset + bytes - a->second.bytes) +
           " bytes past its allocation of " + std::to_string(a->second.bytes) +
           " bytes (at offset " + std::to_string(offset) + ", " + std::to_string(bytes) + " bytes)";
  return "";
}

// A call's refusal of a handle cudaStreamDestroy has retired (as a GPU's use of a freed handle is
// an error), or success.
cudaError_t refuse_destroyed(const Stream* st, const char* what) {
  return st->destroyed ? set_error(cudaErrorInvalidResourceHandle,
                                   std::string(what) + " on a destroyed stream")
                       : cudaSuccess;
}

// A call a capture forbids ("potentially unsafe": it allocates, frees or waits for the device):
// refused with cudaErrorStreamCaptureUnsupported, and each capture it breaks invalidated, while
// the calling thread captures (not in relaxed mode) or another thread captures in global mode.
cudaError_t refuse_in_capture(const char* call) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  const std::thread::id self = std::this_thread::get_id();
  std::string which;
  for (Stream* st : g_capturing) {
    Capture& c = *st->capture;
    const bool mine = c.thread == self;
    if (mine ? c.mode == cudaStreamCaptureModeRelaxed : c.mode != cudaStreamCaptureModeGlobal)
      continue;
    invalidate(c, std::string(call) + " while " + (mine ? "this" : "another") +
                      " thread's stream captured (" + mode_name(c.mode) + " mode)");
    which = c.invalid;
  }
  if (which.empty()) return cudaSuccess;
  return set_error(cudaErrorStreamCaptureUnsupported,
                   std::string(call) + " is not allowed while a stream captures: " + which);
}

namespace {
// A capturing stream's refusal of a call that would wait for it (a synchronize or a query of the
// stream, a copy that stages pageable memory), or of work on the legacy stream while a blocking
// stream of its device captures (which would order the two): the capture invalidated.
cudaError_t refuse_capturing(Stream* st, const char* call) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  if (st->capture) {
    invalidate(*st->capture, std::string(call) + " on the capturing stream");
    return set_error(cudaErrorStreamCaptureUnsupported,
                     std::string(call) + " on a capturing stream: " + st->capture->invalid);
  }
  if (!st->legacy) return cudaSuccess;
  for (Stream* c : g_capturing)
    if (c->device == st->device && c->blocking) {
      invalidate(*c->capture,
                 std::string(call) + " on the legacy stream while a blocking stream captured");
      return set_error(cudaErrorStreamCaptureImplicit, c->capture->invalid);
    }
  return cudaSuccess;
}
}  // namespace

cudaError_t enqueue(cudaStream_t s, const char* what, std::function<void()> work) {
  Stream* st = stream_of(s);
  if (cudaError_t e = refuse_destroyed(st, what)) return e;
  {
    // Captured: recorded for the graph's launches, in the order issued.
    std::lock_guard<std::mutex> lock(g_capture_mu);
    if (Capture* c = st->capture.get()) {
      if (!c->invalid.empty())
        return set_error(cudaErrorStreamCaptureInvalidated,
                         std::string(what) + " on an invalidated capture: " + c->invalid);
      c->nodes.push_back({what, std::move(work)});
      return cudaSuccess;
    }
  }
  if (cudaError_t e = refuse_capturing(st, what)) return e;
  Device& d = *st->device;
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.sticky != cudaSuccess) return d.sticky;
  Op op;
  op.work = std::move(work);
  op.what = what;
  d.push(st, std::move(op));
  return cudaSuccess;
}

void launch_kernel(const char* name, dim3 grid, dim3 block, size_t shared, CUstream_st* stream,
                   void* closure, Body body, void (*destroy)(void*)) {
  std::shared_ptr<void> c(closure, destroy);
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  std::string why;
  if (threads == 0 || threads > 1024 || block.z > 64)
    why = "a block of " + std::to_string(block.x) + " x " + std::to_string(block.y) + " x " +
          std::to_string(block.z) + " threads (at most 1024, z at most 64)";
  else if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 ||
           grid.x > 2147483647u)
    why = "a grid of " + std::to_string(grid.x) + " x " + std::to_string(grid.y) + " x " +
          std::to_string(grid.z) + " blocks";
  else if (shared > 0)
    why = std::to_string(shared) +
          " bytes of dynamic shared memory (the emulator has none: cuda_emu/README.md)";
  if (!why.empty()) {
    set_error(cudaErrorInvalidConfiguration, std::string(name) + " launched with " + why);
    return;
  }
  Stream* st = stream_of(stream);
  const int dev = st->device->index;
  const cudaError_t e = enqueue(stream, name, [=] {
    count_touches(dev, name, [&] { run_grid(name, grid, block, c.get(), body); });
  });
  if (e == cudaSuccess)
    count_kernel(name);
  else if (t_last != e)  // the device's sticky error: enqueue left the thread's as it was
    set_error(e, "");
}

namespace {
std::atomic<int64_t> g_kernels{0}, g_library_calls{0}, g_host_waits{0}, g_graph_launches{0};
// CUDA_EMU_TRACE=1: each counted event on stderr as it is issued (cuda_emu/README.md).
const bool g_trace = [] {
  const char* e = std::getenv("CUDA_EMU_TRACE");
  return e && *e && std::string(e) != "0";
}();
}  // namespace

void count_kernel(const char* name) {
  ++g_kernels;
  if (g_trace) std::fprintf(stderr, "cuda_emu: kernel %s\n", name);
}
void count_library_call(const char* name) {
  ++g_library_calls;
  if (g_trace) std::fprintf(stderr, "cuda_emu: library %s\n", name);
}
void count_graph_launch() {
  ++g_graph_launches;
  if (g_trace) std::fprintf(stderr, "cuda_emu: graph launch\n");
}
void count_host_wait(const char* call) {
  ++g_host_waits;
  if (g_trace) std::fprintf(stderr, "cuda_emu: host wait %s\n", call);
}
Counts counts() {
  return {g_kernels.load(), g_library_calls.load(), g_host_waits.load(), g_graph_launches.load()};
}

// The emulated NCCL (libnccl.so.2 beside this library) loaded with the runtime, so that the
// program's dlopen("libnccl.so.2") finds it, whatever its search path would find first (under
// ASan, dlopen searches from the sanitizer's library, and a CUDA machine's NCCL is in the cache).
__attribute__((constructor)) void load_emulated_nccl() {
  Dl_info self{};
  if (!dladdr(reinterpret_cast<void*>(&load_emulated_nccl), &self) || !self.dli_fname) return;
  std::string dir = self.dli_fname;
  dir = dir.substr(0, dir.rfind('/') + 1);
  ::dlopen((dir + "libnccl.so.2").c_str(), RTLD_NOW | RTLD_GLOBAL);
}

}  // namespace cuda_emu

using cuda_emu::Device;
using cuda_emu::set_error;

cudaError_t cudaGetDeviceCount(int* count) {
  *count = cuda_emu::count_devices();
  return cuda_emu::no_device();
}

cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= cuda_emu::count_devices())
    return set_error(cudaErrorInvalidDevice, "device " + std::to_string(d) + " of " +
                                                 std::to_string(cuda_emu::count_devices()));
  cuda_emu::t_device = d;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* d) {
  *d = cuda_emu::t_device;
  return cuda_emu::no_device();
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (d < 0 || d >= cuda_emu::count_devices()) return set_error(cudaErrorInvalidDevice, "");
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "bertrain CUDA emulator (device %d, on the CPU)", d);
  p->totalGlobalMem = cuda_emu::device(d).total;
  p->sharedMemPerBlock = 48 << 10;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = p->maxGridSize[2] = 65535;
  p->multiProcessorCount = 1;
  p->major = 9;
  p->minor = 0;
  p->pciBusID = d + 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* bus, int len, int d) {
  if (d < 0 || d >= cuda_emu::count_devices()) return set_error(cudaErrorInvalidDevice, "");
  std::snprintf(bus, static_cast<size_t>(len), "00000000:%02X:00.0", d + 1);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  if (cudaError_t e = cuda_emu::refuse_in_capture(__func__)) return e;
  cuda_emu::count_host_wait(__func__);
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  return cuda_emu::current_dev().synchronize();
}

cudaError_t cudaDeviceReset() {
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  Device& d = cuda_emu::current_dev();
  d.synchronize();
  std::lock_guard<std::mutex> lock(d.mu);
  d.sticky = cudaSuccess;
  d.message.clear();
  cuda_emu::t_last = cudaSuccess;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  Device& d = cuda_emu::current_dev();
  std::lock_guard<std::mutex> lock(cuda_emu::g_memory_mu);
  *total = d.total;
  *free_bytes = d.total - d.allocated;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = cudaPeekAtLastError();
  cuda_emu::t_last = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() {
  if (cuda_emu::t_last != cudaSuccess) return cuda_emu::t_last;
  if (cuda_emu::count_devices() == 0) return cudaSuccess;
  Device& d = cuda_emu::current_dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.sticky;
}

namespace {
struct ErrorText {
  cudaError_t code;
  const char *name, *text;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};
const ErrorText& error_text(cudaError_t e) {
  for (const ErrorText& t : kErrors)
    if (t.code == e) return t;
  return kErrors[std::size(kErrors) - 1];
}
}  // namespace

const char* cudaGetErrorName(cudaError_t e) {
  return error_text(e).name;
}

const char* cudaGetErrorString(cudaError_t e) {
  const char* text = error_text(e).text;
  // With the detail of what failed: the device's fault, or the call's own.
  thread_local std::string out;
  std::string detail;
  if (e == cudaErrorLaunchFailure && cuda_emu::count_devices() > 0) {
    Device& d = cuda_emu::current_dev();
    std::lock_guard<std::mutex> lock(d.mu);
    detail = d.message;
  } else if (e == cuda_emu::t_detail_code) {
    detail = cuda_emu::t_detail;
  }
  out = detail.empty() ? text : std::string(text) + " (emulated device: " + detail + ")";
  return out.c_str();
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = nullptr;
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  if (cudaError_t e = cuda_emu::refuse_in_capture(__func__)) return e;
  if (bytes == 0) return cudaSuccess;
  Device& d = cuda_emu::current_dev();
  {
    std::lock_guard<std::mutex> lock(cuda_emu::g_memory_mu);
    if (d.allocated + bytes > d.total)
      return set_error(cudaErrorMemoryAllocation, std::to_string(bytes) + " bytes asked for, " +
                                                      std::to_string(d.total - d.allocated) +
                                                      " free of " + std::to_string(d.total) +
                                                      " (CUDA_EMU_MEMORY_GIB)");
    // (counting touches: whole pages of its own, so that a page is one allocation's)
    const bool paged = cuda_emu::touch_counting();
    const size_t held = paged ? cuda_emu::whole_pages(bytes) : bytes;
    if (posix_memalign(p, paged ? cuda_emu::kTouchPage : 256, held) != 0)
      return set_error(cudaErrorMemoryAllocation, "the host has no memory for the device's");
    d.allocated += bytes;
    cuda_emu::g_memory[reinterpret_cast<uintptr_t>(*p)] = {bytes, d.index, paged};
  }
  // New device memory holds no zeros to rely on: all ones (fp32 and 16-bit NaN) until written.
  std::memset(*p, 0xff, bytes);
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  if (cudaError_t e = cuda_emu::refuse_in_capture(__func__)) return e;
  cuda_emu::count_host_wait(__func__);
  int dev = -1;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(cuda_emu::g_memory_mu);
    auto it = cuda_emu::g_memory.find(reinterpret_cast<uintptr_t>(p));
    if (it == cuda_emu::g_memory.end() || it->second.device < 0)
      return set_error(cudaErrorInvalidValue, "cudaFree of a pointer cudaMalloc did not return");
    dev = it->second.device;
    bytes = it->second.bytes;
  }
  Device& d = cuda_emu::device(dev);
  d.synchronize();  // as cudaFree: the device's work that may use it runs first
  std::lock_guard<std::mutex> lock(cuda_emu::g_memory_mu);
  cuda_emu::g_memory.erase(reinterpret_cast<uintptr_t>(p));
  d.allocated -= bytes;
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  if (cudaError_t e = cuda_emu::refuse_in_capture(__func__)) return e;
  if (posix_memalign(p, 4096, std::max<size_t>(bytes, 1)) != 0)
    return set_error(cudaErrorMemoryAllocation, "page-locked host memory");
  std::lock_guard<std::mutex> lock(cuda_emu::g_memory_mu);
  cuda_emu::g_memory[reinterpret_cast<uintptr_t>(*p)] = {std::max<size_t>(bytes, 1), -1};
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  return cudaHostAlloc(p, bytes, cudaHostAllocDefault);
}

cudaError_t cudaFreeHost(void* p) {
  if (!p) return cudaSuccess;
  if (cudaError_t e = cuda_emu::refuse_in_capture(__func__)) return e;
  cuda_emu::count_host_wait(__func__);
  {
    std::lock_guard<std::mutex> lock(cuda_emu::g_memory_mu);
    auto it = cuda_emu::g_memory.find(reinterpret_cast<uintptr_t>(p));
    if (it == cuda_emu::g_memory.end() || it->second.device >= 0)
      return set_error(cudaErrorInvalidValue,
                       "cudaFreeHost of a pointer cudaHostAlloc did not return");
  }
  for (int k = 0; k < cuda_emu::count_devices(); ++k) cuda_emu::device(k).synchronize();
  std::lock_guard<std::mutex> lock(cuda_emu::g_memory_mu);
  cuda_emu::g_memory.erase(reinterpret_cast<uintptr_t>(p));
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  *a = cudaPointerAttributes{};
  std::lock_guard<std::mutex> lock(cuda_emu::g_memory_mu);
  if (const auto* m = cuda_emu::find(p)) {
    a->type = m->second.device >= 0 ? cudaMemoryTypeDevice : cudaMemoryTypeHost;
    a->device = m->second.device;
    (m->second.device >= 0 ? a->devicePointer : a->hostPointer) = const_cast<void*>(p);
  }
  return cudaSuccess;
}

// Pageable host memory as CUDA treats it: a copy from it waits for the stream, then is staged
// (the caller may reuse its buffer on return), a copy into it returns when done; page-locked memory
// (cudaHostAlloc) is copied when the stream gets there.
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s) {
  if (cudaError_t e = cuda_emu::check_copy(dst, src, bytes, kind, "cudaMemcpyAsync")) return e;
  if (bytes == 0) return cudaSuccess;
  const bool pageable = (!cuda_emu::is_device(src) && !cuda_emu::is_pinned(src, bytes)) ||
                        (!cuda_emu::is_device(dst) && !cuda_emu::is_pinned(dst, bytes));
  if (pageable) {  // (the host waits for the stream: no capture can hold the copy)
    if (cudaError_t e = cuda_emu::refuse_capturing(cuda_emu::stream_of(s),
                                                   "cudaMemcpyAsync of pageable host memory"))
      return e;
  }
  if (!cuda_emu::is_device(src) && !cuda_emu::is_pinned(src, bytes)) {
    // CUDA's API synchronisation behaviour: a copy from pageable memory may first wait for the
    // stream before it stages the data; the emulator does (and counts it as a host wait).
    cuda_emu::count_host_wait(__func__);
    if (cudaError_t e = cuda_emu::stream_synchronize(s)) return e;
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    return cuda_emu::enqueue(s, "cudaMemcpyAsync",
                             [=] { std::memcpy(dst, staged->data(), bytes); });
  }
  if (cudaError_t e =
          cuda_emu::enqueue(s, "cudaMemcpyAsync", [=] { std::memcpy(dst, src, bytes); }))
    return e;
  if (!cuda_emu::is_device(dst) && !cuda_emu::is_pinned(dst, bytes)) {
    cuda_emu::count_host_wait(__func__);
    return cuda_emu::stream_synchronize(s);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (cudaError_t e = cuda_emu::refuse_in_capture(__func__)) return e;
  if (cudaError_t e = cuda_emu::check_copy(dst, src, bytes, kind, "cudaMemcpy")) return e;
  if (bytes == 0) return cudaSuccess;
  if (cudaError_t e =
          cuda_emu::enqueue(nullptr, "cudaMemcpy", [=] { std::memcpy(dst, src, bytes); }))
    return e;
  cuda_emu::count_host_wait(__func__);
  return cuda_emu::stream_synchronize(nullptr);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  if (bytes == 0) return cudaSuccess;
  const std::string why = cuda_emu::device_range_problem(p, bytes, "its destination");
  if (!why.empty()) return set_error(cudaErrorInvalidValue, "cudaMemsetAsync: " + why);
  return cuda_emu::enqueue(s, "cudaMemsetAsync", [=] { std::memset(p, value, bytes); });
}

cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (cudaError_t e = cuda_emu::refuse_in_capture(__func__)) return e;
  if (cudaError_t e = cudaMemsetAsync(p, value, bytes, nullptr)) return e;
  cuda_emu::count_host_wait(__func__);
  return cuda_emu::stream_synchronize(nullptr);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  Device& d = cuda_emu::current_dev();
  *s = new CUstream_st;
  (*s)->s.device = &d;
  (*s)->s.blocking = (flags & cudaStreamNonBlocking) == 0;
  std::lock_guard<std::mutex> lock(d.mu);
  d.streams.push_back(&(*s)->s);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  cuda_emu::count_host_wait(__func__);
  if (!s) return set_error(cudaErrorInvalidResourceHandle, "the legacy stream is not destroyed");
  if (cudaError_t e = cuda_emu::refuse_destroyed(&s->s, "cudaStreamDestroy")) return e;
  if (cudaError_t e = cuda_emu::refuse_capturing(&s->s, "cudaStreamDestroy")) return e;
  Device& d = *s->s.device;
  d.wait(&s->s, d.tail(&s->s));  // its work completes first, as a GPU's does
  // Kept, off the device's list: events recorded on it, other streams' waits for it and another
  // thread's device synchronize still refer to it, and resolve at once, as a GPU's do (its work
  // is complete). A later use of the handle is an error.
  std::lock_guard<std::mutex> lock(d.mu);
  d.streams.erase(std::find(d.streams.begin(), d.streams.end(), &s->s));
  s->s.destroyed = true;
  d.retired.emplace_back(s);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  cuda_emu::count_host_wait(__func__);
  return cuda_emu::stream_synchronize(s);
}

cudaError_t cuda_emu::stream_synchronize(cudaStream_t s) {
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  cuda_emu::Stream* st = cuda_emu::stream_of(s);
  if (cudaError_t e = cuda_emu::refuse_destroyed(st, "cudaStreamSynchronize")) return e;
  if (cudaError_t e = cuda_emu::refuse_capturing(st, "cudaStreamSynchronize")) return e;
  return st->device->wait(st, st->device->tail(st));
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  cuda_emu::Stream* st = cuda_emu::stream_of(s);
  if (cudaError_t e = cuda_emu::refuse_destroyed(st, "cudaStreamQuery")) return e;
  if (cudaError_t e = cuda_emu::refuse_capturing(st, "cudaStreamQuery")) return e;
  return st->device->query(st, st->device->tail(st));
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  if (!e) return set_error(cudaErrorInvalidResourceHandle, "a null event");
  cuda_emu::Stream* st = cuda_emu::stream_of(s);
  if (cudaError_t r = cuda_emu::refuse_destroyed(st, "cudaStreamWaitEvent")) return r;
  {
    // In a capture: a wait for an event recorded into the same capture is its order already; a
    // wait for one recorded outside it would tie the graph to that work (isolation), and a wait
    // joining another stream to the capture (a fork or join) is not emulated.
    std::lock_guard<std::mutex> lock(cuda_emu::g_capture_mu);
    if (e->captured && st->capture == e->captured) return cudaSuccess;
    if (e->captured) {
      cuda_emu::invalidate(*e->captured, "a wait on another stream for an event of the capture");
      return set_error(cudaErrorStreamCaptureUnsupported,
                       "cudaStreamWaitEvent: another stream joining a capture (a fork or join) is "
                       "not emulated (cuda_emu/README.md)");
    }
    if (st->capture) {
      cuda_emu::invalidate(*st->capture, "a wait for an event recorded outside the capture");
      return set_error(cudaErrorStreamCaptureIsolation,
                       "cudaStreamWaitEvent: the capturing stream waits for an event recorded "
                       "outside the capture");
    }
  }
  if (cudaError_t r = cuda_emu::refuse_capturing(st, "cudaStreamWaitEvent")) return r;
  Device& d = *st->device;
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.sticky != cudaSuccess) return d.sticky;
  if (!e->stream) return cudaSuccess;  // never recorded: nothing to wait for
  if (e->stream->device != &d)
    return set_error(cudaErrorInvalidResourceHandle,
                     "a wait for an event of another device (not emulated: cuda_emu/README.md)");
  cuda_emu::Op op;
  op.deps.push_back({e->stream, e->seq});
  op.what = "cudaStreamWaitEvent";
  d.push(st, std::move(op));
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  *e = new CUevent_st;
  (*e)->timing = (flags & cudaEventDisableTiming) == 0;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  return cudaEventCreateWithFlags(e, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (!e) return set_error(cudaErrorInvalidResourceHandle, "a null event");
  if (e->stream) e->stream->device->wait(e->stream, e->seq);  // its record still refers to it
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (!e) return set_error(cudaErrorInvalidResourceHandle, "a null event");
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  cuda_emu::Stream* st = cuda_emu::stream_of(s);
  if (cudaError_t r = cuda_emu::refuse_destroyed(st, "cudaEventRecord")) return r;
  {
    // Recorded into a capture: an event only that capture's waits may use.
    std::lock_guard<std::mutex> lock(cuda_emu::g_capture_mu);
    e->captured = st->capture;
    if (e->captured) return cudaSuccess;
  }
  if (cudaError_t r = cuda_emu::refuse_capturing(st, "cudaEventRecord")) return r;
  Device& d = *st->device;
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.sticky != cudaSuccess) return d.sticky;
  cuda_emu::Op op;
  op.record = e;
  op.what = "cudaEventRecord";
  e->stream = st;
  e->seq = st->issued + 1;
  d.push(st, std::move(op));
  return cudaSuccess;
}

namespace cuda_emu {
namespace {
// An event recorded into a capture is the capture's: the host cannot wait for it or time it.
cudaError_t refuse_captured(cudaEvent_t e, const char* call) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  return e->captured ? set_error(cudaErrorCapturedEvent,
                                 std::string(call) + " of an event recorded into a capture")
                     : cudaSuccess;
}
}  // namespace
}  // namespace cuda_emu

cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (!e) return set_error(cudaErrorInvalidResourceHandle, "a null event");
  if (cudaError_t r = cuda_emu::refuse_captured(e, __func__)) return r;
  if (!e->stream) return cudaSuccess;
  return e->stream->device->query(e->stream, e->seq);
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (!e) return set_error(cudaErrorInvalidResourceHandle, "a null event");
  if (cudaError_t r = cuda_emu::refuse_captured(e, __func__)) return r;
  cuda_emu::count_host_wait(__func__);
  if (!e->stream) return cudaSuccess;
  return e->stream->device->wait(e->stream, e->seq);
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!start || !end || !start->timing || !end->timing)
    return set_error(cudaErrorInvalidResourceHandle, "an event without timing");
  if (cudaError_t r = cuda_emu::refuse_captured(start, __func__)) return r;
  if (cudaError_t r = cuda_emu::refuse_captured(end, __func__)) return r;
  if (!start->stream || !end->stream || start->stream->completed.load() < start->seq ||
      end->stream->completed.load() < end->seq)
    return set_error(cudaErrorNotReady, "an event not yet complete");
  *ms = static_cast<float>(end->ms - start->ms);
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  if (cuda_emu::count_devices() == 0) return cuda_emu::no_device();
  if (!s)
    return set_error(cudaErrorStreamCaptureUnsupported,
                     "cudaStreamBeginCapture: the legacy stream cannot capture");
  if (cudaError_t e = cuda_emu::refuse_destroyed(&s->s, __func__)) return e;
  std::lock_guard<std::mutex> lock(cuda_emu::g_capture_mu);
  if (s->s.capture)
    return set_error(cudaErrorInvalidValue, "cudaStreamBeginCapture: the stream captures already");
  s->s.capture = std::make_shared<cuda_emu::Capture>();
  s->s.capture->mode = mode;
  s->s.capture->thread = std::this_thread::get_id();
  cuda_emu::g_capturing.push_back(&s->s);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  *graph = nullptr;
  if (!s) return set_error(cudaErrorInvalidValue, "cudaStreamEndCapture: the legacy stream");
  std::lock_guard<std::mutex> lock(cuda_emu::g_capture_mu);
  std::shared_ptr<cuda_emu::Capture> c = s->s.capture;
  if (!c)
    return set_error(cudaErrorInvalidValue, "cudaStreamEndCapture: the stream is not capturing");
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
    return set_error(cudaErrorStreamCaptureWrongThread,
                     "cudaStreamEndCapture from a thread other than the one that began it");
  s->s.capture.reset();
  auto& all = cuda_emu::g_capturing;
  all.erase(std::find(all.begin(), all.end(), &s->s));
  if (!c->invalid.empty())
    return set_error(cudaErrorStreamCaptureInvalidated,
                     "the capture was invalidated: " + c->invalid);
  *graph = new CUgraph_st{std::move(c->nodes)};
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  cuda_emu::Stream* st = cuda_emu::stream_of(s);
  std::lock_guard<std::mutex> lock(cuda_emu::g_capture_mu);
  *status = !st->capture                   ? cudaStreamCaptureStatusNone
            : st->capture->invalid.empty() ? cudaStreamCaptureStatusActive
                                           : cudaStreamCaptureStatusInvalidated;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (!graph) return set_error(cudaErrorInvalidValue, "cudaGraphInstantiate of a null graph");
  *exec = new CUgraphExec_st{std::make_shared<const std::vector<cuda_emu::Node>>(graph->nodes)};
  return cudaSuccess;
}

// The graph's work queued as one operation of the stream: its nodes in the order they were
// captured (a kernel that fails names itself, as it does launched alone).
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  if (!exec) return set_error(cudaErrorInvalidValue, "cudaGraphLaunch of a null graph");
  {
    std::lock_guard<std::mutex> lock(cuda_emu::g_capture_mu);
    if (cuda_emu::stream_of(s)->capture)
      return set_error(cudaErrorStreamCaptureUnsupported,
                       "cudaGraphLaunch into a capture (a child graph) is not emulated");
  }
  std::shared_ptr<const std::vector<cuda_emu::Node>> nodes = exec->nodes;
  const cudaError_t e = cuda_emu::enqueue(s, "cudaGraphLaunch", [nodes] {
    for (const cuda_emu::Node& n : *nodes) n.work();
  });
  if (e == cudaSuccess) cuda_emu::count_graph_launch();
  return e;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;  // (a launch queued holds its nodes)
  return cudaSuccess;
}
