// A model on a backend with memory of its own (what the CUDA backend is), checked on the CPU:
// OwnMemoryBackend runs the CPU's kernels but says its memory is not the host's, hands out its
// own blocks, and fails any kernel call given a pointer outside them. So BertModel's device path
// (its arenas from the backend, parameters written through to_device, the batch arrays staged
// per forward, checkpoints read through to_host) runs here, every pointer a kernel receives is
// proven to be backend memory, and the results equal the plain CPU model's bit for bit (the
// same kernels on the same values).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "comm/communicator.h"
#include "core/dtype.h"
#include "golden_check.h"
#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/scratch.h"
#include "loss_curve.h"
#include "model/bert.h"
#include "model/checkpoint.h"
#include "own_memory_backend.h"
#include "plan/memory.h"
#include "test_util.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace bertrain {
namespace {

using namespace kernels;
using test::OwnMemoryBackend;

using StepRun = test::BackendStep;
constexpr auto step = test::backend_step;

// The losses are sums in OpenMP reductions, whose combination order varies from run to run
// with several threads: equal to the last few bits.
void expect_same(const StepRun& own, const StepRun& cpu) {
  EXPECT_NEAR(own.losses.loss, cpu.losses.loss, 1e-12 * std::fabs(cpu.losses.loss));
  EXPECT_EQ(own.losses.mlm_correct, cpu.losses.mlm_correct);
  EXPECT_EQ(own.losses.tokens_correct, cpu.losses.tokens_correct);
  EXPECT_EQ(own.grads, cpu.grads);
}

TEST(DeviceModel, PretrainingPassesOnlyBackendMemoryAndEqualsTheCpuModel) {
  const OwnMemoryBackend own;
  model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::Batch b = test::random_batch(c, 4, 32, 5);
  int64_t passes = 0;
  for (int precision = 0; precision < 3; ++precision)
    for (bool unpadded : {false, true}) {
      model::ModelDims d{b.B, b.T, b.P};
      d.unpadded = unpadded;
      d.precision = static_cast<Precision>(precision);   // 0 fp32, 1 bf16, 2 fp16
      if (d.bf16() && !gemm_bf16_available()) continue;  // (AVX2 CPUs: bf16 does not run)
      SCOPED_TRACE(testing::Message() << "precision " << precision << " unpadded " << unpadded);
      expect_same(step(own, c, model::Head::Pretraining, d, b),
                  step(cpu_backend(), c, model::Head::Pretraining, d, b));
      ++passes;
    }
  EXPECT_EQ(own.blocks(), 0u);       // every block released with its model
  EXPECT_EQ(own.uploads(), passes);  // each batch in one copy, from the staging memory
}

// The HuggingFace golden (forward, every gradient) through a model in a backend's own memory:
// what CudaModel.MatchesTheHuggingFaceGoldens runs on a GPU, both attention kernels here.
TEST(DeviceModel, MatchesTheHuggingFaceGoldens) {
  const OwnMemoryBackend own;
  for (auto attention : {model::ModelDims::Attention::Full, model::ModelDims::Attention::Blocked})
    for (bool unpadded : {false, true}) {
      SCOPED_TRACE(testing::Message()
                   << "blocked " << (attention != model::ModelDims::Attention::Full) << " unpadded "
                   << unpadded);
      model::ModelDims d;
      d.attention = attention;
      d.unpadded = unpadded;
      model::golden::check_pretraining(own, d);
    }
  EXPECT_EQ(own.blocks(), 0u);
}

TEST(DeviceModel, TaskHeadsPassOnlyBackendMemory) {
  const OwnMemoryBackend own;
  model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  c.num_labels = 3;
  model::Batch b = test::task_batch(c);
  for (auto head : {model::Head::SequenceClassification, model::Head::TokenClassification,
                    model::Head::QuestionAnswering})
    for (bool unpadded : {false, true}) {
      SCOPED_TRACE(testing::Message() << static_cast<int>(head) << " unpadded " << unpadded);
      model::ModelDims d{b.B, b.T, b.P};
      d.unpadded = unpadded;
      expect_same(step(own, c, head, d, b), step(cpu_backend(), c, head, d, b));
    }
  // Regression (one label, MSE)
  c.num_labels = 1;
  b.label_values = {0.5f, -1.0f, 2.0f, 0.0f};
  expect_same(step(own, c, model::Head::SequenceClassification, {b.B, b.T, b.P}, b),
              step(cpu_backend(), c, model::Head::SequenceClassification, {b.B, b.T, b.P}, b));
}

// Training steps (train::Step: forward, backward, the gradient norm, the update) with the
// optimizer's moments in the backend's memory too: the same parameters as on the CPU after
// three steps of AdamW and of LAMB, in fp32 and bf16 (whose update also writes the bf16 copy).
TEST(DeviceModel, TrainingStepsEqualTheCpu) {
  const OwnMemoryBackend own;
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::Batch batch = test::random_batch(c, 4, 32, 5);
  auto train = [&](const Backend& be, train::OptimizerKind kind, bool bf16) {
    model::ModelDims d{batch.B, batch.T, batch.P};
    d.precision = bf16 ? Precision::BF16 : Precision::FP32;
    d.unpadded = true;
    model::BertModel m(c, model::Head::Pretraining, d, be);
    m.init_params(11);
    train::OptimizerConfig oc;
    oc.kind = kind;
    train::Optimizer opt(train::param_slices(m.table()), m.table().total(), oc, be);
    train::LossScaler scaler{train::LossScaler::Config{}};
    comm::SingleProcess single;
    train::StepSettings ss;
    ss.seed = 9;
    train::Step step(m, opt, scaler, single, ss);
    for (int64_t k = 0; k < 3; ++k) EXPECT_TRUE(step.run(k, 1e-3, test::same_batch(batch)).applied);
    std::vector<float> p(static_cast<size_t>(m.table().total()));
    be.to_host(p.data(), m.params(), p.size() * sizeof(float));
    return p;
  };
  for (auto kind : {train::OptimizerKind::AdamW, train::OptimizerKind::Lamb})
    for (bool bf16 : {false, true}) {
      if (bf16 && !gemm_bf16_available()) continue;
      SCOPED_TRACE(testing::Message() << train::optimizer_name(kind) << (bf16 ? " bf16" : ""));
      EXPECT_EQ(train(own, kind, bf16), train(cpu_backend(), kind, bf16));
    }
}

// A pretraining model (initialised from seed 11), its optimizer, loss scaler and step on a
// backend: the deferred-step tests' runs (deferred where the backend has memory of its own).
struct DeferredRun {
  std::unique_ptr<model::BertModel> m;
  std::unique_ptr<train::Optimizer> opt;
  std::unique_ptr<train::LossScaler> scaler;
  comm::SingleProcess single;
  std::unique_ptr<train::Step> step;
  DeferredRun(const Backend& be, const model::BertConfig& c, const model::ModelDims& d,
              train::OptimizerKind kind, const train::LossScaler::Config& sc = {}) {
    m = std::make_unique<model::BertModel>(c, model::Head::Pretraining, d, be);
    m->init_params(11);
    train::OptimizerConfig oc;
    oc.kind = kind;
    opt = std::make_unique<train::Optimizer>(train::param_slices(m->table()), m->table().total(),
                                             oc, be);
    scaler = std::make_unique<train::LossScaler>(sc);
    train::StepSettings ss;
    ss.seed = 9;
    ss.defer = true;
    step = std::make_unique<train::Step>(*m, *opt, *scaler, single, ss);
  }
  std::vector<float> params() const {
    std::vector<float> p(static_cast<size_t>(m->table().total()));
    m->backend().to_host(p.data(), m->params(), p.size() * sizeof(float));
    return p;
  }
};

// Deferred steps (StepSettings::defer, what train and bench run): on a backend with memory of
// its own the norm, finite check and clipping are the device's (Optimizer::gate, apply_gated)
// and nothing is read until settle(). Five steps, AdamW and LAMB (clipping at 1.0 active: the
// first steps' norms are above it), fp32 and bf16: the parameters equal the eager steps' on the
// CPU bit for bit (the same sums in the same order, the same factor from the same doubles), and
// settle() returns every step's report in order with the eager run's loss (the OpenMP sums'
// order aside: 1e-12), norm and hits. Then a parameter made NaN: the next two steps change no
// other parameter (the gate skips them on the device) and settle() fails naming the first.
TEST(DeviceModel, DeferredStepsEqualTheEagerOnesAndFailWhereTheyDiverge) {
  const OwnMemoryBackend own;
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::Batch batch = test::random_batch(c, 4, 32, 5);
  const auto next = test::same_batch(batch);
  for (auto kind : {train::OptimizerKind::AdamW, train::OptimizerKind::Lamb})
    for (bool bf16 : {false, true}) {
      if (bf16 && !gemm_bf16_available()) continue;
      SCOPED_TRACE(testing::Message() << train::optimizer_name(kind) << (bf16 ? " bf16" : ""));
      model::ModelDims d{batch.B, batch.T, batch.P};
      d.precision = bf16 ? Precision::BF16 : Precision::FP32;
      d.unpadded = true;
      DeferredRun eager(cpu_backend(), c, d, kind);  // (host memory: never deferred)
      DeferredRun deferred(own, c, d, kind);
      EXPECT_FALSE(eager.step->deferring());
      ASSERT_TRUE(deferred.step->deferring());
      std::vector<train::StepReport> want;
      for (int64_t k = 0; k < 5; ++k) {
        want.push_back(eager.step->run(k, 1e-3, next, "", k + 1 < 5));
        const train::StepReport r = deferred.step->run(k, 1e-3, next, "", k + 1 < 5);
        EXPECT_TRUE(r.pending);
        EXPECT_EQ(r.examples, 4);
      }
      EXPECT_GT(want[0].grad_norm, 1.0) << "clipping is what this checks";
      const std::vector<train::StepReport> got = deferred.step->settle();
      ASSERT_EQ(got.size(), 5u);
      for (size_t k = 0; k < got.size(); ++k) {
        EXPECT_EQ(got[k].step, static_cast<int64_t>(k));
        EXPECT_FALSE(got[k].pending);
        EXPECT_TRUE(got[k].applied);
        EXPECT_NEAR(got[k].loss, want[k].loss, 1e-12 * std::fabs(want[k].loss)) << k;
        EXPECT_NEAR(got[k].grad_norm, want[k].grad_norm, 1e-12 * want[k].grad_norm) << k;
        EXPECT_EQ(got[k].mlm_correct, want[k].mlm_correct) << k;
        EXPECT_EQ(got[k].nsp_correct, want[k].nsp_correct) << k;
        EXPECT_GT(got[k].t_total, 0.0) << k;
      }
      EXPECT_TRUE(deferred.step->settle().empty());
      EXPECT_EQ(deferred.params(), eager.params());

      // A NaN weight: the steps it spoils change nothing; the read names the first of them.
      // (a LayerNorm weight: read in fp32, whatever the precision)
      const auto& ps = deferred.m->table().params();
      const auto w = std::find_if(ps.begin(), ps.end(), [](const model::ParamInfo& p) {
        return p.name.find("LayerNorm.weight") != std::string::npos;
      });
      ASSERT_NE(w, ps.end());
      const float nan = std::nanf("");
      own.to_device(deferred.m->params() + w->offset, &nan, sizeof nan);
      const std::vector<float> before = deferred.params();
      for (int64_t k = 5; k < 7; ++k) EXPECT_TRUE(deferred.step->run(k, 1e-3, next, "").pending);
      try {
        deferred.step->settle();
        ADD_FAILURE() << "a step with non-finite gradients was settled";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("step 5: gradients are not finite"), std::string::npos)
            << e.what();
      }
      const std::vector<float> after = deferred.params();
      ASSERT_EQ(after.size(), before.size());
      EXPECT_EQ(std::memcmp(after.data(), before.data(), after.size() * sizeof(float)), 0);
    }
}

