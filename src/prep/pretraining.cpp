#include "prep/pretraining.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace bertrain::prep {

void InstanceStats::add(const InstanceStats& o) {
  instances += o.instances;
  tokens += o.tokens;
  masked += o.masked;
  as_mask += o.as_mask;
  as_random += o.as_random;
  as_kept += o.as_kept;
  random_next += o.random_next;
  truncated += o.truncated;
  short_targets += o.short_targets;
  if (length_histogram.size() < o.length_histogram.size())
    length_histogram.resize(o.length_histogram.size());
  for (size_t i = 0; i < o.length_histogram.size(); ++i)
    length_histogram[i] += o.length_histogram[i];
}

namespace {

bool truncate_seq_pair(std::vector<int32_t>& a, std::vector<int32_t>& b, size_t max_tokens,
                       Rng& rng) {
  bool cut = false;
  while (a.size() + b.size() > max_tokens) {
    std::vector<int32_t>& t = a.size() > b.size() ? a : b;
    // Google: assert len(trunc_tokens) >= 1; remove from the front or the back at random.
    if (rng.random() < 0.5)
      t.erase(t.begin());
    else
      t.pop_back();
    cut = true;
  }
  return cut;
}

void mask_tokens(Instance& inst, const InstanceOptions& opt, const Vocab& vocab, Rng& rng,
                 InstanceStats& st) {
  // Candidate groups as flat arrays (a group is one token, or one whole word with WWM).
  thread_local std::vector<int32_t> group_of, first, order;
  thread_local std::vector<char> covered;
  thread_local std::vector<std::pair<int32_t, int32_t>> masked;  // (position, original id)
  const size_t n = inst.tokens.size();
  first.clear();
  group_of.assign(n, -1);
  for (size_t i = 0; i < n; ++i) {
    const int32_t t = inst.tokens[i];
    if (t == vocab.cls() || t == vocab.sep()) continue;
    if (!(opt.whole_word_mask && !first.empty() && vocab.token(t).rfind("##", 0) == 0))
      first.push_back(static_cast<int32_t>(i));
    group_of[i] = static_cast<int32_t>(first.size()) - 1;
  }
  // Members of group g: positions i >= first[g] with group_of[i] == g (contiguous except for
  // a [SEP] in between, which has no group).
  order.resize(first.size());
  for (size_t g = 0; g < order.size(); ++g) order[g] = static_cast<int32_t>(g);
  rng.shuffle(order);
  const int64_t want = std::min<int64_t>(
      opt.max_predictions,
      std::max<int64_t>(1, static_cast<int64_t>(std::nearbyint(n * opt.masked_lm_prob))));
  masked.clear();
  covered.assign(n, 0);
  for (int32_t g : order) {
    if (static_cast<int64_t>(masked.size()) >= want) break;
    size_t size = 0;
    for (size_t i = first[g]; i < n && (group_of[i] == g || group_of[i] < 0); ++i)
      size += group_of[i] == g;
    if (static_cast<int64_t>(masked.size() + size) > want) continue;
    for (size_t i = first[g]; i < n && (group_of[i] == g || group_of[i] < 0); ++i) {
      if (group_of[i] != g || covered[i]) continue;
      covered[i] = 1;
      int32_t replacement;
      if (rng.random() < 0.8) {
        replacement = vocab.mask();
        ++st.as_mask;
      } else if (rng.random() < 0.5) {
        replacement = inst.tokens[i];
        ++st.as_kept;
      } else {
        replacement = static_cast<int32_t>(rng.randint(0, vocab.size() - 1));
        ++st.as_random;
      }
      masked.push_back({static_cast<int32_t>(i), inst.tokens[i]});
      inst.tokens[i] = replacement;
    }
  }
  std::sort(masked.begin(), masked.end());
  for (const auto& [pos, label] : masked) {
    inst.masked_positions.push_back(pos);
    inst.masked_labels.push_back(label);
  }
  st.masked += masked.size();
}

}  // namespace

