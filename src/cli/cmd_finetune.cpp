// bertrain finetune: sequence classification from a pretrained checkpoint; bertrain predict:
// labels for new text with a fine-tuned model.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "model/checkpoint.h"
#include "train/finetune.h"

namespace bertrain::cli {

namespace {
// --task and the column flags: a preset's columns, each overridden by its flag.
struct TaskOpts {
  std::string task, text_a, text_b, label;
  train::TaskColumns columns() const {
    train::TaskColumns c = task.empty() ? train::TaskColumns{} : train::task_columns(task);
    if (!text_a.empty()) c.text_a = text_a;
    if (!text_b.empty()) c.text_b = text_b;
    if (!label.empty()) c.label = label;
    return c;
  }
};

void add_task_options(CLI::App* c, TaskOpts& t) {
  c->add_option("--task", t.task,
                "Read text files as this task distributes them: " + train::known_tasks());
  c->add_option("--text-a-column", t.text_a,
                "Column (TSV header) or key (JSON lines) of the first text");
  c->add_option("--text-b-column", t.text_b, "Column or key of the second text (sentence pairs)");
  c->add_option("--label-column", t.label, "Column or key of the label");
}
}  // namespace

void add_finetune(CLI::App& app) {
  struct Opts {
    train::FinetuneConfig cfg;
    TaskOpts task;
    std::string lower = "auto", precision = "fp32";
    int threads = 0;
  };
  auto o = std::make_shared<Opts>();
  auto& f = o->cfg;
  auto* c =
      app.add_subcommand("finetune", "Fine-tune a pretrained BERT for sequence classification");
  c->add_option("--init-checkpoint", f.init_checkpoint,
                "Pretrained model: run directory, checkpoint, HuggingFace directory or TensorFlow "
                "checkpoint (Google BERT: prefix, .index or directory)")
      ->required();
  c->add_option("--train", f.train,
                "Training data: a TSV (header row; by default label, text_a[, text_b]) or JSON "
                "lines (.json/.jsonl) file, or classification TFRecords")
      ->required();
  c->add_option("--dev", f.dev,
                "Dev data (its own format, the same columns): accuracy after every epoch");
  add_task_options(c, o->task);
  c->add_option("--output", f.output, "Where to save the fine-tuned model (HuggingFace directory)");
  c->add_option("--vocab", f.vocab, "WordPiece vocabulary (default: vocab.txt of the checkpoint)");
  c->add_option("--lower-case", o->lower, "auto, true or false")->capture_default_str();
  c->add_option("--seq-len", f.seq_len, "Tokens per example")->capture_default_str();
  c->add_option("--batch-size", f.batch_size, "Examples per step")->capture_default_str();
  c->add_option("--epochs", f.epochs, "Passes over the training data")->capture_default_str();
  c->add_option("--lr", f.lr, "Peak learning rate (AdamW, linear warmup and decay)")
      ->capture_default_str();
  c->add_option("--warmup", f.warmup, "Warmup fraction of all steps")->capture_default_str();
  c->add_option("--weight-decay", f.weight_decay, "Decoupled weight decay")->capture_default_str();
  c->add_option("--seed", f.seed, "Seed for the head's init, dropout and data order")
      ->capture_default_str();
  c->add_option("--precision", o->precision,
                "fp32, bf16 (bf16 matmuls, fp32 master weights) or fp16 (activations kept in "
                "fp16, dynamic loss scaling)")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "Compute threads (0: OpenMP default)")
      ->capture_default_str();
  c->callback([o] {
    set_threads(o->threads);
    train::FinetuneConfig cfg = o->cfg;
    cfg.lower_case = o->lower == "auto" ? -1 : (o->lower == "true" ? 1 : 0);
    cfg.precision = train::parse_precision(o->precision);
    cfg.columns = o->task.columns();
    train::finetune(cfg);
  });
}

void add_predict(CLI::App& app) {
  struct Opts {
    std::string checkpoint, input;
    TaskOpts task;
    int64_t batch = 32;
    int threads = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("predict", "Labels for new text with a fine-tuned classifier");
  c->add_option("--checkpoint", o->checkpoint, "A directory written by bertrain finetune")
      ->required();
  c->add_option("--input", o->input,
                "TSV or JSON lines with the texts (and labels, to report accuracy); the columns "
                "the model was fine-tuned with unless told")
      ->required();
  add_task_options(c, o->task);
  c->add_option("--batch-size", o->batch, "Examples per batch")->capture_default_str();
  c->add_option("--threads", o->threads, "Compute threads (0: OpenMP default)")
      ->capture_default_str();
  c->callback([o] {
    set_threads(o->threads);
    const std::string cfg_path = model::checkpoint_config_path(o->checkpoint);
    std::ifstream in(cfg_path);
    const nlohmann::json j = nlohmann::json::parse(in);
    const model::BertConfig mc = model::BertConfig::from_json(j, cfg_path);
    std::vector<std::string> names(mc.num_labels);
    for (int64_t i = 0; i < mc.num_labels; ++i)
      names[i] = j["id2label"].value(std::to_string(i), std::to_string(i));
    const auto bt = j.value("bertrain", nlohmann::json::object());
    const int64_t seq = bt.value("seq_len", int64_t{128});
    const data::Vocab vocab =
        data::Vocab::load((std::filesystem::path(o->checkpoint) / "vocab.txt").string());
    const data::Tokenizer tok(vocab, bt.value("lower_case", vocab.looks_uncased()));
    train::TaskColumns cols = o->task.columns();
    if (cols.empty() && bt.contains("columns"))
      cols = {bt["columns"].value("text_a", ""), bt["columns"].value("text_b", ""),
              bt["columns"].value("label", "")};
    train::LabeledSet s = train::read_task_file(o->input, cols, tok, seq, names);
    model::BertModel m(mc, model::Head::SequenceClassification, {o->batch, seq, 0});
    model::load_safetensors_into(m, model::checkpoint_weights_path(o->checkpoint));
    std::vector<train::Prediction> preds;
    const double acc = train::classify(m, s, o->batch, &preds);
    for (const auto& p : preds) std::printf("%s\t%.4f\n", names[p.label].c_str(), p.probs[p.label]);
    if (!s.labels.empty() && s.labels[0] >= 0)
      std::fprintf(stderr, "predict: accuracy %.4f on %zu labelled examples\n", acc, preds.size());
  });
}

}  // namespace bertrain::cli
