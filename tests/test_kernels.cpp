// Kernel tests: oneDNN gemm against a double-accumulating triple loop, and every backward
// against central finite differences of its forward on tiny shapes (STYLE.md §6).
// FD in fp32 with eps = 1e-2: truncation error O(eps^2) ~ 1e-4 relative, rounding ~ 1e-7/eps =
// 1e-5, so gradients must agree to rtol 2e-3 with atol 2e-3 of the largest gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/dtype.h"
#include "core/isa.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "test_util.h"

namespace bertrain::kernels {
namespace {

using test::all_close;
using test::dot;
using test::numeric_grad;
using test::random_vector;

constexpr float kEps = 1e-2f;
constexpr double kRtol = 2e-3, kAtol = 2e-3;

struct GemmCase {
  bool ta, tb, bias, acc;
  int64_t M, N, K;
};

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, MatchesReference) {
  const GemmCase c = GetParam();
  const int64_t lda = (c.ta ? c.M : c.K) + 3, ldb = (c.tb ? c.K : c.N) + 1, ldc = c.N + 2;
  auto A = random_vector((c.ta ? c.K : c.M) * lda, 1),
       B = random_vector((c.tb ? c.N : c.K) * ldb, 2);
  auto bias = random_vector(c.N, 3);
  auto C0 = random_vector(c.M * ldc, 4);
  auto C1 = C0, C2 = C0;
  const float* bp = c.bias ? bias.data() : nullptr;
  gemm(c.ta, c.tb, c.M, c.N, c.K, A.data(), lda, B.data(), ldb, C1.data(), ldc, bp, c.acc);
  gemm_reference(c.ta, c.tb, c.M, c.N, c.K, A.data(), lda, B.data(), ldb, C2.data(), ldc, bp,
                 c.acc);
  // fp32 accumulation of K products of N(0,1) values: error ~ sqrt(K) * eps * |terms|.
  EXPECT_TRUE(all_close("gemm", C1.data(), C2.data(), C1.size(), 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest,
                         ::testing::Values(GemmCase{false, false, false, false, 7, 5, 9},
                                           GemmCase{false, true, true, false, 33, 17, 65},
                                           GemmCase{true, false, false, true, 16, 31, 8},
                                           GemmCase{true, true, false, true, 3, 4, 129},
                                           GemmCase{false, true, false, true, 1, 1, 1},
                                           GemmCase{false, false, true, false, 64, 96, 0}));

// Products over heads (inner batch) of several sequences (outer batch) in one call, with the
// strides the attention uses (heads interleaved in rows, gaps between sequences): each product
// equals the plain reference, transposed operands and alpha included.
TEST(GemmBatched, OuterBatchEqualsEveryProductAlone) {
  const int64_t G = 3, H = 4, M = 9, N = 7, K = 5, lda = H * K + 2, ldb = H * N + 1,
                ldc = H * N + 3, oa = M * lda + 5, ob = K * ldb + 2, oc = M * ldc + 4;
  for (bool tb : {false, true}) {
    // tb: B_i stored [N,K] (row stride ldb2) instead of [K,N].
    const int64_t ldb2 = tb ? H * K + 1 : ldb, ob2 = tb ? N * ldb2 + 2 : ob, sb = tb ? K : N;
    auto A = random_vector(G * oa, 31), B = random_vector(G * ob2, 32);
    std::vector<float> C(G * oc, 0.0f), R(G * oc, 0.0f);
    gemm_batched(H, false, tb, M, N, K, 0.5f, A.data(), lda, K, B.data(), ldb2, sb, C.data(), ldc,
                 N, {G, oa, ob2, oc});
    for (int64_t g = 0; g < G; ++g)
      for (int64_t h = 0; h < H; ++h) {
        float* r = R.data() + g * oc + h * N;
        gemm_reference(false, tb, M, N, K, A.data() + g * oa + h * K, lda,
                       B.data() + g * ob2 + h * sb, ldb2, r, ldc, nullptr, false);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) r[i * ldc + j] *= 0.5f;
      }
    EXPECT_TRUE(all_close("outer-batched gemm", C.data(), R.data(), C.size(), 1e-5, 1e-5))
        << (tb ? "B transposed" : "B plain");
  }
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  const int64_t M = 5, N = 4, K = 6;
  auto x = random_vector(M * K, 10), w = random_vector(N * K, 11), b = random_vector(N, 12);
  auto r = random_vector(M * N, 13);  // loss = sum(out * r)
  std::vector<float> out(M * N);
  auto loss = [&] {
    linear_forward(out.data(), x.data(), w.data(), b.data(), M, N, K);
    return dot(out, r);
  };
  std::vector<float> dx(M * K, 0.5f), dw(N * K, 0.0f), db(N, 0.0f);
  linear_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), M, N, K);
  EXPECT_TRUE(
      all_close("dx", dx.data(), numeric_grad(x, loss, kEps).data(), dx.size(), kRtol, kAtol));
  EXPECT_TRUE(
      all_close("dw", dw.data(), numeric_grad(w, loss, kEps).data(), dw.size(), kRtol, kAtol));
  EXPECT_TRUE(
      all_close("db", db.data(), numeric_grad(b, loss, kEps).data(), db.size(), kRtol, kAtol));
  // accumulate_dinp adds to what is there
  std::vector<float> dx2(M * K, 1.0f);
  linear_backward(dx2.data(), nullptr, nullptr, r.data(), x.data(), w.data(), M, N, K, true);
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], dx[i] + 1.0f, 1e-5);
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  const int64_t N = 3, C = 8;
  auto x = random_vector(N * C, 20), g = random_vector(C, 21), b = random_vector(C, 22);
  for (auto& v : g) v += 1.0f;
  auto r = random_vector(N * C, 23);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), N, C,
                      1e-5f);
    return dot(out, r);
  };
  loss();
  // forward against the definition in double
  for (int64_t i = 0; i < N; ++i) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[i * C + c];
    m /= C;
    for (int64_t c = 0; c < C; ++c) v += (x[i * C + c] - m) * (x[i * C + c] - m);
    v /= C;
    for (int64_t c = 0; c < C; ++c)
      EXPECT_NEAR(out[i * C + c], (x[i * C + c] - m) / std::sqrt(v + 1e-5) * g[c] + b[c], 1e-5);
  }
  std::vector<float> dx(N * C), dg(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dx.data(), dg.data(), db.data(), r.data(), x.data(), g.data(), mean.data(),
                     rstd.data(), N, C);
  EXPECT_TRUE(
      all_close("dx", dx.data(), numeric_grad(x, loss, 1e-3f).data(), dx.size(), kRtol, kAtol));
  EXPECT_TRUE(all_close("dgamma", dg.data(), numeric_grad(g, loss, kEps).data(), C, kRtol, kAtol));
  EXPECT_TRUE(all_close("dbeta", db.data(), numeric_grad(b, loss, kEps).data(), C, kRtol, kAtol));
}

