#include "train/finetune.h"

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

#include "core/error.h"
#include "core/safetensors.h"
#include "core/setting.h"
#include "data/pipeline.h"
#include "data/pretraining.h"
#include "data/schema.h"
#include "data/tfrecord.h"
#include "model/checkpoint.h"
#include "obs/events.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/run_state.h"
#include "train/step.h"

namespace bertrain::train {

namespace fs = std::filesystem;

namespace {

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t t = line.find('\t', start);
    out.push_back(line.substr(start, t == std::string::npos ? std::string::npos : t - start));
    if (t == std::string::npos) break;
    start = t + 1;
  }
  return out;
}

std::string str_join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& x : v) out += (out.empty() ? "'" : ", '") + x + "'";
  return out;
}

bool is_int(const std::string& s) {
  if (s.empty()) return false;
  for (size_t i = s[0] == '-' ? 1 : 0; i < s.size(); ++i)
    if (s[i] < '0' || s[i] > '9') return false;
  return s != "-";
}

}  // namespace

TaskColumns task_columns(const std::string& task) {
  static const std::map<std::string, TaskColumns> tasks = {
      // GLUE (TSV, header row)
      {"sst2", {"sentence", "", "label"}},
      {"mrpc", {"#1 String", "#2 String", "Quality"}},
      {"qqp", {"question1", "question2", "is_duplicate"}},
      {"qnli", {"question", "sentence", "label"}},
      {"rte", {"sentence1", "sentence2", "label"}},
      {"wnli", {"sentence1", "sentence2", "label"}},
      {"mnli", {"sentence1", "sentence2", "gold_label"}},
      // CLUE (JSON lines)
      {"afqmc", {"sentence1", "sentence2", "label"}},
      {"tnews", {"sentence", "", "label"}},
      {"iflytek", {"sentence", "", "label"}},
      {"cmnli", {"sentence1", "sentence2", "label"}},
      {"ocnli", {"sentence1", "sentence2", "label"}},
  };
  std::string key;
  for (char ch : task)
    if (ch != '-' && ch != '_')
      key += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  auto it = tasks.find(key);
  if (it == tasks.end())
    fail("unknown ", setting("task"), " '", task, "'; known: ", known_tasks(),
         " (or name the columns with ", setting("text_a_column"), ", ", setting("text_b_column"),
         ", ", setting("label_column"), ")");
  return it->second;
}

std::string known_tasks() {
  return "sst2, mrpc, qqp, qnli, rte, wnli, mnli (GLUE TSV); afqmc, tnews, iflytek, cmnli, ocnli "
         "(CLUE JSON lines)";
}

