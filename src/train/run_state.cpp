#include "train/run_state.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>

#include <cerrno>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "core/error.h"
#include "core/host.h"
#include "core/safetensors.h"
#include "data/storage.h"
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

std::string shard_file(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "optimizer.rank-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

// model.safetensors of a sharded master into dir: the matmul weights rank 0 does not hold in
// fp32 come from the "master" parts of `files` (one per rank, each with its begin/end).
void save_assembled(const model::BertModel& m, const std::string& dir,
                    const std::vector<std::string>& files, int64_t total) {
  struct Part {
    int64_t begin, end;
    const float* data;  // [begin, end), mapped from its file
  };
  std::vector<std::unique_ptr<SafetensorsReader>> readers;
  std::vector<Part> parts;
  for (const std::string& f : files) {
    const auto& r = *readers.emplace_back(std::make_unique<SafetensorsReader>(f));
    const auto& meta = r.metadata();
    const SafeTensorInfo* t = r.find("master");
    const int64_t b = meta.count("begin") ? std::stoll(meta.at("begin")) : 0;
    const int64_t e = meta.count("end") ? std::stoll(meta.at("end")) : total;
    if (!t || t->dtype != DType::F32 || shape_numel(t->shape) != e - b)
      fail(f, " holds no fp32 master weights for [", b, ", ", e,
           ") (written by a run without a sharded master?)");
    parts.push_back({b, e, static_cast<const float*>(r.data(*t))});
  }
  model::save_pretrained(m, dir, DType::F32, [&](const model::ParamInfo& p, float* out) {
    int64_t covered = 0;
    for (const Part& q : parts) {
      const int64_t lo = std::max(q.begin, p.offset), hi = std::min(q.end, p.end());
      if (hi <= lo) continue;
      std::copy(q.data + (lo - q.begin), q.data + (hi - q.begin), out + (lo - p.offset));
      covered += hi - lo;
    }
    if (covered != p.numel())
      fail("the optimizer shards hold ", covered, " of the ", p.numel(), " weights of ", p.name);
  });
}

std::string master_part_file(const std::string& dir, int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, ".master.rank-%05d-of-%05d.safetensors", rank, world);
  return (fs::path(dir) / buf).string();
}

void write_master_part(const std::string& path, const float* data, int64_t begin, int64_t end,
                       int64_t total) {
  write_safetensors(path, {{"master", DType::F32, {end - begin}, data, nullptr}},
                    {{"format", "bertrain-master-part"},
                     {"begin", std::to_string(begin)},
                     {"end", std::to_string(end)},
                     {"total", std::to_string(total)}});
}

// `files` names each rank's fp32 master part as rank 0 would read it (its optimizer shard, or a
// part file). The parts rank 0 does not see (written into another host's directory) come to it
// over comm from their owners, each written as master_part_file(dir, r, world), which `files`
// then names on rank 0. Collective. Rank 0: returns the files it wrote (for the caller to
// remove); a write that failed is in `error`, and the passes go on so every rank ends together.
std::vector<std::string> pass_unseen_master_parts(const model::BertModel& m,
                                                  comm::Communicator& comm,
                                                  std::vector<std::string>& files,
                                                  const std::string& dir, std::string& error) {
  const int rank = comm.rank(), world = comm.size();
  std::vector<uint8_t> unseen(world, 0);
  if (rank == 0)
    for (int r = 1; r < world; ++r) unseen[r] = !fs::exists(files[r]);
  comm.broadcast(unseen.data(), world, 0);
  const model::ModelDims& d = m.dims();
  std::vector<std::string> written;
  for (int r = 1; r < world; ++r) {
    if (!unseen[r]) continue;
    int64_t range[2] = {d.master_begin, d.master_end};
    comm.broadcast(range, sizeof range, r);
    std::vector<float> part(rank == 0 ? static_cast<size_t>(range[1] - range[0]) : 0);
    void* data = rank == 0   ? part.data()
                 : rank == r ? const_cast<float*>(m.params() + d.master_begin)  // only read
                             : nullptr;
    comm.pass(data, (range[1] - range[0]) * static_cast<int64_t>(sizeof(float)), r, 0);
    if (rank != 0 || !error.empty()) continue;
    try {
      files[r] = master_part_file(dir, r, world);
      write_master_part(files[r], part.data(), range[0], range[1], m.table().total());
      written.push_back(files[r]);
    } catch (const std::exception& e) {
      error = str("rank ", r, "'s part of the weights, passed to rank 0: ", e.what());
    }
  }
  return written;
}

}  // namespace

