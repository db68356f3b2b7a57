// The CLI as a user runs it: --help everywhere, exit codes, one-line errors that say what to do.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"

namespace {

using bertrain::test::data_path;
using bertrain::test::TempDir;

struct RunResult {
  int rc;
  std::string out;
};

RunResult run(const std::string& args) {
  std::string cmd = std::string(BERTRAIN_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// --version names the build (version, commit, build type), the kernels' instruction sets, the
// CUDA build and the libraries this process runs with, one line each.
TEST(Cli, VersionNamesTheBuildAndItsLibraries) {
  RunResult r = run("--version");
  EXPECT_EQ(r.rc, 0) << r.out;
  for (const char* want :
       {"bertrain 0.1.0 (commit ", " build)\n", "\n  kernels  avx512, avx2 and", "this CPU ",
        "\n  CUDA     ", "\n  oneDNN   ", "\n  MPI      ", "\n  NCCL     "})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << " in\n" << r.out;
  EXPECT_EQ(r.out.find("unknown (not a git checkout)"), std::string::npos) << r.out;
}

TEST(Cli, HelpForEverySubcommand) {
  RunResult r = run("--help");
  EXPECT_EQ(r.rc, 0);
  for (const char* sub : {"estimate", "init", "inspect", "bench", "bench-input", "prepare",
                          "tokenize", "report", "doctor", "convert"}) {
    EXPECT_NE(r.out.find(sub), std::string::npos) << sub;
    RunResult s = run(std::string(sub) + " --help");
    EXPECT_EQ(s.rc, 0) << sub;
    EXPECT_NE(s.out.find("Usage"), std::string::npos) << s.out;
  }
  EXPECT_NE(run("").rc, 0);  // a subcommand is required
}

TEST(Cli, EstimatePrintsPlanAndBatchForBudget) {
  RunResult r = run("estimate --model-config " + data_path("../configs/bert-base.json") +
                    " --batch-size 8 --memory-budget 8GiB");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("110.1M parameters"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("largest batch size that fits is"), std::string::npos) << r.out;
}

// --device cuda plans a GPU run where there is no GPU: the arenas in device memory with the
// CUDA kernels' scratch (cuBLASLt's 32 MiB workspace among it) and the staged batch, full
// attention at 512 tokens in bf16 (the GPU's auto; the CPU's is blocked there); the largest
// batch for a GPU's memory.
TEST(Cli, EstimatePlansAGpuRunWithoutAGpu) {
  const std::string base = "estimate --model-config " + data_path("../configs/bert-base.json") +
                           " --batch-size 8 --precision bf16 --seq-len 512 --max-predictions 80";
  RunResult r = run(base + " --device cuda --memory-budget 16GiB");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* want :
       {"full attention", "memory plan per rank, in the cuda device's memory", "  input   ",
        "besides the plan: the CUDA context", "largest batch size that fits is"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  r = run(base + " --device cuda --explain");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("cuBLASLt's workspace, attention's buffers"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the batch, its embedding groups"), std::string::npos) << r.out;
  const RunResult cpu = run(base + " --memory-budget 16GiB");
  ASSERT_EQ(cpu.rc, 0) << cpu.out;
  EXPECT_NE(cpu.out.find("blocked attention"), std::string::npos) << cpu.out;
  EXPECT_EQ(cpu.out.find("  input   "), std::string::npos) << cpu.out;
  r = run(base + " --device tpu");
  EXPECT_NE(r.out.find("--device must be cpu, cuda or auto, got 'tpu'"), std::string::npos)
      << r.out;
  // bf16 with the optimizer sharded: on a GPU the optimizer state alone (its arenas have no
  // unbacked pages for a sharded fp32 master), on the CPU the master too.
  r = run(base + " --device cuda --shard-optimizer --ranks 8");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("sharded over 8 ranks, full attention"), std::string::npos) << r.out;
  r = run(base + " --device cuda --attention blocked");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("blocked attention"), std::string::npos) << r.out;
  r = run(base + " --shard-optimizer --ranks 8");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("sharded over 8 ranks with the fp32 master weights"), std::string::npos)
      << r.out;
}

// --device cuda --explain adds the traffic model (plan/traffic.h; checked kernel by kernel
// against the emulated device in CudaCounts.TheBytesEachKernelTouchesAreTheModels): BERT-Large's
// step at 128 tokens in bf16, its kernels with their launches, bytes and products, the step's
// totals (723 launches: 28 a layer and the embeddings', heads' and update's 51; an H200 counted
// 894 on real data with 35 a layer, and the [MASK] row of real data adds an
// embedding_sums_kernel launch) and the time they predict on an H200; with forward and backward
// as CUDA graphs (--cuda-graphs auto, train's default) 773: the graphs make the attention's
// pointer tables each launch (48) and launch the embedding tables' sums kernels whatever the
// batch (2 more). A head it does not model says so.
TEST(Cli, EstimateExplainsTheGpuStepsTraffic) {
  const std::string base = "estimate --model-config " + data_path("../configs/bert-large.json") +
                           " --batch-size 32 --precision bf16 --device cuda --explain";
  RunResult r = run(base + " --optimizer adamw --cuda-graphs off");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* want :
       {"GPU traffic model (bf16)", "cublasLtMatmul", "attention_softmax_kernel",
        "layernorm_backward_kernel", "adamw_many_kernel", "cudaMemsetAsync",
        "step: 723 launches (memsets apart)", "predicted on cuBLASLt measured on an H200"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  EXPECT_EQ(r.out.find("pair_pointers_kernel"), std::string::npos) << r.out;
  r = run(base + " --optimizer adamw");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* want : {"step: 773 launches (memsets apart)", "pair_pointers_kernel"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  r = run(base + " --attention blocked");  // (fused, and train's LAMB)
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* want : {"attention_forward_fused", "attention_backward_fused",
                           "lamb_moments_many_kernel", "lamb_apply_many_kernel"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  EXPECT_EQ(r.out.find("attention_softmax_kernel"), std::string::npos) << r.out;
  r = run(base + " --head classification");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("traffic model: covers the pretraining step's"), std::string::npos) << r.out;
  r = run(base + " --optimizer sgd");
  EXPECT_NE(r.out.find("--optimizer must be lamb or adamw, got 'sgd'"), std::string::npos) << r.out;
}

TEST(Cli, ErrorsAreOneLineWithTheCause) {
  RunResult r = run("estimate --model-config /nonexistent.json");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("bertrain: error: cannot open model config /nonexistent.json"),
            std::string::npos)
      << r.out;
  r = run("estimate --model-config " + data_path("../configs/bert-base.json") + " --seq-len 1024");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("exceeds the model's max_position_embeddings 512"), std::string::npos)
      << r.out;
  r = run("estimate --model-config " + data_path("../configs/bert-base.json") +
          " --attention flash");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--attention must be auto, full or blocked, got 'flash'"), std::string::npos)
      << r.out;
}

// --device: a GPU that cannot be had is named as such (this build without the CUDA backend, or
// the CUDA build on a machine without a GPU), and auto falls back to the CPU.
TEST(Cli, DeviceSaysWhyNoGpu) {
  const std::string bench = "bench --model-config " + data_path("../configs/bert-tiny.json") +
                            " --batch-size 2 --seq-len 16 --max-predictions 2 --steps 1 "
                            "--warmup 0 --device ";
  RunResult r = run(bench + "gpu");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--device must be cpu, cuda or auto, got 'gpu'"), std::string::npos)
      << r.out;
  r = run(bench + "cuda");
  const bool named = r.out.find("built without the CUDA backend") != std::string::npos ||
                     r.out.find("no CUDA device is visible") != std::string::npos;
  // (a machine with a GPU and a CUDA build runs it: then it must succeed on the GPU)
  if (r.rc == 0)
    EXPECT_NE(r.out.find("gpu "), std::string::npos) << r.out;
  else
    EXPECT_TRUE(named) << r.out;
  r = run(bench + "auto");
  EXPECT_EQ(r.rc, 0) << r.out;
}

TEST(Cli, InitThenInspectRoundTrip) {
  TempDir tmp;
  RunResult r = run("init --model-config " + data_path("../configs/bert-tiny.json") + " --output " +
                    tmp.path.string() + " --seed 3 --dtype BF16");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = run("inspect " + tmp.path.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("bert.embeddings.word_embeddings.weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("loads as BertForPreTraining"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("0 tensors with non-finite values"), std::string::npos) << r.out;
}

// Extractive QA as a user runs it: fine-tune on SQuAD's JSON, predict answers (one JSON line per
// question, scored when the file has answers), inspect the saved model.
TEST(Cli, QuestionAnsweringFinetunePredictInspect) {
  TempDir tmp;
  const std::string init = (tmp.path / "init").string(), qa = (tmp.path / "qa").string();
  const std::string squad = data_path("data/tasks/squad_v1.1_tiny.json");
  RunResult r =
      run("init --model-config " + data_path("../configs/bert-tiny.json") + " --output " + init);
  ASSERT_EQ(r.rc, 0) << r.out;
  r = run(
      "finetune --init-checkpoint " + init + " --vocab " +
      data_path("../data/vocab/bert-base-uncased-vocab.txt") + " --task squad --train " + squad +
      " --dev " + squad +
      " --seq-len 64 --max-query-length 16 --doc-stride 16 --epochs 1 --batch-size 8 --output " +
      qa);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("5 questions -> 19 windows of 64 tokens (doc stride 16"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("dev EM"), std::string::npos) << r.out;
  r = run("predict --checkpoint " + qa + " --input " + squad);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 6) << r.out;  // 5 answers + scores
  EXPECT_NE(r.out.find("\"id\":\"5733be284776f41900661182\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("predict: exact match"), std::string::npos) << r.out;
  r = run("inspect " + qa + "/model.safetensors");
  EXPECT_NE(r.out.find("loads as BertForQuestionAnswering"), std::string::npos) << r.out;
  r = run("prepare --task squad --input " + squad + " --vocab " +
          data_path("../data/vocab/bert-base-uncased-vocab.txt") + " --output " +
          (tmp.path / "tf").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("fine-tuned from its own files"), std::string::npos) << r.out;
}

// --batch-size auto picks the largest micro-batch whose memory plan fits the budget (the same
// number estimate prints), --global-batch keeps a step's sequences with accumulation, and
// --recompute layer shows in the banner.
TEST(Cli, TrainPicksTheBatchThatFits) {
  TempDir tmp;
  const std::string base =
      "train --model-config " + data_path("../configs/bert-tiny.json") + " --data " +
      data_path("data/tfrecord/bert_pretrain_sample_text.tfrecord") + " --steps 1 --output ";
  RunResult r = run("estimate --model-config " + data_path("../configs/bert-tiny.json") +
                    " --memory-budget 300MiB --recompute layer");
  ASSERT_EQ(r.rc, 0) << r.out;
  const size_t at = r.out.find("largest batch size that fits is ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string fit = r.out.substr(at + 32, r.out.find('\n', at) - at - 32);
  r = run(base + (tmp.path / "a").string() +
          " --batch-size auto --memory-budget 300MiB --recompute layer --global-batch 96");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("batch auto: " + fit + " sequences of 128 tokens per rank fit 300.0 MiB"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("= 96 sequences per step"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layers recomputed in backward"), std::string::npos) << r.out;
  r = run(base + (tmp.path / "b").string() + " --batch-size auto --memory-budget 1MiB");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("not even one sequence of 128 tokens fits"), std::string::npos) << r.out;
  r = run(base + (tmp.path / "c").string() + " --batch-size lots");
  EXPECT_NE(r.out.find("--batch-size must be a number or auto"), std::string::npos) << r.out;
}

// launch: the job's flags are checked against the command's own, and --run trains on 2 ranks.
TEST(Cli, LaunchChecksFlagsAndRuns) {
  TempDir tmp;
  const std::string job = (tmp.path / "job.yaml").string();
  std::ofstream(job) << "name: two\nslots_per_worker: 2\nenv: {OMP_NUM_THREADS: 1}\n"
                     << "command: train\nflags:\n  model-config: "
                     << data_path("../configs/bert-tiny.json") << "\n  data: "
                     << data_path("data/tfrecord/bert_pretrain_sample_text.tfrecord")
                     << "\n  output: " << (tmp.path / "run").string()
                     << "\n  batch-size: 2\n  steps: 2\n  log-every: 1\n";
  RunResult r = run("launch " + job + " --emit slurm");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("#SBATCH --ntasks-per-node=2"), std::string::npos) << r.out;
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);  // mpirun refuses root without them
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  r = run("launch " + job + " --run");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("2 ranks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step      2/2"), std::string::npos) << r.out;
  std::ofstream(job, std::ios::app) << "  batch-szie: 3\n";
  r = run("launch " + job + " --emit mpirun");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("flags.batch-szie: not a flag of `bertrain train`"), std::string::npos)
      << r.out;
}

TEST(Cli, InspectHuggingFaceCheckpointAndCorruptFile) {
  RunResult r = run("inspect " + data_path("golden/bert_cls"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("loads as BertForSequenceClassification"), std::string::npos) << r.out;
  TempDir tmp;
  std::ofstream(tmp / "bad.safetensors") << std::string("\x10\0\0\0\0\0\0\0{{{{", 12);
  r = run("inspect " + tmp / "bad.safetensors");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("bertrain: error:"), std::string::npos) << r.out;
}

TEST(Cli, InspectAndConvertATensorFlowCheckpoint) {
  const std::string tf = data_path("data/tf_checkpoint/keras_bert_tiny");
  RunResult r = run("inspect " + tf);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("TensorFlow checkpoint, 139 variables"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cls/predictions/output_bias"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cls.predictions.bias"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(optimizer slot)"), std::string::npos) << r.out;
  TempDir tmp;
  r = run("convert " + tf + "/bert_model.ckpt.index " + tmp / "hf");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("46 weights as BertForPreTraining"), std::string::npos) << r.out;
  r = run("inspect " + tmp / "hf");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("loads as BertForPreTraining"), std::string::npos) << r.out;
  r = run("convert " + data_path("golden/bert_cls") + " " + tmp / "x");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("is not a TensorFlow checkpoint"), std::string::npos) << r.out;
}

TEST(Cli, BenchRunsAStep) {
  RunResult r = run("bench --model-config " + data_path("../configs/bert-tiny.json") +
                    " --batch-size 2 --seq-len 16 --max-predictions 3 --steps 1 --warmup 0 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("\"tokens_per_s\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"padding\":\"skip\""), std::string::npos) << r.out;  // --padding auto, CPU
  // fp16 runs everywhere (fp32 kernels); the loss stays finite under the loss scale.
  r = run("bench --model-config " + data_path("../configs/bert-tiny.json") +
          " --batch-size 2 --seq-len 16 --max-predictions 3 --steps 1 --warmup 0 --precision fp16");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("fp16, full attention"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("loss       nan"), std::string::npos) << r.out;
  r = run("bench --model-config " + data_path("../configs/bert-tiny.json") + " --precision fp8");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--precision must be fp32, bf16 or fp16, got 'fp8'"), std::string::npos)
      << r.out;
}

