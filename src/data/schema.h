// The record schemas bertrain trains on, and parsing one serialized tf.Example into a row of a
// Batch with every length and id checked:
//   pretraining (Google's create_pretraining_data.py): input_ids, input_mask, segment_ids
//     [seq_len] int64; masked_lm_positions, masked_lm_ids [max_predictions] int64;
//     masked_lm_weights [max_predictions] float; next_sentence_labels [1] int64.
//   classification: input_ids, input_mask, segment_ids [seq_len]; label_ids [1] int64.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/batch.h"
#include "data/example.h"

namespace bertrain::data {

struct FeatureSpec {
  std::string name;
  FeatureKind kind;
  int64_t length;
  int64_t lo = 0, hi = 0;  // int features: values must lie in [lo, hi)
  int64_t offset = 0;      // where it goes in a ParsedExample (ints or floats)
};

// A parsed example: the int features back to back (as int32), then the float features.
struct ParsedExample {
  std::vector<int32_t> ints;
  std::vector<float> floats;
};

class Schema {
 public:
  enum class Kind { Pretraining, Classification };
  static Schema pretraining(int64_t seq_len, int64_t max_predictions, int64_t vocab_size,
                            int64_t type_vocab_size = 2);
  static Schema classification(int64_t seq_len, int64_t num_labels, int64_t vocab_size,
                               int64_t type_vocab_size = 2);
  // A regression task's records (STS-B): label_ids is one float, as ALBERT's classifier_utils
  // writes it for sts-b.
  static Schema regression(int64_t seq_len, int64_t vocab_size, int64_t type_vocab_size = 2);

  Kind kind() const { return kind_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t max_predictions() const { return max_predictions_; }
  const std::vector<FeatureSpec>& features() const { return features_; }
  int64_t int_count() const { return ints_; }
  int64_t float_count() const { return floats_; }
  size_t example_bytes() const { return ints_ * 4 + floats_ * 4; }

  // Parses `record`; on failure returns false and sets `error` to what is wrong (feature name,
  // expected vs found). Never throws.
  bool parse(std::string_view record, ParsedExample& out, std::string& error) const;
  // The same into caller storage: ints[int_count()], floats[float_count()].
  // `mismatch` (optional) is set when the record is well-formed but its shape differs from
  // this schema's (another --seq-len or --max-predictions): a configuration error, not damage.
  bool parse(std::string_view record, int32_t* ints, float* floats, std::string& error,
             bool* mismatch = nullptr) const;
  // Copies a parsed example into row `row` of a batch shaped for this schema.
  void fill_row(const ParsedExample& ex, Batch& b, int64_t row) const {
    fill_row(ex.ints.data(), ex.floats.data(), b, row);
  }
  void fill_row(const int32_t* ints, const float* floats, Batch& b, int64_t row) const;
  void shape_batch(Batch& b, int64_t batch_size) const;

 private:
  void add(const std::string& name, FeatureKind kind, int64_t len, int64_t lo, int64_t hi);
  // input_ids, input_mask, segment_ids [T] and one label_ids of kind `label`.
  static Schema sequence_with_label(int64_t T, int64_t V, int64_t types, FeatureKind label,
                                    int64_t labels);
  Kind kind_;
  int64_t seq_len_ = 0, max_predictions_ = 0;
  std::vector<FeatureSpec> features_;
  int64_t ints_ = 0, floats_ = 0;
};

}  // namespace bertrain::data
