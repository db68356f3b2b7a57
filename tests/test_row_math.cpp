// The fused kernels' per-row math (kernels/row_math.h), which the CUDA kernels run one warp per
// row, against the CPU kernels on the same inputs. Each row runs on one lane and on 32 lanes,
// the lanes as host threads combining through a barrier as a warp's shuffles do: the striding,
// the combinations and the first-maximum rule are checked here, so that on a GPU only the
// thread mapping is new. Tolerances: the row math sums in fp32 where the CPU's portable and
// vector bodies sum in double or in another order, so results agree to fp32 rounding of a row
// sum (rtol 1e-5 / 2e-5 of the tensor max); dropout masks are the same bits (compared exactly
// through the zeros).
#include <barrier>
#include <thread>

#include <gtest/gtest.h>

#include "gpu_attention_16.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/attention_products.h"
#include "kernels/cuda/scratch.h"
#include "kernels/embedding_runs.h"
#include "kernels/row_math.h"
#include "test_util.h"

namespace bertrain::kernels {
namespace {

using test::all_close;
using test::random_vector;

// `count` lanes on as many threads; a combination is a barrier, the total summed in lane order.
class HostWarp {
 public:
  explicit HostWarp(int count) : count_(count), bar_(count), f_(count), i_(count) {}

  struct Lane {
    HostWarp* w;
    int lane, count;
    float sum(float v) const {
      return w->combine<float>(w->f_, lane, v, [](float a, float b) { return a + b; });
    }
    float max(float v) const {
      return w->combine<float>(w->f_, lane, v, [](float a, float b) { return a > b ? a : b; });
    }
    int64_t min(int64_t v) const {
      return w->combine<int64_t>(w->i_, lane, v,
                                 [](int64_t a, int64_t b) { return a < b ? a : b; });
    }
  };

  // body(lane) on every lane, each on its own thread.
  template <class F>
  void run(F body) {
    std::vector<std::thread> t;
    for (int l = 0; l < count_; ++l) t.emplace_back([&, l] { body(Lane{this, l, count_}); });
    for (auto& x : t) x.join();
  }

