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
  auto it = ids_.find(std::string(token));
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

std::vector<std::u32string> Tokenizer::basic(std::string_view text) const {
  std::u32string u;
  unicode::decode(text, u);
  std::vector<std::u32string> words;
  split_special(u, [&](std::u32string_view part, const char* special) {
    if (special) {
      std::u32string w;
      for (const char* p = special; *p; ++p) w.push_back(static_cast<char32_t>(*p));
      words.push_back(std::move(w));
      return;
    }
    // clean text + space around CJK ideographs
    std::u32string t;
    t.reserve(part.size());
    for (char32_t c : part) {
      if (c == 0 || c == 0xfffd || unicode::is_control(c)) continue;
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
    t = unicode::nfc(t);
    size_t i = 0;
    while (i < t.size()) {
      while (i < t.size() && unicode::is_python_space(t[i])) ++i;
      size_t j = i;
      while (j < t.size() && !unicode::is_python_space(t[j])) ++j;
      if (j == i) break;
      std::u32string tok = t.substr(i, j - i);
      i = j;
      if (lower_) {
        tok = unicode::nfd(unicode::lower(tok));
        std::u32string stripped;
        for (char32_t c : tok)
          if (!unicode::is_mark_nonspacing(c)) stripped.push_back(c);
        tok.swap(stripped);
      }
      std::u32string cur;
      for (char32_t c : tok) {
        if (unicode::is_punctuation(c)) {
          if (!cur.empty()) words.push_back(std::move(cur));
          cur.clear();
          words.push_back(std::u32string(1, c));
        } else {
          cur.push_back(c);
        }
      }
      if (!cur.empty()) words.push_back(std::move(cur));
    }
  });
  return words;
}

void Tokenizer::wordpiece(const std::u32string& word, std::vector<int32_t>& ids,
                          std::string& piece) const {
  if (word.size() > kMaxWordChars) {
    ids.push_back(vocab_.unk());
    return;
  }
  // Byte offset of each code point, so substrings are slices of one UTF-8 string.
  std::string utf8;
  std::vector<size_t> off;
  off.reserve(word.size() + 1);
  for (char32_t c : word) {
    off.push_back(utf8.size());
    unicode::append_utf8(c, utf8);
  }
  off.push_back(utf8.size());
  const size_t mark = ids.size();
  size_t start = 0;
  while (start < word.size()) {
    size_t end = word.size();
    int32_t found = -1;
    while (start < end) {
      piece.assign(start > 0 ? "##" : "");
      piece.append(utf8, off[start], off[end] - off[start]);
      found = vocab_.id(piece);
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
  std::string scratch;
  for (const auto& w : basic(text)) {
    if (!w.empty() && w[0] == '[') {
      std::string s;
      unicode::encode(w, s);
      bool special = false;
      for (const char* sp : kSpecial) special |= s == sp;
      if (special) {
        ids.push_back(vocab_.id(s));
        continue;
      }
    }
    wordpiece(w, ids, scratch);
  }
}

std::vector<std::string> Tokenizer::tokenize(std::string_view text) const {
  std::vector<int32_t> ids;
  encode(text, ids);
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(vocab_.token(id));
  return out;
}

}  // namespace bertrain::data
