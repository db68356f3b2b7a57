// Reading text corpora as documents of sentences, streaming: BERT's format (a sentence per
// line, a blank line between documents) or prose (paragraphs of wrapped lines, split into
// sentences here; a file is a document, cut every max_doc_sentences sentences). Invalid UTF-8 is
// replaced with U+FFFD and counted; CRLF line endings are accepted.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace bertrain::prep {

enum class CorpusFormat { Auto, Bert, Prose };
CorpusFormat parse_corpus_format(const std::string& s);  // "auto" | "bert" | "prose"
const char* corpus_format_name(CorpusFormat f);

// Splits prose into sentences: after . ! ? (and closing quotes/brackets) when a capital, digit
// or opening quote follows, except after common abbreviations and initials; always after the
// CJK full stops 。！？.
std::vector<std::string> split_sentences(const std::string& text);

// Guesses the format from a file's first lines: many lines that end without sentence-final
// punctuation means hard-wrapped prose.
CorpusFormat detect_format(const std::string& path);

struct TextDocument {
  std::vector<std::string> sentences;
};

class CorpusReader {
 public:
  CorpusReader(std::vector<std::string> files, CorpusFormat format,
               size_t max_doc_sentences = 2000);
  ~CorpusReader();
  // Appends up to max_docs documents (or about max_bytes of text) to out; false when the
  // corpus is exhausted and nothing was added.
  bool next_block(std::vector<TextDocument>& out, size_t max_docs, size_t max_bytes);
  uint64_t bytes_read() const { return bytes_; }
  uint64_t invalid_bytes() const { return invalid_; }  // replacement characters inserted
  uint64_t total_bytes() const { return total_; }      // of all input files
  size_t files_done() const { return file_index_; }

 private:
  bool next_line(std::string& line);  // false at the end of the current file
  bool open_next_file();
  std::vector<std::string> files_;
  CorpusFormat format_;
  CorpusFormat file_format_ = CorpusFormat::Bert;
  size_t max_doc_sentences_;
  size_t file_index_ = 0;
  struct File;
  std::unique_ptr<File> file_;
  uint64_t bytes_ = 0, invalid_ = 0, total_ = 0;
};

}  // namespace bertrain::prep
