// bertrain convert: a Google BERT TensorFlow checkpoint (the original releases, run_pretraining,
// run_classifier, run_squad) as a HuggingFace directory: model.safetensors + config.json (+ the
// vocab.txt beside the checkpoint). Every --init-checkpoint also reads TF checkpoints in place;
// converting once saves the transposes at every start and gives transformers a directory.
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "model/checkpoint.h"
#include "model/tf_checkpoint.h"

namespace bertrain::cli {

void add_convert(CLI::App& app) {
  struct Opts {
    std::string checkpoint, output, config;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "convert", "Convert a TensorFlow BERT checkpoint to a HuggingFace directory (safetensors)");
  c->add_option("checkpoint", o->checkpoint,
                "TF checkpoint: its prefix (.../bert_model.ckpt), its .index file, or its "
                "directory")
      ->required();
  c->add_option("output", o->output, "Directory to write model.safetensors and config.json")
      ->required();
  c->add_option("--model-config", o->config,
                "Google's bert_config.json (default: the one beside the checkpoint)");
  c->callback([o] {
    const model::ConvertReport r =
        model::convert_tf_checkpoint(o->checkpoint, o->config, o->output);
    const std::string cfg_path = model::checkpoint_config_path(o->output);
    const model::BertConfig cfg = model::BertConfig::load(cfg_path);
    std::printf("convert: %s", o->checkpoint.c_str());
    if (r.global_step >= 0) std::printf(" (global step %lld)", (long long)r.global_step);
    std::printf(
        "\n  %zu weights as %s (%s), %zu optimizer/training variables left out\n  wrote %s "
        "(model.safetensors, config.json%s)\n",
        r.weights, r.architecture.c_str(), describe(cfg).c_str(), r.skipped, o->output.c_str(),
        model::checkpoint_vocab_path(o->output).empty() ? "" : ", vocab.txt");
  });
}

}  // namespace bertrain::cli