// fp16's loss scale on the device: deferred steps with the loss scaler on (kernels::GradientGate
// carries the scale and the update count; backward's factor reads the scale where it runs) equal
// the eager steps on the CPU bit for bit, through a growth and a skip. The scale starts at 1024
// and grows after 2 good steps; step 2's gradients are made NaN (a LayerNorm weight, restored
// after it), so it is skipped and the scale backs off: scales 1024, 1024, 2048, 1024, 1024, 2048.
// The skipped step is not an update (AdamW's and LAMB's bias corrections after it count 5 of
// 6), and settle() reports each step's scale and skip as the eager run did; the loss scaler's
// state after settle() (its replay of the device's decisions) is the eager one's.
TEST(DeviceModel, DeferredFp16StepsKeepTheLossScaleOnTheDevice) {
  const OwnMemoryBackend own;
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::Batch batch = test::random_batch(c, 4, 32, 5);
  const auto next = test::same_batch(batch);
  train::LossScaler::Config sc;
  sc.enabled = true;
  sc.init = 1024.0f;
  sc.growth_interval = 2;
  for (auto kind : {train::OptimizerKind::AdamW, train::OptimizerKind::Lamb}) {
    SCOPED_TRACE(train::optimizer_name(kind));
    model::ModelDims d{batch.B, batch.T, batch.P};
    d.precision = Precision::FP16;
    DeferredRun eager(cpu_backend(), c, d, kind, sc);  // (host memory: never deferred)
    DeferredRun deferred(own, c, d, kind, sc);
    ASSERT_FALSE(eager.step->deferring());
    ASSERT_TRUE(deferred.step->deferring());
    const auto& ps = eager.m->table().params();
    const auto w = std::find_if(ps.begin(), ps.end(), [](const model::ParamInfo& p) {
      return p.name.find("LayerNorm.weight") != std::string::npos;
    });
    ASSERT_NE(w, ps.end());
    std::vector<train::StepReport> want;
    const int64_t steps = 6, spoiled = 2;
    for (int64_t k = 0; k < steps; ++k) {
      const float nan = std::nanf("");
      float kept = 0;
      if (k == spoiled) {
        kept = eager.m->params()[w->offset];
        eager.m->params()[w->offset] = nan;
        own.to_device(deferred.m->params() + w->offset, &nan, sizeof nan);
      }
      want.push_back(eager.step->run(k, 1e-3, next, "", k + 1 < steps));
      EXPECT_TRUE(deferred.step->run(k, 1e-3, next, "", k + 1 < steps).pending);
      if (k == spoiled) {
        eager.m->params()[w->offset] = kept;
        own.to_device(deferred.m->params() + w->offset, &kept, sizeof kept);
      }
    }
    const std::vector<train::StepReport> got = deferred.step->settle();
    ASSERT_EQ(got.size(), static_cast<size_t>(steps));
    const float scales[] = {1024, 1024, 2048, 1024, 1024, 2048};
    for (int64_t k = 0; k < steps; ++k) {
      SCOPED_TRACE(k);
      EXPECT_EQ(want[k].loss_scale, scales[k]);
      EXPECT_EQ(got[k].loss_scale, scales[k]);
      EXPECT_EQ(got[k].applied, k != spoiled);
      EXPECT_EQ(want[k].applied, k != spoiled);
      if (k != spoiled) {
        EXPECT_NEAR(got[k].loss, want[k].loss, 1e-12 * std::fabs(want[k].loss));
        EXPECT_NEAR(got[k].grad_norm, want[k].grad_norm, 1e-12 * want[k].grad_norm);
      }
    }
    EXPECT_EQ(deferred.params(), eager.params());
    EXPECT_EQ(deferred.opt->steps(), steps - 1);
    EXPECT_EQ(eager.opt->steps(), steps - 1);
    EXPECT_EQ(deferred.scaler->scale(), eager.scaler->scale());
    EXPECT_EQ(deferred.scaler->good_steps(), eager.scaler->good_steps());
    EXPECT_EQ(deferred.scaler->skipped(), 1);
    EXPECT_EQ(eager.scaler->skipped(), 1);
  }
}