namespace {

// [CLS] a [SEP] (b [SEP]) with longest-first truncation to seq_len, as HuggingFace.
void add_example(LabeledSet& s, const data::Tokenizer& tok, int64_t seq_len,
                 const std::string& a_text, const std::string* b_text) {
  std::vector<int32_t> a, b;
  tok.encode(a_text, a);
  if (b_text) tok.encode(*b_text, b);
  const size_t budget = static_cast<size_t>(seq_len) - (b_text ? 3 : 2);
  while (a.size() + b.size() > budget) (a.size() >= b.size() ? a : b).pop_back();
  std::vector<int32_t> ids = {tok.vocab().cls()}, seg = {0};
  ids.insert(ids.end(), a.begin(), a.end());
  ids.push_back(tok.vocab().sep());
  seg.resize(ids.size(), 0);
  if (b_text) {
    ids.insert(ids.end(), b.begin(), b.end());
    ids.push_back(tok.vocab().sep());
    seg.resize(ids.size(), 1);
  }
  s.ids.push_back(std::move(ids));
  s.segments.push_back(std::move(seg));
}

// The columns to read: given, or found by name among `names` (a header, or a first JSON line's
// keys). A file that looks like sentence pairs but has no text_b column found is an error, not a
// silent single-sentence read.
TaskColumns resolve_columns(const std::string& path, const TaskColumns& given,
                            const std::vector<std::string>& names) {
  auto has = [&](const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  if (!given.empty()) {
    for (const std::string* c : {&given.text_a, &given.text_b})
      if (!c->empty() && !has(*c))
        fail(path, " has no column '", *c, "' (it has: ", str_join(names), ")");
    if (given.text_a.empty())
      fail(path, ": the text column is not named (", setting("text_a_column"), ")");
    return given;
  }
  TaskColumns c;
  for (const char* n : {"text_a", "text", "sentence"})
    if (c.text_a.empty() && has(n)) c.text_a = n;
  if (has("text_b")) c.text_b = "text_b";
  if (has("label")) c.label = "label";
  if (c.text_a.empty())
    fail(path, ": no text_a column (its columns: ", str_join(names), "); pass ", setting("task"),
         " for a GLUE/CLUE file, or ", setting("text_a_column"), " (and ", setting("text_b_column"),
         ", ", setting("label_column"), ")");
  for (const char* pair : {"question", "sentence1", "sentence2", "question1", "#1 String"})
    if (c.text_b.empty() && has(pair))
      fail(path, ": looks like sentence pairs (it has a '", pair,
           "' column) but no text_b column; pass ", setting("task"), " or ",
           setting("text_a_column"), " and ", setting("text_b_column"));
  return c;
}

}  // namespace

LabeledSet read_task_file(const std::string& path, const TaskColumns& columns,
                          const data::Tokenizer& tok, int64_t seq_len,
                          std::vector<std::string> label_names) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open ", path);
  const bool jsonl = path.ends_with(".json") || path.ends_with(".jsonl");
  std::string line;
  std::vector<std::string> raw_labels;
  LabeledSet s;
  int64_t lineno = 0;
  auto strip = [](std::string& l) {
    if (!l.empty() && l.back() == '\r') l.pop_back();
    if (l.compare(0, 3, "\xEF\xBB\xBF") == 0) l.erase(0, 3);  // a BOM (MRPC has one)
  };
  TaskColumns c;
  bool has_label = false;
  if (jsonl) {
    while (std::getline(in, line)) {
      ++lineno;
      strip(line);
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        fail(path, ":", lineno, ": not a JSON object (", e.what(), ")");
      }
      if (!j.is_object()) fail(path, ":", lineno, ": not a JSON object");
      if (c.text_a.empty()) {
        std::vector<std::string> keys;
        for (const auto& [k, _] : j.items()) keys.push_back(k);
        c = resolve_columns(path, columns, keys);
        has_label = !c.label.empty() && j.contains(c.label);
      }
      auto field = [&](const std::string& key) {
        if (!j.contains(key)) fail(path, ":", lineno, ": no '", key, "' key");
        const auto& v = j[key];
        return v.is_string() ? v.get<std::string>() : v.dump();
      };
      const std::string a = field(c.text_a);
      const std::string b = c.text_b.empty() ? "" : field(c.text_b);
      add_example(s, tok, seq_len, a, c.text_b.empty() ? nullptr : &b);
      raw_labels.push_back(has_label ? field(c.label) : "");
    }
  } else {
    if (!std::getline(in, line))
      fail(path, " is empty (expected a header row naming the columns, e.g. label<TAB>text_a)");
    ++lineno;
    strip(line);
    const auto header = split_tabs(line);
    c = resolve_columns(path, columns, header);
    auto index = [&](const std::string& n) {
      return n.empty()
                 ? -1
                 : static_cast<int>(std::find(header.begin(), header.end(), n) - header.begin());
    };
    const int col_a = index(c.text_a), col_b = index(c.text_b);
    int col_label = index(c.label);
    if (col_label >= static_cast<int>(header.size())) col_label = -1;  // unlabelled (test) file
    has_label = col_label >= 0;
    const int need = std::max({col_label, col_a, col_b});
    while (std::getline(in, line)) {
      ++lineno;
      strip(line);
      if (line.empty()) continue;
      const auto cols = split_tabs(line);
      if (static_cast<int>(cols.size()) <= need)
        fail(path, ":", lineno, ": ", cols.size(), " columns, the header has ", header.size());
      add_example(s, tok, seq_len, cols[col_a], col_b >= 0 ? &cols[col_b] : nullptr);
      raw_labels.push_back(has_label ? cols[col_label] : "");
    }
  }
  if (s.ids.empty()) fail(path, " has no examples");
  if (has_label) {
    if (label_names.empty()) {
      std::set<std::string> uniq(raw_labels.begin(), raw_labels.end());
      label_names.assign(uniq.begin(), uniq.end());
      if (std::all_of(label_names.begin(), label_names.end(), is_int))
        std::sort(label_names.begin(), label_names.end(),
                  [](const std::string& x, const std::string& y) {
                    return std::stoll(x) < std::stoll(y);
                  });
    }
    std::map<std::string, int32_t> index;
    for (size_t i = 0; i < label_names.size(); ++i) index[label_names[i]] = static_cast<int32_t>(i);
    for (size_t i = 0; i < raw_labels.size(); ++i) {
      auto it = index.find(raw_labels[i]);
      if (it == index.end())
        fail(path, ": label '", raw_labels[i], "' does not occur in the training labels (",
             label_names.size(), " known)");
      s.labels.push_back(it->second);
    }
  } else {
    s.labels.assign(s.ids.size(), -1);
  }
  s.label_names = label_names;
  return s;
}

