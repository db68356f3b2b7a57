// The blocked (flash-style) attention core against the full one (kernels/cpu/attention.h),
// fp32 and bf16: forward + backward at BERT-base head shapes for T = 128 and 512, best of 5, with
// the bytes each keeps between forward and backward ([B,NH,T,T] probabilities vs the [B,NH,T]
// row log-sum-exp). This was the experiment that promoted the blocked variant for long
// sequences (same speed at T = 512, a fraction of the memory). Usage: bench_attention_blocked
// [threads]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/isa.h"
#include "kernels/cpu/attention.h"

using namespace bertrain;
using namespace bertrain::kernels;

namespace {

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

template <typename F>
double best_seconds(F&& f, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) omp_set_num_threads(std::atoi(argv[1]));
  const float p = 0.1f;
  const bool bf16 = cpu_has_avx512_bf16();
  std::printf(
      "%d threads, BERT-base heads (C 768, 12 heads), dropout %.1f, forward + backward, "
      "best of 5\n",
      omp_get_max_threads(), p);
  std::printf("%-5s %-12s %12s %12s %8s %16s %16s\n", "prec", "B x T", "full ms", "blocked ms",
              "ratio", "full keeps", "blocked keeps");
  for (const bool half : {false, true}) {
    if (half && !bf16) break;
    for (const auto& [B, T] : {std::pair<int64_t, int64_t>{8, 128}, {2, 512}, {8, 512}}) {
      const AttentionShape s{B, T, 768, 12};
      const size_t np = B * 12 * T * T;
      const auto qkv = randn(B * T * 3 * 768, 3), dctx = randn(B * T * 768, 4);
      std::vector<int32_t> mask(B * T, 1);
      std::vector<float> ctx(B * T * 768), dqkv(qkv.size()), probs(half ? 0 : np), work(np),
          lse(B * 12 * T);
      std::vector<uint16_t> q16(qkv.size()), p16(np), d16(dctx.size()), saved(half ? np : 0);
      const AttentionBf16 w{q16.data(), p16.data(), d16.data(), saved.data()};
      const AttentionBf16* h = half ? &w : nullptr;
      const double full = best_seconds(
          [&] {
            attention_forward(ctx.data(), probs.data(), work.data(), qkv.data(), mask.data(), s, p,
                              5, 0, h);
            attention_backward(dqkv.data(), work.data(), dctx.data(), qkv.data(), probs.data(), s,
                               p, 5, 0, h);
          },
          5);
      const double blocked = best_seconds(
          [&] {
            attention_blocked_forward(ctx.data(), lse.data(), qkv.data(), mask.data(), s, p, 5, 0,
                                      h);
            attention_blocked_backward(dqkv.data(), dctx.data(), qkv.data(), lse.data(),
                                       mask.data(), s, p, 5, 0, h);
          },
          5);
      std::printf("%-5s %4lld x %-5lld %12.1f %12.1f %7.2fx %13.1f MiB %13.2f MiB\n",
                  half ? "bf16" : "fp32", (long long)B, (long long)T, 1e3 * full, 1e3 * blocked,
                  full / blocked, np * (half ? 2.0 : 4.0) / (1 << 20),
                  B * 12 * T * 4.0 / (1 << 20));
    }
  }
  return 0;
}
