#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"

#include <atomic>
#include <cstddef>
#include <mutex>
#include <vector>

namespace bertrain::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

void set_device(int device) {
  BT_CUDA_CHECK(cudaSetDevice(device));
}

cudaStream_t compute_stream() {
  // One a device, made at its first use and kept for the process (as the legacy stream is):
  // every thread that runs a device's kernels shares its order. (Every launch asks: the calling
  // thread keeps the last device's, the lock taken only when its device changes.)
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  thread_local int t_device = -1;
  thread_local cudaStream_t t_stream = nullptr;
  int device = 0;
  BT_CUDA_CHECK(cudaGetDevice(&device));
  if (device == t_device) return t_stream;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(device) >= streams.size())
    streams.resize(static_cast<size_t>(device) + 1, nullptr);
  cudaStream_t& s = streams[static_cast<size_t>(device)];
  if (!s) BT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamDefault));
  t_device = device;
  t_stream = s;
  return s;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) BT_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) {
    count_free();
    cudaFree(ptr_);
  }
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) {
      count_free();
      cudaFree(ptr_);
    }
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, size_t bytes) {
  BT_CHECK(bytes <= bytes_, "upload of ", bytes, " bytes into a buffer of ", bytes_);
  BT_CUDA_WAIT(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* host, size_t bytes) const {
  BT_CHECK(bytes <= bytes_, "download of ", bytes, " bytes from a buffer of ", bytes_);
  BT_CUDA_WAIT(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost));
}

namespace {
struct Binding {
  std::byte* base = nullptr;
  kernels::ScratchLayout layout;
  uint64_t generation = 0;  // how many times bind_scratch changed the binding
};
// The calling host thread's: it launches the kernels (a process may run a model per GPU, one
// thread each).
thread_local Binding g_binding;
// Bytes of the buffers scratch() grew outside the bound region (unplanned_scratch_bytes).
std::atomic<int64_t> g_unplanned{0};
}  // namespace

void bind_scratch(void* region, const kernels::ScratchLayout& layout) {
  const Binding& b = g_binding;
  const bool same = b.base == region && b.layout == layout;
  // (a model binds its region before each pass: the same binding; a model freed binds none)
  g_binding = {static_cast<std::byte*>(region), layout, same ? b.generation : b.generation + 1};
}

uint64_t scratch_binding() {
  return g_binding.generation;
}

void* scratch(int slot, size_t bytes) {
  BT_CHECK(slot >= 0 && slot < kScratchSlots, "scratch: no slot ", slot);
  const Binding& bound = g_binding;
  if (bound.base && static_cast<int64_t>(bytes) <= bound.layout.part[slot])
    return bound.base + kernels::ScratchLayout::rounded(bound.layout.caller) +
           bound.layout.offset(slot);
  thread_local DeviceBuffer buffers[kScratchSlots];
  DeviceBuffer& b = buffers[slot];
  if (b.bytes() < bytes) {
    g_unplanned += static_cast<int64_t>(bytes - b.bytes());
    b = DeviceBuffer();  // cudaFree waits for the kernels still using it
    b = DeviceBuffer(bytes);
    BT_CUDA_WAIT(cudaMemset(b.data(), 0, bytes));  // (as the plan's: column tickets start at 0)
  }
  return b.data();
}

int64_t unplanned_scratch_bytes() {
  return g_unplanned.load();
}

void synchronize() {
  BT_CUDA_WAIT(cudaDeviceSynchronize());
}

namespace {
std::atomic<int64_t> g_launches{0}, g_host_syncs{0}, g_ahead_waits{0}, g_graph_launches{0},
    g_graph_kernels{0};
thread_local bool t_capturing = false;
thread_local int64_t t_captured = 0;  // launches issued into the capture
std::atomic<uint64_t> g_frees{0};
}  // namespace

void count_ahead_wait() {
  g_ahead_waits.fetch_add(1, std::memory_order_relaxed);
}

void count_free() {
  count_host_sync();
  g_frees.fetch_add(1, std::memory_order_relaxed);
}

uint64_t memory_generation() {
  return g_frees.load(std::memory_order_relaxed);
}

void count_launch() {
  if (t_capturing)
    ++t_captured;
  else
    g_launches.fetch_add(1, std::memory_order_relaxed);
}

void count_host_sync() {
  g_host_syncs.fetch_add(1, std::memory_order_relaxed);
}

kernels::DeviceCounts device_counts() {
  return {g_launches.load(), g_host_syncs.load(), g_ahead_waits.load(), g_graph_launches.load(),
          g_graph_kernels.load()};
}

int64_t captured_launches() {
  return t_captured;
}

void count_graph_launch(int64_t kernels) {
  g_graph_launches.fetch_add(1, std::memory_order_relaxed);
  g_graph_kernels.fetch_add(kernels, std::memory_order_relaxed);
  g_launches.fetch_add(kernels, std::memory_order_relaxed);
}

void set_capturing(bool on) {
  t_capturing = on;
  if (on) {
    t_captured = 0;
    forget_device_records();
  }
}

bool capturing() {
  return t_capturing;
}

}  // namespace bertrain::cuda
