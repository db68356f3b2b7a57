#include "train/trainer.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <omp.h>
#include <pthread.h>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "comm/incidents.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/setting.h"
#include "model/checkpoint.h"
#include "obs/events.h"
#include "plan/memory.h"
#include "train/autotune.h"
#include "train/loss_scaler.h"
#include "train/run_mirror.h"
#include "train/run_state.h"
#include "train/step.h"

namespace bertrain::train {

std::atomic<int> g_stop_signal{0};

namespace {

std::string hms(double s) {
  char buf[32];
  const int t = static_cast<int>(s + 0.5);
  std::snprintf(buf, sizeof buf, "%d:%02d:%02d", t / 3600, t / 60 % 60, t % 60);
  return buf;
}

}  // namespace

// SIGTERM, SIGINT and SIGUSR1 are blocked in every thread and taken by one thread of their own
// that waits for them (sigwait), so no signal is ever delivered asynchronously to a thread that
// computes. That is not only tidiness: oneDNN's JIT f32 GEMM kernels (the AVX2 and AVX-512
// "gemm:jit" paths, taken on AVX2 CPUs and for some shapes elsewhere) point RSP into a heap
// workspace while they run, and a signal delivered then writes its frame into the heap
// (oneDNN issue #4845, fixed upstream after the 2.6 that Debian ships): "free(): invalid
// pointer" a few calls later. The first signal asks the loop to stop after the step (and
// checkpoint); a second one ends the process at once (checkpoints are written atomically).
void install_signal_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGUSR1);
    // Threads created from here on inherit the mask: call before any other thread exists.
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    std::thread([set] {
      for (;;) {
        int sig = 0;
        if (sigwait(&set, &sig) != 0) continue;
        if (g_stop_signal.exchange(sig) != 0) {
          std::fprintf(stderr,
                       "bertrain: second signal %d: exiting now (the last complete "
                       "checkpoint stands)\n",
                       sig);
          std::_Exit(128 + sig);
        }
      }
    }).detach();
  });
}

int64_t warmup_steps(double warmup, int64_t steps) {
  // A fraction of the run, rounded up: --warmup 0.1 warms up for at least one step however
  // short the run (1e-9: 0.1 * 30 is 3.0000000000000004, still 3 steps).
  if (warmup < 1.0) return static_cast<int64_t>(std::ceil(warmup * steps - 1e-9));
  return static_cast<int64_t>(warmup);
}

// How long a rank of a multi-rank job may still wait (for input or in a collective) once a stop
// was requested, before it ends the job: long enough for its peers to finish the step they are
// in, short enough to answer a preemption in seconds (at least; collectives get twice the
// slowest step when that is longer).
constexpr double kStopGraceSeconds = 5.0;

namespace {

// Sums of step reports over a logging window or the whole run.
struct Totals {
  double loss = 0, mlm_correct = 0, mlm_weight = 0, nsp_correct = 0, examples = 0;
  double real_tokens = 0, computed_tokens = 0, token_slots = 0, flops = 0;
  double input = 0, forward = 0, backward = 0, comm = 0, optimizer = 0, hidden = 0, total = 0;
  double input_hidden = 0;  // read ahead behind the device's backward
  int64_t steps = 0;
  void add(const StepReport& r) {
    loss += r.loss;
    mlm_correct += r.mlm_correct;
    mlm_weight += r.mlm_weight;
    nsp_correct += r.nsp_correct;
    examples += r.examples;
    real_tokens += r.real_tokens;
    computed_tokens += r.computed_tokens;
    token_slots += r.token_slots;
    flops += r.flops;
    input += r.t_input;
    forward += r.t_forward;
    backward += r.t_backward;
    comm += r.t_comm;
    optimizer += r.t_optimizer;
    hidden += r.t_hidden;
    input_hidden += r.t_input_hidden;
    total += r.t_total;
    ++steps;
  }
};

// This process's proportional set size in bytes (/proc/self/smaps_rollup; 0 where unknown):
// resident memory with each shared page divided among the processes that map it. Ranks that
// share their gradients in an MPI window each count the pages they touch in their peers'
// buffers in the RSS; the PSS counts every page once over the ranks.
double proportional_set_size() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string key;
  double kib = 0;
  while (in >> key) {
    if (key == "Pss:") {
      in >> kib;
      return kib * 1024.0;
    }
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

}  // namespace

struct Trainer::State {
  TrainConfig cfg;
  comm::Communicator& comm;
  int rank, world;
  model::BertConfig mcfg;
  Session session;  // the model, optimizer, scaler and step (session.h)
  model::BertModel& m;
  Optimizer& opt;
  LossScaler& scaler;
  int64_t warmup;
  LrSchedule sched;
  nlohmann::json settings;
  int64_t start_step = 0;
  data::PipelinePosition position;
  // Every rank's epoch plans (a resume on another rank count): saved with the positions.
  std::vector<std::vector<data::EpochPlan>> plans_of_rank;
  std::string regrid_note;           // what such a resume did with the batch and the data (banner)
  std::unique_ptr<RunDirLock> lock;  // rank 0: the run directory, held for the run
  // Rank 0 of a run published to object storage (TrainConfig::publish_to): the uploads run
  // beside training, one at a time; an upload's error ends the run at the next wait.
  std::unique_ptr<RunLease> lease;  // rank 0: the bucket prefix, held for the run
  std::unique_ptr<RunMirror> mirror;
  // A sharded run over several hosts: each host stages its own run directory and its first rank
  // uploads its ranks' shards of each checkpoint (shards_mirror) for rank 0 to commit. attempt:
  // rank 0's token for this job, in every host's manifest.
  std::unique_ptr<RunMirror> shards_mirror;
  int hosts = 1;
  bool per_host = false;
  std::string attempt;
  std::future<void> upload;  // rank 0's (or a host's shards'), one at a time
  std::string published;     // the newest checkpoint committed to the bucket (set by the upload)
  std::string startup_note;  // abandoned checkpoint writes removed, a --resume with nothing
  std::string tuning_note;   // what autotune measured and chose, or kept (banner)
  std::string resumed_from, last_ck;
  int resumed_world = 0;   // ranks of the checkpoint resumed (0: none)
  double last_save_s = 0;  // the last checkpoint's write, seconds (doctor: Young/Daly)
  // An elastic supervisor's restart or growth (launch/elastic.h's BERTRAIN_ELASTIC_*), recorded
  // by rank 0 once the first step after it is done.
  struct ElasticEvent {
    std::string kind, count, reason;  // kind "" : this run was not restarted by a supervisor
    double at = 0;                    // unix seconds the supervisor saw the failure
    double last_step_at = 0;          // unix seconds the last step before it ended (0: unknown)
    int64_t recomputed = 0;           // steps done past the checkpoint resumed
  } elastic;
  // Rank 0: <output>/progress, the last step done and when ("STEP UNIX_SECONDS", rewritten in
  // place every step): what a restart recomputes, and when the run was last making progress.
  int progress_fd = -1;
  void note_progress(int64_t done);
  ~State() {
    if (progress_fd >= 0) ::close(progress_fd);
  }
  std::unique_ptr<data::Pipeline> pipe;
  obs::Timeline tl;
  Step* step = nullptr;  // session's, started once the gradients are placed
  double peak_gflops = 0;
  // Rank 0: TensorBoard events and metrics.jsonl in the run directory.
  std::unique_ptr<obs::EventWriter> events;
  std::unique_ptr<obs::MetricsLog> metrics;
  // Filled by run(), read by summary().
  Totals totals;
  int64_t end_step = 0;
  TrainResult res;

