// BertModel: forward and hand-written backward of BERT with a pretraining (MLM + NSP) or a
// sequence-classification head, over a flat parameter buffer (params.h) and an activation
// arena sized by the memory plan for (max batch, seq len, max predictions).
// Invariants: forward overwrites activations; backward accumulates (+=) into gradients, so
// gradient accumulation is "call forward/backward K times, then step". backward overwrites the
// logits buffers with their gradients. Dimension letters: B batch, T tokens, C hidden, NH heads,
// I intermediate, V vocab, P masked predictions per sequence, N = B*T rows.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "kernels/backend.h"
#include "kernels/embedding_runs.h"
#include "model/batch.h"
#include "model/config.h"
#include "model/graphs.h"
#include "model/params.h"
#include "obs/timeline.h"

namespace bertrain::model {

struct ModelDims {
  int64_t batch = 8, seq_len = 128, max_predictions = 20;
  // The precision (core/precision.h). BF16: matmuls take bf16 inputs and a bf16 copy of the
  // weights (refreshed from the fp32 parameters at every forward), accumulate and output fp32;
  // LayerNorm, softmax, losses and all gradients stay fp32.
  // FP16 stores what backward keeps of QKV, the attention probabilities and context and the FFN
  // pre- and post-activation in fp16 (the tensors BF16 keeps in bf16, with fp16's 11-bit
  // significand), each rounded before forward uses it, so backward differentiates exactly what
  // forward computed. On a CPU the kernels compute in fp32 on the fp32 weights: oneDNN has no
  // fp16 matmul for CPUs without AVX512-FP16, and an fp16 copy of the weights would only add
  // memory and error to fp32 matmuls (a GPU's: fp16_operands). Gradients stay fp32.
  Precision precision = Precision::FP32;
  // The attention core: the full kernel (batched products, [B,NH,T,T] probabilities kept for
  // backward) or the blocked one (row blocks, only the row log-sum-exp kept; kernels/cpu/
  // attention.h). Auto: blocked from 512 tokens, where it runs as fast and the probabilities
  // would be the largest activation; full where the backend prefers it (on_backend: a GPU's in
  // bf16 and fp16, kernels::Target::prefers_full_attention).
  enum class Attention { Auto, Full, Blocked } attention = Attention::Auto;
  // FP16 on a backend whose matmuls take fp16 operands (kernels::Target::fp16_operands, a GPU's;
  // set by on_backend, not by users): as bf16 with fp16 for bf16, an fp16 copy of the weights
  // (written by the optimizer's update) and the products' other operands rounded to fp16 (the
  // output gradients under the loss scale), accumulation in fp32.
  bool fp16_operands = false;
  // Blocked attention that runs as one fused kernel on the backend (kernels::Target::
  // fused_attention, a GPU's in bf16 and fp16; set by on_backend, not by users): a batch of
  // packed sequences in one call (dctx's 16-bit copy planned only where its product writes it:
  // qkv16_output; otherwise the kernel rounds dctx as it reads it).
  bool fused_attention = false;
  // QKV's product writes its 16-bit copy alone, no fp32 output (Target::writes_16bit_outputs, a
  // GPU's; set by on_backend, not by users): 16-bit operands and the full attention over padded
  // rows, whose products read only the copy, or the fused kernel, which reads it too (sequences
  // a call each, the blocked products over runs of equal lengths, round theirs a call each:
  // not there). The product adds the
  // bias's 16-bit copy (cuBLASLt's bias is of its output's type): QKV differs from the CPU's by
  // that rounding of the bias, at most half a unit of the bias in the format, before its own.
  // Backward the same way: the output projection's product writes dctx's 16-bit copy alone
  // (Backend::linear_backward_16), which the attention's products read (the same bits as
  // rounding fp32 values: no difference there). The fused kernel then writes the context's
  // 16-bit copy alone too (what the output projection's products read).
  bool qkv16_output = false;
  // The FFN's intermediate product writes its output's (GELU's input's) 16-bit copy alone, the
  // bias's 16-bit copy added in its epilogue, and GELU reads it (a GPU's, with the weights'
  // copy; set by on_backend): the layer's widest fp32 tensor [N, I] neither written nor read.
  // GELU then takes the rounded input (in bf16; fp16 rounds it in every case): its output
  // differs from the CPU's by at most the rounding of its input and the bias (GELU's slope is at
  // most 1.13), a unit of the format after its own rounding.
  bool inter16_output = false;
  // The attention-output and FFN-output projections write their output's 16-bit copy alone (one
  // buffer all layers share, read at once), the bias's 16-bit copy added in the epilogue, and the
  // residual LayerNorm reads it (Backend::residual_layernorm_forward_16; a GPU's, with the
  // weights' copy; set by on_backend): the sum x = dropout(y) + residual is of the rounded y, as
  // PyTorch's autocast rounds a Linear's output to 16 bits before the residual add; the residual
  // stream, the sum and LayerNorm stay fp32. x differs from the CPU's by y's rounding (half a unit
  // of y in the format, the bias's rounding before it, at most half a unit of the bias).
  bool proj16_output = false;
  // Layer recomputation: an encoder layer keeps only its output (the next layer's input); its
  // activations live in one slot shared by all layers, and backward recomputes each layer's
  // forward from its input first (dropout masks regenerated from the same counter RNG, so the
  // gradients are bit for bit those of the stored run). Costs one more forward of the encoder.
  bool recompute_layers = false;
  // Unpadded execution (pretraining, sequence- and token-classification heads, whose losses
  // read only the [CLS] row, the masked positions or the weighted tokens; question answering
  // normalises over every position and stays padded): each sequence runs on its real length,
  // the length through its last input_mask 1 (and any weighted masked position or token past
  // it). Forward packs the
  // real tokens into consecutive rows (position and segment ids kept per row); embeddings,
  // LayerNorm, GELU, dropout and every matmul run on those rows only, attention on each
  // sequence's own rows (runs of equal length together), the heads gather [CLS] and the masked
  // positions from them. The row count is rounded up to 64 (dummy rows, kept out of attention
  // and of every gradient) so the matmuls see few distinct shapes. Losses, gradients and every
  // real position's activations are the padded model's up to summation order (padding keys get
  // probability exp(-10000) = 0 there), dropout included: every packed row and attention run
  // draws the masks of its place in the padded batch.
  bool unpadded = false;
  // Packing (pretraining, unpadded; data/packing.h): a batch is up to `batch` instances whose
  // real tokens fit into pack_rows rows of seq_len and whose weighted masked predictions number
  // at most pack_rows x max_predictions. The encoder is planned for pack_rows x seq_len tokens,
  // the pooler and NSP for `batch` instances, the MLM head (which runs unpadded on the weighted
  // predictions only) for pack_rows x max_predictions of them. 0 = unpacked.
  int64_t pack_rows = 0;
  // ZeRO's sharded fp32 master (bf16 with a sharded optimizer; train::Step): this rank holds
  // the fp32 master of the matmul weights (ParamInfo::matmul) only inside [master_begin,
  // master_end), its optimizer part; the rest of them is address space only (holes of the
  // plan, never resident) and the bf16 copy, which the matmuls read, is then the model's
  // weights: the optimizer rounds its part into it and the step all-gathers it. The tensors
  // read in fp32 (embeddings, biases, LayerNorm) stay whole on every rank.
  bool master_shard = false;
  int64_t master_begin = 0, master_end = 0;
  // Rows of seq_len tokens the encoder is planned for.
  int64_t token_rows() const { return pack_rows > 0 ? pack_rows : batch; }
  bool bf16() const { return precision == Precision::BF16; }
  bool fp16() const { return precision == Precision::FP16; }
  // Whether the matmuls read a 16-bit copy of the weights and 16-bit operand scratch (bf16, or
  // fp16 with fp16 operands): the plan's group "bf16" or "fp16".
  bool weight_copy() const { return bf16() || (fp16() && fp16_operands); }
  bool blocked_attention() const {
    return attention == Attention::Blocked || (attention == Attention::Auto && seq_len >= 512);
  }
};

ModelDims::Attention parse_attention(const std::string& s);
const char* attention_name(ModelDims::Attention a);

struct StepOptions {
  bool training = false;  // dropout on
  uint64_t seed = 0;      // dropout stream (with step and layer)
  uint64_t step = 0;
  uint64_t example_offset = 0;  // global index of this batch's first example (data parallel)
  // The loss sums stay where the kernels compute them: added to the model's StepSums on the
  // device (no host synchronisation), read once a step (BertModel::read_step_sums). forward's
  // Losses then carries only what the host knows (the token counts and the MLM weight).
  bool device_sums = false;
};

// The sums forward added with StepOptions::device_sums since they were last read (doubles, in
// this order, in the backend's memory: region "head.step_sums").
struct StepSums {
  double loss = 0;  // the micro-batches' losses (Losses::loss each) added
  double mlm_correct = 0, nsp_correct = 0, cls_correct = 0;
  double nonfinite = 0;  // loss terms (the MLM's, the NSP's, a classifier's) not finite
  static constexpr int kCount = 5;
};

struct Losses {
  // Token rows the encoder ran: the batch's real tokens and the rows computed (B*T padded,
  // the real tokens rounded up to 64 unpadded).
  int64_t real_tokens = 0, computed_tokens = 0;
  double loss = 0;         // mlm + nsp, or the classification loss
  double mlm_loss = 0;     // sum(w * ce) / (sum(w) + 1e-5), as Google BERT
  double nsp_loss = 0;     // mean over the batch
  double mlm_weight = 0;   // sum of masked_lm_weights
  double mlm_correct = 0;  // weighted count of argmax hits
  int64_t nsp_correct = 0, cls_correct = 0;
  // Token classification: the scored tokens and the argmax hits among them; question answering:
  // 2 per example (its start and its end) and how many of them the argmax hit.
  int64_t tokens_scored = 0, tokens_correct = 0;
};

// Adds the activation and backward-scratch regions of one model to a plan (group
// "activations"); shared by the model and `bertrain estimate`.
void plan_activations(MemoryPlan& plan, const BertConfig& cfg, Head head, const ModelDims& d);

// The kernel scratch one model's kernels need on `backend` (group "kernels", region
// "kernels.scratch": kernels/types.h ScratchLayout), from every linear layer's shape, the
// attention core's and the LayerNorm width.
kernels::ScratchLayout plan_kernel_scratch(const BertConfig& cfg, Head head, const ModelDims& d,
                                           const kernels::Target& target);

// The dims as they run on `be`: FP16's products on fp16 operands where it multiplies them
// (what BertModel and its plan do).
ModelDims on_backend(ModelDims d, const BertConfig& cfg, const kernels::Target& be);

// Bytes of the batch arrays a model's kernels read for dims d (ids, masks, labels, the packed
// rows' indices; each 256-byte aligned): on a backend with memory of its own they are copied
// there each batch, into one of the plan's group "input" regions ("input.batch0", ...: one
// an input slot, kernels::kInputSlots). A bound: the arrays of every head, at the most rows the
// dims allow.
size_t input_bytes(const ModelDims& d);

// The byte ranges of the parameters region a sharded fp32 master holding [begin, end) leaves
// unbacked (ModelDims::master_shard): the whole pages of the matmul weights outside it.
std::vector<std::pair<size_t, size_t>> master_holes(const ParamTable& table, int64_t begin,
                                                    int64_t end);

class BertModel {
 public:
  // Kernels run on `backend` (the CPU's unless told). A backend with memory of its own (a GPU:
  // Backend::host_memory false) holds the arenas: params(), grads() and the activations are
  // then its memory (read them with backend().to_host); write_param copies what the host
  // makes there, and forward copies the batch arrays the kernels read.
  BertModel(const BertConfig& cfg, Head head, const ModelDims& dims,
            const kernels::Backend& backend = kernels::cpu_backend());
  // Unbinds the kernel scratch (its region goes with the model; kernels then use their own).
  ~BertModel() { be_.bind_scratch(nullptr, {}); }
  BertModel(BertModel&&) = default;
  // The plan this model allocates from: parameters, gradients, activations, scratch.
  // `target`: the backend the model runs on, or a device's plan without it (kernels/backend.h).
  static MemoryPlan make_plan(const BertConfig& cfg, Head head, const ModelDims& dims,
                              const kernels::Target& target = kernels::cpu_backend());

