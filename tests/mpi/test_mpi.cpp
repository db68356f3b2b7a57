// Multi-rank tests, run under mpirun -np 2, 3, 4 by ctest (tests/CMakeLists.txt).
// Allreduce algorithms against MPI_Allreduce, and data-parallel equivalence: K optimizer steps
// on 2 ranks with batch B/2 each equal 1 rank with batch B.
// `--stall-demo` / `--exit-demo` make rank 1 stall or die before a collective (stall_test.sh).
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>

#include "comm/mpi.h"
#include "core/safetensors.h"
#include "model/bert.h"
#include "own_memory_backend.h"
#include "plan/memory.h"
#include "test_util.h"
#include "train/finetune.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace bertrain::comm {
namespace {

MpiCommunicator* g_comm = nullptr;

std::vector<float> pattern(int64_t n, int rank, bool integers) {
  std::mt19937 rng(1234 + rank);
  std::vector<float> v(n);
  if (integers) {  // exactly representable sums: every summation order gives the same bits
    std::uniform_int_distribution<int> d(-1000, 1000);
    for (auto& x : v) x = static_cast<float>(d(rng));
  } else {
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& x : v) x = d(rng);
  }
  return v;
}

// A pretraining batch of random tokens: 10 real tokens of T, segments from token 6, P masked
// positions 1, 4, 7, ...; NSP labels alternate.
void random_batch(model::Batch& b, int64_t B, int64_t T, int64_t P, int64_t vocab,
                  std::mt19937& rng) {
  b.resize(B, T, P);
  for (int64_t i = 0; i < B * T; ++i) {
    b.input_ids[i] = static_cast<int32_t>(rng() % vocab);
    b.input_mask[i] = (i % T) < 10 ? 1 : 0;
    b.segment_ids[i] = (i % T) >= 6 ? 1 : 0;
  }
  for (int64_t i = 0; i < B * P; ++i) {
    b.masked_lm_positions[i] = static_cast<int32_t>(1 + (i % P) * 3);
    b.masked_lm_ids[i] = static_cast<int32_t>(rng() % vocab);
    b.masked_lm_weights[i] = 1.0f;
  }
  for (int64_t i = 0; i < B; ++i) b.next_sentence_labels[i] = static_cast<int32_t>(i % 2);
}

std::vector<float> reference(int64_t n, bool integers) {
  std::vector<float> v = pattern(n, g_comm->rank(), integers);
  if (n)
    MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  return v;
}

const int64_t kSizes[] = {0, 1, 7, 1000003, int64_t{25} << 20};  // up to 100 MB

TEST(Allreduce, EveryAlgorithmEqualsMpiAllreduceExactly) {
  for (int64_t n : kSizes) {
    const auto want = reference(n, true);
    for (Algorithm a : {Algorithm::Mpi, Algorithm::Ring, Algorithm::Shm, Algorithm::Hierarchical}) {
      std::vector<float> v = pattern(n, g_comm->rank(), true);
      g_comm->set_algorithm(a);
      g_comm->set_wire(Precision::FP32);
      g_comm->allreduce_sum(v.data(), n);
      ASSERT_EQ(std::memcmp(v.data(), want.data(), n * sizeof(float)), 0)
          << algorithm_name(a) << " n=" << n;
    }
  }
}

// The zero-copy path: buffers from allocate_shared (where the trainer puts its gradients),
// reduced whole and as bucket-like sub-ranges, equal MPI_Allreduce exactly; the rest of the
// buffer is left alone.
TEST(Allreduce, SharedBufferZeroCopyEqualsMpiAllreduce) {
  const int64_t total = 1000003 + 4096;
  float* buf = g_comm->allocate_shared(total);
  ASSERT_NE(buf, nullptr);
  for (int64_t i = 0; i < total; ++i) ASSERT_EQ(buf[i], 0.0f) << "not zeroed at " << i;
  for (Algorithm a : {Algorithm::Shm, Algorithm::Hierarchical}) {
    g_comm->set_algorithm(a);
    g_comm->set_wire(Precision::FP32);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000003}}) {
      for (int64_t off : {int64_t{0}, int64_t{4093}}) {
        const auto v = pattern(total, g_comm->rank(), true);
        std::copy(v.begin(), v.end(), buf);
        std::vector<float> want(v.begin() + off, v.begin() + off + n);
        if (n)
          MPI_Allreduce(MPI_IN_PLACE, want.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                        MPI_COMM_WORLD);
        g_comm->allreduce_sum(buf + off, n);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(buf[off + i], want[i]) << algorithm_name(a) << " n=" << n << " off=" << off;
        for (int64_t i = 0; i < off; ++i) ASSERT_EQ(buf[i], v[i]) << "touched outside, " << i;
        for (int64_t i = off + n; i < total; ++i) ASSERT_EQ(buf[i], v[i]) << "touched " << i;
        MPI_Barrier(MPI_COMM_WORLD);  // nobody refills its buffer while a peer still reads it
      }
    }
  }
}

// Ranks of a node asking for different shared buffers get a clear error on every rank (not a
// hang or a buffer overrun).
TEST(Allreduce, SharedBufferSizeMismatchIsAnErrorOnEveryRank) {
  if (g_comm->local_size() < 2) GTEST_SKIP() << "needs 2 ranks on a node";
  try {
    g_comm->allocate_shared(1000 + g_comm->local_rank());
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("different sizes"), std::string::npos) << e.what();
  }
}