  State(const TrainConfig& c, comm::Communicator& cm);
  void resume_or_init();
  void resume_on_other_ranks(const TrainerState& st, const std::string& ck);
  void check_ranks_agree();
  std::string save(int64_t step_done, const data::PipelinePosition& done_pos);
  void record(int64_t done, int64_t step, const Totals& window, double seconds);
  void log_window(int64_t done, int64_t step, Totals& window, Clock::time_point& start,
                  Clock::time_point run_start);
  void open_mirror();
  void read_elastic_event();
  void record_elastic_event(int64_t first_step);
  void wait_upload();
  void upload_logs();
};

// The run's object-store directory: each host's first rank fetches the latest committed
// checkpoint into its staging directory for --resume; rank 0 publishes from then on.
void Trainer::State::open_mirror() {
  if (cfg.publish_to.empty()) return;
  double first = comm.local_rank() == 0 ? 1.0 : 0.0;
  comm.allreduce_sum(&first, 1);
  hosts = static_cast<int>(first);
  per_host = opt.sharded() && hosts > 1;
  if (per_host) {
    char token[17] = {};
    if (rank == 0) {
      std::random_device rd;
      std::snprintf(token, sizeof token, "%08x%08x", rd(), rd());
    }
    comm.broadcast(token, sizeof token, 0);
    attempt = token;
    if (rank != 0 && comm.local_rank() == 0)
      shards_mirror = std::make_unique<RunMirror>(cfg.publish_to, cfg.output);
  }
  if (rank == 0) {
    lease = std::make_unique<RunLease>(cfg.publish_to, cfg.lease_seconds);
    if (!lease->note().empty()) startup_note += str("  ", lease->note(), "\n");
  }
  if (cfg.resume && comm.local_rank() == 0) {
    const std::string got = RunMirror(cfg.publish_to, cfg.output).fetch_latest();
    if (rank == 0 && !got.empty())
      startup_note += str("  fetched ", got, " from ", cfg.publish_to, " (its latest commit)\n");
  }
  comm.barrier();
  if (rank == 0) mirror = std::make_unique<RunMirror>(cfg.publish_to, cfg.output);
}

// Rank 0, before metrics.jsonl drops the rows past the checkpoint resumed and `progress` is
// rewritten: what the supervisor says of this restart, how many steps it recomputes and when the
// run last made progress.
void Trainer::State::read_elastic_event() {
  const char* kind = std::getenv("BERTRAIN_ELASTIC_KIND");
  if (!kind || !*kind) return;
  auto env = [](const char* k) {
    const char* v = std::getenv(k);
    return std::string(v ? v : "");
  };
  elastic.kind = kind;
  elastic.count = env("BERTRAIN_ELASTIC_COUNT");
  elastic.reason = env("BERTRAIN_ELASTIC_REASON");
  try {
    elastic.at = std::stod(env("BERTRAIN_ELASTIC_AT")) / 1e3;
  } catch (const std::exception&) {
    elastic.at = unix_seconds();
  }
  std::ifstream in(std::filesystem::path(cfg.output) / "metrics.jsonl");
  int64_t last = start_step;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
    if (!row.is_discarded() && row.contains("step") && !row.contains("event") &&
        row["step"].is_number_integer())
      last = std::max(last, row["step"].get<int64_t>());
  }
  // The progress file says it to the step (and when the run last made progress); metrics.jsonl
  // to the log interval where there is none (a stage lost with its host).
  std::ifstream progress(std::filesystem::path(cfg.output) / "progress");
  int64_t step = 0;
  double when = 0;
  if (progress >> step >> when && step > last) last = step;
  if (when > 0) elastic.last_step_at = when;
  elastic.recomputed = last - start_step;
  comm::Incidents::process().report(
      str("bertrain: elastic ", elastic.kind, " ", elastic.count, ": ", elastic.reason,
          "; resumed from ", resumed_from.empty() ? std::string("the start") : resumed_from, " on ",
          world, world == 1 ? " rank" : " ranks",
          resumed_world ? str(" (it was written by ", resumed_world, ")") : std::string(), "; ",
          elastic.recomputed, elastic.recomputed == 1 ? " step" : " steps", " past it done again"));
}

// The restart as a row of metrics.jsonl and a point in TensorBoard, once its first step is done.
void Trainer::State::record_elastic_event(int64_t first_step) {
  if (elastic.kind.empty()) return;
  const double now = unix_seconds();
  // The time lost: from the last step before the failure (else from when the supervisor saw
  // it) to the first step after.
  const double from = elastic.last_step_at > 0 ? elastic.last_step_at : elastic.at;
  metrics->write(nlohmann::json{{"step", first_step},
                                {"event", elastic.kind},
                                {"count", elastic.count},
                                {"reason", elastic.reason},
                                {"world_size", world},
                                {"from_world_size", resumed_world},
                                {"resumed_from", resumed_from},
                                {"failed_at", elastic.at},
                                {"last_step_at", elastic.last_step_at},
                                {"first_step_at", now},
                                {"lost_s", now - from},
                                {"recomputed_steps", elastic.recomputed},
                                {"save_every", cfg.save_every},
                                {"wall_time", now}});
  events->scalars(first_step, {{"cluster/" + elastic.kind, 1.0}});
}

