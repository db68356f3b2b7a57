#include "train/finetune.h"
#include "train/predict.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/safetensors.h"
#include "core/setting.h"
#include "data/example.h"
#include "data/pipeline.h"
#include "data/schema.h"
#include "data/storage.h"
#include "data/tfrecord.h"
#include "model/checkpoint.h"
#include "obs/events.h"
#include "plan/memory.h"
#include "prep/pretraining.h"
#include "tasks/ner.h"
#include "train/loss_scaler.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/run_mirror.h"
#include "train/run_state.h"
#include "train/session.h"
#include "train/step.h"

namespace bertrain::train {

namespace fs = std::filesystem;

namespace {

std::string f4(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4f", x);
  return buf;
}

bool is_text_file(const std::string& f) {
  return f.ends_with(".tsv") || f.ends_with(".txt") || f.ends_with(".json") ||
         f.ends_with(".jsonl");
}

// The pretrained model fine-tuning starts from (a run directory, a bertrain checkpoint or a
// HuggingFace directory), its config and the vocabulary and casing its tokenizer uses.
struct Pretrained {
  std::string src, vocab_path;
  model::BertConfig config;
  prep::Vocab vocab;
  bool lower = false;
};

Pretrained load_pretrained(const FinetuneConfig& cfg) {
  Pretrained p;
  p.src = resolve_checkpoint(cfg.init_checkpoint);
  if (p.src.empty()) p.src = cfg.init_checkpoint;
  p.config = model::BertConfig::load(cfg.model_config.empty() ? model::checkpoint_config_path(p.src)
                                                              : cfg.model_config);
  p.vocab_path = cfg.vocab;
  if (p.vocab_path.empty()) p.vocab_path = model::checkpoint_vocab_path(p.src);
  if (p.vocab_path.empty())
    fail(setting("vocab"), " is required (the checkpoint has no vocab.txt)");
  p.vocab = prep::Vocab::load(p.vocab_path);
  if (p.vocab.size() != p.config.vocab_size)
    fail("vocabulary ", p.vocab_path, " has ", p.vocab.size(), " tokens, the model ",
         p.config.vocab_size);
  p.lower = cfg.lower_case < 0 ? p.vocab.looks_uncased() : cfg.lower_case != 0;
  return p;
}

// A task's train and dev sets, read and encoded once: classification or regression rows (a task
// file, or classification TFRecords), tagged sentences aligned to word pieces (NER), or questions
// in windows of seq_len tokens (extractive QA).
struct TaskData {
  bool tokens = false, qa = false, regression = false;
  tasks::TaggedSet train_tagged, dev_tagged;
  tasks::TokenSet train_tok, dev_tok;
  tasks::QaOptions qo;
  tasks::QaSet train_qa, dev_qa;
  tasks::QaFeatures train_qf, dev_qf;
  tasks::LabeledSet train_set, dev;

