#include "obs/doctor.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/setting.h"

namespace bertrain::obs {

namespace {

double get(const nlohmann::json& row, const char* key) {
  return row.contains(key) && row[key].is_number() ? row[key].get<double>() : 0.0;
}

// The lower median (of two values, the smaller).
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 2];
}

std::string pct(double x) {
  char b[16];
  std::snprintf(b, sizeof b, "%.0f%%", 100 * x);
  return b;
}

std::string fmt(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", x);
  return b;
}

}  // namespace

std::vector<Finding> diagnose(const std::vector<nlohmann::json>& rows, double memory_bytes,
                              const DiagnoseLimits& lim) {
  std::vector<Finding> out;
  if (rows.empty()) return out;
  // The first logged window holds the warm-up steps (primitive creation, first touches): the
  // shares are judged on the rest when there is a rest.
  const size_t from = rows.size() > 2 ? 1 : 0;
  double step = 0, input = 0, comm = 0;
  for (size_t i = from; i < rows.size(); ++i) {
    step += get(rows[i], "time/step_ms");
    input += get(rows[i], "time/input_wait_ms");
    comm += get(rows[i], "time/communication_exposed_ms");
  }
  if (step > 0 && input / step > lim.input_share)
    out.push_back({"input-bound", "the step waits for input " + pct(input / step) + " of its time",
                   "raise " + setting("readers") + " (parallel parse) and " + setting("prefetch") +
                       ", write more and smaller shards "
                       "(prepare " +
                       setting("output_shards") +
                       "), keep the data on local disk; bertrain bench-input "
                       "measures the pipeline alone"});
  // Stragglers: per row, each rank's time over the median rank's; a rank that is slow in most
  // rows (the median of its ratios) is named.
  bool straggler = false;
  size_t ranks = 0;
  for (const auto& r : rows)
    if (r.contains("rank_step_ms")) ranks = std::max(ranks, r["rank_step_ms"].size());
  if (ranks > 1) {
    std::vector<std::vector<double>> ratio(ranks);
    for (size_t i = from; i < rows.size(); ++i) {
      if (!rows[i].contains("rank_step_ms") || rows[i]["rank_step_ms"].size() != ranks) continue;
      const std::vector<double> t = rows[i]["rank_step_ms"].get<std::vector<double>>();
      for (size_t k = 0; k < ranks; ++k) {  // against the other ranks' median
        std::vector<double> others = t;
        others.erase(others.begin() + static_cast<std::ptrdiff_t>(k));
        const double mid = median(others);
        if (mid > 0) ratio[k].push_back(t[k] / mid);
      }
    }
    // Load imbalance: the step waits for its slowest rank every time, but no rank is slow in
    // most windows (noise, other jobs, unequal cores): the mean over the windows of the
    // slowest rank over the median rank.
    double worst = 0;
    int windows = 0;
    for (size_t i = from; i < rows.size(); ++i) {
      if (!rows[i].contains("rank_step_ms") || rows[i]["rank_step_ms"].size() != ranks) continue;
      const std::vector<double> t = rows[i]["rank_step_ms"].get<std::vector<double>>();
      const double mid = median(t);
      if (mid <= 0) continue;
      worst += *std::max_element(t.begin(), t.end()) / mid;
      ++windows;
    }
    for (size_t k = 0; k < ranks; ++k) {
      const double m = median(ratio[k]);
      if (m > lim.straggler_ratio) straggler = true;
      if (m > lim.straggler_ratio)
        out.push_back({"straggler",
                       "rank " + std::to_string(k) + " takes " + fmt(m) +
                           "x the other ranks' step time (they wait for it in the gradient sum)",
                       "check rank " + std::to_string(k) + "'s host: other load, CPU throttling, " +
                           setting("threads") +
                           " x ranks per host "
                           "against its cores (mpirun --bind-to core), a slower CPU or disk"});
    }
    if (!straggler && windows > 0 && worst / windows > lim.straggler_ratio)
      out.push_back(
          {"load-imbalance",
           "the slowest rank takes " + fmt(worst / windows) +
               "x the median rank's step time on average, a different rank from window to "
               "window (every step waits for the slowest)",
           "equal work and equal cores for every rank: the same " + setting("batch_size") +
               " and " + setting("seq_len") + ", ranks bound to cores (mpirun --bind-to core), " +
               setting("threads") +
               " x ranks per host within its cores, no other jobs on the hosts"});
  }
  if (step > 0 && comm / step > lim.comm_share)
    out.push_back({"communication-bound",
                   "exposed communication takes " + pct(comm / step) + " of the step" +
                       (straggler ? " (on rank 0: much of it waits for the straggler above)" : ""),
                   "more work per allreduce: a larger " + setting("batch_size") + " per rank or " +
                       setting("accumulation_steps") + "; keep " + setting("overlap") +
                       " on (tune " + setting("bucket_mb") + "); between hosts " +
                       setting("compression") + " fp16/bf16 and " + setting("allreduce") +
                       " hierarchical"});
  // Loss spikes: a logged loss above spike_ratio x the median of the 5 rows before it.
  for (size_t i = 5; i < rows.size(); ++i) {
    std::vector<double> prev;
    for (size_t j = i - 5; j < i; ++j) prev.push_back(get(rows[j], "train/loss"));
    const double base = median(prev), l = get(rows[i], "train/loss");
    if (base > 0 && l > lim.spike_ratio * base) {
      out.push_back({"loss-spike",
                     "the loss jumps to " + fmt(l) + " at step " +
                         std::to_string(rows[i]["step"].get<int64_t>()) + " from about " +
                         fmt(base),
                     "lower " + setting("lr") + " or raise " + setting("warmup") +
                         "; resume from the checkpoint before the spike; "
                         "check the data around it (bertrain inspect)"});
      break;  // the first one; later ones follow from it
    }
  }
  const double skipped = get(rows.back(), "train/skipped_steps");
  if (skipped > 0) {
    const double steps = rows.back()["step"].get<double>();
    out.push_back({"fp16-skips",
                   fmt(skipped) + " of " + fmt(steps) +
                       " steps were skipped for non-finite gradients (loss scale now " +
                       fmt(get(rows.back(), "train/loss_scale")) + ")",
                   skipped > 0.01 * steps
                       ? "more than 1% of the steps: train with " + setting("precision") +
                             " bf16 (fp16's range "
                             "overflows) or lower " +
                             setting("lr")
                       : "a few skips while the loss scale settles are normal for fp16"});
  }
  if (memory_bytes > 0) {
    const double peak = get(rows.back(), "memory/peak_rss_mib") * 1048576.0;
    if (peak > lim.memory_share * memory_bytes)
      out.push_back({"memory",
                     "peak memory " + fmt(peak / 1073741824.0) + " GiB is " +
                         pct(peak / memory_bytes) + " of this machine's",
                     "lower " + setting("batch_size") + " (with " + setting("accumulation_steps") +
                         " to keep the global batch) or " + setting("seq_len") +
                         "; bertrain estimate " + setting("memory_budget") +
                         " picks the largest batch that "
                         "fits"});
  }
  return out;
}

