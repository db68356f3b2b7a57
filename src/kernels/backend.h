// The kernel interface the model calls: every operation of BERT's forward and backward and the
// optimizer's, on raw buffers in the backend's memory, the precision a parameter. The CPU
// backend (kernels/cpu/backend.cpp) fills it with the oneDNN matmuls and our fused kernels; the
// CUDA backend will fill the same table (cuBLASLt, CUDA kernels), so the model has no precision
// or device branches of its own.
//
// Precision is what the model keeps and what its matmuls read (core/precision.h says it for
// users): FP32 everything fp32; BF16 matmuls on bf16 operands (a bf16 copy of the weights and of
// the kept activations) with fp32 accumulation; FP16 the kept activations stored in fp16, each
// rounded before forward uses it, the kernels computing in fp32 (the CPU's), or, on a backend
// whose products take fp16 operands (Target::fp16_operands: a GPU's tensor cores), the matmuls
// on fp16 operands as BF16's on bf16 ones (an fp16 copy of the weights, the output gradients
// rounded to fp16 under the loss scale). Gradients, LayerNorm, softmax and losses are fp32 in
// every precision.
//
// Conventions (as the CPU kernels): row-major; weights in HF layout [out, in]; backward writes
// input gradients (=, or += where `accumulate` says) and accumulates (+=) weight gradients.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "kernels/types.h"

