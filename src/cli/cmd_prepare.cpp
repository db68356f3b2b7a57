// bertrain prepare: text corpus -> BERT pretraining TFRecords (Google's format and algorithm),
// or with --task a fine-tuning file -> classification TFRecords (run_classifier.py's schema);
// bertrain tokenize: a line of text as WordPiece tokens and ids, to check a vocabulary.
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "core/arena.h"
#include "core/error.h"
#include "core/setting.h"
#include "data/pipeline.h"
#include "prep/prepare.h"
#include "prep/wordpiece.h"

namespace bertrain::cli {

namespace {

std::string eta(double s) {
  char buf[32];
  const int t = static_cast<int>(s + 0.5);
  std::snprintf(buf, sizeof buf, "%d:%02d:%02d", t / 3600, t / 60 % 60, t % 60);
  return buf;
}

int parse_lower(const std::string& s) {
  if (s == "auto") return -1;
  if (s == "true" || s == "yes" || s == "1") return 1;
  if (s == "false" || s == "no" || s == "0") return 0;
  fail("--lower-case must be auto, true or false");
}

// --task: a fine-tuning file (any format finetune reads) as classification TFRecords, so that
// large sets go through the input pipeline.
template <class Opts>
void prepare_task(const Opts& o) {
  if (data::is_remote(o.cfg.output))
    fail("prepare ", setting("task"), " writes to a local folder (with its labels.txt); ",
         o.cfg.output, " is in object storage: write locally, then copy the folder");
  const std::vector<std::string> files = data::list_files(o.cfg.input);
  if (files.size() != 1)
    fail("prepare ", setting("task"), " reads one task file; ", o.cfg.input, " names ",
         files.size());
  const prep::Vocab vocab = prep::Vocab::load(o.cfg.vocab);
  const int l = parse_lower(o.lower);
  const bool lower = l < 0 ? vocab.looks_uncased() : l != 0;
  const prep::Tokenizer tok(vocab, lower);
  const tasks::TaskColumns columns = o.task.columns();
  if (columns.tokens || !columns.qa.empty())
    fail("prepare ", setting("task"), " writes classification TFRecords; ", o.task.task,
         " is fine-tuned from its own files (finetune --task ", o.task.task, " --train FILE)");
  const tasks::LabeledSet s =
      tasks::read_task_file(files[0], columns, tok, o.cfg.instance.seq_len, {});
  if (s.skipped) std::fprintf(stderr, "prepare: %s\n", s.skipped_summary(files[0]).c_str());
  const auto paths = tasks::write_classification_tfrecords(
      s, o.cfg.instance.seq_len, o.cfg.output, o.cfg.output_shards,
      data::resolve_compression(o.compression, ""));
  if (s.regression) {
    std::printf(
        "prepare: %zu examples of %s -> %zu file(s) in %s (regression TFRecords: "
        "run_classifier.py's schema with a float label_ids, as ALBERT writes sts-b; seq %lld, "
        "lower-case %s)\n",
        s.ids.size(), files[0].c_str(), paths.size(), o.cfg.output.c_str(),
        (long long)o.cfg.instance.seq_len, lower ? "yes" : "no");
    return;
  }
  std::string names;
  for (const auto& n : s.label_names) names += (names.empty() ? "" : ", ") + n;
  std::printf(
      "prepare: %zu examples of %s -> %zu file(s) in %s (classification TFRecords, "
      "run_classifier.py's schema; seq %lld, lower-case %s)\n  %zu labels: %s (in %s/labels.txt)\n",
      s.ids.size(), files[0].c_str(), paths.size(), o.cfg.output.c_str(),
      (long long)o.cfg.instance.seq_len, lower ? "yes" : "no", s.label_names.size(), names.c_str(),
      o.cfg.output.c_str());
}

}  // namespace

void add_prepare(CLI::App& app) {
  struct Opts {
    prep::PrepareConfig cfg;
    std::string format = "auto", compression = "none", lower = "auto";
    int threads = 0;
    double block_mb = 32;
    TaskOpts task;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "prepare",
      "Make BERT pretraining TFRecords from text (Google's create_pretraining_data.py format), "
      "or with --task classification TFRecords from a fine-tuning file");
  c->add_option("--input", o->cfg.input,
                "Text files: glob(s), comma-separated; s3:// and oss:// too")
      ->required();
  c->add_option("--vocab", o->cfg.vocab, "WordPiece vocabulary (one token per line)")->required();
  c->add_option("--output", o->cfg.output,
                "Output directory (or s3:// / oss:// prefix) for part-NNNNN-of-NNNNN.tfrecord")
      ->required();
  c->add_option("--seq-len", o->cfg.instance.seq_len, "Tokens per example ([CLS] A [SEP] B [SEP])")
      ->capture_default_str();
  c->add_option("--max-predictions", o->cfg.instance.max_predictions,
                "Masked LM predictions per example")
      ->capture_default_str();
  c->add_option("--masked-lm-prob", o->cfg.instance.masked_lm_prob, "Fraction of tokens to mask")
      ->capture_default_str();
  c->add_option("--short-seq-prob", o->cfg.instance.short_seq_prob,
                "Probability of a shorter target length")
      ->capture_default_str();
  c->add_flag("--whole-word-mask", o->cfg.instance.whole_word_mask,
              "Mask all pieces of a word together");
  c->add_option("--dupe-factor", o->cfg.dupe_factor, "Passes over the data with different masks")
      ->capture_default_str();
  c->add_option("--seed", o->cfg.seed, "Random seed")->capture_default_str();
  c->add_option("--lower-case", o->lower, "auto (from the vocabulary), true or false")
      ->capture_default_str();
  c->add_option(
       "--format", o->format,
       "Input format: auto, bert (sentence per line, blank line between documents) or prose")
      ->capture_default_str();
  c->add_option("--output-shards", o->cfg.output_shards, "Number of output files")
      ->capture_default_str();
  c->add_option("--compression", o->compression, "none, gzip or zlib")->capture_default_str();
  c->add_option("--block-mb", o->block_mb,
                "Text per block (memory bound; NSP samples within a block)")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "Threads (0: all cores)")->capture_default_str();
  add_task_options(c, o->task);
  add_storage_options(c);
  c->callback([o] {
    set_threads(o->threads);
    if (!o->task.columns().empty() || !o->task.task.empty()) return prepare_task(*o);
    prep::PrepareConfig cfg = o->cfg;
    cfg.format = prep::parse_corpus_format(o->format);
    cfg.compression = data::resolve_compression(o->compression, "");
    cfg.lower_case = parse_lower(o->lower);
    cfg.block_bytes = static_cast<size_t>(o->block_mb * (1 << 20));
    std::fprintf(stderr,
                 "prepare: input %s, vocab %s, format %s, seq %lld, predictions %lld, mask %.2f%s, "
                 "dupe %d, seed %llu, %d shards (%s)\n",
                 cfg.input.c_str(), cfg.vocab.c_str(), prep::corpus_format_name(cfg.format),
                 (long long)cfg.instance.seq_len, (long long)cfg.instance.max_predictions,
                 cfg.instance.masked_lm_prob, cfg.instance.whole_word_mask ? " whole-word" : "",
                 cfg.dupe_factor, (unsigned long long)cfg.seed, cfg.output_shards,
                 data::compression_name(cfg.compression));
    const bool tty = isatty(2);
    auto report = [tty](const prep::PrepareProgress& p) {
      const double frac = p.bytes_total ? static_cast<double>(p.bytes_done) / p.bytes_total : 1;
      std::fprintf(
          stderr,
          "%sprepare: %5.1f%% of %s | %llu docs, %.2fM tokens, %llu examples | %.0f docs/s, "
          "%.1f MB/s | ETA %s%s",
          tty ? "\r" : "", 100 * frac, human_bytes(static_cast<double>(p.bytes_total)).c_str(),
          (unsigned long long)p.documents, p.tokens / 1e6, (unsigned long long)p.examples,
          p.documents / std::max(p.seconds, 1e-9), p.bytes_done / 1e6 / std::max(p.seconds, 1e-9),
          eta(frac > 0 ? p.seconds * (1 - frac) / frac : 0).c_str(), tty ? "" : "\n");
    };
    prep::PrepareReport r = prep::prepare(cfg, report);
    if (tty) std::fprintf(stderr, "\n");
    const auto& s = r.stats;
    const double masked = static_cast<double>(s.masked);
    std::printf("prepare: wrote %llu examples to %zu file(s) in %s (%.1f s, %.0f docs/s)\n",
                (unsigned long long)r.totals.examples, r.outputs.size(), cfg.output.c_str(),
                r.totals.seconds, r.totals.documents / std::max(r.totals.seconds, 1e-9));
    std::printf(
        "  input      %llu files, %s, %llu documents, %llu sentences, %.2fM word pieces, "
        "lower-case %s\n",
        (unsigned long long)r.files, human_bytes(static_cast<double>(r.totals.bytes_done)).c_str(),
        (unsigned long long)r.totals.documents, (unsigned long long)r.sentences,
        r.totals.tokens / 1e6, r.lower_case ? "yes" : "no");
    std::printf(
        "  masked     %.2f%% of tokens (%.1f per example); %.1f%% [MASK], %.1f%% random, %.1f%% "
        "kept\n",
        100 * masked / std::max<double>(s.tokens, 1), masked / std::max<double>(s.instances, 1),
        100 * s.as_mask / std::max(masked, 1.0), 100 * s.as_random / std::max(masked, 1.0),
        100 * s.as_kept / std::max(masked, 1.0));
    std::printf(
        "  pairs      %.1f%% random next segment; %.1f%% truncated; mean length %.1f tokens\n",
        100.0 * s.random_next / std::max<double>(s.instances, 1),
        100.0 * s.truncated / std::max<double>(s.instances, 1),
        static_cast<double>(s.tokens) / std::max<double>(s.instances, 1));
    std::printf("  invalid    %llu invalid UTF-8 sequences replaced\n",
                (unsigned long long)r.invalid_bytes);
  });
}

