#include "train/run_state.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"

namespace bertrain::train {

namespace fs = std::filesystem;

namespace {

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "checkpoint-%06lld", static_cast<long long>(step));
  return buf;
}

void fsync_dir(const std::string& dir) {
  FILE* f = std::fopen(dir.c_str(), "r");
  if (f) {
    ::fsync(fileno(f));
    std::fclose(f);
  }
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, const model::BertModel& m,
                            const Optimizer& opt, const TrainerState& st, int keep) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) fail("cannot create run directory ", run_dir, ": ", ec.message());
  const std::string name = checkpoint_name(st.step);
  const std::string final_dir = (fs::path(run_dir) / name).string();
  const std::string tmp_dir =
      (fs::path(run_dir) / ("." + name + ".tmp-" + std::to_string(::getpid()))).string();
  fs::remove_all(tmp_dir, ec);
  try {
    fs::create_directories(tmp_dir);
    model::save_pretrained(m, tmp_dir);
    write_safetensors(
        (fs::path(tmp_dir) / "optimizer.safetensors").string(),
        {{"m", DType::F32, {static_cast<int64_t>(opt.m().size())}, opt.m().data(), nullptr},
         {"v", DType::F32, {static_cast<int64_t>(opt.v().size())}, opt.v().data(), nullptr}},
        {{"format", "bertrain-optimizer"}, {"optimizer", optimizer_name(opt.config().kind)}});
    nlohmann::json j = {{"format", "bertrain-trainer-state"},
                        {"version", kTrainerStateVersion},
                        {"step", st.step},
                        {"loss_scale", st.loss_scale},
                        {"scaler_good_steps", st.scaler_good},
                        {"scaler_skipped_steps", st.scaler_skipped},
                        {"optimizer_steps", st.optimizer_steps},
                        {"settings", st.settings}};
    nlohmann::json pos = nlohmann::json::array();
    for (const auto& p : st.positions)
      pos.push_back({{"epoch", p.epoch},
                     {"batches", p.batches},
                     {"fingerprint", std::to_string(p.fingerprint)}});
    j["pipeline"] = pos;
    write_file_atomic((fs::path(tmp_dir) / "trainer_state.json").string(), j.dump(2) + "\n");
    fsync_dir(tmp_dir);
    if (fs::exists(final_dir)) fs::remove_all(final_dir);  // same step saved again (e.g. at exit)
    fs::rename(tmp_dir, final_dir);
    fsync_dir(run_dir);
    write_file_atomic((fs::path(run_dir) / "latest").string(), name + "\n");
  } catch (const std::exception& e) {
    fs::remove_all(tmp_dir, ec);
    fail("could not save checkpoint ", final_dir, ": ", e.what(),
         "; the previous checkpoint is intact (", resolve_checkpoint(run_dir), ")");
  }
  if (keep > 0) {
    std::vector<std::string> all;
    for (const auto& e : fs::directory_iterator(run_dir))
      if (e.is_directory() && e.path().filename().string().rfind("checkpoint-", 0) == 0)
        all.push_back(e.path().string());
    std::sort(all.begin(), all.end());
    for (size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i], ec);
  }
  return final_dir;
}

std::string resolve_checkpoint(const std::string& path) {
  if (fs::exists(fs::path(path) / "trainer_state.json") ||
      fs::exists(fs::path(path) / "model.safetensors"))
    return path;
  const fs::path latest = fs::path(path) / "latest";
  if (!fs::exists(latest)) return "";
  std::ifstream in(latest);
  std::string name;
  std::getline(in, name);
  const fs::path dir = fs::path(path) / name;
  if (name.empty() || !fs::exists(dir / "model.safetensors"))
    fail(latest.string(), " names '", name, "', which is not a complete checkpoint");
  return dir.string();
}

TrainerState load_checkpoint(const std::string& dir, model::BertModel& m, Optimizer* opt) {
  const std::string state_path = (fs::path(dir) / "trainer_state.json").string();
  std::ifstream in(state_path);
  if (!in) fail("no trainer_state.json in ", dir, " (not a bertrain training checkpoint)");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    fail(state_path, " is not valid JSON: ", e.what());
  }
  if (j.value("format", "") != "bertrain-trainer-state")
    fail(state_path, " is not a bertrain trainer state");
  const int version = j.value("version", 0);
  if (version != kTrainerStateVersion)
    fail(state_path, " has format version ", version, "; this bertrain reads version ",
         kTrainerStateVersion, " (resume with the bertrain that wrote it)");
  const model::BertConfig ck = model::BertConfig::load((fs::path(dir) / "config.json").string());
  if (!ck.same_shapes(m.config()))
    fail("checkpoint ", dir,
         " is of another model (its config.json differs from --model-config in ",
         "sizes); resume with the same model config or start a new --output");
  model::load_safetensors_into(m, (fs::path(dir) / "model.safetensors").string());
  TrainerState st;
  // A field missing or of the wrong type is an error naming the file and the field.
  const char* field = "";
  try {
    st.step = j.at(field = "step");
    st.loss_scale = j.at(field = "loss_scale");
    st.scaler_good = j.at(field = "scaler_good_steps");
    st.scaler_skipped = j.at(field = "scaler_skipped_steps");
    st.optimizer_steps = j.at(field = "optimizer_steps");
    st.settings = j.at(field = "settings");
    for (const auto& p : j.at(field = "pipeline"))
      st.positions.push_back({p.at("epoch").get<uint64_t>(), p.at("batches").get<uint64_t>(),
                              std::stoull(p.at("fingerprint").get<std::string>())});
  } catch (const std::exception& e) {
    fail(state_path, ": field \"", field, "\" is missing or malformed (", e.what(),
         "); resume from an earlier checkpoint of the run");
  }
  if (opt) {
    SafetensorsReader r((fs::path(dir) / "optimizer.safetensors").string());
    auto mm = r.read_f32("m"), vv = r.read_f32("v");
    if (mm.size() != opt->m().size() || vv.size() != opt->v().size())
      fail(dir, "/optimizer.safetensors holds ", mm.size(), " moments, the model needs ",
           opt->m().size());
    const std::string kind = r.metadata().count("optimizer") ? r.metadata().at("optimizer") : "";
    if (kind != optimizer_name(opt->config().kind))
      fail("checkpoint ", dir, " was trained with --optimizer ", kind,
           "; resume with the same optimizer");
    std::copy(mm.begin(), mm.end(), opt->m().begin());
    std::copy(vv.begin(), vv.end(), opt->v().begin());
    opt->set_steps(st.optimizer_steps);
  }
  return st;
}

}  // namespace bertrain::train
