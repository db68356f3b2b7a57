#include "train/autotune.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/packing.h"
#include "data/pipeline.h"
#include "data/schema.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/precision.h"
#include "train/run_state.h"
#include "train/step.h"

namespace bertrain::train {

nlohmann::json Tuning::to_json() const {
  nlohmann::json trials_json = nlohmann::json::array();
  for (const Trial& t : trials)
    trials_json.push_back({{"knob", t.knob},
                           {"value", t.value},
                           {"step_ms", t.step_ms},
                           {"tokens_per_s", t.tokens_per_s}});
  return {{"attention", model::attention_name(attention)},
          {"threads", threads},
          {"bucket_mb", bucket_mb},
          {"pack", pack},
          {"trials", trials_json}};
}

Tuning Tuning::from_json(const nlohmann::json& j) {
  Tuning t;
  t.attention = model::parse_attention(j.at("attention").get<std::string>());
  t.threads = j.at("threads").get<int>();
  t.bucket_mb = j.at("bucket_mb").get<int64_t>();
  t.pack = j.value("pack", int64_t{-1});
  for (const auto& x : j.value("trials", nlohmann::json::array()))
    t.trials.push_back({x.at("knob").get<std::string>(), x.at("value").get<std::string>(),
                        x.at("step_ms").get<double>(), x.value("tokens_per_s", 0.0)});
  return t;
}

void Tuning::apply(TrainConfig& cfg) const {
  cfg.attention = attention;
  cfg.bucket_mb = bucket_mb;
  if (pack >= 0) cfg.input.pack_per_row = pack;
  if (threads > 0) omp_set_num_threads(threads);
}

std::string Tuning::report() const {
  std::string out;
  const std::string packed = pack >= 0 ? str(", packing ", pack, " instances a row") : "";
  if (source != "measured") {
    out += str("  autotune: kept from ", source, ": ", model::attention_name(attention),
               " attention, ", threads, " threads, buckets of ", bucket_mb, " MiB", packed, "\n");
    return out;
  }
  for (const Trial& t : trials) {
    char line[160];
    std::snprintf(line, sizeof line, "  autotune: %-9s %-8s %9.1f ms per step", t.knob.c_str(),
                  t.value.c_str(), t.step_ms);
    out += line;
    if (t.tokens_per_s > 0) {
      std::snprintf(line, sizeof line, ", %.0f real tokens/s", t.tokens_per_s);
      out += line;
    }
    out += "\n";
  }
  out += str("  autotune: chose ", model::attention_name(attention), " attention, ", threads,
             " threads, buckets of ", bucket_mb, " MiB", packed,
             " (the fastest of each, the default unless another is 2% faster",
             pack >= 0 ? "; packing by real tokens/s" : "",
             "; input readers and prefetch tune themselves)\n");
  return out;
}

bool stored_tuning(const TrainConfig& cfg, Tuning& out) {
  if (!cfg.resume) return false;
  const std::string ck = resolve_checkpoint(cfg.output);
  if (ck.empty()) return false;
  std::ifstream in(std::filesystem::path(ck) / "trainer_state.json");
  if (!in) return false;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception&) {
    return false;  // load_checkpoint names what is wrong with it
  }
  if (!j.contains("settings") || !j["settings"].contains("autotune")) return false;
  out = Tuning::from_json(j["settings"]["autotune"]);
  out.source = ck;
  return true;
}

namespace {

// Step time (ms) of a throwaway model: a first pass over the batches warms it up (oneDNN creates
// a primitive per new shape, and an unpadded batch brings new row counts: a trial timed on its
// first sight of them would pay for what the trials after it find cached), then the mean of a
// second pass over the same batches, the mean of that over the ranks.
double time_steps(const TrainConfig& cfg, comm::Communicator& comm, const model::BertConfig& mc,
                  const std::vector<model::Batch>& batches, model::ModelDims::Attention attention,
                  int threads, int64_t bucket_mb) {
  omp_set_num_threads(threads);
  SessionSettings ss = session_settings(cfg, comm.rank(), comm.size());
  ss.dims.attention = attention;
  Session session(mc, ss, comm, cfg.seed);
  Step& step =
      session.start(StepSettings{1, cfg.predivide, cfg.overlap, bucket_mb << 20, cfg.seed});
  const int n = static_cast<int>(batches.size());
  double timed = 0;
  for (int s = 0; s < 2 * n; ++s) {
    const model::Batch& b = batches[static_cast<size_t>(s % n)];
    const StepReport r = step.run(s, 1e-6, [&](model::Batch& out) {
      out = b;
      return true;
    });
    if (s >= n) timed += r.t_total;
  }
  double ms = 1e3 * timed / n;
  if (comm.size() > 1) {
    comm.allreduce_sum(&ms, 1);
    ms /= comm.size();
    comm.broadcast(&ms, sizeof ms, 0);  // rank 0's sum decides on every rank
  }
  return ms;
}

}  // namespace

