#include "prep/corpus.h"

#include <sys/stat.h>

#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "core/setting.h"
#include "data/storage.h"
#include "prep/unicode.h"

namespace bertrain::prep {

CorpusFormat parse_corpus_format(const std::string& s) {
  if (s == "auto") return CorpusFormat::Auto;
  if (s == "bert") return CorpusFormat::Bert;
  if (s == "prose") return CorpusFormat::Prose;
  fail(setting("format"), " must be auto, bert or prose, got '", s, "'");
}

const char* corpus_format_name(CorpusFormat f) {
  return f == CorpusFormat::Bert ? "bert" : f == CorpusFormat::Prose ? "prose" : "auto";
}

namespace {

bool is_abbreviation(const std::string& word) {
  static const char* const kAbbrev[] = {
      "mr",  "mrs", "ms",  "dr",  "st",   "jr",     "sr",   "prof", "vs",     "etc", "e.g",
      "i.e", "mt",  "no",  "vol", "gen",  "col",    "capt", "lt",   "sgt",    "rev", "hon",
      "fig", "inc", "ltd", "co",  "corp", "approx", "dept", "est",  "messrs", "mme"};
  std::string w;
  for (char c : word) w.push_back(static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c));
  for (const char* a : kAbbrev)
    if (w == a) return true;
  // An initial: a single letter ("J. R. R. Tolkien").
  return word.size() == 1 &&
         ((word[0] >= 'A' && word[0] <= 'Z') || (word[0] >= 'a' && word[0] <= 'z'));
}

bool is_closing(char c) {
  return c == '"' || c == '\'' || c == ')' || c == ']';
}

void trim_into(std::vector<std::string>& out, const std::string& s, size_t b, size_t e) {
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  if (e > b) out.push_back(s.substr(b, e - b));
}

}  // namespace

std::vector<std::string> split_sentences(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0, i = 0;
  const size_t n = s.size();
  while (i < n) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    // CJK full stops (UTF-8: 。 E3 80 82, ！ EF BC 81, ？ EF BC 9F)
    if (c == 0xe3 && i + 2 < n && s[i + 1] == '\x80' && s[i + 2] == '\x82') {
      trim_into(out, s, start, i + 3);
      start = i = i + 3;
      continue;
    }
    if (c == 0xef && i + 2 < n && s[i + 1] == '\xbc' &&
        (s[i + 2] == '\x81' || s[i + 2] == '\x9f')) {
      trim_into(out, s, start, i + 3);
      start = i = i + 3;
      continue;
    }
    if (c == '.' || c == '!' || c == '?') {
      size_t end = i + 1;
      while (end < n && (s[end] == '.' || s[end] == '!' || s[end] == '?')) ++end;
      while (end < n && is_closing(s[end])) ++end;
      if (end < n && s[end] != ' ') {  // not followed by a space: "3.14", "e.g.x"
        i = end;
        continue;
      }
      size_t k = end;
      while (k < n && s[k] == ' ') ++k;
      if (k >= n) break;
      const char nx = s[k];
      const bool starts = (nx >= 'A' && nx <= 'Z') || (nx >= '0' && nx <= '9') || nx == '"' ||
                          nx == '\'' || nx == '(' || nx == '[' ||
                          static_cast<unsigned char>(nx) >= 0x80;
      if (c == '.') {
        size_t w = i;
        while (w > start && s[w - 1] != ' ' && s[w - 1] != '(' && s[w - 1] != '"') --w;
        if (is_abbreviation(s.substr(w, i - w))) {
          i = end;
          continue;
        }
      }
      if (starts) {
        trim_into(out, s, start, end);
        start = end;
      }
      i = end;
      continue;
    }
    ++i;
  }
  trim_into(out, s, start, n);
  return out;
}