void save_pretrained_sharded(const model::BertModel& m, const std::string& dir,
                             comm::Communicator& comm) {
  const model::ModelDims& d = m.dims();
  BT_CHECK(d.master_shard, "save_pretrained_sharded: the model's master is not sharded");
  const int rank = comm.rank(), world = comm.size();
  const int64_t total = m.table().total();
  auto part = [&](int r) { return master_part_file(dir, r, world); };
  std::string error;
  auto agree = [&](const char* what) {
    if (comm.all(error.empty())) return;
    std::error_code ec;
    fs::remove(part(rank), ec);
    fail("could not save the model into ", dir, ": ",
         error.empty() ? str("another rank failed to ", what) : error);
  };
  try {
    std::error_code ec;
    fs::create_directories(dir, ec);
    write_master_part(part(rank), m.params() + d.master_begin, d.master_begin, d.master_end, total);
  } catch (const std::exception& e) {
    error = str("rank ", rank, ": ", e.what());
  }
  agree("write its part of the weights");
  // A directory of each host's own (no shared file system): the other hosts' parts travel.
  std::vector<std::string> files;
  for (int r = 0; r < world; ++r) files.push_back(part(r));
  const std::vector<std::string> passed = pass_unseen_master_parts(m, comm, files, dir, error);
  if (rank == 0 && error.empty()) try {
      save_assembled(m, dir, files, total);
    } catch (const std::exception& e) {
      error = e.what();
    }
  std::error_code ec;
  for (const std::string& f : passed) fs::remove(f, ec);
  agree("assemble the model");
  fs::remove(part(rank), ec);
}

std::string save_optimizer_state(const std::string& dir, const Optimizer& opt,
                                 const float* master) {
  const Shard& sh = opt.shard();
  const std::string path =
      (fs::path(dir) / (opt.sharded() ? shard_file(sh.rank, sh.world) : "optimizer.safetensors"))
          .string();
  // layout: the flat buffer's, ParamTable's (the vocabulary padded to 64 rows since "vocab64").
  std::map<std::string, std::string> meta = {{"format", "bertrain-optimizer"},
                                             {"optimizer", optimizer_name(opt.config().kind)},
                                             {"layout", "vocab64"}};
  if (opt.sharded()) {
    meta["begin"] = std::to_string(sh.begin);
    meta["end"] = std::to_string(sh.end);
    meta["total"] = std::to_string(opt.total());
  }
  const int64_t n = static_cast<int64_t>(opt.m().size());
  std::vector<SafeTensorOut> tensors = {{"m", DType::F32, {n}, opt.m().data(), nullptr},
                                        {"v", DType::F32, {n}, opt.v().data(), nullptr}};
  if (!opt.backend().host_memory())  // a GPU's moments: copied out as they are written
    for (SafeTensorOut& t : tensors) {
      const float* at = t.f32;
      t.f32 = nullptr;
      t.fill = [&opt, at, n](float* o) {
        opt.backend().to_host(o, at, static_cast<size_t>(n) * sizeof(float));
      };
    }
  if (master) tensors.push_back({"master", DType::F32, {n}, master, nullptr});
  write_safetensors(path, tensors, meta);
  return path;
}

std::vector<std::string> optimizer_state_files(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "optimizer.safetensors"))
    return {(fs::path(dir) / "optimizer.safetensors").string()};
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("optimizer.rank-", 0) == 0 && name.size() > 12 &&
        name.compare(name.size() - 12, 12, ".safetensors") == 0)
      files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