std::vector<Finding> diagnose_incidents(const std::string& run_dir) {
  std::ifstream in(std::filesystem::path(run_dir) / "incidents.log");
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);)  // (the elastic restarts: diagnose_elastic's)
    if (!l.empty() && l.rfind("bertrain: elastic ", 0) != 0) lines.push_back(l);
  if (lines.empty()) return {};
  // Hosts the ranks waited for or found gone: every "on host X" / "the ranks on X" after the
  // reporting rank's own "bertrain: rank N on host H:" prefix.
  std::vector<std::string> suspects;
  for (const auto& l : lines) {
    const size_t body = l.find(": ", l.find(" on host "));
    if (body == std::string::npos) continue;
    for (const std::string key : {"on host ", "the ranks on "})
      for (size_t k = l.find(key, body); k != std::string::npos; k = l.find(key, k + 1)) {
        const size_t h = k + key.size();
        const std::string host = l.substr(h, l.find_first_of(" :;(", h) - h);
        if (!host.empty() && std::find(suspects.begin(), suspects.end(), host) == suspects.end())
          suspects.push_back(host);
      }
  }
  std::string hosts;
  for (const auto& h : suspects) hosts += str(hosts.empty() ? "" : ", ", h);
  return {{"incident",
           str(lines.size(), " message(s) from ranks when the job ended",
               hosts.empty() ? std::string() : str(" (waiting for or probing: ", hosts, ")"),
               "; the last: ", lines.back()),
           str("continue from the last checkpoint with --resume; if a host is lost, on the hosts "
               "left (the global batch is kept by the accumulation, the unread examples are "
               "re-divided); see ",
               (std::filesystem::path(run_dir) / "incidents.log").string())}};
}

double daly_interval(double delta_s, double mtbf_s) {
  if (delta_s >= 2 * mtbf_s) return mtbf_s;
  const double r = delta_s / (2 * mtbf_s);
  return std::sqrt(2 * delta_s * mtbf_s) * (1 + std::sqrt(r) / 3 + r / 9) - delta_s;
}

