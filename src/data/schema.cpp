#include "data/schema.h"

#include <cmath>
#include <cstring>
#include "core/setting.h"

namespace bertrain::data {

void Schema::add(const std::string& name, FeatureKind kind, int64_t len, int64_t lo, int64_t hi) {
  FeatureSpec f{name, kind, len, lo, hi, kind == FeatureKind::Float ? floats_ : ints_};
  (kind == FeatureKind::Float ? floats_ : ints_) += len;
  features_.push_back(f);
}

Schema Schema::pretraining(int64_t T, int64_t P, int64_t V, int64_t types) {
  Schema s;
  s.kind_ = Kind::Pretraining;
  s.seq_len_ = T;
  s.max_predictions_ = P;
  s.add("input_ids", FeatureKind::Int64, T, 0, V);
  s.add("input_mask", FeatureKind::Int64, T, 0, 2);
  s.add("segment_ids", FeatureKind::Int64, T, 0, types);
  s.add("masked_lm_positions", FeatureKind::Int64, P, 0, T);
  s.add("masked_lm_ids", FeatureKind::Int64, P, 0, V);
  s.add("next_sentence_labels", FeatureKind::Int64, 1, 0, 2);
  s.add("masked_lm_weights", FeatureKind::Float, P, 0, 0);
  return s;
}

Schema Schema::sequence_with_label(int64_t T, int64_t V, int64_t types, FeatureKind label,
                                   int64_t labels) {
  Schema s;
  s.kind_ = Kind::Classification;
  s.seq_len_ = T;
  s.add("input_ids", FeatureKind::Int64, T, 0, V);
  s.add("input_mask", FeatureKind::Int64, T, 0, 2);
  s.add("segment_ids", FeatureKind::Int64, T, 0, types);
  s.add("label_ids", label, 1, 0, labels);
  return s;
}

Schema Schema::classification(int64_t T, int64_t labels, int64_t V, int64_t types) {
  return sequence_with_label(T, V, types, FeatureKind::Int64, labels);
}

Schema Schema::regression(int64_t T, int64_t V, int64_t types) {
  return sequence_with_label(T, V, types, FeatureKind::Float, 0);
}

bool Schema::parse(std::string_view record, ParsedExample& out, std::string& error) const {
  out.ints.resize(ints_);
  out.floats.resize(floats_);
  return parse(record, out.ints.data(), out.floats.data(), error);
}

bool Schema::parse(std::string_view record, int32_t* ints, float* floats, std::string& error,
                   bool* mismatch) const {
  if (mismatch) *mismatch = false;
  thread_local ExampleView view;
  if (!view.parse(record)) {
    error = "not a valid tf.train.Example: " + view.error();
    return false;
  }
  for (const FeatureSpec& f : features_) {
    const ExampleView::Entry* e = view.find(f.name);
    if (!e) {
      error = str("feature '", f.name, "' is missing");
      return false;
    }
    if (e->kind != f.kind) {
      error = str("feature '", f.name, "' is a ", feature_kind_name(e->kind), " list, expected ",
                  feature_kind_name(f.kind));
      return false;
    }
    int64_t n = 0;
    bool ok, range_ok = true;
    int64_t bad_value = 0, bad_index = 0;
    if (f.kind == FeatureKind::Int64) {
      int32_t* dst = ints + f.offset;
      ok = ExampleView::for_each_int64(e->list, [&](int64_t v) {
        if (n < f.length) {
          if ((v < f.lo || v >= f.hi) && range_ok) {
            range_ok = false;
            bad_value = v;
            bad_index = n;
          }
          dst[n] = static_cast<int32_t>(v);
        }
        ++n;
      });
    } else {
      float* dst = floats + f.offset;
      ok = ExampleView::for_each_float(e->list, [&](float v) {
        if (n < f.length) {
          if (!std::isfinite(v) && range_ok) {
            range_ok = false;
            bad_index = n;
          }
          dst[n] = v;
        }
        ++n;
      });
    }
    if (!ok) {
      error = str("feature '", f.name, "' has a malformed value list");
      return false;
    }
    if (n != f.length) {
      if (mismatch) *mismatch = true;
      const bool seq = f.length == seq_len_ && f.name != "masked_lm_positions";
      error = str("feature '", f.name, "' has ", n, " values, expected ", f.length,
                  seq ? str(" (the data's sequence length differs from ", setting("seq_len"), ")")
                  : f.length == max_predictions_ ? str(" (the data's max predictions differ from ",
                                                       setting("max_predictions"), ")")
                                                 : std::string());
      return false;
    }
    if (!range_ok) {
      error = f.kind == FeatureKind::Float
                  ? str("feature '", f.name, "'[", bad_index, "] is not finite")
                  : str("feature '", f.name, "'[", bad_index, "] = ", bad_value, " is outside [",
                        f.lo, ", ", f.hi, ")",
                        f.name.find("ids") != std::string::npos && f.hi > 2
                            ? " (was the data prepared with another vocabulary?)"
                            : "");
      return false;
    }
  }
  return true;
}

void Schema::shape_batch(Batch& b, int64_t batch_size) const {
  if (b.B != batch_size || b.T != seq_len_ || b.P != max_predictions_ ||
      b.input_ids.size() != static_cast<size_t>(batch_size * seq_len_))
    b.resize(batch_size, seq_len_, max_predictions_);
}

void Schema::fill_row(const int32_t* ints, const float* floats, Batch& b, int64_t row) const {
  const int64_t T = seq_len_, P = max_predictions_;
  const int32_t* p = ints;
  auto copy = [&](std::vector<int32_t>& dst, int64_t n) {
    std::memcpy(dst.data() + row * n, p, n * 4);
    p += n;
  };
  copy(b.input_ids, T);
  copy(b.input_mask, T);
  copy(b.segment_ids, T);
  if (kind_ == Kind::Pretraining) {
    copy(b.masked_lm_positions, P);
    copy(b.masked_lm_ids, P);
    copy(b.next_sentence_labels, 1);
    std::memcpy(b.masked_lm_weights.data() + row * P, floats, P * 4);
  } else {
    copy(b.label_ids, 1);
  }
}

}  // namespace bertrain::data