void load_optimizer_state(const std::string& dir, Optimizer& opt) {
  const std::vector<std::string> files = optimizer_state_files(dir);
  if (files.empty())
    fail("checkpoint ", dir, " has no optimizer state (optimizer.safetensors or its shards)");
  const Shard& want = opt.shard();
  // The parts found must tile [0, total) exactly: a missing shard (a rank that wrote into a
  // directory the others cannot see) is an error naming the gap, not zeros.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const std::string& path : files) {
    SafetensorsReader r(path);
    const auto& meta = r.metadata();
    auto field = [&](const char* k, int64_t dflt) -> int64_t {
      const auto it = meta.find(k);
      if (it == meta.end()) return dflt;
      try {
        return std::stoll(it->second);
      } catch (const std::exception&) {
        fail(path, ": metadata \"", k, "\" is not a number ('", it->second, "')");
      }
    };
    const std::string kind = meta.count("optimizer") ? meta.at("optimizer") : "";
    if (kind != optimizer_name(opt.config().kind))
      fail("checkpoint ", dir, " was trained with --optimizer ", kind,
           "; resume with the same optimizer");
    const int64_t total = field("total", opt.total());
    const int64_t b = field("begin", 0), e = field("end", total);
    const SafeTensorInfo* m = r.find("m");
    const SafeTensorInfo* v = r.find("v");
    if (!meta.count("layout") && m && (total != opt.total() || shape_numel(m->shape) != e - b))
      fail(path, " was written before bertrain padded the vocabulary inside the model: its ",
           "moments are laid out for another parameter buffer. Resume from its weights with ",
           "--init-checkpoint ", dir, " (the optimizer's moments start again)");
    if (total != opt.total() || !m || !v || m->dtype != DType::F32 || v->dtype != DType::F32 ||
        shape_numel(m->shape) != e - b || shape_numel(v->shape) != e - b || b < 0 || e > total ||
        b > e)
      fail(path, " holds ", m ? shape_numel(m->shape) : 0, " moments for [", b, ", ", e, ") of ",
           total, " parameters; the model needs ", opt.total(),
           " (a checkpoint of another model, or a damaged file)");
    ranges.push_back({b, e});
    const int64_t lo = std::max(b, want.begin), hi = std::min(e, want.end);
    if (hi <= lo) continue;
    const float* src_m = static_cast<const float*>(r.data(*m)) + (lo - b);
    const float* src_v = static_cast<const float*>(r.data(*v)) + (lo - b);
    // (into the backend's memory: a GPU's, or the host's)
    const size_t bytes = static_cast<size_t>(hi - lo) * sizeof(float);
    opt.backend().to_device(opt.m().data() + (lo - want.begin), src_m, bytes);
    opt.backend().to_device(opt.v().data() + (lo - want.begin), src_v, bytes);
  }
  std::sort(ranges.begin(), ranges.end());
  int64_t covered = 0;
  for (const auto& [b, e] : ranges) {
    if (b != covered)
      fail("checkpoint ", dir, ": the optimizer shards ", b > covered ? "leave out" : "overlap at",
           " parameters [", std::min(b, covered), ", ", std::max(b, covered),
           ") (a shard file is missing: were the ranks writing to a directory they all see?)");
    covered = e;
  }
  if (covered != opt.total())
    fail("checkpoint ", dir, ": the optimizer shards end at parameter ", covered, " of ",
         opt.total(), " (a shard file is missing)");
}

namespace {

// A staging directory's writer: ".checkpoint-N.tmp-<host>-<pid>" (the name's tail).
std::string writer_tag(const std::string& host, pid_t pid) {
  return host + "-" + std::to_string(pid);
}

// What a failed save leaves: the checkpoint before it, or that there is none.
std::string previous_checkpoint_line(const std::string& run_dir) {
  std::string previous;
  try {
    previous = resolve_checkpoint(run_dir);
  } catch (const Error&) {
  }
  return previous.empty() ? str("; ", run_dir, " holds no earlier checkpoint (this was its first)")
                          : str("; the previous checkpoint is intact (", previous, ")");
}

}  // namespace

std::vector<std::string> remove_abandoned_checkpoint_writes(const std::string& run_dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return removed;
  const std::string here = host_name();
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const std::string n = e.path().filename().string();
    const size_t tmp = n.rfind(".tmp-");
    if (n.rfind(".checkpoint-", 0) != 0 || tmp == std::string::npos || !e.is_directory()) continue;
    // This host's writers only (<host>-<pid>; a bare <pid>: an older bertrain's, on this host).
    const std::string tag = n.substr(tmp + 5);
    const size_t dash = tag.rfind('-');
    const std::string host = dash == std::string::npos ? here : tag.substr(0, dash);
    const std::string pid_text = dash == std::string::npos ? tag : tag.substr(dash + 1);
    if (host != here || pid_text.empty() ||
        pid_text.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const auto pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // still there
    fs::remove_all(e.path(), ec);
    if (!ec) removed.push_back(e.path().string());
  }
  return removed;
}

