#include "model/bert.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"

namespace bertrain::model {

using namespace bertrain::kernels;

namespace {

// Dropout sites: one RNG stream per (seed, step, layer, site).
enum Site : uint64_t { kEmbedding = 1, kAttnProbs, kAttnOut, kFfnOut, kPooler };

constexpr float kMlmDenominatorEps = 1e-5f;  // Google BERT: sum(w*ce) / (sum(w) + 1e-5)

size_t f32s(int64_t n) {
  return static_cast<size_t>(n) * sizeof(float);
}

}  // namespace

ModelDims::Attention parse_attention(const std::string& s) {
  if (s == "auto") return ModelDims::Attention::Auto;
  if (s == "full") return ModelDims::Attention::Full;
  if (s == "blocked") return ModelDims::Attention::Blocked;
  fail("--attention must be auto, full or blocked, got '", s, "'");
}

const char* attention_name(ModelDims::Attention a) {
  return a == ModelDims::Attention::Auto   ? "auto"
         : a == ModelDims::Attention::Full ? "full"
                                           : "blocked";
}

void plan_activations(MemoryPlan& plan, const BertConfig& cfg, Head head, const ModelDims& d) {
  const int64_t B = d.batch, T = d.seq_len, N = B * T, C = cfg.hidden_size,
                I = cfg.intermediate_size, NH = cfg.num_attention_heads, V = cfg.vocab_size;
  const int64_t BP = head == Head::Pretraining ? B * d.max_predictions : 0;
  const std::string g = "activations";
  // bf16 and fp16 keep the same tensors in 16 bits (of their own format).
  const bool half = d.bf16 || d.fp16;
  plan.add(g, "emb.sum", f32s(N * C));
  plan.add(g, "emb.mean", f32s(N));
  plan.add(g, "emb.rstd", f32s(N));
  plan.add(g, "emb.out", f32s(N * C));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    // bf16/fp16 keep QKV and the FFN pre-activation only rounded (what backward reads: the
    // attention's operands, GELU's input); their fp32 GEMM outputs pass through grad.dI.
    if (half)
      plan.add(g, p + "qkv16", f32s(N * 3 * C) / 2);
    else
      plan.add(g, p + "qkv", f32s(N * 3 * C));
    if (d.blocked_attention())  // the row log-sum-exp only (kernels/cpu/attention.h)
      plan.add(g, p + "lse", f32s(B * NH * T));
    else if (half)  // the softmax output saved in bf16 / fp16
      plan.add(g, p + "probs16", f32s(B * NH * T * T) / 2);
    else
      plan.add(g, p + "probs", f32s(B * NH * T * T));
    // bf16/fp16: the inputs of the attention-output and FFN-output matmuls are kept only in
    // 16 bits (bf16: they are the matmuls' operands, GELU writes them directly).
    if (half)
      plan.add(g, p + "ctx16", f32s(N * C) / 2);
    else
      plan.add(g, p + "ctx", f32s(N * C));
    plan.add(g, p + "attn_res", f32s(N * C));
    plan.add(g, p + "ln1_out", f32s(N * C));
    plan.add(g, p + "ln1_mean", f32s(N));
    plan.add(g, p + "ln1_rstd", f32s(N));
    if (half)
      plan.add(g, p + "inter_pre16", f32s(N * I) / 2);
    else
      plan.add(g, p + "inter_pre", f32s(N * I));
    if (half)
      plan.add(g, p + "inter_act16", f32s(N * I) / 2);
    else
      plan.add(g, p + "inter_act", f32s(N * I));
    plan.add(g, p + "ffn_res", f32s(N * C));
    plan.add(g, p + "ln2_out", f32s(N * C));
    plan.add(g, p + "ln2_mean", f32s(N));
    plan.add(g, p + "ln2_rstd", f32s(N));
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
  plan.add(g, "head.row_loss", f32s(std::max(BP, B)));
  plan.add(g, "head.row_correct", f32s(std::max(BP, B)));
  const std::string s = "scratch";
  plan.add(s, "grad.dh", f32s(N * C));
  plan.add(s, "grad.dA", f32s(N * C));
  plan.add(s, "grad.dB", f32s(N * C));
  plan.add(s, "grad.dI", f32s(N * std::max(I, 3 * C)));
  plan.add(s, "grad.dhead1", f32s(std::max(BP, B) * C));
  plan.add(s, "grad.dhead2", f32s(std::max(BP, B) * C));
  if (!d.blocked_attention()) plan.add(s, "attn.work", f32s(B * NH * T * T));
  if (d.bf16) plan.add(s, "attn.ctx", f32s(N * C));  // fp32 ctx until it is rounded to bf16
  // fp16: forward's fp32 ctx until it is rounded; in backward each saved fp16 tensor widened
  // back to fp32 for the fp32 kernels, one at a time.
  if (d.fp16) plan.add(s, "fp16.wide", f32s(N * std::max(I, 3 * C)));
  plan.add(s, "grad.dsmall", f32s(B * std::max<int64_t>(2, cfg.num_labels)));
  if (d.bf16) {
    const std::string g16 = "bf16";
    const size_t h = sizeof(uint16_t);
    plan.add(g16, "bf16.weights", static_cast<size_t>(ParamTable(cfg, head).total()) * h);
    // Largest matmul operand rounded to bf16: a forward input or a backward output gradient,
    // and a backward input.
    const int64_t a = std::max({N * std::max(3 * C, I), BP * V, B * std::max<int64_t>(C, V)});
    plan.add(g16, "bf16.scratch_a", static_cast<size_t>(a) * h);
    plan.add(g16, "bf16.scratch_b", static_cast<size_t>(std::max(N * std::max(C, I), BP * C)) * h);
    // Attention's matmul operands: the dropped probabilities (then dS), dctx (QKV: per layer).
    if (!d.blocked_attention())
      plan.add(g16, "bf16.attn_probs", static_cast<size_t>(B * NH * T * T) * h);
    plan.add(g16, "bf16.attn_dctx", static_cast<size_t>(N * C) * h);
  }
}

MemoryPlan BertModel::make_plan(const BertConfig& cfg, Head head, const ModelDims& dims) {
  if (dims.seq_len > cfg.max_position_embeddings)
    fail("--seq-len ", dims.seq_len, " exceeds the model's max_position_embeddings ",
         cfg.max_position_embeddings);
  if (dims.batch <= 0 || dims.seq_len <= 0 || dims.max_predictions < 0)
    fail("batch size and sequence length must be positive and max predictions >= 0");
  if (dims.max_predictions > dims.seq_len)
    fail("--max-predictions ", dims.max_predictions, " exceeds --seq-len ", dims.seq_len);
  if (dims.bf16 && dims.fp16) fail("a model computes in bf16 or in fp16, not both");
  const ParamTable table(cfg, head);
  MemoryPlan plan;
  plan.add("parameters", "params", f32s(table.total()));
  plan.add("gradients", "grads", f32s(table.total()));
  plan_activations(plan, cfg, head, dims);
  return plan;
}

BertModel::BertModel(const BertConfig& cfg, Head head, const ModelDims& dims)
    : cfg_(cfg), head_(head), table_(cfg, head), dims_(dims), plan_(make_plan(cfg, head, dims)) {
  params_ = Arena(plan_, "parameters");
  grads_ = Arena(plan_, "gradients");
  acts_arena_ = Arena(plan_, "activations");
  scratch_ = Arena(plan_, "scratch");
  const bool blocked = dims.blocked_attention();
  if (!blocked) attn_work_ = scratch_.f32("attn.work");
  if (dims.bf16) {
    bf16_arena_ = Arena(plan_, "bf16");
    wbf16_ = reinterpret_cast<uint16_t*>(bf16_arena_.f32("bf16.weights"));
    sa_ = reinterpret_cast<uint16_t*>(bf16_arena_.f32("bf16.scratch_a"));
    sb_ = reinterpret_cast<uint16_t*>(bf16_arena_.f32("bf16.scratch_b"));
    auto b16 = [&](const char* name) { return reinterpret_cast<uint16_t*>(bf16_arena_.f32(name)); };
    attn16_ = {nullptr, blocked ? nullptr : b16("bf16.attn_probs"),
               b16("bf16.attn_dctx")};  // qkv: per layer
  }
  if (dims.fp16) f16_wide_ = scratch_.f32("fp16.wide");

  const Arena& a = acts_arena_;
  act_.emb_sum = a.f32("emb.sum");
  act_.emb_mean = a.f32("emb.mean");
  act_.emb_rstd = a.f32("emb.rstd");
  act_.h0 = a.f32("emb.out");
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    const bool h = dims.bf16 || dims.fp16, bf = dims.bf16, fp = dims.fp16;
    auto b16 = [&](const std::string& name) { return reinterpret_cast<uint16_t*>(a.f32(name)); };
    // bf16/fp16: fp32 QKV / pre-activation (fp16: and GELU's output, in place), briefly.
    float* gemm_out = scratch_.f32("grad.dI");
    act_.layers.push_back(
        {h ? gemm_out : a.f32(p + "qkv"), h || blocked ? nullptr : a.f32(p + "probs"),
         bf   ? scratch_.f32("attn.ctx")
         : fp ? f16_wide_
              : a.f32(p + "ctx"),
         a.f32(p + "attn_res"), a.f32(p + "ln1_out"), a.f32(p + "ln1_mean"), a.f32(p + "ln1_rstd"),
         h ? gemm_out : a.f32(p + "inter_pre"),
         bf   ? nullptr
         : fp ? gemm_out
              : a.f32(p + "inter_act"),
         a.f32(p + "ffn_res"), a.f32(p + "ln2_out"), a.f32(p + "ln2_mean"), a.f32(p + "ln2_rstd"),
         h ? b16(p + "ctx16") : nullptr, h ? b16(p + "inter_act16") : nullptr,
         h ? b16(p + "qkv16") : nullptr, h ? b16(p + "inter_pre16") : nullptr,
         h && !blocked ? b16(p + "probs16") : nullptr, blocked ? a.f32(p + "lse") : nullptr});
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
  act_.row_loss = a.f32("head.row_loss");
  act_.row_correct = reinterpret_cast<int32_t*>(a.f32("head.row_correct"));
  const Arena& s = scratch_;
  act_.dh = s.f32("grad.dh");
  act_.dA = s.f32("grad.dA");
  act_.dB = s.f32("grad.dB");
  act_.dI = s.f32("grad.dI");
  act_.dhead1 = s.f32("grad.dhead1");
  act_.dhead2 = s.f32("grad.dhead2");
  act_.dsmall = s.f32("grad.dsmall");
}

void BertModel::lin_fwd(float* out, const float* inp, const float* w, const float* b, int64_t M,
                        int64_t N, int64_t K) {
  if (!wbf16_) return linear_forward(out, inp, w, b, M, N, K);
  linear_forward_bf16(out, inp, wbf16_ + (w - params()), b, M, N, K, sa_);
}

void BertModel::lin_fwd16(float* out, const uint16_t* inp16, const float* w, const float* b,
                          int64_t M, int64_t N, int64_t K) {
  gemm_bf16(false, true, M, N, K, inp16, K, wbf16_ + (w - params()), K, out, N, b, false);
}

void BertModel::lin_bwd16(float* dinp, float* dw, float* db, const float* dout,
                          const uint16_t* inp16, const float* w, int64_t M, int64_t N, int64_t K) {
  linear_backward_bf16_in16(dinp, dw, db, dout, inp16, wbf16_ + (w - params()), M, N, K, false,
                            sa_);
}

void BertModel::lin_bwd(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                        const float* w, int64_t M, int64_t N, int64_t K, bool accumulate_dinp) {
  if (!wbf16_) return linear_backward(dinp, dw, db, dout, inp, w, M, N, K, accumulate_dinp);
  linear_backward_bf16(dinp, dw, db, dout, inp, wbf16_ + (w - params()), M, N, K, accumulate_dinp,
                       sa_, sb_);
}

AttentionBf16 BertModel::attention_bf16(const LayerActs& a) const {
  return {a.qkv16, attn16_.probs, attn16_.dctx, a.probs16};
}

void BertModel::place_gradients(std::byte* memory) {
  Arena moved(plan_, "gradients", memory);
  std::memcpy(moved.base(), grads_.base(), grads_.bytes());
  grads_ = std::move(moved);
}

void BertModel::zero_grads() {
  // Every thread clears its share (BERT-base: 420 MiB every step, 9 ms on one thread of our
  // 2-core machines, 5.5 ms on two).
  std::byte* g = grads_.base();
  parallel_chunks(static_cast<int64_t>(grads_.bytes()),
                  [&](int64_t b, int64_t e) { std::memset(g + b, 0, static_cast<size_t>(e - b)); });
}

Losses BertModel::forward(const Batch& b, const StepOptions& opt) {
  if (b.B > dims_.batch || b.T > dims_.seq_len || b.P > dims_.max_predictions)
    fail("batch [", b.B, " x ", b.T, ", ", b.P, " predictions] exceeds the planned [", dims_.batch,
         " x ", dims_.seq_len, ", ", dims_.max_predictions, "]");
  validate_batch(b, cfg_, head_);
  if (wbf16_ && !bf16_fresh_)
    convert_f32_to_bf16(params(), wbf16_, static_cast<size_t>(table_.total()));
  bf16_fresh_ = false;
  const int64_t B = b.B, T = b.T, N = B * T, C = cfg_.hidden_size, I = cfg_.intermediate_size,
                NH = cfg_.num_attention_heads, V = cfg_.vocab_size;
  const float eps = cfg_.layer_norm_eps;
  const float p_hidden = opt.training ? cfg_.hidden_dropout_prob : 0.0f;
  const float p_attn = opt.training ? cfg_.attention_probs_dropout_prob : 0.0f;
  const Activation act = cfg_.activation();
  const uint64_t off_tc = opt.example_offset * T * C;
  const uint64_t off_probs = opt.example_offset * NH * T * T;
  const int64_t L = cfg_.num_hidden_layers;

  const ParamTable& t = table_;
  embedding_layernorm_forward(act_.h0, act_.emb_sum, act_.emb_mean, act_.emb_rstd,
                              b.input_ids.data(), b.segment_ids.data(),
                              W(t.offset("bert.embeddings.word_embeddings.weight")),
                              W(t.offset("bert.embeddings.position_embeddings.weight")),
                              W(t.offset("bert.embeddings.token_type_embeddings.weight")),
                              W(t.offset("bert.embeddings.LayerNorm.weight")),
                              W(t.offset("bert.embeddings.LayerNorm.bias")), B, T, C, eps, p_hidden,
                              rng_key(opt.seed, opt.step, 0, kEmbedding), off_tc);

  const float* x = act_.h0;
  for (int64_t l = 0; l < L; ++l) {
    obs::Timeline::Span span(timeline_, str("forward layer ", l), "compute");
    const LayerOffsets& o = t.layer(l);
    const LayerActs& a = act_.layers[l];
    lin_fwd(a.qkv, x, W(o.qkv_w), W(o.qkv_b), N, 3 * C, C);
    const bool fp16 = dims_.fp16;  // each kept tensor rounded before forward reads it
    if (fp16) round_to_f16(a.qkv, a.qkv, N * 3 * C, a.qkv16);
    const AttentionBf16 a16 = attention_bf16(a);
    if (a.lse)
      attention_blocked_forward(a.ctx, a.lse, a.qkv, b.input_mask.data(), {B, T, C, NH}, p_attn,
                                rng_key(opt.seed, opt.step, l + 1, kAttnProbs), off_probs,
                                wbf16_ ? &a16 : nullptr);
    else
      attention_forward(a.ctx, a.probs, attn_work_, a.qkv, b.input_mask.data(), {B, T, C, NH},
                        p_attn, rng_key(opt.seed, opt.step, l + 1, kAttnProbs), off_probs,
                        wbf16_ ? &a16 : nullptr, fp16 ? a.probs16 : nullptr);
    if (fp16) {
      round_to_f16(a.ctx, a.ctx, N * C, a.ctx16);
      lin_fwd(a.attn_res, a.ctx, W(o.attn_out_w), W(o.attn_out_b), N, C, C);
    } else if (a.ctx16) {
      convert_f32_to_bf16(a.ctx, a.ctx16, static_cast<size_t>(N * C));
      lin_fwd16(a.attn_res, a.ctx16, W(o.attn_out_w), W(o.attn_out_b), N, C, C);
    } else {
      lin_fwd(a.attn_res, a.ctx, W(o.attn_out_w), W(o.attn_out_b), N, C, C);
    }
    residual_layernorm_forward(a.ln1_out, a.ln1_mean, a.ln1_rstd, a.attn_res, x, W(o.ln1_w),
                               W(o.ln1_b), N, C, eps, p_hidden,
                               rng_key(opt.seed, opt.step, l + 1, kAttnOut), off_tc);
    lin_fwd(a.inter_pre, a.ln1_out, W(o.inter_w), W(o.inter_b), N, I, C);
    if (fp16) {  // inter_act is inter_pre's buffer: GELU in place
      activation_forward_f16(act, a.inter_act, a.inter_act16, a.inter_pre, a.inter_pre16, N * I);
      lin_fwd(a.ffn_res, a.inter_act, W(o.out_w), W(o.out_b), N, C, I);
    } else if (a.inter_act16) {
      activation_forward_bf16(act, a.inter_act16, a.inter_pre, N * I, a.inter_pre16);
      lin_fwd16(a.ffn_res, a.inter_act16, W(o.out_w), W(o.out_b), N, C, I);
    } else {
      activation_forward(act, a.inter_act, a.inter_pre, N * I);
      lin_fwd(a.ffn_res, a.inter_act, W(o.out_w), W(o.out_b), N, C, I);
    }
    residual_layernorm_forward(a.ln2_out, a.ln2_mean, a.ln2_rstd, a.ffn_res, a.ln1_out, W(o.ln2_w),
                               W(o.ln2_b), N, C, eps, p_hidden,
                               rng_key(opt.seed, opt.step, l + 1, kFfnOut), off_tc);
    x = a.ln2_out;
  }
  seq_out_ = const_cast<float*>(x);

  // Pooler: tanh(dense(h[:, 0])).
  for (int64_t i = 0; i < B; ++i) std::memcpy(act_.cls_in + i * C, x + i * T * C, f32s(C));
  lin_fwd(act_.pooled, act_.cls_in, W(t.offset("bert.pooler.dense.weight")),
          W(t.offset("bert.pooler.dense.bias")), B, C, C);
  tanh_forward(act_.pooled, act_.pooled, B * C);

  Losses out;
  if (head_ == Head::Pretraining) {
    lin_fwd(act_.nsp_logits, act_.pooled, W(t.offset("cls.seq_relationship.weight")),
            W(t.offset("cls.seq_relationship.bias")), B, 2, C);
    out.nsp_loss =
        cross_entropy_forward_backward(nullptr, act_.row_loss, act_.row_correct, act_.nsp_logits,
                                       b.next_sentence_labels.data(), nullptr, B, 2, 0.0f) /
        B;
    for (int64_t i = 0; i < B; ++i) out.nsp_correct += act_.row_correct[i];

    // MLM head on the masked positions only (gather first): BP rows instead of B*T.
    const int64_t BP = B * b.P;
    for (int64_t r = 0; r < BP; ++r) {
      const int64_t row = (r / b.P) * T + b.masked_lm_positions[r];
      std::memcpy(act_.mlm_in + r * C, x + row * C, f32s(C));
    }
    lin_fwd(act_.mlm_pre, act_.mlm_in, W(t.offset("cls.predictions.transform.dense.weight")),
            W(t.offset("cls.predictions.transform.dense.bias")), BP, C, C);
    activation_forward(act, act_.mlm_act, act_.mlm_pre, BP * C);
    layernorm_forward(act_.mlm_ln, act_.mlm_mean, act_.mlm_rstd, act_.mlm_act,
                      W(t.offset("cls.predictions.transform.LayerNorm.weight")),
                      W(t.offset("cls.predictions.transform.LayerNorm.bias")), BP, C, eps);
    lin_fwd(act_.mlm_logits, act_.mlm_ln, W(t.offset("bert.embeddings.word_embeddings.weight")),
            W(t.offset("cls.predictions.bias")), BP, V, C);
    // Training: the gradient (for loss scale 1) is written over the logits in the same passes
    // that compute the loss, so backward does not recompute the softmax over the vocabulary.
    for (int64_t r = 0; r < BP; ++r) out.mlm_weight += b.masked_lm_weights[r];
    const float dscale1 = static_cast<float>(1.0 / (out.mlm_weight + kMlmDenominatorEps));
    const double wsum_ce = cross_entropy_forward_backward(
        opt.training ? act_.mlm_logits : nullptr, act_.row_loss, act_.row_correct, act_.mlm_logits,
        b.masked_lm_ids.data(), b.masked_lm_weights.data(), BP, V, dscale1);
    mlm_grad_ready_ = opt.training;
    for (int64_t r = 0; r < BP; ++r)
      out.mlm_correct += b.masked_lm_weights[r] * act_.row_correct[r];
    out.mlm_loss = wsum_ce / (out.mlm_weight + kMlmDenominatorEps);
    out.loss = out.mlm_loss + out.nsp_loss;
  } else {
    std::memcpy(act_.pooled_drop, act_.pooled, f32s(B * C));
    dropout_forward(act_.pooled_drop, B * C, p_hidden, rng_key(opt.seed, opt.step, L + 1, kPooler),
                    opt.example_offset * C);
    const int64_t NL = cfg_.num_labels;
    lin_fwd(act_.cls_logits, act_.pooled_drop, W(t.offset("classifier.weight")),
            W(t.offset("classifier.bias")), B, NL, C);
    out.loss =
        cross_entropy_forward_backward(nullptr, act_.row_loss, act_.row_correct, act_.cls_logits,
                                       b.label_ids.data(), nullptr, B, NL, 0.0f) /
        B;
    for (int64_t i = 0; i < B; ++i) out.cls_correct += act_.row_correct[i];
  }
  return out;
}

std::pair<int64_t, int64_t> BertModel::layer_range(int64_t l) const {
  const int64_t begin = table_.layer(l).qkv_w;
  const int64_t end = l + 1 < cfg_.num_hidden_layers ? table_.layer(l + 1).qkv_w
                                                     : table_.offset("bert.pooler.dense.weight");
  return {begin, end};
}

void BertModel::backward(const Batch& b, const StepOptions& opt, float loss_scale,
                         const std::function<void(int64_t)>& layer_done) {
  const int64_t B = b.B, T = b.T, N = B * T, C = cfg_.hidden_size, I = cfg_.intermediate_size,
                NH = cfg_.num_attention_heads, V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  const float p_hidden = opt.training ? cfg_.hidden_dropout_prob : 0.0f;
  const float p_attn = opt.training ? cfg_.attention_probs_dropout_prob : 0.0f;
  const Activation act = cfg_.activation();
  const uint64_t off_tc = opt.example_offset * T * C;
  const uint64_t off_probs = opt.example_offset * NH * T * T;
  const ParamTable& t = table_;
  const int64_t word = t.offset("bert.embeddings.word_embeddings.weight");
  float* dh = act_.dh;  // gradient of the residual stream [N,C]
  std::memset(dh, 0, f32s(N * C));

  // ---- heads: produce dpooled (and the MLM rows of dh) ----
  float* dpooled = act_.dhead2;  // [B,C]
  if (head_ == Head::Pretraining) {
    float* dnsp = act_.dsmall;
    cross_entropy_forward_backward(dnsp, nullptr, nullptr, act_.nsp_logits,
                                   b.next_sentence_labels.data(), nullptr, B, 2, loss_scale / B);
    lin_bwd(dpooled, G(t.offset("cls.seq_relationship.weight")),
            G(t.offset("cls.seq_relationship.bias")), dnsp, act_.pooled,
            W(t.offset("cls.seq_relationship.weight")), B, 2, C);

    const int64_t BP = B * b.P;
    float* dlogits = act_.mlm_logits;  // gradient overwrites the logits
    if (mlm_grad_ready_) {
      // Forward left the gradient for loss scale 1; scales are powers of two, so scaling here
      // gives the same bits as computing with the scale.
      if (loss_scale != 1.0f) {
        const int64_t n = BP * V;
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; ++i) dlogits[i] *= loss_scale;
      }
    } else {
      double wsum = 0;
      for (int64_t r = 0; r < BP; ++r) wsum += b.masked_lm_weights[r];
      const float dscale = static_cast<float>(loss_scale / (wsum + kMlmDenominatorEps));
      cross_entropy_forward_backward(dlogits, nullptr, nullptr, act_.mlm_logits,
                                     b.masked_lm_ids.data(), b.masked_lm_weights.data(), BP, V,
                                     dscale);
    }
    mlm_grad_ready_ = false;
    float* d1 = act_.dhead1;  // [BP,C]
    lin_bwd(d1, G(word), G(t.offset("cls.predictions.bias")), dlogits, act_.mlm_ln, W(word), BP, V,
            C);
    float* d2 = act_.dI;  // [BP,C] scratch (dI is free until the encoder backward)
    layernorm_backward(d2, G(t.offset("cls.predictions.transform.LayerNorm.weight")),
                       G(t.offset("cls.predictions.transform.LayerNorm.bias")), d1, act_.mlm_act,
                       W(t.offset("cls.predictions.transform.LayerNorm.weight")), act_.mlm_mean,
                       act_.mlm_rstd, BP, C);
    activation_backward(act, d2, act_.mlm_pre, d2, BP * C);
    lin_bwd(d1, G(t.offset("cls.predictions.transform.dense.weight")),
            G(t.offset("cls.predictions.transform.dense.bias")), d2, act_.mlm_in,
            W(t.offset("cls.predictions.transform.dense.weight")), BP, C, C);
    for (int64_t r = 0; r < BP; ++r) {  // scatter (+=): positions may repeat
      float* dst = dh + ((r / b.P) * T + b.masked_lm_positions[r]) * C;
      const float* src = d1 + r * C;
      for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
    }
  } else {
    const int64_t NL = cfg_.num_labels;
    float* dlog = act_.dsmall;
    cross_entropy_forward_backward(dlog, nullptr, nullptr, act_.cls_logits, b.label_ids.data(),
                                   nullptr, B, NL, loss_scale / B);
    lin_bwd(dpooled, G(t.offset("classifier.weight")), G(t.offset("classifier.bias")), dlog,
            act_.pooled_drop, W(t.offset("classifier.weight")), B, NL, C);
    dropout_backward(dpooled, dpooled, B * C, p_hidden, rng_key(opt.seed, opt.step, L + 1, kPooler),
                     opt.example_offset * C);
  }
  // pooler
  tanh_backward(dpooled, act_.pooled, dpooled, B * C);
  float* dcls = act_.dhead1;
  lin_bwd(dcls, G(t.offset("bert.pooler.dense.weight")), G(t.offset("bert.pooler.dense.bias")),
          dpooled, act_.cls_in, W(t.offset("bert.pooler.dense.weight")), B, C, C);
  for (int64_t i = 0; i < B; ++i) add_inplace(dh + i * T * C, dcls + i * C, C);