 private:
  template <class T, class Op>
  T combine(std::vector<T>& slots, int lane, T v, Op op) {
    slots[lane] = v;
    bar_.arrive_and_wait();
    T total = slots[0];
    for (int l = 1; l < count_; ++l) total = op(total, slots[l]);
    bar_.arrive_and_wait();  // nobody writes a slot again before everyone has read them
    return total;
  }
  int count_;
  std::barrier<> bar_;
  std::vector<float> f_;
  std::vector<int64_t> i_;
};

// f(lanes) for every row, with one lane (the host's OneLane) or a warp of 32.
template <class F>
void for_rows(int lanes, int64_t rows, F f) {
  if (lanes == 1) {
    for (int64_t r = 0; r < rows; ++r) f(r, row_math::OneLane{});
    return;
  }
  HostWarp w(lanes);
  for (int64_t r = 0; r < rows; ++r) w.run([&](const HostWarp::Lane& l) { f(r, l); });
}

class RowMath : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Lanes, RowMath, ::testing::Values(1, 32));

// The residual block (dropout + residual + LayerNorm) and plain LayerNorm, rows mapped to other
// dropout rows (an unpadded model's packed rows); C = 100 leaves lanes with 3 and 4 columns.
TEST_P(RowMath, ResidualLayerNormEqualsCpu) {
  const int64_t N = 7, C = 100;
  const float p = 0.1f, eps = 1e-12f;
  const std::vector<int32_t> rows = {3, 0, 9, 1, 4, 12, 5};
  const auto y = random_vector(N * C, 1, 2.0f), res = random_vector(N * C, 2),
             g = random_vector(C, 3), b = random_vector(C, 4);
  std::vector<float> x_ref = y, out_ref(N * C), mean_ref(N), rstd_ref(N);
  residual_layernorm_forward(out_ref.data(), mean_ref.data(), rstd_ref.data(), x_ref.data(),
                             res.data(), g.data(), b.data(), N, C, eps, {p, 7, 50, rows.data()});
  std::vector<float> x = y, out(N * C), mean(N), rstd(N);
  for_rows(GetParam(), N, [&](int64_t r, const auto& l) {
    row_math::dropout_residual(x.data() + r * C, res.data() + r * C, C, p, 7, 50 + rows[r] * C, l);
    row_math::layernorm(out.data() + r * C, &mean[r], &rstd[r], x.data() + r * C, g.data(),
                        b.data(), C, eps, l);
  });
  EXPECT_EQ(x, x_ref);  // the same mask, the same sums of two values
  EXPECT_TRUE(all_close("out", out.data(), out_ref.data(), out.size(), 1e-5, 1e-5));
  EXPECT_TRUE(all_close("mean", mean.data(), mean_ref.data(), N, 1e-5, 1e-6));
  EXPECT_TRUE(all_close("rstd", rstd.data(), rstd_ref.data(), N, 1e-5, 1e-6));
}

TEST_P(RowMath, EmbeddingLayerNormEqualsCpu) {
  const int64_t B = 2, T = 5, C = 72, V = 30, P = 16;
  const float p = 0.1f, eps = 1e-12f;
  const auto word = random_vector(V * C, 1), pos = random_vector(P * C, 2),
             type = random_vector(2 * C, 3), g = random_vector(C, 4), b = random_vector(C, 5);
  const std::vector<int32_t> ids = {1, 29, 4, 4, 0, 7, 8, 2, 17, 3},
                             seg = {0, 0, 1, 1, 1, 0, 1, 0, 1, 1},
                             positions = {0, 1, 2, 3, 4, 0, 1, 2, 3, 15},
                             rows = {0, 1, 2, 3, 4, 8, 9, 10, 11, 12};
  std::vector<float> out_ref(B * T * C), sum_ref(B * T * C), mean_ref(B * T), rstd_ref(B * T);
  embedding_layernorm_forward(out_ref.data(), sum_ref.data(), mean_ref.data(), rstd_ref.data(),
                              ids.data(), seg.data(), positions.data(), word.data(), pos.data(),
                              type.data(), g.data(), b.data(), B, T, C, eps,
                              {p, 9, 3, rows.data()});
  std::vector<float> out(B * T * C), sum(B * T * C), mean(B * T), rstd(B * T);
  for_rows(GetParam(), B * T, [&](int64_t r, const auto& l) {
    row_math::embedding_sum(sum.data() + r * C, ids[r], seg[r], positions[r], word.data(),
                            pos.data(), type.data(), C, l);
    row_math::layernorm(out.data() + r * C, &mean[r], &rstd[r], sum.data() + r * C, g.data(),
                        b.data(), C, eps, l);
    row_math::dropout_row(out.data() + r * C, C, p, 9, 3 + rows[r] * C, l);
  });
  EXPECT_EQ(sum, sum_ref);
  EXPECT_TRUE(all_close("out", out.data(), out_ref.data(), out.size(), 1e-5, 1e-5));
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i] == 0.0f, out_ref[i] == 0.0f) << i;
}

// The residual block's backward: dx accumulated into, the gradient through the dropout, and the
// parameter gradients by columns.
TEST_P(RowMath, LayerNormDropoutBackwardEqualsCpu) {
  const int64_t N = 9, C = 100;
  const float p = 0.1f, eps = 1e-12f;
  const std::vector<int32_t> rows = {2, 0, 1, 8, 3, 4, 11, 5, 6};
  const auto x = random_vector(N * C, 1, 3.0f), g = random_vector(C, 2), b = random_vector(C, 3),
             dy = random_vector(N * C, 4), dx0 = random_vector(N * C, 5);
  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), N, C, eps);
  std::vector<float> dx_ref = dx0, dd_ref(N * C), dg_ref(C, 0.5f), db_ref(C, -0.5f);
  layernorm_dropout_backward(dx_ref.data(), dd_ref.data(), dg_ref.data(), db_ref.data(), dy.data(),
                             x.data(), g.data(), mean.data(), rstd.data(), N, C, true,
                             {p, 4, 17, rows.data()});
  std::vector<float> dx = dx0, dd(N * C), dg(C, 0.5f), db(C, -0.5f);
  for_rows(GetParam(), N, [&](int64_t r, const auto& l) {
    row_math::layernorm_backward(dx.data() + r * C, dd.data() + r * C, dy.data() + r * C,
                                 x.data() + r * C, g.data(), mean[r], rstd[r], C, true, p, 4,
                                 17 + rows[r] * C, l);
  });
  for (int64_t c = 0; c < C; ++c)
    row_math::layernorm_param_grads(dg.data(), db.data(), dy.data(), x.data(), mean.data(),
                                    rstd.data(), 0, N, C, c);
  EXPECT_TRUE(all_close("dx", dx.data(), dx_ref.data(), dx.size(), 1e-5, 1e-5));
  EXPECT_TRUE(all_close("ddropped", dd.data(), dd_ref.data(), dd.size(), 1e-5, 1e-5));
  for (size_t i = 0; i < dd.size(); ++i) ASSERT_EQ(dd[i] == 0.0f, dd_ref[i] == 0.0f) << i;
  EXPECT_TRUE(all_close("dgamma", dg.data(), dg_ref.data(), C, 1e-5, 1e-5));
  EXPECT_TRUE(all_close("dbeta", db.data(), db_ref.data(), C, 1e-5, 1e-5));
}

