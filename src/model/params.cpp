#include "model/params.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace bertrain::model {

const char* head_architecture(Head h) {
  return h == Head::Pretraining              ? "BertForPreTraining"
         : h == Head::SequenceClassification ? "BertForSequenceClassification"
         : h == Head::TokenClassification    ? "BertForTokenClassification"
                                             : "BertForQuestionAnswering";
}

int64_t ParamTable::add(const std::string& name, Shape shape, Init init, bool decay, bool matmul,
                        int64_t stored) {
  ParamInfo p{name, std::move(shape), total_, init, decay, matmul};
  const int64_t offset = total_;
  total_ += (std::max(p.numel(), stored) + 15) / 16 * 16;  // 64-byte aligned tensors
  index_[name] = params_.size();
  params_.push_back(std::move(p));
  return offset;
}

std::pair<int64_t, int64_t> ParamTable::layer_range(int64_t l) const {
  const int64_t begin = layer(l).qkv_w;
  // The last layer ends where the tensor after its last one (output.LayerNorm.bias) begins.
  const int64_t end = l + 1 < static_cast<int64_t>(layers_.size())
                          ? layer(l + 1).qkv_w
                          : layer(l).ln2_b + (hidden_ + 15) / 16 * 16;
  return {begin, end};
}

ParamTable::ParamTable(const BertConfig& cfg, Head head) : head_(head), hidden_(cfg.hidden_size) {
  const int64_t V = cfg.vocab_size, C = cfg.hidden_size, I = cfg.intermediate_size,
                Vr = vocab_rows(cfg);
  const std::string e = "bert.embeddings.";
  EmbeddingOffsets& eo = embeddings_;
  eo.word = add(e + "word_embeddings.weight", {V, C}, Init::Normal, true, false, Vr * C);
  eo.position =
      add(e + "position_embeddings.weight", {cfg.max_position_embeddings, C}, Init::Normal, true);
  eo.token_type =
      add(e + "token_type_embeddings.weight", {cfg.type_vocab_size, C}, Init::Normal, true);
  eo.ln_w = add(e + "LayerNorm.weight", {C}, Init::Ones, false);
  eo.ln_b = add(e + "LayerNorm.bias", {C}, Init::Zeros, false);
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::string p = "bert.encoder.layer." + std::to_string(l) + ".";
    // Adjacent without padding so that [query; key; value] is one [3C, C] matrix and the
    // biases one [3C] vector (C*C and C are multiples of 16 for every real BERT; the checks
    // below hold the invariant for the rest).
    int64_t qkv_w = total_;
    for (const char* m : {"query", "key", "value"}) {
      ParamInfo w{p + "attention.self." + m + ".weight", {C, C}, total_, Init::Normal, true, true};
      index_[w.name] = params_.size();
      params_.push_back(w);
      total_ += C * C;
    }
    total_ = (total_ + 15) / 16 * 16;
    int64_t qkv_b = total_;
    for (const char* m : {"query", "key", "value"}) {
      ParamInfo b{p + "attention.self." + m + ".bias", {C}, total_, Init::Zeros, false};
      index_[b.name] = params_.size();
      params_.push_back(b);
      total_ += C;
    }
    total_ = (total_ + 15) / 16 * 16;
    LayerOffsets lo{};
    lo.qkv_w = qkv_w;
    lo.qkv_b = qkv_b;
    lo.attn_out_w = total_;
    add(p + "attention.output.dense.weight", {C, C}, Init::Normal, true, true);
    lo.attn_out_b = total_;
    add(p + "attention.output.dense.bias", {C}, Init::Zeros, false);
    lo.ln1_w = total_;
    add(p + "attention.output.LayerNorm.weight", {C}, Init::Ones, false);
    lo.ln1_b = total_;
    add(p + "attention.output.LayerNorm.bias", {C}, Init::Zeros, false);
    lo.inter_w = total_;
    add(p + "intermediate.dense.weight", {I, C}, Init::Normal, true, true);
    lo.inter_b = total_;
    add(p + "intermediate.dense.bias", {I}, Init::Zeros, false);
    lo.out_w = total_;
    add(p + "output.dense.weight", {C, I}, Init::Normal, true, true);
    lo.out_b = total_;
    add(p + "output.dense.bias", {C}, Init::Zeros, false);
    lo.ln2_w = total_;
    add(p + "output.LayerNorm.weight", {C}, Init::Ones, false);
    lo.ln2_b = total_;
    add(p + "output.LayerNorm.bias", {C}, Init::Zeros, false);
    layers_.push_back(lo);
  }
  HeadOffsets& h = heads_;
  if (has_pooler(head)) {
    h.pooler_w = add("bert.pooler.dense.weight", {C, C}, Init::Normal, true, true);
    h.pooler_b = add("bert.pooler.dense.bias", {C}, Init::Zeros, false);
  }
  if (head == Head::Pretraining) {
    const std::string t = "cls.predictions.transform.";
    h.mlm_dense_w = add(t + "dense.weight", {C, C}, Init::Normal, true, true);
    h.mlm_dense_b = add(t + "dense.bias", {C}, Init::Zeros, false);
    h.mlm_ln_w = add(t + "LayerNorm.weight", {C}, Init::Ones, false);
    h.mlm_ln_b = add(t + "LayerNorm.bias", {C}, Init::Zeros, false);
    h.mlm_bias = add("cls.predictions.bias", {V}, Init::Zeros, false, false, Vr);
    h.nsp_w = add("cls.seq_relationship.weight", {2, C}, Init::Normal, true, true);
    h.nsp_b = add("cls.seq_relationship.bias", {2}, Init::Zeros, false);
  } else if (head == Head::QuestionAnswering) {
    // row 0: start, row 1: end
    h.qa_w = add("qa_outputs.weight", {2, C}, Init::Normal, true, true);
    h.qa_b = add("qa_outputs.bias", {2}, Init::Zeros, false);
  } else {
    h.classifier_w = add("classifier.weight", {cfg.num_labels, C}, Init::Normal, true, true);
    h.classifier_b = add("classifier.bias", {cfg.num_labels}, Init::Zeros, false);
  }
}

