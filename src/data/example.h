// tf.train.Example: a name -> feature map, each feature an int64, float or bytes list.
// Two decoders: `decode_example` through protobuf's generated code (the reference; used by
// inspect and tests), and `ExampleView`, a zero-copy wire-format scanner for the input pipeline
// (TensorFlow's own fast path does the same: example_proto_fast_parsing.cc). Tests and a fuzz
// target hold the two equal. Both accept packed and unpacked lists; a repeated key keeps the
// last value, as protobuf maps do.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/error.h"

namespace bertrain::data {

enum class FeatureKind { Bytes, Float, Int64, Empty };
const char* feature_kind_name(FeatureKind k);

struct Feature {
  FeatureKind kind = FeatureKind::Empty;
  std::vector<int64_t> ints;
  std::vector<float> floats;
  std::vector<std::string> bytes;
  size_t size() const;
  bool operator==(const Feature& o) const = default;
};

using Example = std::map<std::string, Feature>;

// Equal names, kinds and values; floats compare by bits, except that any NaN equals any NaN
// (Feature::operator== would make NaN != NaN). For decoder cross-checks.
bool same_contents(const Example& a, const Example& b);

// Through protobuf. decode throws Error on malformed bytes.
Example decode_example(std::string_view bytes);
std::string encode_example(const Example& ex);

// Zero-copy scan of one serialized Example. `find` returns the last occurrence of a key.
class ExampleView {
 public:
  struct Entry {
    std::string_view key;
    FeatureKind kind = FeatureKind::Empty;
    std::string_view list;  // the serialized XxxList message
  };
  // Returns false (with `error` set) on malformed wire data.
  bool parse(std::string_view bytes);
  const std::string& error() const { return error_; }
  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* find(std::string_view key) const;

  // Decoders of a list body: call `out(value)` for each element; false on malformed data.
  template <typename F>
  static bool for_each_int64(std::string_view list, F&& out);
  template <typename F>
  static bool for_each_float(std::string_view list, F&& out);
  template <typename F>
  static bool for_each_bytes(std::string_view list, F&& out);

 private:
  std::vector<Entry> entries_;
  std::string error_;
};

Example to_example(const ExampleView& v);  // materialise (for tests and inspect)

namespace wire {
// Protobuf wire primitives over [p, end). Return false on truncation/overflow.
inline bool varint(const char*& p, const char* end, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (p >= end) return false;
    const uint8_t b = static_cast<uint8_t>(*p++);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}
// Skips the value of a field whose tag was just read, as protobuf skips unknown fields:
// varint, fixed64, length-delimited, fixed32, and (deprecated) groups up to their matching
// end-group tag, nested at most 100 deep. False on truncation or an unmatched end-group.
bool skip_field(const char*& p, const char* end, uint64_t tag, int depth = 0);
inline bool length_delimited(const char*& p, const char* end, std::string_view& out) {
  uint64_t n;
  if (!varint(p, end, n) || n > static_cast<uint64_t>(end - p)) return false;
  out = std::string_view(p, n);
  p += n;
  return true;
}
}  // namespace wire

template <typename F>
bool ExampleView::for_each_int64(std::string_view list, F&& out) {
  const char *p = list.data(), *end = p + list.size();
  while (p < end) {
    uint64_t tag;
    if (!wire::varint(p, end, tag)) return false;
    if ((tag >> 3) == 1 && (tag & 7) == 2) {  // packed
      std::string_view body;
      if (!wire::length_delimited(p, end, body)) return false;
      const char *q = body.data(), *qe = q + body.size();
      while (q < qe) {
        uint64_t v;
        if (!wire::varint(q, qe, v)) return false;
        out(static_cast<int64_t>(v));
      }
    } else if ((tag >> 3) == 1 && (tag & 7) == 0) {  // unpacked
      uint64_t v;
      if (!wire::varint(p, end, v)) return false;
      out(static_cast<int64_t>(v));
    } else if (!wire::skip_field(p, end, tag)) {
      return false;
    }
  }
  return true;
}

template <typename F>
bool ExampleView::for_each_float(std::string_view list, F&& out) {
  const char *p = list.data(), *end = p + list.size();
  while (p < end) {
    uint64_t tag;
    if (!wire::varint(p, end, tag)) return false;
    if ((tag >> 3) == 1 && (tag & 7) == 2) {
      std::string_view body;
      if (!wire::length_delimited(p, end, body) || body.size() % 4) return false;
      for (size_t i = 0; i < body.size(); i += 4) {
        float f;
        std::memcpy(&f, body.data() + i, 4);
        out(f);
      }
    } else if ((tag >> 3) == 1 && (tag & 7) == 5) {
      if (end - p < 4) return false;
      float f;
      std::memcpy(&f, p, 4);
      p += 4;
      out(f);
    } else if (!wire::skip_field(p, end, tag)) {
      return false;
    }
  }
  return true;
}

template <typename F>
bool ExampleView::for_each_bytes(std::string_view list, F&& out) {
  const char *p = list.data(), *end = p + list.size();
  while (p < end) {
    uint64_t tag;
    if (!wire::varint(p, end, tag)) return false;
    if ((tag >> 3) == 1 && (tag & 7) == 2) {
      std::string_view v;
      if (!wire::length_delimited(p, end, v)) return false;
      out(v);
    } else if (!wire::skip_field(p, end, tag)) {
      return false;
    }
  }
  return true;
}

}  // namespace bertrain::data
