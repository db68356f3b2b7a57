#include "data/pipeline.h"

#include <fcntl.h>
#include <unistd.h>

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "core/rng.h"
#include "core/setting.h"
#include "data/packing.h"
#include "data/tfrecord.h"

namespace bertrain::data {

ReadAhead read_ahead(const PipelineOptions& opt) {
  ReadAhead ra;
  ra.chunk_bytes = opt.remote_chunk_bytes;
  // At least two requests per open object, and 32 MiB ahead over the whole interleave: what
  // keeps a reader fed through a store's round trip (at 50 ms, 32 MiB ahead sustains 640 MB/s).
  const size_t interleave = static_cast<size_t>(std::max(1, opt.cycle_length)) * ra.chunk_bytes;
  ra.chunks =
      opt.remote_readahead > 0
          ? opt.remote_readahead
          : std::max<int>(2, static_cast<int>(((size_t{32} << 20) + interleave - 1) / interleave));
  return ra;
}

namespace {
// Records one interleave slot may queue ahead.
size_t slot_capacity(const PipelineOptions& opt) {
  return static_cast<size_t>(std::max(2 * opt.block_length, 16));
}
}  // namespace

std::vector<std::string> list_files(const std::string& patterns) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= patterns.size()) {
    size_t end = patterns.find(',', start);
    if (end == std::string::npos) end = patterns.size();
    const std::string pat = patterns.substr(start, end - start);
    start = end + 1;
    if (pat.empty()) continue;
    for (std::string& f : match_files(pat)) out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) fail("no files match '", patterns, "' (check the path or quote the glob)");
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;

// Parsed examples travel in chunks (one reader pass over a file): flat storage, no allocation
// per example, one lock per chunk.
struct Chunk {
  std::vector<int32_t> ints;  // n * schema.int_count()
  std::vector<float> floats;  // n * schema.float_count()
  size_t n = 0, pos = 0;      // examples held; examples already taken by the assembler
  std::string error;          // non-empty: a fatal error after these examples
};

struct Slot {
  int64_t file = -1;                // index into the epoch's file list; -1: empty slot
  std::unique_ptr<ByteSource> raw;  // the file opened ahead (an object), for the reader to take
  std::unique_ptr<TFRecordReader> reader;
  std::deque<Chunk> q;
  size_t queued = 0;  // examples in q
  bool eof = false, busy = false;
};

struct Out {
  Batch batch;
  uint64_t epoch = 0, index = 0;
  std::string error;
  bool end = false;
  uint64_t examples = 0;  // instances of the epoch through this batch
};

void truncate_batch(Batch& b, int64_t rows) {
  b.B = rows;
  b.input_ids.resize(rows * b.T);
  b.input_mask.resize(rows * b.T);
  b.segment_ids.resize(rows * b.T);
  b.masked_lm_positions.resize(rows * b.P);
  b.masked_lm_ids.resize(rows * b.P);
  b.masked_lm_weights.resize(rows * b.P);
  b.next_sentence_labels.resize(rows);
  b.label_ids.resize(rows);
}

uint64_t fingerprint_of(const std::vector<std::string>& files) {
  uint64_t h = 0x6a09e667f3bcc908ull;
  for (const auto& f : files) {
    for (char c : f) h = mix64(h ^ static_cast<uint8_t>(c));
    h = mix64(h ^ (is_fifo(f) ? 0 : file_size(f)));
  }
  return h;
}

// The files rank `rank` of `world` reads in `epoch`: a seeded permutation (the same on every
// rank, so the shards stay disjoint), every world-th file from the rank's own; all files when
// there are fewer files than ranks (the stream is then split by record).
std::vector<std::string> shard_files(const std::vector<std::string>& all, uint64_t seed,
                                     bool shuffle, uint64_t epoch, int world, int rank) {
  std::vector<std::string> f = all;
  if (shuffle) {
    const uint64_t key = rng_key(seed, epoch, 0xf11e5);
    for (size_t i = f.size(); i > 1; --i) std::swap(f[i - 1], f[rng_u64(key, i) % i]);
  }
  if (static_cast<int>(f.size()) < world) return f;
  std::vector<std::string> mine;
  for (size_t i = 0; i < f.size(); ++i)
    if (static_cast<int>(i % world) == rank) mine.push_back(f[i]);
  return mine;
}

}  // namespace

const EpochPlan* PipelinePosition::plan_for(uint64_t e) const {
  for (const auto& p : plans)
    if (p.epoch == e) return &p;
  return nullptr;
}

