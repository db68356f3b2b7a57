// BertConfig: the HuggingFace config.json fields bertrain uses, validated on load.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>

#include "kernels/types.h"

namespace bertrain::model {

struct BertConfig {
  int64_t vocab_size = 30522;
  int64_t hidden_size = 768;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t intermediate_size = 3072;
  std::string hidden_act = "gelu";
  float hidden_dropout_prob = 0.1f;
  float attention_probs_dropout_prob = 0.1f;
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  float layer_norm_eps = 1e-12f;
  float initializer_range = 0.02f;
  int64_t num_labels = 2;  // sequence classification head (from num_labels or id2label)
  // HF's padding_idx of the word embeddings: that row never gets a gradient.
  int64_t pad_token_id = 0;

  kernels::Activation activation() const;
  int64_t head_dim() const { return hidden_size / num_attention_heads; }

  // Parses and validates; `source` names the file in error messages.
  static BertConfig from_json(const nlohmann::json& j, const std::string& source);
  static BertConfig load(const std::string& path);  // reads config.json
  nlohmann::json to_json(const std::string& architecture) const;
  void validate(const std::string& source) const;
  bool same_shapes(const BertConfig& o) const;
};

}  // namespace bertrain::model
