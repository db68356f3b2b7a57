#include "train/trainer.h"

#include <sys/resource.h>

#include <omp.h>
#include <pthread.h>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "dist/reducer.h"
#include "kernels/cpu/matmul.h"
#include "model/checkpoint.h"
#include "train/loss_scaler.h"
#include "train/run_state.h"

namespace bertrain::train {

std::atomic<int> g_stop_signal{0};

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string hms(double s) {
  char buf[32];
  const int t = static_cast<int>(s + 0.5);
  std::snprintf(buf, sizeof buf, "%d:%02d:%02d", t / 3600, t / 60 % 60, t % 60);
  return buf;
}

}  // namespace

// SIGTERM and SIGINT are blocked in every thread and taken by one thread of their own that
// waits for them (sigwait), so no signal is ever delivered asynchronously to a thread that
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

Precision parse_precision(const std::string& s) {
  if (s == "fp32") return Precision::FP32;
  if (s == "bf16") return Precision::BF16;
  if (s == "fp16") return Precision::FP16;
  fail("--precision must be fp32, bf16 or fp16, got '", s, "'");
}

const char* precision_name(Precision p) {
  return p == Precision::FP32 ? "fp32" : p == Precision::BF16 ? "bf16" : "fp16";
}

TrainResult train(const TrainConfig& cfg, dist::Communicator& comm) {
  const int rank = comm.rank(), world = comm.size();
  const bool lead = rank == 0 && !cfg.quiet;
  if (cfg.steps <= 0) fail("--steps must be positive");
  if (cfg.accumulation <= 0) fail("--accumulation-steps must be positive");
  if (cfg.output.empty()) fail("--output is required (the run directory for checkpoints)");

  const model::BertConfig mcfg = model::BertConfig::load(cfg.model_config);
  const bool bf16 = cfg.precision == Precision::BF16, fp16 = cfg.precision == Precision::FP16;
  model::BertModel m(
      mcfg, model::Head::Pretraining,
      with_precision({cfg.batch_size, cfg.seq_len, cfg.max_predictions, false, cfg.attention},
                     cfg.precision));
  Optimizer opt(param_slices(m.table()), m.table().total(), cfg.optimizer);
  LossScaler::Config sc;
  sc.enabled = fp16;
  sc.max_consecutive_skips = cfg.max_skipped_steps;
  LossScaler scaler(sc);
  const int64_t warmup = warmup_steps(cfg.warmup, cfg.steps);
  const LrSchedule sched{cfg.lr, cfg.end_lr, cfg.power, warmup, cfg.steps};

  nlohmann::json settings = {{"batch_size", cfg.batch_size},
                             {"seq_len", cfg.seq_len},
                             {"max_predictions", cfg.max_predictions},
                             {"accumulation", cfg.accumulation},
                             {"world_size", world},
                             {"precision", precision_name(cfg.precision)},
                             {"optimizer", optimizer_name(cfg.optimizer.kind)},
                             {"seed", cfg.seed}};

  // Master weights are fp32: the model's own buffer, params(). bf16: its matmuls use a bf16
  // copy (ModelDims::bf16). fp16: it keeps activations in fp16 (ModelDims::fp16), and the
  // dynamic loss scaler skips steps whose loss or gradients left the fp16 range.
  const int64_t P = m.table().total();
  int64_t start_step = 0;
  data::PipelinePosition position;
  std::string resumed_from;
  const std::string ck = cfg.resume ? resolve_checkpoint(cfg.output) : "";
  if (!ck.empty()) {
    TrainerState st = load_checkpoint(ck, m, &opt);
    for (const char* k : {"batch_size", "seq_len", "max_predictions", "accumulation", "world_size",
                          "precision", "optimizer"})
      if (st.settings.contains(k) && st.settings[k] != settings[k])
        fail("cannot resume from ", ck, ": it was trained with ", k, " = ", st.settings[k].dump(),
             ", this run has ", settings[k].dump(), " (resume with the same settings)");
    start_step = st.step;
    scaler.restore(st.loss_scale, st.scaler_good, st.scaler_skipped);
    if (static_cast<int>(st.positions.size()) == world) position = st.positions[rank];
    resumed_from = ck;
  } else if (!cfg.init_checkpoint.empty()) {
    m.init_params(cfg.seed);  // heads absent from a BertModel checkpoint keep BERT's init
    model::load_safetensors_into(m, model::checkpoint_weights_path(cfg.init_checkpoint),
                                 {{"cls.", "bert.pooler."}, {}});
  } else {
    m.init_params(cfg.seed);
  }
  // Every rank must run the same job: compare a fingerprint of the settings that change the
  // math and name the ranks that differ, instead of training something inconsistent.
  if (world > 1) {
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
           " run with another model config, batch size, sequence length, precision, optimizer "
           "or seed than rank 0; launch every rank with the same arguments");
  }
  // Every rank starts from rank 0's parameters and optimizer state.
  comm.broadcast(m.params(), P * static_cast<int64_t>(sizeof(float)), 0);
  comm.broadcast(opt.m().data(), P * static_cast<int64_t>(sizeof(float)), 0);
  comm.broadcast(opt.v().data(), P * static_cast<int64_t>(sizeof(float)), 0);
  // Gradients in the communicator's shared memory, when it has such: the shm and hierarchical
  // allreduce then read and write them in place, with no copy in or out.
  if (world > 1) {
    const int64_t gbytes = static_cast<int64_t>(m.plan().group_bytes("gradients"));
    if (float* shared = comm.allocate_shared((gbytes + 3) / 4))
      m.place_gradients(reinterpret_cast<std::byte*>(shared));
  }

  data::PipelineOptions in = cfg.input;
  in.batch_size = cfg.batch_size;
  in.rank = rank;
  in.world = world;
  in.seed = cfg.seed;
  // SIGTERM/SIGINT: one rank stops waiting for input at once. With several ranks every rank
  // normally gets the signal and they agree to stop at the end of the step; a rank still waiting
  // (for input, or in a collective for a peer that hangs) after a grace of a few steps ends the
  // job, its last complete checkpoint standing.
  in.interrupt = &g_stop_signal;
  in.interrupt_grace_s = world == 1 ? 0.0 : kStopGraceSeconds;
  comm.set_interrupt(&g_stop_signal, kStopGraceSeconds);
  data::Pipeline pipe(in,
                      data::Schema::pretraining(cfg.seq_len, cfg.max_predictions, mcfg.vocab_size,
                                                mcfg.type_vocab_size),
                      position);

  const double peak = kernels::measure_gemm_peak_gflops(
      cfg.batch_size * cfg.seq_len, mcfg.intermediate_size, mcfg.hidden_size, bf16, 0.5);
  const double flops_step =
      m.flops_per_step(cfg.batch_size, cfg.seq_len, cfg.max_predictions) * cfg.accumulation;
  if (lead) {
    std::printf(
        "train: %s (L%lld H%lld A%lld I%lld V%lld), %s\n", cfg.model_config.c_str(),
        (long long)mcfg.num_hidden_layers, (long long)mcfg.hidden_size,
        (long long)mcfg.num_attention_heads, (long long)mcfg.intermediate_size,
        (long long)mcfg.vocab_size,
        resumed_from.empty()
            ? (cfg.init_checkpoint.empty() ? "fresh init" : ("from " + cfg.init_checkpoint).c_str())
            : ("resumed from " + resumed_from).c_str());
    std::printf(
        "  data %s (%zu files), batch %lld x %lld ranks x %lld accumulation = %lld sequences of "
        "%lld tokens\n",
        cfg.input.files.c_str(), pipe.files().size(), (long long)cfg.batch_size, (long long)world,
        (long long)cfg.accumulation, (long long)(cfg.batch_size * world * cfg.accumulation),
        (long long)cfg.seq_len);
    std::printf(
        "  %s lr %.3g (warmup %lld, decay power %.1f to %.3g), wd %.3g, clip %.3g, %s%s, %s "
        "attention, seed %llu\n",
        optimizer_name(cfg.optimizer.kind), cfg.lr, (long long)warmup, cfg.power, cfg.end_lr,
        cfg.optimizer.weight_decay, cfg.optimizer.max_grad_norm, precision_name(cfg.precision),
        cfg.precision == Precision::FP32 ? ""
        : bf16 ? " (fp32 master weights and optimizer; matmuls and attention on bf16 operands, "
                 "fp32 accumulation)"
               : " (fp32 weights and optimizer; activations kept for backward in fp16, "
                 "kernels compute in fp32; dynamic loss scaling)",
        m.dims().blocked_attention() ? "blocked" : "full", (unsigned long long)cfg.seed);
    std::printf(
        "  steps %lld..%lld, save every %lld to %s, %s, %d threads, memory plan %s, input bound "
        "%s\n",
        (long long)start_step, (long long)cfg.steps, (long long)cfg.save_every, cfg.output.c_str(),
        comm.name().c_str(), omp_get_max_threads(),
        human_bytes(static_cast<double>(m.plan().total_bytes() + 2 * P * 4)).c_str(),
        human_bytes(static_cast<double>(pipe.memory_bound_bytes())).c_str());
    std::printf("  cpu %s\n", kernels::cpu_description().c_str());
    if (bf16 && !kernels::bf16_speed_note().empty())
      std::printf("  %s\n", kernels::bf16_speed_note().c_str());
    std::fflush(stdout);
  }

  TrainResult res;
  std::string last_ck = resumed_from;
  // The input position after the last completed step: a step interrupted while it waited for
  // input is not in the checkpoint, and neither are the micro-batches it had read.
  data::PipelinePosition done_pos = pipe.position();
  auto save = [&](int64_t step_done) {
    TrainerState st;
    st.step = step_done;
    st.loss_scale = scaler.scale();
    st.scaler_good = scaler.good_steps();
    st.scaler_skipped = scaler.skipped();
    st.optimizer_steps = opt.steps();
    st.settings = settings;
    // Every rank's pipeline position goes into rank 0's checkpoint.
    std::vector<double> pos(3 * world, 0.0);
    const data::PipelinePosition mine = done_pos;
    pos[3 * rank] = static_cast<double>(mine.epoch);
    pos[3 * rank + 1] = static_cast<double>(mine.batches);
    comm.allreduce_sum(pos.data(), static_cast<int64_t>(pos.size()));
    for (int r = 0; r < world; ++r)
      st.positions.push_back({static_cast<uint64_t>(pos[3 * r]),
                              static_cast<uint64_t>(pos[3 * r + 1]), mine.fingerprint});
    if (rank == 0) {
      last_ck = save_checkpoint(cfg.output, m, opt, st, static_cast<int>(cfg.keep_last));
    }
    comm.barrier();
    return last_ck;
  };

  obs::Timeline tl;
  if (!cfg.timeline.empty()) {
    tl.enable(rank);
    m.set_timeline(&tl);
  }
  auto span = [&](const char* name, const char* cat, Clock::time_point begin) {
    if (tl.enabled()) {
      const int64_t end = tl.now_us();
      tl.add(name, cat, end - static_cast<int64_t>(since(begin) * 1e6), end);
    }
  };
  std::unique_ptr<dist::Reducer> reducer;
  if (world > 1 && cfg.overlap) {
    std::vector<std::pair<int64_t, int64_t>> layers;
    for (int64_t l = 0; l < mcfg.num_hidden_layers; ++l) layers.push_back(m.layer_range(l));
    reducer = std::make_unique<dist::Reducer>(comm, m.grads(), P, layers, cfg.bucket_mb << 20,
                                              static_cast<float>(cfg.predivide), &tl);
  }
  double t_overlapped = 0;
  model::Batch batch;
  double t_input = 0, t_fwd = 0, t_bwd = 0, t_comm = 0, t_opt = 0, t_total = 0;
  double win_loss = 0, win_mlm_correct = 0, win_mlm_w = 0, win_nsp = 0, win_n = 0;
  int64_t win_steps = 0;
  const auto run_start = Clock::now();
  auto win_start = Clock::now();
  int64_t step = start_step;
  bool interrupted_in_input = false;
  double slowest_step = 0;
  for (; step < cfg.steps; ++step) {
    const auto t_step = Clock::now();
    m.zero_grads();
    double loss_sum = 0, mlm_c = 0, mlm_w = 0, nsp_c = 0;
    const float scale = scaler.scale();
    for (int64_t micro = 0; micro < cfg.accumulation; ++micro) {
      auto t0 = Clock::now();
      try {
        if (!pipe.next(batch)) fail("the input pipeline ended (it repeats forever; this is a bug)");
      } catch (const data::Interrupted&) {
        if (world > 1)  // the peers are in this step's collectives: the job cannot stop cleanly
          fail("stopped by signal ", g_stop_signal.load(), " while rank ", rank,
               " waited for input; the last complete checkpoint stands (continue with --resume)");
        interrupted_in_input = true;
        break;
      }
      t_input += since(t0);
      span("input wait", "input", t0);
      const model::StepOptions so{true, cfg.seed, static_cast<uint64_t>(step),
                                  static_cast<uint64_t>((micro * world + rank) * cfg.batch_size)};
      t0 = Clock::now();
      const model::Losses l = m.forward(batch, so);
      t_fwd += since(t0);
      span("forward", "compute", t0);
      if (!std::isfinite(l.loss) && !fp16)
        fail("step ", step, ": the loss is ", l.loss, " on rank ", rank,
             "; lower --lr or raise --warmup and resume from the last good checkpoint",
             last_ck.empty() ? std::string(" (none saved yet)") : " (" + last_ck + ")");
      loss_sum += l.loss;
      mlm_c += l.mlm_correct;
      mlm_w += l.mlm_weight;
      nsp_c += static_cast<double>(l.nsp_correct);
      t0 = Clock::now();
      const bool last = micro + 1 == cfg.accumulation;
      if (reducer && last)
        m.backward(batch, so, scale / static_cast<float>(cfg.accumulation),
                   [&](int64_t l) { reducer->layer_done(l); });
      else
        m.backward(batch, so, scale / static_cast<float>(cfg.accumulation));
      t_bwd += since(t0);
      span("backward", "compute", t0);
    }
    if (interrupted_in_input) {
      res.interrupted = true;
      break;
    }
    // Average gradients across ranks (sum, then 1/world folded into the unscale).
    auto t0 = Clock::now();
    if (reducer) {
      const double exposed = reducer->finish();  // the rest of the buckets, then wait
      t_overlapped += std::max(0.0, reducer->busy_seconds() - exposed);
    } else if (world > 1 && cfg.predivide != 1.0) {
      const float pre = static_cast<float>(1.0 / cfg.predivide);
      float* g = m.grads();
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < P; ++i) g[i] *= pre;
    }
    if (world > 1 && !reducer) {
      comm.set_label("all gradients (one bucket)");
      comm.allreduce_sum(m.grads(), P);
      comm.set_label("");
    }
    double stats[5] = {loss_sum / cfg.accumulation, mlm_c, mlm_w, nsp_c,
                       static_cast<double>(batch.B * cfg.accumulation)};
    if (world > 1) comm.allreduce_sum(stats, 5);
    t_comm += since(t0);
    span("allreduce gradients", "communication", t0);

    t0 = Clock::now();
    const float inv = static_cast<float>((world > 1 ? cfg.predivide : 1.0) /
                                         (scale * static_cast<double>(world)));
    StepResult r = opt.measure(m.grads(), inv);
    const bool finite = world > 1 ? comm.all(r.finite) : r.finite;  // every rank skips together
    if (scaler.update(finite, step)) {
      const float lr = static_cast<float>(sched.at(step));
      // Clipping must use the same global norm on every rank: it is, since gradients are
      // identical after the allreduce.
      opt.apply(m.params(), m.grads(), lr, inv, r, m.bf16_weights());
      m.bf16_weights_updated();
    }
    t_opt += since(t0);
    span("optimizer", "optimizer", t0);
    t_total += since(t_step);
    // Peers finish a step within about a step's time of each other: the stop grace follows the
    // slowest step so far (BERT-large steps on CPUs take longer than the 5 s floor).
    slowest_step = std::max(slowest_step, since(t_step));
    if (world > 1)
      comm.set_interrupt(&g_stop_signal, std::max(kStopGraceSeconds, 2 * slowest_step));
    span(("step " + std::to_string(step)).c_str(), "step", t_step);

    const double step_loss = stats[0] / world;
    res.losses.push_back(step_loss);
    win_loss += step_loss;
    win_mlm_correct += stats[1];
    win_mlm_w += stats[2];
    win_nsp += stats[3];
    win_n += stats[4];
    ++win_steps;
    const int64_t done = step + 1;
    if (done == start_step + 1) res.first_loss = step_loss;
    const bool log_now = cfg.log_every > 0 && (done % cfg.log_every == 0 || done == cfg.steps);
    if (log_now) {
      const double dt = since(win_start);
      const double tok_s = win_n * cfg.seq_len / std::max(dt, 1e-9);
      const double eta = since(run_start) / (done - start_step) * (cfg.steps - done);
      if (lead) {
        std::printf(
            "step %6lld/%lld | loss %.4f | mlm acc %.3f | nsp acc %.3f | lr %.2e | scale %g | %.0f "
            "tok/s | ETA %s\n",
            (long long)done, (long long)cfg.steps, win_loss / win_steps,
            win_mlm_correct / std::max(win_mlm_w, 1e-9), win_nsp / std::max(win_n, 1.0),
            sched.at(step), scaler.scale(), tok_s, hms(eta).c_str());
        std::fflush(stdout);
      }
      res.last_loss = win_loss / win_steps;
      win_loss = win_mlm_correct = win_mlm_w = win_nsp = win_n = 0;
      win_steps = 0;
      win_start = Clock::now();
    }
    res.steps_done = done;
    done_pos = pipe.position();
    const bool slice_done =
        cfg.stop_after > 0 && done - start_step >= cfg.stop_after && done != cfg.steps;
    const bool stop = slice_done || (world > 1 ? !comm.all(g_stop_signal.load() == 0)
                                               : g_stop_signal.load() != 0);
    if (stop) {
      res.interrupted = true;
      ++step;
      break;
    }
    if (cfg.save_every > 0 && done % cfg.save_every == 0 && done != cfg.steps) save(done);
  }
  if (win_steps > 0) res.last_loss = win_loss / win_steps;
  res.last_checkpoint = save(step);
  if (tl.enabled()) {
    tl.write(cfg.timeline, world);
    comm.barrier();
    if (world > 1 && rank == 0) obs::Timeline::merge(cfg.timeline, world);
    if (lead)
      std::printf("timeline: %s (open in chrome://tracing or ui.perfetto.dev)\n",
                  cfg.timeline.c_str());
  }
  if (lead) {
    if (const uint64_t skipped = pipe.stats().skipped; skipped > 0)
      std::printf("input: %llu unusable records skipped on this rank (--on-corrupt skip)\n",
                  static_cast<unsigned long long>(skipped));
    if (res.interrupted)
      std::printf("train: stopped %s after step %lld; checkpoint %s (continue with --resume)\n",
                  g_stop_signal.load() ? str("by signal ", g_stop_signal.load()).c_str()
                                       : "as --stop-after-steps asked",
                  (long long)step, res.last_checkpoint.c_str());
    const int64_t n = step - start_step;
    if (n > 0) {
      const double other = std::max(0.0, t_total - t_input - t_fwd - t_bwd - t_comm - t_opt);
      auto pct = [&](double t) { return 100.0 * t / std::max(t_total, 1e-9); };
      std::printf(
          "step time %.1f ms: input wait %.1f%% | forward %.1f%% | backward %.1f%% | communication "
          "%.1f%% exposed | optimizer %.1f%% | other %.1f%%\n",
          1e3 * t_total / n, pct(t_input), pct(t_fwd), pct(t_bwd), pct(t_comm), pct(t_opt),
          pct(other));
      if (reducer)
        std::printf(
            "communication hidden behind backward: %.1f ms per step (%zu buckets of <= %lld MiB)\n",
            1e3 * t_overlapped / n, reducer->buckets(), (long long)cfg.bucket_mb);
      const double achieved = flops_step * n / std::max(t_total, 1e-9) / 1e9;
      std::printf(
          "compute: %.1f GFLOP/s of model FLOPs per rank = %.0f%% of the %s GEMM rate measured "
          "now (%.1f GFLOP/s)\n",
          achieved, 100.0 * achieved / peak, bf16 ? "bf16" : "fp32", peak);
      const char* bottleneck =
          pct(t_input) > 10  ? "input pipeline (raise --readers/--prefetch or add shards)"
          : pct(t_comm) > 20 ? "communication (larger batch per rank or fewer ranks per link)"
                             : "compute (forward/backward kernels)";
      std::printf("bottleneck: %s; loss scale %g, %lld skipped steps, final checkpoint %s\n",
                  bottleneck, scaler.scale(), (long long)scaler.skipped(),
                  res.last_checkpoint.c_str());
    }
  }
  return res;
}

}  // namespace bertrain::train