// Prepared records with their padding: both modes on the same batches, each a JSON line with
// real and computed tokens/s (the unpadded run computes fewer rows for the same real tokens).
TEST(Cli, BenchOnPreparedDataSkipsThePadding) {
  const std::string args = "bench --model-config " + data_path("../configs/bert-tiny.json") +
                           " --data " +
                           data_path("data/tfrecord/bert_pretrain_sample_text.tfrecord") +
                           " --batch-size 4 --seq-len 128 --max-predictions 20 --steps 2 --json";
  RunResult r = run(args + " --padding both --pack 3");
  ASSERT_EQ(r.rc, 0) << r.out;
  std::vector<nlohmann::json> runs;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty() && line[0] == '{') runs.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(runs.size(), 3u) << r.out;
  EXPECT_EQ(runs[0]["padding"], "compute");
  EXPECT_EQ(runs[1]["padding"], "skip");
  EXPECT_EQ(runs[2]["padding"], "packed");
  EXPECT_EQ(runs[1]["instances_per_step"], 4.0);
  // Packed rows: at least as many instances a step, the rows at least as full.
  EXPECT_GE(runs[2]["instances_per_step"].get<double>(), 4.0);
  EXPECT_GE(runs[2]["real_token_fraction"].get<double>(),
            runs[1]["real_token_fraction"].get<double>() - 1e-9);
  const double real = runs[1]["real_token_fraction"].get<double>();
  EXPECT_GT(real, 0.3);
  EXPECT_LT(real, 1.0) << "the sample's records have padding";
  EXPECT_EQ(runs[0]["real_token_fraction"], runs[1]["real_token_fraction"]);  // the same batches
  // Padded: every position computed; unpadded: the real ones, rounded up to 64 rows a batch.
  EXPECT_NEAR(runs[0]["computed_tokens_per_s"].get<double>() * real,
              runs[0]["tokens_per_s"].get<double>(), 1e-6 * runs[0]["tokens_per_s"].get<double>());
  EXPECT_GT(runs[1]["computed_tokens_per_s"].get<double>(), runs[1]["tokens_per_s"].get<double>());
  r = run(args + " --padding none");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--padding must be auto, skip or compute, got 'none'"), std::string::npos)
      << r.out;
  r = run(args + " --head classification");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--data takes pretraining records: it needs --head pretraining"),
            std::string::npos)
      << r.out;
  // Packing runs unpadded: train refuses it with --padding compute; auto needs --autotune.
  const std::string train = "train --model-config " + data_path("../configs/bert-tiny.json") +
                            " --data " +
                            data_path("data/tfrecord/bert_pretrain_sample_text.tfrecord") +
                            " --output /nonexistent --pack ";
  r = run(train + "3 --padding compute");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--pack runs unpadded (each instance on its own tokens): it does not go "
                       "with --padding compute"),
            std::string::npos)
      << r.out;
  r = run(train + "auto");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--pack auto is chosen by --autotune"), std::string::npos) << r.out;
  r = run(train + "x3");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("--pack must be a number of instances a row (0: no packing) or auto, got "
                       "'x3'"),
            std::string::npos)
      << r.out;
}

}  // namespace