class ActivationTest : public ::testing::TestWithParam<Activation> {};

TEST_P(ActivationTest, BackwardMatchesFiniteDifferences) {
  auto x = random_vector(64, 30, 2.0f);
  for (auto& v : x)
    if (std::fabs(v) < 0.05f) v = 0.3f;  // keep ReLU's kink out of the FD stencil
  auto r = random_vector(64, 31);
  std::vector<float> out(64);
  auto loss = [&] {
    activation_forward(GetParam(), out.data(), x.data(), 64);
    return dot(out, r);
  };
  std::vector<float> dx(64);
  activation_backward(GetParam(), dx.data(), x.data(), r.data(), 64);
  EXPECT_TRUE(all_close("dx", dx.data(), numeric_grad(x, loss, 1e-3f).data(), 64, kRtol, kAtol));
}

INSTANTIATE_TEST_SUITE_P(All, ActivationTest,
                         ::testing::Values(Activation::GeluErf, Activation::GeluTanh,
                                           Activation::Relu));

TEST(Activation, GeluErfValues) {
  // Reference values of x * Phi(x) computed in double.
  const float x[] = {-3.0f, -1.0f, 0.0f, 0.5f, 2.0f};
  float y[5];
  activation_forward(Activation::GeluErf, y, x, 5);
  for (int i = 0; i < 5; ++i)
    EXPECT_NEAR(y[i], 0.5 * x[i] * (1.0 + std::erf(x[i] / std::sqrt(2.0))), 1e-6) << x[i];
}

TEST(Tanh, BackwardMatchesFiniteDifferences) {
  auto x = random_vector(32, 40), r = random_vector(32, 41);
  std::vector<float> out(32);
  auto loss = [&] {
    tanh_forward(out.data(), x.data(), 32);
    return dot(out, r);
  };
  loss();
  std::vector<float> dx(32);
  tanh_backward(dx.data(), out.data(), r.data(), 32);
  EXPECT_TRUE(all_close("dx", dx.data(), numeric_grad(x, loss, 1e-3f).data(), 32, kRtol, kAtol));
}

TEST(Embedding, ForwardAndBackward) {
  const int64_t B = 2, T = 3, C = 4, V = 5;
  std::vector<int32_t> ids = {1, 4, 1, 0, 2, 4}, seg = {0, 0, 1, 1, 1, 0};
  auto word = random_vector(V * C, 50), pos = random_vector(T * C, 51),
       typ = random_vector(2 * C, 52);
  auto r = random_vector(B * T * C, 53);
  std::vector<float> out(B * T * C);
  auto loss = [&] {
    embedding_forward(out.data(), ids.data(), seg.data(), word.data(), pos.data(), typ.data(), B, T,
                      C);
    return dot(out, r);
  };
  loss();
  EXPECT_FLOAT_EQ(out[(1 * T + 2) * C + 3], word[4 * C + 3] + pos[2 * C + 3] + typ[0 * C + 3]);
  std::vector<float> dw(V * C, 0.0f), dp(T * C, 0.0f), dt(2 * C, 0.0f);
  embedding_backward(dw.data(), dp.data(), dt.data(), r.data(), ids.data(), seg.data(), nullptr, B,
                     T, C);
  EXPECT_TRUE(all_close("dword", dw.data(), numeric_grad(word, loss, kEps).data(), dw.size(), kRtol,
                        kAtol));
  EXPECT_TRUE(
      all_close("dpos", dp.data(), numeric_grad(pos, loss, kEps).data(), dp.size(), kRtol, kAtol));
  EXPECT_TRUE(
      all_close("dtype", dt.data(), numeric_grad(typ, loss, kEps).data(), dt.size(), kRtol, kAtol));
}

TEST(CrossEntropy, LossAndGradient) {
  const int64_t N = 4, V = 7;
  auto logits = random_vector(N * V, 60, 2.0f);
  std::vector<int32_t> y = {3, 0, 6, 2};
  std::vector<float> w = {1.0f, 0.0f, 0.5f, 2.0f};
  auto loss = [&] {
    return cross_entropy_forward_backward(nullptr, nullptr, nullptr, logits.data(), y.data(),
                                          w.data(), N, V, 0.0f);
  };
  // value against log-softmax in double
  double ref = 0;
  for (int64_t i = 0; i < N; ++i) {
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(static_cast<double>(logits[i * V + v]));
    ref += w[i] * (std::log(s) - logits[i * V + y[i]]);
  }
  EXPECT_NEAR(loss(), ref, 1e-5);
  std::vector<float> d(N * V);
  std::vector<float> rows(N);
  std::vector<int32_t> correct(N);
  cross_entropy_forward_backward(d.data(), rows.data(), correct.data(), logits.data(), y.data(),
                                 w.data(), N, V, 1.0f);
  EXPECT_TRUE(all_close("dlogits", d.data(), numeric_grad(logits, loss, kEps).data(), d.size(),
                        kRtol, kAtol));
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(d[1 * V + v], 0.0f);  // weight 0 row
}