  const BertConfig& config() const { return cfg_; }
  const kernels::Backend& backend() const { return be_; }
  const ParamTable& table() const { return table_; }
  const ModelDims& dims() const { return dims_; }
  // The attention kernel the model runs: "full", "blocked", or "fused" (blocked, as one kernel
  // forward and one backward on a GPU: ModelDims::fused_attention).
  const char* attention_kernel() const;
  const MemoryPlan& plan() const { return plan_; }
  // Bytes this model holds in its arenas: plan().total_bytes(), allocated (tests prove it).
  size_t allocated_bytes() const {
    return params_.bytes() + grads_.bytes() + acts_arena_.bytes() + scratch_.bytes() +
           w16_arena_.bytes() + kernels_arena_.bytes() + input_arena_.bytes();
  }
  float* params() const { return reinterpret_cast<float*>(params_.base()); }
  float* grads() const { return reinterpret_cast<float*>(grads_.base()); }
  float* param(const std::string& name) const { return params() + table_.offset(name); }
  float* grad(const std::string& name) const { return grads() + table_.offset(name); }
  void zero_grads();
  // Points the backend's kernels at this model's kernel scratch (forward and backward do it
  // themselves; the training step does it before the optimizer's kernels).
  void bind_kernel_scratch() const { be_.bind_scratch(kernels_arena_.base(), kernel_scratch_); }
  // Encoder layer l on input x, its activations into act_.layers[l] (forward, and backward's
  // recomputation).
  void layer_forward(int64_t l, const float* x, const Batch& b, const StepOptions& opt);
  // The 16-bit copy of the weights the matmuls read (ModelDims::weight_copy: bf16, or fp16 on a
  // backend with fp16 operands; null otherwise). Forward refreshes it from params() unless told,
  // once, that the caller already did (the optimizer writes it in its update pass:
  // weight_copy() says where and in which format).
  uint16_t* weights16() const { return w16_; }
  kernels::WeightCopy weight_copy() const { return {w16_, w16_ && dims_.fp16()}; }
  void weights16_updated() { w16_fresh_ = w16_ != nullptr; }
  // Rounds params()[begin, end) into the 16-bit copy (the parts of the weights another rank
  // updated, for a sharded optimizer); no-op without a copy.
  void refresh_weights16(int64_t begin, int64_t end) const {
    if (w16_ && end > begin) be_.copy_weights(prec_, params() + begin, w16_ + begin, end - begin);
  }
  // Moves the gradients into `memory` (group_bytes("gradients"), 64-byte aligned, owned by the
  // caller and outliving the model), e.g. a communicator's shared window for zero-copy allreduce.
  void place_gradients(std::byte* memory);
  void init_params(uint64_t seed);
  // Sets tensor p to what `read` writes into a buffer of p.numel() floats. With a sharded
  // master (ModelDims::master_shard) a matmul weight is read into a temporary, rounded into
  // the bf16 copy and its fp32 kept only inside the shard, and every tensor's bf16 copy is
  // refreshed (the copy is the model's weights there); else it is read in place.
  void write_param(const ParamInfo& p, const std::function<void(float*)>& read);
  // Whether params() holds all of p in fp32 (false: a matmul weight of a sharded master that
  // reaches outside this rank's part).
  bool holds_fp32(const ParamInfo& p) const {
    return !dims_.master_shard || !p.matmul ||
           (p.offset >= dims_.master_begin && p.end() <= dims_.master_end);
  }

