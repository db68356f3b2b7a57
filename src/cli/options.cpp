// The CLI's shared pieces: option helpers the subcommands register and parse (--attention,
// --recompute, --padding, --device, byte sizes, the distributed options) and the process's
// communicators (the job's: MPI under an MPI launcher; the gradients': NCCL for GPUs).
#include <omp.h>

#include <algorithm>
#include <fstream>
#include <memory>

#include "cli/commands.h"
#include "comm/gpu_placement.h"
#include "comm/launcher.h"
#include "comm/mpi.h"
#include "comm/nccl.h"
#include "core/error.h"

namespace bertrain::cli {

model::Head parse_head(const std::string& s) {
  if (s == "pretraining") return model::Head::Pretraining;
  if (s == "classification") return model::Head::SequenceClassification;
  if (s == "token-classification") return model::Head::TokenClassification;
  if (s == "question-answering") return model::Head::QuestionAnswering;
  fail(
      "--head must be pretraining, classification, token-classification or question-answering, got "
      "'",
      s, "'");
}

void add_shape_options(CLI::App* c, ShapeOpts& s, const char* batch_help) {
  c->add_option("--model-config", s.config, "HuggingFace config.json of the model")->required();
  c->add_option("--batch-size", s.batch, batch_help)->capture_default_str();
  c->add_option("--seq-len", s.seq, "Tokens per sequence")->capture_default_str();
  c->add_option("--max-predictions", s.preds, "Masked LM predictions per sequence")
      ->capture_default_str();
  c->add_option("--head", s.head,
                "pretraining, classification, token-classification or question-answering")
      ->capture_default_str();
}

void add_attention_option(CLI::App* c, std::string& attention) {
  c->add_option("--attention", attention,
                "auto, full or blocked attention kernel (auto: blocked from 512 tokens, but on a "
                "GPU in bf16/fp16 full up to 512, its products on the tensor cores; blocked keeps "
                "only the row log-sum-exp, no [B,heads,T,T] probabilities, and on a GPU in "
                "bf16/fp16 runs fused: 2 kernels a layer, every sequence length in one launch)")
      ->capture_default_str();
}

void add_recompute_option(CLI::App* c, std::string& recompute) {
  c->add_option("--recompute", recompute,
                "none, attention (the blocked attention kernel: backward recomputes the "
                "probabilities from the row log-sum-exp) or layer (each encoder layer keeps only "
                "its output; backward recomputes its forward: one more encoder forward per step)")
      ->capture_default_str();
}

void add_padding_option(CLI::App* c, std::string& padding) {
  c->add_option("--padding", padding,
                "skip: each sequence runs on its real tokens (pretraining, sequence and token "
                "classification; question answering always computes the padding, which its loss "
                "reads); compute: every sequence padded to --seq-len, as HF runs it; auto: skip, "
                "but on a GPU compute unless the attention runs fused (--attention blocked in "
                "bf16 or fp16), where the full kernel would run a call per length")
      ->capture_default_str();
}

void add_graphs_option(CLI::App* c, std::string& graphs) {
  c->add_option("--cuda-graphs", graphs,
                "On a GPU, each step's forward, backward and optimizer update launched as CUDA "
                "graphs, captured at the first steps (one a kind and input slot) and replayed: "
                "three launches for what are hundreds, the step's dropout keys, loss divisor and "
                "learning rate read by the kernels. Forward and backward for pretraining and "
                "fine-tuning: padded batches, "
                "and with the padding skipped or packed where the attention runs "
                "fused (--attention blocked in bf16 or fp16; the rows rounded up to one of 64 "
                "buckets of the planned rows, a graph each), kernel by kernel elsewhere; the "
                "update for every model. auto: on, and back to kernel by kernel with a note "
                "should a capture fail; on: a failed capture is an error; off")
      ->capture_default_str();
}

bool parse_padding(const std::string& padding, const kernels::Target& target,
                   model::ModelDims::Attention attention, Precision precision) {
  if (padding == "skip") return true;
  if (padding == "compute") return false;
  if (padding == "auto")
    return target.host_memory() ||
           (attention == model::ModelDims::Attention::Blocked && precision != Precision::FP32);
  fail("--padding must be auto, skip or compute, got '", padding, "'");
}

void apply_recompute(const std::string& recompute, model::ModelDims& d) {
  if (recompute == "none") return;
  if (recompute == "layer") {
    d.recompute_layers = true;
  } else if (recompute == "attention") {
    if (d.attention == model::ModelDims::Attention::Full)
      fail(
          "--recompute attention is the blocked attention kernel; it cannot go with --attention "
          "full");
    d.attention = model::ModelDims::Attention::Blocked;
  } else {
    fail("--recompute must be none, attention or layer, got '", recompute, "'");
  }
}

double parse_bytes(const std::string& s) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (...) {
    fail("--memory-budget '", s, "' is not a size (e.g. 16GiB, 512MiB)");
  }
  std::string unit = s.substr(pos);
  if (unit.empty() || unit == "B") return v;
  if (unit == "KiB" || unit == "K") return v * 1024;
  if (unit == "MiB" || unit == "M") return v * 1024 * 1024;
  if (unit == "GiB" || unit == "G") return v * 1024 * 1024 * 1024;
  fail("--memory-budget unit '", unit, "' is not one of B, KiB, MiB, GiB");
}

