// HuggingFace-compatible model files: model.safetensors with HF parameter names + config.json;
// and Google BERT's TensorFlow checkpoints, read in place (tf_checkpoint.h).
// Loading accepts the spellings HF itself accepts: with or without the "bert." prefix (BertModel
// vs BertFor* checkpoints), LayerNorm gamma/beta, the tied cls.predictions.decoder.* copies, and
// the position_ids buffer. Missing or unexpected tensors and shape mismatches are errors that
// list every offending name with both shapes.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "model/bert.h"

namespace bertrain::model {

struct LoadOptions {
  // Tensors of the model that may be absent from the file (keep their initialisation), as when
  // fine-tuning a classifier from a pretraining checkpoint: "classifier." and/or "cls.".
  std::vector<std::string> allow_missing_prefixes;
  // Tensors in the file the model does not have that are skipped rather than an error.
  std::vector<std::string> ignore_unexpected_prefixes;
};

struct LoadReport {
  std::vector<std::string> loaded, missing_allowed, ignored;
};

LoadReport load_safetensors_into(BertModel& m, const std::string& path,
                                 const LoadOptions& opt = {});
// A checkpoint of any kind: a bertrain/HuggingFace directory or .safetensors file, or a
// TensorFlow checkpoint (prefix, .index or directory) with Google BERT's variable names
// (tf_checkpoint.h; optimizer slots and global_step are reported as ignored).
LoadReport load_checkpoint_into(BertModel& m, const std::string& path, const LoadOptions& opt = {});

// Writes dir/model.safetensors (dtype F32, F16 or BF16) and dir/config.json, atomically.
// Tensors the model does not hold whole in fp32 (BertModel::holds_fp32: a sharded master) are
// written from `gather`, which fills a buffer of the tensor's numel floats (the ranks' parts).
using ParamGather = std::function<void(const ParamInfo&, float*)>;
void save_pretrained(const BertModel& m, const std::string& dir, DType dtype = DType::F32,
                     const ParamGather& gather = {});

// Finds config.json and model.safetensors in a checkpoint directory (or accepts the file).
std::string checkpoint_weights_path(const std::string& dir_or_file);
// config.json (or a TensorFlow checkpoint's bert_config.json).
std::string checkpoint_config_path(const std::string& dir_or_file);
// vocab.txt in the checkpoint's directory, "" when there is none.
std::string checkpoint_vocab_path(const std::string& dir_or_file);

}  // namespace bertrain::model
