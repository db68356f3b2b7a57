// The HuggingFace goldens (tools/make_bert_golden.py) as the model tests read them: the batch,
// every gradient by name, the outputs in the reference's layout, and the whole pretraining check
// for a model on any backend (a device's outputs and gradients are copied out). Tolerances:
// test_model_golden.cpp.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "kernels/backend.h"
#include "model/bert.h"
#include "model/checkpoint.h"
#include "test_util.h"

namespace bertrain::model::golden {

using test::all_close;
using test::data_path;

constexpr double kFwdRtol = 2e-5, kFwdAtol = 2e-6, kGradRtol = 1e-4, kGradAtol = 1e-4,
                 kGradFloor = 1e-7;

inline Batch golden_batch(const SafetensorsReader& g, bool pretraining) {
  auto ids = g.read_i64("input.input_ids");
  const auto* info = g.find("input.input_ids");
  const int64_t B = info->shape[0], T = info->shape[1];
  const int64_t P = g.find("input.masked_lm_positions")->shape[1];
  Batch b;
  b.resize(B, T, pretraining ? P : 0);
  auto to32 = [](const std::vector<int64_t>& v, std::vector<int32_t>& out) {
    out.assign(v.begin(), v.end());
  };
  to32(ids, b.input_ids);
  to32(g.read_i64("input.input_mask"), b.input_mask);
  to32(g.read_i64("input.segment_ids"), b.segment_ids);
  if (pretraining) {
    to32(g.read_i64("input.masked_lm_positions"), b.masked_lm_positions);
    to32(g.read_i64("input.masked_lm_ids"), b.masked_lm_ids);
    to32(g.read_i64("input.next_sentence_labels"), b.next_sentence_labels);
    auto w = g.read_f64("input.masked_lm_weights");
    b.masked_lm_weights.assign(w.begin(), w.end());
  } else if (g.find("input.label_values")) {  // regression
    auto v = g.read_f64("input.label_values");
    b.label_values.assign(v.begin(), v.end());
  } else {
    to32(g.read_i64("input.label_ids"), b.label_ids);
  }
  return b;
}

inline void check_grads(const BertModel& m, const SafetensorsReader& g) {
  int checked = 0;
  std::vector<float> grads(static_cast<size_t>(m.table().total()));  // (from a device's memory)
  m.backend().to_host(grads.data(), m.grads(), grads.size() * sizeof(float));
  for (const auto& p : m.table().params()) {
    auto ref = g.read_f64("grad." + p.name);
    ASSERT_EQ(ref.size(), static_cast<size_t>(p.numel())) << p.name;
    EXPECT_TRUE(all_close("grad " + p.name, grads.data() + p.offset, ref.data(), ref.size(),
                          kGradRtol, kGradAtol, kGradFloor));
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(m.table().params().size()));
}

// The sequence output in the reference's [B,T,C] layout: a padded model's as it is; an unpadded
// one's real rows (ModelDims::unpadded), the reference's own values at the padding it never
// computes, so comparing checks every real position.
inline std::vector<float> as_padded(const BertModel& m, const Batch& b,
                                    const std::vector<double>& ref) {
  const int64_t C = m.config().hidden_size;
  std::vector<float> out(ref.begin(), ref.end());
  for (int64_t e = 0; e < b.B; ++e)
    for (int64_t t = 0; t < b.T; ++t) {
      const int64_t row = m.sequence_row(e, t);
      if (row >= 0) std::copy_n(m.sequence_output() + row * C, C, out.begin() + (e * b.T + t) * C);
    }
  return out;
}

// The MLM logits in the reference's [B*P,V] layout: a padded model's as they are; an unpadded
// one's rows of the weighted predictions (the only ones it computes), the reference's own values
// at the slots without weight.
inline std::vector<float> mlm_as_padded(const BertModel& m, const Batch& b,
                                        const std::vector<double>& ref) {
  if (!m.unpadded()) return std::vector<float>(m.mlm_logits(), m.mlm_logits() + ref.size());
  const int64_t V = m.config().vocab_size;
  std::vector<float> out(ref.begin(), ref.end());
  int64_t k = 0;
  for (int64_t i = 0; i < b.B * b.P; ++i)
    if (b.masked_lm_weights[i] != 0.0f)
      std::copy_n(m.mlm_logits() + k++ * V, V, out.begin() + i * V);
  return out;
}

// BertForPreTraining's golden: outputs, losses and every gradient, for a model with dims d
// (its attention kernel, padded or not) on backend be.
inline void check_pretraining(const kernels::Backend& be, ModelDims d) {
  const std::string dir = data_path("golden/bert_pretrain");
  SafetensorsReader g(dir + "/golden.safetensors");
  Batch b = golden_batch(g, true);
  BertConfig cfg = BertConfig::load(dir + "/config.json");
  d.batch = b.B;
  d.seq_len = b.T;
  d.max_predictions = b.P;
  BertModel m(cfg, Head::Pretraining, d, be);
  load_safetensors_into(m, dir + "/model.safetensors");

  Losses l = m.forward(b, {});
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size;
  if (d.unpadded) {
    EXPECT_LT(l.real_tokens, b.B * b.T) << "the golden batch has no padding to skip";
    EXPECT_EQ(l.computed_tokens, std::min(b.B * b.T, (l.real_tokens + 63) / 64 * 64));
  } else {
    EXPECT_EQ(l.computed_tokens, b.B * b.T);
  }
  const std::vector<double> seq_ref = g.read_f64("output.sequence_output");
  EXPECT_TRUE(all_close("sequence_output", as_padded(m, b, seq_ref).data(), seq_ref.data(),
                        b.B * b.T * C, kFwdRtol, kFwdAtol));
  EXPECT_TRUE(all_close("pooled_output", m.pooled_output(),
                        g.read_f64("output.pooled_output").data(), b.B * C, kFwdRtol, kFwdAtol));
  const std::vector<double> mlm_ref = g.read_f64("output.mlm_logits");
  EXPECT_TRUE(all_close("mlm_logits", mlm_as_padded(m, b, mlm_ref).data(), mlm_ref.data(),
                        b.B * b.P * V, kFwdRtol, kFwdAtol));
  EXPECT_TRUE(all_close("nsp_logits", m.nsp_logits(), g.read_f64("output.nsp_logits").data(),
                        b.B * 2, kFwdRtol, kFwdAtol));
  EXPECT_NEAR(l.mlm_loss, g.read_f64("output.mlm_loss")[0], 1e-5);
  EXPECT_NEAR(l.nsp_loss, g.read_f64("output.nsp_loss")[0], 1e-5);
  EXPECT_NEAR(l.loss, g.read_f64("output.loss")[0], 2e-5);

  m.zero_grads();
  m.backward(b, {});
  check_grads(m, g);

  // The same sums kept on the device over two forwards (a step of two micro-batches) and read
  // once: the losses and hits added (the CPU's bit for bit: the same doubles added in the same
  // order; a GPU's rows summed in a tree on the device, not in row order on the host).
  StepOptions dev;
  dev.device_sums = true;
  for (int micro = 0; micro < 2; ++micro) {
    const Losses kept = m.forward(b, dev);
    EXPECT_EQ(kept.loss, 0.0) << "forward's Losses with the sums on the device";
    EXPECT_EQ(kept.mlm_weight, l.mlm_weight);
  }
  m.read_step_sums();
  const StepSums s = m.step_sums();
  const double once = l.mlm_loss + l.nsp_loss;
  EXPECT_NEAR(s.loss, 2 * once, be.host_memory() ? 0.0 : 1e-12 * once);
  EXPECT_EQ(s.mlm_correct, 2 * l.mlm_correct);
  EXPECT_EQ(s.nsp_correct, 2.0 * static_cast<double>(l.nsp_correct));
  EXPECT_EQ(s.cls_correct, 0.0);
  EXPECT_EQ(s.nonfinite, 0.0);
  m.read_step_sums();  // read, the device's sums start again from zero
  EXPECT_EQ(m.step_sums().loss, 0.0);
}

}  // namespace bertrain::model::golden