TEST(Dropout, DeterministicRateAndBackward) {
  const int64_t n = 200000;
  std::vector<float> x(n, 1.0f), y(n, 1.0f);
  dropout_forward(x.data(), n, {0.1f, 42, 0});
  dropout_forward(y.data(), n, {0.1f, 42, 0});
  EXPECT_EQ(x, y);  // same key, same mask
  int64_t zeros = 0;
  for (float v : x) {
    if (v == 0.0f)
      ++zeros;
    else
      EXPECT_FLOAT_EQ(v, 1.0f / 0.9f);
  }
  // Binomial(n, 0.1): std = sqrt(n * 0.09) = 134; allow 5 std.
  EXPECT_NEAR(static_cast<double>(zeros), 0.1 * n, 5 * 134.0);
  // A different key gives a different mask; an offset shifts the stream.
  std::vector<float> z(n, 1.0f), s(n - 10, 1.0f);
  dropout_forward(z.data(), n, {0.1f, 43, 0});
  EXPECT_NE(x, z);
  dropout_forward(s.data(), n - 10, {0.1f, 42, 10});
  for (int64_t i = 0; i < n - 10; ++i) ASSERT_EQ(s[i], x[i + 10]);
  // backward applies the same mask and scale
  std::vector<float> dy(n, 2.0f), dx(n);
  dropout_backward(dx.data(), dy.data(), n, {0.1f, 42, 0});
  for (int64_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(dx[i], 2.0f * x[i]);
}

class AttentionTest : public ::testing::TestWithParam<float> {};

TEST_P(AttentionTest, BackwardMatchesFiniteDifferences) {
  const float p = GetParam();
  const AttentionShape s{2, 5, 8, 2};
  auto qkv = random_vector(s.B * s.T * 3 * s.C, 70);
  std::vector<int32_t> mask = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0};
  auto r = random_vector(s.B * s.T * s.C, 71);
  std::vector<float> ctx(s.B * s.T * s.C), probs(s.B * s.NH * s.T * s.T), work(probs.size());
  auto loss = [&] {
    attention_forward(ctx.data(), probs.data(), work.data(), qkv.data(), mask.data(), s, p, 99, 7);
    return dot(ctx, r);
  };
  loss();
  // masked keys get zero probability; rows sum to one
  for (int64_t h = 0; h < s.NH; ++h)
    for (int64_t i = 0; i < s.T; ++i) {
      const float* row = probs.data() + ((1 * s.NH + h) * s.T + i) * s.T;
      EXPECT_EQ(row[3], 0.0f);
      EXPECT_EQ(row[4], 0.0f);
      EXPECT_NEAR(row[0] + row[1] + row[2], 1.0f, 1e-6);
    }
  std::vector<float> dqkv(qkv.size());
  attention_backward(dqkv.data(), work.data(), r.data(), qkv.data(), probs.data(), s, p, 99, 7);
  EXPECT_TRUE(all_close("dqkv", dqkv.data(), numeric_grad(qkv, loss, kEps).data(), dqkv.size(),
                        kRtol, kAtol));
}

// Random QKV (seed) and dctx (seed + 1), and an input mask with sequence `padded`'s positions
// from `pad_from` on masked out.
struct AttentionInputs {
  std::vector<float> qkv, dctx;
  std::vector<int32_t> mask;
};
AttentionInputs attention_inputs(const AttentionShape& s, uint32_t seed, int64_t padded,
                                 int64_t pad_from) {
  AttentionInputs in{random_vector(s.B * s.T * 3 * s.C, seed),
                     random_vector(s.B * s.T * s.C, seed + 1), std::vector<int32_t>(s.B * s.T, 1)};
  for (int64_t t = pad_from; t < s.T; ++t) in.mask[padded * s.T + t] = 0;
  return in;
}

// The plain loops' ctx, probabilities and dqkv (dropout key 5, offset 11).
std::tuple<std::vector<float>, std::vector<float>, std::vector<float>> reference_attention(
    const AttentionShape& s, const std::vector<float>& qkv, const std::vector<int32_t>& mask,
    const std::vector<float>& dctx, float p) {
  std::vector<float> ctx(s.B * s.T * s.C), probs(s.B * s.NH * s.T * s.T), dqkv(qkv.size());
  attention_forward_reference(ctx.data(), probs.data(), qkv.data(), mask.data(), s, p, 5, 11);
  attention_backward_reference(dqkv.data(), dctx.data(), qkv.data(), probs.data(), s, p, 5, 11);
  return {ctx, probs, dqkv};
}

