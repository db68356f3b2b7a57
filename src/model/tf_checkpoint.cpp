#include "model/tf_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/params.h"

namespace bertrain::model {

namespace fs = std::filesystem;

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i; (i = s.find(sep, start)) != std::string::npos; start = i + 1)
    out.push_back(s.substr(start, i - start));
  out.push_back(s.substr(start));
  return out;
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

std::optional<TfWeight> tf_weight(const data::BundleVariable& v) {
  // Optimizer slots and state of Google's AdamWeightDecayOptimizer, tf.train.Adam, LAMB and
  // the mixed-precision loss scale: variables of training, not of the model.
  static const std::set<std::string> not_weights = {"adam_m",
                                                    "adam_v",
                                                    "AdamWeightDecayOptimizer",
                                                    "AdamWeightDecayOptimizer_1",
                                                    "Adam",
                                                    "Adam_1",
                                                    "lamb_m",
                                                    "lamb_v",
                                                    "LAMB",
                                                    "LAMB_1",
                                                    "Momentum",
                                                    "global_step",
                                                    "beta1_power",
                                                    "beta2_power",
                                                    "loss_scale",
                                                    "good_steps",
                                                    "bad_steps",
                                                    "current_loss_scale"};
  if (!data::tf_dtype_is_float(v.dtype) || v.sliced) return std::nullopt;
  const std::vector<std::string> parts = split(v.name, '/');
  for (const auto& p : parts)
    if (not_weights.count(p)) return std::nullopt;
  TfWeight w;
  w.tf_name = v.name;
  std::vector<std::string> out;
  if (parts.size() == 1 && (parts[0] == "output_weights" || parts[0] == "output_bias")) {
    out = {"classifier", parts[0] == "output_weights" ? "weight" : "bias"};    // run_classifier
  } else if (parts.size() == 3 && parts[0] == "cls" && parts[1] == "squad") {  // run_squad
    out = {"qa_outputs", parts[2] == "output_weights" ? "weight" : "bias"};
  } else {
    for (const auto& p : parts) {
      if (p.starts_with("layer_") && all_digits(p.substr(6))) {
        out.push_back("layer");
        out.push_back(p.substr(6));
      } else if (p == "kernel") {
        out.push_back("weight");
        w.transpose = true;
      } else if (p == "gamma" || p == "output_weights") {
        out.push_back("weight");
      } else if (p == "beta" || p == "output_bias") {
        out.push_back("bias");
      } else {
        out.push_back(p);
      }
    }
    if (parts.back().ends_with("_embeddings")) out.push_back("weight");
  }
  for (const auto& p : out) w.hf_name += (w.hf_name.empty() ? "" : ".") + p;
  w.shape = v.shape;
  if (w.transpose) {
    if (w.shape.size() != 2)
      fail("TensorFlow variable ", v.name, " is a kernel of shape ", shape_str(v.shape),
           "; a dense layer's kernel has two dimensions");
    std::swap(w.shape[0], w.shape[1]);
  }
  return w;
}

std::vector<TfWeight> tf_weights(const data::TensorBundle& b) {
  std::vector<TfWeight> out;
  for (const auto& v : b.variables())
    if (auto w = tf_weight(v)) out.push_back(std::move(*w));
  return out;
}

std::vector<float> read_tf_weight(const data::TensorBundle& b, const TfWeight& w) {
  const data::BundleVariable* v = b.find(w.tf_name);
  if (!v) fail(b.prefix(), " has no variable ", w.tf_name);
  std::vector<float> x = b.read_f32(*v);
  if (!w.transpose) return x;
  const int64_t rows = v->shape[0], cols = v->shape[1];  // TF: [in, out]
  std::vector<float> t(x.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t o = 0; o < cols; ++o) t[o * rows + i] = x[i * cols + o];
  return t;
}

bool is_tf_checkpoint(const std::string& path) {
  return !data::TensorBundle::find_prefix(path).empty();
}

