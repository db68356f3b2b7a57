// A fine-tuning task's sets as model batches, and what a model predicts over them: the labels
// of a classification set (and its accuracy), a regression set's values (and their Pearson,
// Spearman and MSE against the targets), a tagged set's tags, a QA set's answers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/batch.h"
#include "model/bert.h"
#include "tasks/ner.h"
#include "tasks/qa.h"
#include "tasks/task_files.h"

namespace bertrain::train {

// Rows [begin, end) of the set (in `order`) as a padded batch.
void make_batch(const tasks::LabeledSet& s, const std::vector<size_t>& order, size_t begin,
                size_t end, int64_t seq_len, model::Batch& b);

struct Prediction {
  int32_t label;
  std::vector<float> probs;
};
// Accuracy of the model over a set with labels; predictions optional.
double classify(model::BertModel& m, const tasks::LabeledSet& s, int64_t batch_size,
                std::vector<Prediction>* out);

struct RegressionMetrics {
  double pearson = 0, spearman = 0, mse = 0;  // NaN / 0 when the set has no targets
};
// A regression model (one output) over a set: the metrics against its targets, the predicted
// values optional.
RegressionMetrics regress(model::BertModel& m, const tasks::LabeledSet& s, int64_t batch_size,
                          std::vector<float>* out);

// Rows [begin, end) of `order` as a padded batch (token labels and weights).
void make_token_batch(const tasks::TokenSet& s, const std::vector<size_t>& order, size_t begin,
                      size_t end, int64_t seq_len, model::Batch& b);

// Each word's predicted tag: the argmax at its first token ("O" for words without a token).
std::vector<std::vector<std::string>> predict_tags(model::BertModel& m, const tasks::TaggedSet& s,
                                                   const tasks::TokenSet& t, int64_t batch_size);

// Features [begin, end) of `order` as a padded batch (span_positions from the labels).
void make_qa_batch(const tasks::QaFeatures& f, const std::vector<size_t>& order, size_t begin,
                   size_t end, int64_t seq_len, model::Batch& b);

// Runs the model over the features and picks the answers.
std::vector<tasks::QaAnswer> predict_answers(model::BertModel& m, const tasks::QaSet& s,
                                             const tasks::QaFeatures& f, const tasks::QaOptions& o,
                                             int64_t batch_size);

}  // namespace bertrain::train
