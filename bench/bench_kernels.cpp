// Micro-benchmarks of the CPU kernels at BERT shapes (Google Benchmark).
// Reports GFLOP/s for the matmuls so they can be compared with the machine's GEMM ceiling.
#include <benchmark/benchmark.h>

#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "train/optimizer.h"

using namespace bertrain::kernels;

static void BM_LinearForward(benchmark::State& st) {
  const int64_t M = st.range(0), N = st.range(1), K = st.range(2);
  std::vector<float> x(M * K, 0.5f), w(N * K, 0.01f), b(N, 0.1f), y(M * N);
  for (auto _ : st) linear_forward(y.data(), x.data(), w.data(), b.data(), M, N, K);
  st.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * M * N * K * st.iterations(), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_LinearForward)
    ->Args({4096, 768, 768})
    ->Args({4096, 3072, 768})
    ->Args({4096, 256, 256})
    ->Unit(benchmark::kMillisecond);

static void BM_LinearBackward(benchmark::State& st) {
  const int64_t M = st.range(0), N = st.range(1), K = st.range(2);
  std::vector<float> x(M * K, 0.5f), w(N * K, 0.01f), dy(M * N, 0.1f), dx(M * K), dw(N * K), db(N);
  for (auto _ : st)
    linear_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), M, N, K);
  st.counters["GFLOP/s"] = benchmark::Counter(
      4.0 * M * N * K * st.iterations(), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_LinearBackward)->Args({4096, 768, 768})->Unit(benchmark::kMillisecond);

static void BM_LayerNormForward(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1);
  std::vector<float> x(N * C, 0.3f), g(C, 1.0f), b(C, 0.0f), y(N * C), m(N), r(N);
  for (auto _ : st)
    layernorm_forward(y.data(), m.data(), r.data(), x.data(), g.data(), b.data(), N, C, 1e-12f);
  st.SetBytesProcessed(st.iterations() * N * C * 8);
}
BENCHMARK(BM_LayerNormForward)->Args({4096, 768})->Unit(benchmark::kMicrosecond);

static void BM_AttentionForward(benchmark::State& st) {
  const int64_t B = st.range(0), T = st.range(1), C = st.range(2), NH = st.range(3);
  std::vector<float> qkv(B * T * 3 * C, 0.01f), ctx(B * T * C), probs(B * NH * T * T),
      work(probs.size());
  std::vector<int32_t> mask(B * T, 1);
  for (auto _ : st)
    attention_forward(ctx.data(), probs.data(), work.data(), qkv.data(), mask.data(), {B, T, C, NH},
                      0.1f, 7, 0);
  st.counters["GFLOP/s"] =
      benchmark::Counter(4.0 * B * T * T * C * st.iterations(), benchmark::Counter::kIsRate,
                         benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AttentionForward)->Args({8, 128, 768, 12})->Unit(benchmark::kMillisecond);

// The optimizer's two passes over BERT-base's 110M parameters: the norm + finite check
// (reads the gradients) and the AdamW update with unscale and clipping (reads gradients,
// parameters and both moments, writes all three). The first pass is what fusing them would
// save; global-norm clipping needs the norm before the first update.
static bertrain::train::Optimizer base_sized_adamw(int64_t n) {
  return bertrain::train::Optimizer({{"all", 0, n, true}}, n, {});
}
static void BM_OptimizerNormPass(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto opt = base_sized_adamw(n);
  std::vector<float> g(n, 1e-3f);
  for (auto _ : st) benchmark::DoNotOptimize(opt.measure(g.data(), 0.5f));
  st.SetBytesProcessed(st.iterations() * n * 4);
}
BENCHMARK(BM_OptimizerNormPass)->Arg(110000000)->Unit(benchmark::kMillisecond);
static void BM_OptimizerUpdatePass(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto opt = base_sized_adamw(n);
  std::vector<float> g(n, 1e-3f), p(n, 0.02f);
  const auto r = opt.measure(g.data(), 0.5f);
  for (auto _ : st) opt.apply(p.data(), g.data(), 1e-5f, 0.5f, r);
  st.SetBytesProcessed(st.iterations() * n * 28);
}
BENCHMARK(BM_OptimizerUpdatePass)->Arg(110000000)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