std::string tf_checkpoint_config(const std::string& checkpoint) {
  const std::string prefix = data::TensorBundle::find_prefix(checkpoint);
  if (prefix.empty()) return "";
  const fs::path dir = fs::path(prefix).parent_path();
  for (const char* name : {"bert_config.json", "config.json"})
    if (fs::exists(dir / name)) return (dir / name).string();
  return "";
}

ConvertReport convert_tf_checkpoint(const std::string& checkpoint, const std::string& bert_config,
                                    const std::string& out_dir) {
  const data::TensorBundle bundle(checkpoint);
  const std::string cfg_path = bert_config.empty() ? tf_checkpoint_config(checkpoint) : bert_config;
  if (cfg_path.empty())
    fail("no bert_config.json beside ", bundle.prefix(),
         "; pass the model's bert_config.json (Google's releases ship one beside the checkpoint)");
  BertConfig cfg = BertConfig::load(cfg_path);
  ConvertReport rep;
  const std::vector<TfWeight> weights = tf_weights(bundle);
  rep.weights = weights.size();
  rep.skipped = bundle.variables().size() - weights.size();
  if (const data::BundleVariable* gs = bundle.find("global_step"))
    rep.global_step = bundle.read_i64(*gs).at(0);
  std::map<std::string, const TfWeight*> by_name;
  for (const auto& w : weights) by_name[w.hf_name] = &w;
  auto has = [&](const char* n) { return by_name.count(n) > 0; };
  if (!has("bert.embeddings.word_embeddings.weight"))
    fail(bundle.prefix(), " has no bert/embeddings/word_embeddings: not a Google BERT checkpoint (",
         weights.size(), " weights, e.g. ", weights.empty() ? "none" : weights[0].tf_name, ")");
  if (has("classifier.weight")) cfg.num_labels = by_name["classifier.weight"]->shape.at(0);
  const bool mlm = has("cls.predictions.bias"), nsp = has("cls.seq_relationship.weight");
  rep.architecture = mlm && nsp                 ? "BertForPreTraining"
                     : mlm                      ? "BertForMaskedLM"
                     : nsp                      ? "BertForNextSentencePrediction"
                     : has("classifier.weight") ? "BertForSequenceClassification"
                     : has("qa_outputs.weight") ? "BertForQuestionAnswering"
                                                : "BertModel";
  // The config must describe these tensors: every weight bertrain's tables name is checked.
  std::vector<std::string> mismatched;
  for (Head head : {Head::Pretraining, Head::SequenceClassification, Head::QuestionAnswering}) {
    const ParamTable table(cfg, head);
    for (const auto& p : table.params()) {
      auto it = by_name.find(p.name);
      if (it != by_name.end() && it->second->shape != p.shape)
        mismatched.push_back(it->second->tf_name + ": checkpoint " + shape_str(it->second->shape) +
                             ", config " + shape_str(p.shape));
    }
  }
  if (!mismatched.empty()) {
    std::string msg = str(cfg_path, " does not describe ", bundle.prefix(), ":");
    for (size_t i = 0; i < mismatched.size() && i < 10; ++i) msg += "\n  " + mismatched[i];
    throw Error(msg + "\n  pass the bert_config.json released with this checkpoint");
  }
  std::vector<std::vector<float>> values;
  values.reserve(weights.size());
  std::vector<SafeTensorOut> out;
  for (const auto& w : weights) {
    values.push_back(read_tf_weight(bundle, w));
    out.push_back({w.hf_name, DType::F32, w.shape, values.back().data(), nullptr});
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail("cannot create ", out_dir, ": ", ec.message());
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), out, {{"format", "pt"}});
  nlohmann::json j = cfg.to_json(rep.architecture);
  write_file_atomic((fs::path(out_dir) / "config.json").string(), j.dump(2) + "\n");
  const fs::path vocab = fs::path(bundle.prefix()).parent_path() / "vocab.txt";
  if (fs::exists(vocab))
    fs::copy_file(vocab, fs::path(out_dir) / "vocab.txt", fs::copy_options::overwrite_existing);
  return rep;
}

}  // namespace bertrain::model
