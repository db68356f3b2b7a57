// Optimizers against PyTorch (tools/make_optimizer_golden.py): torch.optim.AdamW and a reference
// LAMB, six steps with clip_grad_norm_ (two of them clipping), parameters compared after every
// step. Both sides run in fp32; only the order of operations differs, so rtol 2e-6 with an
// absolute floor of 1e-7 (one fp32 ulp at the parameters' scale ~0.5 is 6e-8).
#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/isa.h"
#include "core/safetensors.h"
#include "test_util.h"
#include "train/optimizer.h"

namespace bertrain::train {
namespace {

const std::vector<std::pair<std::string, bool>> kTensors = {
    {"w", true}, {"emb", true}, {"b", false}, {"ln_w", false}, {"ln_b", false}};

void run_golden(OptimizerKind kind, const char* name) {
  SafetensorsReader g(test::data_path("golden/optimizer.safetensors"));
  std::vector<ParamSlice> slices;
  int64_t total = 0;
  for (const auto& [n, decay] : kTensors) {
    const int64_t numel = shape_numel(g.find("init." + n)->shape);
    slices.push_back({n, total, numel, decay});
    total += numel;
  }
  std::vector<float> params(total), grads(total);
  for (const auto& s : slices) {
    auto v = g.read_f32("init." + s.name);
    std::copy(v.begin(), v.end(), params.begin() + s.offset);
  }
  OptimizerConfig cfg;
  cfg.kind = kind;
  Optimizer opt(slices, total, cfg);
  const auto lrs = g.read_f64("lrs");
  for (size_t t = 0; t < lrs.size(); ++t) {
    // Scale the gradients by 8 and unscale inside, as with gradient accumulation / loss scale.
    for (const auto& s : slices) {
      auto v = g.read_f32("grad" + std::to_string(t) + "." + s.name);
      for (int64_t i = 0; i < s.numel; ++i) grads[s.offset + i] = v[i] * 8.0f;
    }
    StepResult r = opt.step(params.data(), grads.data(), static_cast<float>(lrs[t]), 1.0f / 8);
    ASSERT_TRUE(r.finite);
    EXPECT_NEAR(r.grad_norm, g.read_f64(std::string(name) + ".norm" + std::to_string(t))[0],
                1e-5 * r.grad_norm);
    for (const auto& s : slices) {
      auto want = g.read_f32(std::string(name) + ".step" + std::to_string(t) + "." + s.name);
      EXPECT_TRUE(test::all_close(str(name, " step ", t, " ", s.name), params.data() + s.offset,
                                  want.data(), want.size(), 2e-6, 0.0, 1e-7));
    }
  }
  EXPECT_EQ(opt.steps(), 6);
}

TEST(Optimizer, AdamWMatchesPyTorch) {
  run_golden(OptimizerKind::AdamW, "adamw");
}
TEST(Optimizer, LambMatchesReference) {
  run_golden(OptimizerKind::Lamb, "lamb");
}

TEST(Optimizer, NonFiniteGradientChangesNothing) {
  std::vector<ParamSlice> slices = {{"a", 0, 4, true}};
  Optimizer opt(slices, 4, {});
  std::vector<float> p = {1, 2, 3, 4}, g = {0.1f, NAN, 0.2f, 0.3f};
  StepResult r = opt.step(p.data(), g.data(), 0.1f, 1.0f);
  EXPECT_FALSE(r.finite);
  EXPECT_EQ(p, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(opt.steps(), 0);
  EXPECT_EQ(std::vector<float>(opt.m().begin(), opt.m().end()), std::vector<float>(4, 0.0f));
  g[1] = INFINITY;
  EXPECT_FALSE(opt.step(p.data(), g.data(), 0.1f, 1.0f).finite);
}

TEST(LrSchedule, WarmupThenLinearDecay) {
  LrSchedule s{1e-3, 0.0, 1.0, 10, 110};
  EXPECT_DOUBLE_EQ(s.at(0), 1e-4);
  EXPECT_DOUBLE_EQ(s.at(9), 1e-3);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
  EXPECT_NEAR(s.at(60), 5e-4, 1e-12);
  EXPECT_NEAR(s.at(110), 0.0, 1e-12);
  LrSchedule poly{1e-3, 1e-5, 2.0, 0, 100};
  EXPECT_NEAR(poly.at(50), (1e-3 - 1e-5) * 0.25 + 1e-5, 1e-12);
}

// The vector AdamW bodies (AVX-512, AVX2) perform the portable loop's operations in the same
// order: without clipping the same parameters bit for bit (with tails, decay on and off); the
// gradient norm (double sums in another order) within 1e-12 relative, so with clipping the
// coefficient may differ in its last bit: parameters within 1e-6 relative.
class AdamWIsa : public ::testing::TestWithParam<float> {};

TEST_P(AdamWIsa, VectorBodiesEqualPortable) {
  const float clip = GetParam();
  const std::vector<ParamSlice> slices = {{"a", 0, 70001, true}, {"b", 70001, 37, false}};
  const int64_t total = 70038;
  auto run = [&] {
    std::vector<float> p = test::random_vector(total, 1), g = test::random_vector(total, 2, 30.0f);
    OptimizerConfig cfg;
    cfg.max_grad_norm = clip;
    Optimizer opt(slices, total, cfg);
    std::vector<double> norms;
    for (int step = 0; step < 3; ++step)
      norms.push_back(opt.step(p.data(), g.data(), 1e-3f, 0.5f).grad_norm);
    p.insert(p.end(), opt.m().begin(), opt.m().end());
    return std::make_pair(p, norms);
  };
  const auto [pp, np] = test::with_isa(Isa::Portable, run);
  for (Isa isa : test::isa_levels()) {
    const auto [pf, nf] = test::with_isa(isa, run);
    if (clip == 0.0f)
      ASSERT_EQ(pf, pp) << isa_name(isa);
    else
      EXPECT_TRUE(test::all_close(std::string("adamw ") + isa_name(isa), pf.data(), pp.data(),
                                  pf.size(), 1e-6, 1e-9));
    for (size_t i = 0; i < nf.size(); ++i) EXPECT_NEAR(nf[i], np[i], 1e-12 * np[i]);
    EXPECT_GT(nf[0], 1.0);  // the norm is large: clipping at 1.0 is active
  }
}

// LAMB's vector bodies: the moments bit for bit (same operations, same order); the norms for
// the trust ratio are double sums in another order, so parameters agree within 1e-6 relative.
TEST(Optimizer, LambVectorBodiesMatchPortable) {
  const std::vector<ParamSlice> slices = {{"a", 0, 70001, true}, {"b", 70001, 37, false}};
  const int64_t total = 70038;
  OptimizerConfig cfg;
  cfg.kind = OptimizerKind::Lamb;
  cfg.max_grad_norm = 0;
  auto run = [&] {
    std::vector<float> p = test::random_vector(total, 1), g = test::random_vector(total, 2);
    Optimizer opt(slices, total, cfg);
    for (int step = 0; step < 3; ++step) opt.step(p.data(), g.data(), 1e-3f, 1.0f);
    return std::make_tuple(p, std::vector<float>(opt.m().begin(), opt.m().end()),
                           std::vector<float>(opt.v().begin(), opt.v().end()));
  };
  const auto [pp, mp, vp] = test::with_isa(Isa::Portable, run);
  for (Isa isa : test::isa_levels()) {
    const auto [pf, mf, vf] = test::with_isa(isa, run);
    EXPECT_EQ(mf, mp) << isa_name(isa);
    EXPECT_EQ(vf, vp) << isa_name(isa);
    EXPECT_TRUE(test::all_close(std::string("lamb ") + isa_name(isa), pf.data(), pp.data(),
                                pf.size(), 1e-6, 1e-9));
    EXPECT_NE(pf, test::random_vector(total, 1));  // it moved
  }
}

// The 16-bit weight copy written in the update pass (bf16, or fp16: what a GPU's FP16 products
// read) equals the updated parameters rounded, for both optimizers and every body (the AVX-512
// one's vcvtps2ph, the AVX2 one's and the portable loop's f32_to_f16), with a value past fp16's
// range (infinity in the fp16 copy).
TEST(Optimizer, WeightCopyInTheUpdatePassEqualsRoundedParameters) {
  const std::vector<ParamSlice> slices = {{"a", 0, 70001, true}, {"b", 70001, 37, false}};
  const int64_t total = 70038;
  for (bool f16 : {false, true})
    for (OptimizerKind kind : {OptimizerKind::AdamW, OptimizerKind::Lamb}) {
      for (Isa isa : test::isa_levels()) {
        OptimizerConfig cfg;
        cfg.kind = kind;
        std::vector<float> p = test::random_vector(total, 1), g = test::random_vector(total, 2);
        p[5] = 1e6f;  // fp16: infinity
        std::vector<uint16_t> p16(total, 0xffff), want(total);
        Optimizer opt(slices, total, cfg);
        set_isa_override(isa);
        for (int step = 0; step < 2; ++step)
          opt.step(p.data(), g.data(), 1e-3f, 1.0f, kernels::WeightCopy{p16.data(), f16});
        reset_isa_override();
        if (f16)
          convert_f32_to_f16(p.data(), want.data(), total);
        else
          convert_f32_to_bf16(p.data(), want.data(), total);
        EXPECT_EQ(p16, want) << optimizer_name(kind) << " " << isa_name(isa)
                             << (f16 ? " fp16" : " bf16");
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Clip, AdamWIsa, ::testing::Values(0.0f, 1.0f),
                         [](const auto& info) { return info.param > 0 ? "clip1" : "noclip"; });

}  // namespace
}  // namespace bertrain::train
