#include "model/bert.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"
#include "core/setting.h"
#include "data/packing.h"

namespace bertrain::model {

using namespace bertrain::kernels;

namespace {

// Dropout sites: one RNG stream per (seed, step, layer, site).
enum Site : uint64_t { kEmbedding = 1, kAttnProbs, kAttnOut, kFfnOut, kPooler, kTokens };

// The step's arguments (BertModel::step_args_): {key, offset} of every site kind at layers 0 (the
// embeddings) to L + 1 (the heads), then the MLM loss's divisor and gradient scale.
int64_t site_index(int64_t layer, uint64_t s) {
  return (layer * static_cast<int64_t>(kTokens) + static_cast<int64_t>(s) - 1) * 2;
}
int64_t step_args_count(const BertConfig& cfg) {
  return site_index(cfg.num_hidden_layers + 2, kEmbedding) + 2;
}
// Site s of layer l (0: the embeddings, L + 1: the heads), dropping with probability p: its key
// and first index the step's arguments' (BertModel::send_step_args), which kernels read where
// they run; offset (0 here) is what a run of rows adds to the first index.
kernels::Dropout site_of(const StepOptions& opt, const uint64_t* args, int64_t layer, Site s,
                         float p) {
  return kernels::Dropout{p, rng_key(opt.seed, opt.step, layer, s), 0, nullptr,
                          args + site_index(layer, s)};
}

constexpr float kMlmDenominatorEps = 1e-5f;  // Google BERT: sum(w*ce) / (sum(w) + 1e-5)

size_t f32s(int64_t n) {
  return static_cast<size_t>(n) * sizeof(float);
}

// Where layer l's activations are planned: its own, or the slot all layers share when they are
// recomputed ("layers.").
std::string layer_prefix(int64_t l, const ModelDims& d) {
  return d.recompute_layers ? std::string("layers.") : "layer" + std::to_string(l) + ".";
}

// The rows of sequence e an unpadded model runs: through its last input_mask 1 and any masked
// position with a weight (a loss read there must be computed); all T when the mask has no 1 (the
// padded model then attends to every position alike).
int64_t real_length(const Batch& b, int64_t e) {
  const bool mlm = !b.masked_lm_weights.empty();
  int64_t n =
      data::instance_size(b.input_mask.data() + e * b.T, b.T,
                          mlm ? b.masked_lm_positions.data() + e * b.P : nullptr,
                          mlm ? b.masked_lm_weights.data() + e * b.P : nullptr, mlm ? b.P : 0)
          .first;
  if (!b.token_label_weights.empty())
    for (int64_t t = n; t < b.T; ++t)
      if (b.token_label_weights[e * b.T + t] != 0.0f) n = t + 1;
  return n;
}

constexpr int64_t kRowQuantum = 64;  // unpadded row counts are rounded up to this

}  // namespace

ModelDims::Attention parse_attention(const std::string& s) {
  if (s == "auto") return ModelDims::Attention::Auto;
  if (s == "full") return ModelDims::Attention::Full;
  if (s == "blocked") return ModelDims::Attention::Blocked;
  fail(setting("attention"), " must be auto, full or blocked, got '", s, "'");
}

const char* attention_name(ModelDims::Attention a) {
  return a == ModelDims::Attention::Auto   ? "auto"
         : a == ModelDims::Attention::Full ? "full"
                                           : "blocked";
}

namespace {
// The plan group of the weights' 16-bit copy and the 16-bit operand scratch.
std::string copy_group(const ModelDims& d) {
  return d.bf16() ? "bf16" : "fp16";
}
}  // namespace

void plan_activations(MemoryPlan& plan, const BertConfig& cfg, Head head, const ModelDims& d) {
  // B: sequences (the heads); R rows of T tokens (the encoder; R = B unless packed, and a
  // packed batch's attention squares sum to at most R T^2: sum L_i^2 <= T sum L_i <= R T^2).
  const int64_t B = d.batch, T = d.seq_len, R = d.token_rows(), N = R * T, C = cfg.hidden_size,
                I = cfg.intermediate_size, NH = cfg.num_attention_heads, V = vocab_rows(cfg);
  const int64_t BP = head == Head::Pretraining ? R * d.max_predictions : 0;
  const std::string g = "activations";
  // bf16 and fp16 keep the same tensors in 16 bits (of their own format).
  const bool half = d.bf16() || d.fp16();
  plan.add(g, "emb.sum", f32s(N * C));
  plan.add(g, "emb.mean", f32s(N));
  plan.add(g, "emb.rstd", f32s(N));
  plan.add(g, "emb.out", f32s(N * C));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::string p = layer_prefix(l, d);
    // Every tensor of a layer but its output; with layer recomputation one slot for all layers.
    auto add = [&](const char* name, size_t bytes) {
      if (l == 0 || !d.recompute_layers) plan.add(g, p + name, bytes);
    };
    // bf16/fp16 keep QKV and the FFN pre-activation only rounded (what backward reads: the
    // attention's operands, GELU's input); their fp32 GEMM outputs pass through grad.dI.
    if (half)
      add("qkv16", f32s(N * 3 * C) / 2);
    else
      add("qkv", f32s(N * 3 * C));
    if (d.blocked_attention())  // the row log-sum-exp only (kernels/cpu/attention.h)
      add("lse", f32s(R * NH * T));
    else if (half)  // the softmax output saved in bf16 / fp16
      add("probs16", f32s(R * NH * T * T) / 2);
    else
      add("probs", f32s(R * NH * T * T));
    // bf16/fp16: the inputs of the attention-output and FFN-output matmuls are kept only in
    // 16 bits (bf16: they are the matmuls' operands, GELU writes them directly).
    if (half)
      add("ctx16", f32s(N * C) / 2);
    else
      add("ctx", f32s(N * C));
    add("attn_res", f32s(N * C));
    add("ln1_out", f32s(N * C));
    // Where the matmuls read 16 bits, the LayerNorm outputs' copies the LayerNorms write: the
    // next products' inputs, forward and (for the weight gradients) backward.
    if (d.weight_copy()) add("ln1_out16", f32s(N * C) / 2);
    add("ln1_mean", f32s(N));
    add("ln1_rstd", f32s(N));
    if (half)
      add("inter_pre16", f32s(N * I) / 2);
    else
      add("inter_pre", f32s(N * I));
    if (half)
      add("inter_act16", f32s(N * I) / 2);
    else
      add("inter_act", f32s(N * I));
    add("ffn_res", f32s(N * C));
    add("ln2_mean", f32s(N));
    add("ln2_rstd", f32s(N));
    plan.add(g, "layer" + std::to_string(l) + ".ln2_out", f32s(N * C));  // the next one's input
    if (d.weight_copy()) plan.add(g, "layer" + std::to_string(l) + ".ln2_out16", f32s(N * C) / 2);
  }
  plan.add(g, "head.cls_in", f32s(B * C));
  plan.add(g, "head.pooled", f32s(B * C));
  plan.add(g, "head.pooled_drop", f32s(B * C));
  plan.add(g, "head.nsp_logits", f32s(B * 2));
  plan.add(g, "head.cls_logits", f32s(B * cfg.num_labels));
  plan.add(g, "head.mlm_in", f32s(BP * C));
  plan.add(g, "head.mlm_pre", f32s(BP * C));
  plan.add(g, "head.mlm_act", f32s(BP * C));
  plan.add(g, "head.mlm_ln", f32s(BP * C));
  plan.add(g, "head.mlm_mean", f32s(BP));
  plan.add(g, "head.mlm_rstd", f32s(BP));
  plan.add(g, "head.mlm_logits", f32s(BP * V));
  // Token classification: the dropped sequence output, the logits and each token's loss weight.
  const int64_t NT = head == Head::TokenClassification ? N : 0;
  plan.add(g, "head.tok_drop", f32s(NT * C));
  plan.add(g, "head.tok_logits", f32s(NT * cfg.num_labels));
  // Question answering: the start logits of every token, then the end logits.
  const int64_t NQ = head == Head::QuestionAnswering ? N : 0;
  plan.add(g, "head.qa_logits", f32s(2 * NQ));
  plan.add(g, "head.row_loss", f32s(std::max({BP, 2 * B, NT})));
  plan.add(g, "head.row_correct", f32s(std::max({BP, 2 * B, NT})));
  plan.add(g, "head.step_sums", StepSums::kCount * sizeof(double));
  plan.add(g, "head.step_args", static_cast<size_t>(step_args_count(cfg)) * sizeof(uint64_t));
  const std::string s = "scratch";
  plan.add(s, "grad.dh", f32s(N * C));
  plan.add(s, "grad.dA", f32s(N * C));
  plan.add(s, "grad.dB", f32s(N * C));
  plan.add(s, "grad.dI", f32s(N * std::max(I, 3 * C)));
  plan.add(s, "grad.dhead1", f32s(std::max(BP, B) * C));
  plan.add(s, "grad.dhead2", f32s(std::max(BP, B) * C));
  if (!d.blocked_attention()) plan.add(s, "attn.work", f32s(R * NH * T * T));
  if (d.bf16()) plan.add(s, "attn.ctx", f32s(N * C));  // fp32 ctx until it is rounded to bf16
  // fp16: forward's fp32 ctx until it is rounded; in backward (fp32 kernels: no fp16 operands)
  // each saved fp16 tensor widened back to fp32 for them, one at a time.
  if (d.fp16()) plan.add(s, "fp16.wide", f32s(d.fp16_operands ? N * C : N * std::max(I, 3 * C)));
  plan.add(s, "grad.dsmall", f32s(std::max({B, NT, NQ}) * std::max<int64_t>(2, cfg.num_labels)));
  if (d.weight_copy()) {  // bf16, or fp16 with fp16 operands: the same tensors in 16 bits
    const std::string g16 = copy_group(d);
    const size_t h = sizeof(uint16_t);
    plan.add(g16, g16 + ".weights", static_cast<size_t>(ParamTable(cfg, head).total()) * h);
    // Largest matmul operand rounded to 16 bits: a forward input or a backward output gradient,
    // and a backward input.
    const int64_t a = std::max({N * std::max(3 * C, I), BP * V, B * std::max<int64_t>(C, V)});
    plan.add(g16, g16 + ".scratch_a", static_cast<size_t>(a) * h);
    plan.add(g16, g16 + ".scratch_b",
             static_cast<size_t>(std::max(N * std::max(C, I), BP * C)) * h);
    // Attention's matmul operands: the dropped probabilities (then dS), dctx (QKV: per layer;
    // the fused kernel rounds dctx's fp32 values as it reads them, unless the output
    // projection's product writes the copy: ModelDims::qkv16_output).
    if (!d.blocked_attention())
      plan.add(g16, g16 + ".attn_probs", static_cast<size_t>(R * NH * T * T) * h);
    if (!d.fused_attention || d.qkv16_output)
      plan.add(g16, g16 + ".attn_dctx", static_cast<size_t>(N * C) * h);
    // The projections' 16-bit output, read at once by the residual LayerNorm (every layer's).
    if (d.proj16_output) plan.add(g16, g16 + ".proj_out", static_cast<size_t>(N * C) * h);
  }
}

