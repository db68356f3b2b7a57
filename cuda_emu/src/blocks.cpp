// A kernel's grid on the emulated device (cuda_emu/README.md): block after block, one block at a
// time in the process; a block's threads are fibers (Boost.Context) run in thread order, each
// until it exits or reaches a barrier or a warp collective. A barrier opens when every thread of
// the block waits at one; a collective completes when every lane its mask names has reached it
// with the same mask. Anything else (a thread that exited while others wait at a barrier, a
// lane missing from a collective, a source lane outside the mask, threads waiting for each other
// forever) stops the kernel with a Fault naming the kernel, block, threads and why: what a GPU
// leaves undefined, or hangs on.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <boost/context/fiber.hpp>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#else
#define CUDA_EMU_ASAN 0
#endif

namespace cuda_emu {

namespace {

namespace ctx = boost::context;

// A thread's stack: a pool of mmap'd stacks with a guard page below each, reused by the next
// block (a fiber per thread, thousands per launch).
#if CUDA_EMU_ASAN
constexpr size_t kStack = size_t{512} << 10;
#else
constexpr size_t kStack = size_t{128} << 10;
#endif
constexpr size_t kGuard = 4096;

struct StackPool {
  std::vector<ctx::stack_context> free;
  ~StackPool() {
    for (auto& s : free) ::munmap(static_cast<char*>(s.sp) - s.size - kGuard, s.size + kGuard);
  }
};
thread_local StackPool t_stacks;

struct PooledStack {
  const void** bottom;  // where the stack's lowest address goes (ASan is told on each switch)
  ctx::stack_context allocate() {
    ctx::stack_context s = take();
    *bottom = static_cast<char*>(s.sp) - s.size;
    return s;
  }
  ctx::stack_context take() {
    if (!t_stacks.free.empty()) {
      ctx::stack_context s = t_stacks.free.back();
      t_stacks.free.pop_back();
      return s;
    }
    void* base = ::mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw Fault("no memory for a thread's stack");
    ::mprotect(base, kGuard, PROT_NONE);
    ctx::stack_context s;
    s.size = kStack;
    s.sp = static_cast<char*>(base) + kGuard + kStack;
    return s;
  }
  void deallocate(ctx::stack_context& s) noexcept {
#if CUDA_EMU_ASAN
    // (the next thread's frames must not meet this one's redzones)
    __asan_unpoison_memory_region(static_cast<char*>(s.sp) - s.size, s.size);
#endif
    t_stacks.free.push_back(s);
  }
};

enum class State { Runnable, AtBarrier, AtCollective, Done };

struct Worker;

struct Lane {
  ThreadIndex index;
  int linear = 0;
  State state = State::Runnable;
  Worker* worker = nullptr;  // the fiber running this thread
  // At a collective: what it is, and the value it gets back.
  Collective kind = Collective::SyncWarp;
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
  int arg = 0, width = 32;
  const char* fault = nullptr;  // a misuse found by the lane itself
};

// A fiber that runs the block's threads one after another, from the next not yet started, until
// one of them waits (at a barrier or a collective): that thread keeps it, and the next thread
// starts on a new fiber. A kernel without barriers or collectives runs a whole block on one
// fiber; one whose every thread waits has a fiber per thread.
struct Worker {
  ctx::fiber fiber, sink;
  Lane* lane = nullptr;  // the thread it runs (null once out of threads)
  const void* stack_bottom = nullptr;
#if CUDA_EMU_ASAN
  void* fake_stack = nullptr;
#endif
};

std::mutex g_kernel_mu;  // one block at a time in the process: __shared__ is a function static

struct Block;
// (initial-exec: libcuda_emu.so is linked, never dlopen'ed, so these need no __tls_get_addr on
// every threadIdx)
__attribute__((tls_model("initial-exec"))) thread_local Block* t_block = nullptr;
__attribute__((tls_model("initial-exec"))) thread_local Lane* t_lane = nullptr;

const char* collective_name(Collective k) {
  switch (k) {
    case Collective::ShflXor:
      return "__shfl_xor_sync";
    case Collective::Shfl:
      return "__shfl_sync";
    case Collective::ShflUp:
      return "__shfl_up_sync";
    case Collective::ShflDown:
      return "__shfl_down_sync";
    case Collective::Ballot:
      return "__ballot_sync";
    case Collective::Any:
      return "__any_sync";
    case Collective::All:
      return "__all_sync";
    default:
      return "__syncwarp";
  }
}

std::string hex(unsigned m) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", m);
  return b;
}

struct Block {
  const char* name;
  dim3 grid, dim;
  const void* closure;
  void (*body)(const void*);
  std::vector<Lane> lanes;
  std::vector<Worker> workers;  // (reserved: a lane keeps its worker's address)
  int threads, next = 0;        // next: the first thread not yet started
#if CUDA_EMU_ASAN
  void* fake_stack = nullptr;
  const void* bottom = nullptr;
  size_t size = 0;
#endif