// A linear layer's bias gradient as the GPU sums it (cuda::column_chunks): chunks of rows, each
// column summed in order, then the chunks' sums in order, added to what db held. Against the
// CPU's linear_backward; 1000 rows of values in [-1, 1): fp32 sums in another order agree to
// a few ulps of the column's magnitude (rtol 1e-5, 1e-5 of the largest column).
TEST(RowMathColumns, BiasGradientInChunksEqualsCpu) {
  const int64_t M = 1000, N = 37, K = 5;
  const auto dout = random_vector(M * N, 1), in = random_vector(M * K, 2),
             w = random_vector(N * K, 3), db0 = random_vector(N, 4);
  std::vector<float> dw(N * K), db_ref = db0;
  linear_backward(nullptr, dw.data(), db_ref.data(), dout.data(), in.data(), w.data(), M, N, K);
  const int64_t chunks = cuda::column_chunks(M), per = (M + chunks - 1) / chunks;
  ASSERT_EQ(chunks, 32);  // (of 32 rows: kColumnRows)
  std::vector<float> partial(chunks * N, 0.0f), db = db0;
  for (int64_t k = 0; k < chunks; ++k)
    for (int64_t c = 0; c < N; ++c)
      row_math::column_sum(partial.data() + k * N, dout.data(), k * per, std::min(M, (k + 1) * per),
                           N, c);
  for (int64_t c = 0; c < N; ++c) row_math::column_sum(db.data(), partial.data(), 0, chunks, N, c);
  EXPECT_TRUE(all_close("db", db.data(), db_ref.data(), N, 1e-5, 1e-5));
}