// More deferred steps than a read keeps: 5 steps of 50 micro-batches make 152 marks each, so
// the 512 kept hold 3; run() reads those on its own before the fourth and keeps their reports,
// and settle() returns every step's, in order, with the same losses and parameters as the eager
// steps (a tiny model: a layer of 16, 2 x 8 tokens).
TEST(DeviceModel, DeferredStepsPastTheRingsAreReadOnTheirOwn) {
  const OwnMemoryBackend own;
  const model::BertConfig c = test::small_bert(300, 16, 1, 2, 32, 16);
  const model::Batch batch = test::random_batch(c, 2, 8, 5);
  const auto next = test::same_batch(batch);
  const int64_t steps = 5, accumulation = 50;
  auto train = [&](const Backend& be, std::vector<double>& losses) {
    model::ModelDims d{batch.B, batch.T, batch.P};
    model::BertModel m(c, model::Head::Pretraining, d, be);
    m.init_params(11);
    train::Optimizer opt(train::param_slices(m.table()), m.table().total(), {}, be);
    train::LossScaler scaler{train::LossScaler::Config{}};
    comm::SingleProcess single;
    train::StepSettings ss;
    ss.accumulation = accumulation;
    ss.defer = true;
    train::Step step(m, opt, scaler, single, ss);
    for (int64_t k = 0; k < steps; ++k) {
      const train::StepReport r = step.run(k, 1e-3, next, "", k + 1 < steps);
      if (!r.pending) losses.push_back(r.loss);
    }
    for (const train::StepReport& r : step.settle()) {
      EXPECT_EQ(r.step, static_cast<int64_t>(losses.size()));
      losses.push_back(r.loss);
    }
    std::vector<float> p(static_cast<size_t>(m.table().total()));
    be.to_host(p.data(), m.params(), p.size() * sizeof(float));
    return p;
  };
  std::vector<double> eager, deferred;
  EXPECT_EQ(train(own, deferred), train(cpu_backend(), eager));
  ASSERT_EQ(deferred.size(), static_cast<size_t>(steps));
  ASSERT_EQ(eager.size(), static_cast<size_t>(steps));
  for (size_t k = 0; k < eager.size(); ++k)
    EXPECT_NEAR(deferred[k], eager[k], 1e-12 * std::fabs(eager[k])) << k;
}