namespace bertrain::kernels {

// What a memory plan needs to know of where a model's kernels run: whose memory they read, which
// attention kernels there are, the kernel scratch for the model's shapes. A Backend is one; a
// plan for a device this machine lacks (`estimate --device cuda` on a laptop) takes the target
// alone (kernels/cuda/scratch.h, cuda::target()), so the plan printed is the one the run makes.
class Target {
 public:
  virtual ~Target() = default;
  virtual const char* name() const = 0;
  // Whether the kernels read host memory (the CPU's). Otherwise the model's arenas are the
  // backend's (Backend::allocate) and the batch arrays the kernels read are copied there (a
  // planned group of their own, "input").
  virtual bool host_memory() const { return true; }
  // Whether FP16's matmuls take fp16 operands (a GPU's tensor cores multiply fp16 at twice TF32's
  // rate): the model then keeps an fp16 copy of the weights (the optimizer's update writes it)
  // and 16-bit operand scratch, as in BF16. Otherwise (the CPU: oneDNN has no fp16 matmul
  // without AVX512-FP16) FP16's kernels compute in fp32 on the fp32 weights.
  virtual bool fp16_operands() const { return false; }
  // Whether attention at this precision and sequence length runs fastest as the full kernel
  // (the [B, NH, T, T] probabilities kept) whatever the length: a GPU's, where the full
  // kernel's batched products are cuBLAS's and the fused blocked kernel is a first one (a warp a
  // block; measured 3.6x slower on an H200: docs/gpus.md). --attention auto then picks the full
  // kernel (the CPU's choice: blocked from 512 tokens); --attention blocked still runs the fused
  // one.
  virtual bool prefers_full_attention(Precision, int64_t /*seq_len*/) const { return false; }
  // Whether blocked attention (the row log-sum-exp kept) of this precision and shape (its
  // longest sequence T) runs as one fused kernel forward (a GPU's): it takes variable lengths
  // (AttentionShape::starts), a batch of sequences of any lengths in one call, and reads QKV and
  // dctx in 16 bits (their copies alone) or rounds their fp32 values as it reads them (no
  // rounding pass, no Workspace::attn_dctx16 for them). Otherwise a caller runs sequences
  // of equal length a call each.
  virtual bool fused_attention(Precision, const AttentionShape&) const { return false; }
  // Whether a product's output can be written in a 16-bit precision's bits alone
  // (Backend::linear_forward_16: a GPU's cuBLASLt rounds it in its epilogue), where the next
  // products read only those bits: no fp32 output written, read and rounded.
  virtual bool writes_16bit_outputs() const { return false; }
  // What the kernels need besides their operands for the shapes a model runs; the model plans
  // layout.total() bytes (group "kernels") and binds them (Backend::bind_scratch).
  virtual ScratchLayout scratch_layout(const KernelShapes& shapes) const = 0;
};

// The batches a model on a backend with memory of its own holds at once (Backend::upload): the
// one the kernels read and the next, copied in beside them.
constexpr int kInputSlots = 2;

// Memory a device has: free for new allocations now, and in all.
struct DeviceMemory {
  size_t free = 0, total = 0;
};

// What a process gave its device so far (a GPU's: cuda::device_counts): kernel launches (a
// library's product counted as one) and host synchronisations (calls in which the host waited
// for the device: for its results, or to free memory). What stands between a step and a CUDA
// graph: bench prints them per step. Apart: waits for host memory the device still copies from
// (an input slot's staging, the optimizer's tables) where the host ran ahead of the device by
// the depth of that memory (two batches): back-pressure, which a host no faster than its
// device never meets.
struct DeviceCounts {
  int64_t launches = 0, host_syncs = 0, ahead_waits = 0;
  // Graphs (Backend::launch_graph) launched, and the launches above their launches ran (each
  // launch of a graph counts the kernels it holds; its capture counts none).
  int64_t graph_launches = 0, graph_kernels = 0;
};

class Backend : public Target {
 public:
  // -- memory --
  // Not host memory (Target::host_memory): the model's arenas are the backend's (allocate:
  // zeroed, 256-byte aligned; release; a failed allocate is a bertrain::Error naming the bytes
  // asked and the bytes free) and what the host makes or reads crosses with to_device / to_host.
  virtual void* allocate(size_t bytes) const;
  // allocate, its failure naming what the bytes were for (`what`, e.g. "the model's activations
  // (1.2 GiB)") and where the plan that sized them is printed.
  void* allocate_for(size_t bytes, const std::string& what) const;
  virtual void release(void* p) const;
  virtual void to_device(void* dst, const void* src, size_t bytes) const {
    std::memcpy(dst, src, bytes);
  }
  virtual void to_host(void* dst, const void* src, size_t bytes) const {
    std::memcpy(dst, src, bytes);
  }
  // The batch's way in (BertModel::stage_inputs), through input slots (a model has
  // kInputSlots: regions of its backend memory, each named by its start), so that the next
  // batch's copy can run while the kernels still read this one's. Staging memory is host memory
  // the device copies from directly (a GPU's page-locked memory: no staging copy by the driver,
  // no synchronisation). upload(slot, src, bytes) is one copy of src into the slot that runs
  // once the kernels issued before the slot's last release_input have run, asynchronously (a
  // GPU's on a stream of its own, beside the kernels); use_input(slot): the kernels issued
  // after it run after the slot's last upload; release_input(slot): the kernels issued so far
  // are the last to read what the slot's last upload wrote; wait_upload(slot): returns once the
  // slot's last upload has read its source, which the host may then write again. Host memory
  // backends never stage.
  virtual void* allocate_host(size_t bytes) const;
  virtual void release_host(void* p) const;
  virtual void upload(void* slot, const void* src, size_t bytes) const {
    to_device(slot, src, bytes);
  }
  virtual void use_input(const void* /*slot*/) const {}
  virtual void release_input(const void* /*slot*/) const {}
  virtual void wait_upload(const void* /*slot*/) const {}
  // Waits until the kernels issued so far have run (a GPU's run asynchronously; timings of a
  // phase end here). The CPU's kernels have run when they return.
  virtual void synchronize() const {}
  // Whether kernels issued so far are still running (a GPU's, queued behind the host); a CPU's
  // have run when they return.
  virtual bool busy() const { return false; }
  // Phase marks: mark() is a point in the device's queue (a GPU's timing event, recorded
  // behind the kernels issued so far; the CPU's: the host clock now, its kernels having run),
  // seconds_between(a, b) the device's time from mark a to mark b, the host waiting for b if it
  // has not passed yet (a GPU's event synchronisation). A phase timed this way needs no
  // synchronize at its end. A GPU keeps the last kMarks marks: older ones are an error.
  static constexpr int64_t kMarks = 512;
  virtual int64_t mark() const;
  virtual double seconds_between(int64_t a, int64_t b) const;
  // A copy from the backend's memory into page-locked host memory (allocate_host) queued behind
  // the kernels issued so far (a GPU's: asynchronous); wait_to_host() returns once every such
  // copy has landed (without blocking where the device is already past them). The default
  // copies at once.
  virtual void to_host_async(void* dst, const void* src, size_t bytes) const {
    to_host(dst, src, bytes);
  }
  virtual void wait_to_host() const {}
  // A copy of host memory into the backend's memory queued behind the kernels issued so far (a
  // GPU's from page-locked memory, staged there: src may be written again on return, and the
  // host does not wait for the device). What a step's arguments take (BertModel's step_args).
  virtual void send(void* dst, const void* src, size_t bytes) const { to_device(dst, src, bytes); }