TEST(Allreduce, RandomValuesAgreeToRoundingAndAcrossRanks) {
  const int64_t n = 1000003;
  const auto want = reference(n, false);
  for (Algorithm a : {Algorithm::Ring, Algorithm::Shm, Algorithm::Hierarchical}) {
    for (Precision w : {Precision::FP32, Precision::FP16, Precision::BF16}) {
      if (a == Algorithm::Shm && w != Precision::FP32) continue;
      std::vector<float> v = pattern(n, g_comm->rank(), false);
      g_comm->set_algorithm(a);
      g_comm->set_wire(w);
      g_comm->allreduce_sum(v.data(), n);
      // fp32: sums of `size` terms in another order, |err| <= size * eps * sum|x|.
      // fp16/bf16 wire: every hop rounds to the wire format (2^-11 / 2^-8 relative), at most
      // `size` roundings of partial sums whose magnitude is bounded by sum|x| ~ size * 4.
      const double p = g_comm->size();
      const double rel = w == Precision::FP32 ? 1.2e-7 : w == Precision::FP16 ? 0x1p-11 : 0x1p-8;
      const double bound = (p + 1) * rel * p * 4.5;
      double worst = 0;
      for (int64_t i = 0; i < n; ++i)
        worst = std::max(worst, std::fabs(static_cast<double>(v[i]) - want[i]));
      EXPECT_LE(worst, bound) << algorithm_name(a) << " wire " << wire_name(w);
      // All ranks hold identical results (a requirement for data parallelism).
      std::vector<float> r0 = v;
      MPI_Bcast(r0.data(), static_cast<int>(n), MPI_FLOAT, 0, MPI_COMM_WORLD);
      EXPECT_EQ(std::memcmp(r0.data(), v.data(), n * sizeof(float)), 0)
          << algorithm_name(a) << " " << wire_name(w);
    }
  }
  g_comm->set_wire(Precision::FP32);
}

// ZeRO's halves: a reduce-scatter leaves on each rank its part of the sum, exactly as
// MPI_Allreduce computes it (integer values: every order gives the same bits), for even, uneven
// and empty parts, on private and on shared (zero-copy) buffers; an allgather then gives every
// rank every part, bit for bit.
TEST(ReduceScatter, EveryAlgorithmGivesEachRankItsPartOfTheSum) {
  const int p = g_comm->size(), me = g_comm->rank();
  float* shared = g_comm->allocate_shared(1000003);
  for (int64_t n : {int64_t{0}, int64_t{7}, int64_t{1000003}}) {
    std::vector<std::vector<int64_t>> cuts;
    cuts.push_back(train::shard_counts(n, p));  // the optimizer's even parts
    std::vector<int64_t> uneven(p, 0);          // rank 0 nothing, the last rank most
    for (int r = 1; r < p; ++r) uneven[r] = n * r / (p * (p - 1) / 2);
    int64_t sum = 0;
    for (int r = 1; r < p; ++r) sum += uneven[r];
    uneven[p - 1] += n - sum;
    cuts.push_back(uneven);
    const auto want = reference(n, true);
    for (Algorithm a : {Algorithm::Mpi, Algorithm::Ring, Algorithm::Shm, Algorithm::Hierarchical})
      for (const auto& counts : cuts)
        for (bool in_shared : {false, true}) {
          if (in_shared && !shared) continue;
          g_comm->set_algorithm(a);
          g_comm->set_wire(Precision::FP32);
          std::vector<float> own = pattern(n, me, true);
          float* v = in_shared ? shared : own.data();
          std::copy(own.begin(), own.end(), v);
          g_comm->reduce_scatter_sum(v, n, counts);
          int64_t b = 0;
          for (int r = 0; r < me; ++r) b += counts[r];
          for (int64_t i = b; i < b + counts[me]; ++i)
            ASSERT_EQ(v[i], want[i]) << algorithm_name(a) << " n=" << n << " at " << i
                                     << (in_shared ? " (shared buffer)" : "");
          // Everything else is this rank's to overwrite: the allgather fills it in.
          for (int64_t i = 0; i < n; ++i)
            if (i < b || i >= b + counts[me]) v[i] = -1.0f;
          g_comm->allgather(v, n, counts);
          ASSERT_EQ(std::memcmp(v, want.data(), n * sizeof(float)), 0)
              << "allgather, " << algorithm_name(a) << " n=" << n;
          MPI_Barrier(MPI_COMM_WORLD);  // nobody refills the shared buffer while a peer reads it
        }
  }
}

// Parts that do not cover the buffer are an error, not a silent partial sum.
TEST(ReduceScatter, PartsMustCoverTheBuffer) {
  std::vector<float> v(10, 1.0f);
  std::vector<int64_t> counts(g_comm->size(), 1);
  try {
    g_comm->reduce_scatter_sum(v.data(), 10, counts);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cover the buffer"), std::string::npos) << e.what();
  }
}

