// "One memory plan": what `bertrain estimate` prints is what a training run allocates, and the
// process's measured peak resident memory is that plan plus the libraries' own footprint.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kernels/cpu/matmul.h"
#include "kernels/cuda/scratch.h"
#include "model/bert.h"
#include "model/checkpoint.h"
#include "plan/memory.h"
#include "test_util.h"
#include "train/optimizer.h"
#include "train/precision.h"

namespace bertrain {
namespace {

model::BertConfig small_config() {
  return test::small_bert(1000, 64, 2, 4, 256, 512);
}

// Every byte of the plan is allocated, and nothing a step needs beyond the arenas' fixed size
// is: for every precision, attention kernel and head, the model's arenas plus the optimizer's
// hold exactly the estimate's total.
TEST(MemoryPlan, EstimateEqualsTheArenas) {
  const model::BertConfig cfg = small_config();
  for (Precision p : {Precision::FP32, Precision::BF16, Precision::FP16})
    for (auto attention : {model::ModelDims::Attention::Full, model::ModelDims::Attention::Blocked})
      for (model::Head head : {model::Head::Pretraining, model::Head::SequenceClassification}) {
        const model::ModelDims dims =
            train::with_precision({4, 64, 10, Precision::FP32, attention}, p);
        model::BertModel m(cfg, head, dims);
        train::Optimizer opt(train::param_slices(m.table()), m.table().total(), {});
        const MemoryPlan plan = plan::training_plan(cfg, head, dims, 2);
        EXPECT_EQ(m.allocated_bytes() + opt.allocated_bytes(), plan.total_bytes())
            << precision_name(p) << " " << model::attention_name(attention);
        EXPECT_EQ(opt.allocated_bytes(), plan.group_bytes("optimizer"));
        EXPECT_EQ(m.allocated_bytes(), m.plan().total_bytes());
      }
}

// Sharded over N ranks, the optimizer state a rank allocates is its part; the plan (estimate
// --shard-optimizer --ranks N) holds the largest part, which is at most 1/N of the unsharded state
// plus, per moment, a 16-float unit (parts are cut in units) and its allocation's 64-byte
// alignment, and the gradient gate's 64 bytes (which every part holds whole).
TEST(MemoryPlan, ShardedOptimizerStateIsTheLargestPart) {
  const model::BertConfig cfg = small_config();
  const model::ModelDims dims{4, 64, 10};
  model::BertModel m(cfg, model::Head::Pretraining, dims);
  const int64_t total = m.table().total();
  const size_t whole =
      plan::training_plan(cfg, model::Head::Pretraining, dims, 2).group_bytes("optimizer");
  for (int world : {2, 3, 4, 8}) {
    const MemoryPlan plan = plan::training_plan(cfg, model::Head::Pretraining, dims, 2, world);
    size_t most = 0;
    for (int r = 0; r < world; ++r) {
      train::Optimizer opt(train::param_slices(m.table()), total, {}, kernels::cpu_backend(),
                           train::shard_of(total, r, world));
      most = std::max(most, opt.allocated_bytes());
    }
    EXPECT_EQ(plan.group_bytes("optimizer"), most) << world << " ranks";
    EXPECT_LE(most, whole / world + 2 * (16 * sizeof(float) + 64) + 64) << world << " ranks";
  }
}

// bf16 with a sharded optimizer (ZeRO-1's sharded fp32 master): each rank's parameters arena
// holds the tensors read in fp32 and its own part of the matmul weights; the pages of the rest
// are holes (never resident; touching one faults). Its weights (the bf16 copy) and its losses
// are the unsharded model's bit for bit, and its model file, with the other ranks' parts
// supplied, is the unsharded model's file.
TEST(MemoryPlan, ShardedMasterHoldsOnlyItsPartOfTheMatmulWeights) {
  const model::BertConfig cfg = test::small_bert(1000, 128, 2, 4, 512, 128);
  const model::ModelDims dims = train::with_precision({4, 64, 10}, Precision::BF16);
  model::BertModel ref(cfg, model::Head::Pretraining, dims);
  ref.init_params(7);
  const int64_t total = ref.table().total();
  std::vector<uint16_t> ref_bf16(static_cast<size_t>(total));
  ref.refresh_weights16(0, total);
  std::copy(ref.weights16(), ref.weights16() + total, ref_bf16.begin());
  const model::Batch batch = test::random_batch(cfg, 4, 64, 10);
  const bool run = test::bf16_unavailable().empty();
  const model::StepOptions so{false, 0, 0, 0};
  const model::Losses want = run ? ref.forward(batch, so) : model::Losses{};
  const test::TempDir tmp;
  model::save_pretrained(ref, (tmp.path / "ref").string());
  int64_t kept = 0;
  for (const auto& [b, e] : ref.table().fp32_read_ranges()) kept += e - b;
  for (int world : {2, 3}) {
    size_t most = 0;
    for (int r = 0; r < world; ++r) {
      const model::ModelDims d = plan::with_master_shard(cfg, model::Head::Pretraining, dims, r,
                                                         world, kernels::cpu_backend());
      ASSERT_TRUE(d.master_shard);
      model::BertModel m(cfg, model::Head::Pretraining, d);
      const std::string what = str("rank ", r, " of ", world);
      EXPECT_EQ(m.allocated_bytes(), m.plan().total_bytes()) << what;
      // Resident: the fp32-read tensors, the own part, and at most the 2 partial pages at the
      // ends of each matmul range outside it.
      const size_t params = m.plan().group_bytes("parameters");
      const auto outside = m.table().matmul_ranges_outside(d.master_begin, d.master_end);
      EXPECT_LT(params, static_cast<size_t>(4 * total)) << what;
      EXPECT_LE(params, 4 * static_cast<size_t>(kept + d.master_end - d.master_begin) +
                            2 * kPage * outside.size())
          << what;
      most = std::max(most, params);
      m.init_params(7);
      EXPECT_EQ(std::memcmp(m.weights16(), ref_bf16.data(), ref_bf16.size() * 2), 0) << what;
      for (const auto& p : m.table().params()) {
        if (!m.holds_fp32(p)) continue;
        EXPECT_EQ(std::memcmp(m.param(p.name), ref.param(p.name), 4 * p.numel()), 0) << p.name;
      }
      if (run) {
        const model::Losses got = m.forward(batch, so);
        EXPECT_EQ(got.loss, want.loss) << what;
        EXPECT_EQ(got.mlm_correct, want.mlm_correct) << what;
      }
      // Saving needs the other ranks' parts; given them, the file is the unsharded model's.
      const std::string dir = (tmp.path / what).string();
      EXPECT_DEATH(model::save_pretrained(m, dir), "is sharded over the ranks") << what;
      model::save_pretrained(m, dir, DType::F32, [&](const model::ParamInfo& p, float* out) {
        std::copy(ref.param(p.name), ref.param(p.name) + p.numel(), out);
      });
      EXPECT_EQ(test::read_file((tmp.path / "ref/model.safetensors").string()),
                test::read_file(dir + "/model.safetensors"))
          << what;
      // A weight of another rank's part is not there: reading it faults.
      const int64_t floats = static_cast<int64_t>(kPage / 4);
      const int64_t hole = (outside.front().first + floats - 1) / floats * floats;
      if (hole + floats <= outside.front().second) {
        EXPECT_DEATH(
            {
              volatile float x = m.params()[hole];
              (void)x;
            },
            "")
            << what;
      }
    }
    // The plan a rank's estimate prints is the most any rank holds.
    EXPECT_EQ(plan::with_master_shard(cfg, model::Head::Pretraining, dims, -1, world,
                                      kernels::cpu_backend())
                  .master_begin,
              [&] {
                for (int r = 0; r < world; ++r) {
                  const model::ModelDims d = plan::with_master_shard(
                      cfg, model::Head::Pretraining, dims, r, world, kernels::cpu_backend());
                  if (model::BertModel::make_plan(cfg, model::Head::Pretraining, d)
                          .group_bytes("parameters") == most)
                    return d.master_begin;
                }
                return int64_t{-1};
              }());
  }
  // Only bf16 shards the master (fp32 and fp16 compute with the weights the optimizer updates).
  EXPECT_FALSE(plan::with_master_shard(cfg, model::Head::Pretraining, {4, 64, 10}, 0, 2,
                                       kernels::cpu_backend())
                   .master_shard);
  // and only where arenas may leave pages unbacked: a GPU's are one device block each, so there
  // the optimizer state alone is sharded (its plan: the whole parameters, a shard of the moments).
  model::ModelDims bf{4, 64, 10};
  bf.precision = Precision::BF16;
  EXPECT_TRUE(
      plan::with_master_shard(cfg, model::Head::Pretraining, bf, 0, 2, kernels::cpu_backend())
          .master_shard);
  EXPECT_FALSE(plan::with_master_shard(cfg, model::Head::Pretraining, bf, 0, 2, cuda::target())
                   .master_shard);
  const MemoryPlan whole =
      model::BertModel::make_plan(cfg, model::Head::Pretraining, bf, cuda::target());
  const MemoryPlan gpu =
      plan::training_plan(cfg, model::Head::Pretraining, bf, 2, 4, cuda::target());
  EXPECT_EQ(gpu.group_bytes("parameters"), whole.group_bytes("parameters"));
  EXPECT_EQ(gpu.group_bytes("optimizer"),
            static_cast<size_t>(
                2 * 4 *
                plan::largest_shard(model::ParamTable(cfg, model::Head::Pretraining).total(), 4)) +
                kAlign);  // (and the step's gate)
}

// What a run holds besides its arenas (the input pipeline's bound, the MPI window slot) counts
// against a budget exactly as if the budget were that much smaller.
TEST(MemoryPlan, BudgetCountsWhatLivesOutsideTheArenas) {
  const model::BertConfig cfg = small_config();
  const model::ModelDims dims{1, 128, 20};
  const double budget = 600.0 * 1048576, outside = 100.0 * 1048576;
  const int64_t with = plan::max_batch_for_budget(cfg, model::Head::Pretraining, dims, 2, budget, 1,
                                                  [&](int64_t) { return outside; });
  const int64_t less =
      plan::max_batch_for_budget(cfg, model::Head::Pretraining, dims, 2, budget - outside);
  EXPECT_EQ(with, less);
  EXPECT_LT(with, plan::max_batch_for_budget(cfg, model::Head::Pretraining, dims, 2, budget));
}

// estimate --explain: the rule of thumb's numbers (16 B per parameter; Korthikanti et al.'s
// L s b h (34 + 5 a s / h) bytes of activations) next to the plan, and the reasons named for
// this run. BERT-base at 32 x 128: the rule's activations are 12 x 128 x 32 x 768 x 44 B.
TEST(MemoryPlan, ExplainPutsTheRuleOfThumbNextToThePlan) {
  model::BertConfig base;  // BERT-base's defaults
  base.vocab_size = 30522;
  const model::ModelDims dims{32, 128, 20};
  const MemoryPlan plan = plan::training_plan(base, model::Head::Pretraining, dims, 2);
  const std::string e = plan::explain_plan(base, model::Head::Pretraining, dims, 2, 1, plan);
  const double params = model::ParamTable(base, model::Head::Pretraining).total();
  EXPECT_NE(e.find(human_bytes(16.0 * params)), std::string::npos) << e;
  EXPECT_NE(e.find(human_bytes(12.0 * 128 * 32 * 768 * 44)), std::string::npos) << e;
  EXPECT_NE(e.find(human_bytes(static_cast<double>(plan.total_bytes()))), std::string::npos) << e;
  EXPECT_NE(e.find("model states: the plan is 100% of the rule"), std::string::npos) << e;
  EXPECT_NE(e.find("fp32 training keeps fp32 activations"), std::string::npos) << e;
  EXPECT_NE(e.find("the full attention keeps"), std::string::npos) << e;
  // bf16, blocked attention, recomputation, sharding: each named.
  model::ModelDims d2 = train::with_precision({8, 512, 80}, Precision::BF16);
  d2.recompute_layers = true;
  const MemoryPlan p2 = plan::training_plan(base, model::Head::Pretraining, d2, 2, 4);
  const std::string e2 = plan::explain_plan(base, model::Head::Pretraining, d2, 2, 4, p2);
  for (const char* why :
       {"sharded over 4 ranks (2 B per parameter", "bf16 weight copy",
        "layers recomputed in backward", "kept in bf16", "blocked attention keeps no"})
    EXPECT_NE(e2.find(why), std::string::npos) << why << "\n" << e2;
}

struct Bench {
  double peak, baseline, plan, allocated, unplanned_scratch;
};

Bench run_bench(const std::string& args) {
  const nlohmann::json j = test::bench_json(args);
  return {j.at("peak_rss_bytes"), j.at("baseline_rss_bytes"), j.at("plan_bytes"),
          j.at("allocated_bytes"), j.at("unplanned_scratch_bytes")};
}

// Measured: a whole training step's peak resident memory above what the process held before
// the model existed (the libraries: oneDNN, OpenMP, Open MPI, protobuf, the C++ runtime) is the
// plan, within a margin for what lives outside it: oneDNN's primitive cache (descriptors and
// JIT code per shape), the synthetic batch, the heap's own slack. Kernel scratch (oneDNN's
// GEMM scratchpad, attention row buffers, reduction partials) is in the plan (group "kernels")
// and no kernel takes any outside it (asserted). Measured here (bert-mini, batch 8 x 128, one
// thread): 3.7-10.0 MiB above plans of 252-282 MiB, over a 13-20 MiB baseline (before the
// kernel scratch was planned: 1.5-10.4 MiB above plans 1.6 MiB smaller). The margin: 5% of the
// plan + 32 MiB. The arenas are zeroed when allocated (memset), so the RSS cannot undercount
// them.
TEST(MemoryPlan, PeakRssIsThePlanPlusTheLibraries) {
  for (const char* model : {"bert-mini", "bert-small"})
    for (const char* precision : {"fp32", "bf16", "fp16"}) {
      const std::string cfg = test::data_path(std::string("../configs/") + model + ".json");
      const bool small = std::string(model) == "bert-small";
      if (std::string(precision) == "bf16" && !kernels::gemm_bf16_available()) {
        std::printf("bf16 skipped: oneDNN has no bf16 matmul on this CPU (%s)\n",
                    kernels::gemm_isa_name());
        continue;
      }
      const Bench b = run_bench("--model-config " + cfg +
                                " --batch-size 8 --seq-len 128 --steps 1 --warmup 1 --threads 1 "
                                "--precision " +
                                precision);
      EXPECT_EQ(b.allocated, b.plan) << precision;
      EXPECT_EQ(b.unplanned_scratch, 0) << precision << ": a kernel took scratch outside the plan";
      const double above = b.peak - b.baseline;
      std::printf(
          "%s %s: plan %.1f MiB, peak RSS %.1f MiB = %.1f MiB before the model + %.1f MiB\n", model,
          precision, b.plan / 1048576, b.peak / 1048576, b.baseline / 1048576, above / 1048576);
      EXPECT_GE(above, 0.95 * b.plan) << model << " " << precision << ": less than its plan";
      // bert-mini's plan is small enough that the fixed part (oneDNN's primitive cache, heap
      // slack) weighs: 5% + 32 MiB. From bert-small on, within 5% of the plan, as estimate
      // promises (bench/plan_vs_rss.sh: small 1.6-2.0%, base 0.5-0.8% above the plan).
      EXPECT_LE(above, 1.05 * b.plan + (small ? 0.0 : 32.0 * 1048576)) << model << " " << precision;
    }
}

}  // namespace
}  // namespace bertrain
