// Subcommands of the bertrain CLI. Each add_* registers its options and callback on the app.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "comm/communicator.h"
#include "data/pipeline.h"
#include "model/bert.h"
#include "train/finetune.h"

namespace bertrain::cli {

void add_estimate(CLI::App& app);
void add_plan(CLI::App& app);
void add_init(CLI::App& app);
void add_inspect(CLI::App& app);
void add_convert(CLI::App& app);
void add_bench(CLI::App& app);
void add_bench_input(CLI::App& app);
void add_prepare(CLI::App& app);
void add_tokenize(CLI::App& app);
void add_train(CLI::App& app, comm::Communicator& (*comm)());
void add_eval(CLI::App& app, comm::Communicator& (*comm)());
void add_finetune(CLI::App& app, comm::Communicator& (*comm)());
void add_predict(CLI::App& app);
void add_launch(CLI::App& app);
void add_report(CLI::App& app);
void add_doctor(CLI::App& app, comm::Communicator& (*comm)());
void add_pipeline_options(CLI::App* c, data::PipelineOptions& p, std::string& on_corrupt);
// --s3-endpoint, --s3-region, --s3-addressing, --s3-retries, --s3-timeout (object storage).
void add_storage_options(CLI::App* c);
// --read-chunk and --read-ahead: the ranged reads of s3:// and oss:// input.
void add_read_ahead_options(CLI::App* c, data::PipelineOptions& p);
data::OnCorrupt parse_on_corrupt(const std::string& s);

struct DistOptions {
  std::string allreduce = "auto", compression = "none";
  double stall_timeout = 60;
};
void add_dist_options(CLI::App* c);  // --allreduce, --compression, --stall-timeout
// The process's communicator, made on first use: MPI when an MPI launcher started us (with the
// --allreduce, --compression and --stall-timeout given), else a single process.
comm::Communicator& communicator();
// That communicator if it was made (else null), and its end (MPI_Finalize) before exit.
comm::Communicator* existing_communicator();
void release_communicator();
// The communicator a model's gradients go through: the job's (MPI under mpirun) for a model in
// host memory; for a model on a GPU with several ranks, NCCL over the job's ranks (comm/nccl.h),
// made once, before the model allocates (it picks the rank's GPU).
comm::Communicator& gradient_communicator(const kernels::Backend& be, comm::Communicator& job);
// A GPU run with several ranks on a host: this rank's GPU (its local rank's) for what follows,
// as NCCL picks it (gradient_communicator does it too).
void use_rank_gpu(const kernels::Backend& be, const comm::Communicator& job);

// --task and the column flags (finetune, predict, prepare): a preset's columns, each overridden
// by its flag.
struct TaskOpts {
  std::string task, text_a, text_b, label;
  bool regression = false;
  tasks::TaskColumns columns() const;
};
void add_task_options(CLI::App* c, TaskOpts& t);

// bertrain --version: version, commit, build type, the kernels' ISAs, the CUDA build, and the
// oneDNN, MPI and NCCL this process runs with.
std::string version_text();

// Shared option helpers.
// --model-config, --batch-size, --seq-len, --max-predictions and --head: the model and batch a
// command plans or times (bench, estimate); the batch's default and help are the command's.
struct ShapeOpts {
  explicit ShapeOpts(int64_t default_batch) : batch(default_batch) {}
  int64_t batch;
  std::string config, head = "pretraining";
  int64_t seq = 128, preds = 20;
};
void add_shape_options(CLI::App* c, ShapeOpts& s, const char* batch_help);
// pretraining, classification, token-classification or question-answering
model::Head parse_head(const std::string& s);
void add_attention_option(CLI::App* c, std::string& attention);  // --attention auto|full|blocked
void add_device_option(CLI::App* c, std::string& device);        // --device cpu|cuda|auto
// The backend --device names (an error says why a GPU cannot be had: no CUDA backend in this
// build, or no GPU visible).
const kernels::Backend& device_backend(const std::string& device);
// What a memory plan for --device plans for (kernels/backend.h, Target): the CPU, or a GPU's
// backend where one is visible, else the CUDA backend's plan alone (estimate plans a GPU run
// on a machine without one).
const kernels::Target& device_target(const std::string& device);

void add_recompute_option(CLI::App* c, std::string& recompute);  // --recompute none|attention|layer
void add_padding_option(CLI::App* c, std::string& padding);      // --padding auto|skip|compute
void add_graphs_option(CLI::App* c, std::string& graphs);        // --cuda-graphs auto|on|off
// --padding's value as ModelDims::unpadded (skip: true) for a run on `target` with the attention
// and precision asked. auto skips the padding, but on a GPU only where attention runs fused
// (--attention blocked in bf16 or fp16): there the full kernel, auto's, runs a call per run of
// equal lengths, and BERT-Large on real lengths ran 0.61x as fast as with the padding computed
// on an H200 (docs/gpus.md).
bool parse_padding(const std::string& padding, const kernels::Target& target,
                   model::ModelDims::Attention attention, Precision precision);
// --recompute's value into the dims (after --attention): a layer slot, or the blocked kernel.
void apply_recompute(const std::string& recompute, model::ModelDims& d);
double parse_bytes(const std::string& s);          // "16GiB", "512MiB", "1e9" (--memory-budget)
double available_memory();                         // this host's MemAvailable, bytes
void set_threads(int threads);                     // 0 = leave OpenMP's default
std::string describe(const model::BertConfig& c);  // "L4 H256 A4 I1024 V30522"
// The input pipeline's memory bound for pretraining records of this model and shape with `in`
// at `batch` sequences (what a training rank holds besides its arenas, with the MPI window
// slot comm::kShmSlotBytes under several ranks).
double input_bound(data::PipelineOptions in, int64_t batch, int64_t seq_len, int64_t predictions,
                   const model::BertConfig& c);

}  // namespace bertrain::cli