// The fast kernel (batched matmuls, fused row passes, AVX-512 where present) against the plain
// loops, at a length that leaves a 5-element tail in every 16-wide row pass, with dropout:
// the same mask bits, and fp32 results within a few ulp of the row sums (rtol 2e-5).
TEST_P(AttentionTest, FastEqualsReference) {
  const float p = GetParam();
  const AttentionShape s{3, 37, 64, 4};
  const auto [qkv, dctx, mask] = attention_inputs(s, 72, 2, 30);
  const size_t np = s.B * s.NH * s.T * s.T;
  std::vector<float> ctx(s.B * s.T * s.C), ctx_ref(ctx.size()), probs(np), probs_ref(np), work(np),
      dqkv(qkv.size()), dqkv_ref(qkv.size());
  attention_forward(ctx.data(), probs.data(), work.data(), qkv.data(), mask.data(), s, p, 5, 11);
  attention_forward_reference(ctx_ref.data(), probs_ref.data(), qkv.data(), mask.data(), s, p, 5,
                              11);
  EXPECT_TRUE(all_close("probs", probs.data(), probs_ref.data(), np, 2e-5, 1e-7));
  EXPECT_TRUE(all_close("ctx", ctx.data(), ctx_ref.data(), ctx.size(), 2e-5, 1e-6));
  attention_backward(dqkv.data(), work.data(), dctx.data(), qkv.data(), probs.data(), s, p, 5, 11);
  attention_backward_reference(dqkv_ref.data(), dctx.data(), qkv.data(), probs_ref.data(), s, p, 5,
                               11);
  EXPECT_TRUE(all_close("dqkv", dqkv.data(), dqkv_ref.data(), dqkv.size(), 2e-5, 1e-6));
}

// bf16 operands in the four matmuls (fp32 accumulation, fp32 softmax): relative L2 error of
// ctx and dqkv against the fp32 reference within 4 bf16 roundings (4 * 2^-8): each product
// rounds both operands once, and backward chains two products.
TEST_P(AttentionTest, Bf16StaysWithinBf16Precision) {
  BT_SKIP_WITHOUT_BF16();
  const float p = GetParam();
  const AttentionShape s{2, 45, 64, 4};
  const auto [qkv, dctx, mask] = attention_inputs(s, 74, 0, 40);
  const size_t np = s.B * s.NH * s.T * s.T;
  const auto [ctx_ref, probs_ref, dqkv_ref] = reference_attention(s, qkv, mask, dctx, p);
  std::vector<float> ctx(ctx_ref.size()), probs(np), work(np), dqkv(qkv.size());
  std::vector<uint16_t> q16(qkv.size()), p16(np), d16(ctx.size());
  const AttentionBf16 w{q16.data(), p16.data(), d16.data()};
  attention_forward(ctx.data(), probs.data(), work.data(), qkv.data(), mask.data(), s, p, 5, 11,
                    &w);
  attention_backward(dqkv.data(), work.data(), dctx.data(), qkv.data(), probs.data(), s, p, 5, 11,
                     &w);
  EXPECT_LE(test::rel_l2(ctx, ctx_ref), 4 * 0x1p-8);
  EXPECT_LE(test::rel_l2(dqkv, dqkv_ref), 4 * 0x1p-8);
  EXPECT_GT(test::rel_l2(dqkv, dqkv_ref), 0.0);  // really bf16
}

// The softmax output saved in bf16 (bf16 training): the saved row is the fp32 probabilities
// rounded, bit for bit; ctx and dqkv stay within the same 4 bf16 roundings of the fp32
// reference, and close to the run that saves fp32 (one more rounding, of the probabilities).
TEST_P(AttentionTest, Bf16SavedProbabilitiesStayWithinBf16Precision) {
  BT_SKIP_WITHOUT_BF16();
  const float p = GetParam();
  const AttentionShape s{2, 45, 64, 4};
  const auto [qkv, dctx, mask] = attention_inputs(s, 76, 0, 40);
  const size_t np = s.B * s.NH * s.T * s.T;
  const auto [ctx_ref, probs_ref, dqkv_ref] = reference_attention(s, qkv, mask, dctx, p);
  std::vector<float> probs32(np);
  std::vector<uint16_t> saved(np);
  for (bool bf16_saved : {false, true}) {
    std::vector<float> ctx(ctx_ref.size()), work(np), dqkv(qkv.size());
    std::vector<uint16_t> q16(qkv.size()), p16(np), d16(ctx.size());
    const AttentionBf16 w{q16.data(), p16.data(), d16.data(), bf16_saved ? saved.data() : nullptr};
    float* probs = bf16_saved ? nullptr : probs32.data();
    attention_forward(ctx.data(), probs, work.data(), qkv.data(), mask.data(), s, p, 5, 11, &w);
    // The model keeps only the bf16 QKV: backward reads it back (qkv null).
    attention_backward(dqkv.data(), work.data(), dctx.data(), bf16_saved ? nullptr : qkv.data(),
                       probs, s, p, 5, 11, &w);
    EXPECT_LE(test::rel_l2(ctx, ctx_ref), 4 * 0x1p-8) << (bf16_saved ? "bf16 saved" : "fp32");
    EXPECT_LE(test::rel_l2(dqkv, dqkv_ref), 4 * 0x1p-8) << (bf16_saved ? "bf16 saved" : "fp32");
  }
  for (size_t i = 0; i < np; ++i) ASSERT_EQ(saved[i], f32_to_bf16(probs32[i])) << i;
}