  Losses forward(const Batch& b, const StepOptions& opt);
  // The StepSums forward added with device_sums: read_step_sums() queues their copy to the host
  // behind the kernels issued so far and starts the device's sums again from zero; step_sums()
  // returns that copy, the host waiting for it only if it has not landed (a GPU: once the
  // device has run up to it, so a synchronisation made after read_step_sums brings it along).
  // With `into` (page-locked host memory: Backend::allocate_host) the copy goes there instead,
  // landed once Backend::wait_to_host returns (train::Step keeps several steps' sums so).
  void read_step_sums(StepSums* into = nullptr);
  StepSums step_sums() const;
  // The next batch made ready while the kernels still run this one's: its arrays packed and,
  // on a backend with memory of its own, grouped and copied into the other input slot beside
  // the kernels (Backend::upload); forward(b) then starts from them. b must stay as it is until
  // that forward. The same checks as forward's, so a bad batch fails here. Worth it where the
  // kernels run beside the host (stages_ahead: a GPU's); forward alone does the same otherwise.
  void stage(const Batch& b);
  bool stages_ahead() const { return !be_.host_memory(); }
  // Gradients of loss_scale * loss, accumulated into grads(). Needs the preceding forward, on
  // the same batch (its kernels read the arrays that forward chose and staged: KernelInputs).
  // The scale may be a factor in the backend's memory (kernels::Multiplier: fp16's loss scale
  // kept on the device), which the heads' kernels read where they run.
  void backward(const Batch& b, const StepOptions& opt, kernels::Multiplier loss_scale = 1.0f,
                const std::function<void(int64_t)>& layer_done = {});
  // CUDA graphs (Backend::graphs): with them on, forward and backward of a pretraining batch
  // each run as a graph, one a kind, input slot and shape, captured at its first use and
  // launched from then on (the host issues one launch instead of hundreds). What changes from
  // step to step the kernels read where they run: the dropout keys and offsets and the MLM
  // loss's divisor from the step's arguments (sent before each forward), the embedding
  // gradient's groups and an unpadded batch's sequence offsets from the batch's input slot.
  // Padded batches; unpadded and packed ones where the attention runs fused (one launch for any
  // lengths), their rows rounded up to a bucket (kGraphRowBuckets of the planned rows) and the
  // MLM head run on all its planned rows: a shape a graph. graphed(b, opt): whether they run so.
  void set_graphs(GraphMode m) { graphs_ = m; }
  bool graphed(const Batch& b, const StepOptions& opt) const;
  // Whether forward and backward can run as graphs on this backend and head (graphed: with
  // graphs on and the losses' sums on the device too): then an unpadded batch's shapes are a
  // graph's (pack), graphs on or off, so that both run the same products.
  bool graph_shapes() const;
  // What an unpadded batch's rows are rounded up to: 64, or with graph_shapes a bucket of the
  // planned rows (kGraphRowBuckets).
  int64_t row_quantum() const;
  // Graphs captured so far (one each kind, input slot, shape and loss scale; again where one
  // kept longest unused made room).
  int64_t graph_captures() const { return graph_of_.captures(); }
  // Unpadded batches' row counts a graphed model rounds to: the planned rows in this many
  // buckets at most (each a multiple of 64 rows; kept graphs: kKeptGraphs).
  static constexpr int64_t kGraphRowBuckets = 64;
  static constexpr size_t kKeptGraphs = 64;
  // Gradient offsets [begin, end) of encoder layer l: final once backward reports layer l done
  // (layers are contiguous in the flat buffer). Everything else is final when backward returns.
  std::pair<int64_t, int64_t> layer_range(int64_t l) const;