// On a backend with memory of its own (a GPU's) a step reads and stages each micro-batch after
// the first while the kernels still run the backward before it, and the next step's first
// with `ahead`: its copy runs beside them, into the input slot the batch before last used.
// OwnMemoryBackend runs each copy as late as a GPU's copy stream may (when the batch's forward
// starts using it) and fails an upload into a slot not yet released, so the staging memory or
// a slot reused too early changes what the kernels read. Every micro-batch differs: 3 steps of
// 2, in fp32, bf16 and fp16, unpadded and padded, AdamW: the same parameters as the CPU's, which
// reads each batch when it runs it, bit for bit; the reads happen in the same order, five of the
// six copies are issued during a backward, and the reads made while the device was busy count
// as hidden input time, not as input wait.
TEST(DeviceModel, StepsStageTheNextBatchDuringBackwardAndEqualTheCpu) {
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  std::vector<model::Batch> batches;
  int64_t P = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    batches.push_back(test::random_batch(c, 4, 32, seed));
    P = std::max(P, batches.back().P);
  }
  for (int precision = 0; precision < 3; ++precision)
    for (bool unpadded : {true, false}) {
      if (precision == 1 && !gemm_bf16_available()) continue;  // (AVX2 CPUs: bf16 does not run)
      SCOPED_TRACE(testing::Message() << "precision " << precision << " unpadded " << unpadded);
      const OwnMemoryBackend own;  // (FP16 as the CPU's: fp32 products)
      auto train = [&](const Backend& be, std::vector<int>& reads) {
        model::ModelDims d{4, 32, P};
        d.precision = static_cast<Precision>(precision);  // 0 fp32, 1 bf16, 2 fp16
        d.unpadded = unpadded;
        model::BertModel m(c, model::Head::Pretraining, d, be);
        m.init_params(11);
        train::Optimizer opt(train::param_slices(m.table()), m.table().total(),
                             train::OptimizerConfig{}, be);
        train::LossScaler scaler{train::LossScaler::Config{}};
        comm::SingleProcess single;
        train::StepSettings ss;
        ss.accumulation = 2;
        ss.seed = 9;
        train::Step step(m, opt, scaler, single, ss);
        size_t taken = 0;
        for (int64_t k = 0; k < 3; ++k) {
          const train::StepReport r = step.run(
              k, 1e-3,
              [&](model::Batch& b) {
                // Which batch, read ahead for the next step (+100) or not.
                reads.push_back(static_cast<int>(taken) + (step.reading_ahead() ? 100 : 0));
                b = batches.at(taken++);
                return true;
              },
              "", k + 1 < 3);
          EXPECT_FALSE(r.interrupted);
          EXPECT_EQ(step.holds_next(), be.host_memory() ? false : k + 1 < 3) << k;
          // The reads behind a busy device are hidden (OwnMemoryBackend::busy): all but the
          // first step's first.
          if (be.host_memory()) {
            EXPECT_EQ(r.t_input_hidden, 0.0);
          } else {
            EXPECT_GT(r.t_input_hidden, 0.0) << k;
            if (k > 0) {
              EXPECT_EQ(r.t_input, 0.0) << k;
            }
          }
        }
        EXPECT_EQ(taken, batches.size());
        std::vector<float> p(static_cast<size_t>(m.table().total()));
        be.to_host(p.data(), m.params(), p.size() * sizeof(float));
        return p;
      };
      std::vector<int> own_reads, cpu_reads;
      EXPECT_EQ(train(own, own_reads), train(cpu_backend(), cpu_reads));
      EXPECT_EQ(own_reads, (std::vector<int>{0, 1, 102, 3, 104, 5}));
      EXPECT_EQ(cpu_reads, (std::vector<int>{0, 1, 2, 3, 4, 5}));
      EXPECT_EQ(own.uploads(), 6);
      EXPECT_EQ(own.uploads_in_backward(), 5);
      EXPECT_EQ(own.blocks(), 0u);
    }
}

