#include "prep/prepare.h"

#include <omp.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "core/error.h"
#include "core/setting.h"
#include "data/pipeline.h"
#include "data/storage.h"

namespace bertrain::prep {

PrepareReport prepare(const PrepareConfig& cfg,
                      const std::function<void(const PrepareProgress&)>& progress) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const InstanceOptions& io = cfg.instance;
  if (io.seq_len < 8) fail(setting("seq_len"), " must be at least 8");
  if (io.max_predictions < 1 || io.max_predictions > io.seq_len)
    fail(setting("max_predictions"), " must be in [1, ", setting("seq_len"), "]");
  if (!(io.masked_lm_prob > 0 && io.masked_lm_prob < 1))
    fail(setting("masked_lm_prob"), " must be in (0, 1)");
  if (!(io.short_seq_prob >= 0 && io.short_seq_prob <= 1))
    fail(setting("short_seq_prob"), " must be in [0, 1]");
  if (cfg.dupe_factor < 1) fail(setting("dupe_factor"), " must be at least 1");
  if (cfg.output_shards < 1) fail(setting("output_shards"), " must be at least 1");

  const std::vector<std::string> files = data::list_files(cfg.input);
  const Vocab vocab = Vocab::load(cfg.vocab);
  PrepareReport rep;
  rep.files = files.size();
  rep.lower_case = cfg.lower_case < 0 ? vocab.looks_uncased() : cfg.lower_case != 0;
  const Tokenizer tok(vocab, rep.lower_case);

  std::error_code ec;
  if (!data::is_remote(cfg.output)) std::filesystem::create_directories(cfg.output, ec);
  if (ec) fail("cannot create output directory ", cfg.output, ": ", ec.message());
  const char* ext = cfg.compression == data::Compression::Gzip   ? ".tfrecord.gz"
                    : cfg.compression == data::Compression::Zlib ? ".tfrecord.zlib"
                                                                 : ".tfrecord";
  std::vector<std::unique_ptr<data::TFRecordWriter>> writers;
  for (int s = 0; s < cfg.output_shards; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "part-%05d-of-%05d%s", s, cfg.output_shards, ext);
    // A folder or a bucket prefix (s3://bucket/prepared): the shards are staged and uploaded.
    rep.outputs.push_back(cfg.output + (cfg.output.ends_with('/') ? "" : "/") + name);
    writers.push_back(std::make_unique<data::TFRecordWriter>(rep.outputs.back(), cfg.compression));
  }

  CorpusReader reader(files, cfg.format, cfg.max_doc_sentences);
  rep.totals.bytes_total = reader.total_bytes();
  std::vector<TextDocument> text;
  uint64_t written = 0;
  for (uint64_t block = 0;; ++block) {
    text.clear();
    if (!reader.next_block(text, cfg.block_docs, cfg.block_bytes)) break;
    ++rep.blocks;

    // 1. Tokenize every sentence of the block in parallel.
    std::vector<std::pair<size_t, size_t>> where;  // (document, sentence)
    for (size_t d = 0; d < text.size(); ++d)
      for (size_t s = 0; s < text[d].sentences.size(); ++s) where.push_back({d, s});
    std::vector<std::vector<int32_t>> ids(where.size());
#pragma omp parallel for schedule(dynamic, 64)
    for (size_t k = 0; k < where.size(); ++k)
      tok.encode(text[where[k].first].sentences[where[k].second], ids[k]);
    std::vector<Document> docs;
    size_t k = 0;
    for (size_t d = 0; d < text.size(); ++d) {
      Document doc;
      for (size_t s = 0; s < text[d].sentences.size(); ++s, ++k) {
        rep.totals.tokens += ids[k].size();
        if (!ids[k].empty()) doc.sentences.push_back(std::move(ids[k]));
      }
      rep.sentences += doc.sentences.size();
      if (!doc.sentences.empty()) docs.push_back(std::move(doc));
    }
    rep.totals.documents += docs.size();
    Rng(rng_key(cfg.seed, block, 0xd0c5)).shuffle(docs);

    // 2. Instances: dupe_factor passes over the documents, a stream of randomness per
    // document; each instance is encoded as soon as it is made.
    std::vector<std::vector<std::string>> per_doc(docs.size());
    std::vector<std::string> encoded;
    for (int dupe = 0; dupe < cfg.dupe_factor; ++dupe) {
      const int nt = omp_get_max_threads();
      std::vector<InstanceStats> st(nt);
#pragma omp parallel
      {
        std::vector<Instance> made;
#pragma omp for schedule(dynamic, 16)
        for (size_t d = 0; d < docs.size(); ++d) {
          made.clear();
          Rng rng(rng_key(cfg.seed, block, static_cast<uint64_t>(dupe) + 1, d));
          create_instances_from_document(docs, d, io, vocab, rng, made, st[omp_get_thread_num()]);
          per_doc[d].clear();
          for (const auto& inst : made) per_doc[d].push_back(encode_instance(inst, io));
        }
      }
      for (auto& s : st) rep.stats.add(s);
      for (auto& v : per_doc)
        for (auto& e : v) encoded.push_back(std::move(e));
    }
    Rng(rng_key(cfg.seed, block, 0x1257)).shuffle(encoded);

    // 3. Write round-robin to the shards (in order: deterministic).
    for (auto& e : encoded) writers[written++ % writers.size()]->write(e);

    rep.totals.examples = written;
    rep.totals.bytes_done = reader.bytes_read();
    rep.totals.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (progress) progress(rep.totals);
  }
  for (auto& w : writers) w->close();
  rep.invalid_bytes = reader.invalid_bytes();
  rep.totals.bytes_done = reader.bytes_read();
  rep.totals.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (written == 0)
    fail("no training examples could be made from ", cfg.input,
         " (every document needs at least two non-empty segments; check ", setting("format"), ")");
  return rep;
}

}  // namespace bertrain::prep
