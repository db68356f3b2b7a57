// Types shared by the kernel interface (kernels/backend.h) and every backend's kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"
#include "core/precision.h"

namespace bertrain::kernels {

// (The precision: core/precision.h, bertrain::Precision, one type for every part.)

enum class Activation { GeluErf, GeluTanh, Relu };

// Attention dimensions: batch, tokens, hidden, heads; dropout_T (0: T) the row length of the
// dropout index space, larger than T when sequences of T tokens run out of a batch padded to
// dropout_T (an unpadded model's runs): probability (b, h, i, j) is dropout element
// ((b * NH + h) * dropout_T + i) * dropout_T + j.
struct AttentionShape {
  int64_t B, T, C, NH;
  int64_t dropout_T = 0;
  // Variable lengths (a backend whose fused_attention says so): sequence b is rows
  // [starts[b], starts[b + 1]) of the QKV and context rows (backend memory, B + 1 values, each
  // length at most T; its mask row and dropout those of its rows), `rows` rows in all; its row
  // log-sum-exp from NH starts[b] on. The rows past the sequences, [starts[B], rows), are
  // written zero (the context forward, dQKV backward, with their 16-bit copies): whatever the
  // batch's lengths, the call's launches are the same. Null: sequence b is rows [b T, b T + T).
  const int32_t* starts = nullptr;
  int64_t rows = 0;
  // The dropout index of row i of (sequence, head) bh, before the column.
  BT_HOST_DEVICE uint64_t dropout_row(int64_t bh, int64_t i) const {
    const int64_t t = dropout_T > 0 ? dropout_T : T;
    return static_cast<uint64_t>((bh * t + i) * t);
  }
};

// The shapes a model runs, for its backend's kernel scratch (Backend::scratch_layout): every
// linear layer's [M,K] x [N,K]^T, the attention core and which kernel runs it, the widest
// LayerNorm row.
struct LinearShape {
  int64_t M, N, K;
};
struct KernelShapes {
  Precision precision = Precision::FP32;
  const LinearShape* linears = nullptr;
  int64_t num_linears = 0;
  AttentionShape attention{0, 0, 0, 0};
  int64_t sequences = 0;  // the most sequences attention runs over (a packed batch's: past B)
  bool blocked_attention = false;
  int64_t layernorm_width = 0;  // the widest LayerNorm row (the hidden size)
  int64_t tokens = 0;           // the most tokens a pass runs (embedding, LayerNorm rows)
  int64_t loss_rows = 0;        // the most rows one cross-entropy or squared error is given
  // The optimizer's: parameters (values) and tensors of a step.
  int64_t parameters = 0, tensors = 0;
};

// Kernel scratch: what the kernels use besides their operands (the CPU's: oneDNN's GEMM
// scratchpad, attention row buffers and mask rows, LayerNorm's and the optimizer's per-thread
// partial sums; a GPU's: cuBLASLt's workspace, attention's score buffers, the reductions'
// partial sums). `caller` bytes for the thread that calls the kernels (the products it makes
// itself, outside parallel regions), then one slice per thread of the parts' bytes in order,
// each rounded up to 64 bytes. The model plans total() bytes (group "kernels").
struct ScratchLayout {
  static constexpr int kParts = 12;
  int threads = 1;
  int64_t caller = 0;
  int64_t part[kParts] = {};
  static int64_t rounded(int64_t b) { return (b + 63) / 64 * 64; }
  int64_t offset(int i) const {  // of part i in a thread's slice
    int64_t o = 0;
    for (int j = 0; j < i; ++j) o += rounded(part[j]);
    return o;
  }
  int64_t stride() const { return offset(kParts); }
  int64_t total() const { return rounded(caller) + threads * stride(); }
  bool operator==(const ScratchLayout& o) const {
    bool same = threads == o.threads && caller == o.caller;
    for (int i = 0; i < kParts; ++i) same = same && part[i] == o.part[i];
    return same;
  }
};

// Column sums on a GPU (a linear layer's bias gradient, LayerNorm's parameter gradients; the
// CUDA backend's kernels/cuda/scratch.h): rows in chunks of at least kColumnRows, at most
// kColumnChunks chunks, kColumnTile columns a block, each chunk's partial sums written and then
// added in order. The fused attention's backward sums QKV's bias gradient in tiles of
// kFusedAttentionTile rows of each sequence. What the scratch plan and the traffic model
// (plan/traffic.h) count.
// (32 rows: BERT's 4096-row batches in 128 chunks, a block each where LayerNorm's backward sums
// its parameter gradients in its rows' launch, about an H200's 132 multiprocessors)
constexpr int64_t kColumnRows = 32, kColumnChunks = 256, kColumnTile = 256;
inline int64_t column_chunks(int64_t rows) {
  const int64_t c = (rows + kColumnRows - 1) / kColumnRows;
  return c < 1 ? 1 : c > kColumnChunks ? kColumnChunks : c;
}
constexpr int64_t kFusedAttentionTile = 64;  // (a block of four warps' rows)
inline int64_t fused_attention_tiles(int64_t sequences, int64_t T) {
  return sequences * ((T + kFusedAttentionTile - 1) / kFusedAttentionTile);
}
// The fused kernels' tensor-core work (2 M N K a product) over `sequences` sequences of T tokens
// (a variable-length batch: the sum of each sequence's), each of `heads` heads of `head_size`:
// a warp takes 16 rows (the rows rounded up to 16, warps past the sequence idle) against the
// other side a step at a time (forward: 64 keys, 32 at head sizes past 64; backward: 32), the
// length rounded up to the step. Forward: Q K^T twice (the row statistics' pass, then the
// probabilities') and P V, 3 products; backward: S and dd = dO V^T in both kinds of block, dQ
// in one, dK and dV in the other, 7. What the traffic model counts (the emulator checks it).
inline double fused_attention_flops(int64_t sequences, int64_t heads, int64_t T, int64_t head_size,
                                    bool forward) {
  const auto up = [](int64_t x, int64_t to) { return static_cast<double>((x + to - 1) / to * to); };
  const double other = up(T, forward && head_size <= 64 ? 64 : 32);
  return (forward ? 3 : 7) * 2 * up(T, 16) * other *
         static_cast<double>(head_size * heads * sequences);
}

// Embedding backward's token rows grouped by the table row they add to, for a backend whose
// threads each sum one table row's gradients (a GPU's, which has no order among atomics; built on
// the host with the batch: kernels/embedding_runs.h). `order` lists the token rows by table
// row, in token order within one, cut into chunks of at most kEmbeddingChunk tokens. A table row
// of one chunk adds its tokens to the row in token order (the CPU kernel's sums, bit for bit);
// a row of several sums each chunk into a partial row (`partial` >= 0), then adds the partials
// in order (EmbeddingSum). Pointers are the backend's memory; counts are the host's.
constexpr int64_t kEmbeddingChunk = 64;
struct EmbeddingChunk {
  int32_t begin, end, row, partial;  // order[begin, end) add to table row `row`
};
struct EmbeddingSum {
  int32_t row, first, count;  // partial rows [first, first + count) add to table row `row`
};
// num_chunks and num_sums are the grids' blocks; where counts is given (the backend's memory:
// {chunks, sums} of the batch, staged with it) they are bounds, and blocks past the counts
// return at once: a CUDA graph's launches, whose grids are the capture's, hold any batch.
struct RowRuns {
  const int32_t* order = nullptr;
  const EmbeddingChunk* chunks = nullptr;
  const EmbeddingSum* sums = nullptr;
  int64_t num_chunks = 0, num_sums = 0, partials = 0;
  const int32_t* counts = nullptr;
};
// The three tables' (word, position, token type) of one batch.
struct EmbeddingRuns {
  RowRuns word, position, token_type;
};

// A cross-entropy's rows: V classes in rows of `stride` values (stride >= V). The model's masked
// LM pads its vocabulary to a multiple of 64 (BertModel::vocab_rows): the columns past V are
// padding, never a class, and their gradient is written 0. From a count alone: rows of V.
struct Classes {
  int64_t V, stride;
  Classes(int64_t v) : V(v), stride(v) {}  // NOLINT(google-explicit-constructor): rows of V
  Classes(int64_t v, int64_t s) : V(v), stride(s) {}
};

// A factor a kernel multiplies by: `by`, times *times where given (a value in the backend's
// memory the kernel reads where it runs: fp16's loss scale kept on the device, LossScale). From a
// plain float: that value. Only the backend's kernels read *times (the caller passes the
// pointer; on the CPU, whose memory is the host's, the kernel reads it there).
struct Multiplier {
  float by = 1.0f;
  const float* times = nullptr;
  Multiplier() = default;
  Multiplier(float f) : by(f) {}  // NOLINT(google-explicit-constructor): that value
  Multiplier(float f, const float* t) : by(f), times(t) {}
  // This factor / d (by divided, in double, as the host's factors are).
  Multiplier over(double d) const { return {static_cast<float>(by / d), times}; }
  bool is_one() const { return !times && by == 1.0f; }
  BT_HOST_DEVICE float value() const { return times ? by * *times : by; }
};

// What Backend::cross_entropy returns: the weighted loss and the weighted count of hits.
struct CrossEntropySums {
  double loss = 0, correct = 0;
};

// Where Backend::cross_entropy_into adds its sums, in the backend's memory (doubles; null: not
// wanted): *loss += the weighted loss / loss_divisor, *hits += the weighted hits, *nonfinite += 1
// where the weighted loss is not finite. A step's statistics stay on the device this way and
// cross to the host once (BertModel::step_sums).
struct SumsInto {
  double* loss = nullptr;
  double loss_divisor = 1.0;
  double* hits = nullptr;
  double* nonfinite = nullptr;
  // The backend's memory (null: none): the divisor as the step's arguments hold it when the
  // kernel runs, in place of loss_divisor (Dropout::at's reason).
  const double* divisor_at = nullptr;
  BT_HOST_DEVICE double divisor() const { return divisor_at ? *divisor_at : loss_divisor; }
};

// torch.optim.AdamW with g * gscale: p = p * decay - step_size * m / (sqrt(v) / sqrt_bc2 + eps)
// where decay = 1 - lr * wd, step_size = lr / bc1.
// The update also writes the parameters' 16-bit copy where one is given (p16): bf16 bits, or fp16
// with f16_copy (a GPU's FP16 products read an fp16 copy: WeightCopy).
struct AdamwStep {
  float gscale, beta1, beta2, step_size, sqrt_bc2, eps, decay;
  bool f16_copy = false;
  float lr = 0;  // (step_size's: bias_correct)
};

// LAMB with g * gscale: u = m / bc1 / (sqrt(v / bc2) + eps) + wd p (ibc = 1 / bc), then
// p -= lr * trust * u with trust = ||p|| / ||u|| when wd != 0 and both norms are positive.
struct LambStep {
  float gscale, beta1, beta2, ibc1, ibc2, eps, wd, lr;
  bool f16_copy = false;  // as AdamwStep's
};

// The parameters' 16-bit copy the matmuls read, which the optimizer's update writes: bf16 bits
// in BF16, fp16 bits in FP16 on a backend whose products take fp16 operands
// (Target::fp16_operands); none otherwise.
struct WeightCopy {
  uint16_t* bits = nullptr;
  bool f16 = false;
};

// LAMB's trust ratio of a tensor from the squared norms of its parameters and of its update
// direction: ||p|| / ||u|| for tensors with weight decay (when both are non-zero), else 1.
// One tensor of an optimizer step: its values at `offset` of the flat parameter and gradient
// buffers, its optimizer state at `state` of the (possibly sharded) moment buffers, n values.
struct TensorSpan {
  int64_t offset, state, n;
};

BT_HOST_DEVICE inline float lamb_trust(const LambStep& a, double pn, double un) {
  if (a.wd != 0.0f && pn > 0 && un > 0) return static_cast<float>(sqrt(pn) / sqrt(un));
  return 1.0f;
}

// Update number t's (1-based) bias corrections, bc_k = 1 - beta_k^t, into a step's arguments:
// AdamW's step_size = lr / bc1 and sqrt_bc2, LAMB's 1 / bc1 and 1 / bc2 (in double, then
// rounded). The host's steps and a gate's (gated, on the device) come from here. (A GPU's pow
// differs from the host's by at most 2 units in the last place of the double, far below the
// float the factor is rounded to.)
BT_HOST_DEVICE inline void bias_correct(AdamwStep& a, int64_t t) {
  const double bc1 = 1.0 - pow(static_cast<double>(a.beta1), static_cast<double>(t));
  const double bc2 = 1.0 - pow(static_cast<double>(a.beta2), static_cast<double>(t));
  a.step_size = static_cast<float>(a.lr / bc1);
  a.sqrt_bc2 = static_cast<float>(sqrt(bc2));
}
BT_HOST_DEVICE inline void bias_correct(LambStep& a, int64_t t) {
  const double bc1 = 1.0 - pow(static_cast<double>(a.beta1), static_cast<double>(t));
  const double bc2 = 1.0 - pow(static_cast<double>(a.beta2), static_cast<double>(t));
  a.ibc1 = static_cast<float>(1.0 / bc1);
  a.ibc2 = static_cast<float>(1.0 / bc2);
}

// fp16's dynamic loss scale (train::LossScaler; PyTorch's GradScaler rule, as its
// _amp_update_scale_): a step whose gradients are all finite counts toward growth, and after
// growth_interval of them in a row the scale grows; a step with any inf/NaN is skipped and the
// scale backs off (not below min_scale). Where the step is decided on the device (GradientGate)
// the scale lives there and the host replays the same rule when it reads the steps.
// Disabled (fp32, bf16): the scale stays 1.
struct LossScale {
  float scale = 1.0f;
  int32_t good = 0;     // finite steps in a row since the scale last changed
  int32_t bad = 0;      // non-finite steps in a row
  int32_t enabled = 0;  // 0: the scale stays 1
  float growth = 2.0f, backoff = 0.5f, min_scale = 1.0f;
  int32_t growth_interval = 2000;
};

BT_HOST_DEVICE inline void next_loss_scale(LossScale& s, bool finite) {
  if (finite) {
    s.bad = 0;
    if (s.enabled && ++s.good >= s.growth_interval) {
      s.scale *= s.growth;
      s.good = 0;
    }
    return;
  }
  ++s.bad;
  s.good = 0;
  if (s.enabled) s.scale = fmaxf(s.min_scale, s.scale * s.backoff);
}

// A step's update decided where the gradients are (Backend::gate_gradients; a GPU's: no host
// synchronisation): the squared norm of the unscaled gradients, whether every gradient is finite
// (apply 0: every update pass given the gate leaves parameters and moments as they were), and
// the factor the update multiplies each gradient by, unscale x PyTorch's clip_grad_norm_
// coefficient max_norm / (norm + 1e-6) where the norm exceeds max_norm (max_norm 0: no clipping).
// The update passes take the factor as their steps' gscale.
// The gate also keeps what passes from step to step where the steps are decided: the updates
// applied (the bias corrections count them: a skipped step is not one) and the loss scale
// (LossScale, which the gradients of the next step's backward carry). gate_gradients reads them
// and writes the next ones (next_gate); the host writes them only to start from its own.
struct GradientGate {
  double sum_squares = 0;
  float factor = 1.0f;
  int32_t apply = 1;
  float loss_scale = 1.0f;  // the scale this step's gradients carry (the scale before the update)
  int64_t steps = 0;        // updates applied, this one included
  LossScale scale;          // the scale for the next step's backward
};

BT_HOST_DEVICE inline GradientGate gradient_gate(double sum_squares, float unscale,
                                                 float max_norm) {
  GradientGate g;
  g.sum_squares = sum_squares;
  g.apply = sum_squares - sum_squares == 0.0 ? 1 : 0;  // (finite: inf - inf and NaN are NaN)
  const double norm = sqrt(sum_squares);
  const double clip = g.apply && max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
  g.factor = static_cast<float>(static_cast<double>(unscale) * clip);
  return g;
}

// The unscaling factor of gradients that carry loss scale s: unscale / s (the host's factor,
// rounded from double the same way; unscale itself when s is 1).
BT_HOST_DEVICE inline float unscale_by(float unscale, const LossScale& s) {
  return static_cast<float>(static_cast<double>(unscale) / static_cast<double>(s.scale));
}

// The gate of the step after `prev`: the gradients' squared norm `sum_squares` (of the gradients
// x unscale_by(unscale, prev.scale)), the update counted where applied, the scale's rule run.
BT_HOST_DEVICE inline GradientGate next_gate(const GradientGate& prev, double sum_squares,
                                             float unscale, float max_norm) {
  GradientGate g = gradient_gate(sum_squares, unscale_by(unscale, prev.scale), max_norm);
  g.loss_scale = prev.scale.scale;
  g.steps = prev.steps + g.apply;
  g.scale = prev.scale;
  next_loss_scale(g.scale, g.apply != 0);
  return g;
}

// A step's arguments under a gate: its gscale the gate's factor, its bias corrections those of
// the gate's update count.
template <class StepArgs>
BT_HOST_DEVICE inline StepArgs gated(StepArgs a, const GradientGate& g) {
  a.gscale = g.factor;
  bias_correct(a, g.steps);
  return a;
}

// -- the operands of the backend's operations (backend.h), which its implementations take as they
//    are --

// A tensor forward keeps for backward, in the model's precision: `f32` the values forward
// computes with (in 16-bit precisions possibly a scratch buffer, gone by backward), `bits` its
// 16-bit copy (bf16 or fp16 raw bits by precision; null in fp32). Forward's matmuls read `bits`
// in BF16 when present (else they round `f32`), `f32` otherwise; backward reads `bits` whenever
// present (the 16-bit value is what forward used), `f32` otherwise.
// (A plain pointer converts to one without a copy.)
struct Kept {
  float* f32 = nullptr;
  uint16_t* bits = nullptr;
  Kept() = default;
  Kept(float* values, uint16_t* copy = nullptr) : f32(values), bits(copy) {}
};

// An operand read in fp32 and, where its producer wrote one in the same pass, its 16-bit copy:
// `bits` is `f32` rounded to the precision's 16-bit operands (bf16 in BF16; fp16 in FP16 where
// the products take fp16 operands), which a product reads instead of rounding `f32` again (the
// 16-bit dataflow: a GPU's output gradients). A plain pointer converts to one without.
struct KeptIn {
  const float* f32 = nullptr;
  const uint16_t* bits = nullptr;
  KeptIn() = default;
  KeptIn(const float* values, const uint16_t* copy = nullptr) : f32(values), bits(copy) {}
  KeptIn(const Kept& k) : f32(k.f32), bits(k.bits) {}
};

// A linear layer's weight: the fp32 master and its 16-bit copy where the matmuls read one
// (WeightCopy: bf16 bits in BF16; fp16 bits in FP16 with fp16 operands).
struct Weight {
  const float* f32 = nullptr;
  const uint16_t* bits = nullptr;
};

// Scratch the precision paths need, regions of the model's memory plan (BertModel::make_plan):
// 16-bit operands rounded on the fly (a: a forward input or an output gradient, b: a backward
// input; bf16, or fp16 with fp16 operands), the FP16 tensor widened back to fp32 for backward,
// attention's 16-bit operands (the same), and the full attention kernel's [B,NH,T,T] work
// buffer.
struct Workspace {
  uint16_t *half_a = nullptr, *half_b = nullptr;
  float* wide = nullptr;
  uint16_t *attn_probs16 = nullptr, *attn_dctx16 = nullptr;
  float* attn_work = nullptr;
};

// What attention keeps for backward: the softmax output (probs in fp32, or probs16 in BF16 /
// FP16), or, for the blocked (flash-style) kernel, only the row log-sum-exp `lse` [B,NH,T].
struct AttentionSaved {
  float* probs = nullptr;
  uint16_t* probs16 = nullptr;
  float* lse = nullptr;
  // The fused kernels' (a GPU's, blocked in a 16-bit precision): the context's 16-bit copy, which
  // forward writes (the context's own kept bits where the caller keeps them: the same pointer)
  // and backward reads (each row's D = dO . O).
  uint16_t* ctx16 = nullptr;
  bool blocked() const { return lse != nullptr; }
};

// Dropout of one site: element i kept iff rng_uniform(key, offset + i) >= p (core/rng.h, the
// same on host and device). rows (the row kernels: embedding and the LayerNorm blocks): element
// (r, c) of a C-wide row is element rows[r] * C + c, so an unpadded model's packed row draws
// its padded row's mask. at (the backend's memory, null: none): the site's key and first index
// as the step's arguments hold them when the kernels run, {key, offset}, in place of key and
// added to offset: what a kernel replayed from a CUDA graph draws with (its launch arguments
// are the capture's, the step's are not).
struct Dropout {
  float p = 0;
  uint64_t key = 0, offset = 0;
  const int32_t* rows = nullptr;
  const uint64_t* at = nullptr;
};
// d with at's key and offset in place: what a kernel draws with (read where it runs).
BT_HOST_DEVICE inline Dropout resolved(Dropout d) {
  if (d.at) {
    d.key = d.at[0];
    d.offset += d.at[1];
    d.at = nullptr;
  }
  return d;
}

}  // namespace bertrain::kernels
