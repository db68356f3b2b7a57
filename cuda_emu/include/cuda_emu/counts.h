// What the emulated device was given since the process started, counted by the emulator itself
// (cuda_emu/README.md), so that a program's own counts of its launches and host waits (bertrain's
// cuda::device_counts, what `bench --device cuda` prints) can be checked against what happened.
#pragma once

#include <cstdint>

namespace cuda_emu {

struct Counts {
  int64_t kernels = 0;        // kernel launches queued
  int64_t library_calls = 0;  // cuBLAS and cuBLASLt products queued (one kernel or more on a GPU)
  // Calls in which a host thread waited for the device: cudaStreamSynchronize,
  // cudaEventSynchronize, cudaDeviceSynchronize, cudaMemcpy, cudaMemset, cudaMemcpyAsync into
  // or out of pageable memory (CUDA may wait for the stream before staging the latter; the
  // emulator does), cudaFree, cudaFreeHost, cudaStreamDestroy (whether or not work was pending).
  int64_t host_waits = 0;
};

// The process's counts so far (every thread, every device).
Counts counts();

}  // namespace cuda_emu
