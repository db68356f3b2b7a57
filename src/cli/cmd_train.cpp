// bertrain train: pretraining (MLM + NSP) from TFRecords; bertrain eval: MLM/NSP metrics of a
// checkpoint on TFRecords.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "comm/mpi.h"
#include "core/arena.h"
#include "core/error.h"
#include "data/object_store.h"
#include "model/checkpoint.h"
#include "obs/events.h"
#include "plan/memory.h"
#include "train/evaluate.h"
#include "train/run_mirror.h"
#include "train/run_state.h"
#include "train/trainer.h"

namespace bertrain::cli {

void add_pipeline_options(CLI::App* c, data::PipelineOptions& p, std::string& on_corrupt) {
  c->add_option("--cycle-length", p.cycle_length, "Input files read in parallel (interleave)")
      ->capture_default_str();
  c->add_option("--block-length", p.block_length, "Records taken from a file in turn")
      ->capture_default_str();
  c->add_option("--shuffle-buffer", p.shuffle_buffer, "Examples in the shuffle buffer")
      ->capture_default_str();
  c->add_option("--readers", p.readers, "Input reader threads (0: AUTOTUNE)")
      ->capture_default_str();
  c->add_option("--prefetch", p.prefetch, "Batches prefetched (0: AUTOTUNE)")
      ->capture_default_str();
  c->add_option("--on-corrupt", on_corrupt, "Corrupt input records: fail or skip")
      ->capture_default_str();
  add_read_ahead_options(c, p);
  add_storage_options(c);
}

void add_read_ahead_options(CLI::App* c, data::PipelineOptions& p) {
  c->add_option_function<double>(
       "--read-chunk",
       [&p](double mib) {
         if (!(mib >= 0.0625)) fail("--read-chunk must be at least 0.0625 (MiB)");
         p.remote_chunk_bytes = static_cast<size_t>(mib * (1 << 20));
       },
       "MiB per ranged read of an s3:// or oss:// file (default 4)")
      ->group("Object storage");
  c->add_option("--read-ahead", p.remote_readahead,
                "Ranged reads in flight per open s3:// or oss:// file (0: auto, at least 2 and "
                "32 MiB over the --cycle-length open files)")
      ->group("Object storage");
}

data::OnCorrupt parse_on_corrupt(const std::string& s) {
  if (s == "fail") return data::OnCorrupt::Fail;
  if (s == "skip") return data::OnCorrupt::Skip;
  fail("--on-corrupt must be fail or skip, got '", s, "'");
}

namespace {

// --batch-size (a number or auto) and --global-batch into the micro-batch and the accumulation.
// auto: the largest micro-batch whose memory plan (plan::training_plan: parameters, gradients,
// optimizer state, activations, kernel scratch) fits the budget per rank: the host's memory, or
// on a backend with memory of its own (a GPU) the device's (plan::device_budget).
template <typename Opts>
void choose_batch(train::TrainConfig& cfg, const Opts& o, const comm::Communicator& c) {
  const int64_t world = c.size();
  int64_t fit = 0;
  double budget = 0;
  if (o.batch == "auto") {
    const kernels::Backend& be = train::backend_of(cfg);
    const std::optional<kernels::DeviceMemory> device = be.device_memory();
    if (!be.host_memory() && !device)
      fail("--batch-size auto: the ", be.name(),
           " backend says nothing of its memory; give the "
           "batch size");
    budget = !o.budget.empty() ? parse_bytes(o.budget)
             : device          ? plan::device_budget(*device)
                               : 0.9 * available_memory() / std::max(1, c.local_size());
    train::TrainConfig one = cfg;
    one.batch_size = 1;
    const model::ModelDims d = train::model_dims(one, -1, static_cast<int>(world));
    const model::BertConfig mc = model::BertConfig::load(cfg.model_config);
    // Besides the arenas in host memory: this run's input pipeline bound and, under MPI, the
    // window slot. A device's budget holds the arenas alone (the input is staged in its plan).
    auto outside = [&](int64_t batch) {
      if (!be.host_memory()) return 0.0;
      return input_bound(cfg.input, batch, cfg.seq_len, cfg.max_predictions, mc) +
             (world > 1 ? static_cast<double>(comm::kShmSlotBytes) : 0.0);
    };
    fit =
        plan::max_batch_for_budget(mc, model::Head::Pretraining, d, 2, budget,
                                   cfg.shard_optimizer ? static_cast<int>(world) : 1, outside, be);
    if (fit == 0)
      fail("--batch-size auto: not even one sequence of ", cfg.seq_len, " tokens fits ",
           human_bytes(budget), " per rank", device ? str(" on the ", be.name(), " device") : "",
           "; use --recompute layer, --precision bf16, a shorter --seq-len or a larger "
           "--memory-budget");
    cfg.batch_size = fit;
  } else {
    try {
      size_t used = 0;
      cfg.batch_size = std::stoll(o.batch, &used);
      if (used != o.batch.size()) throw std::invalid_argument(o.batch);
    } catch (const std::exception&) {
      fail("--batch-size must be a number or auto, got '", o.batch, "'");
    }
    if (!o.budget.empty()) fail("--memory-budget goes with --batch-size auto");
  }
  if (o.global_batch > 0) {
    if (o.global_batch % world)
      fail("--global-batch ", o.global_batch, " is not a multiple of the ", world, " ranks");
    const int64_t per_rank = o.global_batch / world, most = cfg.batch_size;
    // The fewest micro-batches of at most `most` sequences that split per_rank evenly.
    int64_t accumulation = (per_rank + most - 1) / most;
    while (per_rank % accumulation) ++accumulation;
    cfg.accumulation = accumulation;
    cfg.batch_size = per_rank / accumulation;
  }
  if (fit && c.rank() == 0)
    std::printf(
        "batch auto: %lld sequences of %lld tokens per rank fit %s; micro-batch %lld x %lld "
        "accumulation x %lld ranks = %lld sequences per step\n",
        (long long)fit, (long long)cfg.seq_len, human_bytes(budget).c_str(),
        (long long)cfg.batch_size, (long long)cfg.accumulation, (long long)world,
        (long long)(cfg.batch_size * cfg.accumulation * world));
}

}  // namespace

void add_train(CLI::App& app, comm::Communicator& (*comm)()) {
  struct Opts {
    train::TrainConfig cfg;
    std::string precision = "fp32", optimizer = "lamb", on_corrupt = "fail", attention = "auto",
                recompute = "none", batch = "32", budget, padding = "auto", pack = "0",
                graphs = "auto", device = "cpu", stage_dir;
    int64_t global_batch = 0;
    int threads = 0;
  };
  auto o = std::make_shared<Opts>();
  o->cfg.optimizer.kind = train::OptimizerKind::Lamb;
  auto* c = app.add_subcommand("train", "Pretrain BERT (masked LM + next sentence) on TFRecords");
  auto& t = o->cfg;
  c->add_option("--model-config", t.model_config, "HuggingFace config.json of the model")
      ->required();
  c->add_option("--data", t.input.files,
                "Training TFRecords: glob(s), comma-separated; s3:// and oss:// too")
      ->required();
  c->add_option("--output", t.output,
                "Run directory (checkpoints, latest), or an object-store prefix (s3://bucket/run, "
                "oss://...): checkpoints committed there (parts, then a COMMIT object, then "
                "latest), metrics and events uploaded as they grow, --resume from there")
      ->required();
  c->add_option("--stage-dir", o->stage_dir,
                "With an s3:// or oss:// --output: the local directory each host writes the run "
                "into before it is uploaded (default $TMPDIR/bertrain-stage/<scheme>/<bucket>/"
                "<prefix>)");
  c->add_option("--lease-seconds", t.lease_seconds,
                "With an s3:// or oss:// --output: the run's lease (<output>/bertrain.lock, one "
                "job per run) lasts this long without renewal; a job that stopped renewing it "
                "(killed, its host lost) is taken over after it")
      ->capture_default_str();
  c->add_option("--init-checkpoint", t.init_checkpoint,
                "Start from these weights (HuggingFace or bertrain checkpoint, or a Google BERT "
                "TensorFlow checkpoint)");
  c->add_option("--batch-size", o->batch,
                "Sequences per rank per micro-batch, or auto: the largest the memory plan fits in "
                "--memory-budget")
      ->capture_default_str();
  c->add_option("--memory-budget", o->budget,
                "With --batch-size auto: memory per rank, e.g. 16GiB (default: 90% of this "
                "host's available memory, shared by its ranks; on a GPU its free memory less "
                "256 MiB for the libraries)");
  c->add_option("--global-batch", o->global_batch,
                "Sequences per optimizer step over all ranks, kept with gradient accumulation "
                "(sets --accumulation-steps)");
  c->add_option("--seq-len", t.seq_len, "Tokens per sequence (must match the data)")
      ->capture_default_str();
  c->add_option("--max-predictions", t.max_predictions,
                "Masked LM predictions per sequence (must match the data)")
      ->capture_default_str();
  c->add_option("--steps", t.steps, "Optimizer steps in total")->capture_default_str();
  c->add_option("--accumulation-steps", t.accumulation, "Micro-batches per optimizer step")
      ->capture_default_str();
  add_attention_option(c, o->attention);
  add_recompute_option(c, o->recompute);
  add_padding_option(c, o->padding);
  add_graphs_option(c, o->graphs);
  add_device_option(c, o->device);
  c->add_option("--pack", o->pack,
                "Pack instances (MLPerf's packing, for short sequences): a batch is the instances "
                "that fit into --batch-size rows of --seq-len tokens, at most N a row (3: "
                "MLPerf's); each instance keeps its own positions and attends to itself only. "
                "0: a batch is --batch-size instances; auto: --autotune chooses N of 2, 3, 4 by "
                "real tokens/s. Runs unpadded")
      ->capture_default_str();
  c->add_flag("--autotune", t.autotune,
              "Before the first step, time steps of a throwaway copy of the model with each "
              "attention kernel, fewer compute threads and (several ranks) other bucket sizes, and "
              "train with the fastest; printed, and kept in the checkpoints for --resume");
  c->add_option("--precision", o->precision, "fp32, bf16 or fp16 (fp16: dynamic loss scaling)")
      ->capture_default_str();
  c->add_option("--optimizer", o->optimizer, "lamb or adamw")->capture_default_str();
  c->add_option("--lr", t.lr, "Peak learning rate")->capture_default_str();
  c->add_option("--warmup", t.warmup, "Warmup: a fraction of --steps (< 1) or a number of steps")
      ->capture_default_str();
  c->add_option("--end-lr", t.end_lr, "Learning rate at the last step")->capture_default_str();
  c->add_option("--decay-power", t.power, "Polynomial decay power (1: linear)")
      ->capture_default_str();
  c->add_option("--weight-decay", t.optimizer.weight_decay,
                "Decoupled weight decay (not on LayerNorm/biases)")
      ->capture_default_str();
  c->add_option("--max-grad-norm", t.optimizer.max_grad_norm,
                "Global gradient-norm clipping (0: off)")
      ->capture_default_str();
  c->add_option("--seed", t.seed, "Seed for init, dropout, data order")->capture_default_str();
  c->add_option("--save-every", t.save_every, "Checkpoint every N steps (and always at the end)")
      ->capture_default_str();
  c->add_option("--keep-last", t.keep_last, "Checkpoints kept (0: all)")->capture_default_str();
  c->add_option("--log-every", t.log_every, "Progress line every N steps")->capture_default_str();
  c->add_flag("--resume", t.resume, "Continue from the latest checkpoint in --output");
  c->add_option("--overlap", t.overlap,
                "With several ranks: allreduce gradient buckets while backward runs")
      ->capture_default_str();
  c->add_option("--bucket-mb", t.bucket_mb, "Gradient bucket size for the overlap (MiB)")
      ->capture_default_str();
  c->add_flag("--shard-optimizer", t.shard_optimizer,
              "ZeRO stage 1: each of the ranks holds 1/ranks of the optimizer state; gradients "
              "are reduce-scattered and updated parameters all-gathered (the same bytes as the "
              "allreduce); in bf16 on CPUs each rank holds 1/ranks of the fp32 master weights "
              "too. Checkpoints hold the shards; --resume works with or without it");
  c->add_option("--timeline", t.timeline,
                "Write a Chrome trace (Perfetto) of the run, all ranks in one file");
  c->add_option("--trace-input", t.trace_input,
                "Append 'step epoch fingerprint' for every example each rank trains on to "
                "FILE.rank-R (an audit of the data a run, or a resumed run, read)");
  c->add_option("--stop-after-steps", t.stop_after,
                "Run at most N steps now, checkpoint and exit 0 (time-sliced jobs)")
      ->capture_default_str();
  c->add_option("--gradient-predivide-factor", t.predivide,
                "Scale gradients by 1/f before the allreduce and f/ranks after (1: sum then "
                "divide; ranks: divide then sum)")
      ->capture_default_str();
  c->add_option("--max-skipped-steps", t.max_skipped_steps,
                "fp16: consecutive skipped steps before giving up")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "Compute threads per rank (0: OpenMP default)")
      ->capture_default_str();
  add_pipeline_options(c, t.input, o->on_corrupt);
  add_dist_options(c);
  c->callback([o, comm] {
    train::install_signal_handlers();  // first: before any thread exists
    set_threads(o->threads);
    train::TrainConfig cfg = o->cfg;
    if (data::is_object_url(cfg.output)) {
      cfg.publish_to = cfg.output;
      cfg.output = o->stage_dir.empty() ? train::default_stage_dir(cfg.output) : o->stage_dir;
    } else if (!o->stage_dir.empty()) {
      fail("--stage-dir stages an s3:// or oss:// --output; ", cfg.output, " is a directory");
    }
    cfg.precision = parse_precision(o->precision);
    model::ModelDims d;
    d.attention = model::parse_attention(o->attention);
    apply_recompute(o->recompute, d);
    cfg.attention = d.attention;
    cfg.recompute_layers = d.recompute_layers;
    if (o->pack == "auto") {
      if (!cfg.autotune)
        fail("--pack auto is chosen by --autotune: add --autotune, or give the instances a row");
      cfg.autotune_pack = true;
      cfg.input.pack_per_row = 4;  // the most autotune tries (the memory plan of --batch-size auto)
    } else {
      size_t used = 0;
      try {
        cfg.input.pack_per_row = std::stoll(o->pack, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != o->pack.size() || cfg.input.pack_per_row < 0)
        fail("--pack must be a number of instances a row (0: no packing) or auto, got '", o->pack,
             "'");
    }
    // (Packing runs unpadded: --padding auto skips the padding where it packs.)
    cfg.unpadded = (cfg.input.pack_per_row > 0 && o->padding == "auto") ||
                   parse_padding(o->padding, device_target(o->device), d.attention, cfg.precision);
    if (cfg.input.pack_per_row > 0 && !cfg.unpadded)
      fail(
          "--pack runs unpadded (each instance on its own tokens): it does not go with "
          "--padding compute");
    cfg.optimizer.kind = train::parse_optimizer(o->optimizer);
    cfg.graphs = model::parse_graph_mode(o->graphs);
    cfg.input.on_corrupt = parse_on_corrupt(o->on_corrupt);
    cfg.backend = &device_backend(o->device);
    comm::Communicator& c = gradient_communicator(*cfg.backend, comm());
    choose_batch(cfg, *o, c);
    train::Trainer trainer(cfg, c);
    auto print = [&](const std::string& text) {
      if (c.rank() != 0) return;
      std::fputs(text.c_str(), stdout);
      std::fflush(stdout);
    };
    print(trainer.banner());
    trainer.run();
    print(trainer.summary());
  });
}

void add_eval(CLI::App& app, comm::Communicator& (*comm)()) {
  struct Opts {
    std::string checkpoint, data, model_config, precision = "fp32", device = "cpu";
    int64_t batch = 32, seq = 128, preds = 20, max_batches = 0;
    int threads = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("eval",
                               "Masked LM and next-sentence metrics of a checkpoint on TFRecords");
  c->add_option("--checkpoint", o->checkpoint,
                "Run directory (its latest checkpoint) or checkpoint/HF directory")
      ->required();
  c->add_option("--data", o->data, "Evaluation TFRecords: glob(s), s3:// or oss:// too")
      ->required();
  add_storage_options(c);
  c->add_option("--batch-size", o->batch, "Sequences per batch")->capture_default_str();
  c->add_option("--seq-len", o->seq, "Tokens per sequence (must match the data)")
      ->capture_default_str();
  c->add_option("--max-predictions", o->preds, "Masked LM predictions per sequence")
      ->capture_default_str();
  c->add_option("--max-batches", o->max_batches, "Stop after N batches (0: all data)")
      ->capture_default_str();
  c->add_option("--precision", o->precision, "fp32, bf16 or fp16, as in train")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "Compute threads (0: OpenMP default)")
      ->capture_default_str();
  add_device_option(c, o->device);
  add_dist_options(c);
  c->callback([o, comm] {
    set_threads(o->threads);
    const kernels::Backend& be = device_backend(o->device);
    use_rank_gpu(be, comm());  // (eval's sums are the host's: MPI takes them)
    std::string dir = train::resolve_checkpoint(o->checkpoint);
    if (dir.empty()) fail("no checkpoint in ", o->checkpoint);
    const model::BertConfig cfg = model::BertConfig::load(model::checkpoint_config_path(dir));
    model::ModelDims dims{o->batch, o->seq, o->preds};
    dims.unpadded = true;  // the padded model's metrics, at the real tokens' cost
    dims = train::with_precision(dims, parse_precision(o->precision));
    plan::check_device_fits(cfg, model::Head::Pretraining, dims, 0, 1, be);
    model::BertModel m(cfg, model::Head::Pretraining, dims, be);
    model::load_safetensors_into(m, model::checkpoint_weights_path(dir));
    const train::EvalResult r = train::evaluate(m, o->data, o->batch, o->max_batches, comm());
    if (comm().rank() == 0)
      std::printf(
          "eval %s on %s: %lld examples, %lld predictions\n  masked LM loss %.4f, accuracy %.4f\n"
          "  next sentence loss %.4f, accuracy %.4f\n",
          dir.c_str(), o->data.c_str(), (long long)r.examples, (long long)r.predictions, r.mlm_loss,
          r.mlm_accuracy, r.nsp_loss, r.nsp_accuracy);
    // Evaluating a run directory: the metrics join its TensorBoard events (at the checkpoint's
    // step, beside the training curves) and its eval.jsonl.
    const std::filesystem::path run(o->checkpoint);
    if (comm().rank() == 0 && std::filesystem::exists(run / "latest")) {
      std::ifstream st(std::filesystem::path(dir) / "trainer_state.json");
      const nlohmann::json j = nlohmann::json::parse(st, nullptr, false);
      const int64_t step = j.is_object() && j.contains("step") ? j["step"].get<int64_t>() : 0;
      const obs::Scalars values = {{"eval/mlm_loss", r.mlm_loss},
                                   {"eval/mlm_accuracy", r.mlm_accuracy},
                                   {"eval/nsp_loss", r.nsp_loss},
                                   {"eval/nsp_accuracy", r.nsp_accuracy}};
      obs::EventWriter(run.string()).scalars(step, values);
      obs::MetricsLog(run.string(), -1, "eval.jsonl")
          .write(step, values, {{"data", o->data}, {"examples", r.examples}});
      std::printf("  at step %lld: TensorBoard events and eval.jsonl in %s\n", (long long)step,
                  run.c_str());
    }
  });
}

}  // namespace bertrain::cli