std::vector<Finding> diagnose_elastic(const RunMetrics& run) {
  if (run.events.empty()) return {};
  int restarts = 0, grows = 0;
  double lost = 0;
  int64_t redone = 0, save_every = 0;
  std::string reasons;
  for (const auto& e : run.events) {
    const bool grow = e.value("event", "") == "grow";
    (grow ? grows : restarts) += 1;
    lost += e.value("lost_s", 0.0);
    redone += e.value("recomputed_steps", int64_t{0});
    save_every = e.value("save_every", save_every);
    if (!grow) reasons += str(reasons.empty() ? "" : "; ", e.value("reason", std::string("?")));
  }
  // The failure rate over the run's wall time, the checkpoint's cost and the step's, as logged.
  double t0 = 1e300, t1 = 0;
  std::vector<double> saves, steps;
  for (const auto& r : run.rows) {
    if (r.contains("wall_time")) {
      t0 = std::min(t0, r["wall_time"].get<double>());
      t1 = std::max(t1, r["wall_time"].get<double>());
    }
    if (get(r, "time/checkpoint_s") > 0) saves.push_back(get(r, "time/checkpoint_s"));
    if (get(r, "time/step_ms") > 0) steps.push_back(get(r, "time/step_ms") / 1e3);
  }
  const double span = t1 > t0 ? t1 - t0 : 0;
  std::string what = str(restarts, restarts == 1 ? " restart" : " restarts",
                         restarts ? " (" + reasons + ")" : std::string(), ", ", grows,
                         grows == 1 ? " growth" : " growths", ": ", fmt(lost), " s lost (",
                         fmt(lost / static_cast<double>(run.events.size())),
                         " s each, from the last step before to the first step after), ", redone,
                         redone == 1 ? " step" : " steps", " done again");
  std::string fix = "nothing to change";
  if (restarts > 0 && span > 0 && !saves.empty() && !steps.empty()) {
    const double mtbf = span / restarts, delta = median(saves), step = median(steps);
    const double tau = daly_interval(delta, mtbf);
    const int64_t every = std::max<int64_t>(1, static_cast<int64_t>(std::llround(tau / step)));
    what += str("; ", restarts, restarts == 1 ? " failure" : " failures", " in ", fmt(span),
                " s of training");
    fix = str("for this failure rate (one per ", fmt(mtbf), " s), a checkpoint costing ",
              fmt(delta), " s and steps of ", fmt(step * 1e3), " ms, Young/Daly's interval is ",
              fmt(tau), " s: ", setting("save_every"), " ", every,
              save_every > 0 ? str(" (now ", save_every, ")") : std::string(),
              "; the failure rate of a short run is a rough estimate: use the cluster's own "
              "(hosts x each host's rate)");
  }
  return {{"elastic", what, fix}};
}

std::vector<Finding> diagnose_timeline(const RunMetrics& run, const DiagnoseLimits& lim) {
  std::vector<Finding> out;
  const TraceOverlap o = trace_overlap(run);
  const double step = run.trace_step_ms;
  if (o.comm <= 0 || step <= 0) return out;  // no reducer thread: one rank, or overlap off
  if (o.exposed > lim.comm_share * step && o.hidden < 0.25 * o.comm)
    out.push_back({"late-allreduce",
                   "in " + run.trace_step + " of the timeline the step waits " + fmt(o.exposed) +
                       " ms for the gradient sum, and only " + fmt(o.hidden) + " of " +
                       fmt(o.comm) + " ms of allreduce ran during backward",
                   "start the buckets earlier: a smaller " + setting("bucket_mb") +
                       " (a bucket goes as soon as its layers' gradients are done), " +
                       setting("overlap") + " on"});
  return out;
}

namespace {
// Calls `int symbol(int*)` of the first of `libs` that loads and has it; the library stays
// loaded (the loader counts references; doctor runs once).
int query_version(std::initializer_list<const char*> libs, const char* symbol, std::string& lib) {
  for (const char* name : libs) {
    void* h = dlopen(name, RTLD_LAZY | RTLD_LOCAL);
    if (!h) continue;
    using Fn = int (*)(int*);
    if (auto fn = reinterpret_cast<Fn>(dlsym(h, symbol))) {
      int v = 0;
      if (fn(&v) == 0 && v > 0) {
        lib = name;
        return v;
      }
    }
    dlclose(h);
  }
  return 0;
}
}  // namespace

GpuStack gpu_stack() {
  GpuStack g;
  g.cuda_runtime =
      query_version({"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"},
                    "cudaRuntimeGetVersion", g.runtime_lib);
  g.cuda_driver = query_version({"libcuda.so.1", "libcuda.so"}, "cuDriverGetVersion", g.driver_lib);
  g.nccl = query_version({"libnccl.so.2", "libnccl.so"}, "ncclGetVersion", g.nccl_lib);
  return g;
}

std::string cuda_version_name(int v) {
  return str(v / 1000, ".", (v % 1000) / 10);
}

std::string nccl_version_name(int v) {
  return v >= 10000 ? str(v / 10000, ".", (v % 10000) / 100, ".", v % 100)
                    : str(v / 1000, ".", (v % 1000) / 100, ".", v % 100);
}

}  // namespace bertrain::obs
