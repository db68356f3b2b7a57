// The CUDA backend: kernels/backend.h's table filled with this directory's kernels and cuBLAS /
// cuBLASLt products, which take the interface's own operands and dispatch on the precision each
// in one place (matmul.cu, attention.cu, elementwise.cu), as the CPU's do (kernels/cpu/), so that
// a model computes the same thing on either; FP16's products take fp16 operands here
// (Target::fp16_operands), as BF16's take bf16 ones. The backend adds its device's memory, input
// staging, streams and the per-operation profile. Pointers are device memory; kernels run on the
// kernels' stream (compute_stream), in order.
#include <cuda_fp16.h>

#include <algorithm>
#include <map>
#include <optional>
#include <vector>

#include "core/arena.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/lanes.cuh"
#include "kernels/cuda/profile.cuh"

namespace bertrain::cuda {

namespace rm = kernels::row_math;
using kernels::Activation;
using kernels::AttentionShape;
using kernels::Dropout;
using kernels::Kept;

namespace {

__global__ void tanh_forward_kernel(float* out, const float* in, int64_t n) {
  BT_FOR_EACH(n);
  out[i] = tanhf(in[i]);
}

__global__ void tanh_backward_kernel(float* dinp, const float* out, const float* dout, int64_t n) {
  BT_FOR_EACH(n);
  dinp[i] = dout[i] * (1.0f - out[i] * out[i]);
}

__global__ void add_inplace_kernel(float* out, const float* a, int64_t n) {
  BT_FOR_EACH(n);
  out[i] += a[i];
}

// Embedding backward over the tokens grouped by table row (kernels::RowRuns): a block per chunk
// (blockIdx.x), its channels over threads, then a block per table row of several chunks adding
// their partial rows in order. Deterministic, no atomics; rows of one chunk get the CPU's sums.
__global__ void embedding_chunks_kernel(float* table, float* partial, kernels::RowRuns r,
                                        const float* dout, int64_t C) {
  if (r.counts && blockIdx.x >= static_cast<unsigned>(r.counts[0])) return;  // (a bound's grid)
  const kernels::EmbeddingChunk k = r.chunks[blockIdx.x];
  for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < C;
       c += static_cast<int64_t>(gridDim.y) * blockDim.x)
    rm::embedding_chunk(table, partial, k, r.order, dout, C, c);
}

__global__ void embedding_sums_kernel(float* table, const float* partial, kernels::RowRuns r,
                                      int64_t C) {
  if (r.counts && blockIdx.x >= static_cast<unsigned>(r.counts[1])) return;
  const kernels::EmbeddingSum s = r.sums[blockIdx.x];
  for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < C;
       c += static_cast<int64_t>(gridDim.y) * blockDim.x)
    rm::embedding_partials_sum(table, partial, s, C, c);
}

void embedding_table_backward(float* table, const kernels::RowRuns& r, const float* dout,
                              int64_t C) {
  if (r.num_chunks == 0) return;
  constexpr unsigned kThreads = 128;
  const unsigned y = static_cast<unsigned>((C + kThreads - 1) / kThreads);
  auto* partial = r.partials > 0
                      ? static_cast<float*>(scratch(kEmbeddingSlot, r.partials * C * sizeof(float)))
                      : nullptr;
  BT_LAUNCH(embedding_chunks_kernel, dim3(static_cast<unsigned>(r.num_chunks), y), kThreads, 0,
            compute_stream())
  (table, partial, r, dout, C);
  BT_CUDA_CHECK(cudaGetLastError());
  if (r.num_sums == 0) return;
  BT_LAUNCH(embedding_sums_kernel, dim3(static_cast<unsigned>(r.num_sums), y), kThreads, 0,
            compute_stream())
  (table, partial, r, C);
  BT_CUDA_CHECK(cudaGetLastError());
}

__device__ inline int64_t seq_row(int64_t r, const int32_t* positions, int64_t P, int64_t T) {
  return (r / P) * T + (positions ? positions[r] : 0);
}

__global__ void gather_rows_kernel(float* out, const float* seq, const int32_t* positions,
                                   int64_t B, int64_t P, int64_t T, int64_t C) {
  BT_FOR_EACH(B * P * C);
  const int64_t r = i / C, c = i % C;
  out[i] = seq[seq_row(r, positions, P, T) * C + c];
}