ModelDims on_backend(ModelDims d, const BertConfig& cfg, const kernels::Target& be) {
  d.fp16_operands = d.fp16() && be.fp16_operands();
  if (d.attention == ModelDims::Attention::Auto &&
      be.prefers_full_attention(d.precision, d.seq_len))
    d.attention = ModelDims::Attention::Full;
  const kernels::AttentionShape s{d.token_rows(), d.seq_len, cfg.hidden_size,
                                  cfg.num_attention_heads};
  d.fused_attention = d.blocked_attention() && be.fused_attention(d.precision, s);
  d.qkv16_output =
      be.writes_16bit_outputs() && d.weight_copy() &&
      (d.fused_attention || (!d.blocked_attention() && !d.unpadded && d.pack_rows == 0));
  d.inter16_output = be.writes_16bit_outputs() && d.weight_copy();
  d.proj16_output = be.writes_16bit_outputs() && d.weight_copy();
  return d;
}

kernels::ScratchLayout plan_kernel_scratch(const BertConfig& cfg, Head head,
                                           const ModelDims& requested,
                                           const kernels::Target& target) {
  const ModelDims d = on_backend(requested, cfg, target);
  const int64_t B = d.batch, T = d.seq_len, R = d.token_rows(), N = R * T, C = cfg.hidden_size,
                I = cfg.intermediate_size, NH = cfg.num_attention_heads, V = vocab_rows(cfg);
  // The products forward and backward make (bert.cpp's linear_forward calls), once per shape.
  std::vector<kernels::LinearShape> linears = {{N, 3 * C, C}, {N, C, C}, {N, I, C}, {N, C, I}};
  if (head == Head::Pretraining) {
    const int64_t BP = R * d.max_predictions;
    linears.insert(linears.end(), {{B, C, C}, {B, 2, C}, {BP, C, C}, {BP, V, C}});
  } else if (head == Head::SequenceClassification) {
    linears.insert(linears.end(), {{B, C, C}, {B, cfg.num_labels, C}});
  } else if (head == Head::TokenClassification) {
    linears.push_back({N, cfg.num_labels, C});  // no pooler
  } else {
    linears.push_back({N, 1, C});  // question answering: the start and the end column, no pooler
  }
  kernels::KernelShapes k;
  k.precision = d.precision;
  k.linears = linears.data();
  k.num_linears = static_cast<int64_t>(linears.size());
  k.attention = {R, T, C, NH};
  k.sequences = B;
  k.blocked_attention = d.blocked_attention();
  k.layernorm_width = C;
  k.tokens = N;
  k.loss_rows = std::max({R * d.max_predictions, 2 * B, N});  // (as head.row_loss)
  const ParamTable table(cfg, head);
  k.parameters = table.total();
  k.tensors = static_cast<int64_t>(table.params().size());
  return target.scratch_layout(k);
}

// The plan's region of input slot `slot` (group "input").
static std::string input_region(int slot) {
  return str("input.batch", slot);
}

size_t input_bytes(const ModelDims& d) {
  // stage_inputs' arrays, 4-byte elements: 7 of token rows (ids, segments, mask, token labels and
  // weights, the packed positions and padded rows; at most the padded batch's or the planned
  // rows), 3 of predictions (positions, ids, weights), 4 of sequences (the NSP labels, label ids
  // and values, the [CLS] rows), the QA spans (2 a sequence) and the sequences' starts (1 more).
  const int64_t B = d.batch, rows = std::max(B, d.token_rows()) * d.seq_len,
                P = B * d.max_predictions;
  auto arr = [](int64_t n) { return align_up(static_cast<size_t>(n) * 4, 256); };
  // Then the tokens grouped by embedding table row, 3 tables (kernels::RowRuns): the order, a
  // chunk per row at most (4 values each), a sum per kEmbeddingChunk tokens at most (3 values).
  const int64_t chunks = std::max<int64_t>(1, rows), sums = rows / kernels::kEmbeddingChunk + 1;
  const size_t runs = arr(rows) + arr(4 * chunks) + arr(3 * sums) + arr(2);  // (+ the counts)
  return 7 * arr(rows) + 3 * arr(P) + 4 * arr(B) + arr(2 * B) + arr(B + 1) + 3 * runs;
}

std::vector<std::pair<size_t, size_t>> master_holes(const ParamTable& table, int64_t begin,
                                                    int64_t end) {
  // The whole pages of the matmul weights outside the part (the parameters region starts its
  // group, whose arena is page-aligned).
  std::vector<std::pair<size_t, size_t>> holes;
  for (const auto& [b, e] : table.matmul_ranges_outside(begin, end)) {
    const size_t hb = align_up(f32s(b), kPage), he = f32s(e) / kPage * kPage;
    if (he > hb) holes.push_back({hb, he});
  }
  return holes;
}

MemoryPlan BertModel::make_plan(const BertConfig& cfg, Head head, const ModelDims& requested,
                                const kernels::Target& target) {
  const ModelDims dims = on_backend(requested, cfg, target);
  if (dims.seq_len > cfg.max_position_embeddings)
    fail(setting("seq_len"), " ", dims.seq_len, " exceeds the model's max_position_embeddings ",
         cfg.max_position_embeddings);
  if (dims.batch <= 0 || dims.seq_len <= 0 || dims.max_predictions < 0)
    fail("batch size and sequence length must be positive and max predictions >= 0");
  if (dims.max_predictions > dims.seq_len)
    fail(setting("max_predictions"), " ", dims.max_predictions, " exceeds ", setting("seq_len"),
         " ", dims.seq_len);
  if (dims.pack_rows < 0 || (dims.pack_rows > 0 && (!dims.unpadded || head != Head::Pretraining ||
                                                    dims.pack_rows > dims.batch)))
    fail("packing runs pretraining unpadded, with at least as many instances as rows (",
         dims.pack_rows, " rows, ", dims.batch, " instances", dims.unpadded ? "" : ", padded", ")");
  if (dims.master_shard &&
      (!dims.bf16() || dims.master_begin < 0 || dims.master_begin > dims.master_end))
    fail("a sharded fp32 master needs bf16 compute and a part [", dims.master_begin, ", ",
         dims.master_end, ") of the parameters");
  const ParamTable table(cfg, head);
  MemoryPlan plan;
  const size_t params = plan.add("parameters", "params", f32s(table.total()));
  if (dims.master_shard)
    plan.set_holes(params, master_holes(table, dims.master_begin, dims.master_end));
  plan.add("gradients", "grads", f32s(table.total()));
  plan_activations(plan, cfg, head, dims);
  plan.add("kernels", "kernels.scratch",
           static_cast<size_t>(plan_kernel_scratch(cfg, head, dims, target).total()));
  if (!target.host_memory())
    for (int s = 0; s < kernels::kInputSlots; ++s)
      plan.add("input", input_region(s), input_bytes(dims));
  return plan;
}