StreamSizes::StreamSizes(std::vector<std::string> files, std::vector<uint64_t> records,
                         uint64_t seed, bool shuffle)
    : files_(std::move(files)), records_(std::move(records)), seed_(seed), shuffle_(shuffle) {
  if (files_.size() != records_.size()) fail("StreamSizes: one record count per file");
}

uint64_t StreamSizes::examples(uint64_t epoch, int world, int rank) const {
  if (static_cast<int>(files_.size()) < world) {  // split by record: every world-th of them
    uint64_t total = 0;
    for (uint64_t r : records_) total += r;
    return total / world + (static_cast<uint64_t>(rank) < total % world ? 1 : 0);
  }
  uint64_t n = 0;
  for (const auto& f : shard_files(files_, seed_, shuffle_, epoch, world, rank))
    n += records_[std::lower_bound(files_.begin(), files_.end(), f) - files_.begin()];
  return n;
}

uint64_t count_records(const std::string& path, const std::string& compression) {
  TFRecordReader r(path, resolve_compression(compression, path));
  uint64_t n = 0;
  for (;;) {
    try {
      if (!r.skip()) return n;
      ++n;
    } catch (const CorruptRecord& e) {
      if (!e.resumable()) return n;  // the pipeline reads no further either
      ++n;
    }
  }
}

Remap remap_positions(const std::vector<PipelinePosition>& old, int64_t old_batch, int world,
                      int64_t batch, const StreamSizes& sizes, bool packed) {
  if (old.empty()) fail("the checkpoint holds no input position to resume from");
  if (world <= 0 || batch <= 0 || old_batch <= 0) fail("remap: world and batches must be positive");
  const int N = static_cast<int>(old.size());
  Remap out;
  out.first_epoch = old[0].epoch;
  out.last_epoch = old[0].epoch;
  for (const auto& p : old) {
    out.first_epoch = std::min(out.first_epoch, p.epoch);
    out.last_epoch = std::max(out.last_epoch, p.epoch);
    for (const auto& plan : p.plans) out.last_epoch = std::max(out.last_epoch, plan.epoch);
  }
  out.positions.assign(world, PipelinePosition{out.first_epoch, 0, old[0].fingerprint, {}});
  for (uint64_t e = out.first_epoch; e <= out.last_epoch; ++e) {
    // What the old ranks had still to read of epoch e, end to end in old-rank order.
    std::vector<StreamPart> rest;
    for (int r = 0; r < N; ++r) {
      const PipelinePosition& p = old[r];
      if (e < p.epoch) continue;  // rank r had finished epoch e
      std::vector<StreamPart> parts;
      if (const EpochPlan* plan = p.plan_for(e))
        parts = plan->parts;
      else {
        const uint64_t n = sizes.examples(e, N, r);
        parts.push_back(
            {N, r, 0, packed ? n : n / old_batch * old_batch});  // its full batches (packed: all)
      }
      uint64_t skip = e != p.epoch ? 0 : packed ? p.examples : p.batches * old_batch;  // read
      for (StreamPart part : parts) {
        const uint64_t k = std::min(skip, part.size());
        part.begin += k;
        skip -= k;
        if (part.size() > 0) rest.push_back(part);
      }
    }
    uint64_t total = 0;
    for (const auto& part : rest) total += part.size();
    const uint64_t unit = packed ? 1 : static_cast<uint64_t>(batch);  // dealt out in these
    const uint64_t K = total / unit;
    out.remaining += total;
    out.dropped += total - K * unit;
    // Deal out contiguous runs of whole batches.
    size_t at = 0;
    uint64_t used = 0;  // of rest[at]
    for (int q = 0; q < world; ++q) {
      EpochPlan plan{e, {}};
      uint64_t want = (K / world + (static_cast<uint64_t>(q) < K % world ? 1 : 0)) * unit;
      while (want > 0) {
        const StreamPart& src = rest[at];
        const uint64_t k = std::min(want, src.size() - used);
        plan.parts.push_back({src.world, src.rank, src.begin + used, src.begin + used + k});
        want -= k;
        used += k;
        if (used == src.size()) {
          ++at;
          used = 0;
        }
      }
      out.positions[q].plans.push_back(std::move(plan));
    }
  }
  return out;
}

