#include "tasks/task_files.h"

#include <algorithm>
#include <cctype>
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

namespace bertrain::tasks {

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
  return tasks::skipped_summary(skipped, skipped_reasons, file, "row");
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
void add_example(LabeledSet& s, const prep::Tokenizer& tok, int64_t seq_len,
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
                          const prep::Tokenizer& tok, int64_t seq_len,
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

LabeledSet read_tsv(const std::string& path, const prep::Tokenizer& tok, int64_t seq_len,
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

}  // namespace bertrain::tasks
