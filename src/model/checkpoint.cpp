#include "model/checkpoint.h"

#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/safetensors.h"
#include "core/setting.h"
#include "model/tf_checkpoint.h"

namespace bertrain::model {

namespace fs = std::filesystem;

namespace {

bool starts_with(const std::string& s, const std::string& p) {
  return s.rfind(p, 0) == 0;
}

bool has_prefix(const std::string& s, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes)
    if (starts_with(s, p)) return true;
  return false;
}

// Maps a file tensor name to the model's name, as HF's loader does.
std::string canonical_name(std::string n, const ParamTable& table) {
  auto replace_suffix = [&](const std::string& from, const std::string& to) {
    if (n.size() >= from.size() && n.compare(n.size() - from.size(), from.size(), from) == 0)
      n = n.substr(0, n.size() - from.size()) + to;
  };
  replace_suffix("LayerNorm.gamma", "LayerNorm.weight");
  replace_suffix("LayerNorm.beta", "LayerNorm.bias");
  if (!table.find(n) && table.find("bert." + n)) n = "bert." + n;  // BertModel checkpoint
  return n;
}

bool is_tied_or_buffer(const std::string& n) {
  return n == "cls.predictions.decoder.weight" || n == "cls.predictions.decoder.bias" ||
         n == "bert.embeddings.position_ids" || n == "embeddings.position_ids";
}

}  // namespace

std::string checkpoint_weights_path(const std::string& p) {
  if (fs::is_directory(p)) {
    fs::path f = fs::path(p) / "model.safetensors";
    if (!fs::exists(f))
      fail("no model.safetensors in ", p,
           " (a checkpoint directory needs model.safetensors and config.json, or a TensorFlow "
           "checkpoint's .index and .data files; PyTorch .bin files can be converted with HF "
           "save_pretrained)");
    return f.string();
  }
  if (!fs::exists(p)) fail("checkpoint ", p, " does not exist");
  return p;
}

std::string checkpoint_vocab_path(const std::string& p) {
  const std::string prefix = data::TensorBundle::find_prefix(p);
  const fs::path dir = fs::is_directory(p) ? fs::path(p)
                       : prefix.empty()    ? fs::path(p).parent_path()
                                           : fs::path(prefix).parent_path();
  return fs::exists(dir / "vocab.txt") ? (dir / "vocab.txt").string() : "";
}

std::string checkpoint_config_path(const std::string& p) {
  if (!fs::exists(fs::path(p) / "config.json") && is_tf_checkpoint(p)) {
    const std::string c = tf_checkpoint_config(p);
    if (c.empty())
      fail("no bert_config.json beside TensorFlow checkpoint ", p, " (pass ",
           setting("model_config"), ")");
    return c;
  }
  fs::path f =
      fs::is_directory(p) ? fs::path(p) / "config.json" : fs::path(p).parent_path() / "config.json";
  if (!fs::exists(f)) fail("no config.json next to checkpoint ", p);
  return f.string();
}

namespace {

// One tensor of a checkpoint file: its name as the file spells it, the model's name, its shape
// and how to read it as fp32.
struct SourceTensor {
  std::string file_name, name;
  Shape shape;
  std::function<void(float*)> read;
};

LoadReport load_tensors(BertModel& m, const std::string& path,
                        const std::vector<SourceTensor>& tensors, const LoadOptions& opt,
                        LoadReport rep) {
  const ParamTable& table = m.table();
  std::set<std::string> seen;
  std::vector<std::string> mismatched, unexpected;
  for (const auto& t : tensors) {
    const ParamInfo* p = table.find(t.name);
    if (!p) {
      if (is_tied_or_buffer(t.name) || is_tied_or_buffer(t.file_name) ||
          has_prefix(t.name, opt.ignore_unexpected_prefixes))
        rep.ignored.push_back(t.file_name);
      else
        unexpected.push_back(t.file_name + " " + shape_str(t.shape));
      continue;
    }
    if (t.shape != p->shape) {
      mismatched.push_back(t.file_name + ": file " + shape_str(t.shape) + ", model " +
                           shape_str(p->shape));
      continue;
    }
    m.write_param(*p, t.read);
    seen.insert(t.name);
    rep.loaded.push_back(t.name);
  }
  std::vector<std::string> missing;
  for (const auto& p : table.params()) {
    if (seen.count(p.name)) continue;
    if (has_prefix(p.name, opt.allow_missing_prefixes))
      rep.missing_allowed.push_back(p.name);
    else
      missing.push_back(p.name + " " + shape_str(p.shape));
  }
  if (!mismatched.empty() || !unexpected.empty() || !missing.empty()) {
    std::string msg = path + " does not match the model (" + head_architecture(table.head()) +
                      " with the given config):";
    auto list = [&](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      msg += str("\n  ", v.size(), " ", what, ":");
      for (size_t i = 0; i < v.size() && i < 20; ++i) msg += "\n    " + v[i];
      if (v.size() > 20) msg += str("\n    ... and ", v.size() - 20, " more");
    };
    list("shape mismatches", mismatched);
    list("missing tensors", missing);
    list("unexpected tensors", unexpected);
    msg += str("\n  check that ", setting("model_config"), " matches the checkpoint's config.json");
    throw Error(msg);
  }
  return rep;
}

}  // namespace

