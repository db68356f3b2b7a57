#include "prep/wordpiece.h"

#include <fstream>

#include "core/error.h"
#include "prep/unicode.h"

namespace bertrain::prep {

namespace {
constexpr size_t kMaxWordChars = 100;
const char* const kSpecial[] = {"[CLS]", "[SEP]", "[MASK]", "[UNK]", "[PAD]"};
}  // namespace

Vocab Vocab::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open vocabulary ", path);
  Vocab v;
  std::string line;
  while (std::getline(in, line)) {  // as HF: only the "\n" is stripped
    const int32_t id = static_cast<int32_t>(v.tokens_.size());
    v.ids_[line] = id;  // a repeated token maps to its last line, as HF's dict does
    v.tokens_.push_back(line);
  }
  if (v.tokens_.empty()) fail("vocabulary ", path, " is empty");
  auto need = [&](const char* tok, int32_t& out) {
    out = v.id(tok);
    if (out < 0)
      fail("vocabulary ", path, " has no ", tok,
           " token (a BERT vocabulary needs [CLS], [SEP], "
           "[MASK], [UNK] and [PAD], one token per line)");
  };
  need("[CLS]", v.cls_);
  need("[SEP]", v.sep_);
  need("[MASK]", v.mask_);
  need("[UNK]", v.unk_);
  need("[PAD]", v.pad_);
  for (const auto& t : v.tokens_) {
    if (!t.empty() && (t.front() == '[' || t.front() == '<')) continue;  // [unused0], <S>
    for (char c : t)
      if (c >= 'A' && c <= 'Z') {
        v.uncased_ = false;
        break;
      }
    if (!v.uncased_) break;
  }
  return v;
}

int32_t Vocab::id(std::string_view token) const {
  auto it = ids_.find(token);
  return it == ids_.end() ? -1 : it->second;
}

Tokenizer::Tokenizer(const Vocab& vocab, bool lower_case) : vocab_(vocab), lower_(lower_case) {}

namespace {

// Splits text into runs of ordinary text and special tokens (HF keeps those whole): visit(run,
// nullptr, where) or visit({}, token, where), `where` the run's or token's first character.
template <typename F>
void split_special(const std::u32string& s, F&& visit) {
  size_t start = 0, i = 0;
  while (i < s.size()) {
    if (s[i] == '[') {
      bool matched = false;
      for (const char* sp : kSpecial) {
        const size_t n = std::char_traits<char>::length(sp);
        if (i + n > s.size()) continue;
        bool eq = true;
        for (size_t k = 0; k < n && eq; ++k) eq = s[i + k] == static_cast<char32_t>(sp[k]);
        if (eq) {
          if (i > start) visit(std::u32string_view(s).substr(start, i - start), nullptr, start);
          visit(std::u32string_view(), sp, i);
          i += n;
          start = i;
          matched = true;
          break;
        }
      }
      if (matched) continue;
    }
    ++i;
  }
  if (start < s.size()) visit(std::u32string_view(s).substr(start), nullptr, start);
}

std::u32string lower_strip_accents(std::u32string_view w) {
  const std::u32string low = unicode::nfd(unicode::lower(w));
  std::u32string out;
  for (char32_t c : low)
    if (!unicode::is_mark_nonspacing(c)) out.push_back(c);
  return out;
}

// Applies f (NFC; lower-case and strip accents) to a word and keeps each output character's
// source: f on each cluster (a character and the non-spacing marks after it) gets the cluster's
// characters. Where that differs from f on the whole word (a composition across clusters, rare)
// the whole word's characters are every output character's source. The text is always f(word).
template <typename F>
void apply_aligned(std::u32string& word, std::vector<CharSpan>& src, F&& f) {
  std::u32string whole = f(word), out;
  std::vector<CharSpan> out_src;
  for (size_t i = 0; i < word.size();) {
    size_t j = i + 1;
    while (j < word.size() && unicode::is_mark_nonspacing(word[j])) ++j;
    const std::u32string piece = f(std::u32string_view(word).substr(i, j - i));
    out += piece;
    out_src.insert(out_src.end(), piece.size(), CharSpan{src[i].begin, src[j - 1].end});
    i = j;
  }
  if (out != whole) out_src.assign(whole.size(), CharSpan{src.front().begin, src.back().end});
  word = std::move(whole);
  src = std::move(out_src);
}

}  // namespace