  Block(const char* n, dim3 g, dim3 d, const void* c, void (*b)(const void*))
      : name(n), grid(g), dim(d), closure(c), body(b), threads(static_cast<int>(d.x * d.y * d.z)) {
    lanes.resize(static_cast<size_t>(threads));
  }

  std::string where(const Lane& l) const {
    return std::string(name) + ", block (" + std::to_string(l.index.block.x) + "," +
           std::to_string(l.index.block.y) + "," + std::to_string(l.index.block.z) + ")";
  }
  std::string thread_name(const Lane& l) const {
    return "thread " + std::to_string(l.linear) + " (warp " + std::to_string(l.linear / 32) +
           ", lane " + std::to_string(l.linear % 32) + ")";
  }
  [[noreturn]] void fault(const Lane& l, const std::string& why) const {
    throw Fault(where(l) + ": " + why);
  }

  // The lane's side of a switch back to the scheduler.
  void yield(Lane& l) {
    Worker& w = *l.worker;
#if CUDA_EMU_ASAN
    __sanitizer_start_switch_fiber(&w.fake_stack, bottom, size);
#endif
    w.sink = std::move(w.sink).resume();
#if CUDA_EMU_ASAN
    __sanitizer_finish_switch_fiber(w.fake_stack, nullptr, nullptr);
#endif
    t_lane = &l;
  }

  void resume(Worker& w) {
    t_lane = w.lane;
#if CUDA_EMU_ASAN
    __sanitizer_start_switch_fiber(&fake_stack, w.stack_bottom, kStack);
#endif
    w.fiber = std::move(w.fiber).resume();
#if CUDA_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
    t_lane = nullptr;
    if (w.lane && w.lane->fault) fault(*w.lane, thread_name(*w.lane) + ": " + w.lane->fault);
  }

  // A new worker, run until its thread waits or no thread is left to start.
  void start_worker() {
    workers.emplace_back();
    Worker& w = workers.back();
    w.fiber =
        ctx::fiber(std::allocator_arg, PooledStack{&w.stack_bottom}, [this, &w](ctx::fiber&& sink) {
          w.sink = std::move(sink);
#if CUDA_EMU_ASAN
          __sanitizer_finish_switch_fiber(nullptr, &bottom, &size);
#endif
          while (next < threads) {
            Lane& l = lanes[static_cast<size_t>(next++)];
            w.lane = &l;
            l.worker = &w;
            t_lane = &l;
            body(closure);
            l.state = State::Done;
          }
          w.lane = nullptr;
#if CUDA_EMU_ASAN
          __sanitizer_start_switch_fiber(nullptr, bottom, size);
#endif
          return std::move(w.sink);
        });
    resume(w);
  }

  void run(uint3 b) {
    for (int i = 0; i < threads; ++i) {
      Lane& l = lanes[static_cast<size_t>(i)];
      l.linear = i;
      l.index = {{i % dim.x, (i / dim.x) % dim.y, i / (dim.x * dim.y)}, b, dim, grid};
      l.state = State::Runnable;
      l.fault = nullptr;
      l.worker = nullptr;
    }
    workers.clear();
    workers.reserve(static_cast<size_t>(threads));
    next = 0;
    while (next < threads) start_worker();  // every thread to its first wait, in order
    for (;;) {
      bool ran = false, all_done = true;
      for (Lane& l : lanes) {
        if (l.state == State::Runnable) {
          resume(*l.worker);
          ran = true;
        }
        all_done &= l.state == State::Done;
      }
      if (all_done) break;
      if (release_barrier() | release_collectives() | ran) continue;
      deadlock();
    }
  }

