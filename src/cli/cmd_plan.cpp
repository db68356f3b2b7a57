// bertrain plan: the predicted step time, exposed communication, scaling efficiency and memory
// per rank of a data-parallel job over a range of host counts (plan/scaling.h), from one rank's
// measured compute (`bertrain bench --json`) or given times.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "core/setting.h"
#include "plan/memory.h"
#include "plan/scaling.h"
#include "train/precision.h"

namespace bertrain::cli {

void add_plan(CLI::App& app) {
  struct Opts {
    std::string config, precision = "fp32", attention = "auto", recompute = "none", compute,
                        hosts = "1,2,4,8,16,32", allreduce = "auto", compression = "none";
    int64_t batch = 32, seq = 128, preds = 20, accumulation = 1;
    double forward_ms = 0, backward_ms = 0, optimizer_ms = 0;
    plan::ClusterSpec cluster;
    plan::CommSpec comm;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "plan",
      "Predict step time, exposed communication, scaling efficiency and memory per rank over "
      "host counts, before renting the cluster");
  c->add_option("--model-config", o->config, "HuggingFace config.json of the model")->required();
  c->add_option("--batch-size", o->batch, "Sequences per micro-batch per rank")
      ->capture_default_str();
  c->add_option("--seq-len", o->seq, "Tokens per sequence")->capture_default_str();
  c->add_option("--max-predictions", o->preds, "Masked LM predictions per sequence")
      ->capture_default_str();
  c->add_option("--accumulation-steps", o->accumulation, "Micro-batches per step")
      ->capture_default_str();
  c->add_option("--precision", o->precision, "fp32, bf16 or fp16 (for the memory plan)")
      ->capture_default_str();
  add_attention_option(c, o->attention);
  add_recompute_option(c, o->recompute);
  c->add_option("--compute", o->compute,
                "One rank's step measured by `bertrain bench --json` (its forward_ms, "
                "backward_ms, optimizer_ms), e.g. run on the cluster's device");
  c->add_option("--forward-ms", o->forward_ms, "Or given: forward per step (all micro-batches)");
  c->add_option("--backward-ms", o->backward_ms, "Backward per step");
  c->add_option("--optimizer-ms", o->optimizer_ms, "Optimizer per step");
  c->add_option("--hosts", o->hosts, "Host counts to predict, comma-separated")
      ->capture_default_str();
  c->add_option("--ranks-per-host", o->cluster.ranks_per_host, "Ranks (GPUs) per host")
      ->capture_default_str();
  c->add_option("--link-gbit", o->cluster.link_gbit, "Network bandwidth per host (Gbit/s)")
      ->capture_default_str();
  c->add_option("--latency-us", o->cluster.latency_us, "Network latency per message (us)")
      ->capture_default_str();
  c->add_option("--host-gbyte-s", o->cluster.host_gbyte_s,
                "Memory bandwidth a host's ranks share for the shared-memory reduction (GB/s)")
      ->capture_default_str();
  c->add_option("--allreduce", o->allreduce, "auto, shm, ring, hierarchical or mpi")
      ->capture_default_str();
  c->add_option("--compression", o->compression, "Precision dtype between hosts: none, fp16, bf16")
      ->capture_default_str();
  c->add_option("--bucket-mb", o->comm.bucket_mb, "Gradient bucket size (MiB)")
      ->capture_default_str();
  c->add_option("--overlap", o->comm.overlap, "Reduce buckets while backward runs")
      ->capture_default_str();
  c->add_flag("--shard-optimizer", o->comm.shard_optimizer,
              "The optimizer state sharded over the ranks (train --shard-optimizer)");
  c->callback([o] {
    const model::BertConfig cfg = model::BertConfig::load(o->config);
    plan::StepCompute compute{o->forward_ms, o->backward_ms, o->optimizer_ms, o->accumulation};
    std::string source = "given";
    if (!o->compute.empty()) {
      std::ifstream in(o->compute);
      if (!in) fail("--compute ", o->compute, ": cannot read it (bertrain bench --json > FILE)");
      std::string line, last;
      while (std::getline(in, line))
        if (!line.empty() && line[0] == '{') last = line;
      try {
        const nlohmann::json j = nlohmann::json::parse(last);
        compute.forward_ms = j.at("forward_ms");
        compute.backward_ms = j.at("backward_ms");
        compute.optimizer_ms = j.at("optimizer_ms");
        if (j.contains("batch") && j.at("batch").get<int64_t>() != o->batch)
          fail("--compute ", o->compute, " was measured at batch ", j.at("batch").get<int64_t>(),
               ", the plan is for ", setting("batch_size"), " ", o->batch);
        source = str(o->compute, " (", j.value("cpu", std::string("?")), ", ",
                     j.value("threads", 0), " threads)");
      } catch (const nlohmann::json::exception& e) {
        fail("--compute ", o->compute, ": not bertrain bench --json output (", e.what(), ")");
      }
    }
    if (!(compute.forward_ms > 0 && compute.backward_ms > 0))
      fail(
          "plan needs one rank's compute: --compute FILE from bertrain bench --json, or "
          "--forward-ms and --backward-ms (and --optimizer-ms)");
    if (o->compression == "fp16" || o->compression == "bf16")
      o->comm.wire_bytes = 2;
    else if (o->compression != "none")
      fail("--compression must be none, fp16 or bf16, got '", o->compression, "'");
    o->comm.algorithm = o->allreduce;
    std::vector<int64_t> hosts;
    {
      std::stringstream in(o->hosts);
      std::string item;
      while (std::getline(in, item, ',')) {
        try {
          hosts.push_back(std::stoll(item));
        } catch (const std::exception&) {
          fail("--hosts must be comma-separated counts, got '", o->hosts, "'");
        }
        if (hosts.back() < 1) fail("--hosts: a count must be at least 1");
      }
    }
    const model::ParamTable table(cfg, model::Head::Pretraining);
    const plan::GradientLayout g = plan::gradient_layout(table, cfg.num_hidden_layers);
    model::ModelDims d{o->batch, o->seq, o->preds, parse_precision(o->precision),
                       model::parse_attention(o->attention)};
    apply_recompute(o->recompute, d);
    o->comm.sharded_master = o->comm.shard_optimizer && d.bf16();
    const double tokens_per_rank = static_cast<double>(o->batch * o->accumulation * o->seq);
    std::printf(
        "plan: %s (%s, %.1fM parameters, %s of fp32 gradients), %lld x %lld tokens x %lld "
        "micro-batches per rank, %s\n",
        o->config.c_str(), describe(cfg).c_str(), g.total / 1e6,
        human_bytes(4.0 * static_cast<double>(g.total)).c_str(), (long long)o->batch,
        (long long)o->seq, (long long)o->accumulation, o->precision.c_str());
    std::printf("  one rank's step: forward %.1f ms, backward %.1f ms, optimizer %.1f ms (%s)\n",
                compute.forward_ms, compute.backward_ms, compute.optimizer_ms, source.c_str());
    std::printf(
        "  cluster: %lld ranks per host, link %.3g Gbit/s and %.3g us, host memory %.3g GB/s; "
        "allreduce %s, wire %s, buckets %.3g MiB, overlap %s%s\n",
        (long long)o->cluster.ranks_per_host, o->cluster.link_gbit, o->cluster.latency_us,
        o->cluster.host_gbyte_s, o->allreduce.c_str(), o->compression.c_str(), o->comm.bucket_mb,
        o->comm.overlap ? "on" : "off",
        o->comm.shard_optimizer ? (o->comm.sharded_master ? ", optimizer and fp32 master sharded"
                                                          : ", optimizer sharded")
                                : "");
    std::printf("%6s %6s %-13s %9s %9s %11s %10s %12s %12s\n", "hosts", "ranks", "algorithm",
                "step ms", "comm ms", "exposed ms", "scaling", "tokens/s", "memory/rank");
    for (int64_t h : hosts) {
      plan::ClusterSpec cl = o->cluster;
      cl.hosts = h;
      const plan::ScalingRow r = plan::predict_step(g, compute, cl, o->comm);
      const MemoryPlan mem =
          plan::training_plan(cfg, model::Head::Pretraining, d, 2,
                              o->comm.shard_optimizer ? static_cast<int>(r.ranks) : 1);
      std::printf("%6lld %6lld %-13s %9.1f %9.1f %11.1f %9.0f%% %12.0f %12s\n", (long long)h,
                  (long long)r.ranks, r.algorithm.c_str(), r.step_ms, r.comm_ms, r.exposed_ms,
                  100.0 * r.efficiency, tokens_per_rank * r.ranks / (r.step_ms * 1e-3),
                  human_bytes(static_cast<double>(mem.total_bytes())).c_str());
    }
  });
}

}  // namespace bertrain::cli
