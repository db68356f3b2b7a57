// The CUDA backend: kernels/backend.h's table filled with this directory's kernels and cuBLAS /
// cuBLASLt products, the precision branches as the CPU backend has them (kernels/cpu/backend.cpp)
// so that a model computes the same thing on either; FP16's products take fp16 operands here
// (Target::fp16_operands), as BF16's take bf16 ones. Pointers are device memory; kernels run on
// the default stream, in order.
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

constexpr unsigned kThreads = 256;

#define BT_FOR_EACH(n)                                                           \
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
  if (i >= (n)) return

__device__ inline float widen_f16(uint16_t b) {
  return __half2float(__ushort_as_half(b));
}
__device__ inline uint16_t to_f16(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// FP16 storage: x rounded to fp16 in place, its bits kept.
__global__ void keep_f16_kernel(float* x, uint16_t* bits, int64_t n) {
  BT_FOR_EACH(n);
  const uint16_t b = to_f16(x[i]);
  if (bits) bits[i] = b;
  x[i] = widen_f16(b);
}

// The activation in the kept precision (kernels/backend.h): BF16 writes out16 = bf16(act(x))
// and in16 = bf16(x); FP16 rounds the input first, then the output (bits and value).
__global__ void activation_forward_16_kernel(Precision p, Activation a, float* out, uint16_t* out16,
                                             const float* in, uint16_t* in16, int64_t n) {
  BT_FOR_EACH(n);
  if (p == Precision::BF16) {
    out16[i] = f32_to_bf16(rm::activation(a, in[i]));
    if (in16) in16[i] = f32_to_bf16(in[i]);
    return;
  }
  const uint16_t xb = to_f16(in[i]);
  if (in16) in16[i] = xb;
  const uint16_t yb = to_f16(rm::activation(a, widen_f16(xb)));
  if (out16) out16[i] = yb;
  if (out) out[i] = widen_f16(yb);
}

// dinp = dout * act'(x) at the kept 16-bit input.
__global__ void activation_backward_16_kernel(Precision p, Activation a, float* dinp,
                                              const uint16_t* in16, const float* dout, int64_t n) {
  BT_FOR_EACH(n);
  const float x = p == Precision::BF16 ? bf16_to_f32(in16[i]) : widen_f16(in16[i]);
  dinp[i] = rm::activation_grad(a, x, dout[i]);
}

__global__ void tanh_forward_kernel(float* out, const float* in, int64_t n) {
  BT_FOR_EACH(n);
  out[i] = tanhf(in[i]);
}

__global__ void tanh_backward_kernel(float* dinp, const float* out, const float* dout, int64_t n) {
  BT_FOR_EACH(n);
  dinp[i] = dout[i] * (1.0f - out[i] * out[i]);
}

__global__ void dropout_backward_kernel(float* dx, const float* dy, int64_t n, float p,
                                        uint64_t key, uint64_t offset) {
  BT_FOR_EACH(n);
  dx[i] = rm::dropout(dy[i], p, rm::keep_scale_of(p), key, offset + i);
}

__global__ void add_inplace_kernel(float* out, const float* a, int64_t n) {
  BT_FOR_EACH(n);
  out[i] += a[i];
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  BT_FOR_EACH(n);
  x[i] *= s;
}

// Embedding backward over the tokens grouped by table row (kernels::RowRuns): a block per chunk
// (blockIdx.x), its channels over threads, then a block per table row of several chunks adding
// their partial rows in order. Deterministic, no atomics; rows of one chunk get the CPU's sums.
__global__ void embedding_chunks_kernel(float* table, float* partial, kernels::RowRuns r,
                                        const float* dout, int64_t C) {
  const kernels::EmbeddingChunk k = r.chunks[blockIdx.x];
  for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < C;
       c += static_cast<int64_t>(gridDim.y) * blockDim.x)
    rm::embedding_chunk(table, partial, k, r.order, dout, C, c);
}

__global__ void embedding_sums_kernel(float* table, const float* partial, kernels::RowRuns r,
                                      int64_t C) {
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
  BT_LAUNCH(embedding_chunks_kernel, dim3(static_cast<unsigned>(r.num_chunks), y), kThreads)
  (table, partial, r, dout, C);
  BT_CUDA_CHECK(cudaGetLastError());
  if (r.num_sums == 0) return;
  BT_LAUNCH(embedding_sums_kernel, dim3(static_cast<unsigned>(r.num_sums), y), kThreads)
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
                                     const float* target, int64_t n, float dscale) {
  BT_FOR_EACH(n);
  const float d = pred[i] - target[i];
  sq[i] = static_cast<double>(d) * d;
  if (dpred) dpred[i] = dscale * 2.0f * d;
}