  // Every thread of the block at a barrier: all go on. One that exited while others wait is a
  // barrier not every thread reaches (undefined on a GPU).
  bool release_barrier() {
    int waiting = 0;
    const Lane* exited = nullptr;
    for (const Lane& l : lanes) {
      if (l.state == State::AtBarrier) ++waiting;
      if (l.state == State::Done && !exited) exited = &l;
      if (l.state == State::Runnable) return false;
    }
    if (waiting == 0) return false;
    for (const Lane& l : lanes)
      if (l.state == State::AtCollective) return false;  // (deadlock() names it)
    if (exited) {
      const Lane* w = nullptr;
      for (const Lane& l : lanes)
        if (l.state == State::AtBarrier) {
          w = &l;
          break;
        }
      fault(*w, thread_name(*w) + " waits at __syncthreads, which " + thread_name(*exited) +
                    " never reaches (it exited): a barrier every thread of the block must reach");
    }
    for (Lane& l : lanes) l.state = State::Runnable;
    return true;
  }

  // Collectives whose every named lane has arrived: each lane's result.
  bool release_collectives() {
    bool released = false;
    for (int w0 = 0; w0 < threads; w0 += 32) {
      const int n = std::min(32, threads - w0);
      Lane* warp = &lanes[static_cast<size_t>(w0)];
      for (int i = 0; i < n; ++i) {
        Lane& l = warp[i];
        if (l.state != State::AtCollective) continue;
        if (ready(warp, n, l)) {
          complete(warp, l.mask);
          released = true;
        }
      }
    }
    return released;
  }

  // Whether lane l's collective can complete: every lane of its mask there with the same mask
  // and kind; a named lane that exited or waits at a barrier never will.
  bool ready(Lane* warp, int n, const Lane& l) const {
    for (int j = 0; j < 32; ++j) {
      if (!(l.mask >> j & 1u)) continue;
      if (j >= n)
        fault(l, thread_name(l) + ": " + collective_name(l.kind) + " with mask " + hex(l.mask) +
                     " names lane " + std::to_string(j) + ", which this warp of " +
                     std::to_string(n) + " threads does not have");
      const Lane& o = warp[j];
      switch (o.state) {
        case State::Runnable:
          return false;
        case State::Done:
          fault(l, thread_name(l) + " waits in " + collective_name(l.kind) + " with mask " +
                       hex(l.mask) + " for " + thread_name(o) +
                       ", which exited: every lane the mask names must reach it");
        case State::AtBarrier:
          fault(l, thread_name(l) + " waits in " + collective_name(l.kind) + " with mask " +
                       hex(l.mask) + " for " + thread_name(o) +
                       ", which waits at __syncthreads instead");
        case State::AtCollective:
          if (o.mask != l.mask || o.kind != l.kind)
            fault(l, thread_name(l) + " is in " + collective_name(l.kind) + " with mask " +
                         hex(l.mask) + " while " + thread_name(o) + " is in " +
                         collective_name(o.kind) + " with mask " + hex(o.mask) +
                         ": the lanes of a mask must meet in one collective with one mask");
          break;
      }
    }
    return true;
  }

