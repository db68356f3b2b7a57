// What the emulated device was given since the process started, counted by the emulator itself
// (cuda_emu/README.md), so that a program's own counts of its launches and host waits (bertrain's
// cuda::device_counts, what `bench --device cuda` prints) can be checked against what happened.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace cuda_emu {

struct Counts {
  int64_t kernels = 0;        // kernel launches queued
  int64_t library_calls = 0;  // cuBLAS and cuBLASLt products queued (one kernel or more on a GPU)
  // Calls in which a host thread waited for the device: cudaStreamSynchronize,
  // cudaEventSynchronize, cudaDeviceSynchronize, cudaMemcpy, cudaMemset, cudaMemcpyAsync into
  // or out of pageable memory (CUDA may wait for the stream before staging the latter; the
  // emulator does), cudaFree, cudaFreeHost, cudaStreamDestroy (whether or not work was pending).
  int64_t host_waits = 0;
  // Graph launches queued (cudaGraphLaunch). A kernel or product issued to a capturing stream
  // counts above when captured; its graph's launches run it without counting it again.
  int64_t graph_launches = 0;
};

// The process's counts so far (every thread, every device).
Counts counts();

// The device memory kernels touch, by kernel name, in pages of kTouchPage bytes: what a model of
// the kernels' traffic is checked against. While touch counting is on, device memory is
// allocated in whole pages, and each kernel runs with the pages of its device's allocations
// made since counting began taken from it: the first read and the first write of each page
// fault, are counted and give the page back (a page read, then written, counts as both; one
// written first counts as written only: what is read after that is not seen). Library products
// count as kernels do, under their call's name (cublasLtMatmul, cublasGemmBatchedEx); copies and
// memsets are not counted. Meant for one device at a time (a
// fault in a page of the running kernel's device counts for that kernel, whoever touched it)
// and for counting only: every touched page costs a fault.
constexpr int64_t kTouchPage = 4096;
// With the pages, the products' floating-point operations (2 M N K each) a kernel did: a library
// product's, and each tensor-core operation's (wmma::mma_sync, once a warp), as a GPU's own
// kernels would do them: what a model of the kernels' work is checked against.
struct Touched {
  int64_t launches = 0;
  int64_t pages_read = 0, pages_written = 0;
  double flops = 0;
};
void set_touch_counting(bool on);
// Adds a product's operations to the kernel being counted (nothing while none is).
void count_products(double flops);
std::map<std::string, Touched> touched();  // since the last reset_touched()
void reset_touched();

}  // namespace cuda_emu