  // Whether forward runs unpadded (ModelDims::unpadded and a head that allows it).
  bool unpadded() const { return dims_.unpadded && head_ != Head::QuestionAnswering; }

  // Outputs of the last forward (valid until the next backward/forward), on the host: a model
  // in a backend's own memory (a GPU's) copies one out the first time it is asked for after a
  // forward (host_output).
  // Padded: [B,T,C]; unpadded: the packed rows, sequence b's token t at row
  // sequence_row(b, t) (-1 past its real length).
  const float* sequence_output() const {
    return host_output(seq_out_, output_rows() * cfg_.hidden_size);
  }
  int64_t sequence_row(int64_t b, int64_t t) const;
  const float* pooled_output() const {  // [B,C]
    return host_output(act_.pooled, cur_.packed.B * cfg_.hidden_size);
  }
  // Padded: [B*P,V]; unpadded: a row per weighted prediction (weight != 0), in batch order (the
  // slots without weight, create_pretraining_data's padding of the predictions, are skipped).
  // Rows of the real vocabulary (the model's padding columns, vocab_rows, left out).
  const float* mlm_logits() const;
  const float* nsp_logits() const { return host_output(act_.nsp_logits, cur_.packed.B * 2); }
  const float* cls_logits() const {  // [B,num_labels]
    return host_output(act_.cls_logits, cur_.packed.B * cfg_.num_labels);
  }
  // [B*T,num_labels]; unpadded, a row per packed row (sequence_row).
  const float* token_logits() const {
    return host_output(act_.tok_logits, output_rows() * cfg_.num_labels);
  }
  // Question answering: the start logits [B,T], then the end logits [B,T].
  const float* span_logits() const {
    return host_output(act_.qa_logits, 2 * cur_.packed.B * cur_.packed.T);
  }