template <bool Offsets, typename W, typename S>
void Tokenizer::for_each_word(std::string_view text, W&& visit, S&& visit_special) const {
  // Scratch buffers live per thread: no allocation per word or per line in steady state.
  thread_local std::u32string u, t, tok;
  thread_local std::vector<CharSpan> ts, word_src, hf_src;  // Offsets: characters' sources
  unicode::decode(text, u);
  split_special(u, [&](std::u32string_view part, const char* special, size_t where) {
    const auto at = static_cast<int32_t>(where);
    if (special) {
      visit_special(
          vocab_.id(special),
          CharSpan{at, at + static_cast<int32_t>(std::char_traits<char>::length(special))});
      return;
    }
    // clean text + space around CJK ideographs
    t.clear();
    if constexpr (Offsets) ts.clear();
    auto put = [&](char32_t c, size_t k) {
      t.push_back(c);
      if constexpr (Offsets)
        ts.push_back({at + static_cast<int32_t>(k), at + static_cast<int32_t>(k) + 1});
    };
    bool ascii = true;
    for (size_t k = 0; k < part.size(); ++k) {
      const char32_t c = part[k];
      if (c < 0x80) {
        if (c == 0 || (c < 0x20 && c != '\t' && c != '\n' && c != '\r') || c == 0x7f) continue;
        put(c == '\t' || c == '\n' || c == '\r' ? U' ' : c, k);
        continue;
      }
      ascii = false;
      if (c == 0xfffd || unicode::is_control(c)) continue;
      if (unicode::is_whitespace(c)) {
        put(' ', k);
      } else if (unicode::is_cjk(c)) {
        put(' ', k);
        put(c, k);
        put(' ', k);
      } else {
        put(c, k);
      }
    }
    // NFC never joins across whitespace, so with offsets it is applied word by word (below).
    const bool nfc = !ascii && !unicode::nfc_stable(t);
    if (nfc && !Offsets) t = unicode::nfc(t);
    size_t i = 0;
    while (i < t.size()) {
      while (i < t.size() && unicode::is_python_space(t[i])) ++i;
      size_t j = i;
      bool word_ascii = true;
      while (j < t.size() && !unicode::is_python_space(t[j])) word_ascii &= t[j++] < 0x80;
      if (j == i) break;
      std::u32string_view w(t.data() + i, j - i);
      const CharSpan* src = nullptr;
      if constexpr (Offsets) {
        word_src.assign(ts.begin() + i, ts.begin() + j);
        if (nfc || (lower_ && !word_ascii)) {
          // HuggingFace's fast tokenizer transforms each character alone (lower-case, NFD and
          // strip accents for uncased vocabularies; no NFC): its alignment is used when it gives
          // the text the words are made of (always, but for NFC compositions in cased text).
          std::u32string want(w);
          if (nfc) want = unicode::nfc(want);
          if (lower_ && !word_ascii) want = lower_strip_accents(want);
          tok.clear();
          hf_src.clear();
          for (size_t k = 0; k < w.size(); ++k) {
            const std::u32string piece = lower_ && !word_ascii ? lower_strip_accents(w.substr(k, 1))
                                                               : std::u32string(1, w[k]);
            tok += piece;
            hf_src.insert(hf_src.end(), piece.size(), word_src[k]);
          }
          if (tok == want) {
            word_src.swap(hf_src);
          } else {
            tok.assign(w);
            if (nfc)
              apply_aligned(tok, word_src, [](std::u32string_view s) { return unicode::nfc(s); });
            if (lower_ && !word_ascii) apply_aligned(tok, word_src, lower_strip_accents);
          }
          w = tok;
        }
        src = word_src.data();
      }
      i = j;
      if (lower_) {
        if (word_ascii) {
          tok.assign(w);
          for (auto& c : tok)
            if (c >= 'A' && c <= 'Z') c += 32;
          w = tok;
        } else if (!Offsets) {
          tok = lower_strip_accents(w);
          w = tok;
        }
      }
      auto emit = [&](size_t from, size_t n) {
        visit(w.substr(from, n), src ? src + from : nullptr);
      };
      size_t start = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        if (unicode::is_punctuation(w[k])) {
          if (k > start) emit(start, k - start);
          emit(k, 1);
          start = k + 1;
        }
      }
      if (start < w.size()) emit(start, w.size() - start);
    }
  });
}

