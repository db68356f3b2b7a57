// Pretraining instances by Google's algorithm (create_pretraining_data.py): segments A/B with
// 50% random next segment from another document, short_seq_prob shorter targets, random
// truncation from the front or back, masked LM with 80% [MASK] / 10% random / 10% kept,
// [CLS]/[SEP] never masked, optional whole-word masking. Randomness is counter-based, keyed by
// (seed, block, dupe, document), so the output does not depend on thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/rng.h"
#include "prep/wordpiece.h"

namespace bertrain::prep {

struct InstanceOptions {
  int64_t seq_len = 128;
  int64_t max_predictions = 20;
  double masked_lm_prob = 0.15;
  double short_seq_prob = 0.1;
  bool whole_word_mask = false;
};

struct Document {
  std::vector<std::vector<int32_t>> sentences;  // token ids
};

struct Instance {
  std::vector<int32_t> tokens, segment_ids;
  std::vector<int32_t> masked_positions, masked_labels;  // sorted by position
  bool is_random_next = false;
};

struct InstanceStats {
  uint64_t instances = 0, tokens = 0, masked = 0, as_mask = 0, as_random = 0, as_kept = 0;
  uint64_t random_next = 0, truncated = 0, short_targets = 0;
  std::vector<uint64_t> length_histogram;  // [seq_len + 1]
  void add(const InstanceStats& o);
};

// Python-style helpers over a counter-based stream.
class Rng {
 public:
  explicit Rng(uint64_t key) : key_(key) {}
  double random() { return static_cast<double>(rng_u64(key_, n_++) >> 11) * 0x1.0p-53; }
  int64_t randint(int64_t a, int64_t b) {  // inclusive, as Python's random.randint
    return a + static_cast<int64_t>(rng_u64(key_, n_++) % static_cast<uint64_t>(b - a + 1));
  }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i)
      std::swap(v[i - 1], v[randint(0, static_cast<int64_t>(i) - 1)]);
  }

 private:
  uint64_t key_, n_ = 0;
};

void create_instances_from_document(const std::vector<Document>& docs, size_t doc_index,
                                    const InstanceOptions& opt, const Vocab& vocab, Rng& rng,
                                    std::vector<Instance>& out, InstanceStats& stats);

// The tf.train.Example of an instance in Google's schema (padded to seq_len/max_predictions),
// serialized exactly as protobuf serializes it deterministically (keys sorted).
std::string encode_instance(const Instance& inst, const InstanceOptions& opt);

}  // namespace bertrain::prep
