// bertrain bench: times full training steps (forward, backward, AdamW update) of a model on
// synthetic or prepared batches, padded or unpadded, and reports real tokens/s, ms per phase,
// achieved GFLOP/s and model FLOP utilisation against the GEMM rate (of the operands the
// precision's matmuls take there) it measures itself in the same run (oneDNN or cuBLASLt at the
// model's largest matmul shape), and peak memory.
#include <sys/resource.h>
#include <unistd.h>

#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/commands.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/isa.h"
#include "core/rng.h"
#include "core/setting.h"
#include "data/pipeline.h"
#include "data/schema.h"
#include "plan/memory.h"
#include "plan/traffic.h"
#include "train/optimizer.h"
#include "train/precision.h"
#include "train/session.h"
#include "train/step.h"

namespace bertrain::cli {

namespace {

// Resident memory of this process now (/proc/self/statm), 0 where unknown.
double resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

model::Batch synthetic_batch(const model::BertConfig& cfg, int64_t B, int64_t T, int64_t P,
                             uint64_t seed) {
  model::Batch b;
  b.resize(B, T, P);
  const uint64_t key = rng_key(seed, 0xba7c);
  uint64_t k = 0;
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t t = 0; t < T; ++t) {
      b.input_ids[i * T + t] = static_cast<int32_t>(rng_u64(key, k++) % cfg.vocab_size);
      b.input_mask[i * T + t] = 1;
      b.segment_ids[i * T + t] = t >= T / 2 ? 1 : 0;
    }
    for (int64_t p = 0; p < P; ++p) {  // distinct sorted positions: evenly spread
      b.masked_lm_positions[i * P + p] =
          static_cast<int32_t>(1 + p * (T - 1) / std::max<int64_t>(P, 1));
      b.masked_lm_ids[i * P + p] = static_cast<int32_t>(rng_u64(key, k++) % cfg.vocab_size);
      b.masked_lm_weights[i * P + p] = 1.0f;
    }
    b.next_sentence_labels[i] = static_cast<int32_t>(rng_u64(key, k++) & 1);
    b.label_ids[i] = static_cast<int32_t>(rng_u64(key, k++) % cfg.num_labels);
  }
  return b;
}

// Batches of prepared pretraining records (the pipeline with its default settings, a fixed
// seed): real lengths, so the padding an unpadded run skips is the data's own.
// Packed (pack > 0): batches of B packed rows, up to `pack` instances a row (data/packing.h).
std::vector<model::Batch> data_batches(const std::string& files, int64_t B, int64_t T, int64_t P,
                                       const model::BertConfig& cfg, int n, int64_t pack = 0) {
  data::PipelineOptions po;
  po.files = files;
  po.batch_size = B;
  po.seed = 7;
  po.pack_per_row = pack;
  data::Pipeline pipe(po, data::Schema::pretraining(T, P, cfg.vocab_size, cfg.type_vocab_size));
  std::vector<model::Batch> out(static_cast<size_t>(n));
  for (model::Batch& b : out) pipe.next(b);
  return out;
}

// One configuration's timed steps (each on its own batch of `batches`, cycling).
enum class Mode { Padded, Unpadded, Packed };
const char* mode_name(Mode m) {
  return m == Mode::Padded ? "compute" : m == Mode::Unpadded ? "skip" : "packed";
}

struct BenchResult {
  Mode mode = Mode::Padded;
  double instances = 0;  // sequences (instances) trained on in the timed steps
  double forward = 0, backward = 0, optimizer = 0;  // medians, seconds
  double seconds = 0, real_tokens = 0, computed_tokens = 0, padded_tokens = 0, flops = 0;
  double loss = 0, rss = 0, planned = 0, allocated = 0;
  double device_used = 0;  // a GPU's memory in use at the end (the CUDA context's included)
  int64_t unplanned = 0;
  std::string op_profile;  // the device's time by operation (Backend::op_profile), if on
  // A device's kernel launches and host synchronisations per timed step (Backend::device_counts).
  std::optional<double> launches, host_syncs;
  double graph_launches = 0, graph_kernels = 0;  // (of launches: those the graphs ran)
  // On a GPU where the traffic model applies (plan/traffic.h): its launches, the bytes of the
  // kernels that are not products, and the products' time at the GEMM ceiling measured now.
  std::optional<double> model_launches, non_gemm_bytes, gemm_seconds;
};

}  // namespace

