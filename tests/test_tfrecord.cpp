// TFRecord framing, CRC32C, compression and tf.Example decoding, on real files written by
// TensorFlow (tests/data/tfrecord, see its README) and on every kind of corruption.
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "data/crc32c.h"
#include "data/example.h"
#include "data/schema.h"
#include "data/tfrecord.h"
#include "test_util.h"

namespace bertrain::data {
namespace {

using test::data_path;
using test::TempDir;

std::vector<std::string> read_all(const std::string& path, const std::string& comp = "auto") {
  TFRecordReader r(path, resolve_compression(comp, path));
  std::vector<std::string> out;
  std::string rec;
  while (r.next(rec)) out.push_back(rec);
  return out;
}

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void spit(const std::string& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}

TEST(Crc32c, KnownValuesAndBothImplementations) {
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);  // the CRC-32C check value
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8a9136aau);  // RFC 3720 B.4
  std::mt19937 rng(1);
  for (size_t n : {1u, 7u, 8u, 9u, 63u, 1000u, 65537u}) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    EXPECT_EQ(crc32c(s.data(), n), crc32c_portable(0, s.data(), n)) << n;
    EXPECT_EQ(crc32c_extend(crc32c(s.data(), n / 2), s.data() + n / 2, n - n / 2),
              crc32c(s.data(), n));
  }
}

TEST(RealFiles, TorchdataFixtureHasKnownContents) {
  auto recs = read_all(data_path("data/tfrecord/torchdata_example.tfrecord"));
  ASSERT_EQ(recs.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    Example ex = decode_example(recs[i]);
    ExampleView v;
    ASSERT_TRUE(v.parse(recs[i])) << v.error();
    EXPECT_EQ(to_example(v), ex);  // fast decoder == protobuf
    ASSERT_EQ(ex.at("x_float").kind, FeatureKind::Float);
    ASSERT_EQ(ex.at("x_int").kind, FeatureKind::Int64);
    ASSERT_EQ(ex.at("x_byte").kind, FeatureKind::Bytes);
    ASSERT_EQ(ex.at("x_float").floats.size(), 10u);
    for (int k = 0; k < 10; ++k) {
      EXPECT_EQ(ex.at("x_float").floats[k], static_cast<float>(10 * i + k));
      EXPECT_EQ(ex.at("x_int").ints[k], 10 * (10 * i + k));
    }
    EXPECT_EQ(ex.at("x_byte").bytes, std::vector<std::string>{"test str"});
  }
}

TEST(RealFiles, GzipPenguinsFromTfx) {
  const std::string p = data_path("data/tfrecord/tfx_penguin_train.tfrecord.gz");
  EXPECT_EQ(resolve_compression("auto", p), Compression::Gzip);
  auto recs = read_all(p);
  ASSERT_EQ(recs.size(), 234u);
  for (const auto& r : recs) {
    Example ex = decode_example(r);
    for (const char* f :
         {"body_mass_g", "culmen_depth_mm", "culmen_length_mm", "flipper_length_mm"}) {
      ASSERT_EQ(ex.at(f).kind, FeatureKind::Float) << f;
      ASSERT_EQ(ex.at(f).floats.size(), 1u);
    }
    ASSERT_EQ(ex.at("species").kind, FeatureKind::Int64);
    ASSERT_LT(static_cast<uint64_t>(ex.at("species").ints[0]), 3u);
    ExampleView v;
    ASSERT_TRUE(v.parse(r));
    ASSERT_EQ(to_example(v), ex);
  }
}