// A thread per (sequence, channel): repeated positions of a sequence add in order.
__global__ void scatter_add_rows_kernel(float* dseq, const float* d, const int32_t* positions,
                                        int64_t B, int64_t P, int64_t T, int64_t C) {
  BT_FOR_EACH(B * C);
  const int64_t b = i / C, c = i % C;
  for (int64_t j = 0; j < P; ++j) {
    const int64_t r = b * P + j;
    dseq[seq_row(r, positions, P, T) * C + c] += d[r * C + c];
  }
}

// Each row's squared error in double, as the CPU backend sums them.
__global__ void squared_error_kernel(float* dpred, double* sq, const float* pred,
                                     const float* target, int64_t n, kernels::Multiplier dscale) {
  BT_FOR_EACH(n);
  const float d = pred[i] - target[i];
  sq[i] = static_cast<double>(d) * d;
  if (dpred) dpred[i] = dscale.value() * 2.0f * d;
}

// The squared errors' sum (in row order, one thread: the host's bits) / the divisor into `into`.
__global__ void add_squared_errors_kernel(const double* sq, int64_t n, kernels::SumsInto into) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += sq[i];
  const double l = sum / into.divisor();
  if (into.loss) *into.loss += l;
  if (into.nonfinite && !isfinite(l)) *into.nonfinite += 1.0;
}

// The batches' copies into the models' input slots (Backend::upload), on the calling thread's
// current GPU (one thread may run several GPUs in turn: a test's ranks): on a stream of their
// own, non-blocking (it waits for no other stream's work), so a copy runs beside the kernels. Each
// slot has two events: its last copy (kernels issued after use_input wait for it) and its last
// release (its next copy waits for it). An event waited for before its first record counts as
// complete.
struct InputSlot {
  cudaEvent_t copied = nullptr, released = nullptr;
};
struct Uploads {
  cudaStream_t stream = nullptr;
  std::map<const void*, InputSlot> slots;
  InputSlot& slot(const void* p) {
    InputSlot& s = slots[p];
    if (!s.copied) {
      BT_CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
      BT_CUDA_CHECK(cudaEventCreateWithFlags(&s.released, cudaEventDisableTiming));
    }
    return s;
  }
};
Uploads& uploads() {
  thread_local struct PerDevice {
    std::map<int, Uploads> of;
    ~PerDevice() {
      for (auto& [device, u] : of) {
        for (auto& [p, s] : u.slots) {
          cudaEventDestroy(s.copied);
          cudaEventDestroy(s.released);
        }
        if (u.stream) {
          count_host_sync();
          cudaStreamDestroy(u.stream);
        }
      }
    }
  } d;
  int device = 0;
  BT_CUDA_CHECK(cudaGetDevice(&device));
  Uploads& u = d.of[device];
  if (!u.stream) BT_CUDA_CHECK(cudaStreamCreateWithFlags(&u.stream, cudaStreamNonBlocking));
  return u;
}

// The calling thread's phase marks (Backend::mark: a ring of timing events, mark i in
// event[i % kMarks]) and the event behind its last to_host_async.
struct HostSide {
  cudaEvent_t marks[kernels::Backend::kMarks] = {};
  int64_t next = 0;
  cudaEvent_t copied = nullptr;
  HostSide() = default;
  HostSide(const HostSide&) = delete;
  HostSide& operator=(const HostSide&) = delete;
  ~HostSide() {  // (the thread's end)
    for (cudaEvent_t e : marks)
      if (e) cudaEventDestroy(e);
    if (copied) cudaEventDestroy(copied);
  }
};
thread_local HostSide t_host_side;

// An instantiated CUDA graph and the launches it holds (Backend::end_capture).
struct Graph {
  cudaGraphExec_t exec = nullptr;
  int64_t kernels = 0;
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() {
    if (exec) cudaGraphExecDestroy(exec);
  }
};

class CudaBackend final : public kernels::Backend {
 public:
  const char* name() const override { return "cuda"; }
  bool fp16_operands() const override { return true; }