// Embedding backward as the GPU sums it: the tokens grouped by table row on the host
// (RowGrouping, as BertModel stages them), each chunk's column by embedding_chunk, the long
// rows' partial rows by embedding_partials_sum. Against the CPU kernel: a row of one chunk
// (most words, every position here: 5 sequences) is the same additions, the same bits; the
// long rows (an id on half of every sequence, the two token types, positions given as 7
// rows) sum chunks first: fp32 sums in another order (rtol 1e-5, 1e-5 of the largest).
TEST(RowMathEmbedding, GroupedSumsEqualCpu) {
  const int64_t B = 5, T = 100, C = 24, V = 40, N = B * T;
  std::vector<int32_t> ids(N), seg(N), pos(N);
  for (int64_t i = 0; i < N; ++i) {
    ids[i] = static_cast<int32_t>(i % T >= 60 ? 0 : 1 + (i * 7) % (V - 1));
    seg[i] = static_cast<int32_t>((i % T) >= 30);
    pos[i] = static_cast<int32_t>(i % 7);  // given positions: 7 rows of 71 or 72 tokens
  }
  const auto dout = random_vector(N * C, 1);
  for (const bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "positions given" : "positions by token");
    const int32_t* positions = packed ? pos.data() : nullptr;
    const int64_t P = packed ? 7 : T;
    std::vector<float> w_ref = random_vector(V * C, 2), p_ref = random_vector(P * C, 3),
                       t_ref = random_vector(2 * C, 4);
    std::vector<float> w = w_ref, p = p_ref, t = t_ref;
    embedding_backward(w_ref.data(), p_ref.data(), t_ref.data(), dout.data(), ids.data(),
                       seg.data(), positions, packed ? 1 : B, packed ? N : T, C);
    RowGrouping g;
    auto apply = [&](std::vector<float>& table, const int32_t* keys, int64_t rows) {
      g.build(keys, T, N, rows);
      std::vector<float> partial(static_cast<size_t>(g.partials() * C));
      ASSERT_LE(g.partials(), max_partials(N));
      for (const EmbeddingChunk& k : g.chunks())
        for (int64_t c = 0; c < C; ++c)
          row_math::embedding_chunk(table.data(), partial.data(), k, g.order().data(), dout.data(),
                                    C, c);
      for (const EmbeddingSum& s : g.sums())
        for (int64_t c = 0; c < C; ++c)
          row_math::embedding_partials_sum(table.data(), partial.data(), s, C, c);
    };
    apply(w, ids.data(), V);
    ASSERT_EQ(g.sums().size(), 1u);  // id 0: 40 tokens in each of 5 sequences
    apply(p, positions, P);
    ASSERT_EQ(g.sums().size(), packed ? 7u : 0u);
    apply(t, seg.data(), 2);
    ASSERT_EQ(g.sums().size(), 2u);
    for (int64_t i = C; i < V * C; ++i) ASSERT_EQ(w[i], w_ref[i]) << "word row " << i / C;
    if (!packed) {
      EXPECT_EQ(p, p_ref);
    }
    EXPECT_TRUE(all_close("dword", w.data(), w_ref.data(), w.size(), 1e-5, 1e-5));
    EXPECT_TRUE(all_close("dposition", p.data(), p_ref.data(), p.size(), 1e-5, 1e-5));
    EXPECT_TRUE(all_close("dtoken_type", t.data(), t_ref.data(), t.size(), 1e-5, 1e-5));
  }
}

// The 16-bit attention row passes that round as they write (the GPU's: no fp32 pass between the
// softmax and its bf16 / fp16 operands): the kept and the dropped probabilities, and ds, are the
// bits the fp32 row passes give rounded afterwards, exactly. fp16 with a row of tiny
// probabilities too (subnormal in fp16, rounded as f32_to_f16 rounds them).
template <class H, class Round, class Widen>
void check_rows_16(int lanes, Round round, Widen widen) {
  const int64_t rows = 6, T = 45;
  const float p = 0.1f, ks = row_math::keep_scale_of(p);
  const uint64_t key = 3, index0 = 100;
  auto scores = random_vector(rows * T, 1, 4.0f);
  for (int64_t j = 0; j < T; ++j) scores[5 * T + j] = j == 0 ? 0.0f : -12.0f - 0.1f * j;
  const auto dd = random_vector(rows * T, 2);
  std::vector<int32_t> mask(T, 1);
  for (int64_t j = 40; j < T; ++j) mask[j] = 0;
  std::vector<float> probs(rows * T), ds(rows * T);
  std::vector<H> probs16(rows * T), dropped16(rows * T), ds16(rows * T);
  for_rows(lanes, rows, [&](int64_t r, const auto& l) {
    const uint64_t i0 = index0 + r * T;
    row_math::attention_softmax(probs.data() + r * T, nullptr, scores.data() + r * T, mask.data(),
                                T, 0.0f, key, i0, l);
    row_math::attention_softmax_16(probs16.data() + r * T, dropped16.data() + r * T,
                                   scores.data() + r * T, mask.data(), T, p, key, i0, l);
    row_math::attention_softmax_backward(ds.data() + r * T, dd.data() + r * T,
                                         probs16.data() + r * T, T, p, key, i0, l);
    row_math::attention_softmax_backward(ds16.data() + r * T, dd.data() + r * T,
                                         probs16.data() + r * T, T, p, key, i0, l);
  });
  for (int64_t i = 0; i < rows * T; ++i) {
    const uint16_t b = round(probs[i]);
    ASSERT_EQ(probs16[i].bits, b) << i;
    ASSERT_EQ(dropped16[i].bits, round(row_math::dropout(widen(b), p, ks, key, index0 + i))) << i;
    ASSERT_EQ(ds16[i].bits, round(ds[i])) << i;
  }
}