  model::Head head() const {
    return qa       ? model::Head::QuestionAnswering
           : tokens ? model::Head::TokenClassification
                    : model::Head::SequenceClassification;
  }
  int64_t train_size() const {
    return static_cast<int64_t>(qa       ? train_qf.features.size()
                                : tokens ? train_tok.ids.size()
                                         : train_set.ids.size());
  }
  size_t dev_size() const {
    return qa ? dev_qa.examples.size() : tokens ? dev_tok.ids.size() : dev.ids.size();
  }
  // The head's outputs: one for regression, a start and an end for QA (HF's
  // BertForQuestionAnswering), else a label or tag each.
  int64_t num_labels() const {
    return regression ? 1
           : qa       ? 2
           : tokens   ? static_cast<int64_t>(train_tok.label_names.size())
                      : static_cast<int64_t>(train_set.label_names.size());
  }
  const std::vector<std::string>& label_names() const {
    return tokens ? train_tok.label_names : train_set.label_names;
  }
  std::string describe(int64_t labels) const {
    return regression ? "regression (1 output, MSE)"
           : qa       ? str("extractive QA (", qo.metric, " EM/F1)")
           : tokens   ? str(labels, " tags (entity tagging)")
                      : str(labels, " labels");
  }
  // The batch of training rows [begin, end) of `rows`.
  void fill(const std::vector<size_t>& rows, size_t begin, size_t end, int64_t seq_len,
            model::Batch& batch) const {
    if (qa)
      make_qa_batch(train_qf, rows, begin, end, seq_len, batch);
    else if (tokens)
      make_token_batch(train_tok, rows, begin, end, seq_len, batch);
    else
      make_batch(train_set, rows, begin, end, seq_len, batch);
  }
};

void say_skipped(bool say, const std::string& summary) {
  if (say) std::printf("finetune: %s\n", summary.c_str());
}

TaskData read_task(const FinetuneConfig& cfg, const prep::Tokenizer& tok,
                   const model::BertConfig& mc, bool say) {
  TaskData t;
  t.tokens = cfg.columns.tokens;
  t.qa = !cfg.columns.qa.empty();
  if (t.tokens) {
    t.train_tagged = tasks::read_tagged_file(cfg.train);
    t.train_tok = tasks::encode_tagged(t.train_tagged, tok, cfg.seq_len, {});
    if (t.train_tok.label_names.size() < 2)
      fail(cfg.train, " has ", t.train_tok.label_names.size(), " tag(s); tagging needs at least 2");
    if (t.train_tagged.skipped) say_skipped(say, t.train_tagged.skipped_summary(cfg.train));
    if (!cfg.dev.empty()) {
      t.dev_tagged = tasks::read_tagged_file(cfg.dev);
      t.dev_tok = tasks::encode_tagged(t.dev_tagged, tok, cfg.seq_len, t.train_tok.label_names);
      if (t.dev_tagged.skipped) say_skipped(say, t.dev_tagged.skipped_summary(cfg.dev));
    }
  } else if (t.qa) {
    t.qo = cfg.qa;
    t.qo.seq_len = cfg.seq_len;
    t.qo.metric = cfg.columns.qa;
    t.qo = tasks::resolve_qa_options(t.qo);
    t.train_qa = tasks::read_squad(cfg.train, true);
    t.train_qf = tasks::make_qa_features(t.train_qa, tok, t.qo);
    if (t.train_qa.skipped) say_skipped(say, t.train_qa.skipped_summary(cfg.train));
    if (!cfg.dev.empty()) {
      t.dev_qa = tasks::read_squad(cfg.dev, false);
      t.dev_qf = tasks::make_qa_features(t.dev_qa, tok, t.qo);
      if (t.dev_qa.skipped) say_skipped(say, t.dev_qa.skipped_summary(cfg.dev));
    }
    if (say)
      std::printf(
          "finetune: %zu questions -> %zu windows of %lld tokens (doc stride %lld, %lld questions "
          "cut to %lld tokens, %lld answers found away from their answer_start)\n",
          t.train_qa.examples.size(), t.train_qf.features.size(), (long long)cfg.seq_len,
          (long long)t.qo.doc_stride, (long long)t.train_qf.truncated_questions,
          (long long)t.qo.max_query_length, (long long)t.train_qa.moved);
  } else {
    t.train_set = is_text_file(cfg.train)
                      ? tasks::read_task_file(cfg.train, cfg.columns, tok, cfg.seq_len, {})
                      : tasks::read_classification_tfrecords(cfg.train, cfg.seq_len, mc.num_labels,
                                                             mc.vocab_size);
    t.regression = t.train_set.regression;
    if (!t.regression && t.num_labels() < 2)
      fail(cfg.train, " has ", t.num_labels(), " label(s); classification needs at least 2");
    if (t.regression && t.train_set.targets.empty())
      fail(cfg.train, " has no label column to learn from");
    if (t.train_set.skipped) say_skipped(say, t.train_set.skipped_summary(cfg.train));
    if (!cfg.dev.empty())
      t.dev = is_text_file(cfg.dev) ? tasks::read_task_file(cfg.dev, cfg.columns, tok, cfg.seq_len,
                                                            t.train_set.label_names)
                                    : tasks::read_classification_tfrecords(
                                          cfg.dev, cfg.seq_len, t.num_labels(), mc.vocab_size);
    if (t.dev.skipped) say_skipped(say, t.dev.skipped_summary(cfg.dev));
  }
  return t;
}

// One epoch's dev metrics (accuracy; Pearson, Spearman and MSE for regression; entity F1; QA's
// exact match and F1): appended to the result, as TensorBoard scalars and as the epoch line's
// tail. Nothing without a dev set.
struct DevScores {
  obs::Scalars values;
  std::string line;
};

DevScores score_dev(model::BertModel& m, const TaskData& t, int64_t batch_size,
                    FinetuneResult& res) {
  DevScores d;
  const size_t n = t.dev_size();
  if (n == 0) return d;
  if (t.qa) {
    const std::vector<tasks::QaAnswer> answers =
        predict_answers(m, t.dev_qa, t.dev_qf, t.qo, batch_size);
    std::vector<std::string> texts;
    for (const auto& a : answers) texts.push_back(a.text);
    const tasks::QaScores q = tasks::qa_scores(t.dev_qa, texts, t.qo.metric);
    res.dev_exact_match.push_back(q.exact_match);
    res.dev_qa_f1.push_back(q.f1);
    d.values = {{"finetune/dev_exact_match", q.exact_match}, {"finetune/dev_qa_f1", q.f1}};
    char scores[64];
    std::snprintf(scores, sizeof scores, " | dev EM %.2f, F1 %.2f", q.exact_match, q.f1);
    d.line = str(scores, " (", t.qo.metric, "; ", n, " questions, ", t.dev_qf.features.size(),
                 " windows)");
  } else if (t.tokens) {
    std::vector<std::vector<std::string>> gold;
    for (const auto& s : t.dev_tagged.sentences) gold.push_back(s.tags);
    const tasks::EntityScores e =
        tasks::entity_scores(gold, predict_tags(m, t.dev_tagged, t.dev_tok, batch_size));
    res.dev_f1.push_back(e.f1);
    d.values = {{"finetune/dev_f1", e.f1},
                {"finetune/dev_precision", e.precision},
                {"finetune/dev_recall", e.recall}};
    d.line = str(" | dev entity F1 ", f4(e.f1), " (precision ", f4(e.precision), ", recall ",
                 f4(e.recall), "; ", e.gold, " entities in ", n, " sentences)");
  } else if (t.regression) {
    const RegressionMetrics r = regress(m, t.dev, batch_size, nullptr);
    res.dev_pearson.push_back(r.pearson);
    res.dev_spearman.push_back(r.spearman);
    res.dev_mse.push_back(r.mse);
    d.values = {{"finetune/dev_pearson", r.pearson},
                {"finetune/dev_spearman", r.spearman},
                {"finetune/dev_mse", r.mse}};
    d.line = str(" | dev pearson ", f4(r.pearson), ", spearman ", f4(r.spearman), ", mse ",
                 f4(r.mse), " (", n, " examples)");
  } else {
    const double acc = classify(m, t.dev, batch_size, nullptr);
    res.dev_accuracy.push_back(acc);
    d.values = {{"finetune/dev_accuracy", acc}};
    d.line = str(" | dev accuracy ", f4(acc), " (", n, " examples)");
  }
  return d;
}

// The fine-tuned model as a HuggingFace directory: weights (a sharded master: every rank gives
// its part), config.json with the label names and the settings predict reads new files with,
// and the vocabulary.
void save_finetuned(model::BertModel& m, const FinetuneConfig& cfg, const TaskData& t,
                    const Pretrained& p, comm::Communicator& comm, bool say) {
  if (cfg.output.empty()) return;
  if (m.dims().master_shard) save_pretrained_sharded(m, cfg.output, comm);
  if (comm.rank() != 0) return;
  if (!m.dims().master_shard) model::save_pretrained(m, cfg.output);
  const fs::path cfg_path = fs::path(cfg.output) / "config.json";
  std::ifstream cin(cfg_path);
  nlohmann::json j = nlohmann::json::parse(cin);
  if (!t.regression && !t.qa) {  // a regression head keeps HF's LABEL_0 and problem_type
    const auto& names = t.label_names();
    nlohmann::json id2label, label2id;
    for (size_t i = 0; i < names.size(); ++i) {
      id2label[std::to_string(i)] = names[i];
      label2id[names[i]] = i;
    }
    j["id2label"] = id2label;
    j["label2id"] = label2id;
  }
  j["bertrain"] = {{"lower_case", p.lower}, {"seq_len", cfg.seq_len}};
  if (t.qa)  // predict builds windows and picks answers the same way
    j["bertrain"]["qa"] = {{"metric", t.qo.metric},
                           {"doc_stride", t.qo.doc_stride},
                           {"max_query_length", t.qo.max_query_length},
                           {"max_answer_length", t.qo.max_answer_length},
                           {"n_best", t.qo.n_best}};
  if (!cfg.columns.empty() || t.regression)  // predict reads new files with the same columns
    j["bertrain"]["columns"] = {{"text_a", cfg.columns.text_a},
                                {"text_b", cfg.columns.text_b},
                                {"label", cfg.columns.label},
                                {"regression", t.regression}};
  write_file_atomic(cfg_path.string(), j.dump(2) + "\n");
  fs::copy_file(p.vocab_path, fs::path(cfg.output) / "vocab.txt",
                fs::copy_options::overwrite_existing);
  if (say)
    std::printf(
        "finetune: saved %s (%s + vocab.txt; TensorBoard events and metrics.jsonl per epoch)\n",
        cfg.output.c_str(), model::head_architecture(t.head()));
}

// What the session trains: the task's head on the pretrained model's shapes, AdamW.
SessionSettings finetune_session(const FinetuneConfig& cfg, model::Head head) {
  SessionSettings s;
  s.head = head;
  s.dims = model::ModelDims{cfg.batch_size, cfg.seq_len, 0, cfg.precision};
  s.dims.unpadded = cfg.unpadded;
  s.dims.attention = cfg.attention;
  s.backend = cfg.backend;
  s.optimizer.kind = OptimizerKind::AdamW;
  s.optimizer.weight_decay = static_cast<float>(cfg.weight_decay);
  s.shard_optimizer = cfg.shard_optimizer;
  s.max_skipped_steps = cfg.max_skipped_steps;
  return s;
}

}  // namespace

FinetuneResult finetune(const FinetuneConfig& cfg) {
  using Clock = std::chrono::steady_clock;
  // Data parallel under mpirun: every rank reads the sets, takes its share of each step's
  // examples and runs the shared training step; rank 0 reports, logs and saves.
  comm::SingleProcess single;
  comm::Communicator& comm = cfg.comm ? *cfg.comm : single;
  const int rank = comm.rank(), world = comm.size();
  const bool say = !cfg.quiet && rank == 0;
  // One job per output directory: rank 0 holds it for the run (train/run_state.h); a bucket
  // prefix by its lease, and the stage by its lock.
  std::unique_ptr<RunDirLock> lock;
  std::unique_ptr<RunLease> lease;
  std::unique_ptr<RunMirror> mirror;
  if (!cfg.output.empty() && rank == 0) {
    if (!cfg.publish_to.empty()) {
      lease = std::make_unique<RunLease>(cfg.publish_to, cfg.lease_seconds);
      if (say && !lease->note().empty()) std::printf("finetune: %s\n", lease->note().c_str());
      mirror = std::make_unique<RunMirror>(cfg.publish_to, cfg.output);
    }
    lock = std::make_unique<RunDirLock>(cfg.output);
    if (say && !lock->note().empty()) std::printf("finetune: %s\n", lock->note().c_str());
  }
  const Pretrained pre = load_pretrained(cfg);
  const prep::Tokenizer tok(pre.vocab, pre.lower);
  const TaskData task = read_task(cfg, tok, pre.config, say);
  model::BertConfig mc = pre.config;
  mc.num_labels = task.num_labels();
  const model::Head head = task.head();
  Session session(mc, finetune_session(cfg, head), comm, cfg.seed);
  model::BertModel& m = session.m;
  // A token classifier or a QA model has no pooler: the pretrained one is left out.
  std::vector<std::string> ignored = {"cls."};
  if (!model::has_pooler(head)) ignored.push_back("bert.pooler.");
  const model::LoadReport rep = model::load_checkpoint_into(
      m, pre.src, {{"classifier.", "qa_outputs.", "bert.pooler."}, ignored});
  const int64_t n = task.train_size();
  // Each step takes batch_size examples per rank; with several ranks the epoch's last step
  // wraps around to its first examples (as PyTorch's DistributedSampler pads), so every rank
  // has a full batch.
  const int64_t global_batch = cfg.batch_size * world;
  const int64_t steps_per_epoch = (n + global_batch - 1) / global_batch;
  const int64_t total = steps_per_epoch * cfg.epochs;
  const LrSchedule sched{cfg.lr, 0.0, 1.0, static_cast<int64_t>(cfg.warmup * total), total};
  // A non-finite gradient skips the step in fp16 (the scale halves) and stops fp32/bf16
  // fine-tuning with a message (LossScaler::update). On one GPU the steps' results are read once
  // an epoch (StepSettings::defer: no host synchronisation between).
  StepSettings settings{1, 1.0, false, 0, cfg.seed, /*defer=*/true};
  settings.graphs = cfg.graphs;
  Step& one_step = session.start(settings);
  if (say)
    std::printf(
        "finetune: %s from %s (%zu tensors loaded), %lld train / %zu dev examples, %s, "
        "seq %lld, batch %lld, %lld epochs, adamw lr %.3g, %s, %s attention, padding %s%s\n",
        cfg.train.c_str(), pre.src.c_str(), rep.loaded.size(), (long long)n, task.dev_size(),
        task.describe(mc.num_labels).c_str(), (long long)cfg.seq_len, (long long)cfg.batch_size,
        (long long)cfg.epochs, cfg.lr, precision_name(cfg.precision), m.attention_kernel(),
        m.unpadded() ? "skipped" : "computed", one_step.graphs_summary().c_str());
  // TensorBoard events and metrics.jsonl per epoch, beside the saved model.
  std::unique_ptr<obs::EventWriter> events;
  std::unique_ptr<obs::MetricsLog> metrics;
  if (!cfg.output.empty() && rank == 0) {
    events = std::make_unique<obs::EventWriter>(cfg.output, 0);
    metrics = std::make_unique<obs::MetricsLog>(cfg.output, 0);
  }
  std::vector<size_t> order(n);
  std::vector<size_t> mine(cfg.batch_size);  // this rank's rows of a step (several ranks)
  // The batch of the step at example i of the order: one process, rows [i, i + batch) (the
  // last step may be shorter); several, this rank's rows of the global batch.
  auto fill = [&](int64_t i, model::Batch& batch) {
    if (world == 1)
      return task.fill(order, static_cast<size_t>(i),
                       static_cast<size_t>(std::min(n, i + global_batch)), cfg.seq_len, batch);
    for (int64_t k = 0; k < cfg.batch_size; ++k)
      mine[k] = order[static_cast<size_t>((i + rank * cfg.batch_size + k) % n)];
    task.fill(mine, 0, mine.size(), cfg.seq_len, batch);
  };
  FinetuneResult res;
  int64_t step = 0;
  for (int64_t epoch = 0; epoch < cfg.epochs; ++epoch) {
    for (int64_t i = 0; i < n; ++i) order[i] = static_cast<size_t>(i);
    prep::Rng(rng_key(cfg.seed, epoch, 0xf17e)).shuffle(order);
    double loss = 0;
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < n; i += global_batch, ++step) {
      // On a GPU the step reads the epoch's next batch while its backward runs (Step::run).
      const StepReport r = one_step.run(
          step, sched.at(step),
          [&](model::Batch& batch) {
            fill(one_step.reading_ahead() ? i + global_batch : i, batch);
            return true;
          },
          "", i + global_batch < n);
      if (!r.pending) loss += r.loss;
    }
    for (const StepReport& r : one_step.settle()) loss += r.loss;
    res.train_loss = loss / steps_per_epoch;
    const DevScores dev = score_dev(m, task, cfg.batch_size, res);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (events) {
      obs::Scalars values = {{"finetune/train_loss", res.train_loss},
                             {"finetune/epoch_seconds", seconds}};
      values.insert(values.end(), dev.values.begin(), dev.values.end());
      events->scalars(step, values);
      metrics->write(step, values, {{"epoch", epoch + 1}});
    }
    if (mirror) {  // the epoch's metrics and events to the bucket as they grow
      lease->check();
      mirror->sync_logs(true);
    }
    if (say) {
      std::printf("epoch %lld/%lld | train loss %.4f | %.1f s%s\n", (long long)epoch + 1,
                  (long long)cfg.epochs, res.train_loss, seconds, dev.line.c_str());
      std::fflush(stdout);
    }
  }
  save_finetuned(m, cfg, task, pre, comm, say);
  if (mirror) {
    lease->check();
    try {
      mirror->publish_model({"model.safetensors", "config.json", "vocab.txt"});
      mirror->sync_logs(true);
    } catch (const std::exception& e) {
      fail("publishing the fine-tuned model to ", cfg.publish_to, ": ", e.what(),
           "; the model is complete in ", cfg.output,
           " (its COMMIT is not in the bucket: no reader takes the files there for a model)");
    }
    if (say)
      std::printf("finetune: published %s (COMMIT names its files)\n", cfg.publish_to.c_str());
  }
  return res;
}

}  // namespace bertrain::train
