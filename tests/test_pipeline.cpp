// data::Pipeline: determinism, independence from thread counts, sharding (every record once per
// epoch across ranks), exact resume, corrupt-data policies, bounded memory.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include <fstream>
#include <map>
#include <set>

#include "data/example.h"
#include "data/pipeline.h"
#include "data/tfrecord.h"
#include "test_util.h"

namespace bertrain::data {
namespace {

using test::TempDir;

constexpr int64_t kT = 8, kP = 2, kVocab = 1 << 20;

std::string make_record(int64_t uid) {
  Example ex;
  std::vector<int64_t> ids(kT, 7);
  ids[0] = uid;
  ex["input_ids"] = {FeatureKind::Int64, ids, {}, {}};
  ex["input_mask"] = {FeatureKind::Int64, std::vector<int64_t>(kT, 1), {}, {}};
  ex["segment_ids"] = {FeatureKind::Int64, std::vector<int64_t>(kT, 0), {}, {}};
  ex["masked_lm_positions"] = {FeatureKind::Int64, {1, 2}, {}, {}};
  ex["masked_lm_ids"] = {FeatureKind::Int64, {5, 6}, {}, {}};
  ex["masked_lm_weights"] = {FeatureKind::Float, {}, {1.0f, 1.0f}, {}};
  ex["next_sentence_labels"] = {FeatureKind::Int64, {uid % 2}, {}, {}};
  return encode_example(ex);
}

// files x records, uid = 1000 * file + record (+1 so that 0 never appears).
void write_shards(const TempDir& dir, int files, int records, Compression c = Compression::None) {
  for (int f = 0; f < files; ++f) {
    TFRecordWriter w(dir / ("shard-" + std::to_string(f) + ".tfrecord"), c);
    for (int r = 0; r < records; ++r) w.write(make_record(1000 * f + r + 1));
    w.close();
  }
}

Schema schema() {
  return Schema::pretraining(kT, kP, kVocab);
}

PipelineOptions options(const TempDir& dir, int64_t batch) {
  PipelineOptions o;
  o.files = dir / "shard-*.tfrecord";
  o.batch_size = batch;
  o.cycle_length = 3;
  o.block_length = 4;
  o.shuffle_buffer = 50;
  o.seed = 99;
  return o;
}

// uids of the next n batches
std::vector<int32_t> take(Pipeline& p, int n) {
  std::vector<int32_t> out;
  data::Batch b;
  for (int i = 0; i < n && p.next(b); ++i)
    for (int64_t r = 0; r < b.B; ++r) out.push_back(b.input_ids[r * kT]);
  return out;
}

TEST(Pipeline, OneEpochHoldsEveryRecordOnceAndIsShuffled) {
  TempDir dir;
  write_shards(dir, 5, 37);
  PipelineOptions o = options(dir, 8);
  o.epochs = 1;
  o.drop_remainder = false;
  Pipeline p(o, schema());
  auto uids = take(p, 1000);
  ASSERT_EQ(uids.size(), 5u * 37u);
  std::set<int32_t> uniq(uids.begin(), uids.end());
  EXPECT_EQ(uniq.size(), uids.size());
  EXPECT_FALSE(std::is_sorted(uids.begin(), uids.end()));
  data::Batch b;
  EXPECT_FALSE(p.next(b));  // end, and it stays ended
  EXPECT_FALSE(p.next(b));
  EXPECT_LE(p.stats().examples, 185u);
}

TEST(Pipeline, DeterministicAndIndependentOfThreadCounts) {
  TempDir dir;
  write_shards(dir, 6, 50, Compression::Gzip);
  std::vector<std::vector<int32_t>> runs;
  for (int readers : {1, 3, 0}) {
    for (int prefetch : {1, 4, 0}) {
      PipelineOptions o = options(dir, 16);
      o.files = dir / "shard-*";
      o.readers = readers;
      o.prefetch = prefetch;
      Pipeline p(o, schema());
      runs.push_back(take(p, 40));  // crosses epoch boundaries (300 records / 16)
    }
  }
  for (size_t i = 1; i < runs.size(); ++i) EXPECT_EQ(runs[i], runs[0]) << "run " << i;
  // Another seed gives another order.
  PipelineOptions o = options(dir, 16);
  o.files = dir / "shard-*";
  o.seed = 100;
  Pipeline p(o, schema());
  EXPECT_NE(take(p, 40), runs[0]);
}

void check_sharding(int files, int world) {
  TempDir dir;
  write_shards(dir, files, 23);
  std::multiset<int32_t> seen;
  for (int rank = 0; rank < world; ++rank) {
    PipelineOptions o = options(dir, 4);
    o.rank = rank;
    o.world = world;
    o.epochs = 1;
    o.drop_remainder = false;
    Pipeline p(o, schema());
    for (int32_t u : take(p, 10000)) seen.insert(u);
  }
  ASSERT_EQ(seen.size(), static_cast<size_t>(files * 23))
      << files << " files, " << world << " ranks";
  EXPECT_EQ(std::set<int32_t>(seen.begin(), seen.end()).size(), seen.size());
}

TEST(Pipeline, ShardsByFileEveryRecordOncePerEpoch) {
  check_sharding(7, 3);
}
TEST(Pipeline, ShardsByRecordWhenFewerFilesThanRanks) {
  check_sharding(2, 4);
}

TEST(Pipeline, ResumesExactlyMidEpochAndAcrossEpochs) {
  TempDir dir;
  write_shards(dir, 4, 30);
  PipelineOptions o = options(dir, 7);
  Pipeline full(o, schema());
  auto ref = take(full, 40);  // 120 records per epoch: 17 batches per epoch
  for (int cut : {1, 5, 17, 20, 33}) {
    PipelinePosition pos;
    std::vector<int32_t> got;
    {
      Pipeline a(o, schema());
      got = take(a, cut);
      pos = a.position();
    }
    Pipeline b(o, schema(), pos);
    auto rest = take(b, 40 - cut);
    got.insert(got.end(), rest.begin(), rest.end());
    EXPECT_EQ(got, ref) << "cut after " << cut << " batches (epoch " << pos.epoch << ", batch "
                        << pos.batches << ")";
  }
  // A position from other data is refused.
  PipelinePosition foreign{0, 3, 12345, {}};
  try {
    Pipeline c(o, schema(), foreign);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("input files differ"), std::string::npos);
  }
}

// A job of `world` ranks at `start` positions, every rank taking `steps` batches in lockstep
// (as training does), each uid recorded with the epoch it was read in. Returns the positions.
std::vector<PipelinePosition> run_ranks(const PipelineOptions& base, int world,
                                        std::vector<PipelinePosition> start, int steps,
                                        std::map<uint64_t, std::vector<int32_t>>& read) {
  std::vector<PipelinePosition> out;
  for (int r = 0; r < world; ++r) {
    PipelineOptions o = base;
    o.rank = r;
    o.world = world;
    Pipeline p(o, schema(), start.empty() ? PipelinePosition{} : start[r]);
    data::Batch b;
    for (int i = 0; i < steps; ++i) {
      EXPECT_TRUE(p.next(b));
      for (int64_t k = 0; k < b.B; ++k) read[p.position().epoch].push_back(b.input_ids[k * kT]);
    }
    out.push_back(p.position());
  }
  return out;
}

// Every example of one epoch that an uninterrupted `world`-rank job reads (full batches).
std::multiset<int32_t> epoch_of(const PipelineOptions& base, int world, uint64_t epoch) {
  std::multiset<int32_t> all;
  for (int r = 0; r < world; ++r) {
    PipelineOptions o = base;
    o.rank = r;
    o.world = world;
    o.epochs = static_cast<int64_t>(epoch) + 1;
    Pipeline p(o, schema(), PipelinePosition{epoch, 0, 0, {}});
    for (int32_t uid : take(p, 1 << 20)) all.insert(uid);
  }
  return all;
}

StreamSizes sizes_of(const PipelineOptions& o) {
  std::vector<std::string> files = list_files(o.files);
  std::vector<uint64_t> n;
  for (const auto& f : files) n.push_back(count_records(f));
  return StreamSizes(files, n, o.seed, o.shuffle);
}

// 4 ranks (batch 3) lose a host and go on as 3 ranks (batch 4), then as 2 (batch 6), then grow
// to 5 (batch 2): within every epoch the remaps touched, no example is read twice, every one
// the 4-rank job would have read is read except the remaps' leftovers (less than a batch each).
// Files of unequal sizes put the ranks in different epochs at each cut.
TEST(Pipeline, ResumeOnOtherRankCountsReadsEveryExampleOnce) {
  TempDir dir;
  for (int f = 0; f < 7; ++f) {
    TFRecordWriter w(dir / ("shard-" + std::to_string(f) + ".tfrecord"), Compression::None);
    for (int r = 0; r < 5 + 20 * f; ++r) w.write(make_record(1000 * f + r + 1));
    w.close();
  }
  PipelineOptions o = options(dir, 3);
  const StreamSizes sizes = sizes_of(o);
  // Cut one batch after the shortest stream's epoch ends: that rank is in epoch 1, others not.
  uint64_t shortest = ~uint64_t{0}, longest = 0;
  for (int r = 0; r < 4; ++r) {
    shortest = std::min(shortest, sizes.examples(0, 4, r) / 3);
    longest = std::max(longest, sizes.examples(0, 4, r) / 3);
  }
  ASSERT_GT(longest, shortest + 2);
  std::map<uint64_t, std::vector<int32_t>> read;
  std::vector<PipelinePosition> pos = run_ranks(o, 4, {}, static_cast<int>(shortest) + 1, read);
  std::set<uint64_t> epochs_at_cut;
  for (const auto& p : pos) epochs_at_cut.insert(p.epoch);
  EXPECT_GT(epochs_at_cut.size(), 1u) << "the ranks should be in different epochs at the cut";
  // Which layout reads each epoch whole: (first epoch, world, batch).
  std::vector<std::tuple<uint64_t, int, int64_t>> owner{{0, 4, 3}};
  uint64_t dropped = 0, last_epoch = 0;
  int64_t batch = 3;
  for (auto [world, next_batch, steps] : {std::tuple{3, 4, 9}, {2, 6, 5}, {5, 2, 0}}) {
    const Remap r = remap_positions(pos, batch, world, next_batch, sizes);
    ASSERT_EQ(r.positions.size(), static_cast<size_t>(world));
    dropped += r.dropped;
    last_epoch = std::max(last_epoch, r.last_epoch);
    owner.emplace_back(r.last_epoch + 1, world, next_batch);
    EXPECT_LT(r.dropped, static_cast<uint64_t>(next_batch) * (r.last_epoch - r.first_epoch + 1));
    batch = next_batch;
    PipelineOptions ob = o;
    ob.batch_size = batch;
    if (steps > 0) {
      pos = run_ranks(ob, world, r.positions, steps, read);
      continue;
    }
    // The last layout reads on until every rank is past the remapped epochs.
    for (int q = 0; q < world; ++q) {
      PipelineOptions oq = ob;
      oq.rank = q;
      oq.world = world;
      Pipeline p(oq, schema(), r.positions[q]);
      data::Batch b;
      while (p.next(b) && p.position().epoch <= last_epoch)
        for (int64_t k = 0; k < b.B; ++k) read[p.position().epoch].push_back(b.input_ids[k * kT]);
    }
  }
  uint64_t missing = 0;
  for (uint64_t e = 0; e <= last_epoch; ++e) {
    int world = 4;
    for (auto [from, w, b] : owner)
      if (from <= e) {
        world = w;
        o.batch_size = b;
      }
    const std::multiset<int32_t> want = epoch_of(o, world, e);
    const std::multiset<int32_t> got(read[e].begin(), read[e].end());
    for (int32_t uid : got) {
      EXPECT_EQ(got.count(uid), 1u) << "epoch " << e << ": example " << uid << " read twice";
      EXPECT_EQ(want.count(uid), 1u) << "epoch " << e << ": example " << uid << " not in it";
    }
    missing += want.size() - got.size();
  }
  EXPECT_EQ(missing, dropped) << "examples not read = the remaps' leftovers";
  EXPECT_GE(last_epoch, 1u);
}

TEST(Pipeline, PlanPartsThatCannotExistAreRefused) {
  TempDir dir;
  write_shards(dir, 2, 10);
  PipelinePosition bad{0, 0, 0, {{0, {{2, 5, 0, 4}}}}};
  try {
    Pipeline p(options(dir, 2), schema(), bad);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("impossible part (rank 5 of 2"), std::string::npos)
        << e.what();
  }
}