std::string save_checkpoint(const std::string& run_dir, const model::BertModel& m,
                            const Optimizer& opt, const TrainerState& st, int keep,
                            comm::Communicator* comm, std::string* host_shards) {
  const bool shards = opt.sharded();
  BT_CHECK(!shards || comm, "a sharded optimizer's checkpoint is saved by every rank (comm)");
  const bool per_host = shards && host_shards;
  if (host_shards) host_shards->clear();
  // root commits; lead makes the staging directory (root, or per host each host's first rank)
  const bool root = !shards || comm->rank() == 0;
  const bool lead = per_host ? comm->local_rank() == 0 : root;
  std::error_code ec;
  const std::string name = checkpoint_name(st.step);
  const std::string final_dir = (fs::path(run_dir) / name).string();
  // Shards: every rank (per host: every rank of the host) writes into the same staging
  // directory, so its name is the same on all.
  const std::string tmp_dir =
      (fs::path(run_dir) /
       ("." + name + ".tmp-" +
        (shards ? (per_host ? "shards-node-" + std::to_string(comm->node()) : std::string("shards"))
                : writer_tag(host_name(), ::getpid()))))
          .string();
  // Every rank learns whether every rank succeeded; the first error is rethrown on its rank
  // and named on the others.
  std::string error;
  auto agree = [&](const char* what) {
    if (shards ? comm->all(error.empty()) : error.empty()) return;
    if (lead) fs::remove_all(tmp_dir, ec);
    fail("could not save checkpoint ", final_dir, ": ",
         error.empty() ? str("another rank failed to ", what) : error,
         previous_checkpoint_line(run_dir));
  };
  if (lead) {
    fs::create_directories(run_dir, ec);
    if (ec) error = str("cannot create run directory ", run_dir, ": ", ec.message());
    fs::remove_all(tmp_dir, ec);
    if (error.empty() && !fs::create_directories(tmp_dir, ec))
      error = str("cannot create ", tmp_dir, ": ", ec ? ec.message() : "it exists");
  }
  agree("create the checkpoint directory");
  const bool master_shard = m.dims().master_shard;
  if (shards) {
    try {
      save_optimizer_state(tmp_dir, opt, master_shard ? m.params() + opt.shard().begin : nullptr);
    } catch (const std::exception& e) {
      error = str("rank ", comm->rank(), ": ", e.what());
    }
    agree("write its optimizer shard");
  }
  // Per host: the fp32 master parts of the other hosts' ranks come to rank 0 for the model.
  std::vector<std::string> master_files, passed;
  if (master_shard) {
    for (int r = 0; r < opt.shard().world; ++r)
      master_files.push_back((fs::path(tmp_dir) / shard_file(r, opt.shard().world)).string());
    if (per_host) passed = pass_unseen_master_parts(m, *comm, master_files, tmp_dir, error);
  }
  if (per_host && lead && !root && error.empty()) *host_shards = tmp_dir;
  if (root && error.empty()) try {
      if (shards && !per_host) {
        // Rank 0 sees every shard, or the directory is not shared by the ranks.
        for (int r = 0; r < opt.shard().world; ++r)
          if (!fs::exists(fs::path(tmp_dir) / shard_file(r, opt.shard().world)))
            fail("rank ", r, "'s optimizer shard is not in ", tmp_dir,
                 " as rank 0 sees it: a sharded run needs an --output directory every rank "
                 "sees (a shared file system)");
      }
      if (master_shard) {
        // The matmul weights this rank does not hold in fp32 come from the ranks' shards.
        save_assembled(m, tmp_dir, master_files, opt.total());
        for (const std::string& f : passed) fs::remove(f);
      } else {
        model::save_pretrained(m, tmp_dir);
      }
      if (!shards) save_optimizer_state(tmp_dir, opt);
      nlohmann::json j = {{"format", "bertrain-trainer-state"},
                          {"version", kTrainerStateVersion},
                          {"step", st.step},
                          {"loss_scale", st.loss_scale},
                          {"scaler_good_steps", st.scaler_good},
                          {"scaler_skipped_steps", st.scaler_skipped},
                          {"optimizer_steps", st.optimizer_steps},
                          {"settings", st.settings}};
      nlohmann::json pos = nlohmann::json::array();
      for (const auto& p : st.positions) {
        nlohmann::json e = {{"epoch", p.epoch},
                            {"batches", p.batches},
                            {"examples", p.examples},
                            {"fingerprint", std::to_string(p.fingerprint)}};
        // After a resume on another rank count: each epoch's parts of the old ranks' streams,
        // [world, rank, begin, end] (the epochs not yet finished).
        for (const auto& plan : p.plans) {
          if (plan.epoch < p.epoch) continue;
          nlohmann::json parts = nlohmann::json::array();
          for (const auto& part : plan.parts)
            parts.push_back({part.world, part.rank, part.begin, part.end});
          e["plans"].push_back({{"epoch", plan.epoch}, {"parts", parts}});
        }
        pos.push_back(e);
      }
      j["pipeline"] = pos;
      write_file_atomic((fs::path(tmp_dir) / "trainer_state.json").string(), j.dump(2) + "\n");
      fsync_dir(tmp_dir);
      if (fs::exists(final_dir)) fs::remove_all(final_dir);  // same step saved again (e.g. at exit)
      fs::rename(tmp_dir, final_dir);
      fsync_dir(run_dir);
      write_file_atomic((fs::path(run_dir) / "latest").string(), name + "\n");
    } catch (const std::exception& e) {
      error = e.what();
    }
  agree("commit the checkpoint");
  if (root && keep > 0) {
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
    for (const auto& p : j.at(field = "pipeline")) {
      data::PipelinePosition pos{p.at("epoch").get<uint64_t>(),
                                 p.at("batches").get<uint64_t>(),
                                 std::stoull(p.at("fingerprint").get<std::string>()),
                                 {}};
      if (p.contains("examples")) pos.examples = p.at("examples").get<uint64_t>();
      if (p.contains("plans"))
        for (const auto& plan : p.at("plans")) {
          data::EpochPlan e{plan.at("epoch").get<uint64_t>(), {}};
          for (const auto& q : plan.at("parts"))
            e.parts.push_back({q.at(0).get<int>(), q.at(1).get<int>(), q.at(2).get<uint64_t>(),
                               q.at(3).get<uint64_t>()});
          pos.plans.push_back(std::move(e));
        }
      st.positions.push_back(std::move(pos));
    }
  } catch (const std::exception& e) {
    fail(state_path, ": field \"", field, "\" is missing or malformed (", e.what(),
         "); resume from an earlier checkpoint of the run");
  }
  if (opt) {
    load_optimizer_state(dir, *opt);
    opt->set_steps(st.optimizer_steps);
  }
  return st;
}

