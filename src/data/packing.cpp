#include "data/packing.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace bertrain::data {

RowPacker::RowPacker(PackLimits limits) : lim_(limits) {
  if (lim_.rows <= 0 || lim_.seq_len <= 0 || lim_.per_row <= 0 || lim_.predictions < 0)
    fail("packing needs positive rows, sequence length and instances per row (got ", lim_.rows,
         ", ", lim_.seq_len, ", ", lim_.per_row, ")");
  clear();
}

void RowPacker::clear() {
  tokens_.clear();
  row_of_.clear();
  row_tokens_.assign(lim_.rows, 0);
  row_count_.assign(lim_.rows, 0);
  used_tokens_ = used_predictions_ = 0;
}

bool RowPacker::first_fit(int64_t tokens) {
  for (int64_t r = 0; r < lim_.rows; ++r)
    if (row_count_[r] < lim_.per_row && row_tokens_[r] + tokens <= lim_.seq_len) {
      row_tokens_[r] += tokens;
      ++row_count_[r];
      tokens_.push_back(tokens);
      row_of_.push_back(static_cast<int32_t>(r));
      return true;
    }
  return false;
}

bool RowPacker::repack(int64_t tokens) {
  const size_t n = tokens_.size() + 1;
  std::vector<int64_t> len = tokens_;
  len.push_back(tokens);
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return len[a] > len[b]; });
  std::vector<int64_t> rt(lim_.rows, 0), rc(lim_.rows, 0);
  std::vector<int32_t> row(n, -1);
  for (size_t i : order) {
    for (int64_t r = 0; r < lim_.rows && row[i] < 0; ++r)
      if (rc[r] < lim_.per_row && rt[r] + len[i] <= lim_.seq_len) {
        rt[r] += len[i];
        ++rc[r];
        row[i] = static_cast<int32_t>(r);
      }
    if (row[i] < 0) return false;
  }
  tokens_ = std::move(len);
  row_of_ = std::move(row);
  row_tokens_ = std::move(rt);
  row_count_ = std::move(rc);
  return true;
}

bool RowPacker::take(int64_t tokens, int64_t predictions) {
  if (tokens <= 0 || tokens > lim_.seq_len)
    fail("an instance of ", tokens, " tokens cannot be packed into rows of ", lim_.seq_len);
  if (used_predictions_ + predictions > lim_.predictions) return false;
  if (!first_fit(tokens) && !repack(tokens)) return false;
  used_tokens_ += tokens;
  used_predictions_ += predictions;
  return true;
}

std::pair<int64_t, int64_t> instance_size(const int32_t* input_mask, int64_t seq_len,
                                          const int32_t* masked_positions,
                                          const float* masked_weights, int64_t max_predictions) {
  int64_t n = seq_len;
  while (n > 0 && input_mask[n - 1] == 0) --n;
  if (n == 0) n = seq_len;
  int64_t predictions = 0;
  for (int64_t j = 0; j < max_predictions; ++j)
    if (masked_weights[j] != 0.0f) {
      ++predictions;
      n = std::max<int64_t>(n, std::min<int64_t>(masked_positions[j] + 1, seq_len));
    }
  return {n, predictions};
}

}  // namespace bertrain::data
