// The CUDA backend's host interface: device buffers and the kernel families ported so far
// (LayerNorm and the fused residual and embedding blocks, activations, dropout with the same
// counter-based masks as the CPU, attention's row passes, the cross-entropy, the optimizers).
// The fused kernels run the row math the CPU tests check (kernels/row_math.h). Plain C++
// header, no CUDA types, so CPU code can include it; compiled only with -DBERTRAIN_CUDA=ON.
// Pointers are device memory unless said otherwise. Kernels run on the kernels' stream
// (compute_stream, common.cuh) unless a stream (cudaStream_t as void*) is given; the ones returning
// sums synchronise it. Semantics are the CPU kernels' of the same name (kernels/cpu/*.h,
// kernels/backend.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/backend.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cuda/attention_products.h"

namespace bertrain::cuda {

// The CUDA backend (kernels/backend.h), for models whose memory is on the device.
const kernels::Backend& cuda_backend();

// Number of usable CUDA devices (0 when no driver or no GPU: callers skip, never crash).
int device_count();
// The GPU the calling host thread's kernels and allocations use from now on.
void set_device(int device);

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  float* f32() const { return static_cast<float*>(ptr_); }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* host, size_t bytes);
  void download(void* host, size_t bytes) const;

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

void synchronize();

// A copy of host memory into device memory queued on the stream, staged in page-locked memory
// (Backend::send): the host may write src again on return, and waits only where the device is
// several sends behind.
void send(void* device, const void* host, size_t bytes, void* stream = nullptr);

// What this process gave its GPUs so far (every thread): kernel launches, each cuBLAS or cuBLASLt
// product counted as one (on a GPU it is one kernel or more), and host synchronisations (a
// call in which the host waited for the device: a stream, event or device synchronisation, a
// blocking copy or memset, a free). Counted by bertrain's CUDA code as it issues them; on the
// emulated device, tests check them against the emulator's own counts (cuda_emu/counts.h).
// `bench --device cuda` prints them per step. A CUDA graph's kernels count at each launch of the
// graph (DeviceCounts::graph_kernels), not at its capture.
kernels::DeviceCounts device_counts();
// The launches counted since the calling thread's capture began (set_capturing), and a graph's
// launch running that many.
int64_t captured_launches();
void count_graph_launch(int64_t kernels);

// Stream capture on the calling thread (Backend::begin_capture, end_capture): while it is on,
// what would rely on the device's earlier work without issuing it is issued anyway
// (pair_pointers makes its tables in the graph); after a graph's launch, what the host
// remembered of the device's memory is forgotten (forget_device_records).
void set_capturing(bool on);
bool capturing();
void forget_device_records();

// A linear layer's operands are the precision's (Precision `o`): fp32, or 16-bit (raw bf16 /
// fp16 bits) with fp32 accumulation and an fp32 result.

// out[M,N] = in[M,K] . w[N,K]^T + bias[N] (bias may be null), through cuBLASLt (bias in the
// epilogue); in and w of the operand type.
void linear_forward(Precision o, float* out, const void* in, const void* w, const float* bias,
                    int64_t M, int64_t N, int64_t K, void* stream = nullptr);
// dinp[M,K] = dout . w (or += with accumulate; skipped when null), dw[N,K] += dout^T . in,
// db[N] += column sums of dout (if non-null). dout in the operand type, dout_f32 its fp32 values
// (the bias gradient's; the same pointer in fp32).
void linear_backward(Precision o, float* dinp, float* dw, float* db, const void* dout,
                     const float* dout_f32, const void* in, const void* w, int64_t M, int64_t N,
                     int64_t K, bool accumulate_dinp, void* stream = nullptr);
// db[N] (may be null) += x[M,N]'s column sums (column_sums' chunks and order: linear_backward's
// bits) and bits (may be null; a 16-bit p) = x rounded, in one pass over x.
void rounded_column_sums(Precision p, float* db, const float* x, uint16_t* bits, int64_t M,
                         int64_t N, void* stream = nullptr);