// The softmax output saved in fp16 (fp16 training; fp32 operands), on every body this CPU has:
// the saved row is the fp32 probabilities rounded, bit for bit; ctx and dqkv move from the
// fp32-saving run by the probabilities' one rounding (<= 2 * 2^-11 relative L2) and stay within
// the fp32 tolerance plus that of the plain loops.
TEST_P(AttentionTest, Fp16SavedProbabilitiesAreTheRoundedFp32Ones) {
  const float p = GetParam();
  const AttentionShape s{2, 45, 64, 4};
  const auto [qkv, dctx, mask] = attention_inputs(s, 77, 1, 40);
  const size_t np = s.B * s.NH * s.T * s.T;
  const auto [ctx_ref, probs_ref, dqkv_ref] = reference_attention(s, qkv, mask, dctx, p);
  for (Isa isa : test::isa_levels()) {
    set_isa_override(isa);
    std::vector<float> probs32(np), ctx32(ctx_ref.size()), dqkv32(qkv.size()), work(np);
    attention_forward(ctx32.data(), probs32.data(), work.data(), qkv.data(), mask.data(), s, p, 5,
                      11);
    attention_backward(dqkv32.data(), work.data(), dctx.data(), qkv.data(), probs32.data(), s, p, 5,
                       11);
    std::vector<uint16_t> saved(np);
    std::vector<float> ctx(ctx_ref.size()), dqkv(qkv.size());
    attention_forward(ctx.data(), nullptr, work.data(), qkv.data(), mask.data(), s, p, 5, 11,
                      nullptr, saved.data());
    attention_backward(dqkv.data(), work.data(), dctx.data(), qkv.data(), nullptr, s, p, 5, 11,
                       nullptr, saved.data());
    reset_isa_override();
    const std::string at = std::string(" with ") + isa_name(isa);
    for (size_t i = 0; i < np; ++i) ASSERT_EQ(saved[i], f32_to_f16(probs32[i])) << i << at;
    EXPECT_LE(test::rel_l2(ctx, ctx32), 2 * 0x1p-11) << at;
    EXPECT_LE(test::rel_l2(dqkv, dqkv32), 2 * 0x1p-11) << at;
    EXPECT_GT(test::rel_l2(dqkv, dqkv32), 0.0) << at;  // really rounded
    EXPECT_LE(test::rel_l2(ctx, ctx_ref), 2 * 0x1p-11 + 2e-5) << at;
    EXPECT_LE(test::rel_l2(dqkv, dqkv_ref), 2 * 0x1p-11 + 2e-5) << at;
  }
}

// The blocked (flash-style) kernel against the plain loops on every body this CPU has, at a
// length of one full 128-row block plus a 22-row one, padding and dropout: the same mask bits;
// the log-sum-exp it keeps reproduces the reference probabilities; fp32 results within the
// full kernel's tolerances.
TEST_P(AttentionTest, BlockedEqualsReference) {
  const float p = GetParam();
  const AttentionShape s{2, 150, 64, 4};
  const auto [qkv, dctx, mask] = attention_inputs(s, 78, 1, 131);
  const auto [ctx_ref, probs_ref, dqkv_ref] = reference_attention(s, qkv, mask, dctx, p);
  const float scale = 1.0f / std::sqrt(16.0f);
  for (Isa isa : test::isa_levels()) {
    set_isa_override(isa);
    std::vector<float> ctx(ctx_ref.size()), lse(s.B * s.NH * s.T), dqkv(qkv.size());
    attention_blocked_forward(ctx.data(), lse.data(), qkv.data(), mask.data(), s, p, 5, 11);
    attention_blocked_backward(dqkv.data(), dctx.data(), qkv.data(), lse.data(), mask.data(), s, p,
                               5, 11);
    reset_isa_override();
    const std::string at = std::string(" with ") + isa_name(isa);
    EXPECT_TRUE(all_close("ctx" + at, ctx.data(), ctx_ref.data(), ctx.size(), 2e-5, 1e-6));
    EXPECT_TRUE(all_close("dqkv" + at, dqkv.data(), dqkv_ref.data(), dqkv.size(), 2e-5, 1e-6));
    // probs[b,h,i,j] = exp(q_i . k_j * scale + mask_j - lse[b,h,i]) at a few places.
    for (int64_t b : {0, 1})
      for (int64_t i : {0, 127, 128, 149}) {
        const int64_t h = 3, j = 140, C3 = 3 * s.C;
        const float* q = qkv.data() + (b * s.T + i) * C3 + h * 16;
        const float* k = qkv.data() + (b * s.T + j) * C3 + s.C + h * 16;
        double d = 0;
        for (int e = 0; e < 16; ++e) d += double(q[e]) * k[e];
        const double x = d * scale + (mask[b * s.T + j] ? 0.0 : -10000.0);
        const double want = probs_ref[((b * s.NH + h) * s.T + i) * s.T + j];
        EXPECT_NEAR(std::exp(x - lse[(b * s.NH + h) * s.T + i]), want, 1e-6 + 1e-5 * want) << at;
      }
  }
}

// The blocked kernel with bf16 operands: within the same 4 bf16 roundings of the fp32
// reference as the full kernel's bf16 path.
TEST_P(AttentionTest, BlockedBf16StaysWithinBf16Precision) {
  BT_SKIP_WITHOUT_BF16();
  const float p = GetParam();
  const AttentionShape s{2, 150, 64, 4};
  const auto [qkv, dctx, mask] = attention_inputs(s, 80, 0, 140);
  const auto [ctx_ref, probs_ref, dqkv_ref] = reference_attention(s, qkv, mask, dctx, p);
  std::vector<float> ctx(ctx_ref.size()), lse(s.B * s.NH * s.T), dqkv(qkv.size());
  std::vector<uint16_t> q16(qkv.size()), d16(ctx.size());
  const AttentionBf16 w{q16.data(), nullptr, d16.data()};
  attention_blocked_forward(ctx.data(), lse.data(), qkv.data(), mask.data(), s, p, 5, 11, &w);
  attention_blocked_backward(dqkv.data(), dctx.data(), nullptr, lse.data(), mask.data(), s, p, 5,
                             11, &w);  // qkv null: q16 still holds the forward's rounding
  EXPECT_LE(test::rel_l2(ctx, ctx_ref), 4 * 0x1p-8);
  EXPECT_LE(test::rel_l2(dqkv, dqkv_ref), 4 * 0x1p-8);
  EXPECT_GT(test::rel_l2(dqkv, dqkv_ref), 0.0);  // really bf16
}