// FP16 on a backend whose products take fp16 operands (a GPU's; OwnMemoryBackend multiplies
// what a GPU's linear layers would and runs the GPU's fp16 attention flow, gpu_attention_16.h):
// the model plans the fp16 weight copy and the operand scratch (group "fp16"), the optimizer's
// update writes the copy (after every applied step it is the updated parameters rounded to
// fp16, bit for bit: forward does not refresh it), and 40 steps with the loss scaler track the
// CPU's FP16 (fp32 products on the kept fp16 values) within 1e-3 a step (measured: 2.2e-5
// AdamW, 4.3e-6 LAMB; the weights', output gradients', dropped probabilities' and dS's fp16
// rounding is 2^-11 relative, as the kept activations' already is) while the loss falls, AdamW
// and LAMB.
TEST(DeviceModel, Fp16OperandsTrackTheCpuAndTheUpdateWritesTheCopy) {
  const OwnMemoryBackend own(0, true);
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  for (auto kind : {train::OptimizerKind::AdamW, train::OptimizerKind::Lamb}) {
    SCOPED_TRACE(train::optimizer_name(kind));
    int64_t applied = 0;
    const auto dev =
        test::loss_curve(own, c, Precision::FP16, 40, kind,
                         [&](const model::BertModel& m, const train::StepReport& r) {
                           ASSERT_TRUE(m.dims().fp16_operands);
                           ASSERT_GT(m.plan().group_bytes("fp16"), 2u * m.table().total());
                           if (!r.applied) return;
                           ++applied;
                           const int64_t n = m.table().total();
                           std::vector<float> p(static_cast<size_t>(n));
                           std::vector<uint16_t> copy(p.size()), want(p.size());
                           own.to_host(p.data(), m.params(), p.size() * sizeof(float));
                           own.to_host(copy.data(), m.weights16(), copy.size() * sizeof(uint16_t));
                           convert_f32_to_f16(p.data(), want.data(), p.size());
                           ASSERT_EQ(copy, want);
                         });
    EXPECT_GT(applied, 30);
    const auto cpu = test::loss_curve(cpu_backend(), c, Precision::FP16, 40, kind);
    const double worst = test::worst_relative(dev, cpu);
    std::printf(
        "%s: fp16 operands vs the CPU's fp16 over 40 steps: worst relative loss "
        "difference %.2e (loss %.4f -> %.4f)\n",
        train::optimizer_name(kind), worst, dev.front(), dev.back());
    EXPECT_LT(worst, 1e-3);
    EXPECT_LT(dev.back(), dev.front() - 0.1);
  }
  // One forward and backward (no loss scale): every gradient within the bound the GPU's
  // CudaModel.ForwardBackwardEqualsCpu allows fp16 against the CPU (test::grads_close at 3e-2),
  // padded and unpadded, with either attention kernel (the GPU's blocked one a block of 128
  // query rows at a time: 150 tokens are two blocks).
  const model::BertConfig c_long = test::small_bert(300, 64, 2, 4, 256, 160);
  const model::Batch batch = test::random_batch(c, 4, 32, 5),
                     long_batch = test::random_batch(c_long, 2, 150, 8);
  for (auto kernel : {model::ModelDims::Attention::Full, model::ModelDims::Attention::Blocked})
    for (bool unpadded : {false, true}) {
      const bool full = kernel == model::ModelDims::Attention::Full;
      SCOPED_TRACE(testing::Message()
                   << (full ? "full" : "blocked") << (unpadded ? " unpadded" : " padded"));
      const model::Batch& b = full ? batch : long_batch;
      const model::BertConfig& cfg = full ? c : c_long;
      model::ModelDims d{b.B, b.T, b.P};
      d.precision = Precision::FP16;
      d.unpadded = unpadded;
      d.attention = kernel;
      const StepRun dev = step(own, cfg, model::Head::Pretraining, d, b),
                    cpu = step(cpu_backend(), cfg, model::Head::Pretraining, d, b);
      EXPECT_NEAR(dev.losses.loss, cpu.losses.loss, 3e-2 * std::fabs(cpu.losses.loss));
      EXPECT_TRUE(test::grads_close(model::ParamTable(cfg, model::Head::Pretraining),
                                    dev.grads.data(), cpu.grads.data(), 3e-2));
    }
  // The CPU's FP16 has no copy: its products are fp32.
  model::ModelDims d{4, 32, 5};
  d.precision = Precision::FP16;
  const model::BertModel host(c, model::Head::Pretraining, d);
  EXPECT_FALSE(host.dims().fp16_operands);
  EXPECT_EQ(host.weights16(), nullptr);
  EXPECT_EQ(host.plan().group_bytes("fp16"), 0u);
}