double available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (in >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024;
    in.ignore(256, '\n');
  }
  fail("cannot read MemAvailable from /proc/meminfo: pass --memory-budget");
}

void set_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

double input_bound(data::PipelineOptions in, int64_t batch, int64_t seq_len, int64_t predictions,
                   const model::BertConfig& c) {
  in.batch_size = batch;
  return static_cast<double>(data::Pipeline::memory_bound(
      in, data::Schema::pretraining(seq_len, predictions, c.vocab_size, c.type_vocab_size)));
}

std::string describe(const model::BertConfig& c) {
  return str("L", c.num_hidden_layers, " H", c.hidden_size, " A", c.num_attention_heads, " I",
             c.intermediate_size, " V", c.vocab_size);
}

namespace {
// The process's communicator, created on first use: MPI when an MPI launcher started us.
std::unique_ptr<comm::Communicator> g_comm;
DistOptions g_dist;
}  // namespace

comm::Communicator* existing_communicator() {
  return g_comm.get();
}

void release_communicator() {
  g_comm.reset();
}

comm::Communicator& communicator() {
  if (!g_comm) {
    if (comm::launched_by_mpi()) {
      auto mpi = std::make_unique<comm::MpiCommunicator>(nullptr, nullptr);
      mpi->set_algorithm(comm::parse_algorithm(g_dist.allreduce));
      mpi->set_wire(comm::parse_wire(g_dist.compression));
      mpi->set_stall_timeout(g_dist.stall_timeout);
      g_comm = std::move(mpi);
    } else {
      g_comm = std::make_unique<comm::SingleProcess>();
    }
    // What the launcher started against what MPI sees, and against the job spec's shape.
    const comm::Communicator& c = *g_comm;
    const comm::LauncherEnv env = comm::launcher_env();
    comm::check_launcher_agrees(env, c.rank(), c.size(), c.local_rank(), c.local_size());
    if (const char* job = std::getenv("BERTRAIN_JOB"))
      comm::check_job_shape(job, env, c.size(), c.local_size());
  }
  return *g_comm;
}

comm::Communicator& gradient_communicator(const kernels::Backend& be, comm::Communicator& job) {
  if (job.size() == 1) return job;
  if (be.host_memory()) {
    const auto* mpi = dynamic_cast<const comm::MpiCommunicator*>(&job);
    if (mpi && comm::parse_wire(g_dist.compression) != Precision::FP32 && !mpi->wire_in_use())
      bertrain::fail("--compression ", g_dist.compression,
                     " would do nothing: all ranks are on one node, where the ", g_dist.allreduce,
                     " allreduce reads the other ranks' memory and sends nothing over a wire; "
                     "drop --compression, or pass --allreduce ring to compress between ranks");
    return job;
  }
  if (g_dist.allreduce != "auto")
    fail("--allreduce chooses the MPI allreduce of host memory; the ", be.name(),
         " backend's gradients go through NCCL, whose algorithms NCCL_ALGO chooses: drop it");
  static std::unique_ptr<comm::Communicator> nccl;
  if (!nccl)
    nccl = comm::make_nccl_communicator(job, g_dist.stall_timeout,
                                        comm::parse_wire(g_dist.compression));
  return *nccl;
}

void use_rank_gpu(const kernels::Backend& be, const comm::Communicator& job) {
  if (!be.host_memory() && job.local_size() > 1) kernels::select_gpu(comm::rank_gpu(job));
}

void add_dist_options(CLI::App* c) {
  c->add_option(
       "--allreduce", g_dist.allreduce,
       "Allreduce algorithm under mpirun: auto (shm within a node, hierarchical across nodes), "
       "shm, ring, hierarchical or mpi")
      ->capture_default_str();
  c->add_option(
       "--compression", g_dist.compression,
       "Precision compression for ring/hierarchical (and NCCL between GPUs): none, fp16, bf16")
      ->capture_default_str();
  c->add_option("--stall-timeout", g_dist.stall_timeout,
                "Abort all ranks when a collective waits this long (s)")
      ->capture_default_str();
}

}  // namespace bertrain::cli
