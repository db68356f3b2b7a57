#include "model/batch.h"

#include <cmath>

#include "core/error.h"
#include "core/setting.h"
#include "model/params.h"

namespace bertrain::model {

namespace {

void check_size(const char* name, size_t have, int64_t want) {
  if (static_cast<int64_t>(have) != want)
    fail("batch field ", name, " has ", have, " values, expected ", want);
}

void check_range(const char* name, const std::vector<int32_t>& v, int64_t cols, int64_t lo,
                 int64_t hi, const char* what) {
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] < lo || v[i] >= hi)
      fail("batch field ", name, "[", i / cols, ",", i % cols, "] = ", v[i], " is outside ", what,
           " [", lo, ", ", hi,
           "); check that the data was prepared with this model's "
           "vocabulary and settings");
}

}  // namespace

void validate_batch(const Batch& b, const BertConfig& cfg, Head head) {
  if (b.T > cfg.max_position_embeddings)
    fail("sequence length ", b.T, " exceeds max_position_embeddings ", cfg.max_position_embeddings,
         " of the model; use ", setting("seq_len"), " <= ", cfg.max_position_embeddings);
  check_size("input_ids", b.input_ids.size(), b.B * b.T);
  check_size("input_mask", b.input_mask.size(), b.B * b.T);
  check_size("segment_ids", b.segment_ids.size(), b.B * b.T);
  check_range("input_ids", b.input_ids, b.T, 0, cfg.vocab_size, "the vocabulary");
  check_range("input_mask", b.input_mask, b.T, 0, 2, "{0,1}");
  check_range("segment_ids", b.segment_ids, b.T, 0, cfg.type_vocab_size, "type_vocab_size");
  if (head == Head::Pretraining) {
    check_size("masked_lm_positions", b.masked_lm_positions.size(), b.B * b.P);
    check_size("masked_lm_ids", b.masked_lm_ids.size(), b.B * b.P);
    check_size("masked_lm_weights", b.masked_lm_weights.size(), b.B * b.P);
    check_size("next_sentence_labels", b.next_sentence_labels.size(), b.B);
    check_range("masked_lm_positions", b.masked_lm_positions, b.P, 0, b.T, "the sequence");
    check_range("masked_lm_ids", b.masked_lm_ids, b.P, 0, cfg.vocab_size, "the vocabulary");
    check_range("next_sentence_labels", b.next_sentence_labels, 1, 0, 2, "{0,1}");
    for (size_t i = 0; i < b.masked_lm_weights.size(); ++i)
      if (!std::isfinite(b.masked_lm_weights[i]) || b.masked_lm_weights[i] < 0)
        fail("batch field masked_lm_weights[", i / b.P, ",", i % b.P,
             "] = ", b.masked_lm_weights[i], " must be finite and >= 0");
  } else {
    if (head == Head::TokenClassification) {
      check_size("token_label_ids", b.token_label_ids.size(), b.B * b.T);
      check_size("token_label_weights", b.token_label_weights.size(), b.B * b.T);
      check_range("token_label_ids", b.token_label_ids, b.T, 0, cfg.num_labels, "num_labels");
      for (size_t i = 0; i < b.token_label_weights.size(); ++i)
        if (!std::isfinite(b.token_label_weights[i]) || b.token_label_weights[i] < 0)
          fail("batch field token_label_weights[", i / b.T, ",", i % b.T,
               "] = ", b.token_label_weights[i], " must be finite and >= 0");
    } else if (head == Head::QuestionAnswering) {
      check_size("span_positions", b.span_positions.size(), 2 * b.B);
      check_range("span_positions", b.span_positions, b.B, 0, b.T, "the sequence");
    } else if (cfg.num_labels == 1) {  // regression
      check_size("label_values", b.label_values.size(), b.B);
      for (size_t i = 0; i < b.label_values.size(); ++i)
        if (!std::isfinite(b.label_values[i]))
          fail("batch field label_values[", i, "] = ", b.label_values[i], " must be finite");
    } else {
      check_size("label_ids", b.label_ids.size(), b.B);
      check_range("label_ids", b.label_ids, 1, 0, cfg.num_labels, "num_labels");
    }
  }
}

}  // namespace bertrain::model
