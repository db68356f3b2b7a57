#include "model/config.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "core/error.h"

namespace bertrain::model {

kernels::Activation BertConfig::activation() const {
  if (hidden_act == "gelu") return kernels::Activation::GeluErf;
  if (hidden_act == "gelu_new" || hidden_act == "gelu_pytorch_tanh")
    return kernels::Activation::GeluTanh;
  if (hidden_act == "relu") return kernels::Activation::Relu;
  fail("hidden_act '", hidden_act,
       "' is not supported (use gelu, gelu_new, gelu_pytorch_tanh or relu)");
}

namespace {

template <typename T>
void read_field(const nlohmann::json& j, const char* name, T& out, const std::string& source,
                bool required) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) {
    if (required) fail(source, ": missing field \"", name, "\" (a BERT config.json needs it)");
    return;
  }
  // Numbers are checked before they are converted: a float where an integer belongs, or a value
  // outside the field type's range, is an error, not a truncation (or undefined behaviour).
  if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer())
      fail(source, ": field \"", name, "\" has the wrong type (", it->dump(),
           "; an integer is needed)");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number() ||
        std::fabs(it->get<double>()) > static_cast<double>(std::numeric_limits<T>::max()))
      fail(source, ": field \"", name, "\" has the wrong type (", it->dump(),
           "; a number within float range is needed)");
  }
  try {
    out = it->get<T>();
  } catch (const nlohmann::json::exception&) {
    fail(source, ": field \"", name, "\" has the wrong type (", it->dump(), ")");
  }
}

}  // namespace

BertConfig BertConfig::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) fail(source, ": expected a JSON object");
  BertConfig c;
  read_field(j, "vocab_size", c.vocab_size, source, true);
  read_field(j, "hidden_size", c.hidden_size, source, true);
  read_field(j, "num_hidden_layers", c.num_hidden_layers, source, true);
  read_field(j, "num_attention_heads", c.num_attention_heads, source, true);
  read_field(j, "intermediate_size", c.intermediate_size, source, true);
  read_field(j, "hidden_act", c.hidden_act, source, false);
  read_field(j, "hidden_dropout_prob", c.hidden_dropout_prob, source, false);
  read_field(j, "attention_probs_dropout_prob", c.attention_probs_dropout_prob, source, false);
  read_field(j, "max_position_embeddings", c.max_position_embeddings, source, false);
  read_field(j, "type_vocab_size", c.type_vocab_size, source, false);
  read_field(j, "layer_norm_eps", c.layer_norm_eps, source, false);
  read_field(j, "initializer_range", c.initializer_range, source, false);
  if (j.contains("id2label") && j["id2label"].is_object()) c.num_labels = j["id2label"].size();
  read_field(j, "num_labels", c.num_labels, source, false);
  read_field(j, "pad_token_id", c.pad_token_id, source, false);
  if (j.contains("position_embedding_type") && j["position_embedding_type"] != "absolute")
    fail(source, ": position_embedding_type ", j["position_embedding_type"].dump(),
         " is not supported (bertrain implements \"absolute\")");
  c.validate(source);
  return c;
}

BertConfig BertConfig::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("cannot open model config ", path, " (pass a HuggingFace config.json)");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
  return from_json(j, path);
}

void BertConfig::validate(const std::string& source) const {
  auto positive = [&](const char* name, int64_t v) {
    if (v <= 0) fail(source, ": field \"", name, "\" must be positive, got ", v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("intermediate_size", intermediate_size);
  positive("max_position_embeddings", max_position_embeddings);
  positive("type_vocab_size", type_vocab_size);
  positive("num_labels", num_labels);
  if (pad_token_id < 0 || pad_token_id >= vocab_size)
    fail(source, ": pad_token_id ", pad_token_id, " is outside the vocabulary (", vocab_size,
         " tokens)");
  if (hidden_size % num_attention_heads != 0)
    fail(source, ": hidden_size ", hidden_size, " is not a multiple of num_attention_heads ",
         num_attention_heads);
  auto prob = [&](const char* name, float p) {
    if (!(p >= 0.0f && p < 1.0f)) fail(source, ": field \"", name, "\" must be in [0, 1), got ", p);
  };
  prob("hidden_dropout_prob", hidden_dropout_prob);
  prob("attention_probs_dropout_prob", attention_probs_dropout_prob);
  if (!(layer_norm_eps > 0.0f)) fail(source, ": field \"layer_norm_eps\" must be positive");
  if (!(initializer_range > 0.0f)) fail(source, ": field \"initializer_range\" must be positive");
  try {
    (void)activation();
  } catch (const Error& e) {
    fail(source, ": ", e.what());
  }
}

namespace {
// The shortest decimal that reads back as the same float, as a double: 0.1f is written as 0.1
// (what HuggingFace wrote and read), not as 0.10000000149011612.
double decimal(float v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}
}  // namespace

nlohmann::json BertConfig::to_json(const std::string& architecture) const {
  nlohmann::json j = {{"architectures", {architecture}},
                      {"model_type", "bert"},
                      {"vocab_size", vocab_size},
                      {"hidden_size", hidden_size},
                      {"num_hidden_layers", num_hidden_layers},
                      {"num_attention_heads", num_attention_heads},
                      {"intermediate_size", intermediate_size},
                      {"hidden_act", hidden_act},
                      {"hidden_dropout_prob", decimal(hidden_dropout_prob)},
                      {"attention_probs_dropout_prob", decimal(attention_probs_dropout_prob)},
                      {"max_position_embeddings", max_position_embeddings},
                      {"type_vocab_size", type_vocab_size},
                      {"layer_norm_eps", decimal(layer_norm_eps)},
                      {"initializer_range", decimal(initializer_range)},
                      {"position_embedding_type", "absolute"},
                      {"pad_token_id", pad_token_id},
                      {"torch_dtype", "float32"}};
  if (architecture == "BertForSequenceClassification") {
    nlohmann::json id2label, label2id;
    for (int64_t i = 0; i < num_labels; ++i) {
      id2label[std::to_string(i)] = "LABEL_" + std::to_string(i);
      label2id["LABEL_" + std::to_string(i)] = i;
    }
    j["id2label"] = id2label;
    j["label2id"] = label2id;
    if (num_labels == 1) j["problem_type"] = "regression";  // HF's MSELoss head
  }
  return j;
}

bool BertConfig::same_shapes(const BertConfig& o) const {
  return vocab_size == o.vocab_size && hidden_size == o.hidden_size &&
         num_hidden_layers == o.num_hidden_layers && num_attention_heads == o.num_attention_heads &&
         intermediate_size == o.intermediate_size &&
         max_position_embeddings == o.max_position_embeddings &&
         type_vocab_size == o.type_vocab_size;
}

}  // namespace bertrain::model