// Backward's dropped probabilities from the kept ones, element e of [B, NH, T, T] keyed as its
// row: fp32, or 16-bit (rm::Bf16Bits / rm::F16Bits) into the same format.
template <class H>
__global__ void attention_dropped_kernel(H* dropped, const H* probs, AttentionShape s, float dp,
                                         uint64_t key, uint64_t offset) {
  BT_FOR_EACH(s.B * s.NH * s.T * s.T);
  const int64_t r = i / s.T, j = i % s.T;
  const uint64_t idx = offset + s.dropout_row(r / s.T, r % s.T) + j;
  rm::store(dropped + i, rm::dropout(rm::widen(probs[i]), dp, rm::keep_scale_of(dp), key, idx));
}

// Rows [first, first + rows) of the softmax backward (one sequence's heads); ds in fp32 or,
// for 16-bit products, rounded to their format as it is written.
template <class P, class D>
__global__ void softmax_backward_rows_kernel(D* ds, const float* dd, const P* probs,
                                             AttentionShape s, int64_t first, int64_t rows,
                                             float dp, uint64_t key, uint64_t offset) {
  const int64_t w = warp_row();
  if (w >= rows) return;
  const int64_t r = first + w, T = s.T;
  rm::attention_softmax_backward(ds + w * T, dd + w * T, probs + r * T, T, dp, key,
                                 offset + s.dropout_row(r / T, r % T), warp_lanes());
}

void check_launch() {
  BT_CUDA_CHECK(cudaGetLastError());
}

// The blocked kernel's row passes (attention_products.h, BlockRows): a warp per row of the block;
// X the block operands' type (fp32, rm::Bf16Bits or rm::F16Bits).
template <class X>
__global__ void blocked_rows_forward_kernel(BlockRows r, X* dropped, float* lse,
                                            const float* scores) {
  const int64_t w = warp_row();
  if (w >= r.rows()) return;
  r.forward(w, dropped, lse, scores, warp_lanes());
}
template <class X>
__global__ void blocked_rows_backward_kernel(BlockRows r, X* dropped, X* ds, float* scores,
                                             float* dd, const float* lse) {
  const int64_t w = warp_row();
  if (w >= r.rows()) return;
  r.backward(w, dropped, ds, scores, dd, lse, warp_lanes());
}

// f(X*) with a null pointer of the precision's operand type: float, rm::Bf16Bits, rm::F16Bits.
template <class F>
void with_operand_type(Precision p, F&& f) {
  switch (p) {
    case Precision::BF16:
      return f(static_cast<rm::Bf16Bits*>(nullptr));
    case Precision::FP16:
      return f(static_cast<rm::F16Bits*>(nullptr));
    default:
      return f(static_cast<float*>(nullptr));
  }
}

// The blocked kernel's buffers, parts of the kernels' scratch (scratch.h plans them): the block's
// scores and dd in fp32, its two operand buffers in `el`-byte elements.
BlockBuffers block_buffers(const AttentionShape& s, int64_t el) {
  const int64_t n = block_values(s), op = block_operand_bytes(s, el);
  BlockBuffers b;
  b.scores = static_cast<float*>(scratch(kAttentionScoresSlot, n * int64_t{sizeof(float)}));
  b.dd = static_cast<float*>(scratch(kAttentionGradSlot, n * int64_t{sizeof(float)}));
  auto* operands = static_cast<char*>(scratch(kAttentionDroppedSlot, 2 * op));
  b.dropped = operands;
  b.ds = operands + op;
  return b;
}

template <class K, class... A>
void launch(K kernel, int64_t n, A... args) {
  if (n == 0) return;
  BT_LAUNCH(kernel, blocks_for(n, kThreads), kThreads)(args...);
  check_launch();
}

// The products' operands are the precision's: bf16 bits in BF16, fp16 bits in FP16 (the kept
// fp16 activations, the weights' fp16 copy, the rest rounded on the way in), plain fp32 in FP32.

