// A model on a backend with memory of its own (what the CUDA backend is), checked on the CPU:
// OwnMemoryBackend runs the CPU's kernels but says its memory is not the host's, hands out its
// own blocks, and fails any kernel call given a pointer outside them. So BertModel's device path
// (its arenas from the backend, parameters written through to_device, the batch arrays staged
// per forward, checkpoints read through to_host) runs here, every pointer a kernel receives is
// proven to be backend memory, and the results equal the plain CPU model's bit for bit (the
// same kernels on the same values).
#include <gtest/gtest.h>

#include <cstdlib>
#include <mutex>

#include "comm/communicator.h"
#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"
#include "model/bert.h"
#include "model/checkpoint.h"
#include "own_memory_backend.h"
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
  for (int precision = 0; precision < 3; ++precision)
    for (bool unpadded : {false, true}) {
      model::ModelDims d{b.B, b.T, b.P};
      d.unpadded = unpadded;
      d.bf16 = precision == 1;
      d.fp16 = precision == 2;
      if (d.bf16 && !gemm_bf16_available()) continue;  // (AVX2 CPUs: bf16 does not run)
      SCOPED_TRACE(testing::Message() << "precision " << precision << " unpadded " << unpadded);
      expect_same(step(own, c, model::Head::Pretraining, d, b),
                  step(cpu_backend(), c, model::Head::Pretraining, d, b));
    }
  EXPECT_EQ(own.blocks(), 0u);  // every block released with its model
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
    d.bf16 = bf16;
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
    for (int64_t k = 0; k < 3; ++k)
      EXPECT_TRUE(step.run(k, 1e-3,
                           [&](model::Batch& b) {
                             b = batch;
                             return true;
                           })
                      .applied);
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
  sharded.bf16 = true;
  sharded.master_shard = true;
  sharded.master_begin = 0;
  sharded.master_end = 4096;
  const std::string e =
      test::error_of([&] { model::BertModel m(c, model::Head::Pretraining, sharded, own); });
  EXPECT_NE(e.find("sharded fp32 master"), std::string::npos) << e;
}

}  // namespace
}  // namespace bertrain