BertModel::BertModel(const BertConfig& cfg, Head head, const ModelDims& dims,
                     const kernels::Backend& backend)
    : cfg_(cfg),
      head_(head),
      table_(cfg, head),
      dims_(on_backend(dims, cfg, backend)),
      plan_(make_plan(cfg, head, dims_, backend)),
      be_(backend),
      prec_(dims_.precision) {
  params_ = make_arena("parameters");
  grads_ = make_arena("gradients");
  acts_arena_ = make_arena("activations");
  scratch_ = make_arena("scratch");
  kernels_arena_ = make_arena("kernels");
  kernel_scratch_ = plan_kernel_scratch(cfg, head, dims_, backend);
  if (!backend.host_memory()) {
    input_arena_ = make_arena("input");
    for (int s = 0; s < kernels::kInputSlots; ++s)
      input_slot_[s] = reinterpret_cast<std::byte*>(input_arena_.f32(input_region(s)));
    staging_ = std::shared_ptr<void>(
        be_.allocate_host(input_arena_.bytes()), [be = &be_, slots = input_slot_](void* p) {
          try {
            for (std::byte* s : slots) {  // (the copies out of p; nothing reads the slots after)
              be->wait_upload(s);
              be->release_input(s);
            }
          } catch (const Error&) {  // the device's error is reported
          }
          be->release_host(p);
        });
    for (int s = 0; s < kernels::kInputSlots; ++s)
      staging_slot_[s] =
          static_cast<std::byte*>(staging_.get()) + (input_slot_[s] - input_arena_.base());
  }
  const bool blocked = dims_.blocked_attention();
  if (!blocked) ws_.attn_work = scratch_.f32("attn.work");
  if (dims_.weight_copy()) {
    const std::string g16 = copy_group(dims_);
    w16_arena_ = make_arena(g16);
    auto b16 = [&](const char* name) {
      return reinterpret_cast<uint16_t*>(w16_arena_.f32(g16 + name));
    };
    w16_ = b16(".weights");
    ws_.half_a = b16(".scratch_a");
    ws_.half_b = b16(".scratch_b");
    if (!blocked) ws_.attn_probs16 = b16(".attn_probs");
    if (!dims_.fused_attention || dims_.qkv16_output) ws_.attn_dctx16 = b16(".attn_dctx");
    if (dims_.proj16_output) proj16_ = b16(".proj_out");
  }
  if (dims_.fp16()) ws_.wide = scratch_.f32("fp16.wide");

  const Arena& a = acts_arena_;
  act_.emb_sum = a.f32("emb.sum");
  act_.emb_mean = a.f32("emb.mean");
  act_.emb_rstd = a.f32("emb.rstd");
  act_.h0 = a.f32("emb.out");
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::string p = layer_prefix(l, dims_);
    const bool h = dims_.bf16() || dims_.fp16(), bf = dims_.bf16(), fp = dims_.fp16();
    const bool copies = dims_.weight_copy();
    auto b16 = [&](const std::string& name) {
      return h ? reinterpret_cast<uint16_t*>(a.f32(name)) : nullptr;
    };
    // (the LayerNorm outputs' copies, planned where the products read a weights' copy)
    auto copy16 = [&](const std::string& name) {
      return copies ? reinterpret_cast<uint16_t*>(a.f32(name)) : nullptr;
    };
    // bf16/fp16: fp32 QKV / pre-activation (fp16 whose products read fp32, a CPU's: and GELU's
    // output, in place), briefly. Where the products read 16-bit operands nothing reads GELU's
    // fp32 output: none is written.
    float* gemm_out = scratch_.f32("grad.dI");
    LayerActs la;
    la.qkv = {h ? gemm_out : a.f32(p + "qkv"), b16(p + "qkv16")};
    la.ctx = {bf ? scratch_.f32("attn.ctx") : fp ? ws_.wide : a.f32(p + "ctx"), b16(p + "ctx16")};
    la.inter_pre = {h ? gemm_out : a.f32(p + "inter_pre"), b16(p + "inter_pre16")};
    la.inter_act = {copies ? nullptr
                    : fp   ? gemm_out
                           : a.f32(p + "inter_act"),
                    b16(p + "inter_act16")};
    if (blocked) {
      la.saved.lse = a.f32(p + "lse");
      la.saved.ctx16 = la.ctx.bits;  // (the fused kernels' D = dO . O reads the kept context)
    } else if (h)
      la.saved.probs16 = b16(p + "probs16");
    else
      la.saved.probs = a.f32(p + "probs");
    la.attn_res = a.f32(p + "attn_res");
    la.ln1_out = a.f32(p + "ln1_out");
    la.ln1_out16 = copy16(p + "ln1_out16");
    la.ln1_mean = a.f32(p + "ln1_mean");
    la.ln1_rstd = a.f32(p + "ln1_rstd");
    la.ffn_res = a.f32(p + "ffn_res");
    la.ln2_out = a.f32("layer" + std::to_string(l) + ".ln2_out");
    la.ln2_out16 = copy16("layer" + std::to_string(l) + ".ln2_out16");
    la.ln2_mean = a.f32(p + "ln2_mean");
    la.ln2_rstd = a.f32(p + "ln2_rstd");
    act_.layers.push_back(la);
  }
  act_.cls_in = a.f32("head.cls_in");
  act_.pooled = a.f32("head.pooled");
  act_.pooled_drop = a.f32("head.pooled_drop");
  act_.nsp_logits = a.f32("head.nsp_logits");
  act_.cls_logits = a.f32("head.cls_logits");
  act_.mlm_in = a.f32("head.mlm_in");
  act_.mlm_pre = a.f32("head.mlm_pre");
  act_.mlm_act = a.f32("head.mlm_act");
  act_.mlm_ln = a.f32("head.mlm_ln");
  act_.mlm_mean = a.f32("head.mlm_mean");
  act_.mlm_rstd = a.f32("head.mlm_rstd");
  act_.mlm_logits = a.f32("head.mlm_logits");
  act_.tok_drop = a.f32("head.tok_drop");
  act_.tok_logits = a.f32("head.tok_logits");
  act_.qa_logits = a.f32("head.qa_logits");
  act_.row_loss = a.f32("head.row_loss");
  act_.row_correct = reinterpret_cast<int32_t*>(a.f32("head.row_correct"));
  act_.step_sums = reinterpret_cast<double*>(a.f32("head.step_sums"));
  step_args_ = reinterpret_cast<uint64_t*>(a.f32("head.step_args"));
  step_args_host_.assign(static_cast<size_t>(step_args_count(cfg_)), 0);
  static_assert(sizeof(StepSums) == StepSums::kCount * sizeof(double));
  step_sums_host_ = std::shared_ptr<StepSums>(
      new (be_.allocate_host(sizeof(StepSums))) StepSums{}, [be = &be_](StepSums* p) {
        try {
          be->wait_to_host();     // (a copy into it may still run)
        } catch (const Error&) {  // the device's error is reported
        }
        be->release_host(p);
      });
  be_.zero(act_.step_sums, sizeof(StepSums));
  const Arena& s = scratch_;
  act_.dh = s.f32("grad.dh");
  act_.dA = s.f32("grad.dA");
  act_.dB = s.f32("grad.dB");
  act_.dI = s.f32("grad.dI");
  act_.dhead1 = s.f32("grad.dhead1");
  act_.dhead2 = s.f32("grad.dhead2");
  act_.dsmall = s.f32("grad.dsmall");
}

Arena BertModel::make_arena(const std::string& group) {
  if (be_.host_memory()) return Arena(plan_, group);
  if (plan_.group_bytes(group) != plan_.group_span(group))
    fail("the ", be_.name(), " backend cannot leave parts of ", group,
         " unbacked: the sharded fp32 master (--shard-optimizer with bf16) is for CPUs for now");
  const size_t bytes = std::max<size_t>(plan_.group_span(group), kAlign);
  void* p = be_.allocate_for(  // zeroed
      bytes, str("the model's ", group, " (", human_bytes(static_cast<double>(bytes)),
                 " of its plan's ", human_bytes(static_cast<double>(plan_.total_bytes())), ")"));
  device_blocks_.emplace_back(p, [be = &be_](void* q) { be->release(q); });
  return Arena(plan_, group, static_cast<std::byte*>(p));
}

void BertModel::stage_inputs(const Batch& b, Staged& st, int slot) {
  const bool up = unpadded();
  const Packed& pk = st.packed;
  KernelInputs& in = st.in;
  struct Source {
    const void* data;
    size_t bytes, room;
    const void** at;
  };
  std::array<Source, 28> sources;  // (no allocation in a step: tests/test_no_alloc.cpp)
  size_t count = 0;
  // (room: the bytes the array may take in a batch of this shape, so that each array of every
  // such batch lies where a CUDA graph's launches read it)
  auto use = [&](const auto& v, auto& field, size_t room = 0) {
    field = v.data();
    const size_t bytes = v.size() * sizeof(*v.data());
    sources[count++] = {v.data(), bytes, std::max(bytes, room),
                        reinterpret_cast<const void**>(&field)};
  };
  use(up ? pk.ids : b.input_ids, in.ids);
  use(up ? pk.segments : b.segment_ids, in.segments);
  use(up ? pk.mask : b.input_mask, in.mask);
  use(b.span_positions, in.span_positions);
  use(b.next_sentence_labels, in.nsp_labels);
  use(b.label_ids, in.label_ids);
  use(b.label_values, in.label_values);
  use(up ? pk.mlm : b.masked_lm_positions, in.mlm_positions);
  use(compact_mlm() ? pk.mlm_ids : b.masked_lm_ids, in.mlm_ids);
  use(compact_mlm() ? pk.mlm_weights : b.masked_lm_weights, in.mlm_weights);
  use(up ? pk.token_labels : b.token_label_ids, in.token_labels);
  use(up ? pk.token_weights : b.token_label_weights, in.token_weights);
  in.positions = in.padded_row = in.cls = in.starts = nullptr;
  if (up) {
    use(pk.positions, in.positions);
    use(pk.padded_row, in.padded_row);
    use(pk.cls, in.cls);
    use(pk.starts, in.starts);
  }
  if (be_.host_memory()) return;
  // The tokens grouped by embedding table row: the kernels sum each row's gradients in parallel.
  const int64_t tokens = up ? pk.rows : b.B * b.T;
  auto group = [&](kernels::RowGrouping& g, kernels::RowRuns& r, const int32_t* keys,
                   int64_t rows) {
    g.build(keys, b.T, tokens, rows);
    use(g.order(), r.order);
    use(g.chunks(), r.chunks,
        static_cast<size_t>(kernels::max_chunks(tokens, rows)) * sizeof(kernels::EmbeddingChunk));
    use(g.sums(), r.sums,
        static_cast<size_t>(kernels::max_sums(tokens, rows)) * sizeof(kernels::EmbeddingSum));
    use(g.counts(), r.counts);
    r.num_chunks = static_cast<int64_t>(g.chunks().size());
    r.num_sums = static_cast<int64_t>(g.sums().size());
    r.partials = g.partials();
  };
  group(st.by_word, in.runs.word, up ? pk.ids.data() : b.input_ids.data(), cfg_.vocab_size);
  group(st.by_position, in.runs.position, up ? pk.positions.data() : nullptr,
        cfg_.max_position_embeddings);
  group(st.by_token_type, in.runs.token_type, up ? pk.segments.data() : b.segment_ids.data(),
        cfg_.type_vocab_size);
  // Laid out as the slot's plan region, each array 256-byte aligned, in the slot's part of the
  // backend's host staging memory (once the slot's last copy out of it has run), then one copy
  // (which waits on the device for the kernels that last read the slot).
  size_t need = 0;
  for (size_t i = 0; i < count; ++i) need += align_up(sources[i].room, 256);
  const size_t room = input_bytes(dims_);
  BT_CHECK(need <= room, "the batch arrays take ", need, " bytes, the plan's input slot ", room,
           " (model::input_bytes)");
  be_.wait_upload(input_slot_[slot]);
  std::byte* staging = staging_slot_[slot];
  std::byte* region = input_slot_[slot];
  size_t at = 0;
  for (size_t i = 0; i < count; ++i) {
    const Source& x = sources[i];
    if (x.bytes) std::memcpy(staging + at, x.data, x.bytes);
    *x.at = x.room ? region + at : nullptr;  // (where a graph read it, whatever the batch)
    at += align_up(x.room, 256);
  }
  be_.upload(region, staging, at);
}

const float* BertModel::host_output(const float* p, int64_t n) const {
  if (be_.host_memory() || !p) return p;
  auto& [made_after, copy] = outputs_[p];
  if (made_after != passes_ || copy.size() != static_cast<size_t>(n)) {
    copy.resize(static_cast<size_t>(n));
    be_.to_host(copy.data(), p, copy.size() * sizeof(float));
    made_after = passes_;
  }
  return copy.data();
}

const float* BertModel::mlm_logits() const {
  const int64_t rows = compact_mlm() ? cur_.packed.mlm_rows : cur_.packed.B * cur_.packed.P,
                V = cfg_.vocab_size, Vr = vocab_rows(cfg_);
  const float* padded = host_output(act_.mlm_logits, rows * Vr);
  if (V == Vr || !padded) return padded;
  auto& [made_after, copy] = mlm_logits_;
  if (made_after != passes_ || copy.size() != static_cast<size_t>(rows * V)) {
    copy.resize(static_cast<size_t>(rows * V));
    for (int64_t r = 0; r < rows; ++r) std::copy_n(padded + r * Vr, V, copy.data() + r * V);
    made_after = passes_;
  }
  return copy.data();
}