// ZeRO stage 1 through train::Step: the sharded optimizer (reduce-scatter, each rank's update of
// its part, allgather) trains the same parameters as the unsharded one, on every algorithm, with
// and without the overlapped buckets, for AdamW and LAMB (whose tensors straddle the parts),
// with the global-norm clipping active. Bit-identical where the arithmetic is the same (shm and
// hierarchical sum in rank order either way; AdamW without clipping is element-wise); elsewhere
// the sums run in another order (ring chunks, MPI's reduce-scatter; the norm and LAMB's trust
// ratios add per-rank partial sums): fp32 rounding through 3 steps, the DataParallel tolerance.
TEST(ShardedOptimizer, EqualsUnshardedOnEveryAlgorithm) {
  const model::BertConfig c = test::small_bert(97, 16, 2, 2, 32, 16);
  const int64_t B = 2, T = 12, P = 3;
  const int me = g_comm->rank(), world = g_comm->size();
  auto batch_for = [&](model::Batch& b, uint64_t step) {
    std::mt19937 rng(static_cast<uint32_t>(100 * step + me));
    random_batch(b, B, T, P, c.vocab_size, rng);
  };
  struct Run {
    std::vector<float> params, m;  // m: the whole first moment (sharded: gathered)
    double grad_norm = 0;
  };
  auto run = [&](Algorithm a, train::OptimizerKind kind, float clip, bool overlap, bool shard) {
    g_comm->set_algorithm(a);
    g_comm->set_wire(Precision::FP32);
    model::BertModel m(c, model::Head::Pretraining, {B, T, P});
    m.init_params(11);
    const int64_t total = m.table().total();
    if (float* sh = g_comm->allocate_shared((m.plan().group_bytes("gradients") + 3) / 4))
      m.place_gradients(reinterpret_cast<std::byte*>(sh));
    train::OptimizerConfig oc;
    oc.kind = kind;
    oc.max_grad_norm = clip;
    train::Optimizer opt(train::param_slices(m.table()), total, oc, kernels::cpu_backend(),
                         shard ? train::shard_of(total, me, world) : train::Shard{});
    train::LossScaler scaler{train::LossScaler::Config{}};
    train::StepSettings ss;
    ss.overlap = overlap;
    ss.bucket_bytes = 4096;  // several buckets, most straddling two ranks' parts
    ss.seed = 9;
    train::Step step(m, opt, scaler, *g_comm, ss);
    Run r;
    for (int64_t k = 0; k < 3; ++k) {
      const train::StepReport rep = step.run(k, 1e-3, [&](model::Batch& b) {
        batch_for(b, static_cast<uint64_t>(k));
        return true;
      });
      EXPECT_TRUE(rep.applied);
      r.grad_norm = rep.grad_norm;
    }
    r.params.assign(m.params(), m.params() + total);
    r.m.assign(total, 0.0f);
    std::copy(opt.m().begin(), opt.m().end(), r.m.begin() + opt.shard().begin);
    if (shard) g_comm->allgather(r.m.data(), total, train::shard_counts(total, world));
    // Every rank holds the same parameters.
    std::vector<float> r0 = r.params;
    MPI_Bcast(r0.data(), static_cast<int>(total), MPI_FLOAT, 0, MPI_COMM_WORLD);
    EXPECT_EQ(std::memcmp(r0.data(), r.params.data(), total * sizeof(float)), 0)
        << algorithm_name(a) << (shard ? " sharded" : "") << ": ranks disagree";
    return r;
  };
  auto worst = [](const std::vector<float>& x, const std::vector<float>& y) {
    double w = 0;
    for (size_t i = 0; i < x.size(); ++i)
      w = std::max(w, static_cast<double>(std::fabs(x[i] - y[i])));
    return w;
  };
  double most = 0, moved = 0;
  std::vector<float> initial;
  {
    model::BertModel m(c, model::Head::Pretraining, {B, T, P});
    m.init_params(11);
    initial.assign(m.params(), m.params() + m.table().total());
  }
  for (Algorithm a : {Algorithm::Mpi, Algorithm::Ring, Algorithm::Shm, Algorithm::Hierarchical})
    for (train::OptimizerKind kind : {train::OptimizerKind::AdamW, train::OptimizerKind::Lamb})
      for (float clip : {0.0f, 0.05f})
        for (bool overlap : {false, true}) {
          const std::string what = str(algorithm_name(a), " ", train::optimizer_name(kind),
                                       " clip ", clip, overlap ? " overlapped" : "");
          const Run plain = run(a, kind, clip, overlap, false);
          const Run sharded = run(a, kind, clip, overlap, true);
          const bool same_arithmetic = (a == Algorithm::Shm || a == Algorithm::Hierarchical) &&
                                       kind == train::OptimizerKind::AdamW && clip == 0.0f;
          if (same_arithmetic) {
            EXPECT_EQ(std::memcmp(plain.params.data(), sharded.params.data(),
                                  plain.params.size() * sizeof(float)),
                      0)
                << what << ": not bit-identical";
            EXPECT_EQ(std::memcmp(plain.m.data(), sharded.m.data(), plain.m.size() * 4), 0) << what;
          }
          EXPECT_LE(worst(plain.params, sharded.params), 2e-6) << what;
          EXPECT_LE(worst(plain.m, sharded.m), 1e-6) << what;
          EXPECT_NEAR(plain.grad_norm, sharded.grad_norm, 1e-6 * plain.grad_norm) << what;
          most = std::max(most, worst(plain.params, sharded.params));
          moved = std::max(moved, worst(plain.params, initial));
        }
  if (me == 0)
    std::printf(
        "sharded vs unsharded, %d ranks: worst parameter difference %.2e (parameters "
        "moved up to %.2e)\n",
        world, most, moved);
}