// Backend::linear_forward / linear_backward (kernels/backend.h) in precision p, the one place
// the GPU's linear layers dispatch on it: 16-bit precisions read the weights' 16-bit copy and
// the kept 16-bit input, or the input rounded into ws.half_b (backward; ws.half_a in forward),
// the output gradient rounded into ws.half_a (fp16 under the loss scale; the bias gradient sums
// its fp32 values).
void linear_forward(Precision p, float* out, kernels::Kept in, kernels::Weight w, const float* bias,
                    int64_t M, int64_t N, int64_t K, const kernels::Workspace& ws);
void linear_backward(Precision p, float* dinp, float* dw, float* db, kernels::KeptIn dout,
                     kernels::Kept in, kernels::Weight w, int64_t M, int64_t N, int64_t K,
                     bool accumulate_dinp, const kernels::Workspace& ws);
// Backend::linear_forward_16: linear_forward in a 16-bit p with the output written in p's 16
// bits alone, no fp32 output: cuBLASLt's epilogue adds the bias (its 16-bit copy: a 16-bit
// output takes a bias of its own type) in fp32 and rounds the sum to nearest even once.
void linear_forward_16(Precision p, uint16_t* out, kernels::Kept in, kernels::Weight w,
                       const uint16_t* bias, int64_t M, int64_t N, int64_t K,
                       const kernels::Workspace& ws, void* stream = nullptr);
// Backend::linear_backward_16: linear_backward in a 16-bit p with dinp (=) written in p's 16
// bits alone by the product's epilogue (its fp32 sums rounded to nearest even once).
void linear_backward_16(Precision p, uint16_t* dinp16, float* dw, float* db, kernels::KeptIn dout,
                        kernels::Kept in, kernels::Weight w, int64_t M, int64_t N, int64_t K,
                        const kernels::Workspace& ws);

// A product over attention's (sequence, head) pairs (attention_products.h) for `pairs` pairs of
// NH heads a sequence: one cuBLAS batched call, its pointer arrays made on the GPU (scratch's
// attention-pointers part).
void gemm_pairs(Precision o, int64_t pairs, int64_t NH, const PairProduct& p,
                void* stream = nullptr);
// The pointer arrays of `count` (at most kMaxPairProducts) such products made in one launch
// (scratch's attention-pointers part), and product j of them run: a pass's products share one
// launch for their pointers (forward's two, backward's four). The part keeps kPairTables tables
// (attention_products.h): the same pairs, heads and operands as a table made since the scratch
// was bound find that table, no launch (a model's arenas keep their addresses, so a step after
// the first makes none); else the least recently used table is made again. Valid until
// kPairTables other tables are made (what the stream runs before then reads it as it was).
// While capturing (set_capturing), every table is made in the graph, none kept.
struct PairPointers {
  void** base = nullptr;
  int64_t pairs = 0, count = 0;
};
PairPointers pair_pointers(int64_t pairs, int64_t NH, const PairProduct* p, int64_t count,
                           void* stream = nullptr);
void gemm_pairs(Precision o, const PairPointers& at, int64_t j, const PairProduct& p,
                void* stream = nullptr);

// The GEMM ceiling on the current GPU, measured now: TFLOP/s of cuBLASLt's [M,K] x [N,K]^T
// product with these operands on pseudo-random values (zeros run faster), timed with CUDA
// events over `seconds` after warm-up. What the GPU benchmarks report utilisation against.
double gemm_tflops(Precision o, int64_t M, int64_t N, int64_t K, double seconds);
// The device's name, e.g. "NVIDIA H200".
std::string device_name();

// 16-bit copies in precision p (BF16 or FP16; round to nearest even, as core/dtype.h): raw bits.
void round_to_16(Precision p, uint16_t* dst, const float* src, int64_t n, void* stream = nullptr);
// And back to fp32 (exact).
void widen_from_16(Precision p, float* dst, const uint16_t* src, int64_t n, void* stream = nullptr);

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps, void* stream = nullptr);
// dinp (=), dgamma and dbeta (+=), as the CPU kernel.
void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                        const float* inp, const float* gamma, const float* mean, const float* rstd,
                        int64_t N, int64_t C, void* stream = nullptr);
// x = dropout(x) + residual in place, out = LayerNorm(x).
void residual_layernorm_forward(float* out, float* mean, float* rstd, float* x,
                                const float* residual, const float* gamma, const float* beta,
                                int64_t N, int64_t C, float eps, const kernels::Dropout& d,
                                void* stream = nullptr);
