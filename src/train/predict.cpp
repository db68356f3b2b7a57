#include "train/predict.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "train/metrics.h"

namespace bertrain::train {

void make_batch(const tasks::LabeledSet& s, const std::vector<size_t>& order, size_t begin,
                size_t end, int64_t seq_len, model::Batch& b) {
  b.resize(static_cast<int64_t>(end - begin), seq_len, 0);
  for (size_t r = begin; r < end; ++r) {
    const size_t i = order[r];
    const int64_t row = static_cast<int64_t>(r - begin);
    for (size_t t = 0; t < s.ids[i].size(); ++t) {
      b.input_ids[row * seq_len + t] = s.ids[i][t];
      b.input_mask[row * seq_len + t] = 1;
      b.segment_ids[row * seq_len + t] = s.segments[i][t];
    }
    b.label_ids[row] = std::max(0, s.labels[i]);
    b.label_values[row] = s.targets.empty() ? 0.0f : s.targets[i];
  }
}

double classify(model::BertModel& m, const tasks::LabeledSet& s, int64_t batch_size,
                std::vector<Prediction>* out) {
  std::vector<size_t> order(s.ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const int64_t NL = m.config().num_labels;
  model::Batch b;
  int64_t correct = 0, labeled = 0;
  for (size_t i = 0; i < order.size(); i += batch_size) {
    const size_t end = std::min(order.size(), i + batch_size);
    make_batch(s, order, i, end, m.dims().seq_len, b);
    m.forward(b, {});
    const float* logits = m.cls_logits();
    for (size_t r = i; r < end; ++r) {
      const float* l = logits + (r - i) * NL;
      const int32_t arg = static_cast<int32_t>(std::max_element(l, l + NL) - l);
      if (s.labels[r] >= 0) {
        ++labeled;
        correct += arg == s.labels[r];
      }
      if (out) {
        Prediction p{arg, std::vector<float>(NL)};
        const float mx = l[arg];
        double sum = 0;
        for (int64_t k = 0; k < NL; ++k) sum += std::exp(l[k] - mx);
        for (int64_t k = 0; k < NL; ++k) p.probs[k] = static_cast<float>(std::exp(l[k] - mx) / sum);
        out->push_back(std::move(p));
      }
    }
  }
  return labeled ? static_cast<double>(correct) / labeled : 0.0;
}

RegressionMetrics regress(model::BertModel& m, const tasks::LabeledSet& s, int64_t batch_size,
                          std::vector<float>* out) {
  BT_CHECK(m.config().num_labels == 1, "regress needs a model with one output");
  std::vector<size_t> order(s.ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<double> pred, target;
  model::Batch b;
  for (size_t i = 0; i < order.size(); i += batch_size) {
    const size_t end = std::min(order.size(), i + batch_size);
    make_batch(s, order, i, end, m.dims().seq_len, b);
    m.forward(b, {});
    for (size_t r = i; r < end; ++r) {
      pred.push_back(m.cls_logits()[r - i]);
      if (out) out->push_back(m.cls_logits()[r - i]);
    }
  }
  RegressionMetrics r;
  if (s.targets.empty()) return r;
  target.assign(s.targets.begin(), s.targets.end());
  r.pearson = pearson(pred, target);
  r.spearman = spearman(pred, target);
  for (size_t i = 0; i < pred.size(); ++i) r.mse += (pred[i] - target[i]) * (pred[i] - target[i]);
  r.mse /= static_cast<double>(pred.size());
  return r;
}

void make_token_batch(const tasks::TokenSet& s, const std::vector<size_t>& order, size_t begin,
                      size_t end, int64_t seq_len, model::Batch& b) {
  b.resize(static_cast<int64_t>(end - begin), seq_len, 0);
  for (size_t r = begin; r < end; ++r) {
    const size_t i = order[r];
    const int64_t row = static_cast<int64_t>(r - begin) * seq_len;
    for (size_t t = 0; t < s.ids[i].size(); ++t) {
      b.input_ids[row + t] = s.ids[i][t];
      b.input_mask[row + t] = 1;
      b.token_label_ids[row + t] = std::max(0, s.labels[i][t]);
      b.token_label_weights[row + t] = s.labels[i][t] >= 0 ? 1.0f : 0.0f;
    }
  }
}

std::vector<std::vector<std::string>> predict_tags(model::BertModel& m, const tasks::TaggedSet& s,
                                                   const tasks::TokenSet& t, int64_t batch_size) {
  const int64_t NL = m.config().num_labels, T = m.dims().seq_len;
  std::vector<size_t> order(t.ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<std::vector<std::string>> out;
  model::Batch b;
  for (size_t i = 0; i < order.size(); i += batch_size) {
    const size_t end = std::min(order.size(), i + static_cast<size_t>(batch_size));
    make_token_batch(t, order, i, end, T, b);
    m.forward(b, {});
    for (size_t r = i; r < end; ++r) {
      std::vector<std::string> tags(s.sentences[r].words.size(), "O");
      for (size_t w = 0; w < tags.size(); ++w) {
        const int64_t tok = t.first_token[r][w];
        if (tok < 0) continue;
        const int64_t row = m.sequence_row(static_cast<int64_t>(r - i), tok);
        if (row < 0) continue;  // past the sentence's tokens (never for a word's first token)
        const float* l = m.token_logits() + row * NL;
        tags[w] = t.label_names[std::max_element(l, l + NL) - l];
      }
      out.push_back(std::move(tags));
    }
  }
  return out;
}

void make_qa_batch(const tasks::QaFeatures& f, const std::vector<size_t>& order, size_t begin,
                   size_t end, int64_t seq_len, model::Batch& b) {
  const int64_t B = static_cast<int64_t>(end - begin);
  b.resize(B, seq_len, 0);
  for (size_t r = begin; r < end; ++r) {
    const tasks::QaFeature& x = f.features[order[r]];
    const int64_t row = static_cast<int64_t>(r - begin);
    for (size_t t = 0; t < x.ids.size(); ++t) {
      b.input_ids[row * seq_len + t] = x.ids[t];
      b.input_mask[row * seq_len + t] = 1;
      b.segment_ids[row * seq_len + t] = static_cast<int64_t>(t) >= x.context_begin;
    }
    b.span_positions[row] = x.start;
    b.span_positions[B + row] = x.end;
  }
}

std::vector<tasks::QaAnswer> predict_answers(model::BertModel& m, const tasks::QaSet& s,
                                             const tasks::QaFeatures& f, const tasks::QaOptions& o,
                                             int64_t batch_size) {
  const int64_t T = m.dims().seq_len;
  std::vector<size_t> order(f.features.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::vector<std::vector<float>> starts, ends;
  model::Batch b;
  for (size_t i = 0; i < order.size(); i += static_cast<size_t>(batch_size)) {
    const size_t end = std::min(order.size(), i + static_cast<size_t>(batch_size));
    make_qa_batch(f, order, i, end, T, b);
    m.forward(b, {});
    const float* logits = m.span_logits();  // [B,T] start, then [B,T] end
    for (int64_t r = 0; r < b.B; ++r) {
      starts.emplace_back(logits + r * T, logits + (r + 1) * T);
      ends.emplace_back(logits + (b.B + r) * T, logits + (b.B + r + 1) * T);
    }
  }
  return tasks::best_answers(s, f, starts, ends, o);
}

}  // namespace bertrain::train