namespace {

TEST(Cli, InspectTfRecordsAsJsonLinesAndVerifiesCrcs) {
  RunResult r = run("inspect " + data_path("data/tfrecord/torchdata_example.tfrecord"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("\"x_int\":{\"size\":10,\"type\":\"int64\",\"values\":[0,10,20"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("4 records"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("all CRCs ok"), std::string::npos) << r.out;
  r = run("inspect --count '" + data_path("data/tfrecord/*.tfrecord*") + "'");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("234 records"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gzip compression"), std::string::npos) << r.out;
  // Flip one byte inside the third record: exit 1 naming the file, record and offset.
  TempDir tmp;
  std::ifstream in(data_path("data/tfrecord/torchdata_example.tfrecord"), std::ios::binary);
  std::string bytes(std::istreambuf_iterator<char>(in), {});
  bytes[2 * 124 + 40] ^= 1;
  std::ofstream(tmp / "bad.tfrecord", std::ios::binary) << bytes;
  r = run("inspect " + tmp / "bad.tfrecord");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("bad.tfrecord: corrupt record 2 at byte 255: data CRC mismatch"),
            std::string::npos)
      << r.out;
  // inspect has no --on-corrupt: its advice must not name it.
  EXPECT_EQ(r.out.find("--on-corrupt"), std::string::npos) << r.out;
}

// A user-facing string never names something that does not exist.
TEST(Cli, UnknownCommandsAndHelpSayWhatExists) {
  for (const char* args : {"deploy", "deploy --help", "trian --steps 3"}) {
    RunResult r = run(args);
    EXPECT_EQ(r.rc, 2) << args;
    EXPECT_NE(r.out.find("bertrain: error: unknown command '"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("the commands are: estimate"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("A subcommand is required"), std::string::npos) << r.out;
  }
  RunResult r = run("--help");
  EXPECT_EQ(r.out.find("GPU"), std::string::npos) << r.out;  // no step runs on a GPU yet
  r = run("eval --help");
  EXPECT_EQ(r.out.find("Gradient allreduce"), std::string::npos) << r.out;
}

TEST(Cli, BenchInputReadsShards) {
  RunResult r =
      run("bench-input --data " + data_path("data/tfrecord/bert_pretrain_sample_text.tfrecord") +
          " --batch-size 8 --seconds 0.5 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("\"examples_per_s\""), std::string::npos) << r.out;
}

}  // namespace

namespace {

TEST(Cli, TokenizeAndPrepare) {
  RunResult r = run("tokenize --vocab " + data_path("../data/vocab/bert-base-uncased-vocab.txt") +
                    " 'Hello, unaffable World!'");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("tokens: hello , una ##ffa ##ble world !"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ids:    7592 1010 14477 20961 3468 2088 999"), std::string::npos) << r.out;
  TempDir tmp;
  r = run("prepare --input " + data_path("../data/corpus/bert_sample_text.txt") + " --vocab " +
          data_path("../data/vocab/bert-base-uncased-vocab.txt") + " --output " +
          tmp.path.string() + " --output-shards 2 --compression gzip --dupe-factor 2");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("to 2 file(s)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[MASK]"), std::string::npos) << r.out;
  r = run("inspect --count '" + tmp.path.string() + "/*.gz'");
  EXPECT_EQ(r.rc, 0) << r.out;
  r = run("prepare --input " + data_path("../data/corpus/bert_sample_text.txt") +
          " --vocab /nonexistent --output " + tmp.path.string());
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("cannot open vocabulary /nonexistent"), std::string::npos) << r.out;
}

}  // namespace