LoadReport load_safetensors_into(BertModel& m, const std::string& path, const LoadOptions& opt) {
  SafetensorsReader r(path);
  std::vector<SourceTensor> tensors;
  for (const auto& t : r.tensors()) {
    std::string name = canonical_name(t.name, m.table());
    if (t.dtype != DType::F32 && t.dtype != DType::F16 && t.dtype != DType::BF16 &&
        t.dtype != DType::F64 && m.table().find(name))
      fail(path, ": tensor ", t.name, " has dtype ", dtype_name(t.dtype),
           "; expected a float type");
    tensors.push_back(
        {t.name, std::move(name), t.shape, [&r, &t](float* out) { r.read_f32(t, out); }});
  }
  return load_tensors(m, path, tensors, opt, {});
}

LoadReport load_checkpoint_into(BertModel& m, const std::string& path, const LoadOptions& opt) {
  if (!is_tf_checkpoint(path)) return load_safetensors_into(m, checkpoint_weights_path(path), opt);
  const data::TensorBundle bundle(path);
  std::vector<SourceTensor> tensors;
  LoadReport rep;
  std::vector<TfWeight> weights;
  for (const auto& v : bundle.variables()) {
    if (auto w = tf_weight(v))
      weights.push_back(std::move(*w));
    else
      rep.ignored.push_back(v.name);  // optimizer slots, global_step
  }
  for (const auto& w : weights)
    tensors.push_back({w.tf_name, w.hf_name, w.shape, [&bundle, &w](float* out) {
                         const std::vector<float> v = read_tf_weight(bundle, w);
                         std::copy(v.begin(), v.end(), out);
                       }});
  return load_tensors(m, bundle.prefix(), tensors, opt, std::move(rep));
}

void save_pretrained(const BertModel& m, const std::string& dir, DType dtype,
                     const ParamGather& gather) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create checkpoint directory ", dir, ": ", ec.message());
  std::vector<SafeTensorOut> out;
  for (const auto& p : m.table().params()) {
    if (!m.backend().host_memory()) {  // a GPU's model: each tensor copied out as it is written
      out.push_back({p.name, dtype, p.shape, nullptr, nullptr, [&m, &p](float* o) {
                       m.backend().to_host(o, m.params() + p.offset,
                                           static_cast<size_t>(p.numel()) * sizeof(float));
                     }});
      continue;
    }
    if (m.holds_fp32(p)) {
      out.push_back({p.name, dtype, p.shape, m.params() + p.offset, nullptr});
      continue;
    }
    BT_CHECK(static_cast<bool>(gather), p.name,
             " is sharded over the ranks: saving it needs their parts (gather)");
    out.push_back(
        {p.name, dtype, p.shape, nullptr, nullptr, [&gather, &p](float* o) { gather(p, o); }});
  }
  write_safetensors((fs::path(dir) / "model.safetensors").string(), out, {{"format", "pt"}});
  nlohmann::json cfg = m.config().to_json(head_architecture(m.table().head()));
  if (dtype != DType::F32) cfg["torch_dtype"] = dtype == DType::BF16 ? "bfloat16" : "float16";
  write_file_atomic((fs::path(dir) / "config.json").string(), cfg.dump(2) + "\n");
}

}  // namespace bertrain::model