LabeledSet read_tsv(const std::string& path, const data::Tokenizer& tok, int64_t seq_len,
                    std::vector<std::string> label_names) {
  return read_task_file(path, {}, tok, seq_len, std::move(label_names));
}

LabeledSet read_classification_tfrecords(const std::string& files, int64_t seq_len,
                                         int64_t num_labels, int64_t vocab_size) {
  data::Schema schema = data::Schema::classification(seq_len, num_labels, vocab_size);
  LabeledSet s;
  data::ParsedExample ex;
  std::string err, rec;
  for (const auto& f : data::list_files(files)) {
    data::TFRecordReader r(f, data::resolve_compression("auto", f));
    while (r.next(rec)) {
      if (!schema.parse(rec, ex, err)) fail(f, ": record ", r.records() - 1, ": ", err);
      int64_t len = 0;
      while (len < seq_len && ex.ints[seq_len + len]) ++len;  // input_mask
      s.ids.emplace_back(ex.ints.begin(), ex.ints.begin() + len);
      s.segments.emplace_back(ex.ints.begin() + 2 * seq_len, ex.ints.begin() + 2 * seq_len + len);
      s.labels.push_back(ex.ints[3 * seq_len]);
    }
  }
  for (int64_t i = 0; i < num_labels; ++i) s.label_names.push_back(std::to_string(i));
  if (s.ids.empty()) fail(files, " has no examples");
  return s;
}

void make_batch(const LabeledSet& s, const std::vector<size_t>& order, size_t begin, size_t end,
                int64_t seq_len, model::Batch& b) {
  b.resize(static_cast<int64_t>(end - begin), seq_len, 0);
  for (size_t r = begin; r < end; ++r) {
    const size_t i = order[r];
    const int64_t row = static_cast<int64_t>(r - begin);
    for (size_t t = 0; t < s.ids[i].size(); ++t) {
      b.input_ids[row * seq_len + t] = s.ids[i][t];
      b.input_mask[row * seq_len + t] = 1;
      b.segment_ids[row * seq_len + t] = s.segments[i][t];
    }
    b.label_ids[row] = std::max(0, s.labels[i]);
  }
}