// The same with out's 16-bit copy written in the pass where out.bits is given (p 16-bit), and
// where y16 is given the projection's output read from that 16-bit copy (p's bits), x written:
// Backend::residual_layernorm_forward_16.
void residual_layernorm_forward(Precision p, kernels::Kept out, float* mean, float* rstd, float* x,
                                const float* residual, const float* gamma, const float* beta,
                                int64_t N, int64_t C, float eps, const kernels::Dropout& d,
                                void* stream = nullptr, const uint16_t* y16 = nullptr);
// out = dropout(LayerNorm(word[id] + position[t] + token_type[segment])), the sum kept.
void embedding_layernorm_forward(float* out, float* sum, float* mean, float* rstd,
                                 const int32_t* ids, const int32_t* segment,
                                 const int32_t* positions, const float* word, const float* position,
                                 const float* token_type, const float* gamma, const float* beta,
                                 int64_t B, int64_t T, int64_t C, float eps,
                                 const kernels::Dropout& d, void* stream = nullptr);
// The residual block's backward: dinp (= or +=), ddropped = dropout(dinp) (may be null; with
// bits, in a 16-bit p, also rounded there in the same pass), dgamma and dbeta (+=), and dbias
// (may be null; needs ddropped) += ddropped's column sums in the same launch as dgamma's.
void layernorm_dropout_backward(Precision p, float* dinp, kernels::Kept ddropped, float* dgamma,
                                float* dbeta, float* dbias, const float* dout, const float* in,
                                const float* gamma, const float* mean, const float* rstd, int64_t N,
                                int64_t C, bool accumulate_dinp, const kernels::Dropout& d,
                                void* stream = nullptr);

void activation_forward(kernels::Activation a, float* out, const float* inp, int64_t n,
                        void* stream = nullptr);
void activation_backward(kernels::Activation a, float* dinp, const float* inp, const float* dout,
                         int64_t n, void* stream = nullptr);

// Backend::activation_forward / activation_backward / keep (kernels/backend.h) in precision p,
// the one place the GPU's activations and kept tensors dispatch on it.
void activation_forward(Precision p, kernels::Activation a, kernels::Kept out, kernels::Kept in,
                        int64_t n, void* stream = nullptr);
void activation_backward(Precision p, kernels::Activation a, float* dinp, kernels::Kept in,
                         const float* dout, int64_t n, void* stream = nullptr);
// activation_backward over M rows of N and db[N] += dinp's column sums, in one launch (the
// grid, chunks and order of linear_backward's column sums: the same bits); dinp.bits, where
// given, receives dinp rounded to p's 16 bits as it is written; dout.f32 null: its 16-bit copy
// read (a 16-bit p).
void activation_bias_backward(Precision p, kernels::Activation a, kernels::Kept dinp, float* db,
                              kernels::Kept in, kernels::KeptIn dout, int64_t M, int64_t N,
                              void* stream = nullptr);
void keep(Precision p, kernels::Kept x, int64_t n, void* stream = nullptr);

// x = dropout(x), dx = dropout(dy) with the same mask: N rows of C values, element (r, c) keyed
// at d.offset + R C + c, R = d.rows[r] where a row map is given, else r.
void dropout_forward(float* x, int64_t N, int64_t C, const kernels::Dropout& d,
                     void* stream = nullptr);
void dropout_backward(float* dx, const float* dy, int64_t N, int64_t C, const kernels::Dropout& d,
                      void* stream = nullptr);
// x *= s (n values).
void scale(float* x, int64_t n, kernels::Multiplier s, void* stream = nullptr);

// Attention's row passes over [B, NH, T, T] (the products around them are strided batched
// GEMMs): probs = softmax(scores + mask) (probs may alias scores), dropped = dropout(probs)
// (null when d.p = 0); scores already scaled by 1/sqrt(head size).
void attention_softmax_forward(float* probs, float* dropped, const float* scores,
                               const int32_t* mask, const kernels::AttentionShape& s,
                               const kernels::Dropout& d, void* stream = nullptr);
