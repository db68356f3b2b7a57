#include "data/example.h"

#include "tensorflow/core/example/example.pb.h"

namespace bertrain::data {

const char* feature_kind_name(FeatureKind k) {
  switch (k) {
    case FeatureKind::Bytes:
      return "bytes";
    case FeatureKind::Float:
      return "float";
    case FeatureKind::Int64:
      return "int64";
    case FeatureKind::Empty:
      return "empty";
  }
  return "?";
}

size_t Feature::size() const {
  switch (kind) {
    case FeatureKind::Bytes:
      return bytes.size();
    case FeatureKind::Float:
      return floats.size();
    case FeatureKind::Int64:
      return ints.size();
    case FeatureKind::Empty:
      return 0;
  }
  return 0;
}

bool same_contents(const Example& a, const Example& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, f] : a) {
    auto it = b.find(k);
    if (it == b.end() || it->second.kind != f.kind || it->second.ints != f.ints ||
        it->second.bytes != f.bytes || it->second.floats.size() != f.floats.size())
      return false;
    for (size_t i = 0; i < f.floats.size(); ++i) {
      const float x = f.floats[i], y = it->second.floats[i];
      if (std::memcmp(&x, &y, 4) != 0 && !(x != x && y != y)) return false;
    }
  }
  return true;
}

Example decode_example(std::string_view bytes) {
  tensorflow::Example pb;
  if (!pb.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())))
    fail("record is not a valid tf.train.Example (", bytes.size(), " bytes)");
  Example out;
  for (const auto& [name, f] : pb.features().feature()) {
    Feature& d = out[name];
    switch (f.kind_case()) {
      case tensorflow::Feature::kBytesList:
        d.kind = FeatureKind::Bytes;
        d.bytes.assign(f.bytes_list().value().begin(), f.bytes_list().value().end());
        break;
      case tensorflow::Feature::kFloatList:
        d.kind = FeatureKind::Float;
        d.floats.assign(f.float_list().value().begin(), f.float_list().value().end());
        break;
      case tensorflow::Feature::kInt64List:
        d.kind = FeatureKind::Int64;
        d.ints.assign(f.int64_list().value().begin(), f.int64_list().value().end());
        break;
      default:
        d.kind = FeatureKind::Empty;
    }
  }
  return out;
}

std::string encode_example(const Example& ex) {
  tensorflow::Example pb;
  auto* fmap = pb.mutable_features()->mutable_feature();
  for (const auto& [name, f] : ex) {
    tensorflow::Feature& d = (*fmap)[name];
    switch (f.kind) {
      case FeatureKind::Bytes: {
        auto* list = d.mutable_bytes_list();  // set the kind even for an empty list
        for (const auto& b : f.bytes) list->add_value(b);
        break;
      }
      case FeatureKind::Float:
        d.mutable_float_list()->mutable_value()->Add(f.floats.begin(), f.floats.end());
        break;
      case FeatureKind::Int64:
        d.mutable_int64_list()->mutable_value()->Add(f.ints.begin(), f.ints.end());
        break;
      case FeatureKind::Empty:
        break;
    }
  }
  std::string out;
  // Deterministic: map entries sorted by key, so equal Examples give equal bytes.
  google::protobuf::io::StringOutputStream sos(&out);
  google::protobuf::io::CodedOutputStream cos(&sos);
  cos.SetSerializationDeterministic(true);
  pb.SerializeToCodedStream(&cos);
  cos.Trim();
  return out;
}

namespace wire {
bool skip_field(const char*& p, const char* end, uint64_t tag, int depth) {
  uint64_t v;
  switch (tag & 7) {
    case 0:
      return varint(p, end, v);
    case 1:
      if (end - p < 8) return false;
      p += 8;
      return true;
    case 2: {
      std::string_view s;
      return length_delimited(p, end, s);
    }
    case 3: {  // start group: fields until the end-group tag of the same field number
      if (depth >= 100) return false;
      while (p < end) {
        uint64_t inner;
        if (!varint(p, end, inner)) return false;
        if ((inner & 7) == 4) return (inner >> 3) == (tag >> 3);
        if (!skip_field(p, end, inner, depth + 1)) return false;
      }
      return false;  // no end-group
    }
    case 5:
      if (end - p < 4) return false;
      p += 4;
      return true;
    default:
      return false;  // an end-group without its start, or wire types 6 and 7
  }
}
}  // namespace wire