void create_instances_from_document(const std::vector<Document>& docs, size_t doc_index,
                                    const InstanceOptions& opt, const Vocab& vocab, Rng& rng,
                                    std::vector<Instance>& out, InstanceStats& st) {
  const auto& doc = docs[doc_index].sentences;
  const int64_t max_num_tokens = opt.seq_len - 3;
  int64_t target = max_num_tokens;
  if (rng.random() < opt.short_seq_prob) {
    target = rng.randint(2, max_num_tokens);
    ++st.short_targets;
  }
  if (st.length_histogram.size() < static_cast<size_t>(opt.seq_len + 1))
    st.length_histogram.resize(opt.seq_len + 1);
  std::vector<const std::vector<int32_t>*> chunk;
  int64_t length = 0;
  for (size_t i = 0; i < doc.size(); ++i) {
    if (!doc[i].empty()) {
      chunk.push_back(&doc[i]);
      length += static_cast<int64_t>(doc[i].size());
    }
    if ((i + 1 == doc.size() || length >= target) && !chunk.empty()) {
      const size_t a_end =
          chunk.size() >= 2
              ? static_cast<size_t>(rng.randint(1, static_cast<int64_t>(chunk.size()) - 1))
              : 1;
      std::vector<int32_t> a, b;
      for (size_t j = 0; j < a_end; ++j) a.insert(a.end(), chunk[j]->begin(), chunk[j]->end());
      bool random_next = false;
      if (chunk.size() == 1 || rng.random() < 0.5) {
        random_next = true;
        const int64_t target_b = std::max<int64_t>(1, target - static_cast<int64_t>(a.size()));
        // A random other document (Google tries 10 times; with one document it reuses itself).
        size_t r = doc_index;
        for (int t = 0; t < 10 && docs.size() > 1; ++t) {
          r = static_cast<size_t>(rng.randint(0, static_cast<int64_t>(docs.size()) - 1));
          if (r != doc_index) break;
        }
        const auto& rdoc = docs[r].sentences;
        if (!rdoc.empty()) {
          const size_t start =
              static_cast<size_t>(rng.randint(0, static_cast<int64_t>(rdoc.size()) - 1));
          for (size_t j = start; j < rdoc.size(); ++j) {
            b.insert(b.end(), rdoc[j].begin(), rdoc[j].end());
            if (static_cast<int64_t>(b.size()) >= target_b) break;
          }
        }
        // The segments not used go back: the next instance starts with them.
        i -= chunk.size() - a_end;
      } else {
        for (size_t j = a_end; j < chunk.size(); ++j)
          b.insert(b.end(), chunk[j]->begin(), chunk[j]->end());
      }
      if (truncate_seq_pair(a, b, static_cast<size_t>(max_num_tokens), rng)) ++st.truncated;
      if (!a.empty() && !b.empty()) {
        Instance inst;
        inst.tokens.reserve(a.size() + b.size() + 3);
        inst.tokens.push_back(vocab.cls());
        inst.tokens.insert(inst.tokens.end(), a.begin(), a.end());
        inst.tokens.push_back(vocab.sep());
        inst.tokens.insert(inst.tokens.end(), b.begin(), b.end());
        inst.tokens.push_back(vocab.sep());
        inst.segment_ids.assign(a.size() + 2, 0);
        inst.segment_ids.resize(inst.tokens.size(), 1);
        inst.is_random_next = random_next;
        mask_tokens(inst, opt, vocab, rng, st);
        ++st.instances;
        st.tokens += inst.tokens.size();
        st.random_next += random_next;
        ++st.length_histogram[inst.tokens.size()];
        out.push_back(std::move(inst));
      }
      chunk.clear();
      length = 0;
    }
  }
}