  bool host_memory() const override { return false; }
  void* allocate(size_t bytes) const override {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_bytes = 0, total = 0;
      cudaMemGetInfo(&free_bytes, &total);
      fail("out of GPU memory: ", human_bytes(static_cast<double>(bytes)), " asked for, ",
           human_bytes(static_cast<double>(free_bytes)), " of ",
           human_bytes(static_cast<double>(total)), " free (", cudaGetErrorString(e), ")");
    }
    BT_CUDA_WAIT(cudaMemset(p, 0, bytes));
    return p;
  }
  void release(void* p) const override {
    if (!p) return;
    count_free();
    cudaFree(p);
  }
  void to_device(void* dst, const void* src, size_t bytes) const override {
    const Op op("to_device");
    BT_CUDA_WAIT(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  void to_host(void* dst, const void* src, size_t bytes) const override {
    const Op op("to_host");
    BT_CUDA_WAIT(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
  void* allocate_host(size_t bytes) const override {
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault);
    if (e != cudaSuccess)
      fail("cannot lock ", bytes, " bytes of host memory for the batch's copy to the GPU (",
           cudaGetErrorString(e), "): raise the memory lock limit (ulimit -l) or free host memory");
    return p;
  }
  void release_host(void* p) const override {
    if (!p) return;
    count_host_sync();
    cudaFreeHost(p);
  }
  // The input slots (uploads() above): the host waits only in wait_upload.
  void upload(void* slot, const void* src, size_t bytes) const override {
    Uploads& u = uploads();
    const InputSlot& s = u.slot(slot);
    BT_CUDA_CHECK(cudaStreamWaitEvent(u.stream, s.released, 0));
    BT_CUDA_CHECK(cudaMemcpyAsync(slot, src, bytes, cudaMemcpyHostToDevice, u.stream));
    BT_CUDA_CHECK(cudaEventRecord(s.copied, u.stream));
  }
  void use_input(const void* slot) const override {
    BT_CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), uploads().slot(slot).copied, 0));
  }
  void release_input(const void* slot) const override {
    BT_CUDA_CHECK(cudaEventRecord(uploads().slot(slot).released, compute_stream()));
  }
  void wait_upload(const void* slot) const override {
    const cudaEvent_t copied = uploads().slot(slot).copied;
    if (!done(cudaEventQuery(copied)))  // (a copy long done: no blocking call)
      BT_CUDA_WAIT_AHEAD(cudaEventSynchronize(copied));
  }
  // The kernels' stream only (compute_stream; the copy and NCCL streams are non-blocking): a step's
  // backward phase ends when its kernels have run, not when the gradient bucket NCCL is reducing
  // beside them has (that wait is the reducer's: exposed communication). (Where the stream has
  // already run everything, say after forward's loss read, the query says so and the host does not
  // block.)
  void synchronize() const override {
    if (!done(cudaStreamQuery(compute_stream())))
      BT_CUDA_WAIT(cudaStreamSynchronize(compute_stream()));
  }
  void* queue() const override { return compute_stream(); }
  bool busy() const override { return !done(cudaStreamQuery(compute_stream())); }
  int64_t mark() const override {
    HostSide& h = t_host_side;
    cudaEvent_t& e = h.marks[h.next % kMarks];
    if (!e) BT_CUDA_CHECK(cudaEventCreate(&e));
    BT_CUDA_CHECK(cudaEventRecord(e, compute_stream()));
    return h.next++;
  }
  double seconds_between(int64_t a, int64_t b) const override {
    const HostSide& h = t_host_side;
    for (int64_t m : {a, b})
      BT_CHECK(m >= 0 && m < h.next && h.next - m <= kMarks, "seconds_between: mark ", m,
               " is not one of this thread's last ", kMarks, " (", h.next, " made)");
    cudaEvent_t end = h.marks[b % kMarks];
    if (!done(cudaEventQuery(end))) BT_CUDA_WAIT(cudaEventSynchronize(end));
    float ms = 0;
    BT_CUDA_CHECK(cudaEventElapsedTime(&ms, h.marks[a % kMarks], end));
    return 1e-3 * ms;
  }
  void to_host_async(void* dst, const void* src, size_t bytes) const override {
    const Op op("to_host_async");
    HostSide& h = t_host_side;
    if (!h.copied) BT_CUDA_CHECK(cudaEventCreateWithFlags(&h.copied, cudaEventDisableTiming));
    BT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, compute_stream()));
    BT_CUDA_CHECK(cudaEventRecord(h.copied, compute_stream()));
  }
  void wait_to_host() const override {
    const HostSide& h = t_host_side;
    if (h.copied && !done(cudaEventQuery(h.copied))) BT_CUDA_WAIT(cudaEventSynchronize(h.copied));
  }
  void send(void* dst, const void* src, size_t bytes) const override {
    const Op op("send");
    cuda::send(dst, src, bytes);
  }

  // CUDA graphs by stream capture on the kernels' stream. Thread-local mode: this thread may
  // not allocate, free or wait for the device meanwhile (each is an error that names itself and
  // ends the capture); other threads may.
  bool graphs() const override { return true; }
  void begin_capture() const override {
    BT_CUDA_CHECK(cudaStreamBeginCapture(compute_stream(), cudaStreamCaptureModeThreadLocal));
    set_capturing(true);
  }
  std::shared_ptr<void> end_capture() const override {
    set_capturing(false);
    cudaGraph_t graph = nullptr;
    const cudaError_t e = cudaStreamEndCapture(compute_stream(), &graph);
    if (e != cudaSuccess)
      fail("a step's capture as a CUDA graph failed: ", cudaGetErrorString(e),
           " (run with --cuda-graphs off, and report it: a step's work must not wait for the "
           "device, allocate or free)");
    auto g = std::make_shared<Graph>();
    g->kernels = captured_launches();
    const cudaError_t i = cudaGraphInstantiate(&g->exec, graph, 0);
    cudaGraphDestroy(graph);
    BT_CUDA_CHECK(i);
    return g;
  }
  void launch_graph(const std::shared_ptr<void>& graph) const override {
    const Op op("graph");
    const auto* g = static_cast<const Graph*>(graph.get());
    BT_CUDA_CHECK(cudaGraphLaunch(g->exec, compute_stream()));
    count_graph_launch(g->kernels);
    forget_device_records();  // (its pointer tables were made where the host kept others)
  }
  std::string op_profile(int64_t steps) const override { return profile_table(steps); }
  std::optional<kernels::DeviceCounts> device_counts() const override {
    return cuda::device_counts();
  }

  std::optional<kernels::DeviceMemory> device_memory() const override {
    kernels::DeviceMemory m;
    BT_CUDA_CHECK(cudaMemGetInfo(&m.free, &m.total));
    return m;
  }

  // The kernels' scratch from the model's plan (scratch.h: cuBLASLt's workspace, attention's
  // score buffers, the reductions' partial sums); unbound, buffers of their own.
  kernels::ScratchLayout scratch_layout(const kernels::KernelShapes& k) const override {
    return cuda::scratch_layout(k);
  }
  void bind_scratch(void* region, const kernels::ScratchLayout& layout) const override {
    cuda::bind_scratch(region, layout);
  }
  int64_t unplanned_scratch_bytes() const override { return cuda::unplanned_scratch_bytes(); }

  std::string description() const override {
    return cuda::device_name() + " (CUDA backend, cuBLASLt)";
  }
  std::string device_name() const override { return cuda::device_name(); }
  double gemm_peak_gflops(Precision p, int64_t M, int64_t N, int64_t K,
                          double seconds) const override {
    return 1e3 * gemm_tflops(p, M, N, K, seconds);
  }

  void round_to_16(Precision p, uint16_t* dst, const float* src, int64_t n,
                   void* queue) const override {
    cuda::round_to_16(p, dst, src, n, queue);
  }
  void widen_from_16(Precision p, float* dst, const uint16_t* src, int64_t n,
                     void* queue) const override {
    cuda::widen_from_16(p, dst, src, n, queue);
  }
  void scale_on(float* x, int64_t n, float s, void* queue) const override {
    cuda::scale(x, n, s, queue);
  }

  void linear_forward(Precision p, float* out, Kept in, kernels::Weight w, const float* bias,
                      int64_t M, int64_t N, int64_t K,
                      const kernels::Workspace& ws) const override {
    const Op op("linear_forward");
    cuda::linear_forward(p, out, in, w, bias, M, N, K, ws);
  }
  void linear_forward_16(Precision p, uint16_t* out16, Kept in, kernels::Weight w,
                         const uint16_t* bias16, int64_t M, int64_t N, int64_t K,
                         const kernels::Workspace& ws) const override {
    const Op op("linear_forward");
    cuda::linear_forward_16(p, out16, in, w, bias16, M, N, K, ws);
  }
  bool writes_16bit_outputs() const override { return cuda::target().writes_16bit_outputs(); }
  void linear_backward(Precision p, float* dinp, float* dw, float* db, kernels::KeptIn dout,
                       Kept in, kernels::Weight w, int64_t M, int64_t N, int64_t K,
                       bool accumulate_dinp, const kernels::Workspace& ws) const override {
    const Op op("linear_backward");
    cuda::linear_backward(p, dinp, dw, db, dout, in, w, M, N, K, accumulate_dinp, ws);
  }
  void linear_backward_16(Precision p, uint16_t* dinp16, float* dw, float* db, kernels::KeptIn dout,
                          Kept in, kernels::Weight w, int64_t M, int64_t N, int64_t K,
                          const kernels::Workspace& ws) const override {
    const Op op("linear_backward");
    cuda::linear_backward_16(p, dinp16, dw, db, dout, in, w, M, N, K, ws);
  }
  void keep(Precision p, Kept x, int64_t n) const override {
    const Op op("keep");
    cuda::keep(p, x, n);
  }
  void copy_weights(Precision p, const float* master, uint16_t* copy, int64_t n) const override {
    const Op op("copy_weights");
    if (p != Precision::FP32) round_to_16(p, copy, master, n, nullptr);
  }
  void attention_forward(Precision p, Kept ctx, kernels::AttentionSaved saved, Kept qkv,
                         const int32_t* mask, const AttentionShape& s, const Dropout& d,
                         const kernels::Workspace& ws) const override {
    const Op op("attention_forward");
    cuda::attention_forward(p, ctx, saved, qkv, mask, s, d, ws);
  }
  // (the target's answers: scratch.cpp)
  bool prefers_full_attention(Precision p, int64_t seq_len) const override {
    return cuda::target().prefers_full_attention(p, seq_len);
  }
  bool fused_attention(Precision p, const kernels::AttentionShape& s) const override {
    return cuda::target().fused_attention(p, s);
  }
  void attention_backward(Precision p, float* dqkv, const float* dctx, Kept qkv,
                          kernels::AttentionSaved saved, const int32_t* mask,
                          const AttentionShape& s, const Dropout& d,
                          const kernels::Workspace& ws) const override {
    const Op op("attention_backward");
    cuda::attention_backward(p, Kept{dqkv}, nullptr, dctx, qkv, saved, mask, s, d, ws);
  }
  void attention_bias_backward(Precision p, Kept dqkv, float* dbias, kernels::KeptIn dctx, Kept qkv,
                               kernels::AttentionSaved saved, const int32_t* mask,
                               const AttentionShape& s, const Dropout& d,
                               const kernels::Workspace& ws) const override {
    const Op op("attention_bias_backward");
    cuda::attention_backward(p, dqkv, dbias, dctx, qkv, saved, mask, s, d, ws);
  }
  void activation_forward(Precision p, Activation a, Kept out, Kept in, int64_t n) const override {
    const Op op("activation_forward");
    cuda::activation_forward(p, a, out, in, n);
  }
  void activation_backward(Precision p, Activation a, float* dinp, Kept in, const float* dout,
                           int64_t n) const override {
    const Op op("activation_backward");
    cuda::activation_backward(p, a, dinp, in, dout, n);
  }

  void activation_bias_backward(Precision p, Activation a, Kept dinp, float* db, Kept in,
                                kernels::KeptIn dout, int64_t M, int64_t N) const override {
    const Op op("activation_bias_backward");
    cuda::activation_bias_backward(p, a, dinp, db, in, dout, M, N);
  }

  void rounded_column_sums(Precision p, float* db, Kept x, int64_t M, int64_t N) const override {
    const Op op("rounded_column_sums");
    cuda::rounded_column_sums(p, db, x.f32, p != Precision::FP32 ? x.bits : nullptr, M, N);
  }

  void tanh_forward(float* out, const float* in, int64_t n) const override {
    const Op op("tanh_forward");
    BT_EACH(tanh_forward_kernel, n, out, in, n);
  }
  void tanh_backward(float* dinp, const float* out, const float* dout, int64_t n) const override {
    const Op op("tanh_backward");
    BT_EACH(tanh_backward_kernel, n, dinp, out, dout, n);
  }

  void embedding_layernorm_forward(float* out, float* sum, float* mean, float* rstd,
                                   const int32_t* ids, const int32_t* segment,
                                   const int32_t* positions, const float* word,
                                   const float* position, const float* token_type,
                                   const float* gamma, const float* beta, int64_t B, int64_t T,
                                   int64_t C, float eps, const Dropout& d) const override {
    const Op op("embedding_layernorm_forward");
    cuda::embedding_layernorm_forward(out, sum, mean, rstd, ids, segment, positions, word, position,
                                      token_type, gamma, beta, B, T, C, eps, d);
  }
  void embedding_backward(float* dword, float* dposition, float* dtoken_type, const float* dout,
                          const int32_t* ids, const int32_t* segment, const int32_t* positions,
                          int64_t B, int64_t T, int64_t C,
                          const kernels::EmbeddingRuns* runs) const override {
    const Op op("embedding_backward");
    (void)ids, (void)segment, (void)positions, (void)B, (void)T;  // grouped in `runs`
    BT_CHECK(runs,
             "embedding backward on the GPU sums by the tokens grouped by table row "
             "(kernels::EmbeddingRuns, which BertModel stages with the batch)");
    embedding_table_backward(dword, runs->word, dout, C);
    embedding_table_backward(dposition, runs->position, dout, C);
    embedding_table_backward(dtoken_type, runs->token_type, dout, C);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* in, const float* gamma,
                         const float* beta, int64_t N, int64_t C, float eps) const override {
    const Op op("layernorm_forward");
    cuda::layernorm_forward(out, mean, rstd, in, gamma, beta, N, C, eps);
  }
  void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                          const float* in, const float* gamma, const float* mean, const float* rstd,
                          int64_t N, int64_t C) const override {
    const Op op("layernorm_backward");
    cuda::layernorm_backward(dinp, dgamma, dbeta, dout, in, gamma, mean, rstd, N, C);
  }
  void residual_layernorm_forward(Precision p, Kept out, float* mean, float* rstd, float* x,
                                  const float* residual, const float* gamma, const float* beta,
                                  int64_t N, int64_t C, float eps,
                                  const Dropout& d) const override {
    const Op op("residual_layernorm_forward");
    cuda::residual_layernorm_forward(p, out, mean, rstd, x, residual, gamma, beta, N, C, eps, d);
  }
  void residual_layernorm_forward_16(Precision p, Kept out, float* mean, float* rstd, float* x,
                                     const uint16_t* y16, const float* residual, const float* gamma,
                                     const float* beta, int64_t N, int64_t C, float eps,
                                     const Dropout& d) const override {
    BT_CHECK(p != Precision::FP32 && y16, "residual_layernorm_forward_16: ", precision_name(p),
             ", the projection's 16-bit output ", y16 ? "given" : "missing");
    const Op op("residual_layernorm_forward");
    cuda::residual_layernorm_forward(p, out, mean, rstd, x, residual, gamma, beta, N, C, eps, d,
                                     nullptr, y16);
  }
  void layernorm_dropout_backward(Precision p, float* dinp, Kept ddropped, float* dgamma,
                                  float* dbeta, float* dbias, const float* dout, const float* in,
                                  const float* gamma, const float* mean, const float* rstd,
                                  int64_t N, int64_t C, bool accumulate_dinp,
                                  const Dropout& d) const override {
    const Op op("layernorm_dropout_backward");
    cuda::layernorm_dropout_backward(p, dinp, ddropped, dgamma, dbeta, dbias, dout, in, gamma, mean,
                                     rstd, N, C, accumulate_dinp, d);
  }

  void dropout_forward(float* x, int64_t N, int64_t C, const Dropout& d) const override {
    const Op op("dropout_forward");
    cuda::dropout_forward(x, N, C, d);
  }
  void dropout_backward(float* dx, const float* dy, int64_t N, int64_t C,
                        const Dropout& d) const override {
    const Op op("dropout_backward");
    cuda::dropout_backward(dx, dy, N, C, d);
  }
  void add_inplace(float* out, const float* a, int64_t n) const override {
    const Op op("add_inplace");
    BT_EACH(add_inplace_kernel, n, out, a, n);
  }
  void copy(float* dst, const float* src, int64_t n) const override {
    const Op op("copy");
    if (n > 0)
      BT_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, compute_stream()));
  }
  void gather_rows(float* out, const float* seq, const int32_t* positions, int64_t B, int64_t P,
                   int64_t T, int64_t C) const override {
    const Op op("gather_rows");
    BT_EACH(gather_rows_kernel, B * P * C, out, seq, positions, B, P, T, C);
  }
  void scatter_add_rows(float* dseq, const float* d, const int32_t* positions, int64_t B, int64_t P,
                        int64_t T, int64_t C) const override {
    const Op op("scatter_add_rows");
    BT_EACH(scatter_add_rows_kernel, B * C, dseq, d, positions, B, P, T, C);
  }
  void scale_inplace(float* x, int64_t n, kernels::Multiplier s) const override {
    const Op op("scale_inplace");
    cuda::scale(x, n, s);
  }
  void zero(void* p, int64_t bytes) const override {
    const Op op("zero");
    if (bytes > 0)
      BT_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(bytes), compute_stream()));
  }

  kernels::CrossEntropySums cross_entropy(float* dlogits, float* losses, int32_t* correct,
                                          const float* logits, const int32_t* targets,
                                          const float* weights, int64_t N, kernels::Classes c,
                                          kernels::Multiplier dscale) const override {
    const Op op("cross_entropy");
    kernels::CrossEntropySums s =
        cuda::cross_entropy(dlogits, losses, correct, logits, targets, weights, N, c, dscale,
                            nullptr, /*sums=*/losses != nullptr);
    if (!correct) s.correct = 0;  // as the CPU: the hits only where asked for
    return s;
  }

  void cross_entropy_into(const kernels::SumsInto& into, float* dlogits, float* losses,
                          int32_t* correct, const float* logits, const int32_t* targets,
                          const float* weights, int64_t N, kernels::Classes c,
                          kernels::Multiplier dscale) const override {
    const Op op("cross_entropy");
    kernels::SumsInto to = into;
    if (!correct) to.hits = nullptr;  // (as the CPU: the hits only where asked for)
    cuda::cross_entropy_into(to, dlogits, losses, correct, logits, targets, weights, N, c, dscale);
  }

  double squared_error(float* dpred, const float* pred, const float* target, int64_t N,
                       kernels::Multiplier dscale) const override {
    const Op op("squared_error");
    if (N == 0) return 0;
    double* sq = static_cast<double*>(scratch(kSquaredErrorSlot, N * sizeof(double)));
    BT_EACH(squared_error_kernel, N, dpred, sq, pred, target, N, dscale);
    std::vector<double> h(N);
    BT_CUDA_WAIT(cudaMemcpy(h.data(), sq, h.size() * sizeof(double), cudaMemcpyDeviceToHost));
    double sum = 0;
    for (double x : h) sum += x;
    return sum;
  }
  void squared_error_into(const kernels::SumsInto& into, float* dpred, const float* pred,
                          const float* target, int64_t N,
                          kernels::Multiplier dscale) const override {
    const Op op("squared_error");
    if (N == 0) return;
    double* sq = static_cast<double*>(scratch(kSquaredErrorSlot, N * sizeof(double)));
    BT_EACH(squared_error_kernel, N, dpred, sq, pred, target, N, dscale);
    if (!into.loss && !into.nonfinite) return;  // (the gradient alone)
    BT_LAUNCH(add_squared_errors_kernel, 1, 1, 0, compute_stream())(sq, N, into);
    check_launch();
  }

  void add_sum_squares(double& sum, const float* g, int64_t n, double scale) const override {
    const Op op("add_sum_squares");
    cuda::add_sum_squares(sum, g, n, scale);
  }
  void adamw_update(const kernels::AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m,
                    float* v, int64_t n) const override {
    const Op op("adamw_update");
    cuda::adamw_update(a, p, p16, g, m, v, n);
  }
  void lamb_update(const kernels::LambStep& a, float* p, uint16_t* p16, const float* g, float* m,
                   float* v, int64_t n) const override {
    const Op op("lamb_update");
    double pn = 0, un = 0;
    cuda::lamb_moments(a, p, g, m, v, n, pn, un);
    cuda::lamb_apply(a, p, p16, m, v, n, a.lr * kernels::lamb_trust(a, pn, un));
  }
  // Many tensors: one pass each, one synchronisation for the norms (rows.cu).
  using kernels::Backend::adamw_update;
  using kernels::Backend::add_sum_squares;
  using kernels::Backend::lamb_apply;
  using kernels::Backend::lamb_moments;
  using kernels::Backend::lamb_update;
  void add_sum_squares(double& sum, const float* g, const kernels::TensorSpan* t, int64_t count,
                       double scale) const override {
    const Op op("add_sum_squares (all tensors)");
    cuda::add_sum_squares(sum, g, t, count, scale);
  }
  void gate_gradients(kernels::GradientGate* gate, const float* g, const kernels::TensorSpan* t,
                      int64_t count, float unscale, float max_norm) const override {
    const Op op("gate_gradients (all tensors)");
    cuda::gate_gradients(gate, g, t, count, unscale, max_norm);
  }
  void adamw_update(const kernels::AdamwStep* a, float* p, uint16_t* p16, const float* g, float* m,
                    float* v, const kernels::TensorSpan* t, int64_t count,
                    const kernels::GradientGate* gate) const override {
    const Op op("adamw_update (all tensors)");
    cuda::adamw_update(a, p, p16, g, m, v, t, count, gate);
  }
  void lamb_update(const kernels::LambStep* a, float* p, uint16_t* p16, const float* g, float* m,
                   float* v, const kernels::TensorSpan* t, int64_t count,
                   const kernels::GradientGate* gate) const override {
    const Op op("lamb_update (all tensors)");
    cuda::lamb_update(a, p, p16, g, m, v, t, count, nullptr, nullptr, /*apply=*/true, gate);
  }
  void stage_update(const kernels::AdamwStep* a, const kernels::TensorSpan* t,
                    int64_t count) const override {
    cuda::stage_update(a, t, count);
  }
  void stage_update(const kernels::LambStep* a, const kernels::TensorSpan* t,
                    int64_t count) const override {
    cuda::stage_update(a, t, count);
  }
  void lamb_moments(const kernels::LambStep* a, const float* p, const float* g, float* m, float* v,
                    const kernels::TensorSpan* t, int64_t count, double* pn,
                    double* un) const override {
    const Op op("lamb_moments (all tensors)");
    cuda::lamb_update(a, const_cast<float*>(p), nullptr, g, m, v, t, count, pn, un,
                      /*apply=*/false);
  }
  void lamb_apply(const kernels::LambStep* a, float* p, uint16_t* p16, const float* m,
                  const float* v, const kernels::TensorSpan* t, int64_t count,
                  const float* step) const override {
    const Op op("lamb_apply (all tensors)");
    cuda::lamb_apply(a, p, p16, m, v, t, count, step);
  }

  void lamb_moments(const kernels::LambStep& a, const float* p, const float* g, float* m, float* v,
                    int64_t n, double& pn, double& un) const override {
    const Op op("lamb_moments");
    cuda::lamb_moments(a, p, g, m, v, n, pn, un);
  }
  void lamb_apply(const kernels::LambStep& a, float* p, uint16_t* p16, const float* m,
                  const float* v, int64_t n, float step) const override {
    const Op op("lamb_apply");
    cuda::lamb_apply(a, p, p16, m, v, n, step);
  }
};

}  // namespace

const kernels::Backend& cuda_backend() {
  static const CudaBackend backend;
  return backend;
}

}  // namespace bertrain::cuda
