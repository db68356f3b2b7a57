// BertModel on the CUDA backend against BertModel on the CPU: its arenas in GPU memory, the
// parameters written from the host, the batch arrays copied per forward; the same losses and
// every gradient, in each precision, padded and unpadded, with dropout; and a checkpoint written
// from the GPU model loads into the CPU model bit for bit. Skips without a GPU.
// Tolerances: fp32 differs in summation order only: rtol 1e-4 / atol 1e-4 of each tensor's max
// after two layers of backward (the golden tests' bound against PyTorch is the same order);
// 16-bit paths round operands the other way where the two accumulate differently: 3e-2.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "core/rng.h"
#include "golden_check.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/cuda.h"
#include "loss_curve.h"
#include "model/bert.h"
#include "model/checkpoint.h"
#include "prep/prepare.h"
#include "test_util.h"
#include "train/finetune.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/step.h"
#include "train/trainer.h"

namespace bertrain {
namespace {

using model::BertModel;
using model::Head;
using model::ModelDims;

#define SKIP_WITHOUT_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine"

using StepRun = test::BackendStep;
constexpr auto step = test::backend_step;

// Every precision, padded and unpadded, with either attention kernel (the blocked one at 150
// tokens: a block of 128 query rows and one of 22).
TEST(CudaModel, ForwardBackwardEqualsCpu) {
  SKIP_WITHOUT_GPU();
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 160);
  const model::Batch short_batch = test::random_batch(c, 4, 32, 5),
                     long_batch = test::random_batch(c, 2, 150, 8);
  for (auto kernel : {ModelDims::Attention::Full, ModelDims::Attention::Blocked})
    for (int precision = 0; precision < 3; ++precision)
      for (bool unpadded : {false, true}) {
        const bool full = kernel == ModelDims::Attention::Full;
        const model::Batch& b = full ? short_batch : long_batch;
        ModelDims d{b.B, b.T, b.P};
        d.attention = kernel;
        d.unpadded = unpadded;
        d.precision = static_cast<Precision>(precision);            // 0 fp32, 1 bf16, 2 fp16
        if (d.bf16() && !kernels::gemm_bf16_available()) continue;  // no CPU reference here
        SCOPED_TRACE(testing::Message() << (full ? "full" : "blocked") << " precision " << precision
                                        << " unpadded " << unpadded);
        const StepRun cpu = step(kernels::cpu_backend(), c, Head::Pretraining, d, b);
        const StepRun gpu = step(cuda::cuda_backend(), c, Head::Pretraining, d, b);
        EXPECT_EQ(gpu.params, cpu.params);  // initialised on the host, copied
        const double tol = precision == 0 ? 1e-4 : 3e-2;
        EXPECT_NEAR(gpu.losses.loss, cpu.losses.loss, tol * std::fabs(cpu.losses.loss));
        EXPECT_NEAR(gpu.losses.mlm_loss, cpu.losses.mlm_loss, tol * std::fabs(cpu.losses.mlm_loss));
        EXPECT_NEAR(gpu.losses.nsp_loss, cpu.losses.nsp_loss, tol * std::fabs(cpu.losses.nsp_loss));
        // Per tensor, floored at a thousandth of the largest gradient (test::grads_close): the
        // attention key's exact gradient vanishes, and fp16's dS rounded on the GPU but not on the
        // CPU leaves noise there (the host's fp16 flow: up to 3000x a bound of its own max).
        EXPECT_TRUE(test::grads_close(model::ParamTable(c, Head::Pretraining), gpu.grads.data(),
                                      cpu.grads.data(), tol));
      }
}

// The other heads: sequence classification, token classification, question answering.
// HuggingFace's BertForPreTraining (tools/make_bert_golden.py, float64) on the GPU in fp32:
// outputs, losses and every gradient within the CPU model's golden bounds
// (test_model_golden.cpp), padded and unpadded, with either attention kernel.
TEST(CudaModel, MatchesTheHuggingFaceGoldens) {
  SKIP_WITHOUT_GPU();
  for (auto kernel : {ModelDims::Attention::Full, ModelDims::Attention::Blocked})
    for (bool unpadded : {false, true}) {
      SCOPED_TRACE(testing::Message() << (kernel == ModelDims::Attention::Full ? "full" : "blocked")
                                      << (unpadded ? " unpadded" : " padded"));
      ModelDims d;
      d.attention = kernel;
      d.unpadded = unpadded;
      model::golden::check_pretraining(cuda::cuda_backend(), d);
    }
}

TEST(CudaModel, TaskHeadsEqualCpu) {
  SKIP_WITHOUT_GPU();
  model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  c.num_labels = 3;
  model::Batch b = test::task_batch(c);
  for (Head head :
       {Head::SequenceClassification, Head::TokenClassification, Head::QuestionAnswering}) {
    SCOPED_TRACE(static_cast<int>(head));
    ModelDims d{b.B, b.T, b.P};
    d.attention = ModelDims::Attention::Full;
    const StepRun cpu = step(kernels::cpu_backend(), c, head, d, b);
    const StepRun gpu = step(cuda::cuda_backend(), c, head, d, b);
    EXPECT_NEAR(gpu.losses.loss, cpu.losses.loss, 1e-4 * std::fabs(cpu.losses.loss));
    EXPECT_TRUE(
        test::all_close("grads", gpu.grads.data(), cpu.grads.data(), cpu.grads.size(), 1e-4, 1e-4));
    // The head's loss and hits added on the device (StepOptions::device_sums) equal forward's
    // returned ones (the rows summed in a tree on the device instead of in order on the host).
    BertModel m(c, head, d, cuda::cuda_backend());
    m.init_params(5);
    const model::Losses l = m.forward(b, {});
    model::StepOptions dev;
    dev.device_sums = true;
    m.forward(b, dev);
    m.read_step_sums();
    const model::StepSums s = m.step_sums();
    EXPECT_NEAR(s.loss, l.loss, 1e-12 * std::fabs(l.loss));
    EXPECT_EQ(s.cls_correct, static_cast<double>(l.cls_correct));
  }
  // A regression's squared error added on the device (Backend::squared_error_into): the rows in
  // order, the host's bits.
  c.num_labels = 1;
  b.label_values = {0.5f, -1.0f, 2.0f, 0.0f};
  ModelDims d{b.B, b.T, b.P};
  d.attention = ModelDims::Attention::Full;
  BertModel m(c, Head::SequenceClassification, d, cuda::cuda_backend());
  m.init_params(5);
  const model::Losses l = m.forward(b, {});
  model::StepOptions dev;
  dev.device_sums = true;
  EXPECT_EQ(m.forward(b, dev).loss, 0.0) << "(the device's sums)";
  m.read_step_sums();
  EXPECT_EQ(m.step_sums().loss, l.loss);
  EXPECT_GT(l.loss, 0.0);
}

// 300 training steps (train::Step, AdamW, dropout on) on the GPU in fp32, bf16 and fp16 (fp16
// operands, the loss scaler on) against the CPU in fp32, a new batch every step
// (test::loss_curve): every step's loss within 2% of the CPU's (fp32: summation order only, the
// trajectories drift apart slowly; bf16 and fp16: their rounding) and the loss falls.
TEST(CudaModel, LossCurveTracksTheCpu) {
  SKIP_WITHOUT_GPU();
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const auto cpu = test::loss_curve(kernels::cpu_backend(), c, Precision::FP32, 300);
  for (auto p : {Precision::FP32, Precision::BF16, Precision::FP16}) {
    const char* name = p == Precision::FP32 ? "fp32" : p == Precision::BF16 ? "bf16" : "fp16";
    const auto gpu = test::loss_curve(cuda::cuda_backend(), c, p, 300);
    const double worst = test::worst_relative(gpu, cpu);
    std::printf(
        "%s GPU vs fp32 CPU over 300 steps: worst relative loss difference %.2e; loss %.4f"
        " -> %.4f (CPU %.4f -> %.4f)\n",
        name, worst, gpu.front(), gpu.back(), cpu.front(), cpu.back());
    EXPECT_LT(worst, 2e-2) << name;
    EXPECT_LT(gpu.back(), 0.8 * gpu.front()) << name;
  }
}

// CUDA graphs (train::StepSettings::graphs): 8 training steps (train::Step, AdamW, dropout on, a
// new batch each step read ahead into the other input slot) with forward and backward launched
// as graphs equal the same steps issued kernel by kernel, bit for bit: every step's loss and the
// parameters after each step, in fp32, bf16 and fp16 (the loss scaler on), read each step and
// deferred (the loss scale on the device). What changes from step to step (the dropout keys and
// offsets, the batch's MLM weight, its embedding-gradient groups) the kernels read where they
// run, so each step's graphs draw that step's masks. Each step launches 2 graphs (forward and
// backward: 4 captured, one a kind and input slot), which run the kernels the eager step
// issues, the attention's pointer tables (2 a layer, which the eager steps keep from the first)
// and the embedding tables' sums kernels (3, whatever the batch; eagerly only where a table row
// has more than kEmbeddingChunk tokens); deferred, a third holds the update (the gate and the
// optimizer's kernels: Optimizer::gated_step, the learning rate staged before each launch), so
// the host issues no kernel at all, with AdamW and with LAMB (bf16); read each step, the host
// issues the optimizer's kernels. No more host waits.
TEST(CudaModel, GraphsReplayTheEagerStepsBitForBit) {
  SKIP_WITHOUT_GPU();
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  constexpr int64_t kSteps = 8;
  struct Run {
    std::vector<double> losses;
    std::vector<std::vector<float>> params;     // after each step
    std::vector<kernels::DeviceCounts> counts;  // after each step
  };
  auto train = [&](Precision p, bool graphs, bool defer, train::OptimizerKind kind) {
    Run r;
    r.losses = test::loss_curve(
        cuda::cuda_backend(), c, p, kSteps, kind,
        [&](const model::BertModel& m, const train::StepReport&) {
          r.counts.push_back(cuda::device_counts());
          std::vector<float> host(static_cast<size_t>(m.table().total()));
          m.backend().to_host(host.data(), m.params(), host.size() * sizeof(float));
          r.params.push_back(std::move(host));
        },
        graphs, defer);
    return r;
  };
  struct Case {
    Precision p;
    bool defer;
    train::OptimizerKind kind;
  };
  std::vector<Case> cases;
  for (auto p : {Precision::FP32, Precision::BF16, Precision::FP16})
    for (bool defer : {false, true}) cases.push_back({p, defer, train::OptimizerKind::AdamW});
  cases.push_back({Precision::BF16, true, train::OptimizerKind::Lamb});
  for (const auto& [p, defer, kind] : cases) {
    const bool lamb = kind == train::OptimizerKind::Lamb;
    SCOPED_TRACE(testing::Message() << "precision " << static_cast<int>(p) << " defer " << defer
                                    << (lamb ? " LAMB" : " AdamW"));
    const Run eager = train(p, false, defer, kind), graphed = train(p, true, defer, kind);
    EXPECT_EQ(graphed.losses, eager.losses);
    for (int64_t k = 0; k < kSteps; ++k)
      ASSERT_TRUE(graphed.params[k] == eager.params[k]) << "parameters after step " << k;
    // Per step (the first's counts include the model's setup: from the second on).
    for (int64_t k = 1; k < kSteps; ++k) {
      SCOPED_TRACE(testing::Message() << "step " << k);
      auto step = [&](const Run& r, int64_t kernels::DeviceCounts::*f) {
        return r.counts[k].*f - r.counts[k - 1].*f;
      };
      using C = kernels::DeviceCounts;
      EXPECT_EQ(step(graphed, &C::graph_launches), defer ? 3 : 2);
      EXPECT_EQ(step(eager, &C::graph_launches), 0);
      EXPECT_GE(step(graphed, &C::launches), step(eager, &C::launches) + 2 * c.num_hidden_layers);
      EXPECT_LE(step(graphed, &C::launches),
                step(eager, &C::launches) + 2 * c.num_hidden_layers + 3);
      const int64_t issued = step(graphed, &C::launches) - step(graphed, &C::graph_kernels);
      if (defer)
        EXPECT_EQ(issued, 0);
      else
        EXPECT_LT(issued, step(eager, &C::launches) / 10);
      EXPECT_EQ(step(graphed, &C::host_syncs), step(eager, &C::host_syncs));
      if (k == kSteps - 1)
        std::printf(
            "precision %d defer %d %s: launches a step %lld eager; with graphs %lld, of "
            "them the host's %lld and %d graphs'\n",
            static_cast<int>(p), defer, lamb ? "LAMB" : "AdamW",
            static_cast<long long>(step(eager, &C::launches)),
            static_cast<long long>(step(graphed, &C::launches)), static_cast<long long>(issued),
            defer ? 3 : 2);
    }
  }
}

// A training pass's loss sums, gradients and what it asked of the device, read back.
struct GraphPass {
  std::vector<float> grads;
  model::StepSums sums;
  kernels::DeviceCounts counts;
};
// One training forward and backward (dropout on, the sums kept on the device) of step k.
GraphPass graph_pass(BertModel& m, const model::Batch& b, uint64_t k,
                     model::Losses* losses = nullptr) {
  const model::StepOptions opt{true, 5, k, 0, /*device_sums=*/true};
  m.zero_grads();
  const kernels::DeviceCounts before = cuda::device_counts();
  const model::Losses l = m.forward(b, opt);
  if (losses) *losses = l;
  m.backward(b, opt, 1.0f);
  GraphPass p;
  p.counts = cuda::device_counts();
  p.counts.launches -= before.launches;
  p.counts.graph_launches -= before.graph_launches;
  p.counts.graph_kernels -= before.graph_kernels;
  m.read_step_sums();
  p.sums = m.step_sums();
  p.grads.resize(static_cast<size_t>(m.table().total()));
  m.backend().to_host(p.grads.data(), m.grads(), p.grads.size() * sizeof(float));
  return p;
}
// The graphed passes equal the eager ones bit for bit: loss sums and gradients.
void expect_same_passes(const std::vector<GraphPass>& graphed,
                        const std::vector<GraphPass>& eager) {
  ASSERT_EQ(graphed.size(), eager.size());
  for (size_t k = 0; k < eager.size(); ++k) {
    SCOPED_TRACE(testing::Message() << "batch " << k);
    EXPECT_EQ(graphed[k].sums.loss, eager[k].sums.loss);
    EXPECT_EQ(graphed[k].sums.mlm_correct, eager[k].sums.mlm_correct);
    EXPECT_TRUE(graphed[k].grads == eager[k].grads);
  }
}

// A graph holds every batch of its shape, not only the one it was captured with: three batches
// of 4 x 32 tokens through the two input slots (the first slot's graphs captured with a batch
// whose embedding tables have no row of more than kEmbeddingChunk tokens, so no partial sums,
// then replayed with one whose every token is one word: a row of 128 tokens, summed from two
// chunks; and some of its MLM weights 0: another loss divisor), each a training forward and
// backward: the gradients and loss sums equal the same passes issued kernel by kernel, bit for
// bit.
TEST(CudaModel, AGraphHoldsEveryBatchOfItsShape) {
  SKIP_WITHOUT_GPU();
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::Batch first = test::random_batch(c, 4, 32, 5);
  model::Batch second = first, third = first;
  for (int32_t& id : second.input_ids) id = (id + 17) % 300;
  for (int32_t& id : third.input_ids) id = 7;
  for (size_t i = 0; i < third.masked_lm_weights.size(); i += 3) third.masked_lm_weights[i] = 0;
  auto run = [&](model::GraphMode graphs) {
    ModelDims d{4, 32, 5};
    d.attention = ModelDims::Attention::Full;
    d.unpadded = false;
    BertModel m(c, Head::Pretraining, d, cuda::cuda_backend());
    m.set_graphs(graphs);
    m.init_params(11);
    std::vector<GraphPass> passes;
    uint64_t k = 0;
    for (const model::Batch* b : std::vector<const model::Batch*>{&first, &second, &third}) {
      EXPECT_EQ(m.graphed(*b, {true, 5, k, 0, true}), graphs != model::GraphMode::Off);
      passes.push_back(graph_pass(m, *b, k++));
    }
    return passes;
  };
  expect_same_passes(run(model::GraphMode::On), run(model::GraphMode::Off));
}

// The fine-tuning heads as graphs too (BertModel::graph_shapes: every head): four batches of each
// head through the two input slots (the last two replaying the graphs the first two captured), each
// a training forward and backward, equal the same passes issued kernel by kernel bit for bit (loss
// sums, the classifier's hits, gradients), each pass two graph launches. What changes from batch to
// batch is read where the kernels run: the classifier's labels, a regression's targets (its squared
// error summed on the device: Backend::squared_error_into), the answer spans, and the token
// classifier's scored tokens (its loss divisor and gradient scale, the step's arguments: padded,
// 128, 64, none, whose loss and gradient are 0, and 96). Padded in fp32 and bf16; with the
// padding skipped (the fused attention) in bf16, the second batch's first sequence shorter.
TEST(CudaModel, FineTuningHeadsReplayTheirEagerPassesBitForBit) {
  SKIP_WITHOUT_GPU();
  model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  model::Batch first = test::task_batch(c);
  first.label_values = {0.5f, -1.0f, 2.0f, 0.0f};
  model::Batch second = first, third = first;
  for (int32_t& id : second.input_ids) id = (id + 17) % 300;
  for (int64_t t = 20; t < 32; ++t) second.input_mask[t] = 0;
  second.label_ids = {1, 1, 0, 2};
  second.label_values = {1.5f, 0.25f, -2.0f, 3.0f};
  for (size_t i = 0; i < second.token_label_weights.size(); i += 2)
    second.token_label_weights[i] = 0.0f;
  second.span_positions = {0, 4, 2, 9, 6, 11, 0, 29};
  std::fill(third.token_label_weights.begin(), third.token_label_weights.end(), 0.0f);
  third.label_ids = {2, 2, 2, 0};
  third.label_values = {0.0f, 0.0f, 1.0f, 1.0f};
  model::Batch fourth = second;
  fourth.token_label_weights.assign(fourth.token_label_weights.size(), 1.0f);
  for (size_t i = 0; i < fourth.token_label_weights.size(); i += 4)
    fourth.token_label_weights[i] = 0.0f;
  fourth.label_ids = {0, 1, 2, 0};
  fourth.label_values = {-0.5f, 4.0f, 0.75f, 2.0f};
  fourth.span_positions = {1, 1, 1, 1, 8, 2, 3, 4};
  struct Case {
    Head head;
    int64_t labels;
    Precision p;
    bool unpadded;
  };
  std::vector<Case> cases;
  for (Head head :
       {Head::SequenceClassification, Head::TokenClassification, Head::QuestionAnswering})
    for (Precision p : {Precision::FP32, Precision::BF16}) cases.push_back({head, 3, p, false});
  cases.push_back({Head::SequenceClassification, 1, Precision::BF16, false});  // regression
  cases.push_back({Head::SequenceClassification, 3, Precision::BF16, true});
  cases.push_back({Head::TokenClassification, 3, Precision::BF16, true});
  for (const auto& [head, labels, p, unpadded] : cases) {
    SCOPED_TRACE(testing::Message()
                 << model::head_architecture(head) << " labels " << labels << " precision "
                 << static_cast<int>(p) << (unpadded ? " unpadded" : ""));
    c.num_labels = labels;
    std::vector<model::Losses> losses[2];
    auto run = [&](model::GraphMode graphs) {
      ModelDims d{4, 32, 5, p, ModelDims::Attention::Blocked};
      d.unpadded = unpadded;
      BertModel m(c, head, d, cuda::cuda_backend());
      EXPECT_TRUE(m.graph_shapes());
      if (unpadded) EXPECT_TRUE(m.dims().fused_attention);
      m.set_graphs(graphs);
      m.init_params(11);
      std::vector<GraphPass> passes;
      uint64_t k = 0;
      for (const model::Batch* b :
           std::vector<const model::Batch*>{&first, &second, &third, &fourth}) {
        EXPECT_EQ(m.graphed(*b, {true, 5, k, 0, true}), graphs != model::GraphMode::Off);
        model::Losses l;
        passes.push_back(graph_pass(m, *b, k++, &l));
        losses[graphs == model::GraphMode::On].push_back(l);
        EXPECT_EQ(passes.back().counts.graph_launches, graphs == model::GraphMode::On ? 2 : 0);
      }
      return passes;
    };
    const std::vector<GraphPass> graphed = run(model::GraphMode::On),
                                 eager = run(model::GraphMode::Off);
    expect_same_passes(graphed, eager);
    const int64_t scored[] = {128, 64, 0, 96};
    for (size_t k = 0; k < eager.size(); ++k) {
      SCOPED_TRACE(testing::Message() << "batch " << k);
      EXPECT_EQ(graphed[k].sums.cls_correct, eager[k].sums.cls_correct);
      EXPECT_EQ(losses[1][k].tokens_scored, losses[0][k].tokens_scored);
      if (head == Head::TokenClassification && !unpadded)  // (padded: the padding's weights too)
        EXPECT_EQ(losses[1][k].tokens_scored, scored[k]);
    }
    // The third batch scores no token: the token classifier's loss and gradient 0.
    if (head == Head::TokenClassification)
      EXPECT_EQ(eager[2].sums.loss, 0.0);
    else
      EXPECT_GT(eager[2].sums.loss, 0.0);
  }
}

// `finetune --device cuda` with its steps as graphs (FinetuneConfig::graphs, the default auto:
// forward, backward and the deferred update): entity tagging (100 CLUENER sentences) and question
// answering (a CMRC 2018 article) in bf16, padded, 2 epochs, the same dev metrics and saved model
// byte for byte as with the graphs off, 3 graph launches a step.
// The first n CLUENER training sentences, into `to`.
void cluener_head(int n, const std::string& to) {
  std::ifstream in(test::data_path("data/tasks/cluener_train_head2000.json"));
  std::ofstream out(to);
  std::string line;
  for (int i = 0; i < n && std::getline(in, line); ++i) out << line << "\n";
}

TEST(CudaModel, FineTuningAsGraphsSavesTheSameModel) {
  SKIP_WITHOUT_GPU();
  test::TempDir tmp;
  cluener_head(100, tmp / "ner.json");
  {
    nlohmann::json qa;
    std::ifstream(test::data_path("data/tasks/cmrc2018_dev_head.json")) >> qa;
    qa["data"] = nlohmann::json::array({qa["data"][0]});
    std::ofstream(tmp / "qa.json") << qa.dump();
  }
  for (const std::string task : {"cluener", "cmrc2018"}) {
    SCOPED_TRACE(task);
    const std::string data = tmp / (task == "cluener" ? "ner.json" : "qa.json");
    auto run = [&](model::GraphMode graphs, const std::string& out) {
      train::FinetuneConfig f;
      f.init_checkpoint = test::data_path("data/pretrained/zh-h64");
      f.vocab = test::data_path("../data/vocab/bert-base-chinese-vocab.txt");
      f.train = f.dev = data;
      f.columns = tasks::task_columns(task);
      f.seq_len = 64;
      f.qa.max_query_length = 16;
      f.batch_size = 16;
      f.epochs = 2;
      f.lr = 1e-3;
      f.precision = Precision::BF16;
      f.unpadded = false;  // (--padding auto on a GPU, whose fine-tuning runs the full attention)
      f.output = tmp / out;
      f.quiet = true;
      f.backend = &cuda::cuda_backend();
      f.graphs = graphs;
      const kernels::DeviceCounts before = cuda::device_counts();
      const train::FinetuneResult r = train::finetune(f);
      return std::pair{r, cuda::device_counts().graph_launches - before.graph_launches};
    };
    const auto [graphed, graph_launches] = run(model::GraphMode::On, task + "-graphs");
    const auto [eager, eager_launches] = run(model::GraphMode::Off, task + "-eager");
    EXPECT_GT(graph_launches, 0);
    EXPECT_EQ(graph_launches % 3, 0) << "(forward, backward and the update a step)";
    EXPECT_EQ(eager_launches, 0);
    EXPECT_EQ(graphed.dev_f1, eager.dev_f1);
    EXPECT_EQ(graphed.dev_qa_f1, eager.dev_qa_f1);
    EXPECT_EQ(graphed.dev_exact_match, eager.dev_exact_match);
    EXPECT_EQ(graphed.train_loss, eager.train_loss);
    EXPECT_EQ(test::read_file(tmp / (task + "-graphs/model.safetensors")),
              test::read_file(tmp / (task + "-eager/model.safetensors")));
  }
}

// `finetune --device cuda --attention blocked` in bf16: the attention fused, so `--padding auto`
// skips the padding (each sentence on its real tokens, the rows bucketed for the graphs): the
// header says so; with the graphs on and off the same dev F1, loss and saved model byte for byte;
// and the run tracks the padded full-attention run (the default) over 2 epochs of 64 CLUENER
// sentences: the same math on the real tokens, rounded differently (the fused kernel's online
// softmax and its bf16 probabilities against the full kernel's, each within bf16's unit
// roundoff 2^-8 a product), so the mean training loss within 2^-8 of the padded run's
// (measured: equal to 6 digits) and what fine-tuning changed in each tensor within 2% of each
// other (measured 0.30%, layer 0's query weights).
TEST(CudaModel, FineTuningSkipsThePaddingWithTheFusedAttention) {
  SKIP_WITHOUT_GPU();
  test::TempDir tmp;
  cluener_head(64, tmp / "ner.json");
  auto run = [&](ModelDims::Attention attention, model::GraphMode graphs, const std::string& out,
                 std::string* header) {
    train::FinetuneConfig f;
    f.init_checkpoint = test::data_path("data/pretrained/zh-h64");
    f.vocab = test::data_path("../data/vocab/bert-base-chinese-vocab.txt");
    f.train = f.dev = tmp / "ner.json";
    f.columns = tasks::task_columns("cluener");
    f.seq_len = 64;
    f.batch_size = 16;
    f.epochs = 2;
    f.lr = 1e-3;
    f.precision = Precision::BF16;
    f.attention = attention;
    // (--padding auto: skipped where the attention runs fused)
    f.unpadded = attention == ModelDims::Attention::Blocked;
    f.output = tmp / out;
    f.quiet = header == nullptr;
    f.backend = &cuda::cuda_backend();
    f.graphs = graphs;
    const kernels::DeviceCounts before = cuda::device_counts();
    if (header) testing::internal::CaptureStdout();
    const train::FinetuneResult r = train::finetune(f);
    if (header) *header = testing::internal::GetCapturedStdout();
    return std::pair{r, cuda::device_counts().graph_launches - before.graph_launches};
  };
  std::string header;
  const auto [fused, fused_launches] =
      run(ModelDims::Attention::Blocked, model::GraphMode::On, "fused", &header);
  const auto [eager, eager_launches] =
      run(ModelDims::Attention::Blocked, model::GraphMode::Off, "eager", nullptr);
  const auto [padded, padded_launches] =
      run(ModelDims::Attention::Auto, model::GraphMode::On, "padded", nullptr);
  EXPECT_NE(header.find("bf16, fused attention, padding skipped, CUDA graphs on (forward, "
                        "backward and the update)"),
            std::string::npos)
      << header;
  EXPECT_GT(fused_launches, 0);
  EXPECT_EQ(fused_launches % 3, 0) << "(forward, backward and the update a step)";
  EXPECT_EQ(eager_launches, 0);
  EXPECT_EQ(fused.dev_f1, eager.dev_f1);
  EXPECT_EQ(fused.train_loss, eager.train_loss);
  EXPECT_EQ(test::read_file(tmp / "fused/model.safetensors"),
            test::read_file(tmp / "eager/model.safetensors"));
  EXPECT_NEAR(fused.train_loss, padded.train_loss, padded.train_loss / 256);
  // What fine-tuning changed, tensor by tensor (the pretrained tensors' change, the new head's
  // values): the two runs' within RELATIVE of each other.
  SafetensorsReader a(tmp / "fused/model.safetensors"), b(tmp / "padded/model.safetensors"),
      init(test::data_path("data/pretrained/zh-h64/model.safetensors"));
  double worst = 0;
  std::string worst_name;
  for (const SafeTensorInfo& t : b.tensors()) {
    // (the key's bias adds a constant to each row of scores, which the softmax drops: its
    // gradient is 0 but for rounding, different in each run, and so its change)
    if (t.name.find("attention.self.key.bias") != std::string::npos) continue;
    const std::vector<float> x = a.read_f32(t.name), y = b.read_f32(t.name);
    const SafeTensorInfo* i0 = init.find(t.name);
    const std::vector<float> z = i0 ? init.read_f32(t.name) : std::vector<float>(y.size(), 0.0f);
    double diff = 0, change = 0;
    for (size_t k = 0; k < y.size(); ++k) {
      diff += (double(x[k]) - y[k]) * (double(x[k]) - y[k]);
      change += (double(y[k]) - z[k]) * (double(y[k]) - z[k]);
    }
    const double r = std::sqrt(diff / std::max(change, 1e-30));
    if (r > worst) worst = r, worst_name = t.name;
  }
  EXPECT_LT(worst, 0.02) << worst_name;
  std::printf(
      "fine-tuning, fused attention and the padding skipped against full and padded: "
      "train loss %.6f / %.6f, the change's largest relative difference %.3g (%s)\n",
      fused.train_loss, padded.train_loss, worst, worst_name.c_str());
}

// The graph cache (model/graphs.h) keeps its `most` graphs, the one launched longest ago making
// room: with room for 2, keys 0, 1, 2, 0, 0, 1 capture 5 graphs (2 evicts 0, 0 evicts 1, 1
// evicts 2) and each run launches its own key's graph once (key k adds k + 1 to a sum: 10).
TEST(CudaModel, GraphCacheEvictsTheLeastRecentlyLaunched) {
  SKIP_WITHOUT_GPU();
  const kernels::Backend& be = cuda::cuda_backend();
  float* sum = static_cast<float*>(be.allocate(sizeof(float)));
  float* adds = static_cast<float*>(be.allocate(3 * sizeof(float)));
  const float values[3] = {1.0f, 2.0f, 3.0f};
  be.to_device(adds, values, sizeof values);
  model::GraphCache<int> cache(2);
  model::GraphMode mode = model::GraphMode::On;
  for (int key : {0, 1, 2, 0, 0, 1}) {
    const int64_t l0 = cuda::device_counts().graph_launches;
    cache.run(be, mode, key, "test", [&] { be.add_inplace(sum, adds + key, 1); });
    EXPECT_EQ(cuda::device_counts().graph_launches - l0, 1);
    EXPECT_LE(cache.size(), 2u);
  }
  float got = 0;
  be.synchronize();
  be.to_host(&got, sum, sizeof got);
  EXPECT_EQ(got, 10.0f);
  EXPECT_EQ(cache.captures(), 5);
  EXPECT_EQ(mode, model::GraphMode::On);
  cache.clear();
  be.release(sum);
  be.release(adds);
}

// The padding skipped, with the fused attention (one launch for any lengths, zeroing the rows
// past the sequences), forward and backward run as graphs too: a batch's rows rounded up to a
// bucket, the MLM head on all its slots, a graph each bucket and input slot. Four batches of
// 6 x 48 tokens (bf16, dropout on) of other lengths each, through the two input slots: 196 real
// tokens (256 rows), 100 (128), 200 (256 again, the first slot: its graphs replayed with other
// lengths, a prediction without weight) and none padded (288, the planned rows), each a
// training forward and backward: the loss sums and gradients equal the same passes issued
// kernel by kernel, bit for bit; 6 graphs captured for 8 launched, the host issuing few kernels
// (eagerly: hundreds).
TEST(CudaModel, UnpaddedGraphsHoldEveryBatchOfTheirRows) {
  SKIP_WITHOUT_GPU();
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const int64_t B = 6, T = 48, P = 5;
  auto batch = [&](const std::vector<int64_t>& len, int32_t seed) {
    model::Batch b = test::random_batch(c, B, T, P);
    for (int64_t e = 0; e < B; ++e)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t i = e * T + t;
        b.input_mask[i] = t < len[e] ? 1 : 0;
        b.input_ids[i] = t < len[e] ? static_cast<int32_t>((i * 7919 + seed) % 299 + 1) : 0;
      }
    for (int64_t i = 0; i < B * P; ++i)
      b.masked_lm_positions[i] = static_cast<int32_t>(1 + (i * 3 + seed) % (len[i / P] - 1));
    return b;
  };
  std::vector<model::Batch> batches = {
      batch({48, 40, 30, 20, 48, 10}, 1), batch({10, 10, 20, 20, 30, 10}, 2),
      batch({47, 41, 29, 21, 45, 17}, 3), batch({48, 48, 48, 48, 48, 48}, 4)};
  batches[2].masked_lm_weights[4] = 0;
  const std::vector<int64_t> rows = {256, 128, 256, 288};
  auto run = [&](model::GraphMode graphs) {
    ModelDims d{B, T, P};
    d.precision = Precision::BF16;
    d.attention = ModelDims::Attention::Blocked;
    d.unpadded = true;
    BertModel m(c, Head::Pretraining, d, cuda::cuda_backend());
    EXPECT_TRUE(m.dims().fused_attention);
    m.set_graphs(graphs);
    m.init_params(11);
    std::vector<GraphPass> passes;
    for (uint64_t k = 0; k < batches.size(); ++k) {
      EXPECT_EQ(m.graphed(batches[k], {true, 5, k, 0, true}), graphs != model::GraphMode::Off);
      model::Losses l;
      passes.push_back(graph_pass(m, batches[k], k, &l));
      EXPECT_EQ(l.computed_tokens, rows[k]) << "batch " << k;
    }
    if (graphs != model::GraphMode::Off) EXPECT_EQ(m.graph_captures(), 6);
    return passes;
  };
  const auto eager = run(model::GraphMode::Off), graphed = run(model::GraphMode::On);
  expect_same_passes(graphed, eager);
  for (size_t k = 0; k < eager.size(); ++k) {
    SCOPED_TRACE(testing::Message() << "batch " << k);
    EXPECT_EQ(graphed[k].counts.graph_launches, 2);
    EXPECT_EQ(eager[k].counts.graph_launches, 0);
    // (the host's: the 16-bit weights' copy, without an optimizer step to refresh them)
    const int64_t issued = graphed[k].counts.launches - graphed[k].counts.graph_kernels;
    EXPECT_LT(issued, eager[k].counts.launches / 10);
  }
}