struct Pipeline::Impl {
  PipelineOptions opt;
  Schema schema;
  std::vector<std::string> all_files;
  uint64_t fingerprint = 0;
  bool remote = false;  // some files are objects (s3://, oss://)
  // Objects opened ahead of their slot (assembler only): see run_stream.
  std::map<std::tuple<uint64_t, int, int, size_t>, std::unique_ptr<ByteSource>> ahead;
  size_t slot_cap = 0;

  // Shared between the assembler and the readers (under mu).
  std::mutex mu;
  std::condition_variable cv_work, cv_data;
  std::vector<std::string> epoch_files;
  std::vector<Slot> slots;
  std::vector<Chunk> free_chunks;
  size_t cur = 0;
  int active_readers = 1;
  bool stop = false;

  // Output queue (under out_mu).
  std::mutex out_mu;
  std::condition_variable cv_out, cv_space;
  std::deque<Out> out;
  std::vector<Batch> free_batches;
  int prefetch = 1;

  PipelinePosition start;  // where the assembler begins (read by it alone)
  // Consumer-side state.
  PipelinePosition pos;
  PipelineStats st;
  Clock::time_point t_start = Clock::now();
  double window_wait = 0;
  Clock::time_point window_start = Clock::now();
  int window_batches = 0, calm_windows = 0;

  std::atomic<uint64_t> bytes{0}, skipped{0};
  std::mutex skip_mu;
  std::string first_skip;  // the first skipped record's reason (under skip_mu)
  std::thread assembler;
  std::vector<std::thread> readers;
  std::atomic<int> readers_live{0};

  Impl(const PipelineOptions& o, const Schema& s) : opt(o), schema(s) {}

  // ---- readers ----
  int find_work() {
    const size_t n = slots.size();
    for (size_t d = 0; d < n; ++d) {
      const size_t i = (cur + d) % n;
      const Slot& s = slots[i];
      if (s.file >= 0 && !s.eof && !s.busy && s.queued < slot_cap) return static_cast<int>(i);
    }
    return -1;
  }

  // Skips are counted; the first few are logged in full, then one line at each power of ten,
  // so that a data set with millions of bad records cannot flood stderr.
  void log_skip(const std::string& what) {
    const uint64_t n = skipped.fetch_add(1) + 1;
    {
      std::lock_guard<std::mutex> lock(skip_mu);
      if (first_skip.empty()) first_skip = what;
    }
    if (!opt.verbose_skips) return;
    if (n <= kSkipsLoggedInFull) {
      std::fprintf(stderr, "bertrain: skipping unusable record: %s\n", what.c_str());
      if (n == kSkipsLoggedInFull)
        std::fprintf(stderr, "bertrain: (further skips are counted, not listed)\n");
    } else {
      uint64_t p = 10;
      while (p < n) p *= 10;
      if (p == n)
        std::fprintf(stderr, "bertrain: %llu records skipped so far; the latest: %s\n",
                     static_cast<unsigned long long>(n), what.c_str());
    }
  }
  static constexpr uint64_t kSkipsLoggedInFull = 5;

  std::string first_skip_reason() {
    std::lock_guard<std::mutex> lock(skip_mu);
    return first_skip;
  }