TEST_P(RowMath, Attention16BitRowsEqualRoundingAfter) {
  {
    SCOPED_TRACE("bf16");
    check_rows_16<row_math::Bf16Bits>(GetParam(), f32_to_bf16, bf16_to_f32);
  }
  {
    SCOPED_TRACE("fp16");
    check_rows_16<row_math::F16Bits>(GetParam(), f32_to_f16, f16_to_f32);
  }
}

// Attention as the GPU runs it: the six products over every (sequence, head) pair
// (gemm_reference here), the mask + softmax + dropout and its backward by rows. Against the
// CPU's reference loops with a padded sequence and dropout, with a dropout row length larger
// than T (an unpadded run inside a batch padded to 48).
TEST_P(RowMath, AttentionEqualsCpu) {
  AttentionShape s{2, 37, 64, 4};
  s.dropout_T = 48;
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, C3 = 3 * C;
  const float p = 0.1f;
  const uint64_t key = 5, offset = 11;
  const auto qkv = random_vector(B * T * C3, 72), dctx = random_vector(B * T * C, 73);
  std::vector<int32_t> mask(B * T, 1);
  for (int64_t t = 30; t < T; ++t) mask[T + t] = 0;
  std::vector<float> ctx_ref(B * T * C), probs_ref(B * NH * T * T), dqkv_ref(qkv.size());
  attention_forward_reference(ctx_ref.data(), probs_ref.data(), qkv.data(), mask.data(), s, p, key,
                              offset);
  attention_backward_reference(dqkv_ref.data(), dctx.data(), qkv.data(), probs_ref.data(), s, p,
                               key, offset);

  // The GPU's six products (cuda/attention_products.h: every (sequence, head) pair in place in
  // the QKV rows, the [B, NH, T, T] buffers and the context rows), each pair through the
  // reference GEMM; the row passes between them over all B x NH x T rows.
  const int64_t pairs = B * NH;
  auto run = [&](const cuda::PairProduct& m) { test::run_pairs(m, pairs, NH); };
  std::vector<float> probs(B * NH * T * T), dropped(probs.size()), ctx(B * T * C),
      dqkv(qkv.size(), 0.0f), dd(probs.size());
  const auto fwd =
      cuda::attention_forward_products(s, 4, qkv.data(), probs.data(), dropped.data(), ctx.data());
  run(fwd[0]);  // scale Q K^T into probs: the row pass works in place
  for_rows(GetParam(), pairs * T, [&](int64_t r, const auto& l) {
    const int64_t bh = r / T;
    row_math::attention_softmax(probs.data() + r * T, dropped.data() + r * T, probs.data() + r * T,
                                mask.data() + (bh / NH) * T, T, p, key,
                                offset + s.dropout_row(bh, r % T), l);
  });
  run(fwd[1]);
  const auto bwd = cuda::attention_backward_products(s, 4, qkv.data(), dropped.data(), dctx.data(),
                                                     dd.data(), dd.data(), dqkv.data());
  run(bwd[0]);  // dV
  run(bwd[1]);  // dd
  for_rows(GetParam(), pairs * T, [&](int64_t r, const auto& l) {
    row_math::attention_softmax_backward(dd.data() + r * T, dd.data() + r * T, probs.data() + r * T,
                                         T, p, key, offset + s.dropout_row(r / T, r % T), l);
  });
  run(bwd[2]);  // dQ
  run(bwd[3]);  // dK
  EXPECT_TRUE(all_close("probs", probs.data(), probs_ref.data(), probs.size(), 2e-5, 1e-7));
  EXPECT_TRUE(all_close("ctx", ctx.data(), ctx_ref.data(), ctx.size(), 2e-5, 1e-6));
  EXPECT_TRUE(all_close("dqkv", dqkv.data(), dqkv_ref.data(), dqkv.size(), 2e-5, 1e-6));
}