// bf16 with the optimizer sharded: the fp32 master of the matmul weights is sharded too (each
// rank holds its part, the rest of its parameters arena is holes that fault when touched; the
// step all-gathers the bf16 copy and the fp32-read tensors). On every algorithm, overlapped or
// not, AdamW and LAMB with clipping: bit for bit what the sharded optimizer with a whole fp32
// master computes (the same arithmetic; only what is sent and kept differs), and what the
// unsharded run computes where its arithmetic is the same too (as above). Elsewhere a sum in
// another order can round a bf16 weight the other way (2^-8 relative), which the next steps'
// gradients carry and Adam's normalised update can turn into up to lr per element: bound 1e-4
// after 3 steps at lr 1e-3. The bf16 weights are the same on every rank.
TEST(ShardedOptimizer, ShardedMasterEqualsUnshardedOnEveryAlgorithm) {
  BT_SKIP_WITHOUT_BF16();
  const model::BertConfig c = test::small_bert(97, 64, 2, 2, 256, 16);
  const int64_t B = 2, T = 12, P = 3;
  const int me = g_comm->rank(), world = g_comm->size();
  struct Run {
    std::vector<float> master;  // the whole fp32 master (sharded: each part from its owner)
    std::vector<uint16_t> bf16;
  };
  enum Mode { kPlain, kShardedOptimizer, kShardedMaster };
  auto run = [&](Algorithm a, train::OptimizerKind kind, float clip, bool overlap, Mode mode) {
    g_comm->set_algorithm(a);
    g_comm->set_wire(Precision::FP32);
    model::ModelDims d{B, T, P};
    d.precision = Precision::BF16;
    const int64_t total = model::ParamTable(c, model::Head::Pretraining).total();
    if (mode == kShardedMaster) {
      std::tie(d.master_begin, d.master_end) = plan::shard_range(total, me, world);
      d.master_shard = true;
    }
    model::BertModel m(c, model::Head::Pretraining, d);
    m.init_params(11);
    if (float* sh = g_comm->allocate_shared((m.plan().group_bytes("gradients") + 3) / 4))
      m.place_gradients(reinterpret_cast<std::byte*>(sh));
    train::OptimizerConfig oc;
    oc.kind = kind;
    oc.max_grad_norm = clip;
    train::Optimizer opt(train::param_slices(m.table()), total, oc, kernels::cpu_backend(),
                         mode != kPlain ? train::shard_of(total, me, world) : train::Shard{});
    train::LossScaler scaler{train::LossScaler::Config{}};
    train::StepSettings ss;
    ss.overlap = overlap;
    ss.bucket_bytes = 16384;
    ss.seed = 9;
    train::Step step(m, opt, scaler, *g_comm, ss);
    for (int64_t k = 0; k < 3; ++k) {
      const train::StepReport rep = step.run(k, 1e-3, [&](model::Batch& b) {
        std::mt19937 rng(static_cast<uint32_t>(100 * k + me));
        random_batch(b, B, T, P, c.vocab_size, rng);
        return true;
      });
      EXPECT_TRUE(rep.applied);
    }
    Run r;
    r.master.assign(total, 0.0f);
    const train::Shard own = train::shard_of(total, me, world);
    std::copy(m.params() + own.begin, m.params() + own.end, r.master.begin() + own.begin);
    g_comm->allgather(r.master.data(), total, train::shard_counts(total, world));
    r.bf16.assign(m.weights16(), m.weights16() + total);
    std::vector<uint16_t> r0 = r.bf16;
    MPI_Bcast(r0.data(), static_cast<int>(total), MPI_UINT16_T, 0, MPI_COMM_WORLD);
    EXPECT_EQ(std::memcmp(r0.data(), r.bf16.data(), total * 2), 0)
        << algorithm_name(a) << " mode " << mode << ": ranks disagree";
    return r;
  };
  auto same = [](const Run& x, const Run& y) {
    return std::memcmp(x.master.data(), y.master.data(), x.master.size() * 4) == 0 &&
           std::memcmp(x.bf16.data(), y.bf16.data(), x.bf16.size() * 2) == 0;
  };
  double most = 0;
  for (Algorithm a : {Algorithm::Mpi, Algorithm::Ring, Algorithm::Shm, Algorithm::Hierarchical})
    for (const auto& [kind, clip] : {std::pair(train::OptimizerKind::AdamW, 0.0f),
                                     std::pair(train::OptimizerKind::Lamb, 0.05f)})
      for (bool overlap : {false, true}) {
        const std::string what = str(algorithm_name(a), " ", train::optimizer_name(kind), " clip ",
                                     clip, overlap ? " overlapped" : "");
        const Run plain = run(a, kind, clip, overlap, kPlain);
        const Run sharded = run(a, kind, clip, overlap, kShardedOptimizer);
        const Run master = run(a, kind, clip, overlap, kShardedMaster);
        EXPECT_TRUE(same(sharded, master)) << what << ": the sharded master computes otherwise";
        if ((a == Algorithm::Shm || a == Algorithm::Hierarchical) &&
            kind == train::OptimizerKind::AdamW)
          EXPECT_TRUE(same(plain, master)) << what << ": not bit-identical to the unsharded run";
        double w = 0;
        for (size_t i = 0; i < plain.master.size(); ++i)
          w = std::max(w, static_cast<double>(std::fabs(plain.master[i] - master.master[i])));
        EXPECT_LE(w, 1e-4) << what;
        most = std::max(most, w);
      }
  if (me == 0)
    std::printf("sharded master vs unsharded (bf16), %d ranks: worst fp32 difference %.2e\n", world,
                most);
}

// 2 ranks x batch B/2 == 1 rank x batch B, with dropout on (masks keyed by global example).
TEST(DataParallel, TwoRanksHalfBatchEqualOneRankFullBatch) {
  if (g_comm->size() != 2) GTEST_SKIP() << "runs with 2 ranks";
  const model::BertConfig c = test::small_bert(97, 16, 2, 2, 32, 16);
  const int64_t B = 8, T = 12, P = 3, half = B / 2;
  model::Batch full;
  std::mt19937 rng(5);
  random_batch(full, B, T, P, c.vocab_size, rng);
  for (Algorithm a : {Algorithm::Ring, Algorithm::Hierarchical, Algorithm::Shm}) {
    for (Precision w : {Precision::FP32, Precision::FP16}) {
      g_comm->set_algorithm(a);
      g_comm->set_wire(w);
      model::BertModel one(c, model::Head::Pretraining, {B, T, P}),
          two(c, model::Head::Pretraining, {half, T, P});
      one.init_params(11);
      two.init_params(11);
      if (a != Algorithm::Ring)  // gradients in shared memory, as the trainer places them
        if (float* shared = g_comm->allocate_shared((two.plan().group_bytes("gradients") + 3) / 4))
          two.place_gradients(reinterpret_cast<std::byte*>(shared));
      const auto sl = train::param_slices(one.table());
      train::Optimizer o1(sl, one.table().total(), {}), o2(sl, two.table().total(), {});
      const model::Batch mine = test::slice_batch(full, g_comm->rank() * half, half);
      for (uint64_t step = 0; step < 3; ++step) {
        one.zero_grads();
        one.forward(full, {true, 9, step, 0});
        one.backward(full, {true, 9, step, 0});
        o1.step(one.params(), one.grads(), 1e-3f, 1.0f);
        two.zero_grads();
        const model::StepOptions so{true, 9, step, static_cast<uint64_t>(g_comm->rank() * half)};
        two.forward(mine, so);
        two.backward(mine, so);
        g_comm->allreduce_sum(two.grads(), two.table().total());
        o2.step(two.params(), two.grads(), 1e-3f, 0.5f);
      }
      // The per-rank loss means average to the full-batch mean (equal weights per half), so
      // only summation order differs: fp32 rounding amplified by 3 Adam steps (updates are
      // ~lr-sized and sign-like) -> 1e-6 of lr-scaled parameters; fp16 wire: 1e-4.
      const double tol = w == Precision::FP32 ? 2e-6 : 2e-4;
      double worst = 0;
      for (int64_t i = 0; i < one.table().total(); ++i)
        worst = std::max(worst, static_cast<double>(std::fabs(one.params()[i] - two.params()[i])));
      EXPECT_LE(worst, tol) << algorithm_name(a) << " " << wire_name(w);
    }
  }
  g_comm->set_wire(Precision::FP32);
}