  // Spans per layer (forward/backward) go to this timeline when it is enabled.
  void set_timeline(obs::Timeline* tl) { timeline_ = tl; }

  // Model FLOPs of one forward+backward (matmuls and attention), for throughput reports.
  double flops_per_step(int64_t B, int64_t T, int64_t P) const;
  // The same for the last forward's batch as it ran: unpadded, over the rows computed and each
  // sequence's own attention square.
  double last_step_flops() const;

 private:
  struct LayerActs {
    // Kept in the model's precision (kernels/backend.h, Kept): QKV, the attention context, the
    // FFN pre- and post-activation; in 16-bit precisions their fp32 values live in scratch
    // shared by the layers and backward reads the 16-bit copies.
    kernels::Kept qkv, ctx, inter_pre, inter_act;
    kernels::AttentionSaved saved;  // probabilities (fp32 / 16-bit) or the row log-sum-exp
    float *attn_res, *ln1_out, *ln1_mean, *ln1_rstd;
    float *ffn_res, *ln2_out, *ln2_mean, *ln2_rstd;
    // The LayerNorm outputs' 16-bit copies where the matmuls read 16 bits (else null).
    uint16_t *ln1_out16, *ln2_out16;
  };
  struct Acts {
    float *emb_sum, *emb_mean, *emb_rstd, *h0;
    std::vector<LayerActs> layers;
    float *cls_in, *pooled, *pooled_drop, *nsp_logits, *cls_logits;
    float *tok_drop, *tok_logits, *qa_logits;
    float *mlm_in, *mlm_pre, *mlm_act, *mlm_ln, *mlm_mean, *mlm_rstd, *mlm_logits;
    float* row_loss;
    int32_t* row_correct;
    double* step_sums;  // StepSums
    // backward scratch
    float *dh, *dA, *dB, *dI, *dhead1, *dhead2, *dsmall;
  };
  // The packed rows of an unpadded forward (rows = 0 when padded): sequence b owns rows
  // [start[b], start[b] + len[b]); runs[i] = (first sequence, count) of consecutive sequences of
  // equal length (one attention call each); ids, segments, positions, mask and the padded row
  // (b * T + t: where the row's dropout masks are drawn) per row (dummy rows: [PAD], segment 0,
  // position 0, mask 0, padded row 0); cls and mlm the heads' rows; a token classifier's labels
  // and weights per row (dummy rows: weight 0). The MLM head's rows are the weighted
  // predictions only, with their ids and weights (mlm_ids, mlm_weights).
  // The batch arrays the kernels read, chosen once per forward (padded: the batch's; unpadded:
  // the packed ones) and, for a backend with memory of its own, copied there
  // (stage_inputs): forward and backward pass these, never the batch's.
  struct KernelInputs {
    const int32_t *ids = nullptr, *segments = nullptr, *positions = nullptr, *mask = nullptr,
                  *padded_row = nullptr, *cls = nullptr, *mlm_positions = nullptr,
                  *mlm_ids = nullptr, *token_labels = nullptr, *span_positions = nullptr,
                  *nsp_labels = nullptr, *label_ids = nullptr;
    // Unpadded: each sequence's first packed row, then the rows' end (B + 1; attention with
    // variable lengths, ModelDims::fused_attention).
    const int32_t* starts = nullptr;
    const float *mlm_weights = nullptr, *token_weights = nullptr, *label_values = nullptr;
    // Not host memory: the tokens grouped by embedding table row (embedding backward's).
    kernels::EmbeddingRuns runs;
  };
  // One batch's arrays ready for the kernels: the packed rows, the arrays the kernels read, and
  // their embedding groups (the host side of in.runs).
  struct Staged;
  void stage_inputs(const Batch& b, Staged& s, int slot);
  // The checks, the packing and the staging of batch b into slot (stage and forward).
  void prepare(const Batch& b, Staged& s, int slot);
  // The group's arena: allocated here, or from a backend with memory of its own.
  Arena make_arena(const std::string& group);
  struct Packed {
    int64_t B = 0, T = 0, P = 0, real = 0, rows = 0;  // B, T, P: the last batch's, padded too
    int64_t mlm_rows = 0;                             // rows of the MLM head
    // Each sequence's first packed row, then the real rows' end (B + 1; KernelInputs::starts).
    std::vector<int32_t> starts;
    int64_t start(int64_t e) const { return starts[e]; }
    int64_t len(int64_t e) const { return starts[e + 1] - starts[e]; }
    std::vector<std::pair<int64_t, int64_t>> runs;
    std::vector<int32_t> ids, segments, positions, mask, padded_row, cls, mlm, token_labels;
    std::vector<float> token_weights;
    std::vector<int32_t> mlm_ids;
    std::vector<float> mlm_weights;
  };
  // Unpadded pretraining runs its MLM head on the weighted predictions only.
  bool compact_mlm() const { return unpadded() && head_ == Head::Pretraining; }
  // The MLM head's weights for batch b on the host (its rows: cur_.packed.mlm_rows).
  const float* mlm_weights(const Batch& b) const {
    return compact_mlm() ? cur_.packed.mlm_weights.data() : b.masked_lm_weights.data();
  }
  // Rows of the last forward's encoder output: the packed rows, or B x T.
  int64_t output_rows() const {
    return unpadded() ? cur_.packed.rows : cur_.packed.B * cur_.packed.T;
  }
  // p (n floats of the last forward's outputs) where the host reads it: p itself, or a copy out
  // of the backend's memory made once per forward.
  const float* host_output(const float* p, int64_t n) const;
  // The token classifier's weights on the host (the loss's denominator).
  const float* token_weights_host(const Batch& b) const {
    return unpadded() ? cur_.packed.token_weights.data() : b.token_label_weights.data();
  }
  void pack(const Batch& b, Packed& pk) const;
  // A dropout site drawn by rows (the row kernels', Backend::dropout_forward's), keyed by the
  // padded rows when running unpadded.
  kernels::Dropout on_rows(kernels::Dropout d) const {
    if (unpadded()) d.rows = cur_.in.padded_row;
    return d;
  }
  // One pass's shapes and dropout sites (bert.cpp), and the pieces of forward and backward.
  struct Pass;
  kernels::CrossEntropySums head_loss(const Pass& p, double divisor, double* hits, float* dlogits,
                                      const float* logits, const int32_t* targets,
                                      const float* weights, int64_t N, kernels::Classes c,
                                      kernels::Multiplier dscale,
                                      const double* divisor_at = nullptr);
  Pass pass(const Batch& b, const StepOptions& opt) const;
  // forward's and backward's kernels (after their host-side preludes).
  void forward_kernels(const Pass& p, const Batch& b, Losses& out);
  void backward_kernels(const Pass& p, const Batch& b, kernels::Multiplier loss_scale,
                        const std::function<void(int64_t)>& layer_done);
  // The step's arguments (step_args_) for pass p: each dropout site's key and first index,
  // the head's loss divisor and gradient scale (the MLM's, or the token classifier's), sent to
  // the backend's memory.
  void send_step_args(const Pass& p, const Batch& b);
  // What a graph's launch arguments hold besides the model's own memory: forward or backward,
  // the input slot, the shapes (an unpadded batch's rows and MLM rows too), dropout on or off,
  // the loss scale (its value, or where the device keeps it), whether forward left the MLM
  // gradient.
  struct GraphKey {
    bool forward;
    int slot;
    int64_t B, T, P, rows, mlm_rows;
    bool training;
    float scale;
    const float* scale_at;
    bool ready;
    bool operator<(const GraphKey& o) const {
      return std::tie(forward, slot, B, T, P, rows, mlm_rows, training, scale, scale_at, ready) <
             std::tie(o.forward, o.slot, o.B, o.T, o.P, o.rows, o.mlm_rows, o.training, o.scale,
                      o.scale_at, o.ready);
    }
  };
  GraphKey graph_key(bool forward, const StepOptions& opt, kernels::Multiplier scale) const;
  // The graph of `key` launched, captured first from what issue() issues where it is new.
  void run_graph(const GraphKey& key, const std::function<void()>& issue);
  void layer_backward(int64_t l, const Pass& p, const Batch& b, float* dh);
  void embeddings_backward(const Pass& p, float* dh);
  // A linear layer's backward in the model's precision, its weight and bias by offset (the bias
  // kBiasDone: its gradient added already, by activation_bias_backward).
  static constexpr int64_t kBiasDone = -1;
  void linear_backward(float* dinp, int64_t w_off, int64_t b_off, kernels::KeptIn dout,
                       kernels::Kept in, int64_t M, int64_t N, int64_t K, bool accumulate = false);
  // The heads (bert.cpp, each forward beside its backward): the losses into `out`, the gradient
  // into dh (the sequence output's rows) or dpooled.
  void token_classifier_forward(const Pass& p, const float* x, Losses& out);
  void token_classifier_backward(const Pass& p, kernels::Multiplier loss_scale, float* dh);
  void qa_forward(const Pass& p, const float* x, Losses& out);
  void qa_backward(const Pass& p, kernels::Multiplier loss_scale, float* dh);
  void pooler_forward(const Pass& p, const float* x);
  void pooler_backward(const Pass& p, float* dpooled, float* dh);
  void pretraining_forward(const Pass& p, const Batch& b, const float* x, Losses& out);
  void pretraining_backward(const Pass& p, const Batch& b, kernels::Multiplier loss_scale,
                            float* dpooled, float* dh);
  void classifier_forward(const Pass& p, Losses& out);
  void classifier_backward(const Pass& p, kernels::Multiplier loss_scale, float* dpooled);
  // The attention core of layer l over the packed rows, forward or backward (one call, or one
  // per run of equal lengths).
  void packed_attention(int64_t l, bool forward, kernels::Kept dqkv, float* dbias,
                        kernels::KeptIn dctx, const StepOptions& opt);
  // Layer l's input's 16-bit copy: the previous layer's output's (null for the first layer,
  // whose products round the embeddings' output, and where the matmuls read fp32).
  uint16_t* input16(int64_t l) const;
  const float* W(int64_t off) const { return params() + off; }
  // A weight for the matmuls: the fp32 master and its 16-bit copy, if any.
  kernels::Weight Wt(int64_t off) const { return {params() + off, w16_ ? w16_ + off : nullptr}; }
  float* G(int64_t off) const { return grads() + off; }