// The 16-bit attention as the GPU's BF16 and FP16 run it (gpu_attention_16.h: the six product
// descriptions on 2-byte operands read in place, the rounding row passes, dS written over the
// dropped probabilities once dV has read them), on 1 and 32 lanes, against the fp32 reference:
// the operands round at the format's unit (bf16 2^-8, fp16 2^-11), so a few units of the tensor
// max (bf16 3e-2, fp16 4e-3); the kept probabilities are the reference's rounded, to a unit.
template <class H, class Round, class Widen>
void check_attention_16(int lanes, Round round, Widen widen, double tol) {
  AttentionShape s{2, 37, 64, 4};
  s.dropout_T = 48;
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, C3 = 3 * C, n_p = B * NH * T * T;
  const Dropout d{0.1f, 5, 11, nullptr};
  const auto qkv = random_vector(B * T * C3, 72), dctx = random_vector(B * T * C, 73);
  std::vector<int32_t> mask(B * T, 1);
  for (int64_t t = 30; t < T; ++t) mask[T + t] = 0;
  std::vector<float> ctx_ref(B * T * C), probs_ref(n_p), dqkv_ref(qkv.size());
  attention_forward_reference(ctx_ref.data(), probs_ref.data(), qkv.data(), mask.data(), s, d.p,
                              d.key, d.offset);
  attention_backward_reference(dqkv_ref.data(), dctx.data(), qkv.data(), probs_ref.data(), s, d.p,
                               d.key, d.offset);
  std::vector<H> qkv16(qkv.size()), probs16(n_p), work16(n_p), dctx16(dctx.size());
  for (size_t i = 0; i < qkv.size(); ++i) qkv16[i].bits = round(qkv[i]);
  for (size_t i = 0; i < dctx.size(); ++i) dctx16[i].bits = round(dctx[i]);
  std::vector<float> ctx(B * T * C), dqkv(qkv.size());
  auto rows = [&](int64_t n, const auto& f) { for_rows(lanes, n, f); };
  test::gpu_attention_16_forward(ctx.data(), probs16.data(), work16.data(), qkv16.data(),
                                 mask.data(), s, d, rows);
  test::gpu_attention_16_backward(dqkv.data(), dctx16.data(), qkv16.data(), probs16.data(),
                                  work16.data(), s, d, rows);
  std::vector<float> kept(n_p);
  for (int64_t e = 0; e < n_p; ++e) kept[e] = widen(probs16[e].bits);
  EXPECT_TRUE(all_close("probs", kept.data(), probs_ref.data(), n_p, tol, tol));
  EXPECT_TRUE(all_close("ctx", ctx.data(), ctx_ref.data(), ctx.size(), tol, tol));
  EXPECT_TRUE(all_close("dqkv", dqkv.data(), dqkv_ref.data(), dqkv.size(), tol, tol));
}

TEST_P(RowMath, Attention16BitEqualsTheReference) {
  {
    SCOPED_TRACE("bf16");
    check_attention_16<row_math::Bf16Bits>(GetParam(), f32_to_bf16, bf16_to_f32, 3e-2);
  }
  {
    SCOPED_TRACE("fp16");
    check_attention_16<row_math::F16Bits>(GetParam(), f32_to_f16, f16_to_f32, 4e-3);
  }
}

// The blocked kernel as the GPU runs it (gpu_attention_16.h: cuda::blocked_forward / _backward,
// the schedule, products and row passes of the CUDA backend) against the CPU's reference loops
// and the CPU's blocked kernel: T = 150 is a full 128-row block and a 22-row one (dV and dK
// added across blocks), a padded sequence, dropout, a dropout row length larger than T.
// fp32: the reference's tolerances (rtol 2e-5 of the tensor max); the log-sum-exp the CPU's
// blocked kernel keeps within 1e-5. bf16 / fp16 (16-bit operands, fp32 accumulation): a few
// units of the format (bf16 3e-2, fp16 4e-3), as the full kernel's 16-bit flow.
struct BlockedCase {
  AttentionShape s{2, 150, 32, 2};
  Dropout d{0.1f, 5, 11, nullptr};
  std::vector<float> qkv, dctx, ctx_ref, probs_ref, dqkv_ref;
  std::vector<int32_t> mask;
  BlockedCase() {
    s.dropout_T = 160;
    const int64_t B = s.B, T = s.T, C = s.C;
    qkv = random_vector(B * T * 3 * C, 81);
    dctx = random_vector(B * T * C, 82);
    mask.assign(B * T, 1);
    for (int64_t t = 131; t < T; ++t) mask[T + t] = 0;
    ctx_ref.resize(B * T * C);
    probs_ref.resize(B * s.NH * T * T);
    dqkv_ref.resize(qkv.size());
    attention_forward_reference(ctx_ref.data(), probs_ref.data(), qkv.data(), mask.data(), s, d.p,
                                d.key, d.offset);
    attention_backward_reference(dqkv_ref.data(), dctx.data(), qkv.data(), probs_ref.data(), s, d.p,
                                 d.key, d.offset);
  }
};

