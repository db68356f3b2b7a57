// TensorFlow checkpoints (tensor bundles): the reader against TensorFlow's own
// (tf.train.load_checkpoint), the Google-BERT-to-HuggingFace mapping against transformers' own
// load_tf_weights_in_bert, on a real keras-bert checkpoint and one written by TensorFlow
// (tools/make_tf_checkpoint_golden.py). Values must be bit-identical (nothing is computed);
// logits are HF's in float64 against bertrain's fp32, so the golden tests' forward bounds apply
// (rtol 2e-5, atol 2e-6 of the largest logit).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "data/tensor_bundle.h"
#include "model/bert.h"
#include "model/checkpoint.h"
#include "model/tf_checkpoint.h"
#include "test_util.h"
#include "train/finetune.h"

namespace bertrain::model {
namespace {

namespace fs = std::filesystem;
using test::all_close;
using test::data_path;
using test::TempDir;

const char* kKeras = "tf_checkpoint/keras_bert_tiny";
const char* kClassifier = "tf_checkpoint/tf_classifier";

std::string ckpt(const char* dir) {
  return data_path(std::string("data/") + dir);
}

std::string golden(const char* name) {
  return data_path(std::string("golden/tf_checkpoint/") + name + ".safetensors");
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_reads_as_tensorflow(const std::string& dir, const std::string& golden_file) {
  const data::TensorBundle b(dir);
  SafetensorsReader g(golden_file);
  std::vector<std::string> ref_names;
  for (const auto& t : g.tensors())
    if (t.name.starts_with("var.")) ref_names.push_back(t.name.substr(4));
  std::sort(ref_names.begin(), ref_names.end());
  std::vector<std::string> names;
  for (const auto& v : b.variables()) names.push_back(v.name);
  ASSERT_EQ(names, ref_names);
  for (const auto& v : b.variables()) {
    const SafeTensorInfo* t = g.find("var." + v.name);
    ASSERT_TRUE(t);
    EXPECT_EQ(v.shape, t->shape) << v.name;
    if (t->dtype == DType::I64) {
      EXPECT_EQ(b.read_i64(v), g.read_i64(t->name)) << v.name;
    } else {
      ASSERT_EQ(t->dtype, DType::F32) << v.name;
      EXPECT_EQ(b.read_f32(v), g.read_f32(t->name)) << v.name;  // bit for bit
    }
  }
}

TEST(TensorBundle, ReadsTheKerasBertCheckpointAsTensorFlowDoes) {
  expect_reads_as_tensorflow(ckpt(kKeras) + "/bert_model.ckpt", golden("keras_bert_tiny"));
}

TEST(TensorBundle, ReadsACheckpointTensorFlowWrote) {
  expect_reads_as_tensorflow(ckpt(kClassifier), golden("tf_classifier"));
  const data::TensorBundle b(ckpt(kClassifier));
  EXPECT_EQ(b.read_i64(*b.find("global_step")), std::vector<int64_t>{7});
}

TEST(TensorBundle, FindsTheCheckpointANameMeans) {
  const std::string keras = ckpt(kKeras) + "/bert_model.ckpt";
  EXPECT_EQ(data::TensorBundle::find_prefix(keras), keras);
  EXPECT_EQ(data::TensorBundle::find_prefix(keras + ".index"), keras);
  EXPECT_EQ(data::TensorBundle::find_prefix(keras + ".data-00000-of-00001"), keras);
  EXPECT_EQ(data::TensorBundle::find_prefix(ckpt(kKeras)), keras);  // the one .index there
  // A training directory: TensorFlow's `checkpoint` state file names the latest.
  EXPECT_EQ(data::TensorBundle::find_prefix(ckpt(kClassifier)),
            ckpt(kClassifier) + "/model.ckpt-7");
  EXPECT_EQ(data::TensorBundle::find_prefix(data_path("golden/bert_cls")), "");
  EXPECT_EQ(data::TensorBundle::find_prefix("/nonexistent/model.ckpt"), "");
  EXPECT_TRUE(is_tf_checkpoint(ckpt(kKeras)));
  EXPECT_FALSE(is_tf_checkpoint(data_path("golden/bert_cls")));
  const std::string m = message_of([] { data::TensorBundle b(data_path("golden/bert_cls")); });
  EXPECT_NE(m.find("is not a TensorFlow checkpoint"), std::string::npos) << m;
}

// Damage found where it is: the index's blocks and every tensor carry a CRC32C.
TEST(TensorBundle, DamageIsNamedNotRead) {
  TempDir tmp;
  for (const auto& e : fs::directory_iterator(ckpt(kKeras)))
    fs::copy_file(e.path(), tmp.path / e.path().filename());
  const std::string prefix = tmp / "bert_model.ckpt";
  const std::string data = prefix + ".data-00000-of-00001";
  const data::TensorBundle good(prefix);
  const data::BundleVariable* v = good.find("bert/pooler/dense/kernel");
  ASSERT_TRUE(v);
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(v->offset + 3);
    f.put('\x7f');
  }
  std::string m = message_of([&] { good.read_f32(*v); });
  EXPECT_NE(m.find("bert/pooler/dense/kernel fail their CRC32C"), std::string::npos) << m;
  EXPECT_NE(m.find(data), std::string::npos) << m;
  fs::resize_file(data, v->offset + 2);
  m = message_of([&] { good.read_f32(*v); });
  EXPECT_NE(m.find("is truncated"), std::string::npos) << m;
  {
    std::fstream f(prefix + ".index", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x01');
  }
  m = message_of([&] { data::TensorBundle b(prefix); });
  EXPECT_NE(m.find("fails its CRC32C"), std::string::npos) << m;
  EXPECT_NE(m.find(prefix + ".index"), std::string::npos) << m;
  fs::resize_file(prefix + ".index", 20);
  m = message_of([&] { data::TensorBundle b(prefix); });
  EXPECT_NE(m.find("only 20 bytes"), std::string::npos) << m;
}

TEST(TfCheckpoint, GoogleNamesMapToHuggingFaceNames) {
  auto hf = [](const std::string& name, Shape shape) {
    data::BundleVariable v;
    v.name = name;
    v.dtype = 1;
    v.shape = std::move(shape);
    const auto w = tf_weight(v);
    return w ? w->hf_name + (w->transpose ? " T" : "") : std::string("-");
  };
  EXPECT_EQ(hf("bert/embeddings/word_embeddings", {30, 8}),
            "bert.embeddings.word_embeddings.weight");
  EXPECT_EQ(hf("bert/embeddings/LayerNorm/gamma", {8}), "bert.embeddings.LayerNorm.weight");
  EXPECT_EQ(hf("bert/encoder/layer_11/attention/self/query/kernel", {8, 8}),
            "bert.encoder.layer.11.attention.self.query.weight T");
  EXPECT_EQ(hf("bert/encoder/layer_0/output/LayerNorm/beta", {8}),
            "bert.encoder.layer.0.output.LayerNorm.bias");
  EXPECT_EQ(hf("cls/predictions/output_bias", {30}), "cls.predictions.bias");
  EXPECT_EQ(hf("cls/predictions/transform/dense/kernel", {8, 8}),
            "cls.predictions.transform.dense.weight T");
  EXPECT_EQ(hf("cls/seq_relationship/output_weights", {2, 8}), "cls.seq_relationship.weight");
  EXPECT_EQ(hf("output_weights", {3, 8}), "classifier.weight");
  EXPECT_EQ(hf("cls/squad/output_weights", {2, 8}), "qa_outputs.weight");
  EXPECT_EQ(hf("bert/pooler/dense/kernel/adam_m", {8, 8}), "-");
  EXPECT_EQ(hf("global_step", {}), "-");
  EXPECT_EQ(hf("bert/embeddings/word_embeddings/AdamWeightDecayOptimizer", {30, 8}), "-");
}

Batch golden_input(const SafetensorsReader& g, int64_t P) {
  const SafeTensorInfo* ids = g.find("input.input_ids");
  const int64_t B = ids->shape[0], T = ids->shape[1];
  Batch b;
  b.resize(B, T, P);
  auto to32 = [](const std::vector<int64_t>& v, std::vector<int32_t>& out) {
    out.assign(v.begin(), v.end());
  };
  to32(g.read_i64("input.input_ids"), b.input_ids);
  to32(g.read_i64("input.input_mask"), b.input_mask);
  to32(g.read_i64("input.segment_ids"), b.segment_ids);
  for (int64_t r = 0; r < B; ++r)  // every position, to compare HF's logits at all of them
    for (int64_t t = 0; t < P; ++t) {
      b.masked_lm_positions[r * P + t] = static_cast<int32_t>(t);
      b.masked_lm_weights[r * P + t] = 1.0f;
    }
  return b;
}

TEST(TfCheckpoint, PretrainingLogitsEqualHuggingFacesLoader) {
  SafetensorsReader g(golden("keras_bert_tiny"));
  const int64_t T = g.find("input.input_ids")->shape[1];
  Batch b = golden_input(g, T);
  const BertConfig cfg = BertConfig::load(checkpoint_config_path(ckpt(kKeras)));
  BertModel m(cfg, Head::Pretraining, {b.B, b.T, b.P});
  const LoadReport rep = load_checkpoint_into(m, ckpt(kKeras));
  EXPECT_EQ(rep.loaded.size(), m.table().params().size());
  EXPECT_EQ(rep.ignored.size(), 93u);  // adam_m, adam_v of 46 weights, global_step
  m.forward(b, {});
  EXPECT_TRUE(all_close("prediction_logits", m.mlm_logits(),
                        g.read_f64("output.prediction_logits").data(), b.B * b.T * cfg.vocab_size,
                        2e-5, 2e-6));
  EXPECT_TRUE(all_close("seq_relationship_logits", m.nsp_logits(),
                        g.read_f64("output.seq_relationship_logits").data(), b.B * 2, 2e-5, 2e-6));
}

TEST(TfCheckpoint, ClassifierLogitsEqualHuggingFace) {
  SafetensorsReader g(golden("tf_classifier"));
  Batch b = golden_input(g, 0);
  BertConfig cfg = BertConfig::load(checkpoint_config_path(ckpt(kClassifier)));
  cfg.num_labels = 3;
  BertModel m(cfg, Head::SequenceClassification, {b.B, b.T, 0});
  load_checkpoint_into(m, ckpt(kClassifier));
  m.forward(b, {});
  EXPECT_TRUE(
      all_close("logits", m.cls_logits(), g.read_f64("output.logits").data(), b.B * 3, 2e-5, 2e-6));
}

std::vector<float> params_of(const BertModel& m) {
  return {m.params(), m.params() + m.table().total()};
}

TEST(TfCheckpoint, ConvertWritesAHuggingFaceDirectory) {
  TempDir tmp;
  const ConvertReport r = convert_tf_checkpoint(ckpt(kKeras), "", tmp / "hf");
  EXPECT_EQ(r.architecture, "BertForPreTraining");
  EXPECT_EQ(r.weights, 46u);
  EXPECT_EQ(r.global_step, 20);
  EXPECT_TRUE(fs::exists(tmp / "hf/vocab.txt"));
  const BertConfig cfg = BertConfig::load(tmp / "hf/config.json");
  BertModel direct(cfg, Head::Pretraining, {1, 4, 1}), converted(cfg, Head::Pretraining, {1, 4, 1});
  load_checkpoint_into(direct, ckpt(kKeras));
  load_safetensors_into(converted, tmp / "hf/model.safetensors");  // every tensor, strictly
  EXPECT_EQ(params_of(direct), params_of(converted));

  const ConvertReport c = convert_tf_checkpoint(ckpt(kClassifier), "", tmp / "cls");
  EXPECT_EQ(c.architecture, "BertForSequenceClassification");
  EXPECT_EQ(c.global_step, 7);
  std::ifstream in(tmp / "cls/config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["id2label"].size(), 3u);
}

TEST(TfCheckpoint, AConfigThatDoesNotFitIsNamed) {
  TempDir tmp;
  std::ifstream in(ckpt(kKeras) + "/bert_config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["intermediate_size"] = 32;
  std::ofstream(tmp / "bert_config.json") << j.dump();
  const std::string m =
      message_of([&] { convert_tf_checkpoint(ckpt(kKeras), tmp / "bert_config.json", tmp / "o"); });
  EXPECT_NE(m.find("bert/encoder/layer_0/intermediate/dense/kernel: checkpoint [16, 4], config "
                   "[32, 4]"),
            std::string::npos)
      << m;
  EXPECT_FALSE(fs::exists(tmp / "o/model.safetensors"));
}

// finetune --init-checkpoint reads the TF checkpoint in place (its bert_config.json and
// vocab.txt beside it): after one short epoch (5 AdamW steps of lr 5e-5, at most 2.5e-4 per
// weight) the saved encoder is still the TF checkpoint's, where a fresh init would differ by
// about its 0.02 scale.
TEST(TfCheckpoint, FinetuneStartsFromIt) {
  TempDir tmp;
  train::FinetuneConfig f;
  f.init_checkpoint = ckpt(kKeras);
  f.train = data_path("data/tasks/sst2_dev_head40.tsv");
  f.columns = tasks::task_columns("sst2");
  f.seq_len = 16;
  f.batch_size = 8;
  f.epochs = 1;
  f.output = tmp / "out";
  f.quiet = true;
  train::finetune(f);
  EXPECT_TRUE(fs::exists(tmp / "out/vocab.txt"));
  SafetensorsReader out(tmp / "out/model.safetensors");
  const data::TensorBundle b(ckpt(kKeras));
  for (const char* name :
       {"bert/embeddings/word_embeddings", "bert/encoder/layer_1/output/dense/kernel"}) {
    const data::BundleVariable* v = b.find(name);
    const auto w = tf_weight(*v);
    const std::vector<float> ref = read_tf_weight(b, *w);
    const std::vector<float> got = out.read_f32(w->hf_name);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], 3e-4) << name << " " << i;
  }
}

}  // namespace
}  // namespace bertrain::model