namespace {

// This process's command line (/proc/self/cmdline), for the lock file: at most 300 characters.
std::string own_command() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::replace(raw.begin(), raw.end(), '\0', ' ');
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  return raw.size() > 300 ? raw.substr(0, 297) + "..." : raw;
}

}  // namespace

std::string job_holder() {
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  return str("host ", host_name(), ", pid ", ::getpid(), ", started ", when, ": ", own_command());
}

RunDirLock::RunDirLock(const std::string& run_dir) {
  if (data::is_remote(run_dir)) return;
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  const std::string path = (fs::path(run_dir) / "bertrain.lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    fail("cannot open the run directory's lock ", path, ": ", std::strerror(errno), " (is ",
         run_dir, " writable?)");
  auto holder = [&] {
    std::string text(4096, '\0');
    const ssize_t n = ::pread(fd_, text.data(), text.size(), 0);
    text.resize(n > 0 ? static_cast<size_t>(n) : 0);
    while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
    return text;
  };
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string who = holder();
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK)
      fail("cannot lock the run directory ", run_dir, " (", path, "): ", std::strerror(err));
    fail(run_dir, " is in use by another job (", who.empty() ? "its holder is starting" : who,
         "): one job per run directory. Use another --output, or stop that job first (its "
         "lock, ",
         path, ", goes when it ends)");
  }
  // Ours. A lock file with a holder written in it and no flock: a job that is gone.
  if (const std::string old = holder(); !old.empty())
    note_ = str("took over ", path, " from a job that is gone (", old, ")");
  const std::string mine = job_holder() + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, mine.data(), mine.size(), 0) != static_cast<ssize_t>(mine.size()))
    fail("cannot write the run directory's lock ", path, ": ", std::strerror(errno));
  ::fsync(fd_);
}

RunDirLock::~RunDirLock() {
  if (fd_ < 0) return;
  // Emptied before it is released: a lock file with no holder written in it was left cleanly.
  [[maybe_unused]] const int rc = ::ftruncate(fd_, 0);
  ::close(fd_);
}

}  // namespace bertrain::train