// The bounds CudaBackend's tests hold the GPU's fp16 to against the CPU's (4e-3 of the max:
// LinearLayersMatchCpuInEveryPrecision, AttentionMatchesCpuInEveryPrecision, same shapes and
// inputs), met by the host's model of the GPU's fp16 (the fp16-operand test backend: fp16
// products, dropped probabilities and dS rounded to fp16; measured: within a tenth of them), so
// a GPU run that fails them has a bug, not a tolerance too tight for fp16 operands.
TEST(DeviceModel, Fp16OperandLayersMeetTheGpuTestsBounds) {
  const OwnMemoryBackend own(0, true);
  // A host vector and its copy in the backend's memory.
  struct Twin {
    const Backend& be;
    std::vector<float> h;
    void* d;
    Twin(const Backend& b, std::vector<float> v) : be(b), h(std::move(v)) {
      d = be.allocate(std::max<size_t>(h.size(), 1) * 4);
      be.to_device(d, h.data(), h.size() * 4);
    }
    ~Twin() { be.release(d); }
    float* f32() { return static_cast<float*>(d); }
    uint16_t* u16() { return static_cast<uint16_t*>(d); }
    std::vector<float> back() const {
      std::vector<float> v(h.size());
      be.to_host(v.data(), d, v.size() * 4);
      return v;
    }
  };
  const double t = 4e-3;
  {
    const int64_t M = 70, N = 48, K = 96;
    using test::random_vector;
    std::vector<float> in = random_vector(M * K, 1), w = random_vector(N * K, 2, 0.1f),
                       bias = random_vector(N, 3), dout = random_vector(M * N, 4), out(M * N),
                       dinp = random_vector(M * K, 5), dw = random_vector(N * K, 6),
                       db = random_vector(N, 7);
    Twin din(own, in), dw_(own, w), dbias(own, bias), ddout(own, dout), dout_(own, out),
        ddinp(own, dinp), ddw(own, dw), ddb(own, db), w16(own, std::vector<float>(N * K)),
        in16(own, std::vector<float>(M * K)), a16(own, std::vector<float>(M * std::max(N, K))),
        b16(own, std::vector<float>(M * K)), wide(own, std::vector<float>(M * K));
    std::vector<uint16_t> in16_h(M * K), scratch(M * std::max(N, K));
    std::vector<float> wide_h(M * K);
    const Backend& cpu = cpu_backend();
    // CPU fp16: fp32 products on the kept fp16 input
    Kept xh{in.data(), in16_h.data()};
    cpu.keep(Precision::FP16, xh, M * K);
    const Workspace wsh{scratch.data(), scratch.data(), wide_h.data()};
    cpu.linear_forward(Precision::FP16, out.data(), xh, Weight{w.data(), nullptr}, bias.data(), M,
                       N, K, wsh);
    cpu.linear_backward(Precision::FP16, dinp.data(), dw.data(), db.data(), dout.data(), xh,
                        Weight{w.data(), nullptr}, M, N, K, true, wsh);
    // the GPU's: fp16 operands
    own.copy_weights(Precision::FP16, dw_.f32(), w16.u16(), N * K);
    const Kept x{din.f32(), in16.u16()};
    own.keep(Precision::FP16, x, M * K);
    const Weight wt{dw_.f32(), w16.u16()};
    const Workspace ws{a16.u16(), b16.u16(), wide.f32()};
    own.linear_forward(Precision::FP16, dout_.f32(), x, wt, dbias.f32(), M, N, K, ws);
    own.linear_backward(Precision::FP16, ddinp.f32(), ddw.f32(), ddb.f32(), ddout.f32(), x, wt, M,
                        N, K, true, ws);
    EXPECT_TRUE(test::all_close("out", dout_.back().data(), out.data(), M * N, t, t));
    EXPECT_TRUE(test::all_close("dinp", ddinp.back().data(), dinp.data(), M * K, t, t));
    EXPECT_TRUE(test::all_close("dw", ddw.back().data(), dw.data(), N * K, t, t));
    EXPECT_TRUE(test::all_close("db", ddb.back().data(), db.data(), N, 2e-5, 2e-5));
    std::vector<uint16_t> copy(N * K), want(N * K);  // the products read the fp16 copy
    own.to_host(copy.data(), w16.d, copy.size() * 2);
    convert_f32_to_f16(w.data(), want.data(), want.size());
    EXPECT_EQ(copy, want);
  }
  {
    const AttentionShape s{2, 40, 64, 4};
    const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, n_qkv = B * T * 3 * C, n_p = B * NH * T * T;
    std::vector<float> mask_f(B * T, 0.0f);
    std::vector<int32_t> mask(B * T, 1);
    for (int64_t t2 = 31; t2 < T; ++t2) mask[T + t2] = 0;
    std::memcpy(mask_f.data(), mask.data(), mask.size() * 4);
    const Dropout d{0.1f, 5, 11, nullptr};
    std::vector<float> qkv = test::random_vector(n_qkv, 1), ctx(B * T * C),
                       dctx = test::random_vector(B * T * C, 2), dqkv(n_qkv), work(n_p),
                       wide_h(n_qkv);
    std::vector<uint16_t> qkv16(n_qkv), probs16(n_p), s16(n_p), dctx16(B * T * C);
    Twin dm(own, mask_f), dq(own, qkv), dc(own, ctx), ddc(own, dctx), ddq(own, dqkv),
        dwork(own, work), dwide(own, wide_h), dq16(own, std::vector<float>(n_qkv)),
        dp16(own, std::vector<float>(n_p)), ds16(own, std::vector<float>(n_p)),
        ddc16(own, std::vector<float>(B * T * C));
    // Forward and backward on one side: its work buffers, 16-bit operand buffers and kept bits.
    auto run = [&](const Backend& be, float* ctx_, float* dqkv_, const float* dctx_, Kept x,
                   const int32_t* m, float* work_, uint16_t* ops16, uint16_t* dctx16_, float* wide_,
                   uint16_t* kept16) {
      Workspace ws;
      ws.attn_work = work_;
      ws.attn_probs16 = ops16;
      ws.attn_dctx16 = dctx16_;
      ws.wide = wide_;
      AttentionSaved saved;
      saved.probs16 = kept16;
      be.attention_forward(Precision::FP16, ctx_, saved, x, m, s, d, ws);
      be.attention_backward(Precision::FP16, dqkv_, dctx_, x, saved, m, s, d, ws);
    };
    run(cpu_backend(), ctx.data(), dqkv.data(), dctx.data(), Kept{qkv.data(), qkv16.data()},
        mask.data(), work.data(), s16.data(), dctx16.data(), wide_h.data(), probs16.data());
    run(own, dc.f32(), ddq.f32(), ddc.f32(), Kept{dq.f32(), dq16.u16()},
        reinterpret_cast<const int32_t*>(dm.d), dwork.f32(), ds16.u16(), ddc16.u16(), dwide.f32(),
        dp16.u16());
    EXPECT_TRUE(test::all_close("ctx", dc.back().data(), ctx.data(), ctx.size(), t, t));
    EXPECT_TRUE(test::all_close("dqkv", ddq.back().data(), dqkv.data(), n_qkv, t, t));
    std::vector<uint16_t> ds(n_p);  // the GPU's flow left dS in fp16 in the operand buffer
    own.to_host(ds.data(), ds16.d, ds.size() * 2);
    EXPECT_GT(std::count_if(ds.begin(), ds.end(), [](uint16_t b) { return (b & 0x7fff) != 0; }),
              n_p / 2);
  }
}

// Checkpoints cross: saved from the backend's memory, loaded into it, byte for byte; and a
// sharded fp32 master (holes in the arena) is refused with its reason.
TEST(DeviceModel, CheckpointsCrossAndHolesAreRefused) {
  const OwnMemoryBackend own;
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::ModelDims d{2, 16, 3};
  test::TempDir tmp;
  {
    model::BertModel dev(c, model::Head::Pretraining, d, own);
    dev.init_params(3);
    model::save_pretrained(dev, tmp / "dev");
    model::BertModel host(c, model::Head::Pretraining, d);
    host.init_params(3);
    model::save_pretrained(host, tmp / "host");
    EXPECT_EQ(test::read_file(tmp / "dev/model.safetensors"),
              test::read_file(tmp / "host/model.safetensors"));
    model::BertModel back(c, model::Head::Pretraining, d, own);
    model::load_safetensors_into(back, tmp / "host/model.safetensors");
    std::vector<float> got(static_cast<size_t>(back.table().total()));
    own.to_host(got.data(), back.params(), got.size() * sizeof(float));
    EXPECT_EQ(got, std::vector<float>(host.params(), host.params() + host.table().total()));
  }
  model::ModelDims sharded = d;
  sharded.precision = Precision::BF16;
  sharded.master_shard = true;
  sharded.master_begin = 0;
  sharded.master_end = 4096;
  const std::string e =
      test::error_of([&] { model::BertModel m(c, model::Head::Pretraining, sharded, own); });
  EXPECT_NE(e.find("sharded fp32 master"), std::string::npos) << e;
}