void Trainer::State::note_progress(int64_t done) {
  if (progress_fd < 0) return;
  char line[48];
  std::memset(line, ' ', sizeof line);
  const int n =
      std::snprintf(line, sizeof line, "%lld %.3f", static_cast<long long>(done), unix_seconds());
  line[n] = ' ';
  line[sizeof line - 1] = '\n';
  [[maybe_unused]] const ssize_t w = ::pwrite(progress_fd, line, sizeof line, 0);
}

void Trainer::State::wait_upload() {
  if (!upload.valid()) return;
  try {
    upload.get();
  } catch (const std::exception& e) {
    fail("publishing the run to ", cfg.publish_to, ": ", e.what(),
         "; the bucket's latest commit stands (",
         published.empty() ? std::string("none yet") : published,
         ": a checkpoint is visible only once complete), and this host's copy of the run is in ",
         cfg.output, "; continue with ", setting("resume"), " once the store answers");
  }
}

// The logs, when no checkpoint is uploading (they follow every checkpoint's upload anyway).
void Trainer::State::upload_logs() {
  if (!mirror) return;
  if (upload.valid() && upload.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
    return;
  wait_upload();
  upload = std::async(std::launch::async, [this] {
    lease->check();
    mirror->sync_logs(false);
  });
}

// The logged step's values, to TensorBoard and metrics.jsonl (rank 0). Collective: every rank
// contributes its mean step time over the window (less its wait for the others), so a slow rank
// shows.
void Trainer::State::record(int64_t done, int64_t step, const Totals& w, double seconds) {
  const double n = static_cast<double>(std::max<int64_t>(w.steps, 1));
  // Each rank's own share of the step: without the exposed wait in the gradient sum, which is
  // where fast ranks wait for a slow one (with it, every rank's step would look the same).
  // With it, each rank's memory (its plan, peak RSS and PSS: ranks differ where the fp32 master
  // is sharded, ModelDims::master_shard).
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  const double plan_mib =
      static_cast<double>(m.plan().total_bytes() + opt.plan().total_bytes()) / 1048576.0;
  const double rss_mib = static_cast<double>(ru.ru_maxrss) / 1024.0;
  const double pss_mib = proportional_set_size() / 1048576.0;
  std::vector<double> per_rank(4 * world, 0.0);
  per_rank[rank] = 1e3 * (w.total - w.comm) / n;
  per_rank[world + rank] = plan_mib;
  per_rank[2 * world + rank] = rss_mib;
  per_rank[3 * world + rank] = pss_mib;
  if (world > 1) comm.allreduce_sum(per_rank.data(), 4 * world);
  auto of = [&](int k) {
    return std::vector<double>(per_rank.begin() + k * world, per_rank.begin() + (k + 1) * world);
  };
  const std::vector<double> rank_ms = of(0);
  if (!events) return;
  const obs::Scalars values = {
      {"train/loss", w.loss / n},
      {"train/mlm_accuracy", w.mlm_correct / std::max(w.mlm_weight, 1e-9)},
      {"train/nsp_accuracy", w.nsp_correct / std::max(w.examples, 1.0)},
      {"train/learning_rate", sched.at(step)},
      {"train/loss_scale", scaler.scale()},
      {"train/skipped_steps", static_cast<double>(scaler.skipped())},
      // Real tokens (the input's, padding not counted), and the rows the encoder computed.
      {"throughput/tokens_per_s", w.real_tokens / std::max(seconds, 1e-9)},
      {"throughput/computed_tokens_per_s", w.computed_tokens / std::max(seconds, 1e-9)},
      {"throughput/padding_fraction", 1.0 - w.real_tokens / std::max(w.token_slots, 1.0)},
      {"time/step_ms", 1e3 * w.total / n},
      {"time/input_wait_ms", 1e3 * w.input / n},
      {"time/input_hidden_ms", 1e3 * w.input_hidden / n},
      {"time/forward_ms", 1e3 * w.forward / n},
      {"time/backward_ms", 1e3 * w.backward / n},
      {"time/communication_exposed_ms", 1e3 * w.comm / n},
      {"time/communication_hidden_ms", 1e3 * w.hidden / n},
      {"time/optimizer_ms", 1e3 * w.optimizer / n},
      {"time/slowest_rank_ms", *std::max_element(rank_ms.begin(), rank_ms.end())},
      {"memory/plan_mib", plan_mib},
      {"memory/peak_rss_mib", rss_mib},
      {"memory/pss_mib", pss_mib},
      {"cluster/world_size", static_cast<double>(world)},
      {"time/checkpoint_s", last_save_s},
  };
  events->scalars(done, values);
  metrics->write(done, values,
                 {{"wall_time", unix_seconds()},
                  {"rank_step_ms", rank_ms},
                  {"rank_plan_mib", of(1)},
                  {"rank_peak_rss_mib", of(2)},
                  {"rank_pss_mib", of(3)}});
}

const kernels::Backend& backend_of(const TrainConfig& c) {
  return c.backend ? *c.backend : kernels::cpu_backend();
}

model::ModelDims model_dims(const TrainConfig& c, int rank, int world) {
  const int64_t per_row = c.input.pack_per_row;
  model::ModelDims d;
  d.batch = per_row > 0 ? c.batch_size * per_row : c.batch_size;
  d.seq_len = c.seq_len;
  d.max_predictions = c.max_predictions;
  d.attention = c.attention;
  d.recompute_layers = c.recompute_layers;
  d.unpadded = c.unpadded || per_row > 0;
  d.pack_rows = per_row > 0 ? c.batch_size : 0;
  d = with_precision(d, c.precision);
  if (c.shard_optimizer)
    d = plan::with_master_shard(model::BertConfig::load(c.model_config), model::Head::Pretraining,
                                d, rank, world, backend_of(c));
  return d;
}

SessionSettings session_settings(const TrainConfig& c, int rank, int world) {
  SessionSettings s;
  s.head = model::Head::Pretraining;
  s.dims = model_dims(c, rank, world);
  s.backend = c.backend;
  s.optimizer = c.optimizer;
  s.shard_optimizer = c.shard_optimizer;
  s.max_skipped_steps = c.max_skipped_steps;
  return s;
}

Trainer::State::State(const TrainConfig& c, comm::Communicator& cm)
    : cfg(c),
      comm(cm),
      rank(cm.rank()),
      world(cm.size()),
      mcfg(model::BertConfig::load(c.model_config)),
      session(mcfg, session_settings(c, cm.rank(), cm.size()), cm, std::nullopt),
      m(session.m),
      opt(session.opt),
      scaler(session.scaler),
      warmup(warmup_steps(c.warmup, c.steps)),
      sched{c.lr, c.end_lr, c.power, warmup, c.steps} {
  settings = {{"batch_size", cfg.batch_size},
              {"seq_len", cfg.seq_len},
              {"max_predictions", cfg.max_predictions},
              {"pack", cfg.input.pack_per_row},
              {"accumulation", cfg.accumulation},
              {"world_size", world},
              {"precision", precision_name(cfg.precision)},
              {"optimizer", optimizer_name(cfg.optimizer.kind)},
              {"shard_optimizer", opt.sharded()},
              {"seed", cfg.seed}};
}

// Master weights are fp32: the model's own buffer, params(). bf16: its matmuls use a bf16 copy
// (ModelDims::precision). fp16: it keeps activations in fp16 (ModelDims::precision), and the
// dynamic loss scaler skips steps whose loss or gradients left the fp16 range.
void Trainer::State::resume_or_init() {
  // One job per run directory; then the staging directories of checkpoint writes killed before
  // they finished: gone now.
  if (rank == 0) {
    lock = std::make_unique<RunDirLock>(cfg.output);
    if (!lock->note().empty()) startup_note += str("  ", lock->note(), "\n");
    for (const std::string& d : remove_abandoned_checkpoint_writes(cfg.output))
      startup_note += str("  removed ", d, ": a checkpoint write whose process is gone\n");
  }
  open_mirror();
  const std::string ck = cfg.resume ? resolve_checkpoint(cfg.output) : "";
  const std::string& where = cfg.publish_to.empty() ? cfg.output : cfg.publish_to;
  if (cfg.resume && ck.empty())
    startup_note += str("  --resume: ", where, " holds no checkpoint yet: starting fresh\n");
  if (!ck.empty()) {
    TrainerState st = load_checkpoint(ck, m, &opt);
    // On another number of ranks the per-rank batch and the accumulation may change (the
    // global batch is kept where it can be); on the same number everything must match.
    const bool regrid = static_cast<int>(st.positions.size()) != world;
    for (const char* k : {"batch_size", "seq_len", "max_predictions", "pack", "accumulation",
                          "world_size", "precision", "optimizer"}) {
      if (regrid && (k == std::string("batch_size") || k == std::string("accumulation") ||
                     k == std::string("world_size")))
        continue;
      if (st.settings.contains(k) && st.settings[k] != settings[k])
        fail("cannot resume from ", ck, ": it was trained with ", k, " = ", st.settings[k].dump(),
             ", this run has ", settings[k].dump(), " (resume with the same settings)");
    }
    start_step = st.step;
    resumed_world = static_cast<int>(st.positions.size());
    scaler.restore(st.loss_scale, st.scaler_good, st.scaler_skipped);
    if (regrid) {
      resume_on_other_ranks(st, ck);
    } else {
      position = st.positions[rank];
      for (const auto& p : st.positions) plans_of_rank.push_back(p.plans);
    }
    resumed_from = ck;
  } else if (!cfg.init_checkpoint.empty()) {
    m.init_params(cfg.seed);  // heads absent from a BertModel checkpoint keep BERT's init
    model::load_checkpoint_into(m, cfg.init_checkpoint, {{"cls.", "bert.pooler."}, {}});
  } else {
    m.init_params(cfg.seed);
  }
  last_ck = resumed_from;
}

// A checkpoint of N ranks continued on `world` ranks (a host lost, or more hosts): the global
// batch is kept by the accumulation when it divides (else it changes, with a warning), the
// unread examples of the epochs in progress are re-divided (data::remap_positions), the
// optimizer state (re-partitioned if sharded) and the loss scale carry over.
void Trainer::State::resume_on_other_ranks(const TrainerState& st, const std::string& ck) {
  const int old_world = static_cast<int>(st.positions.size());
  int64_t old_batch = cfg.batch_size, old_accum = cfg.accumulation;
  try {
    old_batch = st.settings.at("batch_size").get<int64_t>();
    old_accum = st.settings.at("accumulation").get<int64_t>();
  } catch (const std::exception&) {
    fail(ck,
         ": trainer_state.json lacks the batch size or accumulation of the run that wrote "
         "it, so its input position cannot be re-divided over ",
         world, " ranks; resume on ", old_world, " ranks");
  }
  if (old_world == 0) fail(ck, ": the checkpoint holds no input position");
  const int64_t old_global = old_batch * old_accum * old_world;
  const int64_t per_step = cfg.batch_size * world;
  auto ranks = [](int n) { return str(n, n == 1 ? " rank" : " ranks"); };
  std::string batch_note;
  if (old_global % per_step == 0) {
    cfg.accumulation = old_global / per_step;
    settings["accumulation"] = cfg.accumulation;
    batch_note = str("global batch ", old_global, " kept (", ranks(world), " x ", cfg.batch_size,
                     " x ", cfg.accumulation, " accumulation; it was ", ranks(old_world), " x ",
                     old_batch, " x ", old_accum, ")");
  } else {
    batch_note = str("WARNING: the global batch changes from ", old_global, " (", ranks(old_world),
                     " x ", old_batch, " x ", old_accum, ") to ", per_step * cfg.accumulation, " (",
                     ranks(world), " x ", cfg.batch_size, " x ", cfg.accumulation,
                     "): ", old_global, " is not a multiple of ", per_step,
                     "; the learning-rate schedule goes on by step. Choose ", setting("batch_size"),
                     " so that ranks x batch divides ", old_global, " to keep it");
  }
  // Record counts of every file, each rank counting its share.
  const std::vector<std::string> files = data::list_files(cfg.input.files);
  std::vector<double> counts(files.size(), 0.0);
  for (size_t i = rank; i < files.size(); i += world)
    counts[i] = static_cast<double>(data::count_records(files[i], cfg.input.compression));
  comm.allreduce_sum(counts.data(), static_cast<int64_t>(counts.size()));
  std::vector<uint64_t> records(counts.begin(), counts.end());
  const data::StreamSizes sizes(files, records, cfg.seed, cfg.input.shuffle);
  const data::Remap r = data::remap_positions(st.positions, old_batch, world, cfg.batch_size, sizes,
                                              cfg.input.pack_per_row > 0);
  position = r.positions[rank];
  for (const auto& p : r.positions) plans_of_rank.push_back(p.plans);
  regrid_note =
      str("  resumed on ", ranks(world), " from a checkpoint of ", ranks(old_world), ": ",
          batch_note, "\n  data: ", r.remaining, " unread examples of epoch",
          r.first_epoch == r.last_epoch ? str(" ", r.first_epoch)
                                        : str("s ", r.first_epoch, "..", r.last_epoch),
          " re-divided over ", ranks(world),
          cfg.input.pack_per_row > 0 ? " instance by instance" : " in whole batches",
          " (none read twice, none skipped",
          r.dropped > 0 ? str("; ", r.dropped, " left over, less than a batch") : std::string(),
          "); later epochs sharded over ", ranks(world), "\n");
}

// Every rank must run the same job: compare a fingerprint of the settings that change the math
// and name the ranks that differ, instead of training something inconsistent.
void Trainer::State::check_ranks_agree() {
  if (world == 1) return;
  const std::string mine = settings.dump() + mcfg.to_json("BertForPreTraining").dump();
  const double h = static_cast<double>(std::hash<std::string>{}(mine) % (uint64_t{1} << 52));
  std::vector<double> all(world, 0.0);
  all[rank] = h;
  comm.allreduce_sum(all.data(), world);
  std::string differ;
  for (int r = 0; r < world; ++r)
    if (all[r] != all[0]) differ += str(differ.empty() ? "" : ", ", r);
  if (!differ.empty())
    fail("rank(s) ", differ,
         " run with another model config, batch size, sequence length, precision, optimizer or "
         "seed than rank 0; launch every rank with the same arguments");
}

std::string Trainer::State::save(int64_t step_done, const data::PipelinePosition& done_pos) {
  TrainerState st;
  st.step = step_done;
  st.loss_scale = scaler.scale();
  st.scaler_good = scaler.good_steps();
  st.scaler_skipped = scaler.skipped();
  st.optimizer_steps = opt.steps();
  st.settings = settings;
  // Every rank's pipeline position goes into rank 0's checkpoint.
  std::vector<double> pos(3 * world, 0.0);
  pos[3 * rank] = static_cast<double>(done_pos.epoch);
  pos[3 * rank + 1] = static_cast<double>(done_pos.batches);
  pos[3 * rank + 2] = static_cast<double>(done_pos.examples);
  comm.allreduce_sum(pos.data(), static_cast<int64_t>(pos.size()));
  for (int r = 0; r < world; ++r)
    st.positions.push_back({static_cast<uint64_t>(pos[3 * r]),
                            static_cast<uint64_t>(pos[3 * r + 1]), done_pos.fingerprint,
                            r < static_cast<int>(plans_of_rank.size())
                                ? plans_of_rank[r]
                                : std::vector<data::EpochPlan>{},
                            static_cast<uint64_t>(pos[3 * r + 2])});
  // (the previous upload first: keep-last may remove its directory here)
  wait_upload();
  const auto save_start = Clock::now();
  std::string host_shards;  // per host: this host's shards, on its first rank
  if (opt.sharded())        // every rank writes its shard
    last_ck = save_checkpoint(cfg.output, m, opt, st, static_cast<int>(cfg.keep_last), &comm,
                              per_host ? &host_shards : nullptr);
  else if (rank == 0)
    last_ck = save_checkpoint(cfg.output, m, opt, st, static_cast<int>(cfg.keep_last));
  comm.barrier();
  last_save_s = seconds_since(save_start);
  if (shards_mirror && !host_shards.empty()) {
    const std::string name = std::filesystem::path(last_ck).filename().string();
    upload = std::async(std::launch::async, [this, host_shards, name] {
      shards_mirror->publish_shards(host_shards, name, attempt, rank);
      std::error_code ec;  // (uploaded: the bucket holds them for rank 0 to commit)
      std::filesystem::remove_all(host_shards, ec);
    });
  }
  if (mirror) {
    const std::string ck = last_ck;
    const int keep = static_cast<int>(cfg.keep_last);
    HostParts parts;
    if (per_host) {
      parts.hosts = hosts - 1;
      parts.attempt = attempt;
    }
    upload = std::async(std::launch::async, [this, ck, keep, parts] {
      lease->check();
      mirror->publish_checkpoint(ck, keep, parts);
      published = std::filesystem::path(ck).filename().string();
      mirror->sync_logs(true);
    });
  }
  return last_ck;
}

Trainer::Trainer(const TrainConfig& cfg, comm::Communicator& comm) {
  if (cfg.steps <= 0) fail(setting("steps"), " must be positive");
  if (cfg.accumulation <= 0) fail(setting("accumulation_steps"), " must be positive");
  if (cfg.output.empty())
    fail(setting("output"), " is required (the run directory for checkpoints)");
  // The settings autotune chose (measured now, or kept from the checkpoint resumed) replace the
  // flags' before the model exists: the attention kernel decides its memory plan.
  TrainConfig tuned = cfg;
  Tuning tuning;
  bool have_tuning = stored_tuning(cfg, tuning);
  if (cfg.autotune && !backend_of(cfg).host_memory())
    fail(setting("autotune"), " tunes the CPU's kernels, threads and buckets; on the ",
         backend_of(cfg).name(), " backend run without it");
  if (!have_tuning && cfg.autotune) {
    tuning = autotune(cfg, comm);
    have_tuning = true;
  }
  if (have_tuning) tuning.apply(tuned);
  s_ = std::make_unique<State>(tuned, comm);
  State& s = *s_;
  if (have_tuning) {
    s.settings["autotune"] = tuning.to_json();
    s.tuning_note = tuning.report();
  }
  s.resume_or_init();
  s.check_ranks_agree();
  // Every rank starts from rank 0's parameters and optimizer state (sharded: each rank loaded
  // its own part of the state).
  // A sharded master: each rank loaded its part, which every rank then gets from its owner.
  const int64_t bytes = s.m.table().total() * static_cast<int64_t>(sizeof(float));
  if (s.m.dims().master_shard)
    ShardedMasterGather(s.m, shard_counts(s.m.table().total(), s.world)).run(s.m, comm);
  else
    comm.broadcast(s.m.params(), bytes, 0);
  if (!s.opt.sharded()) {
    comm.broadcast(s.opt.m().data(), bytes, 0);
    comm.broadcast(s.opt.v().data(), bytes, 0);
  }
  // Gradients in the communicator's shared memory, when it has such: the shm and hierarchical
  // allreduce then read and write them in place, with no copy in or out.
  if (s.world > 1) {
    const int64_t gbytes = static_cast<int64_t>(s.m.plan().group_bytes("gradients"));
    if (float* shared = comm.allocate_shared((gbytes + 3) / 4))
      s.m.place_gradients(reinterpret_cast<std::byte*>(shared));
  }

  data::PipelineOptions in = cfg.input;
  in.batch_size = cfg.batch_size;
  in.rank = s.rank;
  in.world = s.world;
  in.seed = cfg.seed;
  // SIGTERM/SIGINT: one rank stops waiting for input at once. With several ranks every rank
  // normally gets the signal and they agree to stop at the end of the step; a rank still waiting
  // (for input, or in a collective for a peer that hangs) after a grace of a few steps ends the
  // job, its last complete checkpoint standing.
  in.interrupt = &g_stop_signal;
  in.interrupt_grace_s = s.world == 1 ? 0.0 : kStopGraceSeconds;
  comm::Incidents::process().set_interrupt(&g_stop_signal, kStopGraceSeconds);
  comm::Incidents::process().set_log(
      (std::filesystem::path(cfg.output) / "incidents.log").string());
  s.pipe = std::make_unique<data::Pipeline>(
      in,
      data::Schema::pretraining(cfg.seq_len, cfg.max_predictions, s.mcfg.vocab_size,
                                s.mcfg.type_vocab_size),
      s.position);

  if (s.rank == 0) {
    s.read_elastic_event();
    s.progress_fd = ::open((std::filesystem::path(cfg.output) / "progress").c_str(),
                           O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    s.events = std::make_unique<obs::EventWriter>(cfg.output, s.start_step);
    s.metrics = std::make_unique<obs::MetricsLog>(cfg.output, s.start_step);
  }
  if (!cfg.timeline.empty()) {
    s.tl.enable(s.rank);
    s.m.set_timeline(&s.tl);
  }
  s.step = &s.session.start(
      StepSettings{s.cfg.accumulation, cfg.predivide, cfg.overlap, cfg.bucket_mb << 20, cfg.seed,
                   /*defer=*/true, cfg.graphs},
      &s.tl);
  s.peak_gflops =
      backend_of(cfg).gemm_peak_gflops(cfg.precision, cfg.batch_size * cfg.seq_len,
                                       s.mcfg.intermediate_size, s.mcfg.hidden_size, 0.5);
}

Trainer::~Trainer() = default;

std::string Trainer::banner() const {
  const State& s = *s_;
  const TrainConfig& cfg = s.cfg;
  const model::BertConfig& mc = s.mcfg;
  const bool bf16 = cfg.precision == Precision::BF16;
  std::string out =
      str("train: ", cfg.model_config, " (L", mc.num_hidden_layers, " H", mc.hidden_size, " A",
          mc.num_attention_heads, " I", mc.intermediate_size, " V", mc.vocab_size,
          model::vocab_rows(mc) != mc.vocab_size ? str(" in ", model::vocab_rows(mc), " rows")
                                                 : std::string(),
          "), ",
          s.resumed_from.empty() ? (cfg.init_checkpoint.empty() ? std::string("fresh init")
                                                                : "from " + cfg.init_checkpoint)
                                 : "resumed from " + s.resumed_from,
          "\n");
  const int64_t per_row = cfg.input.pack_per_row;
  out += str("  data ", cfg.input.files, " (", s.pipe->files().size(), " files), batch ",
             cfg.batch_size, per_row > 0 ? " packed rows" : "", " x ", s.world, " ranks x ",
             cfg.accumulation, " accumulation = ", cfg.batch_size * s.world * cfg.accumulation,
             per_row > 0 ? str(" rows of ", cfg.seq_len, " tokens, each up to ", per_row,
                               " instances (packed: the instances per step vary)\n")
                         : str(" sequences of ", cfg.seq_len, " tokens\n"));
  char line[512];
  std::snprintf(
      line, sizeof line,
      "  %s lr %.3g (warmup %lld, decay power %.1f to %.3g), wd %.3g, clip %.3g, %s%s, %s "
      "attention%s, padding %s%s, seed %llu\n",
      optimizer_name(cfg.optimizer.kind), cfg.lr, (long long)s.warmup, cfg.power, cfg.end_lr,
      cfg.optimizer.weight_decay, cfg.optimizer.max_grad_norm, precision_name(cfg.precision),
      cfg.precision == Precision::FP32 ? ""
      : bf16 ? " (fp32 master weights and optimizer; matmuls and attention on bf16 operands, "
               "fp32 accumulation)"
      : s.m.dims().fp16_operands
          ? " (fp32 master weights and optimizer; activations kept in fp16 for backward, matmuls "
            "and attention on fp16 operands, fp32 accumulation; dynamic loss scaling)"
          : " (fp32 weights and optimizer; activations kept in fp16 for backward, kernels "
            "compute in fp32; dynamic loss scaling)",
      s.m.attention_kernel(), s.m.dims().recompute_layers ? ", layers recomputed in backward" : "",
      s.m.dims().unpadded ? "skipped" : "computed", s.step->graphs_summary().c_str(),
      (unsigned long long)cfg.seed);
  out += line;
  out += str(
      "  steps ", s.start_step, "..", cfg.steps, ", save every ", cfg.save_every, " to ",
      cfg.publish_to.empty() ? cfg.output : str(cfg.publish_to, " (staged in ", cfg.output, ")"),
      ", ", s.comm.name(), ", ", omp_get_max_threads(), " threads, memory plan ",
      human_bytes(static_cast<double>(s.m.plan().total_bytes() + s.opt.plan().total_bytes())),
      s.opt.sharded()
          ? str(" (optimizer state sharded: ",
                human_bytes(static_cast<double>(s.opt.plan().total_bytes())), " of ",
                human_bytes(8.0 * s.opt.total()), " here",  // m, v: 8 B/param
                s.m.dims().master_shard
                    ? str("; fp32 master weights sharded: ",
                          human_bytes(static_cast<double>(s.m.plan().group_bytes("parameters"))),
                          " of ", human_bytes(4.0 * s.m.table().total()), " here")
                    : std::string(),
                ")")
          : std::string(),
      ", input bound ", human_bytes(static_cast<double>(s.pipe->memory_bound_bytes())), "\n");
  out += s.regrid_note;
  out += s.startup_note;
  out += s.tuning_note;
  out += str("  ", kernels::device_line(backend_of(cfg)), "\n");
  if (const std::string note = backend_of(cfg).precision_note(cfg.precision); !note.empty())
    out += str("  ", note, "\n");
  return out;
}

namespace {

// --trace-input: what each rank trained on, a line per row (step, epoch, FNV-1a of its token ids)
// in PREFIX.rank-R. A batch read ahead for the next step is held until that step runs.
class InputTrace {
 public:
  InputTrace(const std::string& prefix, int rank) {
    if (prefix.empty()) return;
    const std::string path = str(prefix, ".rank-", rank);
    out_.open(path, std::ios::app);
    if (!out_) fail("cannot open ", path, " for --trace-input");
  }
  void add(const model::Batch& b, int64_t step, uint64_t epoch, bool ahead) {
    if (!out_.is_open()) return;
    std::ostringstream lines;
    for (int64_t r = 0; r < b.B; ++r) {
      uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the row's token ids
      for (int64_t t = 0; t < b.T; ++t) {
        h ^= static_cast<uint32_t>(b.input_ids[r * b.T + t]);
        h *= 0x100000001b3ull;
      }
      lines << step << ' ' << epoch << ' ' << std::hex << h << std::dec << '\n';
    }
    if (ahead) {
      held_ = lines.str();
    } else {
      out_ << lines.str();
      out_.flush();
    }
  }
  // The held batch's lines, now that its step runs.
  void release() {
    if (held_.empty()) return;
    out_ << held_;
    out_.flush();
    held_.clear();
  }

 private:
  std::ofstream out_;
  std::string held_;
};

}  // namespace

// The progress line of a logging window (rank 0), its metrics, and the window started again.
void Trainer::State::log_window(int64_t done, int64_t step, Totals& window,
                                Clock::time_point& start, Clock::time_point run_start) {
  const double dt = seconds_since(start);
  const double eta = seconds_since(run_start) / static_cast<double>(done - start_step) *
                     static_cast<double>(cfg.steps - done);
  if (rank == 0 && !cfg.quiet) {
    std::printf(
        "step %6lld/%lld | loss %.4f | mlm acc %.3f | nsp acc %.3f | lr %.2e | scale %g | %.0f "
        "tok/s | ETA %s\n",
        (long long)done, (long long)cfg.steps, window.loss / window.steps,
        window.mlm_correct / std::max(window.mlm_weight, 1e-9),
        window.nsp_correct / std::max(window.examples, 1.0), sched.at(step), scaler.scale(),
        window.real_tokens / std::max(dt, 1e-9), hms(eta).c_str());
    std::fflush(stdout);
  }
  record(done, step, window, dt);
  res.last_loss = window.loss / window.steps;
  window = Totals{};
  start = Clock::now();
}

TrainResult Trainer::run() {
  State& s = *s_;
  const TrainConfig& cfg = s.cfg;
  const int rank = s.rank, world = s.world;
  TrainResult& res = s.res;
  // The input position after the last completed step: a step interrupted while it waited for
  // input is not in the checkpoint, and neither are the micro-batches it had read.
  data::PipelinePosition done_pos = s.pipe->position();
  // The position before the next step's first micro-batch, where a step read it ahead
  // (Step::holds_next): the step after resumes from it.
  data::PipelinePosition ahead_pos;
  int64_t step = s.start_step;
  InputTrace trace(cfg.trace_input, rank);
  auto next_batch = [&](model::Batch& b) {
    const bool ahead = s.step->reading_ahead();
    if (ahead) ahead_pos = s.pipe->position();
    try {
      if (!s.pipe->next(b)) fail("the input pipeline ended (it repeats forever; this is a bug)");
      trace.add(b, ahead ? step + 1 : step, s.pipe->position().epoch, ahead);
      return true;
    } catch (const data::Interrupted&) {
      if (world > 1)  // the peers are in this step's collectives: the job cannot stop cleanly
        fail("stopped by signal ", g_stop_signal.load(), " while rank ", rank,
             " waited for input; the last complete checkpoint stands (continue with ",
             setting("resume"), ")");
      return false;
    }
  };
  Totals window;
  // A step's report into the sums, once it is read (StepReport::pending: at settle()).
  auto take = [&](const StepReport& r) {
    s.totals.add(r);
    window.add(r);
    res.losses.push_back(r.loss);
    if (r.step == s.start_step) res.first_loss = r.loss;
  };
  auto settle = [&] {
    for (const StepReport& r : s.step->settle()) take(r);
  };
  const auto run_start = Clock::now();
  auto window_start = Clock::now();
  double slowest_step = 0;
  for (; step < cfg.steps; ++step) {
    const std::string hint =
        s.last_ck.empty() ? std::string(" (none saved yet)") : " (" + s.last_ck + ")";
    // A step follows unless this one ends the run or its slice (--stop-after).
    const bool ahead =
        step + 1 < cfg.steps && !(cfg.stop_after > 0 && step + 1 - s.start_step >= cfg.stop_after);
    trace.release();
    const StepReport r = s.step->run(step, s.sched.at(step), next_batch, hint, ahead);
    if (r.interrupted) {
      res.interrupted = true;
      break;
    }
    if (!r.pending) take(r);
    // Peers finish a step within about a step's time of each other: the stop grace follows the
    // slowest step so far (BERT-large steps on CPUs take longer than the 5 s floor).
    slowest_step = std::max(slowest_step, r.t_total);
    if (world > 1)
      comm::Incidents::process().set_interrupt(&g_stop_signal,
                                               std::max(kStopGraceSeconds, 2 * slowest_step));

    const int64_t done = step + 1;
    if (done == s.start_step + 1 && s.metrics) s.record_elastic_event(s.start_step);
    const bool log = cfg.log_every > 0 && (done % cfg.log_every == 0 || done == cfg.steps);
    const bool save = cfg.save_every > 0 && done % cfg.save_every == 0 && done != cfg.steps;
    // Deferred steps (a GPU's) are read where a log or a checkpoint needs them: a step that
    // diverged fails before its checkpoint is written.
    if (log || save) settle();
    if (log) s.log_window(done, step, window, window_start, run_start);
    s.upload_logs();
    s.note_progress(done);
    res.steps_done = done;
    done_pos = s.step->holds_next() ? ahead_pos : s.pipe->position();
    const bool slice_done =
        cfg.stop_after > 0 && done - s.start_step >= cfg.stop_after && done != cfg.steps;
    const bool stop = slice_done || (world > 1 ? !s.comm.all(g_stop_signal.load() == 0)
                                               : g_stop_signal.load() != 0);
    if (stop) {
      res.interrupted = true;
      ++step;
      break;
    }
    if (save) s.save(done, done_pos);
  }
  settle();
  if (window.steps > 0) res.last_loss = window.loss / window.steps;
  s.end_step = step;
  res.last_checkpoint = s.save(step, done_pos);
  // The last checkpoint committed (its shards uploaded) and the logs uploaded before the run
  // returns.
  s.wait_upload();
  if (s.mirror) s.mirror->sync_logs(true);
  if (s.tl.enabled()) {
    s.tl.write(cfg.timeline, world);
    s.comm.barrier();
    if (world > 1 && rank == 0) obs::Timeline::merge(cfg.timeline, world);
  }
  return res;
}

std::string Trainer::summary() const {
  const State& s = *s_;
  const TrainConfig& cfg = s.cfg;
  const TrainResult& res = s.res;
  std::string out;
  if (s.tl.enabled())
    out += str("timeline: ", cfg.timeline, " (open in chrome://tracing or ui.perfetto.dev)\n");
  if (s.events)
    out += str("metrics: ", s.events->path(), " (tensorboard --logdir ", cfg.output, ") and ",
               s.metrics->path(), "\n");
  if (const uint64_t skipped = s.pipe->stats().skipped; skipped > 0)
    out += str("input: ", skipped, " unusable records skipped on this rank (",
               setting("on_corrupt"), " skip)\n");
  if (res.interrupted)
    out += str("train: stopped ",
               g_stop_signal.load() ? str("by signal ", g_stop_signal.load())
                                    : str("as ", setting("stop_after_steps"), " asked"),
               " after step ", s.end_step, "; checkpoint ", res.last_checkpoint, " (continue with ",
               setting("resume"), ")\n");
  const Totals& t = s.totals;
  if (t.steps == 0) return out;
  const double n = static_cast<double>(t.steps);
  const double other =
      std::max(0.0, t.total - t.input - t.forward - t.backward - t.comm - t.optimizer);
  auto pct = [&](double x) { return 100.0 * x / std::max(t.total, 1e-9); };
  char line[512];
  std::snprintf(line, sizeof line,
                "step time %.1f ms: input wait %.1f%% | forward %.1f%% | backward %.1f%% | "
                "communication %.1f%% exposed | optimizer %.1f%% | other %.1f%%\n",
                1e3 * t.total / n, pct(t.input), pct(t.forward), pct(t.backward), pct(t.comm),
                pct(t.optimizer), pct(other));
  out += line;
  if (const comm::Reducer* red = s.step->reducer()) {
    std::snprintf(
        line, sizeof line,
        "communication hidden behind backward: %.1f ms per step (%zu buckets of <= %lld MiB)\n",
        1e3 * t.hidden / n, red->buckets(), (long long)cfg.bucket_mb);
    out += line;
  }
  if (t.input_hidden > 0) {
    std::snprintf(line, sizeof line,
                  "input read while the device ran backward: %.1f ms per step (hidden)\n",
                  1e3 * t.input_hidden / n);
    out += line;
  }
  const double achieved = t.flops / std::max(t.total, 1e-9) / 1e9;
  std::snprintf(line, sizeof line,
                "tokens: %.0f real tokens/s over all ranks; %.1f%% of the token positions were "
                "padding, %.1f%% of the rows computed (%s)\n",
                t.real_tokens / std::max(t.total, 1e-9),
                100.0 * (1.0 - t.real_tokens / std::max(t.token_slots, 1.0)),
                100.0 * (1.0 - t.real_tokens / std::max(t.computed_tokens, 1.0)),
                s.m.unpadded() ? str("unpadded: rows rounded up to ", s.m.row_quantum()).c_str()
                               : "padded to --seq-len");
  out += line;
  if (cfg.input.pack_per_row > 0) {
    std::snprintf(line, sizeof line,
                  "packing: %.2f instances a row on average (at most %lld), %.1f instances a "
                  "step\n",
                  t.examples / std::max(t.token_slots / cfg.seq_len, 1.0),
                  (long long)cfg.input.pack_per_row,
                  t.examples / std::max(static_cast<double>(t.steps), 1.0));
    out += line;
  }
  std::snprintf(line, sizeof line,
                "compute: %.1f GFLOP/s of model FLOPs per rank = %.0f%% of the %s GEMM rate "
                "measured now (%.1f GFLOP/s)\n",
                achieved, 100.0 * achieved / s.peak_gflops,
                kernels::gemm_operands(backend_of(cfg), cfg.precision), s.peak_gflops);
  out += line;
  const std::string bottleneck =
      pct(t.input) > 10  ? str("input pipeline (raise ", setting("readers"), "/",
                               setting("prefetch"), " or add shards)")
      : pct(t.comm) > 20 ? "communication (larger batch per rank or fewer ranks per link)"
                         : "compute (forward/backward kernels)";
  std::snprintf(line, sizeof line, "bottleneck: %s; loss scale %g, %lld skipped steps, ",
                bottleneck.c_str(), s.scaler.scale(), (long long)s.scaler.skipped());
  out += line + str("final checkpoint ", res.last_checkpoint, "\n");
  return out;
}

TrainResult train(const TrainConfig& cfg, comm::Communicator& comm) {
  Trainer t(cfg, comm);
  return t.run();
}

}  // namespace bertrain::train