void corrupt_second_file(const TempDir& dir) {
  // Flip a data byte of record 3 of shard-1 (each record has the same size).
  const std::string path = dir / "shard-1.tfrecord";
  std::ifstream in(path, std::ios::binary);
  std::string bytes(std::istreambuf_iterator<char>(in), {});
  const size_t rec = bytes.size() / 10;
  bytes[3 * rec + 20] ^= 0x40;
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(Pipeline, CorruptRecordFailsWithFileAndOffset) {
  TempDir dir;
  write_shards(dir, 3, 10);
  corrupt_second_file(dir);
  PipelineOptions o = options(dir, 4);
  o.epochs = 1;
  Pipeline p(o, schema());
  try {
    take(p, 100);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("shard-1.tfrecord: corrupt record 3 at byte"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--on-corrupt=skip"), std::string::npos) << msg;
  }
}

TEST(Pipeline, CorruptRecordSkippedAndCounted) {
  TempDir dir;
  write_shards(dir, 3, 10);
  corrupt_second_file(dir);
  // A record with a wrong feature length in another file.
  {
    TFRecordWriter w(dir / "shard-9.tfrecord", Compression::None);
    w.write(make_record(9001));
    Example bad;
    bad["input_ids"] = {FeatureKind::Int64, {1, 2, 3}, {}, {}};
    w.write(encode_example(bad));
    w.close();
  }
  PipelineOptions o = options(dir, 4);
  o.epochs = 1;
  o.drop_remainder = false;
  o.on_corrupt = OnCorrupt::Skip;
  o.verbose_skips = false;
  Pipeline p(o, schema());
  auto uids = take(p, 100);
  EXPECT_EQ(uids.size(), 3u * 10u - 1u + 1u);
  EXPECT_EQ(std::count(uids.begin(), uids.end(), 1000 * 1 + 3 + 1), 0);
  EXPECT_EQ(p.stats().skipped, 2u);
}

// Every record of another shape (data prepared with another --seq-len) under --on-corrupt skip
// once looped over every epoch without end; now it is an error naming the first reason, which
// names the setting to change. The same without skip names the setting and not --on-corrupt.
TEST(Pipeline, AnEpochWithoutAUsableRecordIsAnErrorNotAnEndlessLoop) {
  TempDir dir;
  write_shards(dir, 2, 10);
  for (OnCorrupt mode : {OnCorrupt::Skip, OnCorrupt::Fail}) {
    PipelineOptions o = options(dir, 4);  // epochs = 0: repeat forever
    o.on_corrupt = mode;
    o.verbose_skips = false;
    Pipeline p(o, Schema::pretraining(kT / 2, kP, kVocab));
    try {
      data::Batch b;
      p.next(b);
      FAIL() << "no error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("differs from --seq-len"), std::string::npos) << msg;
      EXPECT_EQ(msg.find("--on-corrupt"), std::string::npos) << msg;
      if (mode == OnCorrupt::Skip) {
        EXPECT_NE(msg.find("no usable record in a whole epoch"), std::string::npos) << msg;
        EXPECT_EQ(p.stats().skipped, 20u);
      }
    }
  }
  // Files without any record: an error too, not a wait.
  TempDir empty;
  write_shards(empty, 2, 0);
  PipelineOptions o = options(empty, 4);
  Pipeline p(o, schema());
  data::Batch b;
  EXPECT_THROW(p.next(b), Error);
}

// A batch larger than an epoch (batches do not span epochs; the remainder is dropped) would
// never come: an error naming the numbers and the fix, not a wait (it spun forever before).
TEST(Pipeline, BatchLargerThanAnEpochIsAnError) {
  TempDir dir;
  write_shards(dir, 2, 5);
  PipelineOptions o = options(dir, 16);  // 10 records per epoch
  Pipeline p(o, schema());
  data::Batch b;
  try {
    p.next(b);
    FAIL() << "a batch of 16 came from 10 records";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gives this rank 10 records, fewer than one batch of 16: "
                                         "lower --batch-size to at most 10"),
              std::string::npos)
        << e.what();
  }
}

