// bertrain estimate: the memory plan of a training run (the same plan the trainer allocates),
// and with --memory-budget the largest batch size that fits.
#include <cstdio>

#include "cli/commands.h"
#include "comm/mpi.h"
#include "core/error.h"
#include "data/pipeline.h"
#include "plan/memory.h"
#include "plan/traffic.h"
#include "train/precision.h"

namespace bertrain::cli {

void add_estimate(CLI::App& app) {
  struct Opts {
    ShapeOpts shape{32};
    std::string budget, precision = "fp32", attention = "auto", recompute = "none", device = "cpu",
                        optimizer = "lamb", graphs = "auto";
    int slots = 2, ranks = 1;
    bool shard = false, explain = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "estimate", "Print the memory plan of a training run; pick the batch size for a budget");
  add_shape_options(c, o->shape, "Sequences per step per rank");
  c->add_option("--optimizer-slots", o->slots,
                "fp32 optimizer states per parameter (AdamW/LAMB: 2)")
      ->capture_default_str();
  c->add_flag("--shard-optimizer", o->shard,
              "The optimizer state sharded over --ranks ranks (train --shard-optimizer)");
  c->add_option("--ranks", o->ranks, "Data-parallel ranks (with --shard-optimizer)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_flag("--explain", o->explain,
              "Also print the rule of thumb (16 B per parameter, Korthikanti et al.'s "
              "activations) next to the plan, and why they differ; with --device cuda also the "
              "traffic model: each kernel's launches, bytes and products in a step, and the step "
              "time they predict on an H200");
  c->add_option("--optimizer", o->optimizer,
                "lamb or adamw: the update's kernels in the traffic model (train's default: lamb, "
                "bench's: adamw)")
      ->capture_default_str();
  add_attention_option(c, o->attention);
  add_recompute_option(c, o->recompute);
  add_graphs_option(c, o->graphs);
  c->add_option("--precision", o->precision,
                "fp32, bf16 or fp16 (bf16 adds the bf16 weight copy, fp16 on a GPU an fp16 one; "
                "both keep some activations in 16 bits, as train allocates)")
      ->capture_default_str();
  c->add_option("--memory-budget", o->budget,
                "Memory available per rank (per GPU with --device cuda), e.g. 16GiB: prints the "
                "largest batch that fits (default on a visible GPU: its free memory)");
  c->add_option("--device", o->device,
                "cpu or cuda: the plan of a run on a GPU (its arenas in device memory, the "
                "CUDA kernels' scratch), also where no GPU is; auto: cuda where "
                "a GPU is visible")
      ->capture_default_str();
  c->callback([o] {
    model::BertConfig cfg = model::BertConfig::load(o->shape.config);
    model::Head head = parse_head(o->shape.head);
    model::ModelDims d{o->shape.batch, o->shape.seq,
                       head == model::Head::Pretraining ? o->shape.preds : 0,
                       parse_precision(o->precision), model::parse_attention(o->attention)};
    apply_recompute(o->recompute, d);
    const int shard_world = o->shard ? o->ranks : 1;
    const kernels::Target& target = device_target(o->device);
    const bool device = !target.host_memory();
    d = plan::with_master_shard(cfg, head, d, -1, shard_world, target);  // as train/finetune
    d = model::on_backend(d, cfg, target);
    MemoryPlan plan = plan::training_plan(cfg, head, d, o->slots, shard_world, target);
    const kernels::Backend* gpu = device ? kernels::gpu_backend() : nullptr;
    const std::optional<kernels::DeviceMemory> gpu_memory =
        gpu ? gpu->device_memory() : std::nullopt;
    model::ParamTable table(cfg, head);
    int64_t nparams = 0;
    for (const auto& p : table.params()) nparams += p.numel();
    std::printf("model     %s (%s, %s, %.1fM parameters)\n", o->shape.config.c_str(),
                describe(cfg).c_str(), model::head_architecture(head), nparams / 1e6);
    std::printf(
        "run       batch %lld x seq %lld, %lld predictions, %s, %d optimizer slots%s, %s "
        "attention%s\n",
        (long long)d.batch, (long long)d.seq_len, (long long)d.max_predictions,
        o->precision.c_str(), o->slots,
        shard_world > 1 ? str(" sharded over ", shard_world, " ranks",
                              d.master_shard ? " with the fp32 master weights" : "")
                              .c_str()
                        : "",
        d.blocked_attention() ? "blocked" : "full",
        d.recompute_layers ? ", layers recomputed in backward" : "");
    std::printf("memory plan per rank%s:\n%s",
                device ? str(", in the ", target.name(), " device's memory").c_str() : "",
                plan::format_plan(plan).c_str());
    // Besides the arenas: the input pipeline's bound (train's default input options) and, under
    // MPI, the rank's slot of the node's shared window.
    // (Fine-tuning reads its task file into memory instead: the file's size.)
    const bool pipeline = head == model::Head::Pretraining;
    auto input = [&](int64_t batch) {
      return pipeline ? input_bound({}, batch, d.seq_len, d.max_predictions, cfg) : 0.0;
    };
    auto outside = [&](int64_t batch) {
      return input(batch) + (o->ranks > 1 ? static_cast<double>(comm::kShmSlotBytes) : 0.0);
    };
    if (device) {
      // The device holds the plan; the input pipeline is host memory, the CUDA context and the
      // libraries' handles are the device's own.
      std::printf(
          "besides the plan: the CUDA context and the libraries' handles and workspaces (a run "
          "keeps %s of the free memory for them); in host memory the input pipeline (%s)\n",
          human_bytes(plan::kDeviceHeadroom).c_str(), human_bytes(input(d.batch)).c_str());
      if (gpu_memory)
        std::printf("device    %s: %s free of %s\n", kernels::device_line(*gpu).c_str(),
                    human_bytes(static_cast<double>(gpu_memory->free)).c_str(),
                    human_bytes(static_cast<double>(gpu_memory->total)).c_str());
    } else {
      std::printf("besides the arenas (bounded):\n");
      if (pipeline)
        std::printf(
            "  input pipeline %12s  (train's default input options: interleave, shuffle "
            "buffer, prefetch)\n",
            human_bytes(input(d.batch)).c_str());
      if (o->ranks > 1)
        std::printf(
            "  MPI window     %12s  (the rank's staging slot in its node's shared window)\n",
            human_bytes(static_cast<double>(comm::kShmSlotBytes)).c_str());
      std::printf("  total          %12s\n",
                  human_bytes(static_cast<double>(plan.total_bytes()) + outside(d.batch)).c_str());
    }
    if (o->optimizer != "lamb" && o->optimizer != "adamw")
      fail("--optimizer must be lamb or adamw, got '", o->optimizer, "'");
    if (o->explain)
      std::printf("%s", plan::explain_plan(cfg, head, d, o->slots, shard_world, plan).c_str());
    if (o->explain && device) {
      const std::string why = plan::traffic_not_modelled(head, d);
      if (why.empty())
        std::printf("%s", plan::explain_traffic(
                              plan::cuda_step_traffic(
                                  cfg, head, d, o->optimizer == "lamb",
                                  model::parse_graph_mode(o->graphs) != model::GraphMode::Off),
                              plan::h200_roofline(d.precision), d.precision)
                              .c_str());
      else
        std::printf("traffic model: covers %s\n", why.c_str());
    }
    if (!o->budget.empty() || gpu_memory) {
      const double budget =
          !o->budget.empty() ? parse_bytes(o->budget) : plan::device_budget(*gpu_memory);
      const int64_t b =
          plan::max_batch_for_budget(cfg, head, d, o->slots, budget, shard_world,
                                     device ? std::function<double(int64_t)>() : outside, target);
      if (b == 0)
        std::printf(
            "budget    %s: even batch 1 does not fit; use a shorter --seq-len or a smaller model\n",
            human_bytes(budget).c_str());
      else
        std::printf("budget    %s: largest batch size that fits is %lld\n",
                    human_bytes(budget).c_str(), (long long)b);
    }
  });
}

}  // namespace bertrain::cli