  void reader_loop(int id) {
    std::string rec, err;
    for (;;) {
      std::unique_lock<std::mutex> lock(mu);
      int s;
      cv_work.wait(lock, [&] { return stop || (id < active_readers && (s = find_work()) >= 0); });
      if (stop) return;
      Slot& slot = slots[s];
      slot.busy = true;
      const std::string path = epoch_files[slot.file];
      std::unique_ptr<ByteSource> raw = std::move(slot.raw);
      const size_t want =
          std::min<size_t>(std::max<size_t>(opt.block_length, 8), slot_cap - slot.queued);
      Chunk chunk = take_free_chunk_locked();
      lock.unlock();

      const size_t IC = schema.int_count(), FC = schema.float_count();
      chunk.ints.resize(want * IC);
      chunk.floats.resize(want * FC);
      bool eof = false;
      auto failure = [&](const std::string& msg, bool fatal_to_file) {
        if (opt.on_corrupt == OnCorrupt::Fail) {
          chunk.error = msg;
          eof = true;
        } else {
          log_skip(msg);
          if (fatal_to_file) eof = true;
        }
      };
      try {
        if (!slot.reader)
          slot.reader = std::make_unique<TFRecordReader>(
              path, opt.compression, raw ? std::move(raw) : open_raw(path, read_ahead(opt)));
        while (chunk.n < want && !eof) {
          try {
            if (!slot.reader->next(rec)) {
              eof = true;
              break;
            }
          } catch (const CorruptRecord& e) {
            failure(opt.on_corrupt == OnCorrupt::Fail
                        ? str(e.what(), ", or pass ", setting("on_corrupt"),
                              "=skip to skip bad records")
                        : std::string(e.what()),
                    !e.resumable());
            continue;
          }
          bytes.fetch_add(rec.size() + 16, std::memory_order_relaxed);
          bool mismatch = false;
          if (schema.parse(rec, chunk.ints.data() + chunk.n * IC,
                           chunk.floats.data() + chunk.n * FC, err, &mismatch)) {
            ++chunk.n;
          } else {
            // A shape that differs from the settings is a configuration mismatch (fix the
            // settings); anything else is damaged data (fix it, or skip it).
            failure(str(path, ": record ", slot.reader->records() - 1, " at byte ",
                        slot.reader->offset() - rec.size() - 16, ": ", err,
                        opt.on_corrupt == OnCorrupt::Fail && !mismatch
                            ? str("; fix the data or pass ", setting("on_corrupt"), "=skip")
                            : std::string()),
                    false);
          }
        }
      } catch (const Error& e) {  // cannot open or read the file
        failure(e.what(), true);
      }

      lock.lock();
      if (chunk.n > 0 || !chunk.error.empty()) {
        slot.queued += chunk.n;
        slot.q.push_back(std::move(chunk));
      } else {
        free_chunks.push_back(std::move(chunk));
      }
      slot.busy = false;
      if (eof) {
        slot.eof = true;
        slot.reader.reset();
      }
      lock.unlock();
      cv_data.notify_all();
      cv_work.notify_all();
    }
  }

  Chunk take_free_chunk_locked() {
    Chunk c;
    if (!free_chunks.empty()) {
      c = std::move(free_chunks.back());
      free_chunks.pop_back();
    }
    c.n = c.pos = 0;
    c.error.clear();
    return c;
  }

  // ---- assembler ----
  bool push_out(Out&& o) {
    std::unique_lock<std::mutex> lock(out_mu);
    cv_space.wait(lock, [&] { return stop || static_cast<int>(out.size()) < prefetch; });
    if (stop) return false;
    out.push_back(std::move(o));
    lock.unlock();
    cv_out.notify_one();
    return true;
  }

  Batch take_free_batch() {
    std::lock_guard<std::mutex> lock(out_mu);
    Batch b;
    if (!free_batches.empty()) {
      b = std::move(free_batches.back());
      free_batches.pop_back();
    }
    return b;
  }

