// `prepare`: Google's instance algorithm checked by its statistics on a real corpus, the output
// format decoded by bertrain's reader (and by TensorFlow: tools/check_prepared_tf.py), thread
// independence, and bad input.
#include <gtest/gtest.h>

#include <omp.h>
#include <fstream>

#include "data/example.h"
#include "data/schema.h"
#include "prep/corpus.h"
#include "prep/prepare.h"
#include "test_util.h"

namespace bertrain::prep {
namespace {
using namespace data;  // what prepare writes: TFRecords of tf.Examples

std::string root(const std::string& rel) {
  return test::data_path("../" + rel);
}

std::vector<std::string> records_of(const std::vector<std::string>& files) {
  std::vector<std::string> out;
  for (const auto& f : files) {
    TFRecordReader r(f, resolve_compression("auto", f));
    std::string rec;
    while (r.next(rec)) out.push_back(rec);
  }
  return out;
}

PrepareConfig english(const std::string& out) {
  PrepareConfig c;
  c.input = root("data/corpus/bert_sample_text.txt") + "," +
            root("data/corpus/gutenberg/chesterton-thursday.txt");
  c.vocab = root("data/vocab/bert-base-uncased-vocab.txt");
  c.output = out;
  c.dupe_factor = 3;
  c.output_shards = 3;
  return c;
}

TEST(Prepare, InstancesHaveGooglesStatistics) {
  test::TempDir tmp;
  PrepareConfig cfg = english(tmp.path.string());
  PrepareReport rep = prepare(cfg);
  auto recs = records_of(rep.outputs);
  ASSERT_EQ(recs.size(), rep.totals.examples);
  ASSERT_GT(recs.size(), 1500u);
  const Vocab vocab = Vocab::load(cfg.vocab);
  Schema schema = Schema::pretraining(128, 20, vocab.size());
  ParsedExample ex;
  std::string err;
  data::Batch b;
  schema.shape_batch(b, 1);
  uint64_t masked = 0, tokens = 0, random_next = 0, short_len = 0, as_mask = 0;
  for (const auto& r : recs) {
    ASSERT_TRUE(schema.parse(r, ex, err)) << err;
    schema.fill_row(ex, b, 0);
    int len = 0;
    while (len < 128 && b.input_mask[len]) ++len;
    for (int t = len; t < 128; ++t) ASSERT_EQ(b.input_ids[t], 0);
    ASSERT_EQ(b.input_ids[0], vocab.cls());
    ASSERT_EQ(b.input_ids[len - 1], vocab.sep());
    tokens += len;
    short_len += len < 100;
    random_next += b.next_sentence_labels[0];
    int prev = 0, n = 0;
    for (int p = 0; p < 20; ++p) {
      if (b.masked_lm_weights[p] == 0.0f) {
        ASSERT_EQ(b.masked_lm_positions[p], 0);
        continue;
      }
      const int pos = b.masked_lm_positions[p];
      ASSERT_GT(pos, prev);  // sorted, unique, never [CLS]
      ASSERT_LT(pos, len);
      ASSERT_NE(b.masked_lm_ids[p], vocab.cls());  // [CLS]/[SEP] are never masked
      ASSERT_NE(b.masked_lm_ids[p], vocab.sep());
      as_mask += b.input_ids[pos] == vocab.mask();
      prev = pos;
      ++n;
    }
    // num_to_predict = min(20, max(1, round(len * 0.15)))
    ASSERT_EQ(n, std::min<int>(20, std::max<int>(1, static_cast<int>(std::nearbyint(len * 0.15)))));
    masked += n;
  }
  const double N = static_cast<double>(recs.size());
  const double frac = masked / static_cast<double>(tokens);
  EXPECT_NEAR(frac, 0.15, 0.01);
  // 80% of masked positions show [MASK]: binomial std sqrt(0.16 / masked) ~ 0.002; 5 std.
  EXPECT_NEAR(as_mask / static_cast<double>(masked), 0.8, 5 * std::sqrt(0.16 / masked));
  EXPECT_NEAR(rep.stats.as_random / static_cast<double>(masked), 0.1, 5 * std::sqrt(0.09 / masked));
  // NSP: 50% random next (plus the forced ones for single-segment chunks): within 5 std.
  EXPECT_NEAR(random_next / N, 0.5, 5 * std::sqrt(0.25 / N) + 0.02);
  // short_seq_prob 0.1 gives a target below the maximum for ~10% of the documents' chunks.
  EXPECT_GT(short_len / N, 0.03);
  EXPECT_LT(short_len / N, 0.3);
  EXPECT_EQ(rep.stats.instances, recs.size());
}

TEST(Prepare, SameOutputWithAnyThreadCount) {
  std::vector<std::vector<std::string>> runs;
  for (int threads : {1, 2}) {
    test::TempDir tmp;
    omp_set_num_threads(threads);
    PrepareReport rep = prepare(english(tmp.path.string()));
    runs.push_back(records_of(rep.outputs));
  }
  omp_set_num_threads(1);
  EXPECT_EQ(runs[0], runs[1]);
}

TEST(Prepare, EncodedExampleIsWhatProtobufWrites) {
  Instance inst;
  inst.tokens = {101, 7, 8, 102, 9, 102};
  inst.segment_ids = {0, 0, 0, 0, 1, 1};
  inst.masked_positions = {2, 4};
  inst.masked_labels = {300, 301};
  inst.is_random_next = true;
  InstanceOptions opt;
  opt.seq_len = 8;
  opt.max_predictions = 3;
  const std::string mine = encode_instance(inst, opt);
  Example ex = decode_example(mine);
  EXPECT_EQ(ex.at("input_ids").ints, (std::vector<int64_t>{101, 7, 8, 102, 9, 102, 0, 0}));
  EXPECT_EQ(ex.at("input_mask").ints, (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 0, 0}));
  EXPECT_EQ(ex.at("masked_lm_weights").floats, (std::vector<float>{1, 1, 0}));
  EXPECT_EQ(ex.at("next_sentence_labels").ints, std::vector<int64_t>{1});
  EXPECT_EQ(encode_example(ex), mine);  // byte-identical to protobuf's deterministic output
}

TEST(Prepare, WholeWordMaskingMasksAllPiecesOfAWord) {
  test::TempDir tmp;
  PrepareConfig cfg = english(tmp.path.string());
  cfg.instance.whole_word_mask = true;
  cfg.output_shards = 1;
  PrepareReport rep = prepare(cfg);
  const Vocab vocab = Vocab::load(cfg.vocab);
  Schema schema = Schema::pretraining(128, 20, vocab.size());
  ParsedExample ex;
  std::string err;
  data::Batch b;
  schema.shape_batch(b, 1);
  size_t continuation_checked = 0;
  for (const auto& r : records_of(rep.outputs)) {
    ASSERT_TRUE(schema.parse(r, ex, err));
    schema.fill_row(ex, b, 0);
    std::vector<int> label(128, -1);
    for (int p = 0; p < 20; ++p)
      if (b.masked_lm_weights[p] > 0) label[b.masked_lm_positions[p]] = b.masked_lm_ids[p];
    for (int t = 1; t < 127; ++t) {
      // A masked "##piece" must have its preceding piece masked too (same word), unless a
      // truncation or the segment boundary cut the word ([SEP] before it), as in Google's script.
      if (label[t] >= 0 && vocab.token(label[t]).rfind("##", 0) == 0) {
        if (label[t - 1] < 0) {
          EXPECT_TRUE(b.input_ids[t - 1] == vocab.sep() || b.input_ids[t - 1] == vocab.cls())
              << "position " << t;
        }
        ++continuation_checked;
      }
    }
  }
  EXPECT_GT(continuation_checked, 10u);
}

TEST(Prepare, ProseIsSplitIntoSentencesAndBadBytesAreCounted) {
  test::TempDir tmp;
  std::ofstream(tmp / "book.txt", std::ios::binary)
      << "It was a dark night.  Mr. Smith said \"Hello!\" and left.\r\nThe end came\r\nsoon. Dr. "
         "J. "
         "Watson\r\nagreed; caf\xe9 closed.\r\n\r\nA new paragraph? Yes. 3.14 is pi.\r\n";
  CorpusReader r({tmp / "book.txt"}, CorpusFormat::Prose);
  std::vector<TextDocument> docs;
  ASSERT_TRUE(r.next_block(docs, 100, 1 << 20));
  ASSERT_EQ(docs.size(), 1u);
  const std::vector<std::string> want = {
      "It was a dark night.", "Mr. Smith said \"Hello!\" and left.",
      "The end came soon.",   "Dr. J. Watson agreed; caf\xef\xbf\xbd closed.",
      "A new paragraph?",     "Yes.",
      "3.14 is pi."};
  EXPECT_EQ(docs[0].sentences, want);
  EXPECT_EQ(r.invalid_bytes(), 1u);
  EXPECT_EQ(split_sentences("中文句子。第二句！第三句？"),
            (std::vector<std::string>{"中文句子。", "第二句！", "第三句？"}));
  EXPECT_EQ(detect_format(root("data/corpus/bert_sample_text.txt")), CorpusFormat::Bert);
  EXPECT_EQ(detect_format(root("data/corpus/gutenberg/melville-moby_dick.txt")),
            CorpusFormat::Prose);
}

TEST(Prepare, BadInputIsAClearError) {
  test::TempDir tmp;
  PrepareConfig cfg = english(tmp / "out");
  cfg.input = tmp / "nothing-*.txt";
  try {
    prepare(cfg);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no files match"), std::string::npos);
  }
  std::ofstream(tmp / "one.txt") << "just one line\n";
  cfg.input = tmp / "one.txt";
  cfg.format = CorpusFormat::Bert;
  cfg.instance.seq_len = 8;
  cfg.instance.max_predictions = 2;
  // A single one-segment document still yields an instance (B from the same document, as
  // Google's script does when no other document exists).
  EXPECT_NO_THROW(prepare(cfg));
  std::ofstream(tmp / "empty.txt") << "\n\n";
  cfg.input = tmp / "empty.txt";
  try {
    prepare(cfg);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no training examples"), std::string::npos) << e.what();
  }
  cfg.instance.max_predictions = 100;
  EXPECT_THROW(prepare(cfg), Error);
}

}  // namespace
}  // namespace bertrain::prep
