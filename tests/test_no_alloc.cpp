// "No allocation inside a step": every heap allocation made through operator new in this test
// binary is counted (the library and oneDNN included: they are linked into it), and a warmed-up
// training step — zero_grads, forward, backward, the optimizer — must allocate no buffer, in
// every precision, with either attention kernel and either optimizer. What remains is oneDNN's
// bookkeeping inside each primitive execution (its argument maps: a few dozen bytes each, about
// 600 per step of this model with the full attention, 1600 with the blocked one, which runs a
// matmul per head and block), held to a byte budget of 4 KiB per allocation and 256 KiB a step.
// And every kernel's scratch comes from the model's plan (group "kernels") from the first step
// on: no kernel takes a buffer of its own (kernels/cpu/scratch.h counts them).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "core/isa.h"
#include "kernels/cpu/scratch.h"
#include "model/bert.h"
#include "test_util.h"
#include "train/optimizer.h"
#include "train/precision.h"

namespace {
std::atomic<int64_t> g_allocations{0}, g_large{0}, g_bytes{0};
}  // namespace

void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
  if (n >= 4096) g_large.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  return operator new(n);
}
void* operator new(std::size_t n, std::align_val_t a) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return operator new(n, a);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}

namespace bertrain::train {
namespace {

TEST(Step, MakesNoHeapAllocation) {
  const model::BertConfig cfg = test::small_bert(211, 64, 2, 4, 128, 64);
  const model::Batch b = test::random_batch(cfg, 4, 48, 6);
  std::vector<Precision> precisions = {Precision::FP32, Precision::FP16};
  if (test::bf16_unavailable().empty()) precisions.push_back(Precision::BF16);
  for (Precision p : precisions)
    for (auto kernel : {model::ModelDims::Attention::Full, model::ModelDims::Attention::Blocked})
      for (OptimizerKind kind : {OptimizerKind::AdamW, OptimizerKind::Lamb}) {
        model::BertModel m(cfg, model::Head::Pretraining,
                           with_precision({4, 48, 6, Precision::FP32, kernel}, p));
        m.init_params(5);
        OptimizerConfig oc;
        oc.kind = kind;
        Optimizer opt(param_slices(m.table()), m.table().total(), oc);
        int64_t during = 0, large = 0, bytes = 0;
        const int64_t unplanned = kernels::unplanned_scratch_bytes();
        for (int step = 0; step < 3; ++step) {  // steps 0 and 1 warm up (threads, primitives)
          const int64_t before = g_allocations.load(), lb = g_large.load(), bb = g_bytes.load();
          const model::StepOptions so{true, 1, static_cast<uint64_t>(step), 0};
          m.zero_grads();
          m.forward(b, so);
          m.backward(b, so, 1024.0f);
          if (opt.step(m.params(), m.grads(), 1e-4f, 1.0f / 1024, m.weight_copy()).finite)
            m.weights16_updated();
          during = g_allocations.load() - before;
          large = g_large.load() - lb;
          bytes = g_bytes.load() - bb;
        }
        const std::string what =
            str(precision_name(p), ", ",
                kernel == model::ModelDims::Attention::Full ? "full" : "blocked", " attention, ",
                optimizer_name(kind), ": ", during, " allocations, ", bytes, " bytes");
        EXPECT_EQ(large, 0) << what;
        EXPECT_EQ(kernels::unplanned_scratch_bytes() - unplanned, 0) << what;
        EXPECT_LT(bytes, 256 << 10) << what;
        std::printf("%s\n", what.c_str());
      }
}

}  // namespace
}  // namespace bertrain::train