  // -- graphs: the operations issued between begin_capture and end_capture are recorded, not
  //    run (a GPU's CUDA graph), and launch_graph runs them again, each time with the arguments
  //    they were issued with (what changes from step to step the kernels read from memory:
  //    Dropout::at, SumsInto::divisor_at, RowRuns::counts). Where graphs() is false they are
  //    errors. Nothing in between may wait for the device, allocate, or free. --
  virtual bool graphs() const { return false; }
  virtual void begin_capture() const;
  virtual std::shared_ptr<void> end_capture() const;
  virtual void launch_graph(const std::shared_ptr<void>& graph) const;
  // The device's memory, for a backend with memory of its own (a GPU's: what a run checks its
  // plan against before it allocates); nothing for host memory (the CPU's budget is the host's).
  virtual std::optional<DeviceMemory> device_memory() const { return std::nullopt; }
  // Where the device's time goes, where profiling is on (a GPU's: BERTRAIN_CUDA_PROFILE=1): the
  // device time of each operation since the last call, per step of `steps`, as a table (the
  // sums start again); empty where it is off.
  virtual std::string op_profile(int64_t /*steps*/) const { return {}; }
  // The launches and host synchronisations this process gave the device so far (DeviceCounts);
  // nothing where kernels are calls on the host (the CPU's).
  virtual std::optional<DeviceCounts> device_counts() const { return std::nullopt; }

  // -- the device (what run headers, bench, estimate and doctor say about it) --
  // What it is: the CPU's model, the kernel bodies in use and oneDNN's ISA (and BERTRAIN_ISA's
  // cap); a GPU's name and the library its matmuls use. device_line() prefixes the kind.
  virtual std::string description() const = 0;
  // The device's own name ("NVIDIA H200"; the CPU's model).
  virtual std::string device_name() const = 0;
  // Whether precision p's matmuls run here at all (the CPU's bf16 needs AVX-512: oneDNN has no
  // bf16 matmul on AVX2), and a note for run headers where they run well below the device's
  // rate (the CPU's bf16 emulated without AVX-512 BF16, 0.25-0.4x fp32 measured); empty
  // otherwise.
  virtual bool runs(Precision /*p*/) const { return true; }
  virtual std::string precision_note(Precision /*p*/) const { return {}; }
  // The GEMM ceiling utilisation is reported against: GFLOP/s of the fastest [M,K] x [N,K]^T
  // product with precision p's matmul operands here (gemm_operands), measured now over
  // `seconds` (the CPU's oneDNN matmul; a GPU's cuBLASLt on pseudo-random operands, timed with
  // its events).
  virtual double gemm_peak_gflops(Precision p, int64_t M, int64_t N, int64_t K,
                                  double seconds) const = 0;
  // Bytes of kernel scratch this process took outside a model's plan so far (buffers the
  // kernels grew of their own when nothing, or too little, was bound): a planned step leaves it
  // unchanged (bench reports it; tests/test_memory.cpp checks it).
  virtual int64_t unplanned_scratch_bytes() const = 0;

