#include "kernels/embedding_runs.h"

#include <algorithm>

#include "core/error.h"

namespace bertrain::kernels {

void RowGrouping::build(const int32_t* keys, int64_t period, int64_t tokens, int64_t rows) {
  BT_CHECK(tokens <= INT32_MAX, "embedding backward: ", tokens, " tokens in one batch");
  auto key = [&](int64_t n) -> int64_t { return keys ? keys[n] : n % period; };
  // Counting sort, stable: the tokens of one table row stay in token order.
  start_.assign(static_cast<size_t>(rows) + 1, 0);
  for (int64_t n = 0; n < tokens; ++n) {
    const int64_t k = key(n);
    BT_CHECK(k >= 0 && k < rows, "embedding backward: token ", n, " adds to row ", k,
             " of a table of ", rows);
    ++start_[k + 1];
  }
  for (int64_t r = 0; r < rows; ++r) start_[r + 1] += start_[r];
  order_.resize(static_cast<size_t>(tokens));
  for (int64_t n = 0; n < tokens; ++n) order_[start_[key(n)]++] = static_cast<int32_t>(n);
  // start_[r] is now row r's end.
  chunks_.clear();
  sums_.clear();
  partials_ = 0;
  int64_t begin = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t end = start_[r], n = end - begin;
    const auto row = static_cast<int32_t>(r);
    if (n > kEmbeddingChunk) {
      const int64_t count = (n + kEmbeddingChunk - 1) / kEmbeddingChunk;
      sums_.push_back({row, static_cast<int32_t>(partials_), static_cast<int32_t>(count)});
      for (int64_t b = begin; b < end; b += kEmbeddingChunk)
        chunks_.push_back({static_cast<int32_t>(b),
                           static_cast<int32_t>(std::min(end, b + kEmbeddingChunk)), row,
                           static_cast<int32_t>(partials_++)});
    } else if (n > 0) {
      chunks_.push_back({static_cast<int32_t>(begin), static_cast<int32_t>(end), row, -1});
    }
    begin = end;
  }
  counts_ = {static_cast<int32_t>(chunks_.size()), static_cast<int32_t>(sums_.size())};
}

}  // namespace bertrain::kernels