  void complete(Lane* warp, unsigned mask) {
    uint64_t ballot = 0;
    for (int j = 0; j < 32; ++j)
      if ((mask >> j & 1u) && warp[j].value) ballot |= uint64_t{1} << j;
    for (int j = 0; j < 32; ++j) {
      if (!(mask >> j & 1u)) continue;
      Lane& l = warp[j];
      const int base = j & ~(l.width - 1), end = base + l.width;
      int src = j;
      switch (l.kind) {
        case Collective::ShflXor:
          src = j ^ l.arg;
          if (src >= end || src < base) src = j;  // a later group: its own value, as on a GPU
          break;
        case Collective::Shfl:
          src = base + (l.arg % l.width + l.width) % l.width;
          break;
        case Collective::ShflUp:
          src = j - l.arg >= base ? j - l.arg : j;
          break;
        case Collective::ShflDown:
          src = j + l.arg < end ? j + l.arg : j;
          break;
        default:
          break;
      }
      switch (l.kind) {
        case Collective::Ballot:
          l.result = ballot;
          break;
        case Collective::Any:
          l.result = ballot != 0;
          break;
        case Collective::All:
          l.result = ballot == (mask == 0xffffffffu ? 0xffffffffull : mask);
          break;
        case Collective::SyncWarp:
          break;
        default:
          if (!(mask >> src & 1u))
            fault(l, thread_name(l) + ": " + collective_name(l.kind) + " reads lane " +
                         std::to_string(src) + ", which the mask " + hex(mask) +
                         " does not name: its value is undefined on a GPU");
          l.result = warp[src].value;
      }
      l.state = State::Runnable;
    }
  }

  [[noreturn]] void deadlock() const {
    std::string at;
    for (const Lane& l : lanes)
      if (l.state == State::AtCollective) {
        at = thread_name(l) + " waits in " + collective_name(l.kind) + " with mask " + hex(l.mask);
        break;
      }
    fault(lanes[0], "the block's threads wait for each other forever (" + at + ")");
  }
};

}  // namespace

const ThreadIndex& current() {
  return t_lane->index;
}

void syncthreads() {
  Lane& l = *t_lane;
  l.state = State::AtBarrier;
  t_block->yield(l);
}

void kernel_fault(const char* why) {
  Lane& l = *t_lane;
  l.fault = why;
  l.state = State::Done;
  t_block->yield(l);
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width) {
  Lane& l = *t_lane;
  const int lane = l.linear % 32;
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    l.fault = "a warp collective's width must be a power of two up to 32";
  else if (!(mask >> lane & 1u))
    l.fault = "a warp collective whose mask does not name the calling lane (undefined on a GPU)";
  if (l.fault) {
    l.state = State::Done;
    t_block->yield(l);
  }
  l.state = State::AtCollective;
  l.kind = kind;
  l.mask = mask;
  l.value = value;
  l.arg = arg;
  l.width = width;
  t_block->yield(l);
  return l.result;
}

namespace {

// A kernel thread that touches an address it may not (a GPU's "illegal address"): the kernel,
// block and thread named on stderr, then the signal goes on to the handler before ours
// (AddressSanitizer's report, or the default: the process ends).
struct sigaction g_previous_segv, g_previous_bus;

// Touch counting (counts.h): the running kernel's device's paged allocations, each page's state
// (bit 0 read, bit 1 written), while g_tracking is set.
struct Tracked {
  char* begin;
  size_t bytes;
  size_t first;  // its first page's index in g_page_state
};
std::atomic<bool> g_counting{false}, g_tracking{false};
std::mutex g_touch_mu;  // one counted kernel at a time; guards what follows
std::vector<Tracked> g_tracked;
std::vector<uint8_t> g_page_state;
std::map<std::string, Touched> g_touched;
double g_flops = 0;  // the counted kernel's products (one kernel at a time: g_touch_mu)

// Whether the fault at `addr` was a tracked page's, handled: the page counted and given back
// (read: readable; written: readable and writable).
bool count_touch(void* addr, void* context) {
  if (!g_tracking.load(std::memory_order_acquire)) return false;
  char* a = static_cast<char*>(addr);
  auto it = std::upper_bound(g_tracked.begin(), g_tracked.end(), a,
                             [](char* x, const Tracked& t) { return x < t.begin; });
  if (it == g_tracked.begin()) return false;
  --it;
  if (a >= it->begin + it->bytes) return false;
  const size_t page = static_cast<size_t>(a - it->begin) / kTouchPage;
  char* start = it->begin + page * kTouchPage;
  uint8_t& state = g_page_state[it->first + page];
#if defined(__x86_64__)
  // (the page fault's error code: bit 1 set for a write)
  const bool write = static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_ERR] & 2;
#else
  (void)context;
  const bool write = true;
  state |= 1;  // (read or write unknown: counted as both)
#endif
  state |= write ? 2 : 1;
  ::mprotect(start, kTouchPage, write ? PROT_READ | PROT_WRITE : PROT_READ);
  return true;
}