  // ---- encoder, last layer first ----
  float *dA = act_.dA, *dB = act_.dB, *dI = act_.dI;
  for (int64_t l = L - 1; l >= 0; --l) {
    obs::Timeline::Span span(timeline_, str("backward layer ", l), "compute");
    const LayerOffsets& o = t.layer(l);
    const LayerActs& a = act_.layers[l];
    const float* x = l == 0 ? act_.h0 : act_.layers[l - 1].ln2_out;
    // h_out = LN2(ffn_res), ffn_res = drop(inter_act W_out + b) + ln1_out
    layernorm_dropout_backward(dA, dB, G(o.ln2_w), G(o.ln2_b), dh, a.ffn_res, W(o.ln2_w),
                               a.ln2_mean, a.ln2_rstd, N, C, false, p_hidden,
                               rng_key(opt.seed, opt.step, l + 1, kFfnOut), off_tc);
    const bool fp16 = dims_.fp16;  // saved fp16 tensors widened into f16_wide_
    if (fp16) {
      widen_f16(f16_wide_, a.inter_act16, N * I);
      lin_bwd(dI, G(o.out_w), G(o.out_b), dB, f16_wide_, W(o.out_w), N, C, I);
      activation_backward_f16(act, dI, a.inter_pre16, dI, N * I);
    } else if (a.inter_act16) {
      lin_bwd16(dI, G(o.out_w), G(o.out_b), dB, a.inter_act16, W(o.out_w), N, C, I);
      activation_backward_bf16(act, dI, a.inter_pre16, dI, N * I);
    } else {
      lin_bwd(dI, G(o.out_w), G(o.out_b), dB, a.inter_act, W(o.out_w), N, C, I);
      activation_backward(act, dI, a.inter_pre, dI, N * I);
    }
    lin_bwd(dA, G(o.inter_w), G(o.inter_b), dI, a.ln1_out, W(o.inter_w), N, I, C,
            /*accumulate_dinp=*/true);  // dA = d ln1_out (residual + FFN path)
    // ln1_out = LN1(attn_res), attn_res = drop(ctx W_o + b) + x
    layernorm_dropout_backward(dh, dB, G(o.ln1_w), G(o.ln1_b), dA, a.attn_res, W(o.ln1_w),
                               a.ln1_mean, a.ln1_rstd, N, C, false, p_hidden,
                               rng_key(opt.seed, opt.step, l + 1, kAttnOut), off_tc);
    if (fp16) {
      widen_f16(f16_wide_, a.ctx16, N * C);
      lin_bwd(dA, G(o.attn_out_w), G(o.attn_out_b), dB, f16_wide_, W(o.attn_out_w), N, C, C);
    } else if (a.ctx16) {
      lin_bwd16(dA, G(o.attn_out_w), G(o.attn_out_b), dB, a.ctx16, W(o.attn_out_w), N, C, C);
    } else {
      lin_bwd(dA, G(o.attn_out_w), G(o.attn_out_b), dB, a.ctx, W(o.attn_out_w), N, C, C);
    }
    const AttentionBf16 a16 = attention_bf16(a);
    const float* qkv = a.qkv;  // bf16: null, a16.qkv holds the forward's rounding
    if (fp16) {
      widen_f16(f16_wide_, a.qkv16, N * 3 * C);
      qkv = f16_wide_;
    } else if (a.qkv16) {
      qkv = nullptr;
    }
    if (a.lse)
      attention_blocked_backward(dI, dA, qkv, a.lse, b.input_mask.data(), {B, T, C, NH}, p_attn,
                                 rng_key(opt.seed, opt.step, l + 1, kAttnProbs), off_probs,
                                 wbf16_ ? &a16 : nullptr);
    else
      attention_backward(dI, attn_work_, dA, qkv, a.probs, {B, T, C, NH}, p_attn,
                         rng_key(opt.seed, opt.step, l + 1, kAttnProbs), off_probs,
                         wbf16_ ? &a16 : nullptr, fp16 ? a.probs16 : nullptr);
    lin_bwd(dh, G(o.qkv_w), G(o.qkv_b), dI, x, W(o.qkv_w), N, 3 * C, C,
            /*accumulate_dinp=*/true);  // dh = d x (residual + attention path)
    if (layer_done) layer_done(l);
  }

