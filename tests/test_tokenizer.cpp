// The tokenizer against HuggingFace's BertTokenizer (tools/make_tokenizer_golden.py): every
// line of real English (incl. a Latin-1 file and a CRLF file) and Chinese corpora, and an
// edge-case file, must give identical ids.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "prep/unicode.h"
#include "prep/wordpiece.h"
#include "test_util.h"

namespace bertrain::prep {
namespace {

std::string root_path(const std::string& rel) {
  return test::data_path("../" + rel);
}

std::vector<std::string> raw_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string all(std::istreambuf_iterator<char>(in), {});
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t nl = all.find('\n', start);
    out.push_back(all.substr(start, nl == std::string::npos ? std::string::npos : nl - start));
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  return out;
}

TEST(Tokenizer, MatchesHuggingFaceOnRealCorpora) {
  std::ifstream in(test::data_path("data/tokenizer/golden.json"));
  auto golden = nlohmann::json::parse(in);
  std::map<std::string, Vocab> vocabs;
  size_t lines = 0, mismatches = 0;
  for (const auto& c : golden["cases"]) {
    const std::string vocab_path = root_path(c["vocab"]);
    if (!vocabs.count(vocab_path)) vocabs.emplace(vocab_path, Vocab::load(vocab_path));
    Tokenizer tok(vocabs.at(vocab_path), c["lower_case"].get<bool>());
    auto text = raw_lines(root_path(c["file"]));
    for (const auto& entry : c["lines"]) {
      const size_t i = entry[0];
      const std::vector<int32_t> want = entry[1].get<std::vector<int32_t>>();
      std::vector<int32_t> got;
      tok.encode(text.at(i), got);
      ++lines;
      if (got != want && ++mismatches <= 5) {
        std::string g, w;
        for (auto id : got) g += vocabs.at(vocab_path).token(id) + " ";
        for (auto id : want) w += vocabs.at(vocab_path).token(id) + " ";
        ADD_FAILURE() << c["file"] << ":" << i + 1 << " (lower=" << c["lower_case"]
                      << ")\n  text: " << text[i] << "\n  got:  " << g << "\n  want: " << w;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << lines << " lines";
  EXPECT_GT(lines, 1900u);
}

TEST(Tokenizer, VocabularyErrors) {
  test::TempDir tmp;
  std::ofstream(tmp / "v.txt") << "[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n";
  try {
    Vocab::load(tmp / "v.txt");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no [MASK] token"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Vocab::load(tmp / "absent.txt"), Error);
  Vocab uncased = Vocab::load(root_path("data/vocab/bert-base-uncased-vocab.txt"));
  EXPECT_EQ(uncased.size(), 30522);
  EXPECT_EQ(uncased.cls(), 101);
  EXPECT_EQ(uncased.mask(), 103);
  EXPECT_TRUE(uncased.looks_uncased());
}

TEST(Unicode, DecodingReplacesLikePython) {
  std::u32string out;
  // "\xe9" alone (Latin-1 é), a truncated 3-byte sequence, an overlong encoding, a surrogate.
  EXPECT_EQ(unicode::decode("caf\xe9s", out), 1u);
  EXPECT_EQ(out, U"caf\ufffds");
  EXPECT_EQ(unicode::decode("a\xe2\x82z", out), 1u);  // maximal subpart: one U+FFFD
  EXPECT_EQ(out, U"a\ufffdz");
  EXPECT_EQ(unicode::decode("\xc0\xaf", out), 2u);
  EXPECT_EQ(unicode::decode("\xed\xa0\x80", out), 3u);
  EXPECT_EQ(unicode::decode("\xf0\x9f\x98\x80", out), 0u);
  EXPECT_EQ(out, U"\U0001F600");
  std::string s = "ok\xff";
  EXPECT_EQ(unicode::repair(s), 1u);
  EXPECT_EQ(s, "ok\xef\xbf\xbd");
}

}  // namespace
}  // namespace bertrain::prep
