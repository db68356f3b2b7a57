// NER data and metrics: CLUENER JSON lines and CoNLL column files as distributed (the first
// rows of the real files, tests/data/tasks), WordPiece alignment as HF's run_ner does it, and
// entities/precision/recall/F1 against seqeval itself (tools/make_ner_golden.py; counts, so
// exact up to the last bit of a division: 1e-12).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "tasks/ner.h"
#include "test_util.h"

namespace bertrain::tasks {
namespace {

std::string root(const std::string& rel) {
  return test::data_path("../" + rel);
}

TEST(Ner, EntitiesAndScoresEqualSeqeval) {
  std::ifstream in(test::data_path("golden/metrics/ner.json"));
  const nlohmann::json g = nlohmann::json::parse(in);
  ASSERT_EQ(g["cases"].size(), 3u);
  for (const auto& c : g["cases"]) {
    const auto gold = c["gold"].get<std::vector<std::vector<std::string>>>();
    const auto pred = c["pred"].get<std::vector<std::vector<std::string>>>();
    const std::string name = c["name"];
    for (const char* side : {"gold", "pred"}) {
      const auto& seqs = std::string(side) == "gold" ? gold : pred;
      const auto& ents = c[std::string(side) + "_entities"];
      for (size_t i = 0; i < seqs.size(); ++i) {
        std::vector<Entity> ref;
        for (const auto& e : ents[i]) ref.push_back({e[0], e[1], e[2]});
        EXPECT_EQ(tag_entities(seqs[i]), ref) << name << " " << side << " sentence " << i;
      }
    }
    const EntityScores s = entity_scores(gold, pred);
    EXPECT_NEAR(s.precision, c["precision"].get<double>(), 1e-12) << name;
    EXPECT_NEAR(s.recall, c["recall"].get<double>(), 1e-12) << name;
    EXPECT_NEAR(s.f1, c["f1"].get<double>(), 1e-12) << name;
  }
}

TEST(Ner, ReadsCluenerSpansAsBioTags) {
  const TaggedSet s = read_tagged_file(test::data_path("data/tasks/cluener_dev_head200.json"));
  ASSERT_EQ(s.sentences.size(), 200u);
  EXPECT_EQ(s.skipped, 0);
  // {"text": "彭小军认为，国内银行...台湾...", "label": {"address": {"台湾": [[15, 16]]},
  //  "name": {"彭小军": [[0, 2]]}}}
  const TaggedSentence& t = s.sentences[0];
  EXPECT_EQ(t.words[0], "彭");
  EXPECT_EQ(t.tags[0], "B-name");
  EXPECT_EQ(t.tags[2], "I-name");
  EXPECT_EQ(t.tags[3], "O");
  EXPECT_EQ(t.tags[15], "B-address");
  EXPECT_EQ(t.tags[16], "I-address");
  EXPECT_EQ(t.spans[15], (std::pair<int64_t, int64_t>{15, 16}));
  // A span that names other characters, one outside the text, overlapping entities: skipped and
  // counted with file:line, the rest kept.
  test::TempDir tmp;
  std::ofstream(tmp / "bad.json")
      << R"({"text": "abcd", "label": {"x": {"bc": [[1, 2]]}}})"
      << "\n"
      << R"({"text": "abcd", "label": {"x": {"cd": [[1, 2]]}}})"
      << "\n"
      << R"({"text": "abcd", "label": {"x": {"d": [[3, 4]]}}})"
      << "\n"
      << R"({"text": "abcd", "label": {"x": {"bc": [[1, 2]]}, "y": {"cd": [[2, 3]]}}})"
      << "\n";
  const TaggedSet b = read_tagged_file(tmp / "bad.json");
  EXPECT_EQ(b.sentences.size(), 1u);
  EXPECT_EQ(b.skipped, 3);
  const std::string why = b.skipped_summary("bad.json");
  EXPECT_NE(why.find("bad.json:2: span [1, 2] covers 'bc', not 'cd'"), std::string::npos) << why;
  EXPECT_NE(why.find("bad.json:3: span [3, 4] of 'd' is outside the text"), std::string::npos)
      << why;
  EXPECT_NE(why.find("bad.json:4: entities overlap"), std::string::npos) << why;
}

TEST(Ner, ReadsConllSentencesAndAlignsFirstSubTokens) {
  const TaggedSet s = read_tagged_file(test::data_path("data/tasks/conll2003_valid_head2000.txt"));
  ASSERT_EQ(s.sentences.size(), 128u);       // as seqeval's reading in the golden tool
  const TaggedSentence& t = s.sentences[0];  // CRICKET - LEICESTERSHIRE TAKE OVER AT TOP ...
  EXPECT_EQ(t.words[2], "LEICESTERSHIRE");
  EXPECT_EQ(t.tags[2], "B-ORG");
  EXPECT_EQ(t.text.substr(0, 24), "CRICKET - LEICESTERSHIRE");
  EXPECT_EQ(t.spans[2], (std::pair<int64_t, int64_t>{10, 24}));
  prep::Vocab v = prep::Vocab::load(root("data/vocab/bert-base-uncased-vocab.txt"));
  prep::Tokenizer tok(v, true);
  const TokenSet e = encode_tagged(s, tok, 128, {});
  EXPECT_EQ(e.label_names[0], "O");
  const auto& ids = e.ids[0];
  const auto& labels = e.labels[0];
  EXPECT_EQ(ids.front(), v.cls());
  EXPECT_EQ(ids.back(), v.sep());
  EXPECT_EQ(labels.front(), -1);
  EXPECT_EQ(labels.back(), -1);
  EXPECT_EQ(e.label_names[labels[e.first_token[0][2]]], "B-ORG");
  // A word of several word pieces: the first carries its tag, the rest are not scored.
  int64_t split_words = 0;
  for (size_t i = 0; i < s.sentences.size(); ++i)
    for (size_t w = 0; w + 1 < s.sentences[i].words.size(); ++w) {
      const int64_t first = e.first_token[i][w], next = e.first_token[i][w + 1];
      if (first < 0 || next - first < 2) continue;
      ++split_words;
      EXPECT_EQ(e.label_names[e.labels[i][first]], s.sentences[i].tags[w]);
      for (int64_t k = first + 1; k < next; ++k) EXPECT_EQ(e.labels[i][k], -1);
    }
  EXPECT_GT(split_words, 20);
  // Truncation: words past seq_len get no token (predicted "O") and are counted.
  const TokenSet cut = encode_tagged(s, tok, 8, e.label_names);
  EXPECT_GT(cut.truncated, 0);
  for (const auto& x : cut.ids) EXPECT_LE(x.size(), 8u);
}

}  // namespace
}  // namespace bertrain::tasks
