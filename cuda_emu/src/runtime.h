// Inside the emulated device (cuda_emu/README.md): what the runtime, the BLAS and NCCL parts
// share. A stream's work runs on its device's executor thread, in the stream's order, after the
// work it depends on (event waits, the legacy default stream's implicit ordering).
#pragma once

#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_emu/counts.h"
#include "cuda_runtime.h"

namespace cuda_emu {

// An error found while the device runs work (a kernel's thread, a library call): the device's
// sticky error from then on, as a GPU's launch failure is, with this message.
struct Fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Queues work on a stream (nullptr: the calling thread's current device's legacy stream).
cudaError_t enqueue(cudaStream_t s, const char* what, std::function<void()> work);

int current_device();

// The counts of counts.h: a kernel queued, a library product queued, a host wait (in the call
// named), a graph launch; with CUDA_EMU_TRACE=1 each is also written to stderr.
void count_kernel(const char* name);
void count_library_call(const char* name);
void count_host_wait(const char* call);
void count_graph_launch();

// cudaStreamSynchronize without counting a host wait (for the calls that count their own).
cudaError_t stream_synchronize(cudaStream_t s);

// "" when [p, p + bytes) lies inside one device allocation, else what is wrong (for a message
// naming the operand `what`).
std::string device_range_problem(const void* p, size_t bytes, const char* what);

// Stream capture's refusal of a call a capture forbids (it allocates, frees or waits for the
// device) while one is in progress that the call breaks: cudaSuccess, or the error with each
// capture it broke invalidated (runtime.cpp).
cudaError_t refuse_in_capture(const char* call);

// Sets the calling thread's last error with a detail that cudaGetErrorString appends.
cudaError_t set_error(cudaError_t e, const std::string& detail);

// Touch counting (counts.h set_touch_counting): whether it is on, the allocations of `device`
// made while it was (page-aligned, whole pages: [begin, begin + bytes)), and a kernel's run
// with them counted (blocks.cpp; `run` runs the grid, the pages given back however it ends).
bool touch_counting();
std::vector<std::pair<char*, size_t>> paged_allocations(int device);
void count_touches(int device, const char* name, const std::function<void()>& run);

// Runs a kernel's grid on the calling (executor) thread: every block, its threads as fibers.
// Throws Fault naming the kernel, block and thread on a barrier or collective misuse.
void run_grid(const char* name, dim3 grid, dim3 block, const void* closure,
              void (*body)(const void*));

}  // namespace cuda_emu
