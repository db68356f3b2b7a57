// The model against HuggingFace transformers (tools/make_bert_golden.py): the same weights,
// inputs and losses; every output and the gradient of every parameter, compared by name.
// Reference: HF run in float64. bertrain runs in fp32, so the bound is fp32 arithmetic error:
// forward rtol 2e-5 (eps 1.2e-7 amplified by 2 layers of LayerNorm/softmax, sums of <= 256
// terms); gradients rtol 1e-4 with atol 1e-4 of the tensor's largest element, since the
// backward chains about three times as many operations and cancellations in LayerNorm's
// gradient make small elements relatively noisy. Measured worst errors are ~10x below these.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>

#include "core/isa.h"
#include "core/safetensors.h"
#include "golden_check.h"
#include "model/bert.h"
#include "model/checkpoint.h"
#include "test_util.h"

namespace bertrain::model {
namespace {

using test::all_close;
using test::data_path;

using namespace golden;

// Both attention kernels (the full one and the blocked one), padded and unpadded, against the
// same golden (whose batch has padding: the unpadded runs check that it is skipped).
using GoldenParam = std::tuple<ModelDims::Attention, bool>;
class GoldenAttention : public ::testing::TestWithParam<GoldenParam> {};

ModelDims golden_dims(const GoldenParam& p) {
  ModelDims d;
  d.attention = std::get<0>(p);
  d.unpadded = std::get<1>(p);
  return d;
}

TEST_P(GoldenAttention, BertForPreTrainingForwardBackward) {
  check_pretraining(kernels::cpu_backend(), golden_dims(GetParam()));
}

TEST_P(GoldenAttention, BertForSequenceClassificationForwardBackward) {
  const std::string dir = data_path("golden/bert_cls");
  SafetensorsReader g(dir + "/golden.safetensors");
  Batch b = golden_batch(g, false);
  BertConfig cfg = BertConfig::load(dir + "/config.json");
  ASSERT_EQ(cfg.num_labels, 3);
  ModelDims d = golden_dims(GetParam());
  d.batch = b.B;
  d.seq_len = b.T;
  d.max_predictions = 0;
  BertModel m(cfg, Head::SequenceClassification, d);
  load_safetensors_into(m, dir + "/model.safetensors");
  Losses l = m.forward(b, {});
  EXPECT_TRUE(all_close("logits", m.cls_logits(), g.read_f64("output.logits").data(), b.B * 3,
                        kFwdRtol, kFwdAtol));
  EXPECT_NEAR(l.loss, g.read_f64("output.loss")[0], 1e-5);
  m.zero_grads();
  m.backward(b, {});
  check_grads(m, g);
}

// One output: HF's regression head (problem_type regression, MSELoss), as STS-B fine-tunes.
TEST(GoldenHF, BertForSequenceClassificationRegressionForwardBackward) {
  const std::string dir = data_path("golden/bert_reg");
  SafetensorsReader g(dir + "/golden.safetensors");
  Batch b = golden_batch(g, false);
  BertConfig cfg = BertConfig::load(dir + "/config.json");
  ASSERT_EQ(cfg.num_labels, 1);
  BertModel m(cfg, Head::SequenceClassification, {b.B, b.T, 0});
  load_safetensors_into(m, dir + "/model.safetensors");
  Losses l = m.forward(b, {});
  EXPECT_TRUE(all_close("logits", m.cls_logits(), g.read_f64("output.logits").data(), b.B, kFwdRtol,
                        kFwdAtol));
  EXPECT_NEAR(l.loss, g.read_f64("output.loss")[0], 1e-5 * g.read_f64("output.loss")[0]);
  m.zero_grads();
  m.backward(b, {});
  check_grads(m, g);
}

// HF's BertForTokenClassification: a classifier on every token, no pooler; tokens labelled
// -100 (HF's ignore_index) are weight 0 here, the loss is the mean over the scored ones. Padded
// and unpadded (the logits of the real tokens; padding's are never computed).
TEST(GoldenHF, BertForTokenClassificationForwardBackward) {
  const std::string dir = data_path("golden/bert_token");
  SafetensorsReader g(dir + "/golden.safetensors");
  const auto* info = g.find("input.input_ids");
  const int64_t B = info->shape[0], T = info->shape[1];
  Batch b;
  b.resize(B, T, 0);
  auto to32 = [](const std::vector<int64_t>& v, std::vector<int32_t>& out) {
    out.assign(v.begin(), v.end());
  };
  to32(g.read_i64("input.input_ids"), b.input_ids);
  to32(g.read_i64("input.input_mask"), b.input_mask);
  to32(g.read_i64("input.segment_ids"), b.segment_ids);
  const auto labels = g.read_i64("input.token_labels");
  for (int64_t i = 0; i < B * T; ++i) {
    b.token_label_ids[i] = labels[i] < 0 ? 0 : static_cast<int32_t>(labels[i]);
    b.token_label_weights[i] = labels[i] < 0 ? 0.0f : 1.0f;
  }
  BertConfig cfg = BertConfig::load(dir + "/config.json");
  ASSERT_EQ(cfg.num_labels, 5);
  for (bool unpadded : {false, true}) {
    SCOPED_TRACE(unpadded ? "unpadded" : "padded");
    ModelDims d{B, T, 0};
    d.unpadded = unpadded;
    BertModel m(cfg, Head::TokenClassification, d);
    EXPECT_FALSE(m.table().find("bert.pooler.dense.weight"));
    load_safetensors_into(m, dir + "/model.safetensors");  // strictly: HF's file has no pooler
    Losses l = m.forward(b, {});
    const std::vector<double> ref = g.read_f64("output.logits");
    std::vector<float> logits(ref.begin(), ref.end());
    for (int64_t e = 0; e < B; ++e)
      for (int64_t t = 0; t < T; ++t)
        if (const int64_t row = m.sequence_row(e, t); row >= 0)
          std::copy_n(m.token_logits() + row * 5, 5, logits.begin() + (e * T + t) * 5);
    if (unpadded) EXPECT_LT(l.real_tokens, B * T) << "the golden batch has no padding to skip";
    EXPECT_TRUE(all_close("logits", logits.data(), ref.data(), B * T * 5, kFwdRtol, kFwdAtol));
    EXPECT_NEAR(l.loss, g.read_f64("output.loss")[0], 1e-5);
    m.zero_grads();
    m.backward(b, {});
    check_grads(m, g);
  }
}

// HF's BertForQuestionAnswering: qa_outputs on every token (no pooler, no dropout), the loss
// (CE(start) + CE(end)) / 2 over positions; one example's answer at [CLS] (outside its window).
TEST(GoldenHF, BertForQuestionAnsweringForwardBackward) {
  const std::string dir = data_path("golden/bert_qa");
  SafetensorsReader g(dir + "/golden.safetensors");
  const auto* info = g.find("input.input_ids");
  const int64_t B = info->shape[0], T = info->shape[1];
  Batch b;
  b.resize(B, T, 0);
  auto to32 = [](const std::vector<int64_t>& v, std::vector<int32_t>& out) {
    out.assign(v.begin(), v.end());
  };
  to32(g.read_i64("input.input_ids"), b.input_ids);
  to32(g.read_i64("input.input_mask"), b.input_mask);
  to32(g.read_i64("input.segment_ids"), b.segment_ids);
  to32(g.read_i64("input.span_positions"), b.span_positions);  // [2,B]: starts, then ends
  BertConfig cfg = BertConfig::load(dir + "/config.json");
  BertModel m(cfg, Head::QuestionAnswering, {B, T, 0});
  EXPECT_FALSE(m.table().find("bert.pooler.dense.weight"));
  load_safetensors_into(m, dir + "/model.safetensors");  // strictly: HF's file has no pooler
  Losses l = m.forward(b, {});
  EXPECT_TRUE(all_close("start_logits", m.span_logits(), g.read_f64("output.start_logits").data(),
                        B * T, kFwdRtol, kFwdAtol));
  EXPECT_TRUE(all_close("end_logits", m.span_logits() + B * T,
                        g.read_f64("output.end_logits").data(), B * T, kFwdRtol, kFwdAtol));
  EXPECT_NEAR(l.loss, g.read_f64("output.loss")[0], 1e-5);
  EXPECT_EQ(l.tokens_scored, 2 * B);
  m.zero_grads();
  m.backward(b, {});
  check_grads(m, g);
  // An answer position outside the sequence is named.
  b.span_positions[B] = static_cast<int32_t>(T);
  try {
    m.forward(b, {});
    ADD_FAILURE() << "no error for a span position past the sequence";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("span_positions"), std::string::npos) << e.what();
  }
}

TEST(GoldenHF, BackwardAccumulatesAcrossCalls) {
  // Gradient accumulation relies on backward adding into the gradient buffer.
  const std::string dir = data_path("golden/bert_cls");
  SafetensorsReader g(dir + "/golden.safetensors");
  Batch b = golden_batch(g, false);
  BertModel m(BertConfig::load(dir + "/config.json"), Head::SequenceClassification, {b.B, b.T, 0});
  load_safetensors_into(m, dir + "/model.safetensors");
  m.zero_grads();
  for (int k = 0; k < 2; ++k) {
    m.forward(b, {});
    m.backward(b, {}, 0.5f);
  }
  check_grads(m, g);
}

}  // namespace
}  // namespace bertrain::model