TEST_P(RowMath, BlockedAttentionEqualsCpu) {
  const BlockedCase c;
  const AttentionShape& s = c.s;
  auto rows = [&](int64_t n, const auto& f) { for_rows(GetParam(), n, f); };
  std::vector<float> ctx(c.ctx_ref.size()), lse(s.B * s.NH * s.T), dqkv(c.qkv.size(), 7.0f);
  test::gpu_attention_blocked_forward(ctx.data(), lse.data(), c.qkv.data(), c.mask.data(), s, c.d,
                                      rows);
  test::gpu_attention_blocked_backward(dqkv.data(), c.dctx.data(), c.qkv.data(), lse.data(),
                                       c.mask.data(), s, c.d, rows);
  EXPECT_TRUE(all_close("ctx", ctx.data(), c.ctx_ref.data(), ctx.size(), 2e-5, 1e-6));
  EXPECT_TRUE(all_close("dqkv", dqkv.data(), c.dqkv_ref.data(), dqkv.size(), 2e-5, 1e-6));
  std::vector<float> ctx_cpu(ctx.size()), lse_cpu(lse.size());
  attention_blocked_forward(ctx_cpu.data(), lse_cpu.data(), c.qkv.data(), c.mask.data(), s, c.d.p,
                            c.d.key, c.d.offset);
  EXPECT_TRUE(all_close("lse", lse.data(), lse_cpu.data(), lse.size(), 1e-5, 1e-5));
}

template <class H, class Round>
void check_blocked_16(int lanes, Round round, double tol) {
  const BlockedCase c;
  const AttentionShape& s = c.s;
  auto rows = [&](int64_t n, const auto& f) { for_rows(lanes, n, f); };
  std::vector<H> qkv16(c.qkv.size()), dctx16(c.dctx.size());
  for (size_t i = 0; i < qkv16.size(); ++i) qkv16[i].bits = round(c.qkv[i]);
  for (size_t i = 0; i < dctx16.size(); ++i) dctx16[i].bits = round(c.dctx[i]);
  std::vector<float> ctx(c.ctx_ref.size()), lse(s.B * s.NH * s.T), dqkv(c.qkv.size());
  test::gpu_attention_blocked_forward(ctx.data(), lse.data(), qkv16.data(), c.mask.data(), s, c.d,
                                      rows);
  test::gpu_attention_blocked_backward(dqkv.data(), dctx16.data(), qkv16.data(), lse.data(),
                                       c.mask.data(), s, c.d, rows);
  EXPECT_TRUE(all_close("ctx", ctx.data(), c.ctx_ref.data(), ctx.size(), tol, tol));
  EXPECT_TRUE(all_close("dqkv", dqkv.data(), c.dqkv_ref.data(), dqkv.size(), tol, tol));
  EXPECT_GT(test::rel_l2(dqkv, c.dqkv_ref), 1e-6);  // really 16-bit operands
}

TEST_P(RowMath, BlockedAttention16BitEqualsTheReference) {
  {
    SCOPED_TRACE("bf16");
    check_blocked_16<row_math::Bf16Bits>(GetParam(), f32_to_bf16, 3e-2);
  }
  {
    SCOPED_TRACE("fp16");
    check_blocked_16<row_math::F16Bits>(GetParam(), f32_to_f16, 4e-3);
  }
}