// A checkpoint written from the GPU model is the CPU model's parameters.
// A training run stopped on one device resumes on the other (model, AdamW's moments, the step
// and the input position, through the run checkpoint): stopped after 6 of 12 steps on the GPU
// and finished on the CPU, and the other way round, the last 6 losses track the CPU run that
// never stopped (fp32: summation order only, rtol 1e-3 after 12 AdamW steps).
TEST(CudaModel, ARunMovesBetweenTheGpuAndTheCpu) {
  SKIP_WITHOUT_GPU();
  test::TempDir dir;
  prep::PrepareConfig p;
  p.input = test::data_path("../data/corpus/bert_sample_text.txt");
  p.vocab = test::data_path("../data/vocab/bert-base-uncased-vocab.txt");
  p.output = dir / "data";
  p.instance.seq_len = 64;
  p.instance.max_predictions = 10;
  prep::prepare(p);
  std::ofstream(dir / "tiny.json")
      << R"({"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64})";
  auto cfg = [&](const std::string& out) {
    train::TrainConfig c;
    c.model_config = dir / "tiny.json";
    c.input.files = dir / "data/*.tfrecord";
    c.output = dir / out;
    c.batch_size = 8;
    c.seq_len = 64;
    c.max_predictions = 10;
    c.steps = 12;
    c.lr = 2e-3;
    c.log_every = 0;
    c.quiet = true;
    c.save_every = 6;
    c.optimizer.kind = train::OptimizerKind::AdamW;
    return c;
  };
  comm::SingleProcess comm;
  const train::TrainResult ref = train::train(cfg("cpu"), comm);
  ASSERT_EQ(ref.losses.size(), 12u);
  for (bool gpu_first : {true, false}) {
    SCOPED_TRACE(gpu_first ? "GPU, then CPU" : "CPU, then GPU");
    train::TrainConfig c = cfg(gpu_first ? "gpu-cpu" : "cpu-gpu");
    c.backend = gpu_first ? &cuda::cuda_backend() : nullptr;
    c.stop_after = 6;
    train::train(c, comm);
    c.backend = gpu_first ? nullptr : &cuda::cuda_backend();
    c.stop_after = 0;
    c.resume = true;
    const train::TrainResult r = train::train(c, comm);
    ASSERT_EQ(r.losses.size(), 6u);
    for (size_t k = 0; k < 6; ++k)
      EXPECT_NEAR(r.losses[k], ref.losses[6 + k], 1e-3 * ref.losses[6 + k]) << "step " << 7 + k;
  }
}

