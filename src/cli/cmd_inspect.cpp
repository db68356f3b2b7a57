// bertrain inspect: what is inside a model file. For safetensors: every tensor with dtype,
// shape and statistics, a check that all values are finite, and (with a config.json beside it
// or --model-config) whether it loads into a bertrain model. Exit 1 on any problem.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "model/checkpoint.h"
#include "model/safetensors.h"

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
    model::Head head = r.find("classifier.weight") ? model::Head::SequenceClassification
                                                   : model::Head::Pretraining;
    model::BertModel m(cfg, head, {1, 1, 0});
    // A BertModel-only file (no heads) is fine for fine-tuning: allow the heads to be missing.
    model::LoadReport rep =
        model::load_safetensors_into(m, path, {{"cls.", "classifier.", "bert.pooler."}, {}});
    if (!json)
      std::printf("  loads as %s with %s (%s): %zu tensors loaded, %zu head tensors absent\n",
                  model::head_architecture(head), cfg_path.c_str(), describe(cfg).c_str(),
                  rep.loaded.size(), rep.missing_allowed.size());
  }
  return bad ? 1 : 0;
}

}  // namespace

void add_inspect(CLI::App& app) {
  struct Opts {
    std::vector<std::string> files;
    std::string config;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "inspect", "Show and verify model files (.safetensors or checkpoint directories)");
  c->add_option("files", o->files, "Files or checkpoint directories")->required();
  c->add_option("--model-config", o->config,
                "config.json to check loading against (default: the one beside the file)");
  c->add_flag("--json", o->json, "One JSON object per tensor");
  c->callback([o] {
    int rc = 0;
    for (const auto& f : o->files) {
      std::string path = std::filesystem::is_directory(f) ? model::checkpoint_weights_path(f) : f;
      if (path.size() < 12 || path.substr(path.size() - 12) != ".safetensors")
        fail(f,
             ": unknown file type (inspect reads .safetensors files and checkpoint directories)");
      rc |= inspect_safetensors(path, o->config, o->json);
    }
    if (rc) throw CLI::RuntimeError(1);
  });
}

}  // namespace bertrain::cli
