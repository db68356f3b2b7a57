// A batch as the model consumes it: int32 token data, row-major [B,T] / [B,P].
// Field names follow Google BERT's TFRecord schema (create_pretraining_data.py). The input
// pipeline produces it; the model (model/batch.h) validates it against its config.
#pragma once

#include <cstdint>
#include <vector>

namespace bertrain::data {

struct Batch {
  int64_t B = 0, T = 0, P = 0;  // batch, tokens per sequence, masked predictions per sequence
  // Packed (data/packing.h): the B instances fit into this many rows of T tokens; 0 = unpacked.
  int64_t packed_rows = 0;
  std::vector<int32_t> input_ids, input_mask, segment_ids;  // [B,T]
  std::vector<int32_t> masked_lm_positions, masked_lm_ids;  // [B,P]
  std::vector<float> masked_lm_weights;                     // [B,P]
  std::vector<int32_t> next_sentence_labels;                // [B] (pretraining)
  std::vector<int32_t> label_ids;                           // [B] (classification)
  std::vector<float> label_values;                          // [B] (regression: 1 label)
  // Token classification: each token's label and loss weight (1 scored, 0 not: sub-tokens after
  // a word's first, [CLS]/[SEP], padding).
  std::vector<int32_t> token_label_ids;    // [B,T]
  std::vector<float> token_label_weights;  // [B,T]
  // Extractive QA: the answer's first token of every example, then its last token ([2,B]; an
  // answer outside the window points at [CLS], position 0, as HF's run_qa labels it).
  std::vector<int32_t> span_positions;

  void resize(int64_t b, int64_t t, int64_t p);
  // Token positions of the batch: rows x T, a row per sequence, or per packed row.
  int64_t token_slots() const { return (packed_rows > 0 ? packed_rows : B) * T; }
};

}  // namespace bertrain::data
