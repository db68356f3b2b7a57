// `bertrain prepare`: text corpus -> Google-BERT pretraining TFRecords, streaming in blocks.
// Memory is bounded by the block (block_bytes of text, its tokens and dupe_factor copies of its
// instances), never by the corpus: NSP's random next segments come from the same block (tens
// of thousands of documents by default), the one departure from Google's script, which holds
// the whole corpus in memory. Tokenization, instance creation and encoding run on all cores;
// the output does not depend on the number of threads.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "data/tfrecord.h"
#include "prep/corpus.h"
#include "prep/pretraining.h"

namespace bertrain::prep {

struct PrepareConfig {
  std::string input;  // glob(s), comma-separated
  std::string vocab;
  std::string output;   // directory
  int lower_case = -1;  // -1: from the vocabulary (uncased when no token has capitals)
  CorpusFormat format = CorpusFormat::Auto;
  InstanceOptions instance;
  int dupe_factor = 5;
  uint64_t seed = 12345;
  int output_shards = 1;
  data::Compression compression = data::Compression::None;
  size_t block_bytes = size_t{32} << 20;
  size_t block_docs = 50000;
  size_t max_doc_sentences = 2000;
};

struct PrepareProgress {
  uint64_t bytes_done = 0, bytes_total = 0, documents = 0, tokens = 0, examples = 0;
  double seconds = 0;
};

struct PrepareReport {
  PrepareProgress totals;
  uint64_t files = 0, sentences = 0, invalid_bytes = 0, blocks = 0;
  bool lower_case = true;
  InstanceStats stats;
  std::vector<std::string> outputs;
};

PrepareReport prepare(const PrepareConfig& cfg,
                      const std::function<void(const PrepareProgress&)>& progress = {});

}  // namespace bertrain::prep