INSTANTIATE_TEST_SUITE_P(Dropout, AttentionTest, ::testing::Values(0.0f, 0.3f),
                         [](const auto& info) { return info.param > 0 ? "p03" : "p0"; });

}  // namespace
}  // namespace bertrain::kernels

namespace bertrain::kernels {
namespace {

using test::all_close;
using test::random_vector;

// Runs f with each body this CPU has (AVX-512, AVX2, portable): {isa, result} pairs, the
// portable one last. (Only the portable one on a CPU without AVX2.)
template <typename F>
std::vector<std::pair<Isa, std::vector<float>>> by_isa(F&& f) {
  std::vector<std::pair<Isa, std::vector<float>>> r;
  for (Isa isa : test::isa_levels()) r.emplace_back(isa, test::with_isa(isa, f));
  return r;
}

// Every vector body's result within (rtol, atol_rel) of the portable one's.
::testing::AssertionResult vector_bodies_close(
    const std::string& name, const std::vector<std::pair<Isa, std::vector<float>>>& r, double rtol,
    double atol_rel) {
  const auto& portable = r.back().second;
  for (const auto& [isa, v] : r) {
    if (v.size() != portable.size()) return ::testing::AssertionFailure() << name << ": size";
    auto ok = all_close(name + " " + isa_name(isa) + " vs portable", v.data(), portable.data(),
                        v.size(), rtol, atol_rel);
    if (!ok) return ok;
  }
  return ::testing::AssertionSuccess();
}

// Values spanning GELU's interesting range (tails to +-12) and an odd length (tails of 16).
std::vector<float> wide_values(int64_t n, uint64_t seed) {
  auto v = random_vector(n, seed);
  for (int64_t i = 0; i < n; ++i) v[i] *= 6.0f * static_cast<float>(i % 3);
  return v;
}

// erf and exp are approximations in the vector bodies: GELU within 1e-6 absolute + 2e-6
// relative of the libm version (erf's 3e-7 absolute error, scaled by x/2 <= 6).
TEST(IsaDispatch, GeluVectorBodiesMatchPortable) {
  const int64_t n = 10007;
  const auto x = wide_values(n, 3), dy = random_vector(n, 4);
  const auto r = by_isa([&] {
    std::vector<float> y(n), dx(n);
    activation_forward(Activation::GeluErf, y.data(), x.data(), n);
    activation_backward(Activation::GeluErf, dx.data(), x.data(), dy.data(), n);
    y.insert(y.end(), dx.begin(), dx.end());
    return y;
  });
  EXPECT_TRUE(vector_bodies_close("gelu", r, 2e-6, 2e-6));
  // AVX-512 and AVX2 evaluate the same polynomials in the same order: the same bits.
  if (r.size() == 3) {
    EXPECT_EQ(r[0].second, r[1].second);
  }
}

// GELU written straight to bf16 (the FFN-output matmul's operand) equals the fp32 activation
// rounded, bit for bit, on both bodies and for every activation.
TEST(IsaDispatch, ActivationToBf16EqualsRoundedFp32) {
  const int64_t n = 10007;
  const auto x = wide_values(n, 10);
  for (Isa isa : test::isa_levels()) {
    set_isa_override(isa);
    for (Activation a : {Activation::GeluErf, Activation::GeluTanh, Activation::Relu}) {
      std::vector<float> y(n);
      std::vector<uint16_t> y16(n);
      activation_forward(a, y.data(), x.data(), n);
      activation_forward(Precision::BF16, a, {nullptr, y16.data()},
                         {const_cast<float*>(x.data()), nullptr}, n);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(y16[i], f32_to_bf16(y[i]))
            << "activation " << int(a) << " at " << i << " with " << isa_name(isa);
    }
    reset_isa_override();
  }
}

// fp16 storage: the in-place rounding gives the scalar conversion's bits and values (ties to
// even, subnormals, overflow to infinity, NaN), with and without the bits kept, over several
// threads' chunks and a ragged tail; widening gives the values back exactly.
TEST(Fp16Storage, RoundAndWidenMatchTheScalarConversion) {
  const int64_t n = 200003;
  auto x = random_vector(n, 11);
  // Scales 2^-30 .. 2^17: values that underflow to zero, fp16 subnormals, normals, overflow.
  for (int64_t i = 0; i < n; ++i) x[i] *= std::ldexp(1.0f, static_cast<int>(i % 48) - 30);
  const float specials[] = {65504.0f,   65520.0f, 65519.99f, -1e9f, 0x1p-24f, 0x1p-25f,
                            0x1.8p-25f, 3e-8f,    -0.0f,     NAN,   INFINITY, 1.0f + 0x1p-11f};
  for (size_t i = 0; i < std::size(specials); ++i) x[i * 1001 + 5] = specials[i];
  std::vector<float> y(n), w(n);
  std::vector<uint16_t> h(n);
  round_to_f16(y.data(), x.data(), n, h.data());
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(h[i], f32_to_f16(x[i])) << i << ": " << x[i];
    const float r = f16_to_f32(f32_to_f16(x[i]));
    ASSERT_TRUE(f32_bits(y[i]) == f32_bits(r) || (std::isnan(y[i]) && std::isnan(r))) << i;
  }
  widen_f16(w.data(), h.data(), n);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_TRUE(f32_bits(w[i]) == f32_bits(y[i]) || std::isnan(y[i])) << i;
  std::vector<float> z = x;  // in place, no bits kept
  round_to_f16(z.data(), z.data(), n);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_TRUE(f32_bits(z[i]) == f32_bits(y[i]) || std::isnan(y[i])) << i;
}

// fp16 storage's one-pass activation equals rounding the input, the fp32 activation and rounding
// its output, and its backward equals the fp32 backward at the widened input, bit for bit, on
// every body and for every activation (in place too, as the model calls it).
TEST(IsaDispatch, Fp16ActivationEqualsTheSeparatePasses) {
  const int64_t n = 10007;
  const auto x = wide_values(n, 12), dy = random_vector(n, 13);
  for (Isa isa : test::isa_levels()) {
    set_isa_override(isa);
    for (Activation a : {Activation::GeluErf, Activation::GeluTanh, Activation::Relu}) {
      const std::string at =
          std::string("activation ") + std::to_string(int(a)) + " with " + isa_name(isa);
      std::vector<float> r(n), y(n), dx(n), dx_ref(n);
      std::vector<uint16_t> r16(n), y16(n), in16(n), out16(n);
      round_to_f16(r.data(), x.data(), n, r16.data());
      activation_forward(a, y.data(), r.data(), n);
      round_to_f16(y.data(), y.data(), n, y16.data());
      std::vector<float> z = x;
      activation_forward(Precision::FP16, a, {z.data(), out16.data()}, {z.data(), in16.data()}, n);
      ASSERT_EQ(in16, r16) << at;
      ASSERT_EQ(out16, y16) << at;
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(f32_bits(z[i]), f32_bits(y[i])) << i << " " << at;
      activation_backward(a, dx_ref.data(), r.data(), dy.data(), n);
      activation_backward(Precision::FP16, a, dx.data(), {nullptr, in16.data()}, dy.data(), n);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(f32_bits(dx[i]), f32_bits(dx_ref[i])) << i << " " << at;
    }
    reset_isa_override();
  }
}

// bf16 training saves the pre-activation rounded: the forward's bf16 copy of its input equals
// rounding, and the backward from it equals the fp32 backward at the widened values, bit for
// bit, on every body and for every activation.
TEST(IsaDispatch, ActivationBackwardFromBf16EqualsFp32AtTheRoundedInput) {
  const int64_t n = 10007;
  const auto x = wide_values(n, 11), dy = random_vector(n, 12);
  for (Isa isa : test::isa_levels()) {
    set_isa_override(isa);
    for (Activation a : {Activation::GeluErf, Activation::GeluTanh, Activation::Relu}) {
      std::vector<uint16_t> y16(n), x16(n);
      activation_forward(Precision::BF16, a, {nullptr, y16.data()},
                         {const_cast<float*>(x.data()), x16.data()}, n);
      std::vector<float> xr(n), want(n), got(n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(x16[i], f32_to_bf16(x[i])) << isa_name(isa) << " at " << i;
        xr[i] = bf16_to_f32(x16[i]);
      }
      activation_backward(a, want.data(), xr.data(), dy.data(), n);
      activation_backward(Precision::BF16, a, got.data(), {nullptr, x16.data()}, dy.data(), n);
      ASSERT_EQ(got, want) << "activation " << int(a) << " with " << isa_name(isa);
    }
    reset_isa_override();
  }
}

// The fused residual block (dropout + residual add + LayerNorm forward; LayerNorm backward +
// dropout backward) equals the separate kernels bit for bit on each body; the vector LayerNorms
// (double sums in lanes, float sums of the backward in lanes) are within 2e-6 of the portable.
TEST(IsaDispatch, FusedResidualLayerNormEqualsSeparateKernels) {
  const int64_t N = 37, C = 197;  // tails of 5 (16 lanes) and 5 (8 lanes)
  const auto y = random_vector(N * C, 20), res = random_vector(N * C, 21),
             gamma = random_vector(C, 22), beta = random_vector(C, 23),
             dout = random_vector(N * C, 24);
  const float p = 0.1f;
  auto run = [&](bool fused) {
    std::vector<float> x = y, out(N * C), mean(N), rstd(N), dx(N * C), dy(N * C), dg(C, 0.0f),
                       db(C, 0.0f);
    if (fused) {
      residual_layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), res.data(),
                                 gamma.data(), beta.data(), N, C, 1e-12f, {p, 9, 100});
      layernorm_dropout_backward(dx.data(), dy.data(), dg.data(), db.data(), dout.data(), x.data(),
                                 gamma.data(), mean.data(), rstd.data(), N, C, false, {p, 9, 100});
    } else {
      dropout_forward(x.data(), N * C, {p, 9, 100});
      add_inplace(x.data(), res.data(), N * C);
      layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), gamma.data(), beta.data(),
                        N, C, 1e-12f);
      layernorm_backward(dx.data(), dg.data(), db.data(), dout.data(), x.data(), gamma.data(),
                         mean.data(), rstd.data(), N, C);
      dropout_backward(dy.data(), dx.data(), N * C, {p, 9, 100});
    }
    for (auto* v : {&out, &mean, &rstd, &dx, &dy, &dg, &db})
      x.insert(x.end(), v->begin(), v->end());
    return x;
  };
  std::vector<std::pair<Isa, std::vector<float>>> results;
  for (Isa isa : test::isa_levels()) {
    set_isa_override(isa);
    const auto fused = run(true), separate = run(false);
    reset_isa_override();
    ASSERT_EQ(fused.size(), separate.size());
    for (size_t i = 0; i < fused.size(); ++i)
      ASSERT_EQ(fused[i], separate[i]) << isa_name(isa) << " at " << i;
    results.emplace_back(isa, fused);
  }
  EXPECT_TRUE(vector_bodies_close("layernorm", results, 2e-6, 2e-6));
}