std::vector<std::u32string> Tokenizer::basic(std::string_view text) const {
  std::vector<std::u32string> words;
  for_each_word<false>(
      text, [&](std::u32string_view w, const CharSpan*) { words.emplace_back(w); },
      [&](int32_t id, CharSpan) {
        std::u32string w;
        for (char c : vocab_.token(id)) w.push_back(static_cast<char32_t>(c));
        words.push_back(std::move(w));
      });
  return words;
}

void Tokenizer::wordpiece(std::u32string_view word, std::vector<int32_t>& ids,
                          std::vector<std::pair<size_t, size_t>>* pieces) const {
  const size_t piece_mark = pieces ? pieces->size() : 0;
  auto unknown = [&] {
    ids.push_back(vocab_.unk());
    if (pieces) {
      pieces->resize(piece_mark);
      pieces->push_back({0, word.size()});
    }
  };
  if (word.size() > kMaxWordChars) {
    unknown();
    return;
  }
  // UTF-8 of the word and the byte offset of each code point: a first piece is a view of it,
  // a continuation is "##" + view, built in a scratch string.
  thread_local std::string utf8, cont;
  thread_local std::vector<size_t> off;
  utf8.clear();
  off.clear();
  for (char32_t c : word) {
    off.push_back(utf8.size());
    unicode::append_utf8(c, utf8);
  }
  off.push_back(utf8.size());
  const std::string_view all(utf8);
  const size_t mark = ids.size();
  size_t start = 0;
  while (start < word.size()) {
    size_t end = word.size();
    int32_t found = -1;
    while (start < end) {
      const std::string_view piece = all.substr(off[start], off[end] - off[start]);
      if (start == 0) {
        found = vocab_.id(piece);
      } else {
        cont.assign("##");
        cont.append(piece);
        found = vocab_.id(cont);
      }
      if (found >= 0) break;
      --end;
    }
    if (found < 0) {
      ids.resize(mark);
      unknown();
      return;
    }
    ids.push_back(found);
    if (pieces) pieces->push_back({start, end});
    start = end;
  }
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& ids) const {
  for_each_word<false>(
      text, [&](std::u32string_view w, const CharSpan*) { wordpiece(w, ids); },
      [&](int32_t id, CharSpan) { ids.push_back(id); });
}

void Tokenizer::encode_with_offsets(std::string_view text, std::vector<int32_t>& ids,
                                    std::vector<CharSpan>& offsets) const {
  std::vector<std::pair<size_t, size_t>> pieces;
  for_each_word<true>(
      text,
      [&](std::u32string_view w, const CharSpan* src) {
        pieces.clear();
        wordpiece(w, ids, &pieces);
        for (const auto& [b, e] : pieces) offsets.push_back({src[b].begin, src[e - 1].end});
      },
      [&](int32_t id, CharSpan at) {
        ids.push_back(id);
        offsets.push_back(at);
      });
}

std::vector<std::string> Tokenizer::tokenize(std::string_view text) const {
  std::vector<int32_t> ids;
  encode(text, ids);
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(vocab_.token(id));
  return out;
}

}  // namespace bertrain::prep
