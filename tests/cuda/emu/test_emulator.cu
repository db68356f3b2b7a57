// The emulated device itself (cuda_emu/README.md), built only with -DBERTRAIN_CUDA_EMU=ON: the
// built-in indices of a 2-D grid of 2-D blocks, shared memory and barriers, the warp collectives'
// values, and the misuses a GPU leaves undefined or hangs on, each a launch failure whose
// message names the kernel, the block and the threads; the streams' order under the late
// schedule; launch and copy errors. A failed kernel's device is reset (cudaDeviceReset) so the
// next test starts clean. Touch counting: the pages of device memory each kernel reads and
// writes. cuBLASLt's 16-bit outputs and the type of their bias.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mma.h>

#include "cuda_emu/counts.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr unsigned kFull = 0xffffffffu;

template <class T>
struct Buffer {
  T* d = nullptr;
  size_t n;
  explicit Buffer(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), n * sizeof(T)), cudaSuccess);
  }
  ~Buffer() { cudaFree(d); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

// The device's error after the kernels queued so far, its message, and the device reset.
std::string failure_of_queued_work() {
  const cudaError_t e = cudaDeviceSynchronize();
  std::string what = e == cudaSuccess ? "" : cudaGetErrorString(e);
  EXPECT_EQ(e, cudaErrorLaunchFailure) << what;
  EXPECT_EQ(cudaDeviceReset(), cudaSuccess);
  return what;
}

// out[global thread] = its block and thread indices, and the block's sum of threadIdx.x + y
// through shared memory and a barrier.
__global__ void indices_kernel(int* out, int* sums) {
  __shared__ int part[64];
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int b = blockIdx.y * gridDim.x + blockIdx.x;
  const int g = b * blockDim.x * blockDim.y + t;
  out[4 * g] = blockIdx.x;
  out[4 * g + 1] = blockIdx.y;
  out[4 * g + 2] = threadIdx.x;
  out[4 * g + 3] = threadIdx.y;
  part[t] = threadIdx.x + threadIdx.y;
  __syncthreads();
  if (t == 0) {
    int s = 0;
    for (unsigned k = 0; k < blockDim.x * blockDim.y; ++k) s += part[k];
    sums[b] = s;
  }
}

TEST(CudaEmu, IndicesSharedMemoryAndBarriers) {
  const dim3 grid(3, 2), block(8, 4);
  Buffer<int> out(6 * 32 * 4), sums(6);
  BT_LAUNCH(indices_kernel, grid, block)(out.d, sums.d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto h = out.host();
  for (int b = 0; b < 6; ++b)
    for (int t = 0; t < 32; ++t) {
      const int g = b * 32 + t;
      ASSERT_EQ(h[4 * g], b % 3) << g;
      ASSERT_EQ(h[4 * g + 1], b / 3) << g;
      ASSERT_EQ(h[4 * g + 2], t % 8) << g;
      ASSERT_EQ(h[4 * g + 3], t / 8) << g;
    }
  for (int s : sums.host()) EXPECT_EQ(s, 4 * (0 + 7) * 8 / 2 + 8 * (0 + 3) * 4 / 2);
}

// Each lane's value is its lane number; out[6 lane + k] = the collectives' results.
__global__ void collectives_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  int* o = out + 6 * threadIdx.x;
  o[0] = __shfl_xor_sync(kFull, lane, 5);
  o[1] = __shfl_sync(kFull, lane, 7);
  o[2] = __shfl_up_sync(kFull, lane, 3);
  o[3] = __shfl_down_sync(kFull, lane, 3);
  o[4] = static_cast<int>(__ballot_sync(kFull, lane % 3 == 0));
  o[5] = __any_sync(kFull, lane == 31) + 2 * __all_sync(kFull, lane < 31);
}

TEST(CudaEmu, WarpCollectivesHaveTheirSemantics) {
  Buffer<int> out(64 * 6);
  BT_LAUNCH(collectives_kernel, 1, 64)(out.d);
  const auto h = out.host();
  unsigned ballot = 0;
  for (int j = 0; j < 32; j += 3) ballot |= 1u << j;
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32;
    const int* o = h.data() + 6 * t;
    EXPECT_EQ(o[0], lane ^ 5) << t;
    EXPECT_EQ(o[1], 7) << t;
    EXPECT_EQ(o[2], lane >= 3 ? lane - 3 : lane) << t;  // below the warp: its own value
    EXPECT_EQ(o[3], lane + 3 < 32 ? lane + 3 : lane) << t;
    EXPECT_EQ(static_cast<unsigned>(o[4]), ballot) << t;
    EXPECT_EQ(o[5], 1) << t;  // any: lane 31; all: not lane 31
  }
}