  // The stream of rank `rank` of `world` in `epoch`: the interleave of its files (or every
  // world-th record of all files), through the shuffle buffer, each example to sink(ints,
  // floats) in order. False when stopped or failed (the error queued for the consumer, at
  // batch `at`). `own`: this rank's own stream, where an epoch without a usable record is an
  // error (it would repeat forever); a plan's part of another stream may be empty.
  template <class Sink>
  bool run_stream(uint64_t epoch, int world, int rank, bool own, const uint64_t& at, Sink&& sink) {
    const bool by_file = static_cast<int>(all_files.size()) >= world;
    size_t next_file = 0;
    // Objects: the file a slot will take next is opened ahead (its first reads in flight), and
    // once every file of the epoch has a slot, the next epoch's first ones.
    // Opened ahead: (epoch, world, rank, index in that epoch's files) -> the open object. What
    // another stream opened (a plan's guess of the next epoch) is dropped.
    const auto key = [&](uint64_t e, size_t i) { return std::make_tuple(e, world, rank, i); };
    std::erase_if(ahead, [&](const auto& a) {
      return std::get<0>(a.first) != epoch || std::get<1>(a.first) != world ||
             std::get<2>(a.first) != rank;
    });
    bool ahead_next_epoch = false;
    auto open_next_ahead = [&] {
      if (!remote) return;
      const ReadAhead ra = read_ahead(opt);
      auto open = [&](uint64_t e, size_t i, const std::string& f) {
        try {
          ahead[key(e, i)] = open_raw(f, ra);
        } catch (const Error&) {  // the reader's open reports it, in its turn
        }
      };
      if (next_file < epoch_files.size()) return open(epoch, next_file, epoch_files[next_file]);
      if (ahead_next_epoch) return;
      ahead_next_epoch = true;
      const auto next = shard_files(all_files, opt.seed, opt.shuffle, epoch + 1, world, rank);
      for (size_t i = 0; i < std::min(next.size(), slots.size()); ++i) open(epoch + 1, i, next[i]);
    };
    // A slot takes the next file, and the file opened ahead for it if any.
    auto assign = [&](Slot& s) {
      s = Slot();
      if (next_file >= epoch_files.size()) return;
      auto it = ahead.find(key(epoch, next_file));
      if (it != ahead.end()) {
        s.raw = std::move(it->second);
        ahead.erase(it);
      }
      s.file = static_cast<int64_t>(next_file++);
    };
    {
      std::lock_guard<std::mutex> lock(mu);
      epoch_files = shard_files(all_files, opt.seed, opt.shuffle, epoch, world, rank);
      for (auto& s : slots) assign(s);
      open_next_ahead();
      cur = 0;
    }
    cv_work.notify_all();

    const uint64_t shuffle_key = rng_key(opt.seed, epoch, 0x5b0ff1e, rank);
    uint64_t draws = 0, stream_k = 0;
    const size_t IC = schema.int_count(), FC = schema.float_count();
    // Flat shuffle buffer: no allocation per example.
    const size_t S =
        opt.shuffle && opt.shuffle_buffer > 1 ? static_cast<size_t>(opt.shuffle_buffer) : 0;
    std::vector<int32_t> buf_ints(S * IC);
    std::vector<float> buf_floats(S * FC);
    size_t buffered = 0;
    auto accept = [&](const int32_t* ints, const float* floats) -> bool {
      if (!by_file && static_cast<int>(stream_k++ % world) != rank) return true;
      if (S == 0) return sink(ints, floats);
      if (buffered < S) {
        std::copy_n(ints, IC, buf_ints.data() + buffered * IC);
        std::copy_n(floats, FC, buf_floats.data() + buffered * FC);
        ++buffered;
        return true;
      }
      const size_t j = rng_u64(shuffle_key, draws++) % S;
      if (!sink(buf_ints.data() + j * IC, buf_floats.data() + j * FC)) return false;
      std::copy_n(ints, IC, buf_ints.data() + j * IC);
      std::copy_n(floats, FC, buf_floats.data() + j * FC);
      return true;
    };

    // Interleave: block_length examples from each open file in turn; an exhausted file is
    // replaced in its slot by the next file of the epoch. The assembler owns `held[i]`, the
    // chunk it is taking examples from for slot i, so it locks once per chunk.
    std::vector<Chunk> held(slots.size());
    uint64_t usable = 0;  // records parsed this epoch (before the per-rank split)
    for (;;) {
      bool any_open = false;
      for (const auto& s : slots) any_open |= s.file >= 0;
      if (!any_open) break;
      Slot& slot = slots[cur];
      Chunk& h = held[cur];
      for (int taken = 0; taken < opt.block_length;) {
        if (h.pos < h.n) {
          const size_t k = std::min<size_t>(h.n - h.pos, opt.block_length - taken);
          usable += k;
          for (size_t i = 0; i < k; ++i, ++h.pos)
            if (!accept(h.ints.data() + h.pos * IC, h.floats.data() + h.pos * FC)) return false;
          taken += static_cast<int>(k);
          continue;
        }
        if (!h.error.empty()) {
          push_out({{}, epoch, at, h.error, false});
          return false;
        }
        std::unique_lock<std::mutex> lock(mu);
        if (h.ints.capacity() > 0) free_chunks.push_back(std::move(h));
        h = Chunk();
        if (slot.file < 0) break;
        cv_data.wait(lock, [&] { return stop || !slot.q.empty() || (slot.eof && !slot.busy); });
        if (stop) return false;
        if (slot.q.empty()) {  // this file is done: the next one takes the slot
          assign(slot);
          open_next_ahead();
          lock.unlock();
          cv_work.notify_all();
          break;
        }
        h = std::move(slot.q.front());
        slot.q.pop_front();
        slot.queued -= h.n;
        lock.unlock();
        cv_work.notify_all();
      }
      std::lock_guard<std::mutex> lock(mu);
      cur = (cur + 1) % slots.size();
    }
    // An epoch without a single usable record would repeat forever: with every record
    // skipped, or files without records, that is an error, not a wait.
    if (usable == 0 && own) {
      const uint64_t n = skipped.load();
      const std::string first = first_skip_reason();
      push_out({{},
                epoch,
                at,
                n > 0
                    ? str("no usable record in a whole epoch of ", epoch_files.size(), " file(s) (",
                          opt.files, "): all ", n, " records read were skipped; the first: ", first)
                    : str("the input files hold no records (", opt.files, ", ", epoch_files.size(),
                          " file(s) for this rank)"),
                false});
      return false;
    }
    // End of the epoch: drain the shuffle buffer in random order.
    while (buffered > 0) {
      const size_t j = rng_u64(shuffle_key, draws++) % buffered;
      if (!sink(buf_ints.data() + j * IC, buf_floats.data() + j * FC)) return false;
      --buffered;
      std::copy_n(buf_ints.data() + buffered * IC, IC, buf_ints.data() + j * IC);
      std::copy_n(buf_floats.data() + buffered * FC, FC, buf_floats.data() + j * FC);
    }
    return true;
  }