void BertModel::place_gradients(std::byte* memory) {
  BT_CHECK(be_.host_memory(), "gradients in the ", be_.name(), " backend's memory stay there");
  Arena moved(plan_, "gradients", memory);
  std::memcpy(moved.base(), grads_.base(), grads_.bytes());
  grads_ = std::move(moved);
}

void BertModel::init_params(uint64_t seed) {
  const auto& ps = table_.params();
  for (size_t t = 0; t < ps.size(); ++t)
    write_param(ps[t], [&](float* out) { table_.initialize_tensor(t, out, cfg_, seed); });
}

void BertModel::write_param(const ParamInfo& p, const std::function<void(float*)>& read) {
  if (!be_.host_memory()) {  // made on the host, copied to the backend's memory
    std::vector<float> host(static_cast<size_t>(p.numel()));
    read(host.data());
    be_.to_device(params() + p.offset, host.data(), host.size() * sizeof(float));
    w16_fresh_ = false;
    return;
  }
  if (!dims_.master_shard) {
    read(params() + p.offset);
    w16_fresh_ = false;  // the 16-bit copy follows at the next forward
    return;
  }
  const int64_t n = p.numel();
  if (!p.matmul) {
    read(params() + p.offset);
    be_.copy_weights(prec_, params() + p.offset, w16_ + p.offset, n);
    return;
  }
  std::vector<float> whole(static_cast<size_t>(n));
  read(whole.data());
  be_.copy_weights(prec_, whole.data(), w16_ + p.offset, n);
  const int64_t b = std::max(p.offset, dims_.master_begin), e = std::min(p.end(), dims_.master_end);
  if (e > b) std::copy(whole.data() + (b - p.offset), whole.data() + (e - p.offset), params() + b);
}

const char* BertModel::attention_kernel() const {
  if (!dims_.blocked_attention()) return "full";
  return dims_.fused_attention ? "fused" : "blocked";
}

void BertModel::zero_grads() {
  be_.zero(grads_.base(), static_cast<int64_t>(grads_.bytes()));
}

void BertModel::pack(const Batch& b, Packed& pk) const {
  const int64_t B = b.B, T = b.T, P = b.P;
  pk.starts.assign(1, 0);
  pk.runs.clear();
  int64_t r = 0;
  for (int64_t e = 0; e < B; ++e) {
    r += real_length(b, e);
    pk.starts.push_back(static_cast<int32_t>(r));  // int32, as the kernels' row indices
    if (e > 0 && pk.len(e) == pk.len(e - 1))
      ++pk.runs.back().second;
    else
      pk.runs.push_back({e, 1});
  }
  pk.real = r;
  const int64_t budget = dims_.pack_rows > 0 ? dims_.pack_rows * dims_.seq_len : B * T;
  if (r > budget)
    fail("the batch's ", B, " sequences hold ", r, " real tokens, more than the ", budget,
         " planned (", dims_.pack_rows, " packed rows of ", dims_.seq_len,
         "); pack the batch with the same --batch-size and --seq-len as the model");
  const int64_t quantum = row_quantum();
  pk.rows = std::min(budget, (r + quantum - 1) / quantum * quantum);
  pk.ids.assign(pk.rows, cfg_.pad_token_id);
  pk.segments.assign(pk.rows, 0);
  pk.positions.assign(pk.rows, 0);
  pk.mask.assign(pk.rows, 0);
  pk.padded_row.assign(pk.rows, 0);
  for (int64_t e = 0; e < B; ++e)
    for (int64_t t = 0; t < pk.len(e); ++t) {
      const int64_t row = pk.start(e) + t;
      pk.padded_row[row] = static_cast<int32_t>(e * T + t);
      pk.ids[row] = b.input_ids[e * T + t];
      pk.segments[row] = b.segment_ids[e * T + t];
      pk.positions[row] = static_cast<int32_t>(t);
      pk.mask[row] = b.input_mask[e * T + t];
    }
  if (head_ == Head::TokenClassification) {
    pk.token_labels.assign(pk.rows, 0);
    pk.token_weights.assign(pk.rows, 0.0f);
    for (int64_t e = 0; e < B; ++e)
      for (int64_t t = 0; t < pk.len(e); ++t) {
        pk.token_labels[pk.start(e) + t] = b.token_label_ids[e * T + t];
        pk.token_weights[pk.start(e) + t] = b.token_label_weights[e * T + t];
      }
  }
  pk.cls.resize(B);
  for (int64_t e = 0; e < B; ++e) pk.cls[e] = static_cast<int32_t>(pk.start(e));
  // A masked position past the real length has weight 0 (real_length): its loss is multiplied
  // by 0, so any row of the sequence serves; its first.
  pk.mlm.resize(B * P);
  for (int64_t e = 0; e < B; ++e)
    for (int64_t j = 0; j < P; ++j) {
      const int64_t t = b.masked_lm_positions[e * P + j];
      pk.mlm[e * P + j] = static_cast<int32_t>(pk.start(e) + (t < pk.len(e) ? t : 0));
    }
  pk.mlm_rows = B * P;
  if (!compact_mlm()) return;
  // The weighted predictions only (at least one row, weight 0, when there are none): a slot
  // without weight adds 0 to the loss and its gradient, whatever its logits.
  pk.mlm_ids.clear();
  pk.mlm_weights.clear();
  int64_t n = 0;
  for (int64_t i = 0; i < B * P; ++i)
    if (b.masked_lm_weights[i] != 0.0f) {
      pk.mlm[n++] = pk.mlm[i];
      pk.mlm_ids.push_back(b.masked_lm_ids[i]);
      pk.mlm_weights.push_back(b.masked_lm_weights[i]);
    }
  const int64_t most = dims_.token_rows() * dims_.max_predictions;
  if (n > most)
    fail("the batch holds ", n, " weighted masked predictions, more than the ", most, " planned (",
         dims_.pack_rows, " packed rows x ", setting("max_predictions"), " ", dims_.max_predictions,
         ")");
  // (graphed: every slot the batch's shape has room for, one shape, those past the predictions
  // weight 0)
  for (const int64_t rows = graph_shapes() ? std::min(most, B * P) : 1; n < rows; ++n) {
    pk.mlm[n] = 0;
    pk.mlm_ids.push_back(0);
    pk.mlm_weights.push_back(0.0f);
  }
  pk.mlm.resize(n);
  pk.mlm_rows = n;
}

int64_t BertModel::sequence_row(int64_t b, int64_t t) const {
  if (!unpadded()) return b * cur_.packed.T + t;
  return t < cur_.packed.len(b) ? cur_.packed.start(b) + t : -1;
}

void BertModel::packed_attention(int64_t l, bool forward, Kept dqkv, float* dbias,
                                 kernels::KeptIn dctx, const StepOptions& opt) {
  const Packed& pk = cur_.packed;
  const int64_t C = cfg_.hidden_size, NH = cfg_.num_attention_heads, T = pk.T;
  const float p_attn = opt.training ? cfg_.attention_probs_dropout_prob : 0.0f;
  const Dropout site = site_of(opt, step_args_, l + 1, kAttnProbs, p_attn);
  const LayerActs& a = act_.layers[l];
  // The dummy rows past the real tokens take no part in attention: their context is zero, not
  // stale values (their kept bits +0 in bf16 and fp16), and no gradient reaches the QKV weights
  // from them (dQKV zero there too).
  // One call for every sequence, each over its length, where the backend takes them (the
  // dummy rows zeroed by that call: AttentionShape::starts).
  const AttentionShape all{pk.B, T, C, NH, T, cur_.in.starts, pk.rows};
  if (dims_.fused_attention) {
    const Dropout& d = site;
    // (QKV's 16-bit copy alone where its product wrote only that, and the context's written
    // alone: ModelDims::qkv16_output)
    const Kept qkv = dims_.qkv16_output ? Kept{nullptr, a.qkv.bits} : a.qkv;
    const Kept ctx = dims_.qkv16_output ? Kept{nullptr, a.ctx.bits} : a.ctx;
    if (forward)
      be_.attention_forward(prec_, ctx, a.saved, qkv, cur_.in.mask, all, d, ws_);
    else
      be_.attention_bias_backward(prec_, dqkv, dbias, dctx, a.qkv, a.saved, cur_.in.mask, all, d,
                                  ws_);
    return;
  }
  int64_t saved = 0;  // values of the probabilities (or the log-sum-exp) the runs before used
  for (const auto& [first, count] : pk.runs) {
    const int64_t L = pk.len(first), r0 = pk.start(first);
    const AttentionShape s{count, L, C, NH, T};
    AttentionSaved sv = a.saved;
    if (sv.lse) sv.lse += saved;
    if (sv.probs) sv.probs += saved;
    if (sv.probs16) sv.probs16 += saved;
    if (sv.ctx16) sv.ctx16 += r0 * C;
    saved += count * NH * L * (sv.blocked() ? 1 : L);
    const Kept qkv{a.qkv.f32 + r0 * 3 * C, a.qkv.bits ? a.qkv.bits + r0 * 3 * C : nullptr};
    // The run's probabilities draw the padded model's dropout: its sequences' [NH,T,T] blocks.
    Dropout d = site;
    d.offset = static_cast<uint64_t>(first * NH * T * T);
    const int32_t* mask = cur_.in.mask + r0;
    if (forward)
      be_.attention_forward(prec_, {a.ctx.f32 + r0 * C, a.ctx.bits ? a.ctx.bits + r0 * C : nullptr},
                            sv, qkv, mask, s, d, ws_);
    else
      be_.attention_backward(prec_, dqkv.f32 + r0 * 3 * C, dctx.f32 + r0 * C, qkv, sv, mask, s, d,
                             ws_);
  }
  const int64_t width = forward ? C : 3 * C, dummies = (pk.rows - pk.real) * width;
  const Kept out = forward ? a.ctx : dqkv;
  be_.zero(out.f32 + pk.real * width, static_cast<int64_t>(f32s(dummies)));
  if (out.bits) be_.zero(out.bits + pk.real * width, dummies * int64_t{sizeof(uint16_t)});
  if (forward) return;
  // The runs' rows at once (a pass each, not one a run): the bias gradient and the 16-bit copy.
  be_.rounded_column_sums(prec_, dbias, dqkv, pk.real, 3 * C);
}

