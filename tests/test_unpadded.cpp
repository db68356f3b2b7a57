// Unpadded execution (ModelDims::unpadded): a model that runs each sequence on its real length
// against the padded model on the same batches: losses, every parameter's gradient and every
// real position's output. Both compute the same sums; what differs is only their order (matmuls
// with another row count may block K differently, the softmax sums its row without the padding's
// zeros), so fp32 agrees to rounding: losses to 1e-5 relative, gradients to 1e-4 relative with
// 1e-5 of each tensor's largest element as the absolute floor (the golden tests' rule, ten times
// tighter). 16-bit precisions round the same values at the same places; the rounding of a value
// that differs in its last fp32 bit can flip, so they are held to their formats' golden bounds.
// Dropout included: each packed row and attention run draws its padded place's masks, so a
// training step (dropout on) agrees too. Also: the row bookkeeping (real lengths, mask holes, a
// row without any 1, a weighted masked position past the mask, the 64-row quantum), padding
// tokens that cannot change anything, and dropout masks regenerated in backward (layer
// recomputation gives the same bits).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "model/bert.h"
#include "test_util.h"

namespace bertrain::model {
namespace {

BertConfig config(float dropout = 0.0f) {
  BertConfig c = test::small_bert(50, 32, 2, 4, 64, 48);
  c.num_labels = 3;
  c.hidden_dropout_prob = dropout;
  c.attention_probs_dropout_prob = dropout;
  return c;
}

// B sequences of T tokens with the given real lengths (0: a mask without any 1).
Batch batch(const std::vector<int>& lengths, int64_t T, int64_t P) {
  const int64_t B = static_cast<int64_t>(lengths.size());
  Batch b;
  b.resize(B, T, P);
  for (int64_t e = 0; e < B; ++e) {
    for (int64_t t = 0; t < T; ++t) {
      const bool real = t < lengths[e];
      b.input_ids[e * T + t] = real ? static_cast<int32_t>(2 + (e * 7 + t * 13) % 47) : 0;
      b.input_mask[e * T + t] = real;
      b.segment_ids[e * T + t] = real && t >= lengths[e] / 2;
      // Token classification: every real token but [CLS] and every third one scored.
      b.token_label_ids[e * T + t] = static_cast<int32_t>((e + t) % 3);
      b.token_label_weights[e * T + t] = real && t > 0 && t % 3 != 2 ? 1.0f : 0.0f;
    }
    for (int64_t j = 0; j < P; ++j) {
      const int64_t len = std::max(lengths[e], 1);
      b.masked_lm_positions[e * P + j] = static_cast<int32_t>((j * 5 + e) % len);
      b.masked_lm_ids[e * P + j] = static_cast<int32_t>(3 + (e + j * 11) % 40);
      b.masked_lm_weights[e * P + j] = j + 1 < P ? 1.0f : 0.0f;  // the last slot unused
    }
    b.next_sentence_labels[e] = static_cast<int32_t>(e % 2);
    b.label_ids[e] = static_cast<int32_t>(e % 3);
  }
  return b;
}

struct StepResult {
  Losses losses;
  std::vector<float> grads;
  std::vector<float> rows;  // every real position's output, in (sequence, token) order
};

StepResult run(Head head, ModelDims d, const Batch& b, const StepOptions& opt = {},
               float dropout = 0.0f) {
  d.batch = b.B;
  d.seq_len = b.T;
  d.max_predictions = b.P;
  BertModel m(config(dropout), head, d);
  m.init_params(5);
  m.zero_grads();
  StepResult r;
  r.losses = m.forward(b, opt);
  const int64_t C = m.config().hidden_size;
  for (int64_t e = 0; e < b.B; ++e)
    for (int64_t t = 0; t < b.T; ++t)
      if (b.input_mask[e * b.T + t]) {
        const int64_t row = m.sequence_row(e, t);
        EXPECT_GE(row, 0) << "a real token without a row: " << e << "," << t;
        r.rows.insert(r.rows.end(), m.sequence_output() + row * C,
                      m.sequence_output() + (row + 1) * C);
      }
  m.backward(b, opt, 2.0f);
  r.grads.assign(m.grads(), m.grads() + m.table().total());
  return r;
}

void expect_same(const StepResult& padded, const StepResult& unpadded, double rtol, double atol,
                 const ParamTable& table) {
  EXPECT_NEAR(unpadded.losses.loss, padded.losses.loss, rtol * std::fabs(padded.losses.loss));
  EXPECT_EQ(unpadded.losses.mlm_correct, padded.losses.mlm_correct);
  EXPECT_EQ(unpadded.losses.nsp_correct, padded.losses.nsp_correct);
  EXPECT_EQ(unpadded.losses.cls_correct, padded.losses.cls_correct);
  EXPECT_EQ(unpadded.losses.tokens_scored, padded.losses.tokens_scored);
  EXPECT_EQ(unpadded.losses.tokens_correct, padded.losses.tokens_correct);
  ASSERT_EQ(unpadded.rows.size(), padded.rows.size());
  EXPECT_TRUE(test::all_close("real positions' output", unpadded.rows.data(), padded.rows.data(),
                              padded.rows.size(), rtol, atol));
  for (const auto& p : table.params())
    EXPECT_TRUE(test::all_close("grad " + p.name, unpadded.grads.data() + p.offset,
                                padded.grads.data() + p.offset, p.numel(), rtol, atol, 1e-9));
}

// Lengths with every case: full rows, a run of equal lengths, length 1, a mask without any 1.
const std::vector<int> kLengths = {24, 24, 17, 9, 9, 1, 0, 12};

const Head kHeads[] = {Head::Pretraining, Head::SequenceClassification, Head::TokenClassification};

TEST(Unpadded, EqualsThePaddedModelInFp32) {
  const Batch b = batch(kLengths, 24, 4);
  for (Head head : kHeads)
    for (auto attention : {ModelDims::Attention::Full, ModelDims::Attention::Blocked}) {
      SCOPED_TRACE(str(head_architecture(head), " ", attention_name(attention)));
      ModelDims d;
      d.attention = attention;
      const StepResult padded = run(head, d, b);
      d.unpadded = true;
      const StepResult unpadded = run(head, d, b);
      // The mask without a 1 runs all T positions, as the padded model attends to them all.
      const int64_t real = 24 + 24 + 17 + 9 + 9 + 1 + 24 + 12;
      EXPECT_EQ(unpadded.losses.real_tokens, real);
      EXPECT_EQ(unpadded.losses.computed_tokens, 128);  // 120 rounded up to 64
      EXPECT_EQ(padded.losses.real_tokens, real);
      EXPECT_EQ(padded.losses.computed_tokens, 8 * 24);
      expect_same(padded, unpadded, 1e-4, 1e-5, ParamTable(config(), head));
    }
}

TEST(Unpadded, EqualsThePaddedModelWithDropout) {
  // A training step: dropout 0.2 on every site, an example offset as a data-parallel rank has.
  const Batch b = batch(kLengths, 24, 4);
  const StepOptions opt{true, 99, 7, 40};
  for (Head head : kHeads)
    for (auto attention : {ModelDims::Attention::Full, ModelDims::Attention::Blocked}) {
      SCOPED_TRACE(str(head_architecture(head), " ", attention_name(attention)));
      ModelDims d;
      d.attention = attention;
      const StepResult padded = run(head, d, b, opt, 0.2f);
      d.unpadded = true;
      const StepResult unpadded = run(head, d, b, opt, 0.2f);
      expect_same(padded, unpadded, 1e-4, 1e-5, ParamTable(config(), head));
      // Dropout was on: the step differs from the deterministic one.
      EXPECT_NE(padded.losses.loss, run(head, d, b).losses.loss);
    }
}

TEST(Unpadded, SixteenBitPrecisionsStayWithinTheirBounds) {
  const Batch b = batch(kLengths, 24, 4);
  for (int precision = 1; precision < 3; ++precision) {
    if (precision == 1 && !test::bf16_unavailable().empty()) continue;  // bf16: AVX-512
    SCOPED_TRACE(precision == 1 ? "bf16" : "fp16");
    ModelDims d;
    d.precision = static_cast<Precision>(precision);  // 0 fp32, 1 bf16, 2 fp16
    const StepResult padded = run(Head::Pretraining, d, b);
    d.unpadded = true;
    const StepResult unpadded = run(Head::Pretraining, d, b);
    // test_model_golden.cpp's bounds: 16u for bf16, 8u for fp16 (u the unit roundoff).
    const double bound = precision == 1 ? 16.0 * 0x1p-9 : 8.0 * 0x1p-11;
    expect_same(padded, unpadded, bound, bound, ParamTable(config(), Head::Pretraining));
  }
}

TEST(Unpadded, MaskHolesAndWeightedPositionsPastTheMask) {
  Batch b = batch({20, 20, 6}, 20, 3);
  // A hole in the mask inside the real tokens: attention keeps it masked, the row runs.
  b.input_mask[0 * 20 + 5] = 0;
  // Sequence 2: a weighted masked position past its last mask 1 extends its rows to it.
  b.masked_lm_positions[2 * 3 + 0] = 10;
  for (auto attention : {ModelDims::Attention::Full, ModelDims::Attention::Blocked}) {
    SCOPED_TRACE(attention_name(attention));
    ModelDims d;
    d.attention = attention;
    const StepResult padded = run(Head::Pretraining, d, b);
    d.unpadded = true;
    const StepResult unpadded = run(Head::Pretraining, d, b);
    EXPECT_EQ(unpadded.losses.real_tokens, 20 + 20 + 11);
    expect_same(padded, unpadded, 1e-4, 1e-5, ParamTable(config(), Head::Pretraining));
  }
}

TEST(Unpadded, PaddingTokensChangeNothing) {
  Batch b = batch(kLengths, 24, 4);
  ModelDims d;
  d.unpadded = true;
  const StepResult before = run(Head::Pretraining, d, b);
  for (int64_t i = 0; i < b.B * b.T; ++i)
    if (!b.input_mask[i] && i / b.T != 6) {  // not the row without any 1 (it runs whole)
      b.input_ids[i] = 33;
      b.segment_ids[i] = 1;
    }
  const StepResult after = run(Head::Pretraining, d, b);
  EXPECT_EQ(before.losses.loss, after.losses.loss);
  EXPECT_EQ(
      std::memcmp(before.grads.data(), after.grads.data(), before.grads.size() * sizeof(float)), 0);
}

TEST(Unpadded, DropoutMasksRegenerateInBackward) {
  // Layer recomputation redraws every dropout mask of forward; equal bits prove backward reads
  // the masks forward drew in the packed rows (attention runs included).
  BertConfig c = config();
  const Batch b = batch(kLengths, 24, 4);
  for (auto attention : {ModelDims::Attention::Full, ModelDims::Attention::Blocked}) {
    SCOPED_TRACE(attention_name(attention));
    ModelDims d;
    d.attention = attention;
    d.unpadded = true;
    const StepOptions opt{true, 77, 3, 16};
    auto with_dropout = [&](bool recompute) {
      d.recompute_layers = recompute;
      d.batch = b.B;
      d.seq_len = b.T;
      d.max_predictions = b.P;
      BertConfig cd = c;
      cd.hidden_dropout_prob = 0.2f;
      cd.attention_probs_dropout_prob = 0.2f;
      BertModel m(cd, Head::Pretraining, d);
      m.init_params(5);
      m.zero_grads();
      const double loss = m.forward(b, opt).loss;
      m.backward(b, opt);
      return std::make_pair(loss, std::vector<float>(m.grads(), m.grads() + m.table().total()));
    };
    const auto stored = with_dropout(false), recomputed = with_dropout(true);
    EXPECT_EQ(stored.first, recomputed.first);
    EXPECT_EQ(std::memcmp(stored.second.data(), recomputed.second.data(),
                          stored.second.size() * sizeof(float)),
              0);
  }
}

TEST(Unpadded, QuestionAnsweringStaysPadded) {
  // Question answering normalises its start and end over every position, padding included (as
  // HF computes it), so the flag leaves it padded.
  ModelDims d{2, 24, 4};
  d.unpadded = true;
  EXPECT_FALSE(BertModel(config(), Head::QuestionAnswering, d).unpadded());
  for (Head head : kHeads)
    EXPECT_TRUE(BertModel(config(), head, d).unpadded()) << head_architecture(head);
}

TEST(Unpadded, AScoredTokenPastTheMaskExtendsTheRows) {
  Batch b = batch({20, 6}, 20, 0);
  b.token_label_weights[1 * 20 + 9] = 1.0f;  // a weighted token past sequence 1's last mask 1
  ModelDims d;
  const StepResult padded = run(Head::TokenClassification, d, b);
  d.unpadded = true;
  const StepResult unpadded = run(Head::TokenClassification, d, b);
  EXPECT_EQ(unpadded.losses.real_tokens, 20 + 10);
  expect_same(padded, unpadded, 1e-4, 1e-5, ParamTable(config(), Head::TokenClassification));
}

}  // namespace
}  // namespace bertrain::model
