// The parameter table: every BERT parameter by its HuggingFace name, with its shape and offset
// into one flat fp32 buffer (gradients use a second buffer with the same offsets).
// Layout choice: query/key/value weights are adjacent ([3C, C] as one matrix) and so are their
// biases, so the QKV projection is a single GEMM over the flat buffer with no copy.
// The MLM decoder is tied to bert.embeddings.word_embeddings.weight (no separate entry).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace bertrain::model {

// TokenClassification: HF's BertForTokenClassification (a classifier on every token's final
// hidden state, no pooler). QuestionAnswering: HF's BertForQuestionAnswering (qa_outputs, a
// start and an end logit per token, no pooler).
enum class Head { Pretraining, SequenceClassification, TokenClassification, QuestionAnswering };
const char* head_architecture(Head h);  // "BertForPreTraining", ...
// HF builds BertForTokenClassification and BertForQuestionAnswering without the pooler.
inline bool has_pooler(Head h) {
  return h == Head::Pretraining || h == Head::SequenceClassification;
}

enum class Init { Normal, Zeros, Ones };

// The word embeddings' rows as the model stores them: the vocabulary padded to a multiple of 64,
// so that the masked LM's logits and its decoder's operands have rows a GPU's matrix units and
// copies read whole (30522 -> 30528). The padding rows (and the decoder bias's padding) stay zero:
// no token id reaches them, their logits are no class (kernels::Classes) and their gradient is
// zero. Checkpoints, the optimizer and every tensor's shape keep the real vocabulary.
constexpr int64_t kVocabMultiple = 64;
inline int64_t vocab_rows(const BertConfig& cfg) {
  return (cfg.vocab_size + kVocabMultiple - 1) / kVocabMultiple * kVocabMultiple;
}

struct ParamInfo {
  std::string name;
  Shape shape;
  int64_t offset = 0;  // in floats
  Init init = Init::Normal;
  bool decay = true;  // false for LayerNorm weights and all biases (BERT's AdamW/LAMB exclusion)
  // Read by the model only as a matmul weight (a bf16 model reads its bf16 copy), never in fp32:
  // the linear layers' weights. The embeddings (the word embeddings are also the tied MLM
  // decoder), biases and LayerNorm are read in fp32.
  bool matmul = false;
  int64_t numel() const { return shape_numel(shape); }
  int64_t end() const { return offset + numel(); }
};

// Offsets of one encoder layer's parameters, for the model's hot loop.
struct LayerOffsets {
  int64_t qkv_w, qkv_b, attn_out_w, attn_out_b, ln1_w, ln1_b;
  int64_t inter_w, inter_b, out_w, out_b, ln2_w, ln2_b;
};

// Offsets of the embeddings' parameters.
struct EmbeddingOffsets {
  int64_t word, position, token_type, ln_w, ln_b;
};

// Offsets of the heads' parameters; -1 for those the table's head does not have. The MLM
// decoder's weight is the word embeddings (tied).
struct HeadOffsets {
  int64_t pooler_w = -1, pooler_b = -1;                 // Pretraining, SequenceClassification
  int64_t mlm_dense_w = -1, mlm_dense_b = -1;           // Pretraining: cls.predictions.transform
  int64_t mlm_ln_w = -1, mlm_ln_b = -1, mlm_bias = -1;  //   its LayerNorm; the decoder's bias
  int64_t nsp_w = -1, nsp_b = -1;                       //   cls.seq_relationship
  int64_t classifier_w = -1, classifier_b = -1;         // Sequence/TokenClassification
  int64_t qa_w = -1, qa_b = -1;                         // QuestionAnswering: qa_outputs
};

class ParamTable {
 public:
  ParamTable(const BertConfig& cfg, Head head);

  // [begin, end) of encoder layer l's parameters in the flat buffer (the reducer's buckets).
  std::pair<int64_t, int64_t> layer_range(int64_t l) const;

  const std::vector<ParamInfo>& params() const { return params_; }
  // Floats, each tensor padded to 16 floats (the word embeddings and the decoder's bias to the
  // padded vocabulary's rows first).
  int64_t total() const { return total_; }
  const ParamInfo* find(const std::string& name) const;
  const ParamInfo& at(const std::string& name) const;  // BT_CHECK if absent
  int64_t offset(const std::string& name) const { return at(name).offset; }
  const LayerOffsets& layer(int64_t l) const { return layers_.at(l); }
  const EmbeddingOffsets& embeddings() const { return embeddings_; }
  const HeadOffsets& heads() const { return heads_; }
  Head head() const { return head_; }

  // Fills the flat buffer with BERT's initialisation: truncated normal (2 std) with
  // std = initializer_range for matrices and embeddings, zeros for biases, LayerNorm 1/0.
  void initialize(float* params, const BertConfig& cfg, uint64_t seed) const;
  // The same for tensor t (index into params()) alone, into out[numel].
  void initialize_tensor(size_t t, float* out, const BertConfig& cfg, uint64_t seed) const;

  // [begin, end) float ranges of the flat buffer (adjacent tensors merged, the padding between
  // them included): the matmul weights outside [keep_begin, keep_end), and the tensors read in
  // fp32 (all but the matmul weights). A sharded fp32 master (ModelDims::master_shard) holds
  // the first nowhere on this rank and every rank holds the second.
  std::vector<std::pair<int64_t, int64_t>> matmul_ranges_outside(int64_t keep_begin,
                                                                 int64_t keep_end) const;
  std::vector<std::pair<int64_t, int64_t>> fp32_read_ranges() const;

 private:
  // Appends a tensor with room for `stored` floats (at least its own; the padded vocabulary's);
  // returns its offset.
  int64_t add(const std::string& name, Shape shape, Init init, bool decay, bool matmul = false,
              int64_t stored = 0);
  Head head_;
  std::vector<ParamInfo> params_;
  std::map<std::string, size_t> index_;
  std::vector<LayerOffsets> layers_;
  EmbeddingOffsets embeddings_{};
  HeadOffsets heads_;
  int64_t total_ = 0, hidden_ = 0;
};

}  // namespace bertrain::model