  // -- a communicator's conversions (16-bit gradients on the wire), on its own queue: a GPU
  //    stream as void* (null: the kernels' own), so they run beside the kernels; the CPU's run
  //    now --
  // The kernels' own queue (a GPU's stream, as void*; null where kernels are calls on the host):
  // what a communicator's queue waits for before it reads what the kernels wrote.
  virtual void* queue() const { return nullptr; }
  // dst = src rounded to p's 16 bits (BF16 or FP16; round to nearest even, as core/dtype.h).
  virtual void round_to_16(Precision p, uint16_t* dst, const float* src, int64_t n,
                           void* queue) const = 0;
  // dst = src widened back to fp32 (exact).
  virtual void widen_from_16(Precision p, float* dst, const uint16_t* src, int64_t n,
                             void* queue) const = 0;
  // x *= s (the average's division).
  virtual void scale_on(float* x, int64_t n, float s, void* queue) const = 0;

  // -- kernel scratch (kernels/types.h) --
  // The region of Target::scratch_layout's layout, bound before the model runs kernels
  // (forward, backward, optimizer). Kernels run with nothing bound still work, on buffers of
  // their own.
  virtual void bind_scratch(void* region, const ScratchLayout& layout) const = 0;

  // -- matmuls --
  // out[M,N] = in[M,K] . w[N,K]^T + bias[N] (bias may be null).
  virtual void linear_forward(Precision p, float* out, Kept in, Weight w, const float* bias,
                              int64_t M, int64_t N, int64_t K, const Workspace& ws) const = 0;
  // The same in a 16-bit p with the output's bits alone written into out16, rounded to nearest
  // even by the product itself, the bias its 16-bit copy (bias16, the weights' copy's: a GPU's
  // product adds a bias of its output's type; its rounding, at most half a unit of the bias in
  // the format, comes before the output's), where Target::writes_16bit_outputs; the default
  // fails.
  virtual void linear_forward_16(Precision p, uint16_t* out16, Kept in, Weight w,
                                 const uint16_t* bias16, int64_t M, int64_t N, int64_t K,
                                 const Workspace& ws) const;
  // dinp[M,K] (= or += with accumulate_dinp), dw[N,K] += dout^T . in, db[N] += column sums
  // (of dout.f32). In a 16-bit precision the products read dout.bits where its producer wrote
  // them (KeptIn), else dout.f32 rounded.
  virtual void linear_backward(Precision p, float* dinp, float* dw, float* db, KeptIn dout, Kept in,
                               Weight w, int64_t M, int64_t N, int64_t K, bool accumulate_dinp,
                               const Workspace& ws) const = 0;
  // The same with dinp (=) written in a 16-bit p's bits alone (dinp16, no fp32 dinp: the product
  // rounds its fp32 sums once, as round_to_16 would), where Target::writes_16bit_outputs and the
  // next products read only those bits (the attention's output projection: dctx for the full
  // kernel's products); the default fails.
  virtual void linear_backward_16(Precision p, uint16_t* dinp16, float* dw, float* db, KeptIn dout,
                                  Kept in, Weight w, int64_t M, int64_t N, int64_t K,
                                  const Workspace& ws) const;

  // -- precision --
  // x (n values) to the kept precision: BF16 writes its bf16 copy to bits; FP16 rounds x in
  // place and writes the fp16 bits; FP32 does nothing.
  virtual void keep(Precision p, Kept x, int64_t n) const = 0;
  // The weights' copy the matmuls read: BF16 rounds master[n] into copy (bf16 bits), FP16 where
  // fp16_operands() (fp16 bits); others do nothing.
  virtual void copy_weights(Precision p, const float* master, uint16_t* copy, int64_t n) const = 0;

