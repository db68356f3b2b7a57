// bertrain finetune: sequence classification/regression, entity tagging or extractive QA from a
// pretrained checkpoint; bertrain predict: labels, values, entities or answers for new text with
// a fine-tuned model.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/setting.h"
#include "data/object_store.h"
#include "model/checkpoint.h"
#include "plan/memory.h"
#include "tasks/ner.h"
#include "tasks/qa.h"
#include "train/finetune.h"
#include "train/predict.h"
#include "train/run_mirror.h"

namespace bertrain::cli {

tasks::TaskColumns TaskOpts::columns() const {
  tasks::TaskColumns c = task.empty() ? tasks::TaskColumns{} : tasks::task_columns(task);
  if (!text_a.empty()) c.text_a = text_a;
  if (!text_b.empty()) c.text_b = text_b;
  if (!label.empty()) c.label = label;
  c.regression = c.regression || regression;
  return c;
}

void add_task_options(CLI::App* c, TaskOpts& t) {
  c->add_option("--task", t.task,
                "Read text files as this task distributes them: " + tasks::known_tasks());
  c->add_option("--text-a-column", t.text_a,
                "Column (TSV header) or key (JSON lines) of the first text");
  c->add_option("--text-b-column", t.text_b, "Column or key of the second text (sentence pairs)");
  c->add_option("--label-column", t.label, "Column or key of the label");
  c->add_flag("--regression", t.regression,
              "The label is a number to predict (one output, mean squared error; dev Pearson and "
              "Spearman), as --task stsb");
}

void add_finetune(CLI::App& app, comm::Communicator& (*comm)()) {
  struct Opts {
    train::FinetuneConfig cfg;
    TaskOpts task;
    std::string lower = "auto", precision = "fp32", padding = "auto", device = "cpu";
    std::string stage_dir, graphs = "auto", attention = "auto";
    int threads = 0;
  };
  auto o = std::make_shared<Opts>();
  auto& f = o->cfg;
  auto* c = app.add_subcommand(
      "finetune",
      "Fine-tune a pretrained BERT: sequence classification or regression, entity tagging, "
      "extractive question answering");
  c->add_option("--init-checkpoint", f.init_checkpoint,
                "Pretrained model: run directory, checkpoint, HuggingFace directory or TensorFlow "
                "checkpoint (Google BERT: prefix, .index or directory)")
      ->required();
  c->add_option("--train", f.train,
                "Training data: a TSV (header row; by default label, text_a[, text_b]) or JSON "
                "lines (.json/.jsonl) file, or classification TFRecords; tagged sentences (--task "
                "ner); SQuAD v1.1 JSON (--task squad, cmrc2018, drcd)")
      ->required();
  c->add_option("--dev", f.dev,
                "Dev data (its own format, the same columns): accuracy (Pearson, entity F1, QA "
                "exact match and F1) after every epoch");
  add_task_options(c, o->task);
  c->add_option("--doc-stride", f.qa.doc_stride,
                "QA: context tokens shared by consecutive windows of a long context (default: "
                "min(128, half the context room of a window))");
  c->add_option("--max-query-length", f.qa.max_query_length,
                "QA: question tokens kept (the rest cut)")
      ->capture_default_str();
  c->add_option("--max-answer-length", f.qa.max_answer_length,
                "QA: longest answer predicted, in tokens")
      ->capture_default_str();
  c->add_option("--n-best", f.qa.n_best, "QA: start and end candidates per window")
      ->capture_default_str();
  c->add_option("--output", f.output,
                "Where to save the fine-tuned model (HuggingFace directory), or an object-store "
                "prefix (s3://bucket/models/x, oss://...): metrics and events uploaded after every "
                "epoch, the model's files at the end, then a COMMIT object naming them");
  c->add_option(
      "--stage-dir", o->stage_dir,
      "With an s3:// or oss:// --output: the local directory the model is written into "
      "before it is uploaded (default $TMPDIR/bertrain-stage/<scheme>/<bucket>/<prefix>)");
  c->add_option("--lease-seconds", f.lease_seconds,
                "With an s3:// or oss:// --output: the job's lease (<output>/bertrain.lock, one "
                "job per prefix) lasts this long without renewal")
      ->capture_default_str();
  c->add_option("--vocab", f.vocab, "WordPiece vocabulary (default: vocab.txt of the checkpoint)");
  c->add_option("--lower-case", o->lower, "auto, true or false")->capture_default_str();
  c->add_option("--seq-len", f.seq_len, "Tokens per example")->capture_default_str();
  c->add_option("--batch-size", f.batch_size, "Examples per step (per rank under mpirun)")
      ->capture_default_str();
  c->add_option("--epochs", f.epochs, "Passes over the training data")->capture_default_str();
  c->add_option("--lr", f.lr, "Peak learning rate (AdamW, linear warmup and decay)")
      ->capture_default_str();
  c->add_option("--warmup", f.warmup, "Warmup fraction of all steps")->capture_default_str();
  c->add_option("--weight-decay", f.weight_decay, "Decoupled weight decay")->capture_default_str();
  c->add_option("--seed", f.seed, "Seed for the head's init, dropout and data order")
      ->capture_default_str();
  c->add_flag("--shard-optimizer", f.shard_optimizer,
              "Under mpirun: each rank holds 1/ranks of the AdamW state (ZeRO stage 1)");
  c->add_option("--max-skipped-steps", f.max_skipped_steps,
                "fp16: consecutive skipped steps before giving up")
      ->capture_default_str();
  c->add_option("--precision", o->precision,
                "fp32, bf16 (bf16 matmuls, fp32 master weights) or fp16 (activations kept in "
                "fp16, dynamic loss scaling)")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "Compute threads (0: OpenMP default)")
      ->capture_default_str();
  add_attention_option(c, o->attention);
  add_padding_option(c, o->padding);
  add_device_option(c, o->device);
  add_graphs_option(c, o->graphs);
  add_dist_options(c);
  add_storage_options(c);
  c->callback([o, comm] {
    set_threads(o->threads);
    train::FinetuneConfig cfg = o->cfg;
    cfg.backend = &device_backend(o->device);
    cfg.lower_case = o->lower == "auto" ? -1 : (o->lower == "true" ? 1 : 0);
    cfg.precision = parse_precision(o->precision);
    cfg.graphs = model::parse_graph_mode(o->graphs);
    cfg.attention = model::parse_attention(o->attention);
    cfg.unpadded = parse_padding(o->padding, *cfg.backend, cfg.attention, cfg.precision);
    cfg.columns = o->task.columns();
    if (data::is_object_url(cfg.output)) {
      cfg.publish_to = cfg.output;
      cfg.output = o->stage_dir.empty() ? train::default_stage_dir(cfg.output) : o->stage_dir;
    } else if (!o->stage_dir.empty()) {
      fail("--stage-dir stages an s3:// or oss:// --output; ", cfg.output, " is a directory");
    }
    // MPI under mpirun: data parallel (--batch-size per rank); a GPU's gradients through NCCL.
    cfg.comm = &gradient_communicator(*cfg.backend, comm());
    train::finetune(cfg);
  });
}