// The plan of a run on a GPU, made without one (cuda::target(): what `estimate --device cuda`
// prints): the CPU plan's model groups for the same attention kernel (auto picks full at 64
// tokens in fp32, blocked at 512, and full in bf16 and fp16 at every length up to 512 on a GPU;
// blocked asked for runs fused there in bf16 and fp16), the CUDA kernels' scratch instead of the
// CPU's, and the batch arrays staged in device memory.
TEST(DeviceMemory, TheCudaPlanHoldsItsKernelsScratchAndTheBatch) {
  using Attention = model::ModelDims::Attention;
  model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 512);
  for (int precision = 0; precision < 3; ++precision)
    for (int64_t T : {64, 512})
      for (Attention asked : {Attention::Auto, Attention::Blocked}) {
        if (precision == 0 && asked == Attention::Blocked) continue;
        SCOPED_TRACE(testing::Message() << "precision " << precision << " T " << T << " "
                                        << model::attention_name(asked));
        model::ModelDims d{8, T, 10};
        d.precision = static_cast<Precision>(precision);  // 0 fp32, 1 bf16, 2 fp16
        d.attention = asked;
        const bool blocked = asked == Attention::Blocked || (precision == 0 && T == 512),
                   fused = blocked && precision != 0;  // head 16, T <= 512
        const model::ModelDims on_gpu = model::on_backend(d, c, cuda::target());
        EXPECT_EQ(on_gpu.blocked_attention(), blocked);
        EXPECT_EQ(on_gpu.fused_attention, fused);
        model::ModelDims on_cpu = d;
        on_cpu.attention = on_gpu.attention;
        const MemoryPlan gpu =
            model::BertModel::make_plan(c, model::Head::Pretraining, d, cuda::target());
        const MemoryPlan cpu = model::BertModel::make_plan(c, model::Head::Pretraining, on_cpu);
        // FP16 multiplies fp16 operands on a GPU: BF16's group in fp16 (the weights' copy and the
        // operands rounded on the way in), the two LayerNorm outputs' fp16 copies [8 T, 64] of
        // each of the 2 layers kept for backward, and of the widened tensors the CPU's fp32
        // kernels read only forward's fp32 context [8 T, 64]. The fused kernel reads dctx's
        // 16-bit copy [8 T, 64] that the output projection's product writes alone
        // (ModelDims::qkv16_output), as the CPU's blocked products read theirs: the same copy.
        // A GPU's 16-bit group holds the projections' 16-bit output [8 T, 64] too, which the
        // residual LayerNorms read (ModelDims::proj16_output; the CPU's read fp32).
        const int64_t N = 8 * T, C = 64, I = 256;
        const size_t proj16 = precision != 0 ? N * C * 2 : 0;
        for (const char* g : {"parameters", "gradients"})
          EXPECT_EQ(gpu.group_bytes(g), cpu.group_bytes(g)) << g;
        EXPECT_EQ(gpu.group_bytes("activations"),
                  cpu.group_bytes("activations") + (d.fp16() ? 2 * 2 * N * C * 2 : 0));
        EXPECT_EQ(on_gpu.qkv16_output, precision != 0 && (fused || !blocked));
        model::ModelDims as_bf16 = on_cpu;
        if (d.fp16()) as_bf16.precision = Precision::BF16;
        EXPECT_EQ(on_gpu.proj16_output, precision != 0);
        EXPECT_EQ(gpu.group_bytes("bf16"), cpu.group_bytes("bf16") + (d.bf16() ? proj16 : 0));
        EXPECT_EQ(gpu.group_bytes("fp16"),
                  d.fp16() ? model::BertModel::make_plan(c, model::Head::Pretraining, as_bf16)
                                     .group_bytes("bf16") +
                                 proj16
                           : 0u);
        EXPECT_EQ(cpu.group_bytes("fp16"), 0u);
        EXPECT_EQ(gpu.group_bytes("scratch") + (d.fp16() ? (N * I - N * C) * 4 : 0),
                  cpu.group_bytes("scratch"));
        // A slot for the batch the kernels read and one for the next, copied in beside them.
        EXPECT_EQ(gpu.group_bytes("input"), kInputSlots * model::input_bytes(d));
        EXPECT_EQ(cpu.group_bytes("input"), 0u);
        // cuBLASLt's workspace; full attention: [B, NH, T, T] fp32 scores in 16 bits, backward's
        // dropped probabilities in fp32, the probabilities' fp32 gradients; blocked: a block of 128
        // query rows of each for every (sequence, head): fp32 scores and gradients, and two
        // operand buffers (the dropped probabilities, dS) in the products' elements; fused: none
        // (each row's D is computed where it is needed); the reductions' partial sums; a loss and
        // a hit for each of the most rows a loss sees.
        const ScratchLayout l =
            model::plan_kernel_scratch(c, model::Head::Pretraining, d, cuda::target());
        const int64_t probs = 8 * 4 * T * T * 4, block = 8 * 4 * 128 * T * 4;
        EXPECT_EQ(l.part[cuda::kMatmulWorkspaceSlot], int64_t{32} << 20);
        if (fused) {
          EXPECT_EQ(l.part[cuda::kAttentionScoresSlot], 0);
          EXPECT_EQ(l.part[cuda::kAttentionGradSlot], 0);
          EXPECT_EQ(l.part[cuda::kAttentionDroppedSlot], 0);
        } else if (blocked) {
          EXPECT_EQ(l.part[cuda::kAttentionScoresSlot], block);
          EXPECT_EQ(l.part[cuda::kAttentionGradSlot], block);
          EXPECT_EQ(l.part[cuda::kAttentionDroppedSlot], precision == 0 ? 2 * block : block);
        } else {
          EXPECT_EQ(l.part[cuda::kAttentionScoresSlot], precision == 0 ? 0 : probs);
          EXPECT_EQ(l.part[cuda::kAttentionDroppedSlot], precision == 0 ? probs : 0);
          EXPECT_EQ(l.part[cuda::kAttentionGradSlot], probs);
        }
        // 3 pointers a (sequence, head) pair and product, 4 products a table (the full kernel's
        // backward makes its 4 products' at once), 64 tables kept (cuda.h, pair_pointers).
        EXPECT_EQ(l.part[cuda::kAttentionPointersSlot], fused ? 0 : 64 * 4 * 3 * 8 * 4 * 8);
        EXPECT_EQ(l.part[cuda::kReductionSlot], 2 * 1024 * 8);
        EXPECT_EQ(l.part[cuda::kCrossEntropySlot], 2 * 8 * T * 4);
        const model::ParamTable table(c, model::Head::Pretraining);  // the optimizer's tensors
        EXPECT_EQ(
            l.part[cuda::kMultiTensorSlot],
            cuda::multi_tensor_bytes(table.total(), static_cast<int64_t>(table.params().size())));
        // Column sums' partials: the widest bias gradient (the intermediate layer's 256 columns)
        // over its 8 x T rows in chunks of 32, more than LayerNorm's three of 64 columns, and
        // more than the fused attention's backward needs for QKV's bias gradient (a row of 3 x 64
        // partial sums for every tile of 64 rows of the 8 sequences; the slot holds the larger).
        ASSERT_LT(8 * (T / 64) * 192, (8 * T / 32) * 256);
        EXPECT_EQ(l.part[cuda::kColumnSumsSlot], (8 * T / 32) * 256 * 4);
        // Their tickets (column_tickets.cuh): one a tile of 256 columns of the widest bias, the
        // masked-LM decoder's over the vocabulary of 300: 2; fused, one for each head's Q, K and V
        // columns: 12.
        EXPECT_EQ(l.part[cuda::kColumnTicketsSlot], (fused ? 12 : 2) * 4);
        // Embedding backward's partial rows: at most 2 per 64 of the 8 x T tokens, 64 columns.
        EXPECT_EQ(l.part[cuda::kEmbeddingSlot], 2 * (8 * T / 64) * 64 * 4);
        EXPECT_EQ(gpu.group_bytes("kernels"), static_cast<size_t>(l.total()));
      }
}