  // -- attention core (between the QKV and the output projection) --
  // ctx[B,T,C] from qkv[B,T,3C] (Q, K, V column blocks; FP16: qkv rounded in place first, its
  // bits kept) with BERT's additive mask from mask[B,T]; dropout on the probabilities. ctx is
  // left kept (keep's contract) where ctx.bits is given: what the output projection reads.
  virtual void attention_forward(Precision p, Kept ctx, AttentionSaved saved, Kept qkv,
                                 const int32_t* mask, const AttentionShape& s, const Dropout& d,
                                 const Workspace& ws) const = 0;
  // dqkv[B,T,3C] (=) from dctx; qkv and saved as forward left them.
  virtual void attention_backward(Precision p, float* dqkv, const float* dctx, Kept qkv,
                                  AttentionSaved saved, const int32_t* mask,
                                  const AttentionShape& s, const Dropout& d,
                                  const Workspace& ws) const = 0;
  // The same, with the QKV projection's bias gradient: dbias[3C] (may be null) += dqkv's column
  // sums (its linear_backward then takes no db), and where dqkv.bits is given (a 16-bit
  // precision) dqkv rounded there too (KeptIn: what that backward reads). A GPU's fused kernel
  // writes both as it writes dqkv (one launch; the bias summed in another order than
  // linear_backward's, within fp32 rounding); the default calls attention_backward, then sums
  // and rounds. dctx.bits: dctx's 16-bit copy made already (linear_backward_16, the output
  // projection's product writing it), read by the full kernel's products instead of a rounding
  // of dctx.f32 (which may be null then; the fused kernel reads dctx.f32). dqkv.f32 may be null
  // where the fused kernel runs (Target::fused_attention) and dqkv.bits is given: the 16-bit copy
  // alone, what a GPU's products read.
  virtual void attention_bias_backward(Precision p, Kept dqkv, float* dbias, KeptIn dctx, Kept qkv,
                                       AttentionSaved saved, const int32_t* mask,
                                       const AttentionShape& s, const Dropout& d,
                                       const Workspace& ws) const;

  // -- activations (out / in kept in the precision: BF16 writes out.bits and in.bits, FP16
  //    rounds both and writes their bits, and out.f32 the rounded output where given (a model
  //    whose products read 16-bit operands gives none); FP32 reads in.f32 and writes out.f32;
  //    on a backend that writes_16bit_outputs, in.f32 may be null in a 16-bit precision: the
  //    input's copy alone, as its product wrote it, read at its value) --
  virtual void activation_forward(Precision p, Activation a, Kept out, Kept in,
                                  int64_t n) const = 0;
  // dinp = dout * act'(in) at the kept input (dinp may alias dout).
  virtual void activation_backward(Precision p, Activation a, float* dinp, Kept in,
                                   const float* dout, int64_t n) const = 0;
  // The same over M rows of N, fused with the bias gradient of the linear layer whose output
  // `in` is: db[N] += dinp's column sums (linear_backward's, bit for bit; its call then takes no
  // db). A GPU computes both in one pass over the rows (the FFN's dGELU and its bias gradient:
  // one launch, dinp read once less); the default calls the two. Where dinp.bits is given (a
  // 16-bit precision), dinp rounded is written there too (KeptIn: what the next product reads);
  // on a backend that writes 16-bit outputs (writes_16bit_outputs) dinp.f32 may be null, where
  // only the bits are read next: then they alone are written, and dout may be its 16-bit copy
  // alone (dout.f32 null: what linear_backward_16 wrote), read at its value.
  virtual void activation_bias_backward(Precision p, Activation a, Kept dinp, float* db, Kept in,
                                        KeptIn dout, int64_t M, int64_t N) const;
  // db[N] += dout[M,N]'s column sums: linear_backward's bias gradient alone (what the defaults
  // of the fused calls above and below add).
  void bias_gradient(float* db, const float* dout, int64_t M, int64_t N) const;
  // The tail those defaults share: db[N] (may be null) += x.f32[M,N]'s column sums
  // (bias_gradient's, bit for bit), and where x.bits is given (a 16-bit p) x rounded there. The
  // default calls bias_gradient, then round_to_16; a GPU does both in one pass over x.
  virtual void rounded_column_sums(Precision p, float* db, Kept x, int64_t M, int64_t N) const;
  virtual void tanh_forward(float* out, const float* in, int64_t n) const = 0;
  virtual void tanh_backward(float* dinp, const float* out, const float* dout, int64_t n) const = 0;