// A sentiment fine-tuning config for the ranks of this test: the first `reviews` ChnSentiCorp
// training reviews (written into dir as train.tsv), the small pretrained fixture, 32 tokens.
train::FinetuneConfig small_finetune(const test::TempDir& dir, int reviews) {
  {
    std::ifstream in(test::data_path("../data/classification/chnsenticorp_small/train.tsv"));
    std::ofstream out(dir / "train.tsv");
    std::string line;
    for (int i = 0; i <= reviews && std::getline(in, line); ++i) out << line << "\n";
  }
  train::FinetuneConfig f;
  f.init_checkpoint = test::data_path("data/pretrained/zh-h64");
  f.vocab = test::data_path("../data/vocab/bert-base-chinese-vocab.txt");
  f.train = dir / "train.tsv";
  f.seq_len = 32;
  f.quiet = true;
  f.comm = g_comm;
  return f;
}

// finetune under mpirun: 2 ranks x batch 4 run the shared step on the same examples as 1 rank x
// batch 8 (64 reviews: no wrap-around), dropout included (the step gives each rank its examples'
// offsets). Summation order differs only: after 16 AdamW steps the weights agree to 1e-5
// (measured 1.2e-7; fp32 rounding of the gradient sum through Adam's normalisation), losses to
// 1e-4.
TEST(DataParallel, FinetuneTwoRanksEqualOneRankDoubleBatch) {
  if (g_comm->size() != 2) GTEST_SKIP() << "runs with 2 ranks";
  test::TempDir tmp;
  train::FinetuneConfig f = small_finetune(tmp, 64);
  f.dev = f.train;
  f.epochs = 2;
  f.lr = 1e-3;
  f.batch_size = 4;
  f.output = tmp / "two";
  const train::FinetuneResult two = train::finetune(f);
  // The same with the AdamW state sharded over the 2 ranks: the same model (2-term sums are
  // order-free; only the clipping norm adds two partial sums), 1e-6.
  train::FinetuneConfig sh = f;
  sh.shard_optimizer = true;
  sh.output = tmp / "two_sharded";
  const train::FinetuneResult two_sharded = train::finetune(sh);
  EXPECT_NEAR(two_sharded.train_loss, two.train_loss, 1e-6);
  // bf16 with the AdamW state sharded: the fp32 master of the matmul weights is sharded too, and
  // the model file is assembled from the ranks' parts (in the output both ranks see). The same
  // 2-term sums: the weights agree to a bf16 rounding of the same gradients (1e-6 measured 0).
  const bool bf16 = test::bf16_unavailable().empty();
  if (bf16) {
    char shared[512] = {};  // rank 0's directory (each rank's TempDir is its own)
    std::snprintf(shared, sizeof shared, "%s", (tmp / "bf16").c_str());
    g_comm->broadcast(shared, sizeof shared, 0);
    train::FinetuneConfig b = f;
    b.precision = Precision::BF16;
    b.output = std::string(shared) + "/plain";
    const train::FinetuneResult plain = train::finetune(b);
    b.shard_optimizer = true;
    b.output = std::string(shared) + "/sharded";
    const train::FinetuneResult sharded = train::finetune(b);
    EXPECT_NEAR(sharded.train_loss, plain.train_loss, 1e-6);
    EXPECT_EQ(sharded.dev_accuracy, plain.dev_accuracy);
  }
  // Rank 0 saved; every rank has the same metrics.
  if (g_comm->rank() == 0) {
    train::FinetuneConfig s = f;
    s.batch_size = 8;
    s.comm = nullptr;
    s.output = tmp / "one";
    const train::FinetuneResult one = train::finetune(s);
    EXPECT_NEAR(two.train_loss, one.train_loss, 1e-4);
    EXPECT_EQ(two.dev_accuracy, one.dev_accuracy);
    // The largest weight difference between two saved models.
    auto worst_of = [](const std::string& x_path, const std::string& y_path) {
      SafetensorsReader a(x_path), b(y_path);
      double w = 0;
      for (const auto& t : a.tensors()) {
        const auto x = a.read_f32(t.name), y = b.read_f32(t.name);
        for (size_t i = 0; i < x.size(); ++i)
          w = std::max(w, static_cast<double>(std::fabs(x[i] - y[i])));
      }
      return w;
    };
    const double worst = worst_of(tmp / "two/model.safetensors", tmp / "one/model.safetensors");
    EXPECT_LE(worst, 1e-5);
    const double sharded_worst =
        worst_of(tmp / "two/model.safetensors", tmp / "two_sharded/model.safetensors");
    EXPECT_LE(sharded_worst, 1e-6);
    std::printf("finetune 2 ranks sharded vs unsharded: worst weight diff %.2e\n", sharded_worst);
    if (bf16) {
      const double bf16_worst =
          worst_of(tmp / "bf16/plain/model.safetensors", tmp / "bf16/sharded/model.safetensors");
      EXPECT_LE(bf16_worst, 1e-6);
      for (const auto& e : std::filesystem::directory_iterator(tmp / "bf16/sharded"))
        EXPECT_EQ(e.path().filename().string().find(".master"), std::string::npos)
            << e.path() << ": a part left behind";
      std::printf("finetune 2 ranks bf16, sharded master vs unsharded: worst weight diff %.2e\n",
                  bf16_worst);
    }
    std::printf("finetune 2 ranks x 4 vs 1 x 8: train loss %.6f vs %.6f, worst weight diff %.2e\n",
                two.train_loss, one.train_loss, worst);
  }
  float done = 1.0f;  // rank 1 waits here while rank 0 runs the reference
  g_comm->allreduce_sum(&done, 1);
}

