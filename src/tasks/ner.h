// Token classification data (NER): CoNLL-style column files (a word and its tag per line, tag
// last; blank lines or -DOCSTART- between sentences) and CLUENER-style JSON lines ({"text",
// "label": {TYPE: {ENTITY: [[start, end], ...]}}}, character offsets with an inclusive end; the
// characters become the words, tagged BIO). Words are aligned to WordPiece tokens as
// HuggingFace's run_ner does: the first sub-token of a word carries its tag, the others and
// [CLS]/[SEP]/padding are not scored. Entities and precision/recall/F1 as seqeval computes them
// (its default, conlleval-compatible chunking of BIO, BIOES and BMES tags; micro average).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "prep/wordpiece.h"

namespace bertrain::tasks {

struct TaggedSentence {
  std::vector<std::string> words, tags;  // tags empty when the file has none
  // The sentence as text and each word's [begin, end) in it, in characters (code points): for
  // reporting entities as spans of the original text.
  std::string text;
  std::vector<std::pair<int64_t, int64_t>> spans;
};

struct TaggedSet {
  std::vector<TaggedSentence> sentences;
  // Sentences that cannot be used (a span outside the text or naming other characters,
  // overlapping entities, a line without a tag), counted with the first reasons (file:line).
  int64_t skipped = 0;
  std::vector<std::string> skipped_reasons;
  std::string skipped_summary(const std::string& file) const;
};

// By extension: .json/.jsonl CLUENER-style, anything else CoNLL-style.
TaggedSet read_tagged_file(const std::string& path);

struct Entity {
  std::string type;
  int64_t begin = 0, end = 0;  // words [begin, end]
  bool operator==(const Entity&) const = default;
  auto operator<=>(const Entity&) const = default;
};
// seqeval's get_entities on one sentence's tags.
std::vector<Entity> tag_entities(const std::vector<std::string>& tags);

struct EntityScores {
  double precision = 0, recall = 0, f1 = 0;
  int64_t gold = 0, predicted = 0, correct = 0;
};
// Micro-averaged over all sentences, as seqeval's precision_score/recall_score/f1_score.
EntityScores entity_scores(const std::vector<std::vector<std::string>>& gold,
                           const std::vector<std::vector<std::string>>& predicted);

// Sentences as model input: [CLS] word pieces [SEP], truncated to seq_len (the words cut off
// are predicted "O" and counted).
struct TokenSet {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<int32_t>> labels;       // per token, -1 where not scored
  std::vector<std::vector<int64_t>> first_token;  // per word: its first token, -1 if none
  std::vector<std::string> label_names;
  int64_t truncated = 0;  // sentences with words past seq_len
};
// `label_names` fixes the tag order (from training data or a model); when empty it is the
// file's tags, "O" first, then sorted by entity type and tag.
TokenSet encode_tagged(const TaggedSet& s, const prep::Tokenizer& tok, int64_t seq_len,
                       std::vector<std::string> label_names);

// The entities of tagged words as spans of the sentence's text (characters, end exclusive).
struct EntitySpan {
  std::string type, text;
  int64_t start = 0, end = 0;
};
std::vector<EntitySpan> entity_spans(const TaggedSentence& s, const std::vector<std::string>& tags);

}  // namespace bertrain::tasks