// n fp32 values rounded to the 16-bit precision's operands.
void round_16(Precision p, uint16_t* dst, const float* src, int64_t n) {
  if (p == Precision::BF16)
    round_to_bf16(dst, src, n);
  else
    round_to_f16(dst, src, n);
}

// Attention's sizes and operands: the products read the precision's elements (16-bit bits in
// BF16 and FP16, fp32 values in FP32: `el` bytes).
struct AttentionDims {
  int64_t n_probs;
  Precision o;
  int64_t el;
  AttentionDims(Precision p, const AttentionShape& s)
      : n_probs(s.B * s.NH * s.T * s.T), o(p), el(precision_bytes(p)) {}
};

// QKV as attention's products read it: BF16 and FP16 round it into its kept bits first.
const void* attention_qkv(Precision p, Kept qkv, const AttentionShape& s) {
  const int64_t n = s.B * s.T * 3 * s.C;
  if (p == Precision::BF16) round_to_bf16(qkv.bits, qkv.f32, n);
  if (p == Precision::FP16) launch(keep_f16_kernel, n, qkv.f32, qkv.bits, n);
  return p == Precision::FP32 ? static_cast<const void*>(qkv.f32) : qkv.bits;
}

// The batches' copies into the models' input slots (Backend::upload), on the calling thread's
// current GPU (one thread may run several GPUs in turn: a test's ranks): on a stream of their
// own, non-blocking (it does not wait for the legacy default stream the kernels run on), so a
// copy runs beside the kernels. Each slot has two events: its last copy (kernels issued after
// use_input wait for it) and its last release (its next copy waits for it). An event waited for
// before its first record counts as complete.
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
        if (u.stream) cudaStreamDestroy(u.stream);
      }
    }
  } d;
  int device = 0;
  BT_CUDA_CHECK(cudaGetDevice(&device));
  Uploads& u = d.of[device];
  if (!u.stream) BT_CUDA_CHECK(cudaStreamCreateWithFlags(&u.stream, cudaStreamNonBlocking));
  return u;
}