// A sharded master's model is assembled by rank 0 from every rank's part. Into a directory of
// each rank's own (no shared file system: each rank's temp directory here) the parts rank 0 does
// not see come to it over MPI: the model equals the one saved into a directory all ranks share,
// byte for byte, and no part is left behind anywhere.
TEST(DataParallel, ShardedMasterPartsRankZeroDoesNotSeeComeOverMpi) {
  BT_SKIP_WITHOUT_BF16();
  if (g_comm->size() < 2) GTEST_SKIP() << "runs with 2 or more ranks";
  test::TempDir tmp;  // a different directory on each rank
  char shared[512] = {};
  std::snprintf(shared, sizeof shared, "%s", (tmp / "shared").c_str());
  g_comm->broadcast(shared, sizeof shared, 0);
  train::FinetuneConfig f = small_finetune(tmp, 16);
  f.epochs = 1;
  f.batch_size = 4;
  f.precision = Precision::BF16;
  f.shard_optimizer = true;
  f.output = tmp / "own";
  train::finetune(f);
  f.output = shared;
  train::finetune(f);
  if (g_comm->rank() == 0) {
    auto bytes = [](const std::filesystem::path& p) {
      std::ifstream in(p, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    const std::string own = bytes(std::filesystem::path(tmp / "own") / "model.safetensors");
    EXPECT_FALSE(own.empty());
    EXPECT_TRUE(own == bytes(std::filesystem::path(shared) / "model.safetensors"))
        << "the model assembled from parts passed over MPI differs";
  }
  for (const std::string dir : {tmp / "own", std::string(shared)})
    for (const auto& p : std::filesystem::directory_iterator(dir))
      EXPECT_EQ(p.path().filename().string().find(".master"), std::string::npos)
          << p.path() << ": a part left behind";
}

// pass: the bytes of one rank land in another's buffer and nobody else's; node(): the ranks of
// a node share its number, numbered in the order of the nodes' first ranks.
TEST(Communicator, PassMovesOneRanksBytesToAnother) {
  const int rank = g_comm->rank(), world = g_comm->size();
  for (int from = 0; from < world; ++from) {
    const int to = (from + 1) % world;
    std::vector<int32_t> v(100003, -1);
    if (rank == from) std::iota(v.begin(), v.end(), from * 1000);
    g_comm->pass(v.data(), static_cast<int64_t>(v.size() * sizeof(int32_t)), from, to);
    if (rank == to || rank == from) {
      EXPECT_EQ(v[0], from * 1000) << "rank " << rank << ", from " << from;
      EXPECT_EQ(v.back(), from * 1000 + 100002);
    } else {
      EXPECT_EQ(v[0], -1) << "rank " << rank << " got bytes passed from " << from << " to " << to;
    }
  }
  std::vector<double> first(world, 0.0);
  first[rank] = g_comm->local_rank() == 0 ? 1.0 : 0.0;
  g_comm->allreduce_sum(first.data(), world);
  int nodes = 0;
  for (double x : first) nodes += x > 0 ? 1 : 0;
  EXPECT_GE(g_comm->node(), 0);
  EXPECT_LT(g_comm->node(), nodes);
  std::vector<double> node_of(world, 0.0);
  node_of[rank] = g_comm->node();
  g_comm->allreduce_sum(node_of.data(), world);
  for (int r = 1; r < world; ++r) EXPECT_LE(node_of[r], node_of[r - 1] + 1) << "rank " << r;
  if (const char* k = std::getenv("BERTRAIN_LOCAL_SIZE"))
    EXPECT_EQ(g_comm->node(), rank / std::atoi(k));
}

// Sharded, the finite check is the sum of the parts' squared norms (train::Step): an overflow
// on the last rank in a part another rank owns reaches that owner through the reduce-scatter,
// and every rank sees a non-finite norm.
TEST(LossScaling, ShardedOverflowInAnotherRanksPartSkipsOnAll) {
  const int64_t n = 64 * g_comm->size();
  std::vector<train::ParamSlice> sl = {{"w", 0, n, true}};
  train::Optimizer opt(sl, n, {}, kernels::cpu_backend(),
                       train::shard_of(n, g_comm->rank(), g_comm->size()));
  std::vector<float> g(n, 0.5f);
  if (g_comm->rank() == g_comm->size() - 1) g[3] = INFINITY;  // in rank 0's part
  g_comm->reduce_scatter_sum(g.data(), n, train::shard_counts(n, g_comm->size()));
  double sum = opt.sum_squares(g.data(), 1.0f);
  g_comm->allreduce_sum(&sum, 1);
  EXPECT_FALSE(opt.result(sum).finite) << "rank " << g_comm->rank();
}

// MPI's collectives on a backend's own memory: what NCCL is to a GPU's (comm/nccl.h), on the
// CPU. The backend's blocks open only while a collective or one of its kernels runs, so a step
// that touched the gradients or parameters from the host anywhere else would fault.
class DeviceMpi final : public Communicator {
 public:
  DeviceMpi(MpiCommunicator& mpi, const test::OwnMemoryBackend& be) : mpi_(mpi), be_(be) {}
  int rank() const override { return mpi_.rank(); }
  int size() const override { return mpi_.size(); }
  int local_rank() const override { return mpi_.local_rank(); }
  int local_size() const override { return mpi_.local_size(); }
  bool device_memory() const override { return true; }
  std::string name() const override { return "device MPI"; }
  void set_label(const std::string& l) override { mpi_.set_label(l); }
  void allreduce_sum(float* d, int64_t n) override {
    open([&] { mpi_.allreduce_sum(d, n); });
  }
  void allreduce_sum(double* d, int64_t n) override {
    open([&] { mpi_.allreduce_sum(d, n); });
  }
  void broadcast(void* d, int64_t bytes, int root) override {
    open([&] { mpi_.broadcast(d, bytes, root); });
  }
  void barrier() override { mpi_.barrier(); }
  void reduce_scatter_sum(float* d, int64_t n, std::span<const int64_t> counts) override {
    open([&] { mpi_.reduce_scatter_sum(d, n, counts); });
  }
  void allgather(float* d, int64_t n, std::span<const int64_t> counts) override {
    open([&] { mpi_.allgather(d, n, counts); });
  }
  void allgather(uint16_t* d, int64_t n, std::span<const int64_t> counts) override {
    open([&] { mpi_.allgather(d, n, counts); });
  }
  void scale(float* d, int64_t n, float s) override {
    open([&] { Communicator::scale(d, n, s); });
  }

 private:
  void open(const std::function<void()>& f) {
    const test::OwnMemoryBackend::Open o(be_);
    f();
  }
  MpiCommunicator& mpi_;
  const test::OwnMemoryBackend& be_;
};

// The device tests' world: a small model, [B, T] batches with P predictions, the ring in fp32
// for the test's lifetime (the algorithm restored after, also when an assertion returns early).
struct DeviceTestWorld {
  const model::BertConfig c = test::small_bert(97, 16, 2, 2, 32, 16);
  const int64_t B = 2, T = 12, P = 3;
  const int me = g_comm->rank(), world = g_comm->size();
  const Algorithm was = g_comm->algorithm();
  DeviceTestWorld() {
    g_comm->set_algorithm(Algorithm::Ring);
    g_comm->set_wire(Precision::FP32);
  }
  ~DeviceTestWorld() { g_comm->set_algorithm(was); }
};

// Three applied steps of train::Step (learning rate 1e-3), each rank's micro-batches its own
// (seeded by the step and the rank), [B, T] with P predictions.
void three_steps(model::BertModel& m, train::Optimizer& opt, Communicator& comm,
                 const train::StepSettings& ss, int64_t B, int64_t T, int64_t P) {
  train::LossScaler scaler{train::LossScaler::Config{}};
  train::Step step(m, opt, scaler, comm, ss);
  for (int64_t k = 0; k < 3; ++k)
    EXPECT_TRUE(step.run(k, 1e-3,
                         [&](model::Batch& b) {
                           std::mt19937 rng(static_cast<uint32_t>(100 * k + comm.rank()));
                           random_batch(b, B, T, P, m.config().vocab_size, rng);
                           return true;
                         })
                    .applied);
}

// A model on a backend with memory of its own trains across ranks through a communicator of
// device memory (a GPU's through NCCL): bit for bit the CPU ranks' parameters after three steps,
// overlapped or not, sharded or not, AdamW and LAMB, with a predivide factor; through a
// communicator of host memory it is refused, and the other way round.
TEST(DataParallel, ADeviceModelTrainsAcrossRanksThroughADeviceCommunicator) {
  const DeviceTestWorld w;
  const model::BertConfig& c = w.c;
  const int64_t B = w.B, T = w.T, P = w.P;
  const int me = w.me, world = w.world;
  auto run = [&](const kernels::Backend& be, Communicator& comm, train::OptimizerKind kind,
                 bool overlap, bool shard) {
    model::BertModel m(c, model::Head::Pretraining, {B, T, P}, be);
    m.init_params(11);
    const int64_t total = m.table().total();
    train::OptimizerConfig oc;
    oc.kind = kind;
    train::Optimizer opt(train::param_slices(m.table()), total, oc, be,
                         shard ? train::shard_of(total, me, world) : train::Shard{});
    train::StepSettings ss;
    ss.overlap = overlap;
    ss.bucket_bytes = 4096;
    ss.seed = 9;
    ss.predivide = 2.0;
    three_steps(m, opt, comm, ss, B, T, P);
    std::vector<float> p(static_cast<size_t>(total));
    be.to_host(p.data(), m.params(), p.size() * sizeof(float));
    return p;
  };
  const test::OwnMemoryBackend own;
  DeviceMpi device(*g_comm, own);
  for (auto kind : {train::OptimizerKind::AdamW, train::OptimizerKind::Lamb})
    for (bool overlap : {false, true})
      for (bool shard : {false, true}) {
        SCOPED_TRACE(str(train::optimizer_name(kind), overlap ? " overlapped" : "",
                         shard ? " sharded" : ""));
        EXPECT_EQ(run(own, device, kind, overlap, shard),
                  run(kernels::cpu_backend(), *g_comm, kind, overlap, shard));
      }
  const std::string e =
      test::error_of([&] { run(own, *g_comm, train::OptimizerKind::AdamW, false, false); });
  EXPECT_NE(e.find("the model's memory is the own-memory device's, the MPI"), std::string::npos)
      << e;
  EXPECT_NE(e.find("reduces host memory (a GPU's gradients go through NCCL)"), std::string::npos)
      << e;
  const std::string h = test::error_of(
      [&] { run(kernels::cpu_backend(), device, train::OptimizerKind::AdamW, false, false); });
  EXPECT_NE(h.find("the model's memory is the host's, the device MPI communicator reduces device"),
            std::string::npos)
      << h;
}

// bf16 with the optimizer sharded, on a backend whose arenas are one block each (a GPU's: no
// unbacked pages, plan::with_master_shard leaves the master whole): the optimizer state alone is
// sharded, each rank's updated part of the fp32 parameters gathered and rounded into every
// rank's bf16 copy. It trains the same model as the CPU ranks, whose fp32 master is sharded:
// after three steps the bf16 weights are the same bits on every rank, and so are the fp32
// parameters of the part the CPU rank holds.
TEST(DataParallel, ABf16DeviceModelShardsTheOptimizerAndKeepsTheMasterWhole) {
  BT_SKIP_WITHOUT_BF16();
  const DeviceTestWorld w;
  const model::BertConfig& c = w.c;
  const int64_t B = w.B, T = w.T, P = w.P;
  const int me = w.me, world = w.world;
  struct Result {
    model::ModelDims dims;
    std::vector<float> params;
    std::vector<uint16_t> weights16;
  };
  auto run = [&](const kernels::Backend& be, Communicator& comm) {
    model::ModelDims d{B, T, P};
    d.precision = Precision::BF16;
    d = plan::with_master_shard(c, model::Head::Pretraining, d, me, world, be);
    model::BertModel m(c, model::Head::Pretraining, d, be);
    m.init_params(11);
    const int64_t total = m.table().total();
    train::Optimizer opt(train::param_slices(m.table()), total, train::OptimizerConfig{}, be,
                         train::shard_of(total, me, world));
    train::StepSettings ss;
    ss.seed = 9;
    three_steps(m, opt, comm, ss, B, T, P);
    Result r{m.dims(), {}, std::vector<uint16_t>(static_cast<size_t>(total))};
    be.to_host(r.weights16.data(), m.weights16(), r.weights16.size() * sizeof(uint16_t));
    const int64_t b = d.master_shard ? d.master_begin : 0,
                  e = d.master_shard ? d.master_end : total;
    r.params.resize(static_cast<size_t>(e - b));
    be.to_host(r.params.data(), m.params() + b, r.params.size() * sizeof(float));
    return r;
  };
  const test::OwnMemoryBackend own;
  DeviceMpi device(*g_comm, own);
  const Result dev = run(own, device), cpu = run(kernels::cpu_backend(), *g_comm);
  ASSERT_FALSE(dev.dims.master_shard);
  ASSERT_EQ(cpu.dims.master_shard, world > 1);
  EXPECT_EQ(dev.weights16, cpu.weights16);
  const int64_t b = cpu.dims.master_shard ? cpu.dims.master_begin : 0;
  EXPECT_TRUE(std::equal(cpu.params.begin(), cpu.params.end(), dev.params.begin() + b));
}

// fp16 loss scaling: an overflow on one rank makes every rank skip the step and halve the scale.
TEST(LossScaling, OverflowOnOneRankSkipsOnAll) {
  std::vector<train::ParamSlice> sl = {{"w", 0, 4, true}};
  train::Optimizer opt(sl, 4, {});
  std::vector<float> p = {1, 2, 3, 4}, g = {0.1f, 0.2f, 0.3f, 0.4f};
  if (g_comm->rank() == g_comm->size() - 1) g[2] = INFINITY;  // overflow injected on the last rank
  g_comm->allreduce_sum(g.data(), 4);
  train::StepResult r = opt.measure(g.data(), 1.0f);
  const bool finite = g_comm->all(r.finite);
  train::LossScaler::Config c;
  c.enabled = true;
  train::LossScaler s(c);
  EXPECT_FALSE(s.update(finite, 0));
  EXPECT_EQ(s.scale(), 32768.0f);
  // Even a flag that only this rank sees (before any reduction) is made global.
  EXPECT_FALSE(g_comm->all(g_comm->rank() != 0));
  EXPECT_TRUE(g_comm->all(true));
}

}  // namespace
}  // namespace bertrain::comm

