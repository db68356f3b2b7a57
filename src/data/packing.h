// Packing: a batch holds as many pretraining instances as fit into a fixed number of rows of
// seq_len tokens (at most `per_row` instances a row), the way MLPerf BERT and Graphcore's packed
// BERT put several short instances into one row. The model runs a packed batch unpadded (each
// instance on its own tokens, its attention over its own tokens only: the block-diagonal mask
// without the zero blocks), so where an instance sits in its row changes no number; the rows
// are the batch's token budget, and the instances always fit them.
//
// A batch is a contiguous run of the input stream: instances are taken in order while they fit
// (first fit into the rows; when that fails, first fit decreasing of all of them), and the first
// that fits nowhere begins the next batch. So the batches depend on the stream alone, and a
// position (batches, or instances, read) restarts it exactly.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace bertrain::data {

struct PackLimits {
  int64_t rows = 0;         // rows per batch (--batch-size)
  int64_t seq_len = 0;      // tokens per row
  int64_t per_row = 3;      // instances per row at most
  int64_t predictions = 0;  // weighted masked predictions per batch at most (rows x per-row)
};

class RowPacker {
 public:
  explicit RowPacker(PackLimits limits);
  // Takes an instance of `tokens` real tokens and `predictions` weighted masked predictions
  // when it fits beside those already taken; false (nothing changed) when it does not.
  bool take(int64_t tokens, int64_t predictions);
  void clear();
  int64_t instances() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t tokens() const { return used_tokens_; }
  int64_t predictions() const { return used_predictions_; }
  // The row of each instance taken, in the order taken.
  const std::vector<int32_t>& rows() const { return row_of_; }
  const PackLimits& limits() const { return lim_; }

 private:
  bool first_fit(int64_t tokens);
  bool repack(int64_t tokens);  // all instances and the new one, longest first

  PackLimits lim_;
  std::vector<int64_t> tokens_;      // per instance
  std::vector<int32_t> row_of_;      // per instance
  std::vector<int64_t> row_tokens_;  // per row
  std::vector<int64_t> row_count_;   // instances per row
  int64_t used_tokens_ = 0, used_predictions_ = 0;
};

// The real length of a pretraining instance (through its last input_mask 1, and any weighted
// masked position past it; a mask of zeros counts as full: the model's rule) and its weighted
// masked predictions, from the feature rows of one instance.
std::pair<int64_t, int64_t> instance_size(const int32_t* input_mask, int64_t seq_len,
                                          const int32_t* masked_positions,
                                          const float* masked_weights, int64_t max_predictions);

}  // namespace bertrain::data