Tuning autotune(const TrainConfig& cfg, comm::Communicator& comm, int steps) {
  const model::BertConfig mc = model::BertConfig::load(cfg.model_config);
  // The run's first batches of this rank (packed as `c` packs them), from a pipeline of the
  // tuning's own.
  auto first_batches = [&](const TrainConfig& c) {
    data::PipelineOptions in = c.input;
    in.batch_size = c.batch_size;
    in.rank = comm.rank();
    in.world = comm.size();
    in.seed = c.seed;
    in.verbose_skips = false;
    std::vector<model::Batch> out(static_cast<size_t>(steps));
    data::Pipeline pipe(in, data::Schema::pretraining(c.seq_len, c.max_predictions, mc.vocab_size,
                                                      mc.type_vocab_size));
    for (model::Batch& b : out) pipe.next(b);
    return out;
  };
  Tuning t;
  t.source = "measured";
  t.attention = cfg.attention;
  t.threads = omp_get_max_threads();
  t.bucket_mb = cfg.bucket_mb;
  // Each knob's default is measured first; another value replaces it only when faster by more
  // than this fraction (step times vary by a few percent from run to run: a difference within
  // that is no reason to leave the default).
  constexpr double kMargin = 0.02;
  auto faster = [&](double ms, double best) { return ms < best * (1.0 - kMargin); };
  // 0. --pack auto: the instances a packed row holds at most, MLPerf's 3 first. Each candidate
  // packs its own batches, whose steps hold different numbers of tokens: compared by real
  // tokens per second over the ranks.
  TrainConfig run = cfg;  // what the later trials time: the pack chosen here
  std::vector<model::Batch> batches;
  if (cfg.autotune_pack) {
    double best_rate = 0;
    for (int64_t n : {3, 2, 4}) {
      TrainConfig c = cfg;
      c.input.pack_per_row = n;
      std::vector<model::Batch> bs = first_batches(c);
      double tokens = 0;  // real tokens of this rank's batches, then of all ranks'
      for (const model::Batch& b : bs)
        for (int64_t e = 0; e < b.B; ++e)
          tokens +=
              static_cast<double>(data::instance_size(b.input_mask.data() + e * b.T, b.T,
                                                      b.masked_lm_positions.data() + e * b.P,
                                                      b.masked_lm_weights.data() + e * b.P, b.P)
                                      .first);
      comm.allreduce_sum(&tokens, 1);
      const double ms = time_steps(c, comm, mc, bs, c.attention, t.threads, t.bucket_mb);
      const double rate = tokens / static_cast<double>(steps) / (ms / 1e3);
      t.trials.push_back({"pack", std::to_string(n), ms, rate});
      if (best_rate == 0 || rate > best_rate * (1.0 + kMargin)) {
        best_rate = rate;
        t.pack = n;
        batches = std::move(bs);
      }
    }
    run.input.pack_per_row = t.pack;
  } else {
    batches = first_batches(cfg);
  }
  auto measure = [&](const std::string& knob, const std::string& value,
                     model::ModelDims::Attention a, int threads, int64_t bucket) {
    const double ms = time_steps(run, comm, mc, batches, a, threads, bucket);
    t.trials.push_back({knob, value, ms});
    return ms;
  };
  // 1. The attention kernel, unless the run asked for one: auto's own choice first (full below
  // 512 tokens, blocked from there), then the other.
  double best = 0;
  if (cfg.attention == model::ModelDims::Attention::Auto) {
    model::ModelDims d;
    d.seq_len = cfg.seq_len;
    const auto first = d.blocked_attention() ? model::ModelDims::Attention::Blocked
                                             : model::ModelDims::Attention::Full;
    const auto other = first == model::ModelDims::Attention::Full
                           ? model::ModelDims::Attention::Blocked
                           : model::ModelDims::Attention::Full;
    best = measure("attention", model::attention_name(first), first, t.threads, t.bucket_mb);
    t.attention = first;
    const double ms =
        measure("attention", model::attention_name(other), other, t.threads, t.bucket_mb);
    if (faster(ms, best)) {
      best = ms;
      t.attention = other;
    }
  } else {
    best = measure("attention", model::attention_name(t.attention), t.attention, t.threads,
                   t.bucket_mb);
  }
  // 2. Compute threads per rank: the most this process may use, and fewer (a rank sharing its
  // cores with the input pipeline's readers and the communication may do better with less).
  const int most = t.threads;
  std::vector<int> fewer;
  for (int n : {most * 3 / 4, most / 2})
    if (n >= 1 && n < most && std::find(fewer.begin(), fewer.end(), n) == fewer.end())
      fewer.push_back(n);
  for (int n : fewer) {
    const double ms = measure("threads", std::to_string(n), t.attention, n, t.bucket_mb);
    if (faster(ms, best)) {
      best = ms;
      t.threads = n;
    }
  }
  // 3. The gradient bucket size, where buckets are reduced behind backward.
  if (comm.size() > 1 && cfg.overlap) {
    const int64_t base = cfg.bucket_mb;
    for (int64_t mb : {std::max<int64_t>(1, base / 4), base * 4}) {
      if (mb == base) continue;
      const double ms = measure("bucket", str(mb, " MiB"), t.attention, t.threads, mb);
      if (faster(ms, best)) {
        best = ms;
        t.bucket_mb = mb;
      }
    }
  }
  omp_set_num_threads(t.threads);
  return t;
}

}  // namespace bertrain::train