void BertModel::prepare(const Batch& b, Staged& st, int slot) {
  if (b.packed_rows > 0 && (dims_.pack_rows == 0 || b.packed_rows > dims_.pack_rows))
    fail("a batch packed into ", b.packed_rows, " rows needs a model planned for packing (",
         setting("pack"), ") with at least that ", setting("batch_size"),
         "; this one is planned for ", dims_.pack_rows, " packed rows");
  if (b.B > dims_.batch || b.T > dims_.seq_len || b.P > dims_.max_predictions)
    fail("batch [", b.B, " x ", b.T, ", ", b.P, " predictions] exceeds the planned [", dims_.batch,
         " x ", dims_.seq_len, ", ", dims_.max_predictions, "]");
  validate_batch(b, cfg_, head_);
  st.packed.B = b.B;
  st.packed.T = b.T;
  st.packed.P = b.P;
  if (unpadded()) pack(b, st.packed);
  stage_inputs(b, st, slot);
}

void BertModel::stage(const Batch& b) {
  next_for_ = nullptr;  // (should b fail its checks)
  prepare(b, next_, 1 - slot_);
  next_for_ = &b;
}

// One forward or backward pass's shapes and dropout sites: B sequences of T tokens, N rows the
// encoder runs (the packed rows when unpadded), C hidden, L layers.
struct BertModel::Pass {
  const StepOptions& opt;
  bool up;
  int64_t B, T, N, C, L;
  float p_hidden;
  const uint64_t* args;  // the step's arguments (step_args_), in the backend's memory
  Dropout site(int64_t layer, Site s, float p) const { return site_of(opt, args, layer, s, p); }
  // The head's loss divisor (a double) and gradient scale (a float), after the sites' arguments.
  const uint64_t* head_args() const { return args + site_index(L + 2, kEmbedding); }
  // Site s's first index: this micro-batch's offset in the site's index space ([B, T, C] but for
  // the attention probabilities' [B, NH, T, T] and the pooler's [B, C]).
  uint64_t site_offset(Site s, int64_t NH) const {
    const uint64_t e = opt.example_offset;
    return s == kAttnProbs ? e * NH * T * T : s == kPooler ? e * C : e * T * C;
  }
};

BertModel::Pass BertModel::pass(const Batch& b, const StepOptions& opt) const {
  const bool up = unpadded();
  const int64_t C = cfg_.hidden_size;
  return Pass{opt,
              up,
              b.B,
              b.T,
              up ? cur_.packed.rows : b.B * b.T,
              C,
              cfg_.num_hidden_layers,
              opt.training ? cfg_.hidden_dropout_prob : 0.0f,
              step_args_};
}

Losses BertModel::forward(const Batch& b, const StepOptions& opt) {
  if (next_for_ != &b) prepare(b, next_, 1 - slot_);
  next_for_ = nullptr;
  // The last batch's kernels were the last to read its slot; this one's run after its copy.
  be_.release_input(input_slot_[slot_]);
  slot_ = 1 - slot_;
  std::swap(cur_, next_);
  be_.use_input(input_slot_[slot_]);
  bind_kernel_scratch();
  // A sharded master's bf16 copy is the model's weights (write_param, the optimizer and the
  // step keep it current); else it follows the fp32 master.
  if (!w16_fresh_ && !dims_.master_shard) be_.copy_weights(prec_, params(), w16_, table_.total());
  w16_fresh_ = false;
  ++passes_;  // the outputs copied out before are stale now (backward too)
  const Pass p = pass(b, opt);
  send_step_args(p, b);
  int64_t real = p.up ? cur_.packed.real : 0;
  if (!p.up)
    for (int64_t e = 0; e < p.B; ++e) real += real_length(b, e);
  Losses out;
  out.real_tokens = real;
  out.computed_tokens = p.N;
  if (!graphed(b, opt)) {
    forward_kernels(p, b, out);
    return out;
  }
  // A graph's forward: what the host knows of the losses (the device keeps the sums), as the
  // kernels' forward leaves it, which the capture checks.
  Losses known = out;
  known.mlm_weight = mlm_weight_;
  known.tokens_scored = head_ == Head::TokenClassification ? static_cast<int64_t>(tokens_scored_)
                        : head_ == Head::QuestionAnswering ? 2 * p.B
                                                           : 0;
  run_graph(graph_key(true, opt, 1.0f), [&] {
    forward_kernels(p, b, out);
    BT_CHECK(out.loss == 0 && out.mlm_loss == 0 && out.nsp_loss == 0 && out.mlm_correct == 0 &&
                 out.nsp_correct == 0 && out.cls_correct == 0 && out.tokens_correct == 0 &&
                 out.mlm_weight == known.mlm_weight && out.tokens_scored == known.tokens_scored,
             "a graph's forward: the host's losses are not what the captured forward left");
  });
  mlm_grad_ready_ = opt.training && head_ == Head::Pretraining;
  seq_out_ = p.L > 0 ? act_.layers[static_cast<size_t>(p.L - 1)].ln2_out : act_.h0;
  return known;
}

void BertModel::forward_kernels(const Pass& p, const Batch& b, Losses& out) {
  const ParamTable& t = table_;
  be_.embedding_layernorm_forward(
      act_.h0, act_.emb_sum, act_.emb_mean, act_.emb_rstd, cur_.in.ids, cur_.in.segments,
      cur_.in.positions, W(t.embeddings().word), W(t.embeddings().position),
      W(t.embeddings().token_type), W(t.embeddings().ln_w), W(t.embeddings().ln_b), p.up ? 1 : p.B,
      p.up ? p.N : p.T, p.C, cfg_.layer_norm_eps, on_rows(p.site(0, kEmbedding, p.p_hidden)));

  const float* x = act_.h0;
  for (int64_t l = 0; l < p.L; ++l) {
    obs::Timeline::Span span(timeline_, str("forward layer ", l), "compute");
    layer_forward(l, x, b, p.opt);
    x = act_.layers[l].ln2_out;
  }
  seq_out_ = const_cast<float*>(x);

  switch (head_) {
    case Head::TokenClassification:
      token_classifier_forward(p, x, out);
      break;
    case Head::QuestionAnswering:
      qa_forward(p, x, out);
      break;
    case Head::Pretraining:
      pooler_forward(p, x);
      pretraining_forward(p, b, x, out);
      break;
    case Head::SequenceClassification:
      pooler_forward(p, x);
      classifier_forward(p, out);
      break;
  }
}

void BertModel::layer_forward(int64_t l, const float* x, const Batch& b, const StepOptions& opt) {
  const bool up = unpadded();
  const int64_t B = b.B, T = b.T, N = up ? cur_.packed.rows : B * T, C = cfg_.hidden_size,
                I = cfg_.intermediate_size, NH = cfg_.num_attention_heads;
  const float eps = cfg_.layer_norm_eps;
  const float p_hidden = opt.training ? cfg_.hidden_dropout_prob : 0.0f;
  const float p_attn = opt.training ? cfg_.attention_probs_dropout_prob : 0.0f;
  auto site = [&](Site s, float p) { return site_of(opt, step_args_, l + 1, s, p); };
  const LayerOffsets& o = table_.layer(l);
  const LayerActs& a = act_.layers[l];
  uint16_t* x16 = input16(l);
  // (its 16-bit copy alone where the attention reads only that: ModelDims::qkv16_output)
  const Kept qkv = dims_.qkv16_output ? Kept{nullptr, a.qkv.bits} : a.qkv;
  if (dims_.qkv16_output)
    be_.linear_forward_16(prec_, qkv.bits, {const_cast<float*>(x), x16}, Wt(o.qkv_w),
                          Wt(o.qkv_b).bits, N, 3 * C, C, ws_);
  else
    be_.linear_forward(prec_, qkv.f32, {const_cast<float*>(x), x16}, Wt(o.qkv_w), W(o.qkv_b), N,
                       3 * C, C, ws_);
  if (up) {
    packed_attention(l, true, Kept{}, nullptr, {}, opt);
  } else {
    // (the fused kernel: the context's 16-bit copy alone, what the products read)
    const bool copy_alone = dims_.qkv16_output && dims_.fused_attention;
    be_.attention_forward(prec_, copy_alone ? Kept{nullptr, a.ctx.bits} : a.ctx, a.saved, qkv,
                          cur_.in.mask, {B, T, C, NH}, site(kAttnProbs, p_attn), ws_);
  }
  // The projections and their residual LayerNorms: x = dropout(y) + residual in fp32 (what
  // backward reads), y written in fp32 there, or its 16-bit copy alone (ModelDims::
  // proj16_output). The LayerNorms write their output's 16-bit copy (none where the matmuls read
  // fp32): the next product's input, and backward's.
  const auto project = [&](float* sum, Kept in, int64_t w, int64_t bias, int64_t K,
                           const float* residual, Kept out, float* mean, float* rstd, int64_t ln_w,
                           int64_t ln_b, const kernels::Dropout& d) {
    if (dims_.proj16_output) {
      be_.linear_forward_16(prec_, proj16_, in, Wt(w), Wt(bias).bits, N, C, K, ws_);
      be_.residual_layernorm_forward_16(prec_, out, mean, rstd, sum, proj16_, residual, W(ln_w),
                                        W(ln_b), N, C, eps, d);
    } else {
      be_.linear_forward(prec_, sum, in, Wt(w), W(bias), N, C, K, ws_);
      be_.residual_layernorm_forward(prec_, out, mean, rstd, sum, residual, W(ln_w), W(ln_b), N, C,
                                     eps, d);
    }
  };
  const Kept ln1{a.ln1_out, a.ln1_out16};
  project(a.attn_res, a.ctx, o.attn_out_w, o.attn_out_b, C, x, ln1, a.ln1_mean, a.ln1_rstd, o.ln1_w,
          o.ln1_b, on_rows(site(kAttnOut, p_hidden)));
  if (dims_.inter16_output) {  // (GELU's input's 16-bit copy alone: ModelDims::inter16_output)
    be_.linear_forward_16(prec_, a.inter_pre.bits, ln1, Wt(o.inter_w), Wt(o.inter_b).bits, N, I, C,
                          ws_);
    be_.activation_forward(prec_, cfg_.activation(), a.inter_act, {nullptr, a.inter_pre.bits},
                           N * I);
  } else {
    be_.linear_forward(prec_, a.inter_pre.f32, ln1, Wt(o.inter_w), W(o.inter_b), N, I, C, ws_);
    be_.activation_forward(prec_, cfg_.activation(), a.inter_act, a.inter_pre, N * I);
  }
  project(a.ffn_res, a.inter_act, o.out_w, o.out_b, I, a.ln1_out, {a.ln2_out, a.ln2_out16},
          a.ln2_mean, a.ln2_rstd, o.ln2_w, o.ln2_b, on_rows(site(kFfnOut, p_hidden)));
}

