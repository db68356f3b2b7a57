// Embedding backward's grouping of a batch's token rows by the table row they add to
// (kernels::RowRuns, types.h), made on the host when a model stages a batch for a backend with
// memory of its own: a stable counting sort by table row, then each row's tokens cut into
// chunks of at most kEmbeddingChunk. A GPU then sums every table row's gradients in parallel,
// deterministically and without atomics.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/types.h"

namespace bertrain::kernels {

class RowGrouping {
 public:
  // Token n (of `tokens`) adds to table row keys[n], or to n % period where keys is null (the
  // position of a padded batch's token); every key is below `rows`. The vectors keep their
  // capacity from batch to batch.
  void build(const int32_t* keys, int64_t period, int64_t tokens, int64_t rows);

  const std::vector<int32_t>& order() const { return order_; }
  const std::vector<EmbeddingChunk>& chunks() const { return chunks_; }
  const std::vector<EmbeddingSum>& sums() const { return sums_; }
  int64_t partials() const { return partials_; }
  // {chunks, sums}: what kernels bounded by the most (below) read (RowRuns::counts).
  const std::vector<int32_t>& counts() const { return counts_; }

 private:
  std::vector<int32_t> order_, start_;
  std::vector<EmbeddingChunk> chunks_;
  std::vector<EmbeddingSum> sums_;
  int64_t partials_ = 0;
  std::vector<int32_t> counts_ = {0, 0};
};

// The most chunks and sums a grouping of `tokens` tokens into a table of `rows` rows makes: a
// chunk holds a token at least, and a row's tokens take one chunk each kEmbeddingChunk but the
// first; a sum is a row of more than kEmbeddingChunk tokens.
inline int64_t max_chunks(int64_t tokens, int64_t rows) {
  return std::min(tokens, std::min(tokens, rows) + tokens / kEmbeddingChunk);
}
inline int64_t max_sums(int64_t tokens, int64_t rows) {
  return std::min(rows, tokens / (kEmbeddingChunk + 1));
}

// The most partial rows a grouping of `tokens` tokens needs: a table row of n > kEmbeddingChunk
// tokens takes ceil(n / kEmbeddingChunk) < 2n / kEmbeddingChunk of them.
inline int64_t max_partials(int64_t tokens) {
  return 2 * ((tokens + kEmbeddingChunk - 1) / kEmbeddingChunk);
}

}  // namespace bertrain::kernels
