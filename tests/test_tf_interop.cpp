// Interoperability with TensorFlow: files written by TensorFlow (tools/make_tfrecord_golden.py)
// decode to exactly the manifest's contents; the same contents written by bertrain read back
// identically here, and (run with BERTRAIN_INTEROP_OUT=DIR, then the tool's `verify DIR`)
// in TensorFlow's tf.data.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/example.h"
#include "data/tfrecord.h"
#include "test_util.h"

namespace bertrain::data {
namespace {

using nlohmann::json;

json manifest() {
  std::ifstream in(test::data_path("data/tfrecord/tf_written/manifest.json"));
  return json::parse(in);
}

std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

float json_float(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "nan") return NAN;
    return s == "inf" ? INFINITY : -INFINITY;
  }
  return static_cast<float>(v.get<double>());
}

Example to_example(const json& rec) {
  Example ex;
  for (auto it = rec.begin(); it != rec.end(); ++it) {
    const std::string kind = (*it)[0];
    Feature f;
    if (kind == "int64") {
      f.kind = FeatureKind::Int64;
      for (const auto& v : (*it)[1]) f.ints.push_back(v.get<int64_t>());
    } else if (kind == "float") {
      f.kind = FeatureKind::Float;
      for (const auto& v : (*it)[1]) f.floats.push_back(json_float(v));
    } else {
      f.kind = FeatureKind::Bytes;
      for (const auto& v : (*it)[1]) f.bytes.push_back(unhex(v));
    }
    ex[it.key()] = f;
  }
  return ex;
}

std::vector<std::string> read_all(const std::string& path) {
  TFRecordReader r(path, resolve_compression("auto", path));
  std::vector<std::string> out;
  std::string rec;
  while (r.next(rec)) out.push_back(rec);
  return out;
}

TEST(TfInterop, FilesWrittenByTensorFlowDecodeExactly) {
  json m = manifest();
  ASSERT_GE(m.size(), 5u);
  for (auto it = m.begin(); it != m.end(); ++it) {
    const std::string path = test::data_path("data/tfrecord/tf_written/" + it.key());
    EXPECT_EQ(compression_name(resolve_compression("auto", path)),
              (*it)["compression"].get<std::string>())
        << path;
    auto recs = read_all(path);
    ASSERT_EQ(recs.size(), (*it)["records"].size()) << path;
    for (size_t i = 0; i < recs.size(); ++i) {
      Example want = to_example((*it)["records"][i]);
      EXPECT_TRUE(same_contents(decode_example(recs[i]), want)) << it.key() << " record " << i;
      ExampleView v;
      ASSERT_TRUE(v.parse(recs[i])) << v.error();
      EXPECT_TRUE(same_contents(bertrain::data::to_example(v), want))
          << it.key() << " record " << i;
    }
  }
}

TEST(TfInterop, BertrainWritesTheSameContents) {
  const char* env = std::getenv("BERTRAIN_INTEROP_OUT");
  test::TempDir tmp;
  const std::string dir = env ? env : tmp.path.string();
  std::filesystem::create_directories(dir);
  json m = manifest();
  for (auto it = m.begin(); it != m.end(); ++it) {
    const std::string path = dir + "/" + it.key();
    {
      TFRecordWriter w(path, resolve_compression((*it)["compression"].get<std::string>(), path));
      for (const auto& rec : (*it)["records"]) w.write(encode_example(to_example(rec)));
      w.close();
    }
    auto recs = read_all(path);
    ASSERT_EQ(recs.size(), (*it)["records"].size());
    for (size_t i = 0; i < recs.size(); ++i)
      EXPECT_TRUE(same_contents(decode_example(recs[i]), to_example((*it)["records"][i])));
  }
}

}  // namespace
}  // namespace bertrain::data