TEST(RealFiles, GoogleBertPretrainingRecords) {
  auto recs = read_all(data_path("data/tfrecord/bert_pretrain_sample_text.tfrecord"));
  ASSERT_EQ(recs.size(), 60u);
  Schema s = Schema::pretraining(128, 20, 30522);
  ParsedExample ex;
  std::string err;
  data::Batch b;
  s.shape_batch(b, 60);
  for (size_t i = 0; i < recs.size(); ++i) {
    ASSERT_TRUE(s.parse(recs[i], ex, err)) << err;
    s.fill_row(ex, b, i);
    EXPECT_EQ(decode_example(recs[i]), to_example([&] {
                ExampleView v;
                v.parse(recs[i]);
                return v;
              }()));
  }
  const std::vector<int32_t> ids0 = {101, 2005, 2062, 2084, 1037, 103, 2039, 103};
  EXPECT_EQ(std::vector<int32_t>(b.input_ids.begin(), b.input_ids.begin() + 8), ids0);
  const std::vector<int32_t> pos0 = {5, 7, 12, 13, 14, 24, 32, 55, 59, 60, 71, 94};
  EXPECT_EQ(std::vector<int32_t>(b.masked_lm_positions.begin(), b.masked_lm_positions.begin() + 12),
            pos0);
  // Every record: [CLS] first, weights 1 exactly where positions are set, valid NSP label.
  for (int i = 0; i < 60; ++i) {
    EXPECT_EQ(b.input_ids[i * 128], 101);
    for (int p = 0; p < 20; ++p) {
      const float w = b.masked_lm_weights[i * 20 + p];
      EXPECT_TRUE(w == 0.0f || w == 1.0f);
      if (w == 0.0f) {
        EXPECT_EQ(b.masked_lm_positions[i * 20 + p], 0);
      }
    }
    EXPECT_LE(b.next_sentence_labels[i], 1);
  }
  // The same records under a model whose sequence length differs: a clear error.
  Schema s64 = Schema::pretraining(64, 20, 30522);
  EXPECT_FALSE(s64.parse(recs[0], ex, err));
  EXPECT_NE(err.find("'input_ids' has 128 values, expected 64"), std::string::npos) << err;
  Schema small_vocab = Schema::pretraining(128, 20, 1000);
  EXPECT_FALSE(small_vocab.parse(recs[0], ex, err));
  EXPECT_NE(err.find("another vocabulary"), std::string::npos) << err;
}

class WriterTest : public ::testing::TestWithParam<Compression> {};

TEST_P(WriterTest, RoundTripsRecordsOfAnySize) {
  TempDir tmp;
  const std::string path = tmp / "w.tfrecord";
  std::vector<std::string> recs = {"", "a", std::string(3 << 20, 'x'), "tail"};
  for (int i = 0; i < 1000; ++i) recs.push_back(std::string(1, 'r').append(std::to_string(i)));
  {
    TFRecordWriter w(path, GetParam());
    for (const auto& r : recs) w.write(r);
    w.close();
  }
  EXPECT_EQ(read_all(path, compression_name(GetParam())), recs);
  if (GetParam() != Compression::None) {
    EXPECT_EQ(resolve_compression("auto", path), GetParam());  // sniffed from the bytes
  }
}

INSTANTIATE_TEST_SUITE_P(All, WriterTest,
                         ::testing::Values(Compression::None, Compression::Gzip, Compression::Zlib),
                         [](const auto& i) { return std::string(compression_name(i.param)); });

TEST(Writer, UnclosedWriterLeavesNoFile) {
  TempDir tmp;
  {
    TFRecordWriter w(tmp / "x.tfrecord", Compression::None);
    w.write("abc");
  }
  EXPECT_FALSE(std::filesystem::exists(tmp / "x.tfrecord"));
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path));
}

TEST(Example, EncodeDecodeRoundTrip) {
  Example ex;
  ex["ids"] = {FeatureKind::Int64, {1, -2, 1LL << 40}, {}, {}};
  ex["w"] = {FeatureKind::Float, {}, {0.5f, -1e30f}, {}};
  ex["b"] = {FeatureKind::Bytes, {}, {}, {"x", std::string("\0y", 2)}};
  ex["e"] = {};
  const std::string s = encode_example(ex);
  EXPECT_EQ(decode_example(s), ex);
  ExampleView v;
  ASSERT_TRUE(v.parse(s));
  EXPECT_EQ(to_example(v), ex);
}

