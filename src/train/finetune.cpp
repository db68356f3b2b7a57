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
#include <sstream>

#include "core/error.h"
#include "core/safetensors.h"
#include "core/setting.h"
#include "data/example.h"
#include "data/pipeline.h"
#include "data/pretraining.h"
#include "data/schema.h"
#include "data/storage.h"
#include "data/tfrecord.h"
#include "model/checkpoint.h"
#include "obs/events.h"
#include "plan/memory.h"
#include "train/loss_scaler.h"
#include "train/metrics.h"
#include "train/ner.h"
#include "train/optimizer.h"
#include "train/run_state.h"
#include "train/session.h"
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

std::string f4(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4f", x);
  return buf;
}

bool is_int(const std::string& s) {
  if (s.empty()) return false;
  for (size_t i = s[0] == '-' ? 1 : 0; i < s.size(); ++i)
    if (s[i] < '0' || s[i] > '9') return false;
  return s != "-";
}

}  // namespace

std::string skipped_summary(int64_t skipped, const std::vector<std::string>& reasons,
                            const std::string& file, const char* what) {
  if (!skipped) return "";
  std::string out = str(skipped, " unusable ", what, skipped == 1 ? "" : "s", " of ", file,
                        " skipped, not used:");
  for (const auto& r : reasons) out += "\n  " + r;
  if (skipped > static_cast<int64_t>(reasons.size()))
    out += str("\n  ... and ", skipped - static_cast<int64_t>(reasons.size()), " more");
  return out;
}

std::string LabeledSet::skipped_summary(const std::string& file) const {
  return train::skipped_summary(skipped, skipped_reasons, file, "row");
}

