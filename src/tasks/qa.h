// Extractive question answering (SQuAD v1.1 and the files laid out like it: CMRC 2018, DRCD).
// Features as HuggingFace's run_qa builds them: [CLS] question [SEP] context window [SEP], the
// question cut to max_query_length tokens, the context in windows of what is left that overlap
// by doc_stride tokens (the fast tokenizer's stride), each token's characters kept (offset
// mapping); the answer's first and last token as labels, [CLS] where a window does not hold the
// whole answer. Answers as run_qa's postprocess_qa_predictions picks them (the n_best highest
// start and end logits of every window, spans of context tokens up to max_answer_length, the
// highest start + end). Exact match and F1 as the official SQuAD v1.1 evaluation computes them,
// or as CMRC 2018's official evaluation does (characters of Chinese, words of other text).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "prep/wordpiece.h"

namespace bertrain::tasks {

struct QaExample {
  std::string id, question, context;
  std::vector<std::string> answers;  // every reference answer (evaluation)
  // The first answer's characters in the context (code points, end exclusive), located for
  // training; -1 when the file's offset and text disagree and the text is not in the context.
  int64_t answer_begin = -1, answer_end = -1;
};

struct QaSet {
  std::vector<QaExample> examples;
  // Questions that cannot be used (no id or question, no answer to learn from, an answer not
  // found in its context), counted with the first reasons; `moved` counts answers whose
  // answer_start did not match their text and that were found elsewhere in the context.
  int64_t skipped = 0, moved = 0;
  std::vector<std::string> skipped_reasons;
  std::string skipped_summary(const std::string& file) const;
};

// SQuAD v1.1 JSON ({"data": [{"paragraphs": [{"context", "qas": [{"id", "question",
// "answers": [{"text", "answer_start"}]}]}]}]}; extra keys ignored). `training`: every question
// needs an answer located in its context (an answer_start that does not match its text is
// replaced by the text's occurrence nearest to it); otherwise answers are only for scoring.
QaSet read_squad(const std::string& path, bool training);

struct QaOptions {
  // doc_stride < 0: min(128, half the context room), see resolve_qa_options.
  int64_t seq_len = 384, doc_stride = -1, max_query_length = 64;
  int64_t max_answer_length = 30, n_best = 20;
  std::string metric = "squad";  // or "cmrc2018"
};
// The context room of a window and a stride that fits it: doc_stride < 0 picks
// min(128, room / 2). Fails naming the flags when the stride does not fit.
QaOptions resolve_qa_options(QaOptions o);

struct QaFeature {
  int64_t example = 0;                  // index into QaSet::examples
  std::vector<int32_t> ids;             // [CLS] question [SEP] window [SEP]
  int32_t context_begin = 0;            // position of the window's first token
  std::vector<prep::CharSpan> offsets;  // the window's tokens' characters in the context
  int32_t start = 0, end = 0;           // labels: the answer's first and last token, or 0 ([CLS])
};

struct QaFeatures {
  std::vector<QaFeature> features;
  int64_t truncated_questions = 0;  // questions cut to max_query_length
};
QaFeatures make_qa_features(const QaSet& s, const prep::Tokenizer& tok, const QaOptions& o);

struct QaAnswer {
  std::string text;
  int64_t begin = -1, end = -1;  // characters of the context (end exclusive); -1: none
  double score = 0;              // start logit + end logit
};
// One answer per example from every feature's start and end logits ([seq_len] each): no valid
// span gives an empty answer.
std::vector<QaAnswer> best_answers(const QaSet& s, const QaFeatures& f,
                                   const std::vector<std::vector<float>>& start_logits,
                                   const std::vector<std::vector<float>>& end_logits,
                                   const QaOptions& o);

struct QaScores {
  double exact_match = 0, f1 = 0;  // percent, over every question of the set
  int64_t total = 0;
};
// The official SQuAD v1.1 evaluation (lower case, ASCII punctuation and articles removed,
// whitespace words; F1 of the bag of words), the best over each question's answers.
QaScores squad_scores(const QaSet& s, const std::vector<std::string>& predictions);
// CMRC 2018's official evaluation: F1 from the longest common run of segments (each Chinese
// character and listed punctuation mark its own segment, other text split into words as NLTK's
// Treebank rules split them; punctuation removed), exact match after removing punctuation.
QaScores cmrc_scores(const QaSet& s, const std::vector<std::string>& predictions);
QaScores qa_scores(const QaSet& s, const std::vector<std::string>& predictions,
                   const std::string& metric);

}  // namespace bertrain::tasks