// Unknown fields in the deprecated group encoding (found by the fuzzer: protobuf skipped such a
// field, the fast decoder rejected the record): both skip a group, nested groups too, and both
// reject an end-group without its start or a group that never ends.
TEST(Example, UnknownGroupFieldsAreSkippedAsProtobufDoes) {
  const std::string feature = encode_example({{"x", {FeatureKind::Int64, {7}, {}, {}}}});
  // field 9 start-group { field 2 varint 5; field 3 start-group { field 1 fixed32 } end } end
  const std::string group = std::string("\x4b\x10\x05\x1b\x0d\x01\x02\x03\x04\x1c\x4c", 11);
  for (const std::string& ex : {group + feature, feature + group}) {
    Example ref = decode_example(ex);
    ExampleView v;
    ASSERT_TRUE(v.parse(ex)) << v.error();
    EXPECT_EQ(to_example(v), ref);
    EXPECT_EQ(ref.at("x").ints, std::vector<int64_t>{7});
  }
  for (const std::string& bad : {std::string("\x4c", 1) + feature,          // end without start
                                 feature + std::string("\x4b\x10\x05", 3),  // never ends
                                 std::string("\x4b\x54", 2) + feature}) {   // ends another field
    ExampleView v;
    EXPECT_FALSE(v.parse(bad));
    EXPECT_THROW(decode_example(bad), Error);
  }
}

TEST(Example, UnpackedListsAndDuplicateKeysDecodeAsProtobufDoes) {
  // Hand-made wire bytes: feature "a" as an unpacked int64 list [3, 4], then "a" again as
  // float [1.5] (a repeated map key: the last wins), and "f" as unpacked floats.
  auto entry = [](const std::string& key, const std::string& feature) {
    std::string e = std::string("\x0a") + static_cast<char>(key.size()) + key + "\x12" +
                    static_cast<char>(feature.size()) + feature;
    return std::string("\x0a") + static_cast<char>(e.size()) + e;
  };
  std::string ints_unpacked = std::string("\x08\x03\x08\x04", 4);
  std::string f_a1 = std::string("\x1a") + static_cast<char>(ints_unpacked.size()) + ints_unpacked;
  std::string fl = std::string("\x0d\x00\x00\xc0\x3f", 5);  // unpacked float 1.5
  std::string f_a2 = std::string("\x12") + static_cast<char>(fl.size()) + fl;
  std::string features = entry("a", f_a1) + entry("f", f_a2) + entry("a", f_a2);
  std::string ex = std::string("\x0a") + static_cast<char>(features.size()) + features;
  Example ref = decode_example(ex);
  ExampleView v;
  ASSERT_TRUE(v.parse(ex)) << v.error();
  EXPECT_EQ(to_example(v), ref);
  EXPECT_EQ(ref.at("a").kind, FeatureKind::Float);
  EXPECT_EQ(ref.at("f").floats, std::vector<float>{1.5f});
}

// ---- corruption: each case names the file and offset, never crashes ----

struct Corruption {
  const char* name;
  size_t offset;  // byte to flip within the second record (record = 12 + len + 4)
  CorruptRecord::Kind kind;
};

class CorruptTest : public ::testing::TestWithParam<Corruption> {};