double classify(model::BertModel& m, const LabeledSet& s, int64_t batch_size,
                std::vector<Prediction>* out) {
  std::vector<size_t> order(s.ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const int64_t NL = m.config().num_labels;
  model::Batch b;
  int64_t correct = 0, labeled = 0;
  for (size_t i = 0; i < order.size(); i += batch_size) {
    const size_t end = std::min(order.size(), i + batch_size);
    make_batch(s, order, i, end, m.dims().seq_len, b);
    m.forward(b, {});
    const float* logits = m.cls_logits();
    for (size_t r = i; r < end; ++r) {
      const float* l = logits + (r - i) * NL;
      const int32_t arg = static_cast<int32_t>(std::max_element(l, l + NL) - l);
      if (s.labels[r] >= 0) {
        ++labeled;
        correct += arg == s.labels[r];
      }
      if (out) {
        Prediction p{arg, std::vector<float>(NL)};
        const float mx = l[arg];
        double sum = 0;
        for (int64_t k = 0; k < NL; ++k) sum += std::exp(l[k] - mx);
        for (int64_t k = 0; k < NL; ++k) p.probs[k] = static_cast<float>(std::exp(l[k] - mx) / sum);
        out->push_back(std::move(p));
      }
    }
  }
  return labeled ? static_cast<double>(correct) / labeled : 0.0;
}

FinetuneResult finetune(const FinetuneConfig& cfg) {
  using Clock = std::chrono::steady_clock;
  // The pretrained model: a run directory, a bertrain checkpoint or a HuggingFace directory.
  std::string src = resolve_checkpoint(cfg.init_checkpoint);
  if (src.empty()) src = cfg.init_checkpoint;
  model::BertConfig mc = model::BertConfig::load(
      cfg.model_config.empty() ? model::checkpoint_config_path(src) : cfg.model_config);
  std::string vocab_path = cfg.vocab;
  if (vocab_path.empty()) vocab_path = model::checkpoint_vocab_path(src);
  if (vocab_path.empty()) fail(setting("vocab"), " is required (the checkpoint has no vocab.txt)");
  const data::Vocab vocab = data::Vocab::load(vocab_path);
  if (vocab.size() != mc.vocab_size)
    fail("vocabulary ", vocab_path, " has ", vocab.size(), " tokens, the model ", mc.vocab_size);
  const bool lower = cfg.lower_case < 0 ? vocab.looks_uncased() : cfg.lower_case != 0;
  const data::Tokenizer tok(vocab, lower);
  // Train and dev each in their own format: a task file (TSV, JSON lines), or classification
  // TFRecords.
  auto is_text = [](const std::string& f) {
    return f.ends_with(".tsv") || f.ends_with(".txt") || f.ends_with(".json") ||
           f.ends_with(".jsonl");
  };
  LabeledSet train_set =
      is_text(cfg.train)
          ? read_task_file(cfg.train, cfg.columns, tok, cfg.seq_len, {})
          : read_classification_tfrecords(cfg.train, cfg.seq_len, mc.num_labels, mc.vocab_size);
  mc.num_labels = static_cast<int64_t>(train_set.label_names.size());
  if (mc.num_labels < 2)
    fail(cfg.train, " has ", mc.num_labels, " label(s); classification needs at least 2");
  LabeledSet dev;
  if (!cfg.dev.empty())
    dev = is_text(cfg.dev)
              ? read_task_file(cfg.dev, cfg.columns, tok, cfg.seq_len, train_set.label_names)
              : read_classification_tfrecords(cfg.dev, cfg.seq_len, mc.num_labels, mc.vocab_size);

  model::BertModel m(mc, model::Head::SequenceClassification,
                     with_precision({cfg.batch_size, cfg.seq_len, 0}, cfg.precision));
  m.init_params(cfg.seed);
  model::LoadReport rep =
      model::load_checkpoint_into(m, src, {{"classifier.", "bert.pooler."}, {"cls."}});
  OptimizerConfig oc;
  oc.kind = OptimizerKind::AdamW;
  oc.weight_decay = static_cast<float>(cfg.weight_decay);
  Optimizer opt(param_slices(m.table()), m.table().total(), oc);
  LossScaler::Config sc;
  sc.enabled = cfg.precision == Precision::FP16;
  LossScaler scaler(sc);
  const int64_t n = static_cast<int64_t>(train_set.ids.size());
  const int64_t steps_per_epoch = (n + cfg.batch_size - 1) / cfg.batch_size;
  const int64_t total = steps_per_epoch * cfg.epochs;
  const LrSchedule sched{cfg.lr, 0.0, 1.0, static_cast<int64_t>(cfg.warmup * total), total};
  if (!cfg.quiet)
    std::printf(
        "finetune: %s from %s (%zu tensors loaded), %lld train / %zu dev examples, %lld labels, "
        "seq %lld, batch %lld, %lld epochs, adamw lr %.3g, %s\n",
        cfg.train.c_str(), src.c_str(), rep.loaded.size(), (long long)n, dev.ids.size(),
        (long long)mc.num_labels, (long long)cfg.seq_len, (long long)cfg.batch_size,
        (long long)cfg.epochs, cfg.lr, precision_name(cfg.precision));
  FinetuneResult res;
  std::vector<size_t> order(n);
  // A non-finite gradient skips the step in fp16 (the scale halves) and stops fp32/bf16
  // fine-tuning with a message (LossScaler::update).
  // TensorBoard events and metrics.jsonl per epoch, beside the saved model.
  std::unique_ptr<obs::EventWriter> events;
  std::unique_ptr<obs::MetricsLog> metrics;
  if (!cfg.output.empty()) {
    events = std::make_unique<obs::EventWriter>(cfg.output, 0);
    metrics = std::make_unique<obs::MetricsLog>(cfg.output, 0);
  }
  comm::SingleProcess single;
  Step one_step(m, opt, scaler, single, StepSettings{1, 1.0, false, 0, cfg.seed});
  int64_t step = 0;
  for (int64_t epoch = 0; epoch < cfg.epochs; ++epoch) {
    for (int64_t i = 0; i < n; ++i) order[i] = static_cast<size_t>(i);
    data::Rng(rng_key(cfg.seed, epoch, 0xf17e)).shuffle(order);
    double loss = 0;
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < n; i += cfg.batch_size, ++step) {
      const size_t end = static_cast<size_t>(std::min(n, i + cfg.batch_size));
      const StepReport r = one_step.run(step, sched.at(step), [&](model::Batch& batch) {
        make_batch(train_set, order, static_cast<size_t>(i), end, cfg.seq_len, batch);
        return true;
      });
      loss += r.loss;
    }
    res.train_loss = loss / steps_per_epoch;
    const double acc = dev.ids.empty() ? 0.0 : classify(m, dev, cfg.batch_size, nullptr);
    res.dev_accuracy.push_back(acc);
    if (events) {
      obs::Scalars values = {
          {"finetune/train_loss", res.train_loss},
          {"finetune/epoch_seconds", std::chrono::duration<double>(Clock::now() - t0).count()}};
      if (!dev.ids.empty()) values.push_back({"finetune/dev_accuracy", acc});
      events->scalars(step, values);
      metrics->write(step, values, {{"epoch", epoch + 1}});
    }
    if (!cfg.quiet) {
      std::printf("epoch %lld/%lld | train loss %.4f | %.1f s", (long long)epoch + 1,
                  (long long)cfg.epochs, res.train_loss,
                  std::chrono::duration<double>(Clock::now() - t0).count());
      if (!dev.ids.empty()) std::printf(" | dev accuracy %.4f (%zu examples)", acc, dev.ids.size());
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (!cfg.output.empty()) {
    model::save_pretrained(m, cfg.output);
    // Label names and the tokenizer settings travel with the model.
    const fs::path cfg_path = fs::path(cfg.output) / "config.json";
    std::ifstream cin(cfg_path);
    nlohmann::json j = nlohmann::json::parse(cin);
    nlohmann::json id2label, label2id;
    for (size_t i = 0; i < train_set.label_names.size(); ++i) {
      id2label[std::to_string(i)] = train_set.label_names[i];
      label2id[train_set.label_names[i]] = i;
    }
    j["id2label"] = id2label;
    j["label2id"] = label2id;
    j["bertrain"] = {{"lower_case", lower}, {"seq_len", cfg.seq_len}};
    if (!cfg.columns.empty())  // predict reads new files with the same columns
      j["bertrain"]["columns"] = {{"text_a", cfg.columns.text_a},
                                  {"text_b", cfg.columns.text_b},
                                  {"label", cfg.columns.label}};
    write_file_atomic(cfg_path.string(), j.dump(2) + "\n");
    fs::copy_file(vocab_path, fs::path(cfg.output) / "vocab.txt",
                  fs::copy_options::overwrite_existing);
    if (!cfg.quiet)
      std::printf(
          "finetune: saved %s (BertForSequenceClassification + vocab.txt; TensorBoard events and "
          "metrics.jsonl per epoch)\n",
          cfg.output.c_str());
  }
  return res;
}

}  // namespace bertrain::train