// d = a b + c through warp matrix fragments (<mma.h>): a row-major, b column-major (b's
// element (k, n) at b[n * 16 + k]), c and d row-major fp32; `offset` elements into a (a
// misaligned operand when not a multiple of 16).
template <class T>
__global__ void wmma_kernel(float* d, const T* a, const T* b, const float* c, int offset) {
  namespace w = nvcuda::wmma;
  w::fragment<w::matrix_a, 16, 16, 16, T, w::row_major> fa;
  w::fragment<w::matrix_b, 16, 16, 16, T, w::col_major> fb;
  w::fragment<w::accumulator, 16, 16, 16, float> acc;
  w::load_matrix_sync(fa, a + offset, 16);
  w::load_matrix_sync(fb, b, 16);
  w::load_matrix_sync(acc, c, 16, w::mem_row_major);
  w::mma_sync(acc, fa, fb, acc);
  w::store_matrix_sync(d, acc, 16, w::mem_row_major);
}

// The emulated tensor-core product: each output c + sum over k in order of a b, the 16-bit
// operands widened, in fp32 (what a GPU's m16n16k16 computes, up to its own order), for bf16 and
// fp16; and an operand that is not 256-bit aligned stops the kernel, as the hardware faults.
// fp16 widened bit by bit (cuda_fp16.h, in place of libgcc's slow routine) equals the compiler's
// IEEE widening for every one of the 65536 halves: zeros, subnormals, normals, infinities, and
// each NaN quiet with its payload.
TEST(CudaEmu, HalvesWidenAsTheCompilersBinary16) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    _Float16 h;
    const auto bits = static_cast<uint16_t>(b);
    std::memcpy(&h, &bits, 2);
    const float want = static_cast<float>(h), got = __half2float(__ushort_as_half(bits));
    uint32_t w, g;
    std::memcpy(&w, &want, 4);
    std::memcpy(&g, &got, 4);
    ASSERT_EQ(g, w) << "half 0x" << std::hex << b;
  }
}