  void assembler_loop() {
    const int64_t B = opt.batch_size, T = schema.seq_len(), P = schema.max_predictions();
    const bool pack = opt.pack_per_row > 0;
    const int64_t cap = pack ? B * opt.pack_per_row : B;  // instances a batch holds at most
    RowPacker packer({B, T, std::max<int64_t>(opt.pack_per_row, 1), B * P});
    int64_t mask_at = 0, positions_at = 0, weights_at = 0;  // in a parsed example
    for (const FeatureSpec& f : schema.features()) {
      if (f.name == "input_mask") mask_at = f.offset;
      if (f.name == "masked_lm_positions") positions_at = f.offset;
      if (f.name == "masked_lm_weights") weights_at = f.offset;
    }
    for (uint64_t epoch = start.epoch; opt.epochs == 0 || epoch < static_cast<uint64_t>(opt.epochs);
         ++epoch) {
      const uint64_t skip_batches = epoch == start.epoch ? start.batches : 0;
      uint64_t batch_index = 0, read = 0;  // read: instances of the epoch in batches so far
      int64_t rows = 0;
      Batch batch = take_free_batch();
      schema.shape_batch(batch, cap);
      packer.clear();
      auto close = [&]() -> bool {  // the batch's `rows` instances are all it gets
        read += rows;
        if (batch_index >= skip_batches) {
          if (rows != batch.B) truncate_batch(batch, rows);
          batch.packed_rows = pack ? B : 0;
          if (!push_out({std::move(batch), epoch, batch_index, "", false, read})) return false;
          batch = take_free_batch();
          schema.shape_batch(batch, cap);
        }
        ++batch_index;
        rows = 0;
        packer.clear();
        return true;
      };
      auto emit = [&](const int32_t* ints, const float* floats) -> bool {
        if (pack) {
          const auto [tokens, predictions] =
              instance_size(ints + mask_at, T, ints + positions_at, floats + weights_at, P);
          if (!packer.take(tokens, predictions)) {
            if (!close()) return false;
            packer.take(tokens, predictions);  // an empty batch takes any one instance
          }
        }
        if (batch_index >= skip_batches) schema.fill_row(ints, floats, batch, rows);
        if (++rows == B && !pack) return close();
        return true;
      };
      const EpochPlan* plan = start.plan_for(epoch);
      if (plan) {  // parts of other ranks' streams, one after the other
        for (const StreamPart& part : plan->parts) {
          uint64_t k = 0;
          auto in_part = [&](const int32_t* ints, const float* floats) -> bool {
            const bool mine = k >= part.begin && k < part.end;
            ++k;
            return !mine || emit(ints, floats);
          };
          if (!run_stream(epoch, part.world, part.rank, false, batch_index, in_part)) return;
        }
      } else if (!run_stream(epoch, opt.world, opt.rank, true, batch_index, emit)) {
        return;
      }
      if (rows > 0 && !opt.drop_remainder && !close()) return;
      // Batches do not span epochs: with fewer records per epoch than one batch (and the
      // remainder dropped) no batch would ever come, and the run would wait forever. (A plan
      // may give this rank no batch of an epoch: the others read it.)
      if (batch_index == 0 && opt.drop_remainder && !plan) {
        push_out({{},
                  epoch,
                  0,
                  str("one epoch of ", opt.files, " gives this rank ", rows,
                      pack ? str(" records, which fill fewer than one batch of ", B, " packed rows")
                           : str(" records, fewer than one batch of ", B),
                      ": lower ", setting("batch_size"), " to at most ", rows,
                      opt.world > 1 ? " (or use fewer ranks)" : "", ", or add data"),
                  false});
        return;
      }
    }
    push_out({{}, 0, 0, "", true});
  }