bool ExampleView::parse(std::string_view bytes) {
  entries_.clear();
  error_.clear();
  const char *p = bytes.data(), *end = p + bytes.size();
  auto bad = [&](const char* what) {
    error_ = str(what, " at byte ", p - bytes.data());
    return false;
  };
  while (p < end) {  // Example
    uint64_t tag;
    if (!wire::varint(p, end, tag)) return bad("truncated Example tag");
    if (tag != ((1 << 3) | 2)) {
      if (!wire::skip_field(p, end, tag)) return bad("malformed Example field");
      continue;
    }
    std::string_view features;
    if (!wire::length_delimited(p, end, features)) return bad("truncated Features");
    const char *q = features.data(), *qe = q + features.size();
    while (q < qe) {  // Features: repeated map entry, field 1
      if (!wire::varint(q, qe, tag)) return bad("truncated Features tag");
      if (tag != ((1 << 3) | 2)) {
        if (!wire::skip_field(q, qe, tag)) return bad("malformed Features field");
        continue;
      }
      std::string_view entry;
      if (!wire::length_delimited(q, qe, entry)) return bad("truncated feature entry");
      Entry e;
      const char *r = entry.data(), *re = r + entry.size();
      while (r < re) {  // map entry: key = 1, value = 2
        if (!wire::varint(r, re, tag)) return bad("truncated entry tag");
        if (tag == ((1 << 3) | 2)) {
          if (!wire::length_delimited(r, re, e.key)) return bad("truncated feature name");
        } else if (tag == ((2 << 3) | 2)) {
          std::string_view feature;
          if (!wire::length_delimited(r, re, feature)) return bad("truncated Feature");
          e.kind = FeatureKind::Empty;
          e.list = {};
          const char *s = feature.data(), *se = s + feature.size();
          while (s < se) {  // Feature: oneof bytes_list = 1, float_list = 2, int64_list = 3
            if (!wire::varint(s, se, tag)) return bad("truncated Feature tag");
            const uint64_t field = tag >> 3;
            if ((tag & 7) == 2 && field >= 1 && field <= 3) {
              if (!wire::length_delimited(s, se, e.list)) return bad("truncated feature list");
              e.kind = field == 1   ? FeatureKind::Bytes
                       : field == 2 ? FeatureKind::Float
                                    : FeatureKind::Int64;
            } else if (!wire::skip_field(s, se, tag)) {
              return bad("malformed Feature field");
            }
          }
        } else if (!wire::skip_field(r, re, tag)) {
          return bad("malformed feature entry");
        }
      }
      entries_.push_back(e);
    }
  }
  return true;
}

const ExampleView::Entry* ExampleView::find(std::string_view key) const {
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it)
    if (it->key == key) return &*it;
  return nullptr;
}

Example to_example(const ExampleView& v) {
  Example out;
  for (const auto& e : v.entries()) {
    Feature f;
    f.kind = e.kind;
    bool ok = true;
    if (e.kind == FeatureKind::Int64)
      ok = ExampleView::for_each_int64(e.list, [&](int64_t x) { f.ints.push_back(x); });
    else if (e.kind == FeatureKind::Float)
      ok = ExampleView::for_each_float(e.list, [&](float x) { f.floats.push_back(x); });
    else if (e.kind == FeatureKind::Bytes)
      ok =
          ExampleView::for_each_bytes(e.list, [&](std::string_view x) { f.bytes.emplace_back(x); });
    if (!ok) fail("malformed ", feature_kind_name(e.kind), " list in feature '", e.key, "'");
    out[std::string(e.key)] = std::move(f);
  }
  return out;
}

}  // namespace bertrain::data
