// BERT's tokenizer, token for token as HuggingFace's BertTokenizer (itself a port of Google's
// tokenization.py): BasicTokenizer (clean text, split CJK ideographs, NFC, whitespace split,
// lower-case + strip accents for uncased vocabularies, split punctuation) then WordPiece
// (greedy longest match, "##" continuations, words over 100 characters -> [UNK]).
// Special tokens ([CLS], [SEP], [MASK], [UNK], [PAD]) written in the text stay whole.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace bertrain::prep {

class Vocab {
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

 public:
  static Vocab load(const std::string& path);  // one token per line; Error names what is wrong
  int32_t id(std::string_view token) const;    // -1 if absent
  const std::string& token(int32_t id) const { return tokens_.at(id); }
  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t cls() const { return cls_; }
  int32_t sep() const { return sep_; }
  int32_t mask() const { return mask_; }
  int32_t unk() const { return unk_; }
  int32_t pad() const { return pad_; }
  // True when no ordinary token has an upper-case letter: the vocabulary is uncased.
  bool looks_uncased() const { return uncased_; }

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> ids_;  // lookup by view
  int32_t cls_ = -1, sep_ = -1, mask_ = -1, unk_ = -1, pad_ = -1;
  bool uncased_ = true;
};

// Where a token came from: characters [begin, end) of the text (code points of the UTF-8
// decoded with invalid bytes replaced, as Python's str indexes it), HF's offset_mapping.
struct CharSpan {
  int32_t begin = 0, end = 0;
  bool operator==(const CharSpan&) const = default;
};

class Tokenizer {
 public:
  Tokenizer(const Vocab& vocab, bool lower_case);
  // Appends word pieces of `text` (UTF-8, invalid bytes replaced) as ids / as strings.
  void encode(std::string_view text, std::vector<int32_t>& ids) const;
  // encode() and each token's characters in `text`, as HuggingFace's fast tokenizer reports
  // them: a word piece its own characters (accents stripped and case folded map back to the
  // character they came from), [UNK] its whole word, a special token written in the text
  // itself. Extractive QA maps predicted tokens back to answer text with them.
  void encode_with_offsets(std::string_view text, std::vector<int32_t>& ids,
                           std::vector<CharSpan>& offsets) const;
  std::vector<std::string> tokenize(std::string_view text) const;
  // Basic tokenization only (the words before WordPiece).
  std::vector<std::u32string> basic(std::string_view text) const;
  const Vocab& vocab() const { return vocab_; }
  bool lower_case() const { return lower_; }

 private:
  // Appends the word's pieces; `pieces` (optional) gets each piece's characters in the word.
  void wordpiece(std::u32string_view word, std::vector<int32_t>& ids,
                 std::vector<std::pair<size_t, size_t>>* pieces = nullptr) const;
  // Calls visit(word, spans) for each word of basic tokenization (views into scratch storage),
  // or visit_special(id, span) for a special token written in the text. With Offsets, spans[i]
  // is the text's characters word[i] came from; without, spans is null (and nothing is tracked).
  template <bool Offsets, typename W, typename S>
  void for_each_word(std::string_view text, W&& visit, S&& visit_special) const;
  const Vocab& vocab_;
  bool lower_;
};

}  // namespace bertrain::prep