TaskColumns task_columns(const std::string& task) {
  static const std::map<std::string, TaskColumns> tasks = {
      // GLUE (TSV, header row)
      {"sst2", {"sentence", "", "label", false, false, ""}},
      {"mrpc", {"#1 String", "#2 String", "Quality", false, false, ""}},
      {"qqp", {"question1", "question2", "is_duplicate", false, false, ""}},
      {"qnli", {"question", "sentence", "label", false, false, ""}},
      {"rte", {"sentence1", "sentence2", "label", false, false, ""}},
      {"wnli", {"sentence1", "sentence2", "label", false, false, ""}},
      {"mnli", {"sentence1", "sentence2", "gold_label", false, false, ""}},
      {"stsb", {"sentence1", "sentence2", "score", true, false, ""}},
      {"ner", {"", "", "", false, true, ""}},
      {"cluener", {"", "", "", false, true, ""}},
      {"conll", {"", "", "", false, true, ""}},
      // extractive QA (SQuAD v1.1 JSON layout)
      {"squad", {"", "", "", false, false, "squad"}},
      {"cmrc2018", {"", "", "", false, false, "cmrc2018"}},
      {"cmrc", {"", "", "", false, false, "cmrc2018"}},
      {"drcd", {"", "", "", false, false, "cmrc2018"}},
      // CLUE (JSON lines)
      {"afqmc", {"sentence1", "sentence2", "label", false, false, ""}},
      {"tnews", {"sentence", "", "label", false, false, ""}},
      {"iflytek", {"sentence", "", "label", false, false, ""}},
      {"cmnli", {"sentence1", "sentence2", "label", false, false, ""}},
      {"ocnli", {"sentence1", "sentence2", "label", false, false, ""}},
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
  return "sst2, mrpc, qqp, qnli, rte, wnli, mnli, stsb (regression) (GLUE TSV); afqmc, tnews, "
         "iflytek, cmnli, ocnli (CLUE JSON lines); ner, cluener, conll (entity tagging: CLUENER "
         "JSON lines or CoNLL columns); squad, cmrc2018, drcd (extractive QA: SQuAD v1.1 JSON)";
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
  c.regression = given.regression;
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

namespace {

// A task file's data row before encoding: its fields, its line in the file and its index among
// the data rows.
struct TaskRow {
  std::string a, b, label;
  int64_t line = 0, index = 0;
};
// The rows read, the columns they were read by (the task's, or those the file's header or first
// object names), and whether the file has labels.
struct TaskRows {
  std::vector<TaskRow> rows;
  TaskColumns columns;
  bool has_label = false;
};

// A row that cannot be used: counted, its index kept, the first five reasons with file:line.
void skip_row(LabeledSet& s, const std::string& path, int64_t line, int64_t index,
              const std::string& why) {
  ++s.skipped;
  s.skipped_rows.push_back(index);
  if (s.skipped_reasons.size() < 5) s.skipped_reasons.push_back(str(path, ":", line, ": ", why));
}

void strip_line(std::string& l) {
  if (!l.empty() && l.back() == '\r') l.pop_back();
  if (l.compare(0, 3, "\xEF\xBB\xBF") == 0) l.erase(0, 3);  // a BOM (MRPC has one)
}

// JSON lines: one object a row; the first object's keys resolve the columns.
TaskRows read_jsonl_rows(std::istream& in, const std::string& path, const TaskColumns& columns,
                         LabeledSet& s) {
  TaskRows t;
  TaskColumns& c = t.columns;
  std::string line;
  int64_t lineno = 0, index = 0;
  while (std::getline(in, line)) {
    ++lineno;
    strip_line(line);
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const int64_t row = index++;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      skip_row(s, path, lineno, row, str("not a JSON object (", e.what(), ")"));
      continue;
    }
    if (!j.is_object()) {
      skip_row(s, path, lineno, row, "not a JSON object");
      continue;
    }
    if (c.text_a.empty()) {
      std::vector<std::string> keys;
      for (const auto& [k, _] : j.items()) keys.push_back(k);
      c = resolve_columns(path, columns, keys);
      t.has_label = !c.label.empty() && j.contains(c.label);
    }
    std::string missing;
    for (const std::string* k : {&c.text_a, &c.text_b, t.has_label ? &c.label : nullptr})
      if (k && !k->empty() && !j.contains(*k) && missing.empty()) missing = *k;
    if (!missing.empty()) {
      skip_row(s, path, lineno, row, str("no '", missing, "' key"));
      continue;
    }
    auto field = [&](const std::string& key) {
      if (key.empty()) return std::string();
      const auto& v = j[key];
      return v.is_string() ? v.get<std::string>() : v.dump();
    };
    t.rows.push_back(
        {field(c.text_a), field(c.text_b), t.has_label ? field(c.label) : "", lineno, row});
  }
  return t;
}

// TSV: a header row naming the columns, then a row a line.
TaskRows read_tsv_rows(std::istream& in, const std::string& path, const TaskColumns& columns,
                       LabeledSet& s) {
  TaskRows t;
  std::string line;
  if (!std::getline(in, line))
    fail(path, " is empty (expected a header row naming the columns, e.g. label<TAB>text_a)");
  int64_t lineno = 1, index = 0;
  strip_line(line);
  const auto header = split_tabs(line);
  t.columns = resolve_columns(path, columns, header);
  auto col = [&](const std::string& n) {
    return n.empty()
               ? -1
               : static_cast<int>(std::find(header.begin(), header.end(), n) - header.begin());
  };
  const int col_a = col(t.columns.text_a), col_b = col(t.columns.text_b);
  int col_label = col(t.columns.label);
  if (col_label >= static_cast<int>(header.size())) col_label = -1;  // unlabelled (test) file
  t.has_label = col_label >= 0;
  const int need = std::max({col_label, col_a, col_b});
  while (std::getline(in, line)) {
    ++lineno;
    strip_line(line);
    if (line.empty()) continue;
    const int64_t row = index++;
    const auto cols = split_tabs(line);
    if (static_cast<int>(cols.size()) <= need) {
      skip_row(s, path, lineno, row, str(cols.size(), " columns, the header has ", header.size()));
      continue;
    }
    t.rows.push_back({cols[col_a], col_b >= 0 ? cols[col_b] : "",
                      t.has_label ? cols[col_label] : "", lineno, row});
  }
  return t;
}

}  // namespace

LabeledSet read_task_file(const std::string& path, const TaskColumns& columns,
                          const data::Tokenizer& tok, int64_t seq_len,
                          std::vector<std::string> label_names) {
  std::istringstream in(data::read_all(path));  // a file or an object (s3://, oss://)
  const bool jsonl = path.ends_with(".json") || path.ends_with(".jsonl");
  // First every data row's fields (a row that cannot be read is skipped and counted), then
  // the labels, then the examples.
  LabeledSet s;
  const TaskRows t =
      jsonl ? read_jsonl_rows(in, path, columns, s) : read_tsv_rows(in, path, columns, s);
  const std::vector<TaskRow>& rows = t.rows;
  const TaskColumns& c = t.columns;
  const bool has_label = t.has_label;
  auto skip = [&](int64_t line, int64_t index, const std::string& why) {
    skip_row(s, path, line, index, why);
  };
  auto no_examples = [&] {
    fail(path, " has no usable examples",
         s.skipped ? str(" (", s.skipped, " rows skipped; first: ", s.skipped_reasons[0], ")")
                   : std::string());
  };
  if (rows.empty()) no_examples();
  s.regression = c.regression;
  const bool label_classes = has_label && !c.regression;
  if (label_classes && label_names.empty()) {
    std::set<std::string> uniq;
    for (const auto& r : rows) uniq.insert(r.label);
    label_names.assign(uniq.begin(), uniq.end());
    if (std::all_of(label_names.begin(), label_names.end(), is_int))
      std::sort(
          label_names.begin(), label_names.end(),
          [](const std::string& x, const std::string& y) { return std::stoll(x) < std::stoll(y); });
  }
  std::map<std::string, int32_t> label_index;
  for (size_t i = 0; i < label_names.size(); ++i)
    label_index[label_names[i]] = static_cast<int32_t>(i);
  for (const auto& r : rows) {
    int32_t label = -1;
    float target = 0;
    if (has_label && c.regression) {
      char* end = nullptr;
      const double x = std::strtod(r.label.c_str(), &end);
      if (r.label.empty() || end != r.label.c_str() + r.label.size() || !std::isfinite(x)) {
        skip(r.line, r.index,
             str("label '", r.label,
                 "' is not a number (a regression task's label column holds the values to "
                 "predict)"));
        continue;
      }
      target = static_cast<float>(x);
    } else if (label_classes) {
      auto it = label_index.find(r.label);
      if (it == label_index.end()) {
        skip(r.line, r.index,
             str("label '", r.label, "' does not occur in the training labels (",
                 label_names.size(), " known)"));
        continue;
      }
      label = it->second;
    }
    add_example(s, tok, seq_len, r.a, c.text_b.empty() ? nullptr : &r.b);
    s.labels.push_back(label);
    if (has_label && c.regression) s.targets.push_back(target);
  }
  if (s.ids.empty()) no_examples();
  std::sort(s.skipped_rows.begin(), s.skipped_rows.end());
  if (!c.regression) s.label_names = label_names;
  return s;
}

LabeledSet read_tsv(const std::string& path, const data::Tokenizer& tok, int64_t seq_len,
                    std::vector<std::string> label_names) {
  return read_task_file(path, {}, tok, seq_len, std::move(label_names));
}

LabeledSet read_classification_tfrecords(const std::string& files, int64_t seq_len,
                                         int64_t num_labels, int64_t vocab_size) {
  const std::vector<std::string> paths = data::list_files(files);
  LabeledSet s;
  if (!paths.empty()) {
    std::ifstream names(fs::path(paths[0]).parent_path() / "labels.txt");
    for (std::string line; std::getline(names, line);)
      if (!line.empty()) s.label_names.push_back(line);
    if (!s.label_names.empty()) num_labels = static_cast<int64_t>(s.label_names.size());
  }
  // A float label_ids is a regression task's score (prepare writes it so for stsb).
  std::string err, rec;
  if (!paths.empty()) {
    data::TFRecordReader first(paths[0], data::resolve_compression("auto", paths[0]));
    if (first.next(rec)) {
      const data::Example e = data::decode_example(rec);
      const auto it = e.find("label_ids");
      s.regression = it != e.end() && it->second.kind == data::FeatureKind::Float;
    }
  }
  const data::Schema schema = s.regression
                                  ? data::Schema::regression(seq_len, vocab_size)
                                  : data::Schema::classification(seq_len, num_labels, vocab_size);
  data::ParsedExample ex;
  for (const auto& f : paths) {
    data::TFRecordReader r(f, data::resolve_compression("auto", f));
    while (r.next(rec)) {
      if (!schema.parse(rec, ex, err)) fail(f, ": record ", r.records() - 1, ": ", err);
      int64_t len = 0;
      while (len < seq_len && ex.ints[seq_len + len]) ++len;  // input_mask
      s.ids.emplace_back(ex.ints.begin(), ex.ints.begin() + len);
      s.segments.emplace_back(ex.ints.begin() + 2 * seq_len, ex.ints.begin() + 2 * seq_len + len);
      if (s.regression) {
        s.labels.push_back(-1);
        s.targets.push_back(ex.floats[0]);
      } else {
        s.labels.push_back(ex.ints[3 * seq_len]);
      }
    }
  }
  if (s.regression) {
    if (s.ids.empty()) fail(files, " has no examples");
    return s;
  }
  if (s.label_names.empty())
    for (int64_t i = 0; i < num_labels; ++i) s.label_names.push_back(std::to_string(i));
  if (s.ids.empty()) fail(files, " has no examples");
  return s;
}

std::vector<std::string> write_classification_tfrecords(const LabeledSet& s, int64_t seq_len,
                                                        const std::string& dir, int shards,
                                                        data::Compression compression) {
  if (s.ids.empty() || (s.regression ? s.targets.size() != s.ids.size() : s.labels[0] < 0))
    fail("the input has no label column: classification TFRecords need labels");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create ", dir, ": ", ec.message());
  shards = std::max(1, std::min<int>(shards, static_cast<int>(s.ids.size())));
  std::vector<std::string> paths;
  std::vector<std::unique_ptr<data::TFRecordWriter>> out;
  for (int i = 0; i < shards; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "part-%05d-of-%05d.tfrecord%s", i, shards,
                  compression == data::Compression::Gzip ? ".gz" : "");
    paths.push_back((fs::path(dir) / name).string());
    out.push_back(std::make_unique<data::TFRecordWriter>(paths.back(), compression));
  }
  for (size_t i = 0; i < s.ids.size(); ++i) {
    data::Example ex;
    auto ints = [&](const char* key, std::vector<int64_t> v) {
      ex[key] = data::Feature{data::FeatureKind::Int64, std::move(v), {}, {}};
    };
    std::vector<int64_t> ids(seq_len, 0), mask(seq_len, 0), seg(seq_len, 0);
    for (size_t t = 0; t < s.ids[i].size(); ++t) {
      ids[t] = s.ids[i][t];
      mask[t] = 1;
      seg[t] = s.segments[i][t];
    }
    ints("input_ids", std::move(ids));
    ints("input_mask", std::move(mask));
    ints("segment_ids", std::move(seg));
    if (s.regression)  // the score as one float (ALBERT's classifier_utils for sts-b)
      ex["label_ids"] = data::Feature{data::FeatureKind::Float, {}, {s.targets[i]}, {}};
    else
      ints("label_ids", {s.labels[i]});
    ints("is_real_example", {1});
    out[i % shards]->write(data::encode_example(ex));
  }
  for (auto& w : out) w->close();
  if (!s.regression) {
    std::string names;
    for (const auto& n : s.label_names) names += n + "\n";
    write_file_atomic((fs::path(dir) / "labels.txt").string(), names);
  }
  return paths;
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
    b.label_values[row] = s.targets.empty() ? 0.0f : s.targets[i];
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

RegressionMetrics regress(model::BertModel& m, const LabeledSet& s, int64_t batch_size,
                          std::vector<float>* out) {
  BT_CHECK(m.config().num_labels == 1, "regress needs a model with one output");
  std::vector<size_t> order(s.ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<double> pred, target;
  model::Batch b;
  for (size_t i = 0; i < order.size(); i += batch_size) {
    const size_t end = std::min(order.size(), i + batch_size);
    make_batch(s, order, i, end, m.dims().seq_len, b);
    m.forward(b, {});
    for (size_t r = i; r < end; ++r) {
      pred.push_back(m.cls_logits()[r - i]);
      if (out) out->push_back(m.cls_logits()[r - i]);
    }
  }
  RegressionMetrics r;
  if (s.targets.empty()) return r;
  target.assign(s.targets.begin(), s.targets.end());
  r.pearson = pearson(pred, target);
  r.spearman = spearman(pred, target);
  for (size_t i = 0; i < pred.size(); ++i) r.mse += (pred[i] - target[i]) * (pred[i] - target[i]);
  r.mse /= static_cast<double>(pred.size());
  return r;
}

namespace {

bool is_text_file(const std::string& f) {
  return f.ends_with(".tsv") || f.ends_with(".txt") || f.ends_with(".json") ||
         f.ends_with(".jsonl");
}

// The pretrained model fine-tuning starts from (a run directory, a bertrain checkpoint or a
// HuggingFace directory), its config and the vocabulary and casing its tokenizer uses.
struct Pretrained {
  std::string src, vocab_path;
  model::BertConfig config;
  data::Vocab vocab;
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
  p.vocab = data::Vocab::load(p.vocab_path);
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
  TaggedSet train_tagged, dev_tagged;
  TokenSet train_tok, dev_tok;
  QaOptions qo;
  QaSet train_qa, dev_qa;
  QaFeatures train_qf, dev_qf;
  LabeledSet train_set, dev;

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

TaskData read_task(const FinetuneConfig& cfg, const data::Tokenizer& tok,
                   const model::BertConfig& mc, bool say) {
  TaskData t;
  t.tokens = cfg.columns.tokens;
  t.qa = !cfg.columns.qa.empty();
  if (t.tokens) {
    t.train_tagged = read_tagged_file(cfg.train);
    t.train_tok = encode_tagged(t.train_tagged, tok, cfg.seq_len, {});
    if (t.train_tok.label_names.size() < 2)
      fail(cfg.train, " has ", t.train_tok.label_names.size(), " tag(s); tagging needs at least 2");
    if (t.train_tagged.skipped) say_skipped(say, t.train_tagged.skipped_summary(cfg.train));
    if (!cfg.dev.empty()) {
      t.dev_tagged = read_tagged_file(cfg.dev);
      t.dev_tok = encode_tagged(t.dev_tagged, tok, cfg.seq_len, t.train_tok.label_names);
      if (t.dev_tagged.skipped) say_skipped(say, t.dev_tagged.skipped_summary(cfg.dev));
    }
  } else if (t.qa) {
    t.qo = cfg.qa;
    t.qo.seq_len = cfg.seq_len;
    t.qo.metric = cfg.columns.qa;
    t.qo = resolve_qa_options(t.qo);
    t.train_qa = read_squad(cfg.train, true);
    t.train_qf = make_qa_features(t.train_qa, tok, t.qo);
    if (t.train_qa.skipped) say_skipped(say, t.train_qa.skipped_summary(cfg.train));
    if (!cfg.dev.empty()) {
      t.dev_qa = read_squad(cfg.dev, false);
      t.dev_qf = make_qa_features(t.dev_qa, tok, t.qo);
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
    t.train_set =
        is_text_file(cfg.train)
            ? read_task_file(cfg.train, cfg.columns, tok, cfg.seq_len, {})
            : read_classification_tfrecords(cfg.train, cfg.seq_len, mc.num_labels, mc.vocab_size);
    t.regression = t.train_set.regression;
    if (!t.regression && t.num_labels() < 2)
      fail(cfg.train, " has ", t.num_labels(), " label(s); classification needs at least 2");
    if (t.regression && t.train_set.targets.empty())
      fail(cfg.train, " has no label column to learn from");
    if (t.train_set.skipped) say_skipped(say, t.train_set.skipped_summary(cfg.train));
    if (!cfg.dev.empty())
      t.dev =
          is_text_file(cfg.dev)
              ? read_task_file(cfg.dev, cfg.columns, tok, cfg.seq_len, t.train_set.label_names)
              : read_classification_tfrecords(cfg.dev, cfg.seq_len, t.num_labels(), mc.vocab_size);
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
    const std::vector<QaAnswer> answers = predict_answers(m, t.dev_qa, t.dev_qf, t.qo, batch_size);
    std::vector<std::string> texts;
    for (const auto& a : answers) texts.push_back(a.text);
    const QaScores q = qa_scores(t.dev_qa, texts, t.qo.metric);
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
    const EntityScores e =
        entity_scores(gold, predict_tags(m, t.dev_tagged, t.dev_tok, batch_size));
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
  const Pretrained pre = load_pretrained(cfg);
  const data::Tokenizer tok(pre.vocab, pre.lower);
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
  if (say)
    std::printf(
        "finetune: %s from %s (%zu tensors loaded), %lld train / %zu dev examples, %s, "
        "seq %lld, batch %lld, %lld epochs, adamw lr %.3g, %s\n",
        cfg.train.c_str(), pre.src.c_str(), rep.loaded.size(), (long long)n, task.dev_size(),
        task.describe(mc.num_labels).c_str(), (long long)cfg.seq_len, (long long)cfg.batch_size,
        (long long)cfg.epochs, cfg.lr, precision_name(cfg.precision));
  // TensorBoard events and metrics.jsonl per epoch, beside the saved model.
  std::unique_ptr<obs::EventWriter> events;
  std::unique_ptr<obs::MetricsLog> metrics;
  if (!cfg.output.empty() && rank == 0) {
    events = std::make_unique<obs::EventWriter>(cfg.output, 0);
    metrics = std::make_unique<obs::MetricsLog>(cfg.output, 0);
  }
  // A non-finite gradient skips the step in fp16 (the scale halves) and stops fp32/bf16
  // fine-tuning with a message (LossScaler::update).
  Step& one_step = session.start(StepSettings{1, 1.0, false, 0, cfg.seed});
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
    data::Rng(rng_key(cfg.seed, epoch, 0xf17e)).shuffle(order);
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
      loss += r.loss;
    }
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
    if (say) {
      std::printf("epoch %lld/%lld | train loss %.4f | %.1f s%s\n", (long long)epoch + 1,
                  (long long)cfg.epochs, res.train_loss, seconds, dev.line.c_str());
      std::fflush(stdout);
    }
  }
  save_finetuned(m, cfg, task, pre, comm, say);
  return res;
}

}  // namespace bertrain::train