void add_predict(CLI::App& app) {
  struct Opts {
    std::string checkpoint, input, precision = "fp32", device = "cpu";
    TaskOpts task;
    int64_t batch = 32;
    int threads = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "predict", "Labels (or values, for a regression model) for new text with a fine-tuned model");
  c->add_option("--checkpoint", o->checkpoint, "A directory written by bertrain finetune")
      ->required();
  c->add_option("--input", o->input,
                "TSV or JSON lines with the texts (and labels, to report accuracy); the columns "
                "the model was fine-tuned with unless told. An entity tagger reads CLUENER JSON "
                "lines (.json) or CoNLL columns and writes JSON lines with the entities")
      ->required();
  add_task_options(c, o->task);
  c->add_option("--batch-size", o->batch, "Examples per batch")->capture_default_str();
  c->add_option("--precision", o->precision,
                "fp32, bf16 or fp16: the matmuls' precision, as in train (bf16 needs AVX-512)")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "Compute threads (0: OpenMP default)")
      ->capture_default_str();
  add_device_option(c, o->device);
  c->callback([o] {
    set_threads(o->threads);
    const Precision precision = parse_precision(o->precision);
    const kernels::Backend& be = device_backend(o->device);
    const std::string cfg_path = model::checkpoint_config_path(o->checkpoint);
    std::ifstream in(cfg_path);
    const nlohmann::json j = nlohmann::json::parse(in);
    const model::BertConfig mc = model::BertConfig::from_json(j, cfg_path);
    const bool regression = mc.num_labels == 1;  // HF's rule: one output is a regression head
    std::vector<std::string> names(regression ? 0 : mc.num_labels);
    for (size_t i = 0; i < names.size(); ++i)
      names[i] = j.contains("id2label") && j["id2label"].is_object()
                     ? j["id2label"].value(std::to_string(i), std::to_string(i))
                     : std::to_string(i);
    const auto bt = j.value("bertrain", nlohmann::json::object());
    const int64_t seq = bt.value("seq_len", int64_t{128});
    const prep::Vocab vocab =
        prep::Vocab::load((std::filesystem::path(o->checkpoint) / "vocab.txt").string());
    const prep::Tokenizer tok(vocab, bt.value("lower_case", vocab.looks_uncased()));
    const std::string arch =
        j.value("architectures", nlohmann::json::array({""})).at(0).get<std::string>();
    if (arch == "BertForQuestionAnswering") {
      // Extractive QA: one JSON line per question with its answer and where it is in the context;
      // exact match and F1 on stderr when the file has answers.
      const auto q = bt.value("qa", nlohmann::json::object());
      tasks::QaOptions qo;
      qo.seq_len = seq;
      qo.metric = q.value("metric", std::string("squad"));
      qo.doc_stride = q.value("doc_stride", int64_t{-1});
      qo.max_query_length = q.value("max_query_length", qo.max_query_length);
      qo.max_answer_length = q.value("max_answer_length", qo.max_answer_length);
      qo.n_best = q.value("n_best", qo.n_best);
      if (!o->task.task.empty()) {
        const tasks::TaskColumns cols = o->task.columns();
        if (cols.qa.empty()) fail(setting("task"), " ", o->task.task, " is not a QA task");
        qo.metric = cols.qa;
      }
      qo = tasks::resolve_qa_options(qo);
      const tasks::QaSet s = tasks::read_squad(o->input, false);
      if (s.skipped) std::fprintf(stderr, "predict: %s\n", s.skipped_summary(o->input).c_str());
      const tasks::QaFeatures f = tasks::make_qa_features(s, tok, qo);
      const model::ModelDims dims = train::with_precision({o->batch, seq, 0}, precision);
      plan::check_device_fits(mc, model::Head::QuestionAnswering, dims, 0, 1, be);
      model::BertModel m(mc, model::Head::QuestionAnswering, dims, be);
      model::load_safetensors_into(m, model::checkpoint_weights_path(o->checkpoint));
      const std::vector<tasks::QaAnswer> answers = train::predict_answers(m, s, f, qo, o->batch);
      std::vector<std::string> texts;
      bool scored = true;
      for (size_t i = 0; i < answers.size(); ++i) {
        const nlohmann::json line = {{"id", s.examples[i].id},
                                     {"answer", answers[i].text},
                                     {"start", answers[i].begin},
                                     {"end", answers[i].end},
                                     {"score", answers[i].score}};
        std::printf("%s\n",
                    line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
        texts.push_back(answers[i].text);
        scored &= !s.examples[i].answers.empty();
      }
      if (scored) {
        const tasks::QaScores r = tasks::qa_scores(s, texts, qo.metric);
        std::fprintf(stderr,
                     "predict: exact match %.2f, F1 %.2f (%s evaluation; %lld questions, %zu "
                     "windows)\n",
                     r.exact_match, r.f1, qo.metric.c_str(), (long long)r.total, f.features.size());
      }
      return;
    }
    if (arch == "BertForTokenClassification") {
      // Entity tagging: one JSON line per sentence with its entities as character spans of the
      // sentence's text (end exclusive) and every word's tag.
      const tasks::TaggedSet s = tasks::read_tagged_file(o->input);
      if (s.skipped) std::fprintf(stderr, "predict: %s\n", s.skipped_summary(o->input).c_str());
      const tasks::TokenSet t = tasks::encode_tagged(s, tok, seq, names);
      model::ModelDims dims{o->batch, seq, 0};
      dims.unpadded = true;  // the padded model's tags, at the real tokens' cost
      dims = train::with_precision(dims, precision);
      plan::check_device_fits(mc, model::Head::TokenClassification, dims, 0, 1, be);
      model::BertModel m(mc, model::Head::TokenClassification, dims, be);
      model::load_safetensors_into(m, model::checkpoint_weights_path(o->checkpoint));
      const auto tags = train::predict_tags(m, s, t, o->batch);
      std::vector<std::vector<std::string>> gold;
      for (size_t i = 0; i < s.sentences.size(); ++i) {
        nlohmann::json ents = nlohmann::json::array();
        for (const auto& e : tasks::entity_spans(s.sentences[i], tags[i]))
          ents.push_back({{"type", e.type}, {"text", e.text}, {"start", e.start}, {"end", e.end}});
        const nlohmann::json line = {
            {"text", s.sentences[i].text}, {"entities", ents}, {"tags", tags[i]}};
        std::printf("%s\n",
                    line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
        if (!s.sentences[i].tags.empty()) gold.push_back(s.sentences[i].tags);
      }
      if (gold.size() == tags.size()) {
        const tasks::EntityScores e = tasks::entity_scores(gold, tags);
        std::fprintf(stderr,
                     "predict: entity precision %.4f, recall %.4f, F1 %.4f (%lld of %lld entities "
                     "found, %lld predicted; %zu sentences, %lld truncated)\n",
                     e.precision, e.recall, e.f1, (long long)e.correct, (long long)e.gold,
                     (long long)e.predicted, tags.size(), (long long)t.truncated);
      }
      return;
    }
    tasks::TaskColumns cols = o->task.columns();
    if (cols.empty() && bt.contains("columns")) {
      cols.text_a = bt["columns"].value("text_a", "");
      cols.text_b = bt["columns"].value("text_b", "");
      cols.label = bt["columns"].value("label", "");
    }
    cols.regression = regression;
    tasks::LabeledSet s = tasks::read_task_file(o->input, cols, tok, seq, names);
    model::ModelDims dims{o->batch, seq, 0};
    dims.unpadded = true;  // the padded model's predictions, at the real tokens' cost
    dims = train::with_precision(dims, precision);
    plan::check_device_fits(mc, model::Head::SequenceClassification, dims, 0, 1, be);
    model::BertModel m(mc, model::Head::SequenceClassification, dims, be);
    model::load_safetensors_into(m, model::checkpoint_weights_path(o->checkpoint));
    // One output line per data row of the input: a row that could not be used gets "-" (and is
    // reported on stderr), so that line i is still row i.
    const std::string skipped = s.skipped_summary(o->input);
    if (!skipped.empty()) std::fprintf(stderr, "predict: %s\n", skipped.c_str());
    auto print_rows = [&](size_t n, const std::function<void(size_t)>& print) {
      size_t next = 0, k = 0;
      for (size_t row = 0; next < n; ++row) {
        if (k < s.skipped_rows.size() && s.skipped_rows[k] == static_cast<int64_t>(row)) {
          std::printf("-\n");
          ++k;
          continue;
        }
        print(next++);
      }
      for (; k < s.skipped_rows.size(); ++k) std::printf("-\n");  // trailing unusable rows
    };
    if (regression) {
      std::vector<float> values;
      const train::RegressionMetrics r = train::regress(m, s, o->batch, &values);
      print_rows(values.size(), [&](size_t i) { std::printf("%.6g\n", values[i]); });
      if (!s.targets.empty())
        std::fprintf(stderr,
                     "predict: pearson %.4f, spearman %.4f, mse %.4f on %zu labelled examples\n",
                     r.pearson, r.spearman, r.mse, values.size());
      return;
    }
    std::vector<train::Prediction> preds;
    const double acc = train::classify(m, s, o->batch, &preds);
    print_rows(preds.size(), [&](size_t i) {
      std::printf("%s\t%.4f\n", names[preds[i].label].c_str(), preds[i].probs[preds[i].label]);
    });
    if (!s.labels.empty() && s.labels[0] >= 0)
      std::fprintf(stderr, "predict: accuracy %.4f on %zu labelled examples\n", acc, preds.size());
  });
}

}  // namespace bertrain::cli