  BertConfig cfg_;
  Head head_;
  ParamTable table_;
  ModelDims dims_;
  MemoryPlan plan_;
  // A backend with memory of its own: the arenas' blocks and the staged batch arrays (freed
  // with the model, through the backend).
  std::vector<std::shared_ptr<void>> device_blocks_;
  struct Staged {
    Packed packed;
    KernelInputs in;
    kernels::RowGrouping by_word, by_position, by_token_type;
  };
  // The batch the kernels run (the last forward's), in input slot slot_; and the next, made
  // ready by stage(b) for b == next_for_ in the other slot.
  Staged cur_, next_;
  int slot_ = 0;
  const Batch* next_for_ = nullptr;
  // host_output's copies, each with the pass (forward or backward) it was made after.
  uint64_t passes_ = 0;
  mutable std::unordered_map<const float*, std::pair<uint64_t, std::vector<float>>> outputs_;
  mutable std::pair<uint64_t, std::vector<float>> mlm_logits_;  // (mlm_logits' rows of V)
  Arena params_, grads_, acts_arena_, scratch_, w16_arena_, kernels_arena_;
  // The staged batch arrays (a backend with memory of its own): the plan's input region a slot
  // (kernels::kInputSlots), each with its part of the host staging memory
  // (Backend::allocate_host).
  Arena input_arena_;
  // read_step_sums' copy (Backend::allocate_host; released after the staging memory).
  std::shared_ptr<StepSums> step_sums_host_;
  std::shared_ptr<void> staging_;
  std::array<std::byte*, kernels::kInputSlots> input_slot_{}, staging_slot_{};
  kernels::ScratchLayout kernel_scratch_;  // kernels_arena_'s layout, bound before kernels run
  Acts act_{};
  const kernels::Backend& be_;
  Precision prec_;
  kernels::Workspace ws_;        // the precision paths' scratch, regions of the plan
  uint16_t* w16_ = nullptr;      // the weights' 16-bit copy the matmuls read (weight_copy())
  uint16_t* proj16_ = nullptr;   // the projections' 16-bit output (ModelDims::proj16_output)
  bool mlm_grad_ready_ = false;  // the training forward left the MLM logits' gradient in place
  bool w16_fresh_ = false;       // weights16() already equals params() rounded
  obs::Timeline* timeline_ = nullptr;
  float* seq_out_ = nullptr;
  // The step's arguments in the backend's memory (the plan's "head.step_args") and their host
  // copy: {key, offset} of each dropout site by (layer, site kind), then the head's loss
  // divisor (a double's bits) and gradient scale (a float's); the MLM weight or the token
  // classifier's scored tokens they came from.
  uint64_t* step_args_ = nullptr;
  std::vector<uint64_t> step_args_host_;
  double mlm_weight_ = 0, tokens_scored_ = 0;
  // The graphs (set_graphs) by kind, input slot and shape, and whether one is being captured.
  GraphMode graphs_ = GraphMode::Off;
  GraphCache<GraphKey> graph_of_{kKeptGraphs};
};

}  // namespace bertrain::model