// The 16-bit precisions': the probabilities kept in p's 16 bits (BF16 or FP16) and the dropped
// ones made from them, in the same pass (row_math::attention_softmax_16; dropped16 null when
// d.p = 0).
void attention_softmax_forward_16(Precision p, uint16_t* probs16, uint16_t* dropped16,
                                  const float* scores, const int32_t* mask,
                                  const kernels::AttentionShape& s, const kernels::Dropout& d,
                                  void* stream = nullptr);
// ds = probs * (dp - rowsum(probs * dp)), dp = dropout(dd) (ds may alias dd).
void attention_softmax_backward(float* ds, const float* dd, const float* probs,
                                const kernels::AttentionShape& s, const kernels::Dropout& d,
                                void* stream = nullptr);

// Backend::attention_forward / attention_bias_backward (kernels/backend.h) in precision p
// (attention.cu): the full kernel, or the blocked (flash-style) one where `saved` keeps only the
// row log-sum-exp; the one place the GPU's attention dispatches on the precision and the kernel.
// Backward's dbias and dqkv.bits (each may be null): the fused kernel's own, else one pass over
// dqkv (rounded_column_sums); dctx.bits (may be null): dctx's 16-bit copy, made by the output
// projection's product (linear_backward_16), which the full and blocked kernels' products read
// instead of rounding dctx.f32; the fused kernel rounds dctx.f32 as it reads it.
void attention_forward(Precision p, kernels::Kept ctx, kernels::AttentionSaved saved,
                       kernels::Kept qkv, const int32_t* mask, const kernels::AttentionShape& s,
                       const kernels::Dropout& d, const kernels::Workspace& ws);
void attention_backward(Precision p, kernels::Kept dqkv, float* dbias, kernels::KeptIn dctx,
                        kernels::Kept qkv, kernels::AttentionSaved saved, const int32_t* mask,
                        const kernels::AttentionShape& s, const kernels::Dropout& d,
                        const kernels::Workspace& ws);

// The fused attention (fused_attention.cu): the blocked algorithm (the row log-sum-exp kept) in
// one kernel forward and one backward, variable lengths through AttentionShape::starts, where
// fused_attention_runs (scratch.h). attention_forward and _backward run it there and the blocked
// kernel's products otherwise. Forward reads QKV's 16-bit copy (qkv.f32 null: its product wrote
// only that), or its fp32 values, rounded as it stages them, writing the kept bits; it writes
// ctx with its 16-bit copy where ctx.bits is given (keep's contract; ctx.f32 null: the copy
// alone); backward reads the kept
// bits, that copy of ctx (ctx16), lse [NH rows] and dctx in fp32 (rounded as it is read) or,
// where dctx.f32 is null, its 16-bit copy. QKV, dctx and their copies at 16-byte boundaries
// (16-byte accesses).
void fused_attention_forward(Precision p, kernels::Kept ctx, float* lse, kernels::Kept qkv,
                             const int32_t* mask, const kernels::AttentionShape& s,
                             const kernels::Dropout& d);
// Backward's dqkv.f32, dqkv.bits and dbias (each may be null, not both of dqkv's): dqkv, rounded,
// and += its column sums over the sequences' rows (partial sums a tile of 64 rows, added in order
// by the last block of each head's Q, K or V columns: column_tickets.cuh).
void fused_attention_backward(Precision p, kernels::Kept dqkv, float* dbias, kernels::KeptIn dctx,
                              const uint16_t* qkv, const uint16_t* ctx16, const float* lse,
                              const int32_t* mask, const kernels::AttentionShape& s,
                              const kernels::Dropout& d);

// Softmax cross-entropy of N rows over c.V classes (rows of c.stride logits: kernels::Classes)
// with its gradient (dlogits may be null or alias logits, its padding written 0; weights may be
// null); losses and correct (optional) receive each row's loss and hit.
// Returns the weighted loss and hit sums (synchronises the stream), or with `sums` false zero
// sums without waiting (a gradient-only call).
kernels::CrossEntropySums cross_entropy(float* dlogits, float* losses, int32_t* correct,
                                        const float* logits, const int32_t* targets,
                                        const float* weights, int64_t N, kernels::Classes c,
                                        kernels::Multiplier dscale, void* stream = nullptr,
                                        bool sums = true);