void on_fault(int sig, siginfo_t* info, void* context) {
  if (sig == SIGSEGV && count_touch(info->si_addr, context)) return;
  if (const Lane* l = t_lane) {
    char line[512];
    const int n = std::snprintf(
        line, sizeof line,
        "cuda_emu: %s, block (%u,%u,%u), thread %d: invalid memory access at %p (a GPU reports "
        "an illegal address)\n",
        t_block ? t_block->name : "?", l->index.block.x, l->index.block.y, l->index.block.z,
        l->linear, info->si_addr);
    if (n > 0) (void)!::write(2, line, static_cast<size_t>(std::min<int>(n, sizeof line - 1)));
  }
  const struct sigaction& prev = sig == SIGSEGV ? g_previous_segv : g_previous_bus;
  if (prev.sa_flags & SA_SIGINFO && prev.sa_sigaction) return prev.sa_sigaction(sig, info, context);
  if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && prev.sa_handler)
    return prev.sa_handler(sig);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void install_fault_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction a;
    std::memset(&a, 0, sizeof a);
    a.sa_sigaction = on_fault;
    a.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&a.sa_mask);
    ::sigaction(SIGSEGV, &a, &g_previous_segv);
    ::sigaction(SIGBUS, &a, &g_previous_bus);
  });
}

}  // namespace

bool touch_counting() {
  return g_counting.load();
}

void set_touch_counting(bool on) {
  install_fault_handler();
  g_counting.store(on);
}

std::map<std::string, Touched> touched() {
  std::lock_guard<std::mutex> lock(g_touch_mu);
  return g_touched;
}

void reset_touched() {
  std::lock_guard<std::mutex> lock(g_touch_mu);
  g_touched.clear();
}

void count_products(double flops) {
  if (g_tracking.load(std::memory_order_acquire)) g_flops += flops;
}

void count_touches(int device, const char* name, const std::function<void()>& run) {
  if (!g_counting.load()) return run();
  std::vector<std::pair<char*, size_t>> allocations = paged_allocations(device);
  std::lock_guard<std::mutex> lock(g_touch_mu);
  std::sort(allocations.begin(), allocations.end());
  g_tracked.clear();
  size_t pages = 0;
  for (const auto& [p, bytes] : allocations) {
    g_tracked.push_back({p, bytes, pages});
    pages += bytes / kTouchPage;
  }
  g_page_state.assign(pages, 0);
  for (const Tracked& t : g_tracked) ::mprotect(t.begin, t.bytes, PROT_NONE);
  g_tracking.store(true, std::memory_order_release);
  struct GiveBack {  // however the kernel ends
    ~GiveBack() {
      g_tracking.store(false, std::memory_order_release);
      for (const Tracked& t : g_tracked) ::mprotect(t.begin, t.bytes, PROT_READ | PROT_WRITE);
    }
  };
  Touched& k = g_touched[name];
  ++k.launches;
  g_flops = 0;
  {
    const GiveBack give_back;
    run();
  }
  k.flops += g_flops;
  for (uint8_t s : g_page_state) {
    k.pages_read += s & 1;
    k.pages_written += s >> 1 & 1;
  }
}

void run_grid(const char* name, dim3 grid, dim3 block, const void* closure,
              void (*body)(const void*)) {
  install_fault_handler();
  std::lock_guard<std::mutex> lock(g_kernel_mu);
  Block b(name, grid, block, closure, body);
  Block* outer = t_block;
  t_block = &b;
  try {
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) b.run({x, y, z});
  } catch (...) {
    t_block = outer;
    throw;
  }
  t_block = outer;
}

}  // namespace cuda_emu