// Ranks other than 0 print only their failures, each named by rank and test (rank 0 prints
// gtest's usual output): without it, a check that fails on rank 2 alone shows as nothing but
// mpiexec's "exit code 1".
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
    std::fprintf(stderr, "rank %d: %s.%s failed: %s:%d: %s\n", rank_,
                 t ? t->test_suite_name() : "-", t ? t->name() : "-",
                 r.file_name() ? r.file_name() : "-", r.line_number(), r.message());
  }

 private:
  int rank_;
};

int main(int argc, char** argv) {
  auto* comm = new bertrain::comm::MpiCommunicator(&argc, &argv);
  bertrain::comm::g_comm = comm;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--stall-demo" || a == "--exit-demo") {
      comm->set_stall_timeout(2.0);
      if (comm->rank() == 1) {
        if (a == "--exit-demo") std::exit(4);
        ::sleep(30);
      }
      float x = 1.0f;
      comm->set_label("gradient bucket 3");
      comm->allreduce_sum(&x, 1);
      std::printf("rank %d passed the collective\n", comm->rank());
      delete comm;
      return 0;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (comm->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(comm->rank()));
  }
  int rc = RUN_ALL_TESTS();
  MPI_Allreduce(MPI_IN_PLACE, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  delete comm;
  return rc;
}