const ParamInfo* ParamTable::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &params_[it->second];
}

const ParamInfo& ParamTable::at(const std::string& name) const {
  const ParamInfo* p = find(name);
  BT_CHECK(p, "no parameter named ", name);
  return *p;
}

namespace {

// Appends [b, e) to ranges, merged with the last one when they touch.
void append_range(std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t b, int64_t e) {
  if (e <= b) return;
  if (!ranges.empty() && ranges.back().second == b)
    ranges.back().second = e;
  else
    ranges.push_back({b, e});
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> ParamTable::matmul_ranges_outside(int64_t keep_begin,
                                                                           int64_t keep_end) const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t t = 0; t < params_.size(); ++t) {
    if (!params_[t].matmul) continue;
    // The tensor with the padding up to the next one (or the end of the buffer).
    const int64_t b = params_[t].offset,
                  e = t + 1 < params_.size() ? params_[t + 1].offset : total_;
    append_range(out, b, std::min(e, keep_begin));
    append_range(out, std::max(b, keep_end), e);
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> ParamTable::fp32_read_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t t = 0; t < params_.size(); ++t)
    if (!params_[t].matmul)
      append_range(out, params_[t].offset, t + 1 < params_.size() ? params_[t + 1].offset : total_);
  return out;
}

void ParamTable::initialize(float* params, const BertConfig& cfg, uint64_t seed) const {
  for (size_t t = 0; t < params_.size(); ++t)
    initialize_tensor(t, params + params_[t].offset, cfg, seed);
}

void ParamTable::initialize_tensor(size_t t, float* w, const BertConfig& cfg, uint64_t seed) const {
  const ParamInfo& p = params_.at(t);
  const int64_t n = p.numel();
  if (p.init == Init::Zeros) {
    for (int64_t i = 0; i < n; ++i) w[i] = 0.0f;
  } else if (p.init == Init::Ones) {
    for (int64_t i = 0; i < n; ++i) w[i] = 1.0f;
  } else {
    // Box-Muller on counter-based uniforms; redraw outside 2 std (truncated normal, as
    // Google BERT's tf.truncated_normal_initializer). Keyed by tensor name order and index.
    const uint64_t key = rng_key(seed, 0x1a17, t);
    for (int64_t i = 0; i < n; ++i) {
      float z;
      uint64_t draw = static_cast<uint64_t>(i) << 8;
      do {
        float u1 = rng_uniform(key, 2 * draw) + 1.0f / 33554432.0f;
        float u2 = rng_uniform(key, 2 * draw + 1);
        z = std::sqrt(-2.0f * std::log(u1)) * std::cos(6.28318530717958647692f * u2);
        ++draw;
      } while (std::fabs(z) > 2.0f);
      w[i] = z * cfg.initializer_range;
    }
  }
}

}  // namespace bertrain::model