TEST(CudaEmu, WarpMatrixProductsAndTheirAlignment) {
  auto check = [](auto zero, auto to_16, auto to_float) {
    using T = decltype(zero);
    std::vector<T> a(256), b(256);
    std::vector<float> c(256);
    for (int i = 0; i < 256; ++i) {
      a[i] = to_16(static_cast<float>((i * 37) % 19) / 7.0f - 1.0f);
      b[i] = to_16(static_cast<float>((i * 11) % 23) / 9.0f - 1.2f);
      c[i] = static_cast<float>(i % 5) - 2.0f;
    }
    Buffer<T> da(256 + 16), db(256);
    Buffer<float> dc(256), dd(256);
    EXPECT_EQ(cudaMemcpy(da.d, a.data(), 256 * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(db.d, b.data(), 256 * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(dc.d, c.data(), 256 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    BT_LAUNCH(wmma_kernel<T>, 1, 32)(dd.d, da.d, db.d, dc.d, 0);
    const std::vector<float> got = dd.host();
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float want = c[m * 16 + n];
        for (int k = 0; k < 16; ++k)
          want = want + to_float(a[m * 16 + k]) * to_float(b[n * 16 + k]);
        EXPECT_EQ(got[m * 16 + n], want) << m << "," << n;
      }
    BT_LAUNCH(wmma_kernel<T>, 1, 32)(dd.d, da.d, db.d, dc.d, 1);
    const std::string e = failure_of_queued_work();
    EXPECT_NE(e.find("wmma_kernel<T>, block (0,0,0): thread 0 (warp 0, lane 0)"), std::string::npos)
        << e;
    EXPECT_NE(e.find("a wmma load or store at a pointer not 256-bit aligned"), std::string::npos)
        << e;
  };
  check(
      __nv_bfloat16{}, [](float x) { return __float2bfloat16_rn(x); },
      [](__nv_bfloat16 x) { return __bfloat162float(x); });
  check(
      __half{}, [](float x) { return __float2half_rn(x); },
      [](__half x) { return __half2float(x); });
}

// Lanes 16..31 return before the shuffle their partners wait in.
__global__ void early_exit_kernel(float* x) {
  if (threadIdx.x % 32 >= 16) return;
  x[threadIdx.x] = __shfl_xor_sync(kFull, x[threadIdx.x], 1);
}

TEST(CudaEmu, ALaneThatExitsBeforeACollectiveStopsTheKernel) {
  Buffer<float> x(32);
  BT_LAUNCH(early_exit_kernel, 1, 32)(x.d);
  const std::string e = failure_of_queued_work();
  EXPECT_NE(e.find("early_exit_kernel, block (0,0,0): thread 0 (warp 0, lane 0) waits in "
                   "__shfl_xor_sync with mask 0xffffffff for thread 16 (warp 0, lane 16), which "
                   "exited"),
            std::string::npos)
      << e;
}

// Lane 0 reads lane 16, which its mask leaves out.
__global__ void outside_mask_kernel(float* x) {
  if (threadIdx.x >= 16) return;
  x[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, x[threadIdx.x], 16);
}

TEST(CudaEmu, ASourceLaneOutsideTheMaskStopsTheKernel) {
  Buffer<float> x(32);
  BT_LAUNCH(outside_mask_kernel, 1, 32)(x.d);
  const std::string e = failure_of_queued_work();
  EXPECT_NE(e.find("reads lane 16, which the mask 0x0000ffff does not name"), std::string::npos)
      << e;
}

// Thread 0 returns before the barrier every other thread waits at.
__global__ void divergent_barrier_kernel(float* x) {
  if (threadIdx.x == 0) return;
  x[threadIdx.x] = 1.0f;
  __syncthreads();
}

TEST(CudaEmu, ABarrierAThreadNeverReachesStopsTheKernel) {
  Buffer<float> x(64);
  BT_LAUNCH(divergent_barrier_kernel, 2, 64)(x.d);
  const std::string e = failure_of_queued_work();
  EXPECT_NE(e.find("divergent_barrier_kernel, block (0,0,0): thread 1 (warp 0, lane 1) waits at "
                   "__syncthreads, which thread 0 (warp 0, lane 0) never reaches"),
            std::string::npos)
      << e;
}

// Even lanes shuffle with the full mask, odd ones with a mask that leaves lane 0 out.
__global__ void mismatched_masks_kernel(float* x) {
  const unsigned mask = threadIdx.x % 2 ? 0xfffffffeu : kFull;
  x[threadIdx.x] = __shfl_xor_sync(mask, x[threadIdx.x], 2);
}

TEST(CudaEmu, LanesInCollectivesOfDifferentMasksStopTheKernel) {
  Buffer<float> x(32);
  BT_LAUNCH(mismatched_masks_kernel, 1, 32)(x.d);
  const std::string e = failure_of_queued_work();
  EXPECT_NE(e.find("mismatched_masks_kernel, block (0,0,0): thread 0 (warp 0, lane 0) is in "
                   "__shfl_xor_sync with mask 0xffffffff while thread 1 (warp 0, lane 1) is in "
                   "__shfl_xor_sync with mask 0xfffffffe"),
            std::string::npos)
      << e;
}

__global__ void fill_kernel(float* x, float v, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = v;
}

TEST(CudaEmu, AnInvalidLaunchIsTheLastErrorAndQueuesNothing) {
  Buffer<float> x(4);
  BT_LAUNCH(fill_kernel, 1, 2048)(x.d, 1.0f, 4);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // not sticky
  BT_LAUNCH(fill_kernel, 0, 32)(x.d, 1.0f, 4);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(CudaEmu, CopiesPastAnAllocationAreRefused) {
  Buffer<float> x(4);
  std::vector<float> h(8, 1.0f);
  EXPECT_EQ(cudaMemcpy(x.d, h.data(), 8 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  const std::string e = cudaGetErrorString(cudaErrorInvalidValue);
  EXPECT_NE(e.find("its destination runs 16 bytes past its allocation of 16 bytes"),
            std::string::npos)
      << e;
  EXPECT_EQ(cudaMemcpy(h.data(), x.d, 4, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  cudaGetLastError();
}

TEST(CudaEmu, NewDeviceMemoryReadsAsNaN) {
  Buffer<float> x(3);
  for (float v : x.host()) EXPECT_TRUE(v != v);
}

// A kernel on one stream after a copy on another: without an event between them it reads what
// was there before (the late schedule runs the copy only when something waits for it); with
// cudaStreamWaitEvent it reads the copy.
TEST(CudaEmu, StreamsAreOrderedOnlyByWhatTheyWaitFor) {
  const char* s = std::getenv("CUDA_EMU_SCHEDULE");
  if (s && std::strcmp(s, "late") != 0)
    GTEST_SKIP() << "the late schedule's order (set: " << s << ")";
  Buffer<float> src(1), dst(1);
  float* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), sizeof(float), cudaHostAllocDefault),
            cudaSuccess);
  BT_LAUNCH(fill_kernel, 1, 1)(src.d, 0.0f, 1);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t copies;
  cudaEvent_t copied;
  ASSERT_EQ(cudaStreamCreateWithFlags(&copies, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), cudaSuccess);
  for (bool wait : {false, true}) {
    *pinned = wait ? 2.0f : 1.0f;
    ASSERT_EQ(cudaMemcpyAsync(src.d, pinned, sizeof(float), cudaMemcpyHostToDevice, copies),
              cudaSuccess);
    ASSERT_EQ(cudaEventRecord(copied, copies), cudaSuccess);
    if (wait) {
      ASSERT_EQ(cudaStreamWaitEvent(nullptr, copied, 0), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(dst.d, src.d, sizeof(float), cudaMemcpyDeviceToDevice, nullptr),
              cudaSuccess);
    EXPECT_EQ(dst.host()[0], wait ? 2.0f : 0.0f) << (wait ? "waited" : "did not wait");
    ASSERT_EQ(cudaStreamSynchronize(copies), cudaSuccess);
    EXPECT_EQ(src.host()[0], wait ? 2.0f : 1.0f);
  }
  cudaEventDestroy(copied);
  cudaStreamDestroy(copies);
  cudaFreeHost(pinned);
}

// A destroyed stream's work, events and the waits for it stay valid while other threads use the
// device (the race a two-rank NCCL test's teardown once hit: one rank's cudaFreeHost synchronizing
// the device whose stream the other rank destroyed), and its handle is refused afterwards.
TEST(CudaEmu, AStreamDestroyedWhileOthersUseTheDeviceStaysResolvable) {
  Buffer<float> x(256);
  std::atomic<bool> stop{false};
  std::thread syncer([&] {
    while (!stop.load()) EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  });
  cudaEvent_t done;
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  for (int k = 0; k < 200; ++k) {
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    BT_LAUNCH(fill_kernel, 1, 256, 0, s)(x.d, float(k), 256);
    ASSERT_EQ(cudaEventRecord(done, s), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(nullptr, done, 0), cudaSuccess);
    ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
    ASSERT_EQ(cudaEventQuery(done), cudaSuccess) << "its work completed as it was destroyed";
    ASSERT_EQ(cudaEventSynchronize(done), cudaSuccess);
    if (k == 199) {
      EXPECT_EQ(cudaStreamQuery(s), cudaErrorInvalidResourceHandle);
      EXPECT_EQ(cudaStreamDestroy(s), cudaErrorInvalidResourceHandle);
      EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
    }
  }
  stop = true;
  syncer.join();
  EXPECT_EQ(x.host()[255], 199.0f);
  cudaEventDestroy(done);
}

__global__ void doubled_kernel(float* y, const float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2.0f * x[i];
}

__global__ void scale_in_place_kernel(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= 2.0f;
}

// Stream capture: the work issued to a capturing stream is recorded, not run (the buffer keeps
// its value); each launch of the instantiated graph runs it in order, a copy from page-locked
// memory reading the host's value at the launch, the kernels' arguments those of the capture.
// The kernels count once, when captured; each launch counts as a graph launch.
TEST(CudaEmu, AStreamCaptureRecordsWorkThatEachGraphLaunchRuns) {
  Buffer<float> x(4);
  float* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), sizeof(float), cudaHostAllocDefault),
            cudaSuccess);
  BT_LAUNCH(fill_kernel, 1, 4)(x.d, 1.0f, 4);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  const cuda_emu::Counts before = cuda_emu::counts();
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  cudaStreamCaptureStatus status;
  ASSERT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  ASSERT_EQ(cudaMemcpyAsync(x.d + 3, pinned, sizeof(float), cudaMemcpyHostToDevice, s),
            cudaSuccess);
  BT_LAUNCH(scale_in_place_kernel, 1, 4, 0, s)(x.d, 4);
  BT_LAUNCH(scale_in_place_kernel, 1, 4, 0, s)(x.d, 3);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  EXPECT_EQ(x.host(), std::vector<float>(4, 1.0f)) << "captured work does not run";
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);  // (the executable graph keeps its work)
  for (float v : {5.0f, 7.0f}) {
    *pinned = v;
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  }
  EXPECT_EQ(x.host(), (std::vector<float>{16.0f, 16.0f, 16.0f, 14.0f}));
  const cuda_emu::Counts after = cuda_emu::counts();
  EXPECT_EQ(after.kernels - before.kernels, 2);
  EXPECT_EQ(after.graph_launches - before.graph_launches, 2);
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  cudaStreamDestroy(s);
  cudaFreeHost(pinned);
}

// What a capture forbids, each refused with CUDA's error and the capture invalidated (its end
// says which call broke it): an allocation, a synchronisation or query of the capturing stream,
// work on the legacy stream (which would order itself with the blocking stream), a copy of
// pageable memory (the host would wait for the stream), a wait for an event recorded outside the
// capture. An event recorded in the capture is the capture's: the host cannot query it.
TEST(CudaEmu, ACaptureRefusesWhatAGraphCannotHold) {
  Buffer<float> x(4);
  std::vector<float> pageable(4, 3.0f);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  cudaEvent_t outside, inside;
  ASSERT_EQ(cudaEventCreateWithFlags(&outside, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&inside, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(outside, nullptr), cudaSuccess);
  struct Case {
    const char* name;
    std::function<cudaError_t()> call;
    cudaError_t error;
    const char* reason;
  };
  const Case cases[] = {
      {"cudaMalloc",
       [] {
         void* p = nullptr;
         return cudaMalloc(&p, 16);
       },
       cudaErrorStreamCaptureUnsupported, "cudaMalloc while this thread's stream captured"},
      {"cudaStreamSynchronize", [&] { return cudaStreamSynchronize(s); },
       cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize on the capturing stream"},
      {"cudaStreamQuery", [&] { return cudaStreamQuery(s); }, cudaErrorStreamCaptureUnsupported,
       "cudaStreamQuery on the capturing stream"},
      {"the legacy stream",
       [&] {
         BT_LAUNCH(fill_kernel, 1, 4)(x.d, 2.0f, 4);
         return cudaGetLastError();
       },
       cudaErrorStreamCaptureImplicit, "fill_kernel on the legacy stream"},
      {"cudaMemcpy", [&] { return cudaMemcpy(x.d, pageable.data(), 16, cudaMemcpyHostToDevice); },
       cudaErrorStreamCaptureUnsupported, "cudaMemcpy while this thread's stream captured"},
      {"a pageable copy",
       [&] { return cudaMemcpyAsync(x.d, pageable.data(), 16, cudaMemcpyHostToDevice, s); },
       cudaErrorStreamCaptureUnsupported, "cudaMemcpyAsync of pageable host memory"},
      {"an outside event", [&] { return cudaStreamWaitEvent(s, outside, 0); },
       cudaErrorStreamCaptureIsolation, "a wait for an event recorded outside the capture"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    BT_LAUNCH(fill_kernel, 1, 4, 0, s)(x.d, 1.0f, 4);
    EXPECT_EQ(c.call(), c.error);
    cudaGetLastError();
    cudaStreamCaptureStatus status;
    ASSERT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusInvalidated);
    BT_LAUNCH(fill_kernel, 1, 4, 0, s)(x.d, 1.0f, 4);
    EXPECT_EQ(cudaGetLastError(), cudaErrorStreamCaptureInvalidated);
    cudaGraph_t graph;
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(graph, nullptr);
    const std::string why = cudaGetErrorString(cudaErrorStreamCaptureInvalidated);
    EXPECT_NE(why.find(c.reason), std::string::npos) << why;
  }
  // An event of the capture: its own stream may wait for it, the host may not query it.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(inside, s), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(s, inside, 0), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(inside), cudaErrorCapturedEvent);
  EXPECT_EQ(cudaEventSynchronize(inside), cudaErrorCapturedEvent);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphDestroy(graph);
  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal),
            cudaErrorStreamCaptureUnsupported)
      << "the legacy stream cannot capture";
  cudaGetLastError();
  for (float v : x.host()) EXPECT_TRUE(v != v) << "nothing captured or refused ran";
  ASSERT_EQ(cudaEventRecord(inside, s), cudaSuccess);  // recorded outside again: the host's
  EXPECT_EQ(cudaEventSynchronize(inside), cudaSuccess);
  cudaEventDestroy(outside);
  cudaEventDestroy(inside);
  cudaStreamDestroy(s);
}

// A kernel that fails inside a graph's launch fails as it does alone: the device's sticky error,
// its message naming the kernel.
TEST(CudaEmu, AKernelThatFailsInAGraphNamesItself) {
  Buffer<float> x(32);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  BT_LAUNCH(fill_kernel, 1, 32, 0, s)(x.d, 1.0f, 32);
  BT_LAUNCH(early_exit_kernel, 1, 32, 0, s)(x.d);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  EXPECT_NE(failure_of_queued_work().find("early_exit_kernel"), std::string::npos);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// Touch counting (cuda_emu/counts.h): the pages each kernel reads and writes, by its name. 1 MiB
// buffers are 256 pages: y = 2x reads x's 256 and writes y's 256; over the first 1000 floats
// only, one page of each (1000 x 4 bytes < 4096); in place, x's 256 pages read and written; a
// buffer allocated before counting began is not counted; a fill writes without reading; a warp's
// tensor-core operation counts its 2 M N K once. The values are the kernels' as ever, and
// counting off counts nothing.
TEST(CudaEmu, TouchCountingCountsThePagesEachKernelReadsAndWrites) {
  Buffer<float> before(1 << 18);
  cuda_emu::set_touch_counting(true);
  cuda_emu::reset_touched();
  const int n = 1 << 18;  // 1 MiB of floats
  {
    Buffer<float> x(n), y(n);
    BT_LAUNCH(fill_kernel, n / 256, 256)(x.d, 1.5f, n);
    BT_LAUNCH(doubled_kernel, n / 256, 256)(y.d, x.d, n);
    BT_LAUNCH(doubled_kernel, 4, 256)(y.d, x.d, 1000);
    BT_LAUNCH(scale_in_place_kernel, n / 256, 256)(x.d, n);
    BT_LAUNCH(fill_kernel, n / 256, 256)(before.d, 2.0f, n);
    Buffer<__nv_bfloat16> a16(256), b16(256);
    Buffer<float> c16(256), d16(256);
    BT_LAUNCH(wmma_kernel<__nv_bfloat16>, 3, 64)(d16.d, a16.d, b16.d, c16.d, 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(y.host()[n - 1], 3.0f);
    EXPECT_EQ(x.host()[0], 3.0f);
    const std::map<std::string, cuda_emu::Touched> t = cuda_emu::touched();
    ASSERT_EQ(t.count("doubled_kernel"), 1u);
    const cuda_emu::Touched& d = t.at("doubled_kernel");
    EXPECT_EQ(d.launches, 2);
    EXPECT_EQ(d.pages_read, 256 + 1);
    EXPECT_EQ(d.pages_written, 256 + 1);
    const cuda_emu::Touched& s = t.at("scale_in_place_kernel");
    EXPECT_EQ(s.pages_read, 256);
    EXPECT_EQ(s.pages_written, 256);
    const cuda_emu::Touched& f = t.at("fill_kernel");
    EXPECT_EQ(f.launches, 2);
    EXPECT_EQ(f.pages_read, 0);
    EXPECT_EQ(f.pages_written, 256) << "x's; `before` was allocated before counting began";
    EXPECT_EQ(f.flops, 0);
    // 3 blocks of 2 warps, each warp one 16 x 16 x 16 tensor-core operation: counted a warp's
    // once, not once a lane.
    ASSERT_EQ(t.count("wmma_kernel<__nv_bfloat16>"), 1u);
    EXPECT_EQ(t.at("wmma_kernel<__nv_bfloat16>").flops, 3 * 2 * 2.0 * 16 * 16 * 16);
  }
  cuda_emu::set_touch_counting(false);
  cuda_emu::reset_touched();
  Buffer<float> z(n);
  BT_LAUNCH(fill_kernel, n / 256, 256)(z.d, 1.0f, n);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(cuda_emu::touched().empty());
}

// cuBLASLt with a 16-bit output (D of the bf16 operands' type): the fp32 sum with the bias added,
// rounded to nearest even; the bias of the output's type (cuBLASLt's rule outside its integer and
// fp8 kernels: an fp32 bias with a bf16 output finds no algorithm, as on a GPU).
TEST(CudaEmu, CublasLtWrites16BitOutputsWithABiasOfTheirType) {
  auto bf16 = [](float v) {  // (exact for these values)
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  // Column-major D (2 x 2) = A (2 x 1) . B (1 x 2) + bias: A = [1, 1 + 2^-7], B = [1, 2],
  // bias = [2^-8, 2^-8]: D's first column 1 + 2^-8 and 1 + 3 2^-8, halfway between bf16's
  // neighbours (2^-7 apart in [1, 2)): to the even ones, 1 and 1 + 2^-6; the second 2 + 2^-8 and
  // 2 + 2^-6 + 2^-8 (2^-6 apart in [2, 4)): 2 and 2 + 2^-6.
  Buffer<uint16_t> a(2), b(2), bias(2), d(4);
  const uint16_t ha[] = {bf16(1.0f), bf16(1.0078125f)}, hb[] = {bf16(1.0f), bf16(2.0f)},
                 hbias[] = {bf16(0.00390625f), bf16(0.00390625f)};
  ASSERT_EQ(cudaMemcpy(a.d, ha, 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b.d, hb, 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(bias.d, hbias, 4, cudaMemcpyHostToDevice), cudaSuccess);
  cublasLtHandle_t h;
  ASSERT_EQ(cublasLtCreate(&h), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulDesc_t op;
  ASSERT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
  const void* bias_ptr = bias.d;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                           sizeof bias_ptr),
            CUBLAS_STATUS_SUCCESS);
  cublasLtMatrixLayout_t la, lb, ld;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, 2, 1, 2), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, 1, 2, 1), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, 2, 2, 2), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulPreference_t pref;
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  const float one = 1.0f, zero = 0.0f;
  // The bias type left at its default (D's type): bf16.
  ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &r, &found),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(found, 1);
  ASSERT_EQ(cublasLtMatmul(h, op, &one, a.d, la, b.d, lb, &zero, d.d, ld, d.d, ld, &r.algo, nullptr,
                           0, nullptr),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> want = {bf16(1.0f), bf16(1.015625f), bf16(2.0f), bf16(2.015625f)};
  EXPECT_EQ(d.host(), want) << "halfway sums round to the even neighbour";
  // An fp32 bias with the bf16 output: no algorithm.
  const cudaDataType_t f32 = CUDA_R_32F;
  ASSERT_EQ(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &f32, sizeof f32),
      CUBLAS_STATUS_SUCCESS);
  EXPECT_NE(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &r, &found),
            CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulPreferenceDestroy(pref);
  for (cublasLtMatrixLayout_t l : {la, lb, ld}) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(h);
}

}  // namespace