// A raised stop flag (SIGTERM's) ends a wait for input within the wait's slice.
TEST(Pipeline, NextStopsWaitingWhenInterrupted) {
  TempDir dir;
  write_shards(dir, 1, 2);
  // A FIFO as the data file: the reader blocks on it, so the consumer waits for input.
  const std::string fifo = dir / "shard-9.tfrecord";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  PipelineOptions o = options(dir, 64);
  std::atomic<int> flag{0};
  o.interrupt = &flag;
  o.shuffle = false;
  Pipeline p(o, schema());
  std::thread raise([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    flag = 15;
  });
  const auto t0 = std::chrono::steady_clock::now();
  data::Batch b;
  EXPECT_THROW(p.next(b), Interrupted);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, 5.0);
  raise.join();
  // Unblock the reader (waiting in open) so that the pipeline can shut down: a writer that opens
  // and closes the FIFO makes it an empty file.
  for (int i = 0; i < 500; ++i) {
    const int fd = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) {
      close(fd);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

TEST(Pipeline, MissingFilesAndBadOptionsAreClearErrors) {
  TempDir dir;
  PipelineOptions o = options(dir, 4);
  try {
    Pipeline p(o, schema());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no files match"), std::string::npos);
  }
  write_shards(dir, 1, 3);
  o.rank = 2;
  o.world = 2;
  EXPECT_THROW(Pipeline(o, schema()), Error);
}

TEST(Pipeline, MemoryIsBoundedAndReported) {
  TempDir dir;
  write_shards(dir, 4, 200);
  PipelineOptions o = options(dir, 32);
  Pipeline p(o, schema());
  const size_t bound = p.memory_bound_bytes();
  EXPECT_GT(bound, 0u);
  EXPECT_LT(bound, size_t{64} << 20);  // a few MiB for these settings, not the data size
  take(p, 50);
  PipelineStats s = p.stats();
  EXPECT_EQ(s.batches, 50u);
  EXPECT_EQ(s.examples, 50u * 32u);
  EXPECT_GT(s.bytes, 0u);
  EXPECT_GE(s.readers, 1);
  EXPECT_LE(s.queued_batches, 8);
}

}  // namespace
}  // namespace bertrain::data