CorpusFormat detect_format(const std::string& path) {
  std::istringstream in(data::read_prefix(path, size_t{1} << 20));  // a file or an object
  std::string line;
  int lines = 0, unterminated = 0, blank = 0;
  while (lines < 400 && std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty()) {
      ++blank;
      continue;
    }
    ++lines;
    const unsigned char last = static_cast<unsigned char>(line.back());
    const bool terminal = last == '.' || last == '!' || last == '?' || last == '"' ||
                          last == '\'' || last == ')' ||
                          last >= 0x80;  // non-ASCII: CJK punctuation and quotes
    unterminated += !terminal;
  }
  return lines > 0 && unterminated * 2 > lines ? CorpusFormat::Prose : CorpusFormat::Bert;
}

struct CorpusReader::File {
  std::unique_ptr<data::ByteSource> src;
  std::string buf;
  size_t pos = 0;
  // The next line with its '\n' (none at the end of the file) into `line`; false at the end.
  bool getline(std::string& line) {
    for (;;) {
      const size_t nl = buf.find('\n', pos);
      if (nl != std::string::npos) {
        line.append(buf, pos, nl + 1 - pos);
        pos = nl + 1;
        return true;
      }
      line.append(buf, pos, std::string::npos);
      buf.resize(1 << 20);
      buf.resize(src->read(buf.data(), buf.size()));
      pos = 0;
      if (buf.empty()) return !line.empty();
    }
  }
};

CorpusReader::CorpusReader(std::vector<std::string> files, CorpusFormat format,
                           size_t max_doc_sentences)
    : files_(std::move(files)), format_(format), max_doc_sentences_(max_doc_sentences) {
  for (const auto& f : files_) total_ += data::file_size(f);
}

CorpusReader::~CorpusReader() = default;

bool CorpusReader::open_next_file() {
  file_.reset();
  if (file_index_ >= files_.size()) return false;
  const std::string& path = files_[file_index_];
  file_ = std::make_unique<File>();
  file_->src = data::open_raw(path);
  file_format_ = format_ == CorpusFormat::Auto ? detect_format(path) : format_;
  return true;
}

bool CorpusReader::next_line(std::string& line) {
  line.clear();
  if (!file_->getline(line)) return false;
  bytes_ += line.size();
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  invalid_ += unicode::repair(line);
  return true;
}

bool CorpusReader::next_block(std::vector<TextDocument>& out, size_t max_docs, size_t max_bytes) {
  const size_t docs_before = out.size();
  size_t bytes = 0;
  std::string line, paragraph;
  TextDocument doc;
  auto finish_doc = [&] {
    if (!doc.sentences.empty()) out.push_back(std::move(doc));
    doc = TextDocument();
  };
  auto add_paragraph = [&] {
    if (paragraph.empty()) return;
    for (auto& s : split_sentences(paragraph)) {
      doc.sentences.push_back(std::move(s));
      if (doc.sentences.size() >= max_doc_sentences_) finish_doc();
    }
    paragraph.clear();
  };
  while (out.size() - docs_before < max_docs && bytes < max_bytes) {
    if (!file_ && !open_next_file()) break;
    if (!next_line(line)) {  // end of file ends the document
      add_paragraph();
      finish_doc();
      ++file_index_;
      file_.reset();
      continue;
    }
    bytes += line.size() + 1;
    bool blank = true;
    for (char c : line) blank &= (c == ' ' || c == '\t');
    if (file_format_ == CorpusFormat::Bert) {
      if (blank)
        finish_doc();
      else
        doc.sentences.push_back(line);
    } else if (blank) {
      add_paragraph();
    } else {
      if (!paragraph.empty()) paragraph.push_back(' ');
      paragraph += line;
    }
  }
  // A block that fills up by bytes inside a document ends that document here (documents
  // longer than a block are cut; blocks are tens of MB, documents rarely are).
  if (file_ && (!doc.sentences.empty() || !paragraph.empty())) {
    add_paragraph();
    finish_doc();
  }
  return out.size() > docs_before;
}

}  // namespace bertrain::prep