uint16_t* BertModel::input16(int64_t l) const {
  return l > 0 ? act_.layers[l - 1].ln2_out16 : nullptr;
}

std::pair<int64_t, int64_t> BertModel::layer_range(int64_t l) const {
  return table_.layer_range(l);
}

void BertModel::backward(const Batch& b, const StepOptions& opt, kernels::Multiplier loss_scale,
                         const std::function<void(int64_t)>& layer_done) {
  ++passes_;
  bind_kernel_scratch();
  const Pass p = pass(b, opt);
  // (a layer's end reported as backward reaches it: the host must issue it)
  if (layer_done || !graphed(b, opt)) return backward_kernels(p, b, loss_scale, layer_done);
  run_graph(graph_key(false, opt, loss_scale), [&] { backward_kernels(p, b, loss_scale, {}); });
  mlm_grad_ready_ = false;
}

void BertModel::backward_kernels(const Pass& p, const Batch& b, kernels::Multiplier loss_scale,
                                 const std::function<void(int64_t)>& layer_done) {
  float* dh = act_.dh;  // gradient of the residual stream [N,C]
  be_.zero(dh, static_cast<int64_t>(f32s(p.N * p.C)));
  // The heads: all of dh (token classification, QA), or the MLM rows of dh and dpooled.
  float* dpooled = act_.dhead2;  // [B,C]
  switch (head_) {
    case Head::TokenClassification:
      token_classifier_backward(p, loss_scale, dh);
      break;
    case Head::QuestionAnswering:
      qa_backward(p, loss_scale, dh);
      break;
    case Head::Pretraining:
      pretraining_backward(p, b, loss_scale, dpooled, dh);
      pooler_backward(p, dpooled, dh);
      break;
    case Head::SequenceClassification:
      classifier_backward(p, loss_scale, dpooled);
      pooler_backward(p, dpooled, dh);
      break;
  }
  // The encoder, last layer first.
  for (int64_t l = p.L - 1; l >= 0; --l) {
    obs::Timeline::Span span(timeline_, str("backward layer ", l), "compute");
    layer_backward(l, p, b, dh);
    if (layer_done) layer_done(l);
  }
  embeddings_backward(p, dh);
}

void BertModel::linear_backward(float* dinp, int64_t w_off, int64_t b_off, kernels::KeptIn dout,
                                Kept in, int64_t M, int64_t N, int64_t K, bool accumulate) {
  be_.linear_backward(prec_, dinp, G(w_off), b_off == kBiasDone ? nullptr : G(b_off), dout, in,
                      Wt(w_off), M, N, K, accumulate, ws_);
}

// One encoder layer's backward: dh (the gradient of its output) becomes that of its input.
void BertModel::layer_backward(int64_t l, const Pass& p, const Batch& b, float* dh) {
  const int64_t N = p.N, C = p.C, I = cfg_.intermediate_size, NH = cfg_.num_attention_heads;
  const float p_attn = p.opt.training ? cfg_.attention_probs_dropout_prob : 0.0f;
  const LayerOffsets& o = table_.layer(l);
  const LayerActs& a = act_.layers[l];
  float *dA = act_.dA, *dB = act_.dB, *dI = act_.dI;
  float* x = l == 0 ? act_.h0 : act_.layers[l - 1].ln2_out;
  if (dims_.recompute_layers && l != p.L - 1) {  // the last layer's forward is still in the slot
    obs::Timeline::Span recompute(timeline_, str("recompute layer ", l), "compute");
    layer_forward(l, x, b, p.opt);
  }
  // The output gradients the 16-bit products read are rounded by their producers, into the
  // operand scratch the products would round them into (none in fp32: half_a is null).
  const Kept dB16{dB, ws_.half_a}, dI16{dI, ws_.half_a};
  // Where the products read 16-bit operands on a GPU, the output gradients' 16-bit copies alone
  // are written (nothing reads their fp32 values: the bias gradients are summed as they are made).
  const bool bits_only = dims_.weight_copy() && be_.writes_16bit_outputs();
  const Kept dB_made = bits_only ? Kept{nullptr, dB16.bits} : dB16;
  // h_out = LN2(ffn_res), ffn_res = drop(inter_act W_out + b) + ln1_out
  // (with the output projection's bias gradient: one launch over the rows on a GPU)
  be_.layernorm_dropout_backward(prec_, dA, dB_made, G(o.ln2_w), G(o.ln2_b), G(o.out_b), dh,
                                 a.ffn_res, W(o.ln2_w), a.ln2_mean, a.ln2_rstd, N, C, false,
                                 on_rows(p.site(l + 1, kFfnOut, p.p_hidden)));
  // dGELU with the intermediate layer's bias gradient (one pass over dI on a GPU; bits_only: dI's
  // 16-bit copy alone), from GELU's output gradient: fp32, or its 16-bit copy alone
  // (ModelDims::inter16_output: the product writes it into dI's memory, whose fp32 values
  // nothing writes then)
  kernels::KeptIn dact{dI};
  if (dims_.inter16_output) {
    auto* dact16 = reinterpret_cast<uint16_t*>(dI);
    be_.linear_backward_16(prec_, dact16, G(o.out_w), nullptr, dB16, a.inter_act, Wt(o.out_w), N, C,
                           I, ws_);
    dact = {nullptr, dact16};
  } else {
    linear_backward(dI, o.out_w, kBiasDone, dB16, a.inter_act, N, C, I);
  }
  BT_CHECK(!dims_.inter16_output || bits_only, "inter16_output writes dI's 16-bit copy alone");
  be_.activation_bias_backward(prec_, cfg_.activation(),
                               bits_only ? Kept{nullptr, dI16.bits} : dI16, G(o.inter_b),
                               a.inter_pre, dact, N, I);
  linear_backward(dA, o.inter_w, kBiasDone, dI16, {a.ln1_out, a.ln1_out16}, N, I, C,
                  /*accumulate=*/true);  // dA = d ln1_out (residual + FFN path)
  // ln1_out = LN1(attn_res), attn_res = drop(ctx W_o + b) + x
  be_.layernorm_dropout_backward(prec_, dh, dB_made, G(o.ln1_w), G(o.ln1_b), G(o.attn_out_b), dA,
                                 a.attn_res, W(o.ln1_w), a.ln1_mean, a.ln1_rstd, N, C, false,
                                 on_rows(p.site(l + 1, kAttnOut, p.p_hidden)));
  // The context's gradient: where QKV's product writes its 16-bit copy alone
  // (ModelDims::qkv16_output: a GPU's, the full kernel's products or the fused kernel), the
  // output projection's product writes dctx's copy alone, what the attention reads (no rounding
  // pass).
  kernels::KeptIn dctx{dA};
  if (dims_.qkv16_output) {
    be_.linear_backward_16(prec_, ws_.attn_dctx16, G(o.attn_out_w), nullptr, dB16, a.ctx,
                           Wt(o.attn_out_w), N, C, C, ws_);
    dctx = {nullptr, ws_.attn_dctx16};
  } else {
    linear_backward(dA, o.attn_out_w, kBiasDone, dB16, a.ctx, N, C, C);
  }
  // dQKV with QKV's bias gradient and its 16-bit copy (the fused kernel's own, on a GPU: the copy
  // alone where the products read only that, bits_only)
  const Kept dqkv_made = bits_only && dims_.fused_attention ? Kept{nullptr, dI16.bits} : dI16;
  if (p.up) {
    packed_attention(l, false, dqkv_made, G(o.qkv_b), dctx, p.opt);
  } else {
    be_.attention_bias_backward(prec_, dqkv_made, G(o.qkv_b), dctx, a.qkv, a.saved, cur_.in.mask,
                                {p.B, p.T, C, NH}, p.site(l + 1, kAttnProbs, p_attn), ws_);
  }
  linear_backward(dh, o.qkv_w, kBiasDone, dI16, {x, input16(l)}, N, 3 * C, C,
                  /*accumulate=*/true);  // dh = d x (residual + attention path)
}

void BertModel::embeddings_backward(const Pass& p, float* dh) {
  const ParamTable& t = table_;
  const int64_t word = t.embeddings().word, C = p.C;
  float* dA = act_.dA;
  be_.dropout_backward(dh, dh, p.N, C, on_rows(p.site(0, kEmbedding, p.p_hidden)));
  be_.layernorm_backward(dA, G(t.embeddings().ln_w), G(t.embeddings().ln_b), dh, act_.emb_sum,
                         W(t.embeddings().ln_w), act_.emb_mean, act_.emb_rstd, p.N, C);
  // HF's padding_idx: the [PAD] row gets no gradient from the embedding lookup (only the question
  // answering head's softmax over all positions reaches padding; the other heads never do). The
  // row is kept aside and put back: a tied MLM decoder has already added its own gradient to it.
  float* pad_row = G(word + cfg_.pad_token_id * C);
  be_.copy(act_.dhead1, pad_row, C);
  // A graph's: grids for any batch of the shape, the blocks past the batch's groups idle.
  kernels::EmbeddingRuns runs = cur_.in.runs;
  if (graph_of_.capturing()) {
    auto bound = [&](kernels::RowRuns& r, int64_t rows) {
      r.num_chunks = kernels::max_chunks(p.N, rows);
      r.num_sums = kernels::max_sums(p.N, rows);
      r.partials = kernels::max_partials(p.N);
    };
    bound(runs.word, cfg_.vocab_size);
    bound(runs.position, cfg_.max_position_embeddings);
    bound(runs.token_type, cfg_.type_vocab_size);
  }
  be_.embedding_backward(G(word), G(t.embeddings().position), G(t.embeddings().token_type), dA,
                         cur_.in.ids, cur_.in.segments, cur_.in.positions, p.up ? 1 : p.B,
                         p.up ? p.N : p.T, C, be_.host_memory() ? nullptr : &runs);
  be_.copy(pad_row, act_.dhead1, C);
}

// ---- the heads, each forward beside its backward ----

