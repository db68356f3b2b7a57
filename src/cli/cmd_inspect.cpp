// bertrain inspect: what is inside a data or model file, verified.
// TFRecord files (any compression): every record as a JSON line (file, record, offset, features
// with type and values), every CRC checked; the first corrupt record stops with its file, byte
// offset and record number, exit 1. safetensors: every tensor with dtype, shape, statistics, a
// finiteness check and (with a config.json beside it or --model-config) whether it loads.
// TensorFlow checkpoints (prefix, .index or directory): every variable, CRC checked, with the
// HuggingFace name it converts to.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "data/example.h"
#include "data/pipeline.h"
#include "data/tensor_bundle.h"
#include "data/tfrecord.h"
#include "model/checkpoint.h"
#include "model/tf_checkpoint.h"

namespace bertrain::cli {

namespace {

int inspect_safetensors(const std::string& path, const std::string& config, bool json) {
  SafetensorsReader r(path);
  int bad = 0;
  size_t total = 0;
  if (!json) {
    std::printf("%s: %zu tensors", path.c_str(), r.tensors().size());
    for (const auto& [k, v] : r.metadata()) std::printf(", %s=%s", k.c_str(), v.c_str());
    std::printf("\n  %-58s %-5s %-14s %11s %11s %11s\n", "name", "dtype", "shape", "mean", "std",
                "absmax");
  }
  std::vector<float> buf;
  for (const auto& t : r.tensors()) {
    const size_t n = static_cast<size_t>(shape_numel(t.shape));
    total += n;
    double mean = 0, sq = 0, absmax = 0;
    size_t nonfinite = 0;
    const bool is_float = t.dtype == DType::F32 || t.dtype == DType::F16 ||
                          t.dtype == DType::BF16 || t.dtype == DType::F64;
    if (is_float) {
      buf.resize(n);
      r.read_f32(t, buf.data());
      for (float v : buf) {
        if (!std::isfinite(v)) {
          ++nonfinite;
          continue;
        }
        mean += v;
        sq += static_cast<double>(v) * v;
        absmax = std::max(absmax, std::fabs(static_cast<double>(v)));
      }
      const size_t ok = n - nonfinite;
      mean = ok ? mean / ok : 0;
      sq = ok ? std::sqrt(std::max(0.0, sq / ok - mean * mean)) : 0;
    }
    bad += nonfinite > 0;
    if (json) {
      nlohmann::json j = {{"name", t.name}, {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}};
      if (is_float)
        j.update({{"mean", mean}, {"std", sq}, {"absmax", absmax}, {"nonfinite", nonfinite}});
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("  %-58s %-5s %-14s %11.4g %11.4g %11.4g%s\n", t.name.c_str(),
                  std::string(dtype_name(t.dtype)).c_str(), shape_str(t.shape).c_str(), mean, sq,
                  absmax, nonfinite ? str("  ", nonfinite, " NON-FINITE").c_str() : "");
    }
  }
  if (!json) std::printf("  %zu values; %d tensors with non-finite values\n", total, bad);
  std::string cfg_path = config;
  if (cfg_path.empty()) {
    auto p = std::filesystem::path(path).parent_path() / "config.json";
    if (std::filesystem::exists(p)) cfg_path = p.string();
  }
  if (!cfg_path.empty()) {
    model::BertConfig cfg = model::BertConfig::load(cfg_path);
    // HF's structure tells the head: a classifier without a pooler tags tokens.
    const model::Head head = r.find("qa_outputs.weight")    ? model::Head::QuestionAnswering
                             : !r.find("classifier.weight") ? model::Head::Pretraining
                             : r.find("bert.pooler.dense.weight")
                                 ? model::Head::SequenceClassification
                                 : model::Head::TokenClassification;
    model::BertModel m(cfg, head, {1, 1, 0});
    // A BertModel-only file (no heads) is fine for fine-tuning: allow the heads to be missing.
    model::LoadReport rep = model::load_safetensors_into(
        m, path, {{"cls.", "classifier.", "qa_outputs.", "bert.pooler."}, {}});
    if (!json)
      std::printf("  loads as %s with %s (%s): %zu tensors loaded, %zu head tensors absent\n",
                  model::head_architecture(head), cfg_path.c_str(), describe(cfg).c_str(),
                  rep.loaded.size(), rep.missing_allowed.size());
  }
  return bad ? 1 : 0;
}

// A TensorFlow checkpoint: every variable with its dtype, shape, HuggingFace name (or what it
// is instead) and statistics; every tensor's CRC checked. A damaged tensor is reported and the
// rest still listed; exit 1.
int inspect_tf_checkpoint(const std::string& path, bool json) {
  const data::TensorBundle b(path);
  int bad = 0;
  if (!json)
    std::printf(
        "%s: TensorFlow checkpoint, %zu variables, %d data file(s)\n  %-56s %-8s %-12s "
        "%-52s %10s %10s\n",
        b.prefix().c_str(), b.variables().size(), b.num_shards(), "variable", "dtype", "shape",
        "HuggingFace name", "mean", "absmax");
  for (const auto& v : b.variables()) {
    const auto w = model::tf_weight(v);
    const std::string as = w                                          ? w->hf_name
                           : v.name.find("adam") != std::string::npos ? "(optimizer slot)"
                                                                      : "(not a weight)";
    double mean = 0, absmax = 0;
    std::string error;
    try {
      if (data::tf_dtype_is_float(v.dtype)) {
        const std::vector<float> x = b.read_f32(v);
        for (float f : x) {
          mean += f;
          absmax = std::max(absmax, std::fabs(static_cast<double>(f)));
        }
        mean = x.empty() ? 0 : mean / static_cast<double>(x.size());
      } else if (v.dtype == 3 || v.dtype == 9) {
        const std::vector<int64_t> x = b.read_i64(v);
        if (x.size() == 1) mean = absmax = static_cast<double>(x[0]);
      }
    } catch (const Error& e) {
      error = e.what();
      ++bad;
    }
    if (json) {
      nlohmann::json j = {{"name", v.name},   {"dtype", data::tf_dtype_name(v.dtype)},
                          {"shape", v.shape}, {"hf_name", w ? w->hf_name : ""},
                          {"mean", mean},     {"absmax", absmax}};
      if (!error.empty()) j["error"] = error;
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("  %-56s %-8s %-12s %-52s %10.4g %10.4g\n", v.name.c_str(),
                  data::tf_dtype_name(v.dtype).c_str(), shape_str(v.shape).c_str(), as.c_str(),
                  mean, absmax);
      if (!error.empty()) std::printf("    ERROR: %s\n", error.c_str());
    }
  }
  if (!json)
    std::printf("  %zu weights; %d unreadable; convert with: bertrain convert %s OUTPUT_DIR\n",
                model::tf_weights(b).size(), bad, b.prefix().c_str());
  return bad ? 1 : 0;
}

nlohmann::json feature_json(const data::Feature& f, size_t max_values) {
  nlohmann::json values = nlohmann::json::array();
  const size_t n = std::min(f.size(), max_values);
  for (size_t i = 0; i < n; ++i) {
    if (f.kind == data::FeatureKind::Int64)
      values.push_back(f.ints[i]);
    else if (f.kind == data::FeatureKind::Float) {
      const float v = f.floats[i];
      if (std::isfinite(v))
        values.push_back(v);
      else
        values.push_back(std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
    } else {
      values.push_back(f.bytes[i]);  // nlohmann escapes; invalid UTF-8 is replaced below
    }
  }
  nlohmann::json j = {
      {"type", data::feature_kind_name(f.kind)}, {"size", f.size()}, {"values", values}};
  if (f.size() > n) j["truncated"] = true;
  return j;
}

int inspect_tfrecord(const std::string& path, const std::string& compression, bool count_only,
                     int64_t max_records, size_t max_values) {
  const data::Compression c = data::resolve_compression(compression, path);
  data::TFRecordReader r(path, c);
  std::string rec;
  uint64_t n = 0, bytes = 0;
  std::map<std::string, std::string> schema;  // feature -> type, over all records
  for (;;) {
    const uint64_t offset = r.offset();
    if (!r.next(rec)) break;  // CorruptRecord propagates: file, offset, record in the message
    bytes += rec.size();
    if (count_only && max_records == 0) {
      ++n;
      continue;
    }
    data::Example ex;
    try {
      ex = data::decode_example(rec);
    } catch (const Error& e) {
      fail(path, ": record ", n, " at byte ", offset, ": ", e.what());
    }
    for (const auto& [k, f] : ex) schema[k] = data::feature_kind_name(f.kind);
    if (!count_only && (max_records < 0 || static_cast<int64_t>(n) < max_records)) {
      nlohmann::json j = {{"file", path}, {"record", n}, {"offset", offset}};
      nlohmann::json feats = nlohmann::json::object();
      for (const auto& [k, f] : ex) feats[k] = feature_json(f, max_values);
      j["features"] = feats;
      std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    }
    ++n;
  }
  std::string feats;
  for (const auto& [k, t] : schema) feats += (feats.empty() ? "" : ", ") + k + ":" + t;
  std::fprintf(stderr, "%s: %llu records, %s, %s compression, all CRCs ok%s%s\n", path.c_str(),
               (unsigned long long)n, human_bytes(static_cast<double>(bytes)).c_str(),
               data::compression_name(c), feats.empty() ? "" : "; features ", feats.c_str());
  return 0;
}

bool is_safetensors(const std::string& path) {
  return path.size() >= 12 && path.substr(path.size() - 12) == ".safetensors";
}

}  // namespace

void add_inspect(CLI::App& app) {
  struct Opts {
    std::vector<std::string> files;
    std::string config, compression = "auto";
    bool json = false, count = false;
    int64_t max_records = -1;
    size_t max_values = 64;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "inspect",
      "Show and verify TFRecord files, .safetensors files, checkpoint directories and "
      "TensorFlow checkpoints");
  c->add_option("files", o->files,
                "TFRecord files (globs allowed; s3:// and oss:// too), .safetensors files, "
                "checkpoint directories or TensorFlow checkpoints (prefix or .index)")
      ->required();
  c->add_option("--model-config", o->config,
                "config.json to check loading against (default: the one beside the file)");
  c->add_flag("--json", o->json, "safetensors: one JSON object per tensor");
  c->add_option("--compression", o->compression, "TFRecord compression: auto, none, gzip, zlib")
      ->capture_default_str();
  c->add_flag("--count", o->count, "TFRecords: only count records and verify CRCs (no JSON)");
  c->add_option("--max-records", o->max_records,
                "TFRecords: print at most this many records per file (-1: all)")
      ->capture_default_str();
  c->add_option("--max-values", o->max_values,
                "TFRecords: print at most this many values per feature")
      ->capture_default_str();
  add_storage_options(c);
  c->callback([o] {
    int rc = 0;
    for (const auto& f : o->files) {
      if (data::is_remote(f)) {  // TFRecords in object storage
        for (const auto& path : data::list_files(f))
          rc |= inspect_tfrecord(path, o->compression, o->count, o->max_records, o->max_values);
        continue;
      }
      if (model::is_tf_checkpoint(f) &&
          !std::filesystem::exists(std::filesystem::path(f) / "model.safetensors")) {
        rc |= inspect_tf_checkpoint(f, o->json);
        continue;
      }
      if (std::filesystem::is_directory(f)) {
        rc |= inspect_safetensors(model::checkpoint_weights_path(f), o->config, o->json);
        continue;
      }
      const std::vector<std::string> paths =
          std::filesystem::exists(f) ? std::vector<std::string>{f} : data::list_files(f);
      for (const auto& path : paths)
        rc |= is_safetensors(path)
                  ? inspect_safetensors(path, o->config, o->json)
                  : inspect_tfrecord(path, o->compression, o->count, o->max_records, o->max_values);
    }
    if (rc) throw CLI::RuntimeError(1);
  });
}

}  // namespace bertrain::cli