TEST_P(CorruptTest, IsReportedWithFileOffsetAndRecord) {
  TempDir tmp;
  const std::string path = tmp / "c.tfrecord";
  {
    TFRecordWriter w(path, Compression::None);
    for (int i = 0; i < 3; ++i) w.write(std::string(10, 'a' + i));
    w.close();
  }
  std::string bytes = slurp(path);
  bytes[26 + GetParam().offset] ^= 0x10;  // second record starts at 12 + 10 + 4 = 26
  spit(path, bytes);
  TFRecordReader r(path, Compression::None);
  std::string rec;
  ASSERT_TRUE(r.next(rec));
  try {
    r.next(rec);
    FAIL() << "no error";
  } catch (const CorruptRecord& e) {
    EXPECT_EQ(e.kind, GetParam().kind);
    EXPECT_EQ(e.record, 1u);
    EXPECT_EQ(e.offset, 26u);
    EXPECT_NE(std::string(e.what()).find(path + ": corrupt record 1 at byte 26"), std::string::npos)
        << e.what();
  }
  // After a data-CRC error the reader goes on with record 2; otherwise the file ends.
  const bool more = r.next(rec);
  EXPECT_EQ(more, GetParam().kind == CorruptRecord::Kind::DataCrc);
  if (more) {
    EXPECT_EQ(rec, std::string(10, 'c'));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Bits, CorruptTest,
    ::testing::Values(Corruption{"length", 0, CorruptRecord::Kind::LengthCrc},
                      Corruption{"length_crc", 9, CorruptRecord::Kind::LengthCrc},
                      Corruption{"data", 14, CorruptRecord::Kind::DataCrc},
                      Corruption{"data_crc", 23, CorruptRecord::Kind::DataCrc}),
    [](const auto& i) { return std::string(i.param.name); });

TEST(Corrupt, TruncatedEmptyAndMissingFiles) {
  TempDir tmp;
  const std::string path = tmp / "t.tfrecord";
  {
    TFRecordWriter w(path, Compression::None);
    w.write("hello");
    w.write("world");
    w.close();
  }
  std::string bytes = slurp(path);
  for (size_t cut : {bytes.size() - 1, bytes.size() - 10, size_t{21 + 5}}) {
    spit(path, bytes.substr(0, cut));
    TFRecordReader r(path, Compression::None);
    std::string rec;
    ASSERT_TRUE(r.next(rec));
    try {
      r.next(rec);
      FAIL() << "cut at " << cut;
    } catch (const CorruptRecord& e) {
      EXPECT_EQ(e.kind, CorruptRecord::Kind::Truncated);
      EXPECT_NE(std::string(e.what()).find("file ends inside"), std::string::npos);
    }
  }
  spit(path, "");
  EXPECT_TRUE(read_all(path).empty());
  try {
    read_all(tmp / "absent.tfrecord");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos);
  }
  // A gzip file cut short reports a damaged stream rather than garbage records.
  {
    TFRecordWriter w(tmp / "z.tfrecord.gz", Compression::Gzip);
    for (int i = 0; i < 100; ++i) w.write(std::string(100, 'q'));
    w.close();
  }
  std::string gz = slurp(tmp / "z.tfrecord.gz");
  spit(tmp / "z.tfrecord.gz", gz.substr(0, gz.size() / 2));
  EXPECT_THROW(read_all(tmp / "z.tfrecord.gz"), CorruptRecord);
}

TEST(Schema, WrongTypeTooLongAndMissingFeatures) {
  Schema s = Schema::classification(4, 2, 100);
  Example ex;
  ex["input_ids"] = {FeatureKind::Int64, {1, 2, 3, 4}, {}, {}};
  ex["input_mask"] = {FeatureKind::Int64, {1, 1, 1, 0}, {}, {}};
  ex["segment_ids"] = {FeatureKind::Int64, {0, 0, 0, 0}, {}, {}};
  ex["label_ids"] = {FeatureKind::Int64, {1}, {}, {}};
  ParsedExample p;
  std::string err;
  ASSERT_TRUE(s.parse(encode_example(ex), p, err)) << err;
  Example bad = ex;
  bad["label_ids"] = {FeatureKind::Float, {}, {1.0f}, {}};
  EXPECT_FALSE(s.parse(encode_example(bad), p, err));
  EXPECT_NE(err.find("'label_ids' is a float list, expected int64"), std::string::npos) << err;
  bad = ex;
  bad["input_ids"].ints.push_back(5);
  EXPECT_FALSE(s.parse(encode_example(bad), p, err));
  EXPECT_NE(err.find("'input_ids' has 5 values, expected 4"), std::string::npos) << err;
  bad = ex;
  bad.erase("segment_ids");
  EXPECT_FALSE(s.parse(encode_example(bad), p, err));
  EXPECT_NE(err.find("'segment_ids' is missing"), std::string::npos) << err;
  bad = ex;
  bad["label_ids"].ints[0] = 2;
  EXPECT_FALSE(s.parse(encode_example(bad), p, err));
  EXPECT_NE(err.find("'label_ids'[0] = 2 is outside [0, 2)"), std::string::npos) << err;
  EXPECT_FALSE(s.parse("\x0a\x05garbage", p, err));
  EXPECT_NE(err.find("not a valid tf.train.Example"), std::string::npos) << err;
}

}  // namespace
}  // namespace bertrain::data