  // -- embeddings, LayerNorm and the fused residual blocks (fp32) --
  // out = dropout(LayerNorm(word[id] + position[t] + token_type[segment])); sum kept. The
  // position of row i is positions[i], or i % T where positions is null.
  virtual void embedding_layernorm_forward(float* out, float* sum, float* mean, float* rstd,
                                           const int32_t* ids, const int32_t* segment,
                                           const int32_t* positions, const float* word,
                                           const float* position, const float* token_type,
                                           const float* gamma, const float* beta, int64_t B,
                                           int64_t T, int64_t C, float eps,
                                           const Dropout& d) const = 0;
  // The three tables' gradients += dout's rows. `runs` (null on host memory): the tokens grouped
  // by table row (types.h, EmbeddingRuns; the model stages them with the batch), which a backend
  // with memory of its own sums by.
  virtual void embedding_backward(float* dword, float* dposition, float* dtoken_type,
                                  const float* dout, const int32_t* ids, const int32_t* segment,
                                  const int32_t* positions, int64_t B, int64_t T, int64_t C,
                                  const EmbeddingRuns* runs) const = 0;
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* in,
                                 const float* gamma, const float* beta, int64_t N, int64_t C,
                                 float eps) const = 0;
  virtual void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                                  const float* in, const float* gamma, const float* mean,
                                  const float* rstd, int64_t N, int64_t C) const = 0;
  // x = dropout(x) + residual (in place), out = LayerNorm(x); where out.bits is given (p a 16-bit
  // precision) out rounded there in the same pass (round_to_16's rounding: the copy the next
  // product reads as its input, Kept.bits, instead of rounding it in a pass of its own).
  virtual void residual_layernorm_forward(Precision p, Kept out, float* mean, float* rstd, float* x,
                                          const float* residual, const float* gamma,
                                          const float* beta, int64_t N, int64_t C, float eps,
                                          const Dropout& d) const = 0;
  // The same with the projection's output given as its 16-bit copy alone (y16, p's bits, as its
  // product wrote them: linear_forward_16): x = dropout(y16 widened) + residual written (what
  // backward reads), out = LayerNorm(x), where Target::writes_16bit_outputs; the default fails.
  virtual void residual_layernorm_forward_16(Precision p, Kept out, float* mean, float* rstd,
                                             float* x, const uint16_t* y16, const float* residual,
                                             const float* gamma, const float* beta, int64_t N,
                                             int64_t C, float eps, const Dropout& d) const;
  // Its backward: dinp (= or +=) the gradient of x (and of the residual), ddropped that of the
  // projection's output (through the dropout), and where ddropped.bits is given (p a 16-bit
  // precision) that rounded in the same pass (KeptIn: what the projection's backward reads; on
  // a backend that writes_16bit_outputs, ddropped.f32 may be null: the copy alone). dbias (may
  // be null; needs ddropped): the projection's bias gradient, += ddropped's column sums
  // (linear_backward's, bit for bit; its call then takes no db): a GPU's in the same launch.
  virtual void layernorm_dropout_backward(Precision p, float* dinp, Kept ddropped, float* dgamma,
                                          float* dbeta, float* dbias, const float* dout,
                                          const float* in, const float* gamma, const float* mean,
                                          const float* rstd, int64_t N, int64_t C,
                                          bool accumulate_dinp, const Dropout& d) const = 0;

  // -- elementwise --
  // x = dropout(x) in place, dx = dropout(dy) with its mask (dx may alias dy): N rows of C
  // values, element (r, c) keyed at d.offset + R C + c, R = d.rows[r] where a row map is given
  // (an unpadded model's rows drawing as their padded rows: one call for every sequence), else r.
  virtual void dropout_forward(float* x, int64_t N, int64_t C, const Dropout& d) const = 0;
  virtual void dropout_backward(float* dx, const float* dy, int64_t N, int64_t C,
                                const Dropout& d) const = 0;
  virtual void add_inplace(float* out, const float* a, int64_t n) const = 0;
  virtual void copy(float* dst, const float* src, int64_t n) const = 0;

  // -- token rows (the heads read a few rows of the sequence output) --
  // out[r] = seq row (r / P) * T + (positions ? positions[r] : 0), r < B * P, rows of C values:
  // the [CLS] rows (positions null, P = 1) for the pooler, the masked positions for the MLM head.
  // T = 0 makes positions absolute rows (an unpadded model's packed rows).
  virtual void gather_rows(float* out, const float* seq, const int32_t* positions, int64_t B,
                           int64_t P, int64_t T, int64_t C) const = 0;
  // Its backward: that row of dseq += d[r] (positions may repeat within a sequence).
  virtual void scatter_add_rows(float* dseq, const float* d, const int32_t* positions, int64_t B,
                                int64_t P, int64_t T, int64_t C) const = 0;
  // x *= s (types.h Multiplier: a factor in the backend's memory is read where the kernel runs).
  virtual void scale_inplace(float* x, int64_t n, Multiplier s) const = 0;
  virtual void zero(void* p, int64_t bytes) const = 0;

  // -- loss --
  // Softmax cross-entropy of N rows over c.V classes (rows of c.stride values: types.h Classes),
  // fused with its gradient (dlogits may be null or alias logits; its padding columns written 0):
  // kernels/cpu/cross_entropy.h. Where `losses` (N values, the backend's buffer for the per-row
  // losses) is given, returns sum_i weight[i] * loss[i] and sum_i weight[i] * [argmax of row i ==
  // target] (weight 1 where weights is null; `correct`, the per-row hits' buffer, null when the
  // hits are not wanted). A gradient-only call (losses null) returns zero sums: on a GPU the sums
  // are a host synchronisation it then does not make. The gradient is of dscale x the loss
  // (types.h Multiplier: fp16's loss scale may be a factor in the backend's memory).
  virtual CrossEntropySums cross_entropy(float* dlogits, float* losses, int32_t* correct,
                                         const float* logits, const int32_t* targets,
                                         const float* weights, int64_t N, Classes c,
                                         Multiplier dscale) const = 0;
  // The same, its sums added where `into` says (types.h SumsInto) instead of returned: on a GPU
  // a small kernel after it, no host synchronisation. The default (host memory, or any backend
  // through to_host/to_device) adds cross_entropy's returned sums.
  virtual void cross_entropy_into(const SumsInto& into, float* dlogits, float* losses,
                                  int32_t* correct, const float* logits, const int32_t* targets,
                                  const float* weights, int64_t N, Classes c,
                                  Multiplier dscale) const;

  // Squared error of N predictions (a regression head, HF's MSELoss summed): returns
  // sum_i (pred[i] - target[i])^2 and, when dpred is not null, writes
  // dpred[i] = dscale * 2 * (pred[i] - target[i]).
  virtual double squared_error(float* dpred, const float* pred, const float* target, int64_t N,
                               Multiplier dscale) const = 0;
  // The same, the sum / the divisor added where `into` says (types.h SumsInto: its loss and
  // nonfinite; no hits) instead of returned: on a GPU a kernel adding the rows in order (the
  // bits of the returned sum), no host synchronisation; neither given, the gradient alone. The
  // default adds squared_error's sum through to_host/to_device.
  virtual void squared_error_into(const SumsInto& into, float* dpred, const float* pred,
                                  const float* target, int64_t N, Multiplier dscale) const;

  // -- optimizer (one parameter tensor; kernels/cpu/optimizer.h) --
  virtual void add_sum_squares(double& sum, const float* g, int64_t n, double scale) const = 0;
  virtual void adamw_update(const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m,
                            float* v, int64_t n) const = 0;
  virtual void lamb_update(const LambStep& a, float* p, uint16_t* p16, const float* g, float* m,
                           float* v, int64_t n) const = 0;
  // LAMB's two passes, for a tensor updated in parts on several ranks: moments (adding the
  // squared norms of p and of the update direction to pn, un), then the move by `step`
  // (lr x the whole tensor's trust ratio, kernels::lamb_trust).
  virtual void lamb_moments(const LambStep& a, const float* p, const float* g, float* m, float* v,
                            int64_t n, double& pn, double& un) const = 0;
  virtual void lamb_apply(const LambStep& a, float* p, uint16_t* p16, const float* m,
                          const float* v, int64_t n, float step) const = 0;

  // -- optimizer over the tensors of one step (kernels/types.h TensorSpan; p, p16 and g at a
  //    span's offset, m and v at its state; one step or trust ratio per span). The defaults call
  //    the one-tensor operations above in span order, so the CPU's results are theirs bit for
  //    bit; a GPU runs each as one pass over all the tensors with at most one synchronisation.
  //    (Pointers and counts: this header is compiled as CUDA C++17 too.)
  virtual void add_sum_squares(double& sum, const float* g, const TensorSpan* t, int64_t count,
                               double scale) const;
  // With a gate (types.h GradientGate, in the backend's memory: gate_gradients wrote it), each
  // step's gscale is the gate's factor, its bias corrections those of the gate's update count
  // (types.h gated), and nothing is updated when the gate says so; the host does not read it (a
  // GPU's kernels do). Without (null), the steps as given.
  virtual void adamw_update(const AdamwStep* a, float* p, uint16_t* p16, const float* g, float* m,
                            float* v, const TensorSpan* t, int64_t count,
                            const GradientGate* gate) const;
  virtual void lamb_update(const LambStep* a, float* p, uint16_t* p16, const float* g, float* m,
                           float* v, const TensorSpan* t, int64_t count,
                           const GradientGate* gate) const;
  // The step's gate (types.h next_gate) from the one in `gate` (the backend's memory) and the
  // gradients g x unscale / its loss scale over the spans, their squared norm summed as
  // add_sum_squares sums it, written over it: the decision, the update count and the loss scale
  // on (a GPU's: on the device, no host synchronisation). The default sums through
  // add_sum_squares and copies the gates across.
  virtual void gate_gradients(GradientGate* gate, const float* g, const TensorSpan* t,
                              int64_t count, float unscale, float max_norm) const;
  // The arguments of an adamw_update / lamb_update over these spans placed where its kernels
  // read them, ahead of a graph (begin_capture) that holds the update: inside a capture the
  // update finds them there (a GPU sends them to the device; a graph's copy would read the
  // host's buffer when it runs). Nothing to do where the update reads its arguments as called.
  virtual void stage_update(const AdamwStep* /*a*/, const TensorSpan* /*t*/,
                            int64_t /*count*/) const {}
  virtual void stage_update(const LambStep* /*a*/, const TensorSpan* /*t*/,
                            int64_t /*count*/) const {}
  // pn[i] and un[i] += span i's squared norms.
  virtual void lamb_moments(const LambStep* a, const float* p, const float* g, float* m, float* v,
                            const TensorSpan* t, int64_t count, double* pn, double* un) const;
  virtual void lamb_apply(const LambStep* a, float* p, uint16_t* p16, const float* m,
                          const float* v, const TensorSpan* t, int64_t count,
                          const float* step) const;
};