// A 16-bit precision's products read the weights' 16-bit copy: a model on this backend plans one
// (Target::fp16_operands, ModelDims::weight_copy).
void check_copy(const kernels::Weight& w) {
  BT_CHECK(w.bits,
           "a 16-bit product on the GPU reads the weights' 16-bit copy (BertModel plans it: "
           "ModelDims::weight_copy), and none was given");
}

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
    BT_CUDA_CHECK(cudaMemset(p, 0, bytes));
    return p;
  }
  void release(void* p) const override {
    if (p) cudaFree(p);
  }
  void to_device(void* dst, const void* src, size_t bytes) const override {
    const Op op("to_device");
    BT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  void to_host(void* dst, const void* src, size_t bytes) const override {
    const Op op("to_host");
    BT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
  void* allocate_host(size_t bytes) const override {
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault);
    if (e != cudaSuccess)
      fail("cannot lock ", bytes, " bytes of host memory for the batch's copy to the GPU (",
           cudaGetErrorString(e), "): raise the memory lock limit (ulimit -l) or free host memory");
    return p;
  }
  void release_host(void* p) const override { cudaFreeHost(p); }
  // The input slots (uploads() above): the host waits only in wait_upload.
  void upload(void* slot, const void* src, size_t bytes) const override {
    Uploads& u = uploads();
    const InputSlot& s = u.slot(slot);
    BT_CUDA_CHECK(cudaStreamWaitEvent(u.stream, s.released, 0));
    BT_CUDA_CHECK(cudaMemcpyAsync(slot, src, bytes, cudaMemcpyHostToDevice, u.stream));
    BT_CUDA_CHECK(cudaEventRecord(s.copied, u.stream));
  }
  void use_input(const void* slot) const override {
    BT_CUDA_CHECK(cudaStreamWaitEvent(nullptr, uploads().slot(slot).copied, 0));
  }
  void release_input(const void* slot) const override {
    BT_CUDA_CHECK(cudaEventRecord(uploads().slot(slot).released, nullptr));
  }
  void wait_upload(const void* slot) const override {
    BT_CUDA_CHECK(cudaEventSynchronize(uploads().slot(slot).copied));
  }
  // The kernels' stream only (the legacy default stream; the copy and NCCL streams are
  // non-blocking): a step's backward phase ends when its kernels have run, not when the gradient
  // bucket NCCL is reducing beside them has (that wait is the reducer's: exposed communication).
  void synchronize() const override { BT_CUDA_CHECK(cudaStreamSynchronize(nullptr)); }
  bool busy() const override {
    const cudaError_t e = cudaStreamQuery(nullptr);
    if (e == cudaErrorNotReady) return true;
    BT_CUDA_CHECK(e);
    return false;
  }
  std::string op_profile(int64_t steps) const override { return profile_table(steps); }

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
    BT_CHECK(p != Precision::FP32, "round_to_16: fp32 is not a 16-bit precision");
    (p == Precision::FP16 ? cuda::round_to_f16 : cuda::round_to_bf16)(dst, src, n, queue);
  }
  void widen_from_16(Precision p, float* dst, const uint16_t* src, int64_t n,
                     void* queue) const override {
    BT_CHECK(p != Precision::FP32, "widen_from_16: fp32 is not a 16-bit precision");
    (p == Precision::FP16 ? cuda::widen_from_f16 : cuda::widen_from_bf16)(dst, src, n, queue);
  }
  void scale_on(float* x, int64_t n, float s, void* queue) const override {
    cuda::scale(x, n, s, queue);
  }

  // 16-bit precisions: the products read the weights' 16-bit copy (the model's, written by the
  // optimizer's update) and the kept 16-bit input, or the input rounded into the workspace.
  void linear_forward(Precision p, float* out, Kept in, kernels::Weight w, const float* bias,
                      int64_t M, int64_t N, int64_t K,
                      const kernels::Workspace& ws) const override {
    const Op op("linear_forward");
    if (p == Precision::FP32)
      return cuda::linear_forward(Precision::FP32, out, in.f32, w.f32, bias, M, N, K);
    check_copy(w);
    const uint16_t* x = in.bits;
    if (!x) {
      round_16(p, ws.half_a, in.f32, M * K);
      x = ws.half_a;
    }
    cuda::linear_forward(p, out, x, w.bits, bias, M, N, K);
  }

  // 16-bit precisions: the output gradient rounded to the operands' format (fp16 under the loss
  // scale; the bias gradient sums its fp32 values).
  void linear_backward(Precision p, float* dinp, float* dw, float* db, const float* dout, Kept in,
                       kernels::Weight w, int64_t M, int64_t N, int64_t K, bool accumulate_dinp,
                       const kernels::Workspace& ws) const override {
    const Op op("linear_backward");
    if (p == Precision::FP32)
      return cuda::linear_backward(Precision::FP32, dinp, dw, db, dout, dout, in.f32, w.f32, M, N,
                                   K, accumulate_dinp);
    check_copy(w);
    round_16(p, ws.half_a, dout, M * N);
    const uint16_t* x = in.bits;
    if (!x) {
      round_16(p, ws.half_b, in.f32, M * K);
      x = ws.half_b;
    }
    cuda::linear_backward(p, dinp, dw, db, ws.half_a, dout, x, w.bits, M, N, K, accumulate_dinp);
  }

  void keep(Precision p, Kept x, int64_t n) const override {
    const Op op("keep");
    if (p == Precision::BF16) round_to_bf16(x.bits, x.f32, n);
    if (p == Precision::FP16) launch(keep_f16_kernel, n, x.f32, x.bits, n);
  }

  void copy_weights(Precision p, const float* master, uint16_t* copy, int64_t n) const override {
    const Op op("copy_weights");
    if (p != Precision::FP32) round_16(p, copy, master, n);
  }

  // Full attention (the blocked kernel's saved state goes to blocked_forward / _backward below):
  // the products over every (sequence, head) pair read straight out of the QKV rows, and the
  // row passes over all rows. FP32 keeps probs; BF16 and FP16 keep
  // probs16 with 16-bit operands for the products (QKV's kept bits, the dropped probabilities
  // and dS rounded as the row passes write them, dctx rounded).
  void attention_forward(Precision p, float* ctx, kernels::AttentionSaved saved, Kept qkv,
                         const int32_t* mask, const AttentionShape& s, const Dropout& d,
                         const kernels::Workspace& ws) const override {
    const Op op("attention_forward");
    const AttentionDims g(p, s);
    const void* q = attention_qkv(p, qkv, s);
    if (saved.blocked()) return blocked_forward(p, ctx, saved.lse, q, mask, s, d);
    const int64_t n_probs = g.n_probs;
    const bool half = p != Precision::FP32;
    // scores (scaled) in fp32: the kept probs in FP32, a buffer of our own otherwise; what
    // multiplies V: the dropped probabilities (16-bit in BF16 and FP16), or the probabilities
    // without dropout
    float* scores =
        half ? static_cast<float*>(scratch(kAttentionScoresSlot, n_probs * 4)) : saved.probs;
    float* dr = !half && d.p > 0.0f ? ws.attn_work : nullptr;
    const void* dropped = half ? static_cast<const void*>(ws.attn_probs16) : dr ? dr : scores;
    const auto products = attention_forward_products(s, g.el, q, scores, dropped, ctx);
    gemm_pairs(g.o, s.B * s.NH, s.NH, products[0]);
    if (half)  // softmax and the 16-bit rounding in one pass
      attention_softmax_forward_16(p == Precision::FP16, saved.probs16, ws.attn_probs16, scores,
                                   mask, s, d);
    else
      attention_softmax_forward(scores, dr, scores, mask, s, d);
    gemm_pairs(g.o, s.B * s.NH, s.NH, products[1]);
  }

  void attention_backward(Precision p, float* dqkv, const float* dctx, Kept qkv,
                          kernels::AttentionSaved saved, const int32_t* mask,
                          const AttentionShape& s, const Dropout& d,
                          const kernels::Workspace& ws) const override {
    const Op op("attention_backward");
    const AttentionDims g(p, s);
    const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, n_probs = g.n_probs;
    const bool half = p != Precision::FP32, f16 = p == Precision::FP16;
    // Q, K, V as forward used them; dctx rounded to the 16-bit operands.
    const void* q = half ? static_cast<const void*>(qkv.bits) : qkv.f32;
    const void* dc = dctx;
    if (half) {
      round_16(p, ws.attn_dctx16, dctx, B * T * C);
      dc = ws.attn_dctx16;
    }
    if (saved.blocked()) return blocked_backward(p, dqkv, dc, q, saved.lse, mask, s, d);
    // The dropped probabilities again (forward's are gone with its scratch).
    const void* dropped = saved.probs;
    if (half) {
      if (f16)
        launch(attention_dropped_kernel<rm::F16Bits>, n_probs,
               reinterpret_cast<rm::F16Bits*>(ws.attn_probs16),
               reinterpret_cast<const rm::F16Bits*>(saved.probs16), s, d.p, d.key, d.offset);
      else
        launch(attention_dropped_kernel<rm::Bf16Bits>, n_probs,
               reinterpret_cast<rm::Bf16Bits*>(ws.attn_probs16),
               reinterpret_cast<const rm::Bf16Bits*>(saved.probs16), s, d.p, d.key, d.offset);
      dropped = ws.attn_probs16;
    } else if (d.p > 0.0f) {
      float* dr = static_cast<float*>(scratch(kAttentionDroppedSlot, n_probs * 4));
      launch(attention_dropped_kernel<float>, n_probs, dr, static_cast<const float*>(saved.probs),
             s, d.p, d.key, d.offset);
      dropped = dr;
    }
    // dd (then ds) for every pair in a [B, NH, T, T] buffer; the 16-bit precisions' ds rounded
    // over the dropped probabilities once dV has used them.
    float* dd = static_cast<float*>(scratch(kAttentionGradSlot, n_probs * 4));
    const void* ds = half ? static_cast<const void*>(ws.attn_probs16) : dd;
    const auto products = attention_backward_products(s, g.el, q, dropped, dc, dd, ds, dqkv);
    gemm_pairs(g.o, B * NH, NH, products[0]);  // dV
    gemm_pairs(g.o, B * NH, NH, products[1]);  // dd
    const int64_t rows = B * NH * T;
    auto backward_rows = [&](auto* out, const auto* probs) {
      BT_LAUNCH(softmax_backward_rows_kernel, row_blocks(rows), kRowThreads)
      (out, dd, probs, s, 0, rows, d.p, d.key, d.offset);
    };
    if (f16)
      backward_rows(reinterpret_cast<rm::F16Bits*>(ws.attn_probs16),
                    reinterpret_cast<const rm::F16Bits*>(saved.probs16));
    else if (half)
      backward_rows(reinterpret_cast<rm::Bf16Bits*>(ws.attn_probs16),
                    reinterpret_cast<const rm::Bf16Bits*>(saved.probs16));
    else
      backward_rows(dd, static_cast<const float*>(saved.probs));
    check_launch();
    gemm_pairs(g.o, B * NH, NH, products[2]);  // dQ
    gemm_pairs(g.o, B * NH, NH, products[3]);  // dK
  }

  // The blocked (flash-style) kernel, from 512 tokens: attention_products.h's
  // blocked_forward_schedule and blocked_backward_schedule (what the host tests run), the block
  // buffers from the kernels' scratch, only the row log-sum-exp kept. q: QKV as the products read
  // it; dc: dctx likewise.
  void blocked_forward(Precision p, float* ctx, float* lse, const void* q, const int32_t* mask,
                       const AttentionShape& s, const Dropout& d) const {
    const AttentionDims g(p, s);
    const BlockBuffers b = block_buffers(s, g.el);
    with_operand_type(p, [&](auto* type) {
      using X = std::remove_pointer_t<decltype(type)>;
      blocked_forward_schedule(
          s, g.el, q, mask, d, b, ctx,
          [&](const PairProduct& m) { gemm_pairs(g.o, s.B * s.NH, s.NH, m); },
          [&](const BlockRows& r) {
            BT_LAUNCH(blocked_rows_forward_kernel<X>, row_blocks(r.rows()), kRowThreads)
            (r, static_cast<X*>(b.dropped), lse, b.scores);
            check_launch();
          });
    });
  }
  void blocked_backward(Precision p, float* dqkv, const void* dc, const void* q, const float* lse,
                        const int32_t* mask, const AttentionShape& s, const Dropout& d) const {
    const AttentionDims g(p, s);
    const BlockBuffers b = block_buffers(s, g.el);
    with_operand_type(p, [&](auto* type) {
      using X = std::remove_pointer_t<decltype(type)>;
      blocked_backward_schedule(
          s, g.el, q, dc, mask, d, b, dqkv,
          [&](const PairProduct& m) { gemm_pairs(g.o, s.B * s.NH, s.NH, m); },
          [&](const BlockRows& r) {
            BT_LAUNCH(blocked_rows_backward_kernel<X>, row_blocks(r.rows()), kRowThreads)
            (r, static_cast<X*>(b.dropped), static_cast<X*>(b.ds), b.scores, b.dd, lse);
            check_launch();
          });
    });
  }

  void activation_forward(Precision p, Activation a, Kept out, Kept in, int64_t n) const override {
    const Op op("activation_forward");
    if (p == Precision::FP32) return cuda::activation_forward(a, out.f32, in.f32, n);
    launch(activation_forward_16_kernel, n, p, a, out.f32, out.bits,
           static_cast<const float*>(in.f32), in.bits, n);
  }

  void activation_backward(Precision p, Activation a, float* dinp, Kept in, const float* dout,
                           int64_t n) const override {
    const Op op("activation_backward");
    if (p == Precision::FP32) return cuda::activation_backward(a, dinp, in.f32, dout, n);
    launch(activation_backward_16_kernel, n, p, a, dinp, static_cast<const uint16_t*>(in.bits),
           dout, n);
  }

  void tanh_forward(float* out, const float* in, int64_t n) const override {
    const Op op("tanh_forward");
    launch(tanh_forward_kernel, n, out, in, n);
  }
  void tanh_backward(float* dinp, const float* out, const float* dout, int64_t n) const override {
    const Op op("tanh_backward");
    launch(tanh_backward_kernel, n, dinp, out, dout, n);
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
  void residual_layernorm_forward(float* out, float* mean, float* rstd, float* x,
                                  const float* residual, const float* gamma, const float* beta,
                                  int64_t N, int64_t C, float eps,
                                  const Dropout& d) const override {
    const Op op("residual_layernorm_forward");
    cuda::residual_layernorm_forward(out, mean, rstd, x, residual, gamma, beta, N, C, eps, d);
  }
  void layernorm_dropout_backward(float* dinp, float* ddropped, float* dgamma, float* dbeta,
                                  const float* dout, const float* in, const float* gamma,
                                  const float* mean, const float* rstd, int64_t N, int64_t C,
                                  bool accumulate_dinp, const Dropout& d) const override {
    const Op op("layernorm_dropout_backward");
    cuda::layernorm_dropout_backward(dinp, ddropped, dgamma, dbeta, dout, in, gamma, mean, rstd, N,
                                     C, accumulate_dinp, d);
  }

  void dropout_forward(float* x, int64_t n, const Dropout& d) const override {
    const Op op("dropout_forward");
    BT_CHECK(!d.rows, "dropout_forward: a row map is for the row kernels");
    cuda::dropout_forward(x, n, d.p, d.key, d.offset);
  }
  void dropout_backward(float* dx, const float* dy, int64_t n, const Dropout& d) const override {
    const Op op("dropout_backward");
    BT_CHECK(!d.rows, "dropout_backward: a row map is for the row kernels");
    if (d.p <= 0.0f) {
      if (dx != dy) copy(dx, dy, n);
      return;
    }
    launch(dropout_backward_kernel, n, dx, dy, n, d.p, d.key, d.offset);
  }
  void add_inplace(float* out, const float* a, int64_t n) const override {
    const Op op("add_inplace");
    launch(add_inplace_kernel, n, out, a, n);
  }
  void copy(float* dst, const float* src, int64_t n) const override {
    const Op op("copy");
    if (n > 0)
      BT_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                    cudaMemcpyDeviceToDevice));
  }
  void gather_rows(float* out, const float* seq, const int32_t* positions, int64_t B, int64_t P,
                   int64_t T, int64_t C) const override {
    const Op op("gather_rows");
    launch(gather_rows_kernel, B * P * C, out, seq, positions, B, P, T, C);
  }
  void scatter_add_rows(float* dseq, const float* d, const int32_t* positions, int64_t B, int64_t P,
                        int64_t T, int64_t C) const override {
    const Op op("scatter_add_rows");
    launch(scatter_add_rows_kernel, B * C, dseq, d, positions, B, P, T, C);
  }
  void scale_inplace(float* x, int64_t n, float s) const override {
    const Op op("scale_inplace");
    launch(scale_kernel, n, x, n, s);
  }
  void zero(void* p, int64_t bytes) const override {
    const Op op("zero");
    if (bytes > 0) BT_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(bytes)));
  }

  kernels::CrossEntropySums cross_entropy(float* dlogits, float* losses, int32_t* correct,
                                          const float* logits, const int32_t* targets,
                                          const float* weights, int64_t N, int64_t V,
                                          float dscale) const override {
    const Op op("cross_entropy");
    kernels::CrossEntropySums s =
        cuda::cross_entropy(dlogits, losses, correct, logits, targets, weights, N, V, dscale);
    if (!correct) s.correct = 0;  // as the CPU: the hits only where asked for
    return s;
  }

  double squared_error(float* dpred, const float* pred, const float* target, int64_t N,
                       float dscale) const override {
    const Op op("squared_error");
    if (N == 0) return 0;
    double* sq = static_cast<double*>(scratch(kSquaredErrorSlot, N * sizeof(double)));
    launch(squared_error_kernel, N, dpred, sq, pred, target, N, dscale);
    std::vector<double> h(N);
    BT_CUDA_CHECK(cudaMemcpy(h.data(), sq, h.size() * sizeof(double), cudaMemcpyDeviceToHost));
    double sum = 0;
    for (double x : h) sum += x;
    return sum;
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
  void adamw_update(const kernels::AdamwStep* a, float* p, uint16_t* p16, const float* g, float* m,
                    float* v, const kernels::TensorSpan* t, int64_t count) const override {
    const Op op("adamw_update (all tensors)");
    cuda::adamw_update(a, p, p16, g, m, v, t, count);
  }
  void lamb_update(const kernels::LambStep* a, float* p, uint16_t* p16, const float* g, float* m,
                   float* v, const kernels::TensorSpan* t, int64_t count) const override {
    const Op op("lamb_update (all tensors)");
    std::vector<double> pn(static_cast<size_t>(count), 0.0), un(static_cast<size_t>(count), 0.0);
    cuda::lamb_update(a, p, p16, g, m, v, t, count, pn.data(), un.data(), [&](float* step) {
      for (int64_t i = 0; i < count; ++i)
        step[i] = a[i].lr * kernels::lamb_trust(a[i], pn[i], un[i]);
    });
  }
  void lamb_moments(const kernels::LambStep* a, const float* p, const float* g, float* m, float* v,
                    const kernels::TensorSpan* t, int64_t count, double* pn,
                    double* un) const override {
    const Op op("lamb_moments (all tensors)");
    cuda::lamb_update(a, const_cast<float*>(p), nullptr, g, m, v, t, count, pn, un, {});
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