  void autotune(double waited) {
    window_wait += waited;
    if (++window_batches < 8) return;
    const double span = std::chrono::duration<double>(Clock::now() - window_start).count();
    const double frac = span > 0 ? window_wait / span : 0;
    size_t queued;
    {
      std::lock_guard<std::mutex> lock(out_mu);
      queued = out.size();
    }
    if (frac > 0.02) {
      calm_windows = 0;
      if (opt.readers == 0) {
        std::lock_guard<std::mutex> lock(mu);
        if (active_readers < static_cast<int>(readers.size())) ++active_readers;
      }
      if (opt.prefetch == 0) {
        std::lock_guard<std::mutex> lock(out_mu);
        if (prefetch < opt.max_prefetch) ++prefetch;
      }
      cv_work.notify_all();
      cv_space.notify_all();
    } else if (queued >= static_cast<size_t>(prefetch) && ++calm_windows >= 4 && opt.readers == 0) {
      // The consumer never waits and the queue is full: give a core back to the compute.
      std::lock_guard<std::mutex> lock(mu);
      if (active_readers > 1) --active_readers;
      calm_windows = 0;
    }
    window_wait = 0;
    window_batches = 0;
    window_start = Clock::now();
  }
};

Pipeline::Pipeline(const PipelineOptions& opt, const Schema& schema, PipelinePosition start)
    : impl_(new Impl(opt, schema)) {
  Impl& m = *impl_;
  if (opt.batch_size <= 0) fail("batch size must be positive");
  if (opt.world <= 0 || opt.rank < 0 || opt.rank >= opt.world)
    fail("rank ", opt.rank, " is outside a world of ", opt.world);
  if (opt.cycle_length <= 0 || opt.block_length <= 0)
    fail("cycle and block length must be positive");
  if (opt.pack_per_row < 0) fail(setting("pack"), " must be >= 0, got ", opt.pack_per_row);
  if (opt.pack_per_row > 0 &&
      (schema.kind() != Schema::Kind::Pretraining || schema.max_predictions() <= 0))
    fail("packing (", setting("pack"),
         ") needs pretraining records with masked predictions; fine-tuning data is not packed");
  m.all_files = list_files(opt.files);
  for (const auto& f : m.all_files) m.remote |= is_remote(f);
  m.fingerprint = fingerprint_of(m.all_files);
  if (start.fingerprint != 0 && start.fingerprint != m.fingerprint)
    fail("the input files differ from the ones the checkpoint was reading (", opt.files,
         "); resume with the same data, or start a new run");
  for (const auto& plan : start.plans)
    for (const auto& part : plan.parts)
      if (part.world <= 0 || part.rank < 0 || part.rank >= part.world || part.end < part.begin)
        fail("the input position's plan for epoch ", plan.epoch, " names an impossible part (rank ",
             part.rank, " of ", part.world, ", examples ", part.begin, "..", part.end, ")");
  m.start = start;
  m.pos = start;
  m.pos.fingerprint = m.fingerprint;
  m.slot_cap = slot_capacity(opt);
  m.slots.resize(opt.cycle_length);
  // A reader works on one open file at a time: more readers than open files would idle.
  const int files_here =
      static_cast<int>(static_cast<int>(m.all_files.size()) >= opt.world && start.plans.empty()
                           ? (m.all_files.size() + opt.world - 1) / opt.world
                           : m.all_files.size());
  const int max_readers = std::max(1, std::min({opt.cycle_length, files_here,
                                                opt.readers > 0 ? opt.readers : opt.cycle_length}));
  m.active_readers = opt.readers > 0 ? max_readers : 1;
  m.prefetch = opt.prefetch > 0 ? opt.prefetch : 2;
  if (opt.prefetch == 0 && opt.max_prefetch < 2)
    fail("PipelineOptions::max_prefetch (AUTOTUNE's upper bound) must be at least 2");
  m.readers_live = max_readers;
  for (int i = 0; i < max_readers; ++i)
    m.readers.emplace_back([&m, i] {
      m.reader_loop(i);
      --m.readers_live;
    });
  m.assembler = std::thread([&m] { m.assembler_loop(); });
}