// -- the devices this build and this machine have (kernels/devices.cpp): every other part
//    asks here, never in kernels/cpu or kernels/cuda, and never by the build's macros --

// The CPU backend (ISA-dispatched kernels, oneDNN matmuls).
const Backend& cpu_backend();
// Whether this build has the GPU backend (-DBERTRAIN_CUDA=ON; or -DBERTRAIN_CUDA_EMU=ON, the
// emulated device of cuda_emu/).
bool gpu_built();
// The GPUs this process sees: 0 without the backend, a driver or a GPU (callers fall back to
// the CPU or say what is missing, never crash).
int gpu_count();
// The GPU backend where gpu_count() > 0; null otherwise.
const Backend* gpu_backend();
// The GPU backend as a memory plan sees it, in every build (`estimate --device cuda` plans a GPU
// run where there is none).
const Target& gpu_target();
// The GPU the calling thread's kernels and allocations use from now on (a rank's own on a host
// of several); an error in a build without the GPU backend.
void select_gpu(int device);

// The operands of precision p's matmuls on a target: "bf16"; "fp16" in FP16 where it multiplies
// fp16 (Target::fp16_operands); "fp32" otherwise (the CPU's FP16 computes in fp32).
const char* gemm_operands(const Target& t, Precision p);
// A line naming a backend's device for run headers: "cpu        <description>" or
// "gpu        <description>".
std::string device_line(const Backend& be);

}  // namespace bertrain::kernels