void add_bench(CLI::App& app) {
  struct Opts {
    ShapeOpts shape{8};
    std::string precision = "fp32", attention = "auto", recompute = "none", data, padding = "auto",
                device = "cpu", graphs = "auto";
    int64_t pack = 0;
    int steps = 5, warmup = 2, threads = 0;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "bench",
      "Time full training steps (forward, backward, AdamW) on synthetic or prepared batches");
  add_shape_options(c, o->shape, "Sequences per step");
  c->add_option("--data", o->data,
                "Prepared pretraining TFRecords (glob(s), comma-separated) to take the batches "
                "from, with their real lengths (default: synthetic batches of full length)");
  c->add_option("--steps", o->steps, "Timed steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_option("--warmup", o->warmup,
                "Untimed steps first (with --data at least one pass over the timed batches: "
                "their row counts' matmul primitives exist then, as in a long run)")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "Compute threads (0: OpenMP default)")
      ->capture_default_str();
  c->add_option("--precision", o->precision,
                "fp32, bf16 (bf16 matmuls with fp32 accumulation) or fp16 (activations kept "
                "in fp16, loss scale 2^16; fp32 compute on a CPU, fp16 matmuls on a GPU)")
      ->capture_default_str();
  add_attention_option(c, o->attention);
  add_recompute_option(c, o->recompute);
  add_padding_option(c, o->padding);
  add_device_option(c, o->device);
  add_graphs_option(c, o->graphs);
  c->get_option("--padding")
      ->description(
          "auto (skip, but on a GPU compute unless the attention runs fused), skip (each "
          "sequence on its real tokens), compute (padded to --seq-len) or both: the "
          "two on the same batches, one after the other, and their ratio");
  c->add_option("--pack", o->pack,
                "With --data: one more run on packed batches (--batch-size rows of --seq-len "
                "tokens, up to N instances a row; train --pack), after the --padding run(s)")
      ->capture_default_str();
  c->add_flag("--json", o->json, "Print one JSON object per run with the results");
  c->callback([o] {
    set_threads(o->threads);
    model::BertConfig cfg = model::BertConfig::load(o->shape.config);
    const model::Head head = parse_head(o->shape.head);
    const int64_t P = head == model::Head::Pretraining ? o->shape.preds : 0;
    const Precision prec = parse_precision(o->precision);
    const kernels::Backend& be = device_backend(o->device);
    std::vector<Mode> modes;
    if (o->padding == "both")
      modes = {Mode::Padded, Mode::Unpadded};
    else
      modes = {parse_padding(o->padding, be, model::parse_attention(o->attention), prec)
                   ? Mode::Unpadded
                   : Mode::Padded};
    if (!o->data.empty() && head != model::Head::Pretraining)
      fail(setting("data"), " takes pretraining records: it needs ", setting("head"),
           " pretraining");
    if (o->pack < 0 || (o->pack > 0 && o->data.empty()))
      fail(setting("pack"), " packs prepared records: it needs ", setting("data"), " and N > 0");
    if (o->pack > 0) modes.push_back(Mode::Packed);
    const bool gpu = !be.host_memory();
    // The GEMM ceiling first: its operands are freed before the model exists, so the peak RSS
    // below is the training run's, not this probe's. On a GPU, cuBLASLt's.
    const double peak = be.gemm_peak_gflops(prec, o->shape.batch * o->shape.seq,
                                            cfg.intermediate_size, cfg.hidden_size, 1.0);
    // What the process holds before the training run exists: the libraries (oneDNN, OpenMP,
    // MPI, protobuf, the C++ runtime) and their own state.
    const double baseline = resident_bytes();
    // Prepared data: `steps` batches, timed after whole untimed passes over them (an unpadded
    // batch brings row counts of its own, whose primitives a long run has long created).
    const int n_batches = o->data.empty() ? 1 : o->steps;
    const int warmup =
        o->data.empty() ? o->warmup : (std::max(o->warmup, 1) + o->steps - 1) / o->steps * o->steps;
    const std::vector<model::Batch> batches =
        o->data.empty()
            ? std::vector<model::Batch>{synthetic_batch(cfg, o->shape.batch, o->shape.seq, P, 7)}
            : data_batches(o->data, o->shape.batch, o->shape.seq, P, cfg, n_batches);

    // Packed: as many packed batches, each holding more instances than rows.
    const std::vector<model::Batch> packed =
        o->pack > 0
            ? data_batches(o->data, o->shape.batch, o->shape.seq, P, cfg, n_batches, o->pack)
            : std::vector<model::Batch>{};

    auto measure = [&](Mode mode) {
      const bool unpadded = mode != Mode::Padded;
      const std::vector<model::Batch>& bs = mode == Mode::Packed ? packed : batches;
      BenchResult res;
      res.mode = mode;
      // Kernel scratch taken outside a model's plan so far (the probe's GEMM scratchpad): the
      // run below adds nothing to it when it runs padded (tests/test_memory.cpp).
      const int64_t unplanned_before = be.unplanned_scratch_bytes();
      model::ModelDims dims{o->shape.batch, o->shape.seq, P, prec,
                            model::parse_attention(o->attention)};
      apply_recompute(o->recompute, dims);
      dims.unpadded = unpadded;
      if (mode == Mode::Packed) {
        dims.batch = o->shape.batch * o->pack;
        dims.pack_rows = o->shape.batch;
      }
      // The training session itself (train/session.h), as train and finetune build it: AdamW
      // with clipping at 1.0; fp16 with the scaler's initial loss scale, the gradients unscaled
      // in the optimizer pass. (A device's plan is checked against its memory first.)
      train::SessionSettings ss;
      ss.head = head;
      ss.dims = dims;
      ss.backend = &be;
      comm::SingleProcess single;
      train::Session session(cfg, ss, single, 1);
      model::BertModel& m = session.m;
      const train::Optimizer& optimizer = session.opt;
      // (deferred as train runs it: a GPU's steps read at the end, not one by one)
      train::Step& train_step = session.start(train::StepSettings{
          1, 1.0, false, 0, 1, /*defer=*/true, model::parse_graph_mode(o->graphs)});
      std::vector<double> fwd, bwd, upd;
      size_t taken = 0;  // batches read (a GPU's step reads the next one during its backward)
      auto next = [&](model::Batch& batch) {
        batch = bs[taken++ % bs.size()];
        return true;
      };
      std::optional<kernels::DeviceCounts> counted;
      std::vector<train::StepReport> reports;
      auto settle = [&] {
        for (const train::StepReport& r : train_step.settle()) reports.push_back(r);
      };
      for (int s = 0; s < warmup + o->steps; ++s) {
        if (s == warmup) {
          settle();          // (the warm-up's read left out of the counts)
          be.op_profile(1);  // (the warm-up's operations left out)
          counted = be.device_counts();
        }
        const train::StepReport r = train_step.run(s, 1e-5, next, "", s + 1 < warmup + o->steps);
        if (!r.pending) reports.push_back(r);
      }
      settle();  // (counted: the read a run makes once per logged window, here once)
      for (const train::StepReport& r : reports) {
        res.loss = r.loss;
        if (r.step < warmup) continue;
        fwd.push_back(r.t_forward);
        bwd.push_back(r.t_backward);
        upd.push_back(r.t_optimizer);
        res.seconds += r.t_forward + r.t_backward + r.t_optimizer;
        res.real_tokens += r.real_tokens;
        res.computed_tokens += r.computed_tokens;
        res.padded_tokens += r.token_slots;
        res.instances += r.examples;
        res.flops += r.flops;
      }
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      if (const auto now = be.device_counts(); now && counted) {
        res.launches = static_cast<double>(now->launches - counted->launches) / o->steps;
        res.host_syncs = static_cast<double>(now->host_syncs - counted->host_syncs) / o->steps;
        res.graph_launches =
            static_cast<double>(now->graph_launches - counted->graph_launches) / o->steps;
        res.graph_kernels =
            static_cast<double>(now->graph_kernels - counted->graph_kernels) / o->steps;
      }
      if (gpu && plan::traffic_not_modelled(head, m.dims()).empty()) {
        const plan::StepTraffic t = plan::cuda_step_traffic(cfg, head, m.dims(), /*lamb=*/false,
                                                            /*graphs=*/res.graph_launches > 0);
        res.model_launches = static_cast<double>(t.launches());
        res.non_gemm_bytes = t.non_gemm_bytes();
        res.gemm_seconds = t.flops() / (peak * 1e9);
      }
      res.op_profile = be.op_profile(o->steps);
      res.forward = median(fwd);
      res.backward = median(bwd);
      res.optimizer = median(upd);
      struct rusage ru {};
      getrusage(RUSAGE_SELF, &ru);
      res.rss = ru.ru_maxrss * 1024.0;
      // The plan `bertrain estimate` prints for this run, and what the arenas hold.
      res.planned =
          static_cast<double>(plan::training_plan(cfg, head, m.dims(), 2, 1, be).total_bytes());
      if (const auto dm = be.device_memory())
        res.device_used = static_cast<double>(dm->total - dm->free);
      res.allocated = static_cast<double>(m.allocated_bytes() + optimizer.allocated_bytes());
      res.unplanned = be.unplanned_scratch_bytes() - unplanned_before;
      if (!o->json && modes.front() == mode) {
        std::printf(
            "bench: %s (%s), batch %lld x seq %lld, %d threads, %s, %s attention%s, %d+%d "
            "steps\n",
            o->shape.config.c_str(), describe(cfg).c_str(), (long long)o->shape.batch,
            (long long)o->shape.seq, omp_get_max_threads(), o->precision.c_str(),
            m.attention_kernel(), m.dims().recompute_layers ? ", layers recomputed" : "", warmup,
            o->steps);
        std::printf("  %s\n", kernels::device_line(be).c_str());
        if (const std::string note = be.precision_note(prec); !note.empty())
          std::printf("  %s\n", note.c_str());
        std::printf("  data       %s\n",
                    o->data.empty()
                        ? "synthetic, every sequence full length (no padding)"
                        : str(o->data, ": ", batches.size(), " batches, ",
                              static_cast<int>(100.0 * res.real_tokens / res.padded_tokens + 0.5),
                              "% of the token positions real")
                              .c_str());
      }
      return res;
    };

    std::vector<BenchResult> results;
    for (Mode mode : modes) {
      const BenchResult r = measure(mode);
      results.push_back(r);
      const double step = r.seconds / o->steps;
      const double gflops = r.flops / r.seconds / 1e9;
      const double tokens = r.real_tokens / r.seconds;
      if (o->json) {
        nlohmann::json j = {{"config", o->shape.config},
                            {"batch", o->shape.batch},
                            {"seq_len", o->shape.seq},
                            {"threads", omp_get_max_threads()},
                            {"precision", o->precision},
                            {"padding", mode_name(r.mode)},
                            {"instances_per_step", r.instances / o->steps},
                            {"cpu", cpu_model_name()},
                            {"device", be.name()},
                            {"isa", isa_name(cpu_isa())},
                            {"device_description", be.description()},
                            {"tokens_per_s", tokens},
                            {"computed_tokens_per_s", r.computed_tokens / r.seconds},
                            {"real_token_fraction", r.real_tokens / r.padded_tokens},
                            {"forward_ms", r.forward * 1e3},
                            {"backward_ms", r.backward * 1e3},
                            {"optimizer_ms", r.optimizer * 1e3},
                            {"step_ms", step * 1e3},
                            {"gflops", gflops},
                            {"gemm_peak_gflops", peak},
                            {"gemm_operands", kernels::gemm_operands(be, prec)},
                            {"mfu", gflops / peak},
                            {"peak_rss_bytes", r.rss},
                            {"baseline_rss_bytes", baseline},
                            {"plan_bytes", r.planned},
                            {"allocated_bytes", r.allocated},
                            {"device_used_bytes", r.device_used},
                            {"unplanned_scratch_bytes", r.unplanned},
                            {"loss", r.loss}};
        if (r.launches) {
          j["launches_per_step"] = *r.launches;
          j["host_syncs_per_step"] = *r.host_syncs;
          j["graph_launches_per_step"] = r.graph_launches;
          j["graph_kernels_per_step"] = r.graph_kernels;
        }
        if (r.non_gemm_bytes) {
          j["model_launches_per_step"] = *r.model_launches;
          j["non_gemm_bytes_per_step"] = *r.non_gemm_bytes;
          j["gemm_ms_at_ceiling"] = *r.gemm_seconds * 1e3;
        }
        std::printf("%s\n", j.dump().c_str());
        continue;
      }
      std::printf("  -- %s --\n",
                  r.mode == Mode::Unpadded ? "padding skipped (each sequence on its real tokens)"
                  : r.mode == Mode::Padded
                      ? "padding computed (every sequence padded to --seq-len)"
                      : str("packed (up to ", o->pack, " instances a row, ",
                            static_cast<int>(100.0 * r.real_tokens / r.padded_tokens + 0.5),
                            "% of the rows' tokens real, each instance on its own tokens)")
                            .c_str());
      std::printf(
          "  step       %8.1f ms mean (median forward %.1f ms, backward %.1f ms, AdamW %.1f ms "
          "over %d steps)\n",
          step * 1e3, r.forward * 1e3, r.backward * 1e3, r.optimizer * 1e3, o->steps);
      std::printf(
          "  throughput %8.0f real tokens/s (%.0f token rows computed/s), %.1f sequences/s\n",
          tokens, r.computed_tokens / r.seconds, r.instances / r.seconds);
      std::printf(
          "  compute    %8.1f GFLOP/s model FLOPs computed; %s GEMM ceiling measured now %.1f "
          "GFLOP/s; utilisation %.0f%%\n",
          gflops, kernels::gemm_operands(be, prec), peak, 100.0 * gflops / peak);
      if (gpu)
        std::printf(
            "  memory     GPU: planned %s, allocated from the arenas %s, in use on the device "
            "%s (with the CUDA context and libraries); host peak RSS %s\n",
            human_bytes(r.planned).c_str(), human_bytes(r.allocated).c_str(),
            human_bytes(r.device_used).c_str(), human_bytes(r.rss).c_str());
      else
        std::printf(
            "  memory     peak RSS %s = %s before the model (libraries) + %s; planned %s, "
            "allocated from the arenas %s\n",
            human_bytes(r.rss).c_str(), human_bytes(baseline).c_str(),
            human_bytes(r.rss - baseline).c_str(), human_bytes(r.planned).c_str(),
            human_bytes(r.allocated).c_str());
      if (r.launches) {
        std::printf(
            "  device     %.0f kernel launches a step (a cuBLAS/cuBLASLt product counted as "
            "one), %.0f host synchronisations in %d steps (%.2f a step: the steps' results read "
            "at the end, as train reads them once a logged window)\n",
            *r.launches, *r.host_syncs * o->steps, o->steps, *r.host_syncs);
        if (r.graph_launches > 0)
          std::printf(
              "  graphs     %.0f of them in %.0f CUDA graph launches a step (--cuda-graphs: the "
              "optimizer's update, and forward and backward where the batch is padded or the "
              "attention fused): the host "
              "issues %.0f launches a step\n",
              r.graph_kernels, r.graph_launches, *r.launches - r.graph_kernels + r.graph_launches);
      }
      if (r.non_gemm_bytes) {
        // What the kernels besides the products move (the traffic model's compulsory bytes),
        // and the rate they moved it at if the products (cuBLAS's, and the fused attention's on
        // the tensor cores) ran at the ceiling measured above.
        const double rest = step - *r.gemm_seconds;
        std::printf(
            "  traffic    the model (estimate --device cuda --explain): %.0f launches, %.2f GB a "
            "step besides the products; the products at the ceiling above take %.2f ms, the "
            "other %.2f ms of the step move those bytes at %s/s\n",
            *r.model_launches, *r.non_gemm_bytes / 1e9, *r.gemm_seconds * 1e3, rest * 1e3,
            rest > 0 ? human_bytes(*r.non_gemm_bytes / rest).c_str() : "(no time left)");
      }
      std::printf("  loss       %.4f (%s)\n", r.loss,
                  o->data.empty() ? "synthetic data; sanity only" : "untrained model");
      if (!r.op_profile.empty())
        std::printf(
            "  device time by operation (BERTRAIN_CUDA_PROFILE; events around each, "
            "so the step above is slower than unprofiled):\n%s",
            r.op_profile.c_str());
    }
    auto rate = [](const BenchResult& r) { return r.real_tokens / r.seconds; };
    for (size_t i = 1; i < results.size() && !o->json; ++i)
      std::printf("  %s: %.2fx the real tokens/s of %s\n",
                  results[i].mode == Mode::Unpadded ? "skipping the padding" : "packing",
                  rate(results[i]) / rate(results[0]),
                  results[0].mode == Mode::Padded ? "computing the padding" : "skipping it");
    if (results.size() == 3 && !o->json)
      std::printf("  packing: %.2fx the real tokens/s of skipping the padding\n",
                  rate(results[2]) / rate(results[1]));
  });
}

}  // namespace bertrain::cli