// The same, its sums added on the device where `into` says (kernels::SumsInto): one more
// kernel, no waiting.
void cross_entropy_into(const kernels::SumsInto& into, float* dlogits, float* losses,
                        int32_t* correct, const float* logits, const int32_t* targets,
                        const float* weights, int64_t N, kernels::Classes c,
                        kernels::Multiplier dscale, void* stream = nullptr);

// Device memory for kernels that need more than their operands (slot: which part, scratch.h):
// the bound region's part (bind_scratch: the model's plan) when it holds `bytes`, else a buffer
// of the calling host thread's own, grown to `bytes` and kept: valid until the next call with
// that slot and a larger size.
void* scratch(int slot, size_t bytes);
// The region of a scratch_layout (scratch.h) the calling thread's kernels take their scratch
// from; null: none.
void bind_scratch(void* region, const kernels::ScratchLayout& layout);
// Which binding the calling thread's scratch is: a number bind_scratch changes when it binds
// another region or layout (a model binds its own before each pass: the same; freed, it binds
// none). What scratch keeps from call to call, the attention's pointer tables, is a binding's.
uint64_t scratch_binding();
// Bytes of the buffers scratch() grew of its own so far (this process, all threads).
int64_t unplanned_scratch_bytes();

// The optimizer over one tensor (kernels/cpu/optimizer.h); the sums come back to the host
// (synchronising the stream).
void add_sum_squares(double& sum, const float* g, int64_t n, double scale, void* stream = nullptr);
void adamw_update(const kernels::AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m,
                  float* v, int64_t n, void* stream = nullptr);
void lamb_moments(const kernels::LambStep& a, const float* p, const float* g, float* m, float* v,
                  int64_t n, double& pn, double& un, void* stream = nullptr);
void lamb_apply(const kernels::LambStep& a, float* p, uint16_t* p16, const float* m, const float* v,
                int64_t n, float step, void* stream = nullptr);

// The same over many tensors of flat buffers (kernels/backend.h, TensorSpan), one pass each
// (scratch.h: a block per chunk; the spans' tables and the steps cross to the device only when
// they change: stage_update sends them ahead of a CUDA graph that holds the pass, which may not
// send them itself). add_sum_squares synchronises once; gate_gradients
// not at all (the sum and the gate in a kernel after the chunks'). lamb_update with `apply`:
// the moments, each span's trust ratio and step (lr x trust) on the device, the update pass:
// no synchronisation (pn, un unused); without: the moments only, pn and un receiving each span's
// norms (+=: one synchronisation), for a tensor updated in parts on several ranks. A gate
// (types.h GradientGate, device memory) gives the steps' gscale and may skip the update.
void add_sum_squares(double& sum, const float* g, const kernels::TensorSpan* t, int64_t count,
                     double scale, void* stream = nullptr);
void gate_gradients(kernels::GradientGate* gate, const float* g, const kernels::TensorSpan* t,
                    int64_t count, float unscale, float max_norm, void* stream = nullptr);
void adamw_update(const kernels::AdamwStep* a, float* p, uint16_t* p16, const float* g, float* m,
                  float* v, const kernels::TensorSpan* t, int64_t count,
                  const kernels::GradientGate* gate = nullptr, void* stream = nullptr);
void lamb_update(const kernels::LambStep* a, float* p, uint16_t* p16, const float* g, float* m,
                 float* v, const kernels::TensorSpan* t, int64_t count, double* pn, double* un,
                 bool apply, const kernels::GradientGate* gate = nullptr, void* stream = nullptr);
void lamb_apply(const kernels::LambStep* a, float* p, uint16_t* p16, const float* m, const float* v,
                const kernels::TensorSpan* t, int64_t count, const float* step,
                void* stream = nullptr);
// The tables and steps adamw_update / lamb_update with these arguments would send, sent now.
void stage_update(const kernels::AdamwStep* a, const kernels::TensorSpan* t, int64_t count,
                  void* stream = nullptr);
void stage_update(const kernels::LambStep* a, const kernels::TensorSpan* t, int64_t count,
                  void* stream = nullptr);

}  // namespace bertrain::cuda
