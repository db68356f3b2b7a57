// The scaling model of `bertrain plan` (plan/scaling.h): its costs against hand-computed
// formulas, the replay of the reducer's overlap, the sharded optimizer's allgather, and the CLI
// on a bench measurement. (Against measured training steps: bench/plan_vs_measured.sh, 2 ranks as
// 2 hosts over a shaped loopback at 1 and 4 Gbit/s: planned / measured step 0.99 and 1.00.)
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "plan/scaling.h"
#include "test_util.h"

namespace bertrain::plan {
namespace {

TEST(Plan, AllreduceCostsAreTheFormulas) {
  ClusterSpec c;
  c.hosts = 4;
  c.ranks_per_host = 2;
  c.link_gbit = 8;  // 1 GB/s
  c.latency_us = 10;
  c.host_gbyte_s = 4;
  c.local_latency_us = 1;
  CommSpec s;
  const int64_t n = 250'000'000;  // 1 GB of fp32
  // Ring over 8 ranks: 2 * 7/8 * 1 GB / 1 GB/s + 14 latencies.
  EXPECT_NEAR(allreduce_ms(n, c, s, "ring"), 1e3 * (2.0 * 7 / 8 + 14 * 10e-6), 1e-6);
  // Hierarchical: shm (2 ranks x 2 GB through 4 GB/s, 2 barriers) + ring of 4 leaders
  // (2 * 3/4 s + 6 latencies) + the copy to the other rank (1 GB / 4 GB/s, 2 barriers).
  EXPECT_NEAR(allreduce_ms(n, c, s, "hierarchical"), 1e3 * (1.0 + 2e-6 + 1.5 + 60e-6 + 0.25 + 2e-6),
              1e-6);
  // fp16 on the wire halves the link's part; a reduce-scatter is half of everything.
  s.wire_bytes = 2;
  EXPECT_NEAR(allreduce_ms(n, c, s, "ring"), 1e3 * (7.0 / 8 + 14 * 10e-6), 1e-6);
  EXPECT_NEAR(allreduce_ms(n, c, s, "ring", true), 0.5 * 1e3 * (7.0 / 8 + 14 * 10e-6), 1e-6);
  c.hosts = 1;
  EXPECT_NEAR(allreduce_ms(n, c, s, "shm"), 1e3 * (1.0 + 2e-6), 1e-6);
}

TEST(Plan, StepReplaysTheReducersOverlap) {
  GradientLayout g;
  g.layers = {1'000'000, 1'000'000, 1'000'000, 1'000'000};
  g.rest = 2'000'000;
  g.total = 6'000'000;
  ClusterSpec c;
  c.hosts = 2;
  c.link_gbit = 8;  // 1 GB/s: a 4 MB layer costs 4 ms in a 2-rank ring (2 * 1/2 * 4 MB)
  c.latency_us = 0;
  c.host_gbyte_s = 1e9;
  c.local_latency_us = 0;
  CommSpec s;
  s.bucket_mb = 1.0;  // one layer per bucket (a 4 MB layer exceeds it alone)
  // Backward 10 ms a layer: layers 3, 2, 1 are reduced behind the next layer's backward; layer
  // 0 is ready only as backward ends, then the rest (embeddings, heads): 4 + 8 ms exposed.
  StepCompute slow{10, 40, 5, 1};
  ScalingRow r = predict_step(g, slow, c, s);
  EXPECT_EQ(r.algorithm, "hierarchical");
  EXPECT_NEAR(r.comm_ms, 24.0, 1e-9);  // 24 MB of fp32 gradients
  EXPECT_NEAR(r.exposed_ms, 12.0, 1e-9);
  EXPECT_NEAR(r.step_ms, 10 + 40 + 5 + 12.0, 1e-9);
  StepCompute fast{1, 4, 1, 1};  // 1 ms a layer: the comm thread lags
  r = predict_step(g, fast, c, s);
  EXPECT_NEAR(r.exposed_ms, (1 + 4 * 4 + 8) - 4, 1e-9);  // first ready at 1 ms, 24 ms of work
  s.overlap = false;
  r = predict_step(g, fast, c, s);
  EXPECT_NEAR(r.exposed_ms, 24.0, 1e-9);
  // Accumulation: only the last micro-batch's backward hides buckets.
  s.overlap = true;
  StepCompute accum{10, 40, 5, 4};  // 2.5 ms a layer in the last one
  r = predict_step(g, accum, c, s);
  EXPECT_NEAR(r.exposed_ms, (30 + 2.5 + 16 + 8) - 40, 1e-9);
  // Sharded: the reduce-scatter is half and overlaps (layer 0's 2 ms and the rest's 4 ms
  // exposed); the allgather (half of the whole, 12 ms) does not; the optimizer is split.
  s.shard_optimizer = true;
  r = predict_step(g, slow, c, s);
  EXPECT_NEAR(r.exposed_ms, 2.0 + 4.0 + 12.0, 1e-9);
  EXPECT_NEAR(r.compute_ms, 10 + 40 + 2.5, 1e-9);
  // A sharded master (bf16): the allgather moves the bf16 weights (3M floats' bytes) and the
  // 1M floats read in fp32: 4M floats' bytes, 8 ms instead of 12.
  g.fp32_read = 1'000'000;
  s.sharded_master = true;
  r = predict_step(g, slow, c, s);
  EXPECT_NEAR(r.exposed_ms, 2.0 + 4.0 + 8.0, 1e-9);
  s.sharded_master = false;
  // One rank alone: no communication, perfect scaling.
  c.hosts = 1;
  r = predict_step(g, slow, c, s);
  EXPECT_EQ(r.exposed_ms, 0.0);
  EXPECT_EQ(r.efficiency, 1.0);
}

TEST(Plan, CliReadsABenchMeasurement) {
  test::TempDir tmp;
  const std::string bench = (tmp.path / "bench.json").string();
  const std::string out = (tmp.path / "plan.txt").string();
  const std::string bt = BERTRAIN_BINARY;
  const std::string cfg = test::data_path("../configs/bert-tiny.json");
  ASSERT_EQ(std::system((bt + " bench --model-config " + cfg +
                         " --batch-size 4 --seq-len 32 --max-predictions 4 --steps 1 --warmup 0 "
                         "--json > " +
                         bench + " 2>/dev/null")
                            .c_str()),
            0);
  ASSERT_EQ(
      std::system((bt + " plan --model-config " + cfg + " --batch-size 4 --seq-len 32 --compute " +
                   bench + " --hosts 1,2,4 --ranks-per-host 2 > " + out + " 2>&1")
                      .c_str()),
      0);
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("one rank's step: forward"), std::string::npos) << text;
  for (const char* row :
       {"     1      2 shm", "     2      4 hierarchical", "     4      8 hierarchical"})
    EXPECT_NE(text.find(row), std::string::npos) << row << "\n" << text;
  // A measurement of another batch, and none at all, are errors that say so.
  ASSERT_NE(std::system((bt + " plan --model-config " + cfg +
                         " --batch-size 8 --seq-len 32 --compute " + bench + " > " + out + " 2>&1")
                            .c_str()),
            0);
  std::ifstream in2(out);
  std::string err((std::istreambuf_iterator<char>(in2)), std::istreambuf_iterator<char>());
  EXPECT_NE(err.find("was measured at batch 4"), std::string::npos) << err;
  ASSERT_NE(std::system((bt + " plan --model-config " + cfg + " > " + out + " 2>&1").c_str()), 0);
  std::ifstream in3(out);
  std::string none((std::istreambuf_iterator<char>(in3)), std::istreambuf_iterator<char>());
  EXPECT_NE(none.find("plan needs one rank's compute"), std::string::npos) << none;
}

}  // namespace
}  // namespace bertrain::plan
