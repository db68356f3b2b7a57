#include "data/wordpiece.h"

#include <fstream>

#include "core/error.h"
#include "data/unicode.h"

namespace bertrain::data {

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

// Splits text into runs of ordinary text and special tokens (HF keeps those whole).
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
          if (i > start) visit(std::u32string_view(s).substr(start, i - start), nullptr);
          visit(std::u32string_view(), sp);
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
  if (start < s.size()) visit(std::u32string_view(s).substr(start), nullptr);
}

}  // namespace

template <typename W, typename S>
void Tokenizer::for_each_word(std::string_view text, W&& visit, S&& visit_special) const {
  // Scratch buffers live per thread: no allocation per word or per line in steady state.
  thread_local std::u32string u, t, tok, low;
  unicode::decode(text, u);
  split_special(u, [&](std::u32string_view part, const char* special) {
    if (special) {
      visit_special(vocab_.id(special));
      return;
    }
    // clean text + space around CJK ideographs
    t.clear();
    bool ascii = true;
    for (char32_t c : part) {
      if (c < 0x80) {
        if (c == 0 || (c < 0x20 && c != '\t' && c != '\n' && c != '\r') || c == 0x7f) continue;
        t.push_back(c == '\t' || c == '\n' || c == '\r' ? U' ' : c);
        continue;
      }
      ascii = false;
      if (c == 0xfffd || unicode::is_control(c)) continue;
      if (unicode::is_whitespace(c)) {
        t.push_back(' ');
      } else if (unicode::is_cjk(c)) {
        t.push_back(' ');
        t.push_back(c);
        t.push_back(' ');
      } else {
        t.push_back(c);
      }
    }
    if (!ascii && !unicode::nfc_stable(t)) t = unicode::nfc(t);
    size_t i = 0;
    while (i < t.size()) {
      while (i < t.size() && unicode::is_python_space(t[i])) ++i;
      size_t j = i;
      bool word_ascii = true;
      while (j < t.size() && !unicode::is_python_space(t[j])) word_ascii &= t[j++] < 0x80;
      if (j == i) break;
      std::u32string_view w(t.data() + i, j - i);
      i = j;
      if (lower_) {
        if (word_ascii) {
          tok.assign(w);
          for (auto& c : tok)
            if (c >= 'A' && c <= 'Z') c += 32;
        } else {
          low = unicode::nfd(unicode::lower(w));
          tok.clear();
          for (char32_t c : low)
            if (!unicode::is_mark_nonspacing(c)) tok.push_back(c);
        }
        w = tok;
      }
      size_t start = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        if (unicode::is_punctuation(w[k])) {
          if (k > start) visit(w.substr(start, k - start));
          visit(w.substr(k, 1));
          start = k + 1;
        }
      }
      if (start < w.size()) visit(w.substr(start));
    }
  });
}

std::vector<std::u32string> Tokenizer::basic(std::string_view text) const {
  std::vector<std::u32string> words;
  for_each_word(
      text, [&](std::u32string_view w) { words.emplace_back(w); },
      [&](int32_t id) {
        std::u32string w;
        for (char c : vocab_.token(id)) w.push_back(static_cast<char32_t>(c));
        words.push_back(std::move(w));
      });
  return words;
}

void Tokenizer::wordpiece(std::u32string_view word, std::vector<int32_t>& ids) const {
  if (word.size() > kMaxWordChars) {
    ids.push_back(vocab_.unk());
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
      ids.push_back(vocab_.unk());
      return;
    }
    ids.push_back(found);
    start = end;
  }
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& ids) const {
  for_each_word(
      text, [&](std::u32string_view w) { wordpiece(w, ids); },
      [&](int32_t id) { ids.push_back(id); });
}

std::vector<std::string> Tokenizer::tokenize(std::string_view text) const {
  std::vector<int32_t> ids;
  encode(text, ids);
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(vocab_.token(id));
  return out;
}

}  // namespace bertrain::data