// Cross-entropy with its gradient in place of the logits, weights (one 0), and ties for the
// maximum in different lanes' columns: the first maximum decides the hit, as on the CPU. The rows
// are padded (1000 classes in rows of 1024, as the model pads its vocabulary): the padding holds
// values larger than any logit, which must be neither a class nor the maximum, and its gradient
// is written 0.
TEST_P(RowMath, CrossEntropyEqualsCpu) {
  const int64_t N = 6, V = 1000, S = 1024;
  auto logits = random_vector(N * V, 1, 3.0f);
  const std::vector<int32_t> targets = {5, 999, 0, 77, 64, 3};
  const std::vector<float> weights = {1.0f, 0.5f, 0.0f, 2.0f, 1.0f, 1.0f};
  logits[3 * V + 77] = logits[3 * V + 640] = 50.0f;  // tie; the target is the first
  logits[4 * V + 33] = logits[4 * V + 64] = 50.0f;   // tie; the target is the second
  logits[5 * V + 3] = 50.0f;
  std::vector<float> d_ref(N * V), loss_ref(N);
  std::vector<int32_t> hit_ref(N);
  const double total_ref =
      cross_entropy_forward_backward(d_ref.data(), loss_ref.data(), hit_ref.data(), logits.data(),
                                     targets.data(), weights.data(), N, V, 0.25f);
  std::vector<float> d(N * S, 99.0f), loss(N);  // the gradient overwrites the logits
  for (int64_t r = 0; r < N; ++r) std::copy_n(logits.data() + r * V, V, d.data() + r * S);
  std::vector<int32_t> hit(N);
  for_rows(GetParam(), N, [&](int64_t r, const auto& l) {
    const auto row = row_math::cross_entropy(d.data() + r * S, d.data() + r * S, targets[r],
                                             weights[r], V, S, 0.25f, l);
    if (l.lane == 0) {
      loss[r] = row.loss;
      hit[r] = row.hit;
    }
  });
  double total = 0;
  for (int64_t r = 0; r < N; ++r) total += weights[r] * loss[r];
  EXPECT_EQ(hit, hit_ref);
  EXPECT_EQ(hit, (std::vector<int32_t>{0, 0, 0, 1, 0, 1}));
  EXPECT_TRUE(all_close("loss", loss.data(), loss_ref.data(), N, 1e-5, 1e-6));
  EXPECT_NEAR(total, total_ref, 1e-5 * std::fabs(total_ref));
  std::vector<float> real(N * V), padding;
  for (int64_t r = 0; r < N; ++r) {
    std::copy_n(d.data() + r * S, V, real.data() + r * V);
    padding.insert(padding.end(), d.data() + r * S + V, d.data() + (r + 1) * S);
  }
  EXPECT_TRUE(all_close("dlogits", real.data(), d_ref.data(), real.size(), 1e-5, 1e-5));
  EXPECT_EQ(padding, std::vector<float>(N * (S - V), 0.0f));
}

// The CPU's cross-entropy on padded rows (Classes{V, stride}) gives the compact rows' bits: the
// padding (here larger than every logit) is read by nothing, and its gradient is written 0.
TEST(CrossEntropy, PaddedRowsGiveTheCompactRowsBits) {
  const int64_t N = 5, V = 30522, S = 30528;
  const auto logits = random_vector(N * V, 7, 3.0f);
  const std::vector<int32_t> targets = {0, 30521, 17, 4096, 30000};
  const std::vector<float> weights = {1.0f, 1.0f, 0.5f, 0.0f, 2.0f};
  std::vector<float> d_ref(logits), loss_ref(N);
  std::vector<int32_t> hit_ref(N);
  const double total_ref =
      cross_entropy_forward_backward(d_ref.data(), loss_ref.data(), hit_ref.data(), d_ref.data(),
                                     targets.data(), weights.data(), N, V, 0.125f);
  std::vector<float> d(N * S, 1e4f), loss(N);
  for (int64_t r = 0; r < N; ++r) std::copy_n(logits.data() + r * V, V, d.data() + r * S);
  std::vector<int32_t> hit(N);
  const double total =
      cross_entropy_forward_backward(d.data(), loss.data(), hit.data(), d.data(), targets.data(),
                                     weights.data(), N, Classes{V, S}, 0.125f);
  EXPECT_EQ(total, total_ref);
  EXPECT_EQ(loss, loss_ref);
  EXPECT_EQ(hit, hit_ref);
  for (int64_t r = 0; r < N; ++r) {
    EXPECT_EQ(std::vector<float>(d.data() + r * S, d.data() + r * S + V),
              std::vector<float>(d_ref.data() + r * V, d_ref.data() + (r + 1) * V))
        << "row " << r;
    EXPECT_EQ(std::vector<float>(d.data() + r * S + V, d.data() + (r + 1) * S),
              std::vector<float>(S - V, 0.0f))
        << "row " << r << "'s padding";
  }
}

}  // namespace
}  // namespace bertrain::kernels
