// safetensors and HF checkpoints: byte-exact round trip of a HuggingFace file, dtype
// conversion, and every documented error (missing/unexpected tensors, shape mismatch, corrupt
// header, failed write leaves the previous file intact).
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "test_util.h"

namespace bertrain::model {
namespace {

using test::data_path;
using test::error_of;
using test::TempDir;

std::string hf_dir() {
  return data_path("golden/bert_pretrain");
}

BertModel load_golden() {
  BertModel m(BertConfig::load(hf_dir() + "/config.json"), Head::Pretraining, {2, 8, 2});
  load_safetensors_into(m, hf_dir() + "/model.safetensors");
  return m;
}

TEST(Checkpoint, HuggingFaceFileRoundTripsByteExactly) {
  BertModel m = load_golden();
  TempDir tmp;
  save_pretrained(m, tmp.path.string());
  SafetensorsReader a(hf_dir() + "/model.safetensors"), b(tmp / "model.safetensors");
  EXPECT_EQ(b.metadata().at("format"), "pt");
  // Same set of tensors (HF drops the tied decoder copies, so do we), same bytes each.
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (const auto& t : a.tensors()) {
    const SafeTensorInfo* u = b.find(t.name);
    ASSERT_TRUE(u) << t.name << " missing from bertrain's file";
    EXPECT_EQ(u->shape, t.shape) << t.name;
    ASSERT_EQ(u->dtype, DType::F32);
    ASSERT_EQ(u->end - u->begin, t.end - t.begin);
    EXPECT_EQ(std::memcmp(a.data(t), b.data(*u), t.end - t.begin), 0) << t.name;
  }
  auto cfg = BertConfig::load(tmp / "config.json");
  EXPECT_TRUE(cfg.same_shapes(m.config()));
  std::ifstream in(tmp / "config.json");
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["architectures"][0], "BertForPreTraining");
  EXPECT_EQ(j["model_type"], "bert");
}

TEST(Checkpoint, Bf16AndFp16FilesLoadWithinRounding) {
  BertModel m = load_golden();
  for (DType t : {DType::BF16, DType::F16}) {
    TempDir tmp;
    save_pretrained(m, tmp.path.string(), t);
    SafetensorsReader r(tmp / "model.safetensors");
    EXPECT_EQ(r.tensors().front().dtype, t);
    BertModel m2(m.config(), Head::Pretraining, {2, 8, 2});
    load_safetensors_into(m2, tmp / "model.safetensors");
    const double rel = t == DType::BF16 ? 0x1p-8 : 0x1p-11;  // half an ulp
    for (int64_t i = 0; i < m.table().total(); ++i)
      ASSERT_LE(std::fabs(m2.params()[i] - m.params()[i]), std::fabs(m.params()[i]) * rel + 1e-7);
  }
}

TEST(Checkpoint, ClassifierFromPretrainingCheckpoint) {
  BertConfig cfg = BertConfig::load(hf_dir() + "/config.json");
  BertModel m(cfg, Head::SequenceClassification, {2, 8, 0});
  // Strict: the cls.* tensors are unexpected and classifier.* missing.
  std::string err = error_of([&] { load_safetensors_into(m, hf_dir() + "/model.safetensors"); });
  EXPECT_NE(err.find("missing tensors"), std::string::npos) << err;
  EXPECT_NE(err.find("classifier.weight"), std::string::npos) << err;
  EXPECT_NE(err.find("unexpected tensors"), std::string::npos) << err;
  EXPECT_NE(err.find("cls.seq_relationship.weight"), std::string::npos) << err;
  // Fine-tuning options allow exactly that.
  LoadReport rep =
      load_safetensors_into(m, hf_dir() + "/model.safetensors", {{"classifier."}, {"cls."}});
  EXPECT_EQ(rep.missing_allowed.size(), 2u);
  EXPECT_FALSE(rep.ignored.empty());
}

TEST(Checkpoint, ShapeMismatchNamesTensorAndShapes) {
  BertConfig cfg = BertConfig::load(hf_dir() + "/config.json");
  cfg.intermediate_size = 96;
  BertModel m(cfg, Head::Pretraining, {2, 8, 2});
  std::string err = error_of([&] { load_safetensors_into(m, hf_dir() + "/model.safetensors"); });
  EXPECT_NE(
      err.find("bert.encoder.layer.0.intermediate.dense.weight: file [128, 64], model [96, 64]"),
      std::string::npos)
      << err;
  EXPECT_NE(err.find("--model-config"), std::string::npos) << err;
}

TEST(Checkpoint, AcceptsBertModelNamesAndGammaBeta) {
  // A BertModel checkpoint (no "bert." prefix, TF-style gamma/beta) loads into the encoder.
  BertModel m = load_golden();
  TempDir tmp;
  std::vector<SafeTensorOut> out;
  for (const auto& p : m.table().params()) {
    if (p.name.rfind("bert.", 0) != 0) continue;
    std::string n = p.name.substr(5);
    auto pos = n.find("LayerNorm.weight");
    if (pos != std::string::npos) n.replace(pos, 16, "LayerNorm.gamma");
    out.push_back({n, DType::F32, p.shape, m.params() + p.offset, nullptr});
  }
  write_safetensors(tmp / "model.safetensors", out, {});
  BertModel m2(m.config(), Head::SequenceClassification, {2, 8, 0});
  load_safetensors_into(m2, tmp / "model.safetensors", {{"classifier."}, {}});
  const auto& p = m.table().at("bert.encoder.layer.1.output.LayerNorm.weight");
  EXPECT_EQ(std::memcmp(m.params() + p.offset, m2.param(p.name), p.numel() * 4), 0);
}

TEST(Safetensors, CorruptFilesGiveClearErrors) {
  TempDir tmp;
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(tmp / name, std::ios::binary) << bytes;
    return tmp / name;
  };
  std::string e = error_of([&] { SafetensorsReader r(write("short", "abc")); });
  EXPECT_NE(e.find("not a safetensors file"), std::string::npos) << e;
  std::string huge(8, '\0');
  huge[0] = '\x40';
  huge[1] = '\x42';
  e = error_of([&] { SafetensorsReader r(write("huge", huge + "{}")); });
  EXPECT_NE(e.find("does not fit"), std::string::npos) << e;
  std::string hdr = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  std::string len(8, '\0');
  len[0] = static_cast<char>(hdr.size());
  e = error_of([&] { SafetensorsReader r(write("trunc", len + hdr + std::string(8, '\0'))); });
  EXPECT_NE(e.find("tensor w [4] F32 has data_offsets [0, 16]"), std::string::npos) << e;
  // Sizes that are no sizes (found by the fuzzer: an offset past 64 bits, which JSON reads as
  // floating point), or more elements than the file has bytes.
  for (const auto& [h, want] : std::vector<std::pair<std::string, std::string>>{
           {R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,55555555555555555524]}})",
            "tensor w: data_offsets holds 5.555555555555556e+19, not a whole number"},
           {R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})",
            "tensor w: shape holds -4, not a whole number"},
           {R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,16]}})",
            "tensor w: shape holds 2.5, not a whole number"},
           {R"({"w":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,16]}})",
            "tensor w: shape [4611686018427387904,8] holds more elements than the data section"},
           {R"({"w":{"dtype":"F32","shape":4,"data_offsets":[0,16]}})",
            "tensor w: shape 4 is not an array"}}) {
    len[0] = static_cast<char>(h.size());
    e = error_of([&] { SafetensorsReader r(write("sizes", len + h + std::string(16, '\0'))); });
    EXPECT_NE(e.find(want), std::string::npos) << e;
  }
  std::string bad = "{not json";
  len[0] = static_cast<char>(bad.size());
  e = error_of([&] { SafetensorsReader r(write("badjson", len + bad)); });
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
  e = error_of([&] { SafetensorsReader r(tmp / "absent"); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
}

TEST(Safetensors, FailedWriteKeepsThePreviousFile) {
  TempDir tmp;
  std::vector<float> v = {1, 2, 3};
  const std::string path = tmp / "w.safetensors";
  write_safetensors(path, {{"a", DType::F32, {3}, v.data(), nullptr}}, {});
  // A read-only directory makes the temp file impossible (as root, chmod does not stop us, so
  // point the writer at a path whose parent is a regular file instead).
  std::ofstream(tmp / "file") << "x";
  std::string e = error_of([&] {
    write_safetensors(tmp / "file/w.safetensors", {{"a", DType::F32, {3}, v.data(), nullptr}}, {});
  });
  EXPECT_NE(e.find("cannot create"), std::string::npos) << e;
  // A write that fails half-way (file size limit: EFBIG, as a full disk gives ENOSPC) leaves the
  // previous checkpoint untouched and no temp file behind.
  std::vector<float> big(1 << 16, 5.0f);
  struct rlimit old_lim {};
  getrlimit(RLIMIT_FSIZE, &old_lim);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = old_lim;
  lim.rlim_cur = 4096;
  setrlimit(RLIMIT_FSIZE, &lim);
  e = error_of([&] {
    write_safetensors(path, {{"a", DType::F32, {1 << 16}, big.data(), nullptr}}, {});
  });
  setrlimit(RLIMIT_FSIZE, &old_lim);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(e.find("cannot write " + path + ".tmp."), std::string::npos) << e;
  int files = 0;
  for (auto& f : std::filesystem::directory_iterator(tmp.path))
    files += f.path().filename() != "file";
  EXPECT_EQ(files, 1);  // only w.safetensors
  e = error_of([&] { write_file_atomic("/dev/null", "abc"); });
  EXPECT_NE(e.find("not a regular file"), std::string::npos) << e;
  SafetensorsReader r(path);
  EXPECT_EQ(r.read_f32("a"), v);
}

TEST(Config, MissingAndInvalidFieldsAreNamed) {
  using nlohmann::json;
  json good = {{"vocab_size", 100},        {"hidden_size", 64},        {"num_hidden_layers", 2},
               {"num_attention_heads", 4}, {"intermediate_size", 128}, {"hidden_act", "gelu"}};
  EXPECT_NO_THROW(BertConfig::from_json(good, "c.json"));
  json j = good;
  j.erase("hidden_size");
  EXPECT_NE(
      error_of([&] { BertConfig::from_json(j, "c.json"); }).find("missing field \"hidden_size\""),
      std::string::npos);
  j = good;
  j["num_attention_heads"] = 5;
  EXPECT_NE(error_of([&] { BertConfig::from_json(j, "c.json"); }).find("not a multiple"),
            std::string::npos);
  j = good;
  j["hidden_act"] = "swish";
  EXPECT_NE(error_of([&] { BertConfig::from_json(j, "c.json"); }).find("hidden_act 'swish'"),
            std::string::npos);
  j = good;
  j["vocab_size"] = "many";
  EXPECT_NE(error_of([&] {
              BertConfig::from_json(j, "c.json");
            }).find("\"vocab_size\" has the wrong type"),
            std::string::npos);
  // Numbers that do not fit the field (found by the fuzzer): an error, not a conversion.
  for (const char* bad : {"1.25e47", "64.5", "1e300"}) {
    j = good;
    j[std::string(bad) == "1e300" ? "layer_norm_eps" : "hidden_size"] = json::parse(bad);
    EXPECT_NE(error_of([&] { BertConfig::from_json(j, "c.json"); }).find("has the wrong type"),
              std::string::npos)
        << bad;
  }
  j = good;
  j["hidden_dropout_prob"] = 1.5;
  EXPECT_NE(error_of([&] { BertConfig::from_json(j, "c.json"); }).find("hidden_dropout_prob"),
            std::string::npos);
  EXPECT_NE(error_of([] { BertConfig::load("/nonexistent/config.json"); }).find("cannot open"),
            std::string::npos);
}

// config.json is written with the values as read (HuggingFace writes 0.1), not with float noise
// (0.10000000149011612), and reads back to the same floats.
TEST(Config, WritesTheDecimalsItRead) {
  using nlohmann::json;
  const json in = {
      {"vocab_size", 100},          {"hidden_size", 64},        {"num_hidden_layers", 2},
      {"num_attention_heads", 4},   {"intermediate_size", 128}, {"hidden_act", "gelu"},
      {"hidden_dropout_prob", 0.1}, {"layer_norm_eps", 1e-12},  {"initializer_range", 0.02}};
  const BertConfig c = BertConfig::from_json(in, "c.json");
  const json out = c.to_json("BertForPreTraining");
  EXPECT_EQ(out["hidden_dropout_prob"].get<double>(), 0.1);
  EXPECT_EQ(out["attention_probs_dropout_prob"].get<double>(), 0.1);
  EXPECT_EQ(out["layer_norm_eps"].get<double>(), 1e-12);
  EXPECT_EQ(out["initializer_range"].get<double>(), 0.02);
  const std::string text = out.dump();
  EXPECT_EQ(text.find("0.10000000149"), std::string::npos) << text;
  const BertConfig back = BertConfig::from_json(out, "c.json");
  EXPECT_EQ(back.hidden_dropout_prob, c.hidden_dropout_prob);
  EXPECT_EQ(back.layer_norm_eps, c.layer_norm_eps);
}

TEST(Batch, OutOfRangeIdsAreNamed) {
  BertModel m = load_golden();
  Batch b;
  b.resize(2, 8, 2);
  b.input_mask.assign(16, 1);
  b.input_ids[11] = 999;
  std::string e = error_of([&] { m.forward(b, {}); });
  EXPECT_NE(e.find("input_ids[1,3] = 999 is outside the vocabulary [0, 256)"), std::string::npos)
      << e;
  b.input_ids[11] = 1;
  b.masked_lm_positions[3] = 8;
  e = error_of([&] { m.forward(b, {}); });
  EXPECT_NE(e.find("masked_lm_positions[1,1] = 8"), std::string::npos) << e;
  b.masked_lm_positions[3] = 0;
  Batch big;
  big.resize(3, 8, 2);
  e = error_of([&] { m.forward(big, {}); });
  EXPECT_NE(e.find("exceeds the planned"), std::string::npos) << e;
}

}  // namespace
}  // namespace bertrain::model