TEST(CudaModel, CheckpointFromTheGpuLoadsOnTheCpu) {
  SKIP_WITHOUT_GPU();
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const ModelDims d{2, 16, 3};
  BertModel gpu(c, Head::Pretraining, d, cuda::cuda_backend());
  gpu.init_params(3);
  test::TempDir tmp;
  model::save_pretrained(gpu, tmp / "ck");
  BertModel cpu(c, Head::Pretraining, d);
  model::load_safetensors_into(cpu, tmp / "ck/model.safetensors");
  BertModel ref(c, Head::Pretraining, d);
  ref.init_params(3);
  const int64_t n = ref.table().total();
  EXPECT_EQ(std::vector<float>(cpu.params(), cpu.params() + n),
            std::vector<float>(ref.params(), ref.params() + n));
  // and back: the CPU's checkpoint into the GPU model
  BertModel gpu2(c, Head::Pretraining, d, cuda::cuda_backend());
  model::load_safetensors_into(gpu2, tmp / "ck/model.safetensors");
  std::vector<float> back(static_cast<size_t>(n));
  gpu2.backend().to_host(back.data(), gpu2.params(), back.size() * sizeof(float));
  EXPECT_EQ(back, std::vector<float>(ref.params(), ref.params() + n));
}

}  // namespace
}  // namespace bertrain
