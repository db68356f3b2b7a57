#include "data/batch.h"

namespace bertrain::data {

void Batch::resize(int64_t b, int64_t t, int64_t p) {
  B = b;
  T = t;
  P = p;
  input_ids.assign(B * T, 0);
  input_mask.assign(B * T, 0);
  segment_ids.assign(B * T, 0);
  masked_lm_positions.assign(B * P, 0);
  masked_lm_ids.assign(B * P, 0);
  masked_lm_weights.assign(B * P, 0.0f);
  next_sentence_labels.assign(B, 0);
  label_ids.assign(B, 0);
  label_values.assign(B, 0.0f);
  token_label_ids.assign(B * T, 0);
  token_label_weights.assign(B * T, 0.0f);
  span_positions.assign(2 * B, 0);
}

}  // namespace bertrain::data
