// Google BERT's TensorFlow checkpoints (run_pretraining.py, run_classifier.py, run_squad.py and
// everything trained with that code) in HuggingFace's names, as transformers'
// load_tf_weights_in_bert maps them: "bert/encoder/layer_0/attention/self/query/kernel" ->
// "bert.encoder.layer.0.attention.self.query.weight" (kernels transposed from [in, out] to
// [out, in]), gamma/beta -> weight/bias, "cls/predictions/output_bias" -> "cls.predictions.bias",
// "cls/seq_relationship/output_weights" -> "cls.seq_relationship.weight", the classifier's
// top-level "output_weights"/"output_bias" -> "classifier.*", "cls/squad/*" -> "qa_outputs.*".
// Optimizer slots (adam_m, adam_v), global_step and the loss-scale state are not weights.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/tensor_bundle.h"

namespace bertrain::model {

struct TfWeight {
  std::string tf_name, hf_name;
  Shape shape;  // HuggingFace's (transposed for kernels)
  bool transpose = false;
};

// The HuggingFace name of a Google BERT variable, or nothing when it is not a weight.
std::optional<TfWeight> tf_weight(const data::BundleVariable& v);

// Every weight of a checkpoint, in its order.
std::vector<TfWeight> tf_weights(const data::TensorBundle& b);

// A weight's values in HuggingFace's layout (fp32).
std::vector<float> read_tf_weight(const data::TensorBundle& b, const TfWeight& w);

// Whether `path` names a TensorFlow checkpoint (a prefix, its .index, or a directory with one).
bool is_tf_checkpoint(const std::string& path);

struct ConvertReport {
  std::string
      architecture;  // BertForPreTraining, BertForMaskedLM, BertForSequenceClassification...
  size_t weights = 0, skipped = 0;
  int64_t global_step = -1;  // -1: the checkpoint has none
};

// Writes out_dir/model.safetensors (HuggingFace names, fp32) and out_dir/config.json (from
// `bert_config`: Google's bert_config.json; default: beside the checkpoint), and copies the
// vocab.txt found beside the checkpoint. The architecture follows the heads present.
ConvertReport convert_tf_checkpoint(const std::string& checkpoint, const std::string& bert_config,
                                    const std::string& out_dir);

// bert_config.json (or config.json) beside a TensorFlow checkpoint; "" if neither exists.
std::string tf_checkpoint_config(const std::string& checkpoint);

}  // namespace bertrain::model