Pipeline::~Pipeline() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> a(m.mu);
    std::lock_guard<std::mutex> b(m.out_mu);
    m.stop = true;
  }
  m.cv_work.notify_all();
  m.cv_data.notify_all();
  m.cv_space.notify_all();
  m.cv_out.notify_all();
  if (m.assembler.joinable()) m.assembler.join();
  // A reader may be blocked opening a named pipe that no program writes to (any more): opening
  // each pipe of the data for writing, without blocking, and closing it again releases it (it
  // then reads an end of file and sees the stop), until every reader has returned.
  while (m.readers_live.load() > 0) {
    for (const auto& f : m.all_files) {
      struct stat st {};
      if (::stat(f.c_str(), &st) != 0 || !S_ISFIFO(st.st_mode)) continue;
      const int fd = ::open(f.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& t : m.readers) t.join();
}

bool Pipeline::next(Batch& batch) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(m.out_mu);
  // Wait in slices, so that a stop request (SIGTERM/SIGINT) is honoured while input is slow.
  Clock::time_point raised{};
  while (!m.cv_out.wait_for(lock, std::chrono::milliseconds(100), [&] { return !m.out.empty(); }))
    if (m.opt.interrupt && m.opt.interrupt->load() != 0) {
      if (raised == Clock::time_point{}) raised = Clock::now();
      if (std::chrono::duration<double>(Clock::now() - raised).count() >= m.opt.interrupt_grace_s)
        throw Interrupted("interrupted while waiting for input");
    }
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  if (m.out.front().end) return false;  // stays queued: later calls also end
  Out o = std::move(m.out.front());
  m.out.pop_front();
  if (batch.input_ids.capacity() > 0 && m.free_batches.size() < 4)
    m.free_batches.push_back(std::move(batch));
  lock.unlock();
  m.cv_space.notify_one();
  if (!o.error.empty()) {
    std::lock_guard<std::mutex> l2(m.out_mu);
    m.out.push_front({{}, 0, 0, o.error, false});  // keep failing on later calls
    throw Error(o.error);
  }
  batch = std::move(o.batch);
  m.pos.epoch = o.epoch;
  m.pos.batches = o.index + 1;
  m.pos.examples = o.examples;
  m.st.batches++;
  m.st.examples += batch.B;
  m.st.consumer_wait_s += waited;
  m.autotune(waited);
  return true;
}

PipelinePosition Pipeline::position() const {
  return impl_->pos;
}

PipelineStats Pipeline::stats() const {
  Impl& m = *impl_;
  PipelineStats s = m.st;
  s.bytes = m.bytes.load();
  s.skipped = m.skipped.load();
  s.elapsed_s = std::chrono::duration<double>(Clock::now() - m.t_start).count();
  {
    std::lock_guard<std::mutex> lock(m.mu);
    s.readers = m.active_readers;
  }
  std::lock_guard<std::mutex> lock(m.out_mu);
  s.prefetch = m.prefetch;
  s.queued_batches = static_cast<int64_t>(m.out.size());
  return s;
}

size_t Pipeline::memory_bound_bytes() const {
  return memory_bound(impl_->opt, impl_->schema);
}

size_t Pipeline::memory_bound(const PipelineOptions& opt, const Schema& schema) {
  const size_t ex = schema.example_bytes();
  const size_t batch = ex * opt.batch_size * std::max<int64_t>(opt.pack_per_row, 1);
  const size_t read_buffers = opt.cycle_length * size_t{2} << 20;  // buffered file + zlib input
  // Per slot: queued chunks up to slot_cap plus one chunk in flight and one held; the free
  // lists recycle those same chunks and batches.
  const size_t slot_cap = slot_capacity(opt);
  const size_t chunk = std::max<size_t>(opt.block_length, 8) * ex;
  // Objects: the ranged reads in flight and the one being read, per open file.
  const ReadAhead ra = read_ahead(opt);
  // Objects: the ranged reads in flight and the one being read, per open file, and those of
  // the files opened ahead (the next epoch's first, one per slot, and the next file).
  const size_t remote =
      opt.files.find("://") != std::string::npos
          ? (opt.cycle_length * (2 * ra.chunks + size_t{1}) + ra.chunks) * ra.chunk_bytes
          : 0;
  return opt.cycle_length * (slot_cap * ex + 2 * chunk) + opt.shuffle_buffer * ex +
         (opt.max_prefetch + 6) * batch + read_buffers + remote + 64 * 1024;
}

const std::vector<std::string>& Pipeline::files() const {
  return impl_->all_files;
}

}  // namespace bertrain::data
