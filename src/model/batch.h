// A batch as the model consumes it: int32 token data, row-major [B,T] / [B,P].
// Field names follow Google BERT's TFRecord schema (create_pretraining_data.py).
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace bertrain::model {

struct Batch {
  int64_t B = 0, T = 0, P = 0;  // batch, tokens per sequence, masked predictions per sequence
  std::vector<int32_t> input_ids, input_mask, segment_ids;  // [B,T]
  std::vector<int32_t> masked_lm_positions, masked_lm_ids;  // [B,P]
  std::vector<float> masked_lm_weights;                     // [B,P]
  std::vector<int32_t> next_sentence_labels;                // [B] (pretraining)
  std::vector<int32_t> label_ids;                           // [B] (classification)

  void resize(int64_t b, int64_t t, int64_t p);
};

enum class Head;  // model/params.h

// Checks every id against the config and every length against B/T/P; the error names the
// field, the example and the position, e.g. "input_ids[3,17] = 40000 is outside the vocabulary".
void validate_batch(const Batch& b, const BertConfig& cfg, Head head);

}  // namespace bertrain::model