void add_tokenize(CLI::App& app) {
  struct Opts {
    std::string vocab, lower = "auto";
    std::vector<std::string> text;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "tokenize", "Show the WordPiece tokens and ids of text (arguments, or stdin lines)");
  c->add_option("--vocab", o->vocab, "WordPiece vocabulary")->required();
  c->add_option("--lower-case", o->lower, "auto, true or false")->capture_default_str();
  c->add_option("text", o->text, "Text to tokenize (default: each line of stdin)");
  c->callback([o] {
    const prep::Vocab vocab = prep::Vocab::load(o->vocab);
    const int l = parse_lower(o->lower);
    const prep::Tokenizer tok(vocab, l < 0 ? vocab.looks_uncased() : l != 0);
    auto show = [&](const std::string& line) {
      std::vector<int32_t> ids;
      tok.encode(line, ids);
      std::string toks, nums;
      for (int32_t id : ids) {
        toks += (toks.empty() ? "" : " ") + vocab.token(id);
        nums += (nums.empty() ? "" : " ") + std::to_string(id);
      }
      std::printf("tokens: %s\nids:    %s\n", toks.c_str(), nums.c_str());
    };
    if (!o->text.empty()) {
      std::string joined;
      for (const auto& t : o->text) joined += (joined.empty() ? "" : " ") + t;
      show(joined);
    } else {
      std::string line;
      while (std::getline(std::cin, line)) show(line);
    }
  });
}

}  // namespace bertrain::cli