  // ---- embeddings ----
  dropout_backward(dh, dh, N * C, p_hidden, rng_key(opt.seed, opt.step, 0, kEmbedding), off_tc);
  layernorm_backward(dA, G(t.offset("bert.embeddings.LayerNorm.weight")),
                     G(t.offset("bert.embeddings.LayerNorm.bias")), dh, act_.emb_sum,
                     W(t.offset("bert.embeddings.LayerNorm.weight")), act_.emb_mean, act_.emb_rstd,
                     N, C);
  embedding_backward(G(word), G(t.offset("bert.embeddings.position_embeddings.weight")),
                     G(t.offset("bert.embeddings.token_type_embeddings.weight")), dA,
                     b.input_ids.data(), b.segment_ids.data(), B, T, C);
}

double BertModel::flops_per_step(int64_t B, int64_t T, int64_t P) const {
  const double N = static_cast<double>(B) * T, C = cfg_.hidden_size, I = cfg_.intermediate_size,
               V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  const double per_layer = 2 * N * (3 * C * C + C * C + 2 * C * I) + 2 * 2 * B * T * T * C;
  double head = 2.0 * B * C * C;
  if (head_ == Head::Pretraining) head += 2.0 * B * P * (C * C + C * V);
  return 3.0 * (L * per_layer + head);  // backward = 2x forward
}

}  // namespace bertrain::model