namespace bertrain::model {
namespace {

double rel_l2(const float* got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// A 16-bit model against the float64 HuggingFace reference: outputs and the loss, then every
// parameter's gradient, both as a relative L2 error and as its worst element over the tensor's
// largest element, each held to `bound`; the worst tensor and the worst element are reported.
// The key biases (true gradient 0) are checked against the absolute floor instead.
void check_within(ModelDims dims, double bound, const char* what) {
  const std::string dir = data_path("golden/bert_pretrain");
  SafetensorsReader g(dir + "/golden.safetensors");
  Batch b = golden_batch(g, true);
  dims.batch = b.B;
  dims.seq_len = b.T;
  dims.max_predictions = b.P;
  BertModel m(BertConfig::load(dir + "/config.json"), Head::Pretraining, dims);
  load_safetensors_into(m, dir + "/model.safetensors");
  Losses l = m.forward(b, {});
  const std::vector<double> seq_ref = g.read_f64("output.sequence_output");
  EXPECT_LT(rel_l2(as_padded(m, b, seq_ref).data(), seq_ref), bound);
  const std::vector<double> mlm_ref = g.read_f64("output.mlm_logits");
  EXPECT_LT(rel_l2(mlm_as_padded(m, b, mlm_ref).data(), mlm_ref), bound);
  EXPECT_NEAR(l.loss, g.read_f64("output.loss")[0], bound * g.read_f64("output.loss")[0]);
  m.zero_grads();
  m.backward(b, {});
  double worst = 0, worst_el = 0;
  std::string worst_name, worst_el_at;
  for (const auto& p : m.table().params()) {
    if (p.name.find("attention.self.key.bias") != std::string::npos) continue;
    const std::vector<double> ref = g.read_f64("grad." + p.name);
    const float* got = m.grads() + p.offset;
    const double e = rel_l2(got, ref);
    if (e > worst) {
      worst = e;
      worst_name = p.name;
    }
    // The worst element, as a fraction of the tensor's largest reference element.
    double scale = 0;
    for (double r : ref) scale = std::max(scale, std::fabs(r));
    for (size_t i = 0; i < ref.size(); ++i) {
      const double d = std::fabs(got[i] - ref[i]) / std::max(scale, 1e-300);
      if (d > worst_el) {
        worst_el = d;
        worst_el_at = str(p.name, "[", i, "] = ", got[i], " vs ", ref[i]);
      }
    }
  }
  EXPECT_LT(worst, bound) << "worst tensor " << worst_name;
  EXPECT_LT(worst_el, bound) << "worst element " << worst_el_at;
  std::printf(
      "%s (%s attention): worst gradient relative L2 error %.5f (%s); worst element %.5f of its "
      "tensor's largest (%s); bound %.5f\n",
      what, attention_name(dims.attention), worst, worst_name.c_str(), worst_el,
      worst_el_at.c_str(), bound);
}

// bf16 matmuls. bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ~ 2e-3); each matmul
// rounds both operands, so a product's relative error is ~2u and a dot product of K terms keeps
// that relative size in the L2 sense. Two layers plus the heads chain ~8 matmuls: the bound per
// tensor is relative L2 error <= 16u = 3.1e-2 (measured 0.009, ~3x lower).
TEST_P(GoldenAttention, Bf16MatmulsStayWithinBf16Precision) {
  BT_SKIP_WITHOUT_BF16();
  ModelDims d = golden_dims(GetParam());
  d.precision = Precision::BF16;
  check_within(d, 16.0 * 0x1p-9, "bf16");
}

// fp16 storage: every kept activation (QKV, context, FFN pre-/post-activation) rounded once to
// fp16, whose unit roundoff is u = 2^-11 ~ 4.9e-4; fp32 weights and arithmetic. Each rounding
// moves its tensor by <= u relative; four per layer over two layers add up, in the L2 sense, to
// at most 8u = 3.9e-3 (measured 5.2e-4, about u). Runs on every CPU (the kernels are fp32).
TEST_P(GoldenAttention, Fp16StorageStaysWithinFp16Precision) {
  ModelDims d = golden_dims(GetParam());
  d.precision = Precision::FP16;
  check_within(d, 8.0 * 0x1p-11, "fp16");
}

INSTANTIATE_TEST_SUITE_P(Kernel, GoldenAttention,
                         ::testing::Combine(::testing::Values(ModelDims::Attention::Full,
                                                              ModelDims::Attention::Blocked),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(attention_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_unpadded" : "_padded");
                         });

}  // namespace
}  // namespace bertrain::model
