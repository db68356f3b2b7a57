// Layer recomputation (ModelDims::recompute_layers): backward recomputes each encoder layer's
// forward from the layer's input, with the dropout masks regenerated from the same counter RNG,
// so loss and every gradient must equal the stored run's bit for bit, in every precision, with
// both attention kernels and every head; and the plan keeps one layer's activations, not L.
#include <gtest/gtest.h>

#include <cstring>

#include "model/bert.h"
#include "test_util.h"

namespace bertrain::model {
namespace {

BertConfig config() {
  BertConfig c = test::small_bert(40, 16, 3, 2, 32, 16);
  c.hidden_dropout_prob = 0.2f;
  c.attention_probs_dropout_prob = 0.2f;
  c.num_labels = 3;
  return c;
}

Batch batch(Head head) {
  Batch b;
  b.resize(2, 8, head == Head::Pretraining ? 2 : 0);
  b.input_ids = {2, 5, 9, 11, 3, 30, 1, 0, 2, 7, 7, 21, 33, 1, 0, 0};
  b.input_mask = {1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0};
  b.segment_ids = {0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0};
  if (head == Head::Pretraining) {
    b.masked_lm_positions = {1, 3, 2, 5};
    b.masked_lm_ids = {4, 17, 8, 39};
    b.masked_lm_weights = {1, 1, 1, 1};
    b.next_sentence_labels = {1, 0};
  }
  b.label_ids = {2, 0};
  b.token_label_ids = {0, 1, 2, 1, 0, 2, 1, 0, 0, 2, 2, 1, 0, 1, 0, 0};
  b.token_label_weights = {0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0};
  b.span_positions = {2, 3, 4, 5};
  return b;
}

struct StepResult {
  double loss;
  std::vector<float> grads;
};

StepResult run(Head head, ModelDims d) {
  BertModel m(config(), head, d);
  m.init_params(9);
  const Batch b = batch(head);
  const StepOptions opt{true, 123, 4, 0};  // dropout on
  m.zero_grads();
  const Losses l = m.forward(b, opt);
  m.backward(b, opt, 2.0f);
  return {l.loss, std::vector<float>(m.grads(), m.grads() + m.table().total())};
}

TEST(Recompute, LayerRecomputationGivesTheSameGradientsBitForBit) {
  for (Head head : {Head::Pretraining, Head::SequenceClassification, Head::TokenClassification,
                    Head::QuestionAnswering})
    for (auto attention : {ModelDims::Attention::Full, ModelDims::Attention::Blocked})
      for (int precision = 0; precision < 3; ++precision) {
        if (precision == 1 && !test::bf16_unavailable().empty()) continue;  // bf16: AVX-512
        ModelDims d{2, 8, head == Head::Pretraining ? 2 : 0,
                    static_cast<Precision>(precision),  // 0 fp32, 1 bf16, 2 fp16
                    attention};
        const StepResult stored = run(head, d);
        d.recompute_layers = true;
        const StepResult recomputed = run(head, d);
        SCOPED_TRACE(
            str(head_architecture(head), " ", attention_name(attention), " precision ", precision));
        EXPECT_EQ(stored.loss, recomputed.loss);
        ASSERT_EQ(stored.grads.size(), recomputed.grads.size());
        EXPECT_EQ(std::memcmp(stored.grads.data(), recomputed.grads.data(),
                              stored.grads.size() * sizeof(float)),
                  0);
        double norm = 0;
        for (float g : stored.grads) norm += static_cast<double>(g) * g;
        EXPECT_GT(norm, 0.0);
      }
}

TEST(Recompute, PlanKeepsOneLayerOfActivations) {
  BertConfig c = test::small_bert(1000, 64, 6, 4, 256, 128);
  ModelDims d{8, 128, 20};
  const auto stored = BertModel::make_plan(c, Head::Pretraining, d, kernels::cpu_backend());
  d.recompute_layers = true;
  const auto recomputed = BertModel::make_plan(c, Head::Pretraining, d, kernels::cpu_backend());
  const size_t a = stored.group_bytes("activations"), r = recomputed.group_bytes("activations");
  // Six layers' activations become one slot plus six layer outputs [N,C].
  EXPECT_LT(r, a / 3) << a << " vs " << r;
  EXPECT_EQ(stored.group_bytes("parameters"), recomputed.group_bytes("parameters"));
}

}  // namespace
}  // namespace bertrain::model