// The fused embedding block equals embedding + LayerNorm + dropout bit for bit on each body.
TEST(IsaDispatch, FusedEmbeddingLayerNormEqualsSeparateKernels) {
  const int64_t B = 3, T = 7, C = 40, V = 11;
  const auto word = random_vector(V * C, 30), pos = random_vector(T * C, 31),
             type = random_vector(2 * C, 32), gamma = random_vector(C, 33),
             beta = random_vector(C, 34);
  std::vector<int32_t> ids(B * T), seg(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    ids[i] = static_cast<int32_t>((i * 5) % V);
    seg[i] = static_cast<int32_t>(i % T >= 4);
  }
  for (Isa isa : test::isa_levels()) {
    set_isa_override(isa);
    std::vector<float> out(B * T * C), sum(out.size()), mean(B * T), rstd(B * T);
    std::vector<float> out2(out.size()), sum2(out.size()), mean2(B * T), rstd2(B * T);
    embedding_layernorm_forward(out.data(), sum.data(), mean.data(), rstd.data(), ids.data(),
                                seg.data(), nullptr, word.data(), pos.data(), type.data(),
                                gamma.data(), beta.data(), B, T, C, 1e-12f, {0.2f, 4, 64});
    embedding_forward(sum2.data(), ids.data(), seg.data(), word.data(), pos.data(), type.data(), B,
                      T, C);
    layernorm_forward(out2.data(), mean2.data(), rstd2.data(), sum2.data(), gamma.data(),
                      beta.data(), B * T, C, 1e-12f);
    dropout_forward(out2.data(), B * T * C, {0.2f, 4, 64});
    reset_isa_override();
    EXPECT_EQ(sum, sum2);
    EXPECT_EQ(out, out2) << isa_name(isa);
    EXPECT_EQ(mean, mean2);
    EXPECT_EQ(rstd, rstd2);
  }
}

