// Whole-model gradient check by finite differences on a tiny BERT, with dropout ON (the
// counter-based masks are the same in every forward of one step, so the loss is a smooth
// function of the parameters): proves the backward wiring, residuals and the regenerated dropout
// masks together. fp32 with eps 5e-3: bound rtol 5e-3, atol 5e-3 of the largest gradient.
#include <gtest/gtest.h>

#include "model/bert.h"
#include "plan/memory.h"
#include "test_util.h"

namespace bertrain::model {
namespace {

BertConfig tiny_config() {
  BertConfig c = test::small_bert(23, 8, 2, 2, 12, 8);
  c.hidden_dropout_prob = 0.2f;
  c.attention_probs_dropout_prob = 0.2f;
  c.num_labels = 3;
  c.initializer_range = 0.5f;  // large weights: every path carries gradient
  return c;
}

Batch tiny_batch() {
  Batch b;
  b.resize(2, 6, 2);
  b.input_ids = {2, 5, 9, 11, 3, 0, 2, 7, 7, 21, 0, 0};
  b.input_mask = {1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0};
  b.segment_ids = {0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0};
  b.masked_lm_positions = {1, 3, 2, 0};
  b.masked_lm_ids = {4, 17, 8, 0};
  b.masked_lm_weights = {1, 1, 1, 0};
  b.next_sentence_labels = {1, 0};
  b.label_ids = {2, 0};
  return b;
}

void check_fd(Head head) {
  BertModel m(tiny_config(), head, {2, 6, 2});
  m.init_params(5);
  // LayerNorm weights and biases away from 1/0 so their gradients are exercised.
  for (auto& p : m.table().params())
    if (p.init != Init::Normal)
      for (int64_t i = 0; i < p.numel(); ++i) m.params()[p.offset + i] += 0.3f * std::sin(1.0f + i);
  Batch b = tiny_batch();
  if (head == Head::SequenceClassification) b.P = 0;
  StepOptions opt{true, 77, 3, 0};
  m.forward(b, opt);
  m.zero_grads();
  m.backward(b, opt);
  std::vector<float> analytic(m.grads(), m.grads() + m.table().total());
  std::vector<float> x(m.params(), m.params() + m.table().total());
  auto loss = [&] {
    std::copy(x.begin(), x.end(), m.params());
    return m.forward(b, opt).loss;
  };
  auto numeric = test::numeric_grad(x, loss, 5e-3f);
  for (const auto& p : m.table().params())
    EXPECT_TRUE(test::all_close(p.name, analytic.data() + p.offset, numeric.data() + p.offset,
                                p.numel(), 5e-3, 5e-3, 5e-4));
}

TEST(ModelFiniteDifferences, PreTrainingWithDropout) {
  check_fd(Head::Pretraining);
}
TEST(ModelFiniteDifferences, ClassificationWithDropout) {
  check_fd(Head::SequenceClassification);
}

TEST(Model, DropoutIsDeterministicPerStepAndOffInEval) {
  BertModel m(tiny_config(), Head::Pretraining, {2, 6, 2});
  m.init_params(1);
  Batch b = tiny_batch();
  double a = m.forward(b, {true, 1, 0, 0}).loss, a2 = m.forward(b, {true, 1, 0, 0}).loss;
  double c = m.forward(b, {true, 1, 1, 0}).loss;
  double e1 = m.forward(b, {false, 1, 0, 0}).loss, e2 = m.forward(b, {false, 9, 5, 0}).loss;
  EXPECT_EQ(a, a2);
  EXPECT_NE(a, c);
  EXPECT_EQ(e1, e2);
}

TEST(Model, InitialisationIsBertsAndSeeded) {
  BertConfig cfg = tiny_config();
  cfg.initializer_range = 0.02f;
  BertModel m(cfg, Head::Pretraining, {2, 6, 2}), m2(cfg, Head::Pretraining, {2, 6, 2});
  m.init_params(3);
  m2.init_params(3);
  EXPECT_EQ(std::memcmp(m.params(), m2.params(), m.table().total() * 4), 0);
  const auto& w = m.table().at("bert.embeddings.word_embeddings.weight");
  double s = 0, s2 = 0, mx = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    float v = m.params()[w.offset + i];
    s += v;
    s2 += v * v;
    mx = std::max(mx, std::fabs(static_cast<double>(v)));
  }
  EXPECT_LE(mx, 0.04 + 1e-7);  // truncated at 2 std
  const double sd = std::sqrt(s2 / w.numel());
  EXPECT_NEAR(sd, 0.02 * 0.88, 0.004);  // std of N(0,1) truncated at 2 is 0.88
  EXPECT_EQ(m.params()[m.table().offset("bert.embeddings.LayerNorm.weight")], 1.0f);
  EXPECT_EQ(m.params()[m.table().offset("cls.predictions.bias")], 0.0f);
}

TEST(Plan, EstimateIsTheAllocation) {
  BertConfig cfg = tiny_config();
  ModelDims d{4, 6, 2};
  BertModel m(cfg, Head::Pretraining, d);
  MemoryPlan p = plan::training_plan(cfg, Head::Pretraining, d, 2);
  EXPECT_EQ(p.group_bytes("parameters"), m.plan().group_bytes("parameters"));
  EXPECT_EQ(p.group_bytes("activations"), m.plan().group_bytes("activations"));
  // (the two moments, and the step's gate: kernels::GradientGate, one aligned region)
  EXPECT_EQ(p.group_bytes("optimizer"), 2 * p.group_bytes("parameters") + kAlign);
  EXPECT_EQ(p.total_bytes(), m.plan().total_bytes() + p.group_bytes("optimizer"));
  // The batch picker returns the largest batch that fits.
  double budget = static_cast<double>(p.total_bytes());
  EXPECT_EQ(plan::max_batch_for_budget(cfg, Head::Pretraining, d, 2, budget), 4);
  EXPECT_EQ(plan::max_batch_for_budget(cfg, Head::Pretraining, d, 2, budget - 1), 3);
  EXPECT_EQ(plan::max_batch_for_budget(cfg, Head::Pretraining, d, 2, 100), 0);
  // bf16: the same identity with the bf16 group (weight copy, matmul operands) and the
  // activations kept in bf16.
  ModelDims d16{4, 6, 2, Precision::BF16};
  BertModel m16(cfg, Head::Pretraining, d16);
  MemoryPlan p16 = plan::training_plan(cfg, Head::Pretraining, d16, 2);
  EXPECT_EQ(p16.total_bytes(), m16.plan().total_bytes() + p16.group_bytes("optimizer"));
  EXPECT_GT(p16.group_bytes("bf16"), 0u);
  EXPECT_LT(p16.group_bytes("activations"), p.group_bytes("activations"));
}

// The blocked attention keeps the row log-sum-exp instead of the [B,NH,T,T] probabilities and
// needs no [B,NH,T,T] scratch: the plan shrinks by exactly those buffers, in fp32 and bf16, and
// auto picks it from 512 tokens.
TEST(Plan, BlockedAttentionDropsTheProbabilityBuffers) {
  BertConfig cfg = tiny_config();
  const int64_t B = 4, T = 6, NH = cfg.num_attention_heads, L = cfg.num_hidden_layers;
  const size_t probs = B * NH * T * T * sizeof(float), lse = B * NH * T * sizeof(float);
  for (bool bf16 : {false, true}) {
    const Precision p = bf16 ? Precision::BF16 : Precision::FP32;
    const MemoryPlan full =
        BertModel::make_plan(cfg, Head::Pretraining, {B, T, 2, p, ModelDims::Attention::Full});
    const MemoryPlan blocked =
        BertModel::make_plan(cfg, Head::Pretraining, {B, T, 2, p, ModelDims::Attention::Blocked});
    const size_t saved = bf16 ? probs / 2 : probs;  // bf16 saves the probabilities in bf16
    EXPECT_EQ(full.group_bytes("activations") - blocked.group_bytes("activations"),
              L * (saved - lse))
        << (bf16 ? "bf16" : "fp32");
    EXPECT_EQ(full.group_bytes("scratch") - blocked.group_bytes("scratch"), probs);
    if (bf16) {
      EXPECT_EQ(full.group_bytes("bf16") - blocked.group_bytes("bf16"), probs / 2);
    }
  }
  EXPECT_FALSE((ModelDims{8, 384, 20}.blocked_attention()));
  EXPECT_TRUE((ModelDims{8, 512, 20}.blocked_attention()));
  EXPECT_FALSE(
      (ModelDims{8, 512, 20, Precision::FP32, ModelDims::Attention::Full}.blocked_attention()));
  EXPECT_TRUE(
      (ModelDims{8, 128, 20, Precision::FP32, ModelDims::Attention::Blocked}.blocked_attention()));
}

// fp16 storage keeps the tensors bf16 keeps in 16 bits (QKV, probabilities or nothing, context,
// FFN pre-/post-activation), so its activations are smaller than fp32's by exactly half of
// those, and bf16's but for the LayerNorm outputs' two bf16 copies a layer bf16's matmuls read
// (fp16's on a CPU are fp32); it adds one widening buffer and no copy of the weights, and
// estimate plans what the model allocates. Both attention kernels.
TEST(Plan, Fp16KeepsTheBf16TensorsInFp16) {
  BertConfig cfg = tiny_config();
  const int64_t B = 4, T = 6, N = B * T, C = cfg.hidden_size, I = cfg.intermediate_size,
                L = cfg.num_hidden_layers, NH = cfg.num_attention_heads;
  for (auto kernel : {ModelDims::Attention::Full, ModelDims::Attention::Blocked}) {
    const bool full = kernel == ModelDims::Attention::Full;
    const MemoryPlan fp32 =
        BertModel::make_plan(cfg, Head::Pretraining, {B, T, 2, Precision::FP32, kernel});
    const MemoryPlan bf16 =
        BertModel::make_plan(cfg, Head::Pretraining, {B, T, 2, Precision::BF16, kernel});
    const ModelDims d16{B, T, 2, Precision::FP16, kernel};
    const MemoryPlan fp16 = BertModel::make_plan(cfg, Head::Pretraining, d16);
    EXPECT_EQ(fp16.group_bytes("activations") + L * 2 * N * C * sizeof(uint16_t),
              bf16.group_bytes("activations"));
    const size_t halved =
        L * (N * 3 * C + (full ? B * NH * T * T : 0) + N * C + 2 * N * I) * sizeof(float) / 2;
    EXPECT_EQ(fp32.group_bytes("activations") - fp16.group_bytes("activations"), halved);
    EXPECT_EQ(fp16.group_bytes("scratch") - fp32.group_bytes("scratch"),
              N * std::max(I, 3 * C) * sizeof(float));
    EXPECT_EQ(fp16.total_bytes() - fp16.group_bytes("activations") - fp16.group_bytes("scratch"),
              fp32.total_bytes() - fp32.group_bytes("activations") - fp32.group_bytes("scratch"));
    BertModel m(cfg, Head::Pretraining, d16);
    const MemoryPlan p = plan::training_plan(cfg, Head::Pretraining, d16, 2);
    EXPECT_EQ(p.total_bytes(), m.plan().total_bytes() + p.group_bytes("optimizer"));
  }
  // (bf16 and fp16 at once cannot be asked for: ModelDims holds one Precision.)
}

}  // namespace
}  // namespace bertrain::model
