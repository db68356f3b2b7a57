// bertrain init: a freshly initialised model (BERT's truncated-normal init, seeded) written as a
// HuggingFace checkpoint directory (model.safetensors + config.json).
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "model/checkpoint.h"

namespace bertrain::cli {

void add_init(CLI::App& app) {
  struct Opts {
    std::string config, output, head = "pretraining", dtype = "F32";
    uint64_t seed = 42;
    int64_t num_labels = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* c =
      app.add_subcommand("init", "Write a freshly initialised model as a HuggingFace checkpoint");
  c->add_option("--model-config", o->config, "HuggingFace config.json of the model")->required();
  c->add_option("--output", o->output, "Directory to write model.safetensors and config.json")
      ->required();
  c->add_option("--head", o->head,
                "pretraining, classification, token-classification or question-answering")
      ->capture_default_str();
  c->add_option("--num-labels", o->num_labels,
                "Classes of the classification head (default: from the config)");
  c->add_option("--seed", o->seed, "Initialisation seed")->capture_default_str();
  c->add_option("--dtype", o->dtype, "Storage dtype: F32, BF16 or F16")->capture_default_str();
  c->callback([o] {
    model::BertConfig cfg = model::BertConfig::load(o->config);
    if (o->num_labels > 0) cfg.num_labels = o->num_labels;
    const model::Head head = parse_head(o->head);
    const DType dt = dtype_from_name(o->dtype);
    if (dt != DType::F32 && dt != DType::BF16 && dt != DType::F16)
      fail("--dtype must be F32, BF16 or F16");
    model::BertModel m(cfg, head, {1, 1, 0});
    m.init_params(o->seed);
    model::save_pretrained(m, o->output, dt);
    std::printf("wrote %s/model.safetensors (%s, %s, %zu tensors, seed %llu)\n", o->output.c_str(),
                model::head_architecture(head), describe(cfg).c_str(), m.table().params().size(),
                (unsigned long long)o->seed);
  });
}

}  // namespace bertrain::cli