TEST(IsaDispatch, DropoutVectorBodiesAreBitIdentical) {
  const int64_t n = 10007;
  const auto x = random_vector(n, 5);
  const auto r = by_isa([&] {
    std::vector<float> y = x, dx(n);
    dropout_forward(y.data(), n, {0.1f, 77, 12345});
    dropout_backward(dx.data(), x.data(), n, {0.1f, 77, 12345});
    y.insert(y.end(), dx.begin(), dx.end());
    return y;
  });
  for (const auto& [isa, v] : r) ASSERT_EQ(v, r.back().second) << isa_name(isa);
}

// Cross-entropy over a BERT-sized vocabulary (V = 30522, not a multiple of 16), with ties for
// the argmax: loss and gradient within 2e-6 relative (fp32 lane sums vs a double sum).
TEST(IsaDispatch, CrossEntropyVectorBodiesMatchPortable) {
  const int64_t N = 5, V = 30522;
  auto logits = random_vector(N * V, 6);
  for (auto& v : logits) v *= 8.0f;
  logits[2 * V + 100] = logits[2 * V + 30000] = 50.0f;  // tie: the first index wins
  std::vector<int32_t> targets = {0, 30521, 100, 17, 29999};
  std::vector<float> weights = {1.0f, 0.5f, 1.0f, 0.0f, 2.0f};
  // Each run: gradient, per-row loss, then the total and the correct flags (as floats).
  const auto r = by_isa([&] {
    std::vector<float> d(N * V), loss(N);
    std::vector<int32_t> correct(N);
    const double total =
        cross_entropy_forward_backward(d.data(), loss.data(), correct.data(), logits.data(),
                                       targets.data(), weights.data(), N, V, 0.25f);
    d.insert(d.end(), loss.begin(), loss.end());
    d.push_back(static_cast<float>(total));
    for (int32_t c : correct) d.push_back(static_cast<float>(c));
    return d;
  });
  EXPECT_TRUE(vector_bodies_close("cross entropy", r, 2e-6, 1e-9));
  for (const auto& [isa, v] : r) {
    for (int64_t i = 0; i < N; ++i)
      EXPECT_EQ(v[N * V + N + 1 + i], r.back().second[N * V + N + 1 + i]) << isa_name(isa);
    EXPECT_EQ(v[N * V + N + 1 + 2], 1.0f) << "tie: the first index wins, " << isa_name(isa);
  }
}

TEST(IsaDispatch, AttentionVectorBodiesMatchPortable) {
  const AttentionShape s{2, 21, 32, 2};
  const auto qkv = random_vector(s.B * s.T * 3 * s.C, 8), dctx = random_vector(s.B * s.T * s.C, 9);
  std::vector<int32_t> mask(s.B * s.T, 1);
  mask[s.T + 20] = 0;
  const auto r = by_isa([&] {
    const size_t np = s.B * s.NH * s.T * s.T;
    std::vector<float> ctx(s.B * s.T * s.C), probs(np), work(np), dqkv(qkv.size());
    attention_forward(ctx.data(), probs.data(), work.data(), qkv.data(), mask.data(), s, 0.2f, 3,
                      0);
    attention_backward(dqkv.data(), work.data(), dctx.data(), qkv.data(), probs.data(), s, 0.2f, 3,
                       0);
    ctx.insert(ctx.end(), dqkv.begin(), dqkv.end());
    return ctx;
  });
  EXPECT_TRUE(vector_bodies_close("attention", r, 1e-5, 1e-7));
}

TEST(IsaDispatch, ReportsWhatItUses) {
  std::printf("kernels use: %s%s\n", isa_name(cpu_isa()),
              cpu_has_avx512_bf16() ? " (+ AVX-512 BF16)" : "");
  set_isa_override(Isa::Portable);
  EXPECT_EQ(cpu_isa(), Isa::Portable);
  reset_isa_override();
}

}  // namespace
}  // namespace bertrain::kernels