// A head's cross-entropy over N rows: its sums returned, or with StepOptions::device_sums
// added to the step's on the device (the loss / divisor to StepSums::loss, the hits to `hits`,
// a non-finite loss counted) and zero sums returned.
CrossEntropySums BertModel::head_loss(const Pass& p, double divisor, double* hits, float* dlogits,
                                      const float* logits, const int32_t* targets,
                                      const float* weights, int64_t N, kernels::Classes c,
                                      kernels::Multiplier dscale, const double* divisor_at) {
  if (!p.opt.device_sums)
    return be_.cross_entropy(dlogits, act_.row_loss, act_.row_correct, logits, targets, weights, N,
                             c, dscale);
  static_assert(offsetof(StepSums, nonfinite) == 4 * sizeof(double));
  const kernels::SumsInto into{act_.step_sums, divisor, hits, act_.step_sums + 4, divisor_at};
  be_.cross_entropy_into(into, dlogits, act_.row_loss, act_.row_correct, logits, targets, weights,
                         N, c, dscale);
  return {};
}

GraphMode parse_graph_mode(const std::string& s) {
  if (s == "off") return GraphMode::Off;
  if (s == "auto") return GraphMode::Auto;
  if (s == "on") return GraphMode::On;
  fail(setting("cuda_graphs"), " must be auto, on or off, got '", s, "'");
}

const char* graph_mode_name(GraphMode m) {
  return m == GraphMode::Off ? "off" : m == GraphMode::Auto ? "auto" : "on";
}

int64_t BertModel::row_quantum() const {
  if (!graph_shapes()) return kRowQuantum;
  // (a bucket of the planned rows, one graph each, rather than every 64 rows)
  const int64_t planned = dims_.token_rows() * dims_.seq_len;
  return std::max(kRowQuantum,
                  (planned / kGraphRowBuckets + kRowQuantum - 1) / kRowQuantum * kRowQuantum);
}

bool BertModel::graph_shapes() const {
  // (unpadded: the blocked attention's runs of equal lengths change the launches from batch to
  // batch, the fused kernel's one launch does not. Every head's loss is summed on the device,
  // its divisor the shape's or the step's arguments')
  return be_.graphs() && (!unpadded() || dims_.fused_attention);
}

bool BertModel::graphed(const Batch& /*b: its shape keys the graph*/,
                        const StepOptions& opt) const {
  return graphs_ != GraphMode::Off && graph_shapes() && opt.device_sums;
}

BertModel::GraphKey BertModel::graph_key(bool forward, const StepOptions& opt,
                                         kernels::Multiplier scale) const {
  const Packed& pk = cur_.packed;
  const bool up = unpadded();
  return {forward,
          slot_,
          pk.B,
          pk.T,
          pk.P,
          up ? pk.rows : 0,
          up ? pk.mlm_rows : 0,
          opt.training,
          scale.by,
          scale.times,
          mlm_grad_ready_};
}

void BertModel::run_graph(const GraphKey& key, const std::function<void()>& issue) {
  graph_of_.run(be_, graphs_, key, key.forward ? "forward" : "backward", issue);
}

void BertModel::send_step_args(const Pass& p, const Batch& b) {
  const int64_t NH = cfg_.num_attention_heads;
  uint64_t* h = step_args_host_.data();
  for (int64_t layer = 0; layer <= p.L + 1; ++layer)
    for (uint64_t s = kEmbedding; s <= kTokens; ++s) {
      uint64_t* at = h + site_index(layer, s);
      at[0] = rng_key(p.opt.seed, p.opt.step, static_cast<uint64_t>(layer), s);
      at[1] = p.site_offset(static_cast<Site>(s), NH);
    }
  // The head's loss divisor and gradient scale, which its kernels read where they run (a
  // graph's replays too): the MLM loss's (pretraining_forward: Google BERT's mean), or the
  // token classifier's (HF's mean over the scored tokens; none scored: a loss and gradient 0).
  mlm_weight_ = 0;
  tokens_scored_ = 0;
  double divisor = kMlmDenominatorEps;
  float dscale = static_cast<float>(1.0 / divisor);
  if (head_ == Head::Pretraining) {
    const int64_t BP = p.up ? cur_.packed.mlm_rows : p.B * b.P;
    for (int64_t r = 0; r < BP; ++r) mlm_weight_ += mlm_weights(b)[r];
    divisor = mlm_weight_ + kMlmDenominatorEps;
    dscale = static_cast<float>(1.0 / divisor);
  } else if (head_ == Head::TokenClassification) {
    for (int64_t i = 0; i < p.N; ++i) tokens_scored_ += token_weights_host(b)[i];
    divisor = tokens_scored_ > 0 ? tokens_scored_ : 1.0;
    dscale = tokens_scored_ > 0 ? static_cast<float>(1.0 / tokens_scored_) : 0.0f;
  }
  uint64_t* tail = h + site_index(p.L + 2, kEmbedding);
  tail[0] = std::bit_cast<uint64_t>(divisor);
  tail[1] = std::bit_cast<uint32_t>(dscale);
  be_.send(step_args_, h, step_args_host_.size() * sizeof(uint64_t));
}

void BertModel::read_step_sums(StepSums* into) {
  be_.to_host_async(into ? into : step_sums_host_.get(), act_.step_sums, sizeof(StepSums));
  be_.zero(act_.step_sums, sizeof(StepSums));
}

StepSums BertModel::step_sums() const {
  be_.wait_to_host();
  return *step_sums_host_;
}

// HF's BertForTokenClassification: classifier(dropout(h)) on every token; the loss is the mean
// cross-entropy over the scored tokens (weight 1; HF's ignore_index -100 is weight 0). Unpadded:
// the packed rows' labels and weights (dummy rows weigh 0).
void BertModel::token_classifier_forward(const Pass& p, const float* x, Losses& out) {
  const int64_t N = p.N, C = p.C, NL = cfg_.num_labels;
  be_.copy(act_.tok_drop, x, N * C);
  be_.dropout_forward(act_.tok_drop, N, C, on_rows(p.site(p.L + 1, kTokens, p.p_hidden)));
  be_.linear_forward(prec_, act_.tok_logits, {act_.tok_drop}, Wt(table_.heads().classifier_w),
                     W(table_.heads().classifier_b), N, NL, C, ws_);
  // (the divisor as the kernels read it from the step's arguments: send_step_args')
  const double scored = tokens_scored_;
  const CrossEntropySums ce = head_loss(
      p, scored > 0 ? scored : 1.0, nullptr, nullptr, act_.tok_logits, cur_.in.token_labels,
      cur_.in.token_weights, N, NL, 0.0f, reinterpret_cast<const double*>(p.head_args()));
  out.loss = scored > 0 ? ce.loss / scored : 0.0;
  out.tokens_scored = static_cast<int64_t>(scored);
  out.tokens_correct = static_cast<int64_t>(ce.correct);
}

void BertModel::token_classifier_backward(const Pass& p, kernels::Multiplier loss_scale,
                                          float* dh) {
  const int64_t N = p.N, NL = cfg_.num_labels;
  float* dlog = act_.dsmall;  // [N,NL]
  // The gradient for loss scale 1 (1 / the scored tokens, or 0, as the kernel reads it from the
  // step's arguments), then the loss scale's factor.
  be_.cross_entropy(dlog, nullptr, nullptr, act_.tok_logits, cur_.in.token_labels,
                    cur_.in.token_weights, N, NL,
                    kernels::Multiplier{1.0f, reinterpret_cast<const float*>(p.head_args() + 1)});
  if (!loss_scale.is_one()) be_.scale_inplace(dlog, N * NL, loss_scale);
  linear_backward(dh, table_.heads().classifier_w, table_.heads().classifier_b, dlog,
                  {act_.tok_drop}, N, NL, p.C);
  be_.dropout_backward(dh, dh, N, p.C, on_rows(p.site(p.L + 1, kTokens, p.p_hidden)));
}

// HF's BertForQuestionAnswering: qa_outputs on every token's final hidden state, no dropout.
// Weight row 0 gives the start logits and row 1 the end logits, each one [N] column, so the
// batch's start logits are B rows of T and its end logits the next B rows; the loss is
// (CE(start) + CE(end)) / 2, each the mean over the batch of a softmax over the T positions.
void BertModel::qa_forward(const Pass& p, const float* x, Losses& out) {
  const int64_t N = p.N, C = p.C, B = p.B;
  const int64_t w = table_.heads().qa_w, bias = table_.heads().qa_b;
  be_.linear_forward(prec_, act_.qa_logits, {const_cast<float*>(x)}, Wt(w), W(bias), N, 1, C, ws_);
  be_.linear_forward(prec_, act_.qa_logits + N, {const_cast<float*>(x)}, Wt(w + C), W(bias + 1), N,
                     1, C, ws_);
  const CrossEntropySums ce = head_loss(p, 2.0 * B, nullptr, nullptr, act_.qa_logits,
                                        cur_.in.span_positions, nullptr, 2 * B, p.T, 0.0f);
  out.loss = ce.loss / (2.0 * B);
  out.tokens_scored = 2 * B;
  out.tokens_correct = static_cast<int64_t>(ce.correct);
}

void BertModel::qa_backward(const Pass& p, kernels::Multiplier loss_scale, float* dh) {
  const int64_t N = p.N, C = p.C, B = p.B;
  float* dlog = act_.dsmall;  // [2N]: d start logits, then d end logits
  be_.cross_entropy(dlog, nullptr, nullptr, act_.qa_logits, cur_.in.span_positions, nullptr, 2 * B,
                    p.T, loss_scale.over(2.0 * B));
  const int64_t w = table_.heads().qa_w, bias = table_.heads().qa_b;
  const Kept seq{seq_out_};
  linear_backward(dh, w, bias, dlog, seq, N, 1, C);
  linear_backward(dh, w + C, bias + 1, dlog + N, seq, N, 1, C, /*accumulate=*/true);
}

// Pooler: tanh(dense(h[:, 0])).
void BertModel::pooler_forward(const Pass& p, const float* x) {
  const int64_t B = p.B, C = p.C;
  be_.gather_rows(act_.cls_in, x, cur_.in.cls, B, 1, p.up ? 0 : p.T, C);
  be_.linear_forward(prec_, act_.pooled, {act_.cls_in}, Wt(table_.heads().pooler_w),
                     W(table_.heads().pooler_b), B, C, C, ws_);
  be_.tanh_forward(act_.pooled, act_.pooled, B * C);
}