namespace {

// Writes protobuf wire format into a raw buffer sized for the worst case (10 bytes a varint).
struct Writer {
  char* p;
  void varint(uint64_t v) {
    while (v >= 0x80) {
      *p++ = static_cast<char>(v | 0x80);
      v >>= 7;
    }
    *p++ = static_cast<char>(v);
  }
  void byte(char c) { *p++ = c; }
  void bytes(const void* src, size_t n) {
    std::memcpy(p, src, n);
    p += n;
  }
};

size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// map entry {key = 1, value = Feature{kind = list_tag {packed value = 1}}} up to the packed
// payload, which the caller writes next (`packed` bytes; none when pad_to == 0).
void feature_header(Writer& w, const char* key, char list_tag, size_t packed, bool has_values) {
  const size_t list = has_values ? 1 + varint_size(packed) + packed : 0;
  const size_t feature = 1 + varint_size(list) + list;
  const size_t klen = std::strlen(key);
  w.byte(0x0a);
  w.varint(1 + varint_size(klen) + klen + 1 + varint_size(feature) + feature);
  w.byte(0x0a);
  w.varint(klen);
  w.bytes(key, klen);
  w.byte(0x12);
  w.varint(feature);
  w.byte(list_tag);
  w.varint(list);
  if (has_values) {
    w.byte(0x0a);
    w.varint(packed);
  }
}

// int64_list (tag 3): the varints are written first into `tmp`, so the lengths are known.
void int_feature(Writer& w, char* tmp, const char* key, const int32_t* v, size_t n, size_t pad_to) {
  Writer t{tmp};
  for (size_t i = 0; i < pad_to; ++i)
    t.varint(i < n ? static_cast<uint64_t>(static_cast<int64_t>(v[i])) : 0);
  const size_t packed = static_cast<size_t>(t.p - tmp);
  feature_header(w, key, 0x1a, packed, pad_to > 0);
  w.bytes(tmp, packed);
}

// float_list (tag 2): fixed 4 bytes a value.
void float_feature(Writer& w, const char* key, const float* v, size_t n, size_t pad_to) {
  feature_header(w, key, 0x12, 4 * pad_to, pad_to > 0);
  w.bytes(v, 4 * n);
  const float zero = 0.0f;
  for (size_t i = n; i < pad_to; ++i) w.bytes(&zero, 4);
}

}  // namespace

std::string encode_instance(const Instance& inst, const InstanceOptions& opt) {
  const size_t T = static_cast<size_t>(opt.seq_len), P = static_cast<size_t>(opt.max_predictions);
  BT_CHECK(inst.tokens.size() <= T && inst.masked_positions.size() <= P,
           "instance larger than its schema");
  thread_local std::vector<int32_t> ones;
  thread_local std::vector<float> weights;
  thread_local std::vector<char> body, tmp;
  if (ones.size() < T) ones.assign(T, 1);
  if (weights.size() < P) weights.assign(P, 1.0f);
  const size_t worst = 3 * (T * 10 + 64) + 2 * (P * 10 + 64) + (4 * P + 64) + 64 + 16;
  if (body.size() < worst) body.resize(worst);
  if (tmp.size() < 10 * T + 16) tmp.resize(10 * T + 16);
  const int32_t nsp = inst.is_random_next ? 1 : 0;
  Writer w{body.data()};
  // Keys in sorted order, as protobuf's deterministic serialization writes map entries.
  int_feature(w, tmp.data(), "input_ids", inst.tokens.data(), inst.tokens.size(), T);
  int_feature(w, tmp.data(), "input_mask", ones.data(), inst.tokens.size(), T);
  int_feature(w, tmp.data(), "masked_lm_ids", inst.masked_labels.data(), inst.masked_labels.size(),
              P);
  int_feature(w, tmp.data(), "masked_lm_positions", inst.masked_positions.data(),
              inst.masked_positions.size(), P);
  float_feature(w, "masked_lm_weights", weights.data(), inst.masked_positions.size(), P);
  int_feature(w, tmp.data(), "next_sentence_labels", &nsp, 1, 1);
  int_feature(w, tmp.data(), "segment_ids", inst.segment_ids.data(), inst.segment_ids.size(), T);
  const size_t n = static_cast<size_t>(w.p - body.data());
  std::string out;
  out.resize(1 + varint_size(n) + n);
  Writer o{out.data()};
  o.byte(0x0a);  // Example.features
  o.varint(n);
  o.bytes(body.data(), n);
  return out;
}

}  // namespace bertrain::prep