// Everything a model, its optimizer and a training step hold on a device is the plan's: the
// most the backend ever held equals the training plan, byte for byte (nothing allocated on the
// way: the batch arrays go to the planned input region), padded and unpadded.
TEST(DeviceMemory, TrainingStepsHoldExactlyThePlan) {
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::Batch batch = test::random_batch(c, 4, 32, 5);
  for (bool unpadded : {false, true}) {
    SCOPED_TRACE(unpadded ? "unpadded" : "padded");
    const OwnMemoryBackend own;
    model::ModelDims d{batch.B, batch.T, batch.P};
    d.unpadded = unpadded;
    size_t planned = 0;
    {
      model::BertModel m(c, model::Head::Pretraining, d, own);
      m.init_params(11);
      train::Optimizer opt(train::param_slices(m.table()), m.table().total(), {}, own);
      train::LossScaler scaler{train::LossScaler::Config{}};
      comm::SingleProcess single;
      train::Step step(m, opt, scaler, single, train::StepSettings{});
      for (int64_t k = 0; k < 2; ++k) step.run(k, 1e-3, test::same_batch(batch));
      planned = plan::training_plan(c, model::Head::Pretraining, m.dims(), 2, 1, own).total_bytes();
      EXPECT_EQ(m.allocated_bytes() + opt.allocated_bytes(), planned);
    }
    EXPECT_EQ(own.peak(), planned);
    EXPECT_EQ(own.in_use(), 0u);
  }
}

// A batch too large for the device is named before anything is allocated, with the largest
// batch that fits, which then runs; an allocation that fails anyway names the model's group.
TEST(DeviceMemory, ABatchTooLargeIsNamedWithTheLargestThatFits) {
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  auto dims = [](int64_t batch) { return model::ModelDims{batch, 32, 5}; };
  const OwnMemoryBackend unbounded;
  auto planned = [&](int64_t batch) {
    return plan::training_plan(c, model::Head::Pretraining, dims(batch), 2, 1, unbounded)
        .total_bytes();
  };
  const OwnMemoryBackend own(planned(4) + static_cast<size_t>(plan::kDeviceHeadroom) + 1000);
  const std::string e = test::error_of(
      [&] { plan::check_device_fits(c, model::Head::Pretraining, dims(16), 2, 1, own); });
  for (const char* want : {"batch 16 x 32 tokens needs", "on the own-memory device (activations",
                           "the largest batch that fits is 4 (--batch-size 4)",
                           "`bertrain estimate --device own-memory` prints the plan"})
    EXPECT_NE(e.find(want), std::string::npos) << want << "\n" << e;
  EXPECT_EQ(own.in_use(), 0u);
  plan::check_device_fits(c, model::Head::Pretraining, dims(4), 2, 1, own);
  EXPECT_EQ(
      test::backend_step(own, c, model::Head::Pretraining, dims(4), test::random_batch(c, 4, 32, 5))
          .grads.size(),
      static_cast<size_t>(model::ParamTable(c, model::Head::Pretraining).total()));
  EXPECT_EQ(plan::max_batch_for_budget(c, model::Head::Pretraining, dims(1), 2,
                                       plan::device_budget(*own.device_memory()), 1, {}, own),
            4);

  // Room for the parameters and gradients only: the activations' allocation fails, named.
  const MemoryPlan p = model::BertModel::make_plan(c, model::Head::Pretraining, dims(4), own);
  const OwnMemoryBackend tight(p.group_span("parameters") + p.group_span("gradients") + 4096);
  const std::string a =
      test::error_of([&] { model::BertModel m(c, model::Head::Pretraining, dims(4), tight); });
  EXPECT_NE(a.find("the model's activations ("), std::string::npos) << a;
  EXPECT_NE(a.find("on the own-memory device: out of own-memory device memory"), std::string::npos)
      << a;
  EXPECT_EQ(tight.in_use(), 0u);  // what was allocated went back
}

}  // namespace
}  // namespace bertrain