void BertModel::pooler_backward(const Pass& p, float* dpooled, float* dh) {
  const int64_t B = p.B, C = p.C;
  be_.tanh_backward(dpooled, act_.pooled, dpooled, B * C);
  float* dcls = act_.dhead1;
  linear_backward(dcls, table_.heads().pooler_w, table_.heads().pooler_b, dpooled, {act_.cls_in}, B,
                  C, C);
  be_.scatter_add_rows(dh, dcls, cur_.in.cls, B, 1, p.up ? 0 : p.T, C);
}

// Pretraining: next-sentence prediction on the pooled [CLS], and the masked LM on the masked
// positions only (gathered first: BP rows instead of B*T), its decoder the word embeddings.
void BertModel::pretraining_forward(const Pass& p, const Batch& b, const float* x, Losses& out) {
  const ParamTable& t = table_;
  const int64_t B = p.B, C = p.C, V = cfg_.vocab_size, Vr = vocab_rows(cfg_);
  be_.linear_forward(prec_, act_.nsp_logits, {act_.pooled}, Wt(t.heads().nsp_w), W(t.heads().nsp_b),
                     B, 2, C, ws_);
  const CrossEntropySums nsp = head_loss(p, static_cast<double>(B), &act_.step_sums[2], nullptr,
                                         act_.nsp_logits, cur_.in.nsp_labels, nullptr, B, 2, 0.0f);
  out.nsp_loss = nsp.loss / B;
  out.nsp_correct = static_cast<int64_t>(nsp.correct);

  const int64_t BP = p.up ? cur_.packed.mlm_rows : B * b.P;
  be_.gather_rows(act_.mlm_in, x, cur_.in.mlm_positions, p.up ? 1 : B, p.up ? BP : b.P,
                  p.up ? 0 : p.T, C);
  be_.linear_forward(prec_, act_.mlm_pre, {act_.mlm_in}, Wt(t.heads().mlm_dense_w),
                     W(t.heads().mlm_dense_b), BP, C, C, ws_);
  // The head's activation stays fp32 in every precision (nothing of it is kept in 16 bits).
  be_.activation_forward(Precision::FP32, cfg_.activation(), {act_.mlm_act}, {act_.mlm_pre},
                         BP * C);
  be_.layernorm_forward(act_.mlm_ln, act_.mlm_mean, act_.mlm_rstd, act_.mlm_act,
                        W(t.heads().mlm_ln_w), W(t.heads().mlm_ln_b), BP, C, cfg_.layer_norm_eps);
  // The decoder's rows of the padded vocabulary (vocab_rows): the logits' padding is 0, no class.
  be_.linear_forward(prec_, act_.mlm_logits, {act_.mlm_ln}, Wt(t.embeddings().word),
                     W(t.heads().mlm_bias), BP, Vr, C, ws_);
  // Training: the gradient (for loss scale 1) is written over the logits in the same passes
  // that compute the loss, so backward does not recompute the softmax over the vocabulary.
  // (the weights' sum, the divisor and the gradient's scale 1 / divisor: send_step_args', which
  // the kernels read from the step's arguments)
  out.mlm_weight = mlm_weight_;
  const uint64_t* tail = p.head_args();
  const kernels::Multiplier dscale1{1.0f, reinterpret_cast<const float*>(tail + 1)};
  const bool training = p.opt.training;
  const CrossEntropySums mlm = head_loss(
      p, out.mlm_weight + kMlmDenominatorEps, &act_.step_sums[1],
      training ? act_.mlm_logits : nullptr, act_.mlm_logits, cur_.in.mlm_ids, cur_.in.mlm_weights,
      BP, kernels::Classes{V, Vr}, dscale1, reinterpret_cast<const double*>(tail));
  mlm_grad_ready_ = training;
  out.mlm_correct = mlm.correct;
  out.mlm_loss = mlm.loss / (out.mlm_weight + kMlmDenominatorEps);
  out.loss = out.mlm_loss + out.nsp_loss;
}

void BertModel::pretraining_backward(const Pass& p, const Batch& b, kernels::Multiplier loss_scale,
                                     float* dpooled, float* dh) {
  const ParamTable& t = table_;
  const int64_t B = p.B, C = p.C, V = cfg_.vocab_size, Vr = vocab_rows(cfg_);
  float* dnsp = act_.dsmall;
  be_.cross_entropy(dnsp, nullptr, nullptr, act_.nsp_logits, cur_.in.nsp_labels, nullptr, B, 2,
                    loss_scale.over(static_cast<double>(B)));
  linear_backward(dpooled, t.heads().nsp_w, t.heads().nsp_b, dnsp, {act_.pooled}, B, 2, C);

  const int64_t BP = p.up ? cur_.packed.mlm_rows : B * b.P;
  float* dlogits = act_.mlm_logits;  // gradient overwrites the logits
  if (mlm_grad_ready_) {
    // Forward left the gradient for loss scale 1; scales are powers of two, so scaling here
    // gives the same bits as computing with the scale.
    if (!loss_scale.is_one()) be_.scale_inplace(dlogits, BP * Vr, loss_scale);
  } else {
    double wsum = 0;
    for (int64_t r = 0; r < BP; ++r) wsum += mlm_weights(b)[r];
    be_.cross_entropy(dlogits, nullptr, nullptr, act_.mlm_logits, cur_.in.mlm_ids,
                      cur_.in.mlm_weights, BP, kernels::Classes{V, Vr},
                      loss_scale.over(wsum + kMlmDenominatorEps));
  }
  mlm_grad_ready_ = false;
  float* d1 = act_.dhead1;  // [BP,C]
  // dW's padding rows and db's padding get the padding's zero gradient.
  linear_backward(d1, t.embeddings().word, t.heads().mlm_bias, dlogits, {act_.mlm_ln}, BP, Vr, C);
  float* d2 = act_.dI;  // [BP,C] scratch (dI is free until the encoder backward)
  be_.layernorm_backward(d2, G(t.heads().mlm_ln_w), G(t.heads().mlm_ln_b), d1, act_.mlm_act,
                         W(t.heads().mlm_ln_w), act_.mlm_mean, act_.mlm_rstd, BP, C);
  be_.activation_backward(Precision::FP32, cfg_.activation(), d2, {act_.mlm_pre}, d2, BP * C);
  linear_backward(d1, t.heads().mlm_dense_w, t.heads().mlm_dense_b, d2, {act_.mlm_in}, BP, C, C);
  be_.scatter_add_rows(dh, d1, cur_.in.mlm_positions, p.up ? 1 : B, p.up ? BP : b.P, p.up ? 0 : p.T,
                       C);
}

// Sequence classification (HF's BertForSequenceClassification): classifier(dropout(pooled));
// cross-entropy, or for one label (regression) the mean squared error.
void BertModel::classifier_forward(const Pass& p, Losses& out) {
  const int64_t B = p.B, C = p.C, NL = cfg_.num_labels;
  be_.copy(act_.pooled_drop, act_.pooled, B * C);
  be_.dropout_forward(act_.pooled_drop, B, C, p.site(p.L + 1, kPooler, p.p_hidden));
  be_.linear_forward(prec_, act_.cls_logits, {act_.pooled_drop}, Wt(table_.heads().classifier_w),
                     W(table_.heads().classifier_b), B, NL, C, ws_);
  if (NL == 1 && p.opt.device_sums) {  // regression (HF's rule for one label): mean squared error
    const kernels::SumsInto into{act_.step_sums, static_cast<double>(B), nullptr,
                                 act_.step_sums + 4};
    be_.squared_error_into(into, nullptr, act_.cls_logits, cur_.in.label_values, B, 0.0f);
  } else if (NL == 1) {
    out.loss = be_.squared_error(nullptr, act_.cls_logits, cur_.in.label_values, B, 0.0f) / B;
  } else {
    const CrossEntropySums cls =
        head_loss(p, static_cast<double>(B), &act_.step_sums[3], nullptr, act_.cls_logits,
                  cur_.in.label_ids, nullptr, B, NL, 0.0f);
    out.loss = cls.loss / B;
    out.cls_correct = static_cast<int64_t>(cls.correct);
  }
}

void BertModel::classifier_backward(const Pass& p, kernels::Multiplier loss_scale, float* dpooled) {
  const int64_t B = p.B, C = p.C, NL = cfg_.num_labels;
  float* dlog = act_.dsmall;
  if (NL == 1)  // (the gradient alone: no sums, so no host synchronisation)
    be_.squared_error_into({}, dlog, act_.cls_logits, cur_.in.label_values, B,
                           loss_scale.over(static_cast<double>(B)));
  else
    be_.cross_entropy(dlog, nullptr, nullptr, act_.cls_logits, cur_.in.label_ids, nullptr, B, NL,
                      loss_scale.over(static_cast<double>(B)));
  linear_backward(dpooled, table_.heads().classifier_w, table_.heads().classifier_b, dlog,
                  {act_.pooled_drop}, B, NL, C);
  be_.dropout_backward(dpooled, dpooled, B, C, p.site(p.L + 1, kPooler, p.p_hidden));
}

double BertModel::last_step_flops() const {
  const Packed& pk = cur_.packed;
  if (!unpadded()) return flops_per_step(pk.B, pk.T, pk.P);
  const double C = cfg_.hidden_size, I = cfg_.intermediate_size, V = cfg_.vocab_size,
               L = cfg_.num_hidden_layers, N = static_cast<double>(pk.rows);
  double squares = 0;
  for (int64_t e = 0; e < pk.B; ++e) squares += static_cast<double>(pk.len(e)) * pk.len(e);
  const double per_layer = 2 * N * (3 * C * C + C * C + 2 * C * I) + 2 * 2 * squares * C;
  double head = 2.0 * pk.B * C * C;
  if (head_ == Head::Pretraining) head += 2.0 * pk.mlm_rows * (C * C + C * V);
  return 3.0 * (L * per_layer + head);
}

double BertModel::flops_per_step(int64_t B, int64_t T, int64_t P) const {
  const double N = static_cast<double>(B) * T, C = cfg_.hidden_size, I = cfg_.intermediate_size,
               V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  const double per_layer = 2 * N * (3 * C * C + C * C + 2 * C * I) + 2 * 2 * B * T * T * C;
  double head = 2.0 * B * C * C;
  if (head_ == Head::Pretraining) head += 2.0 * B * P * (C * C + C * V);
  if (head_ == Head::TokenClassification) head = 2.0 * N * C * cfg_.num_labels;
  if (head_ == Head::QuestionAnswering) head = 2.0 * N * C * 2;
  return 3.0 * (L * per_layer + head);  // backward = 2x forward
}

}  // namespace bertrain::model
