// data::Pipeline: TFRecord shards -> Batch, in parallel, deterministic, memory-bounded.
//
//   glob -> shard by rank (by file when files >= ranks, else by record) -> seeded file order
//   per epoch -> interleave (cycle_length open files, block_length records from each in turn)
//   -> reader threads (read, CRC, decompress, parse + validate) -> shuffle buffer -> batch
//   -> prefetch queue -> next()
//
// Order depends only on (files, seed, options), never on thread timing or counts: the readers
// fill per-file queues, and one assembler thread takes from them in the fixed interleave order.
// Every queue is bounded (memory_bound_bytes() says how much at most). AUTOTUNE raises the
// active reader threads and the prefetch depth while the consumer waits, and lowers them while
// it never does. A position (epoch, batches) restarts the stream exactly where it left off:
// the assembler replays the epoch's interleave and shuffle up to it without emitting batches.
// An epoch with a plan (a resume on another number of ranks) reads the parts of other ranks'
// streams that the plan names, replaying those streams the same way.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/batch.h"
#include "data/schema.h"
#include "data/storage.h"

namespace bertrain::data {

enum class OnCorrupt { Fail, Skip };

struct PipelineOptions {
  std::string files;  // glob pattern(s), comma-separated
  int64_t batch_size = 32;
  int rank = 0, world = 1;
  uint64_t seed = 12345;
  bool shuffle = true;            // file order per epoch + shuffle buffer
  int64_t shuffle_buffer = 4096;  // examples
  int cycle_length = 8;
  int block_length = 16;
  int readers = 0;   // reader threads; 0 = AUTOTUNE (1..cycle_length)
  int prefetch = 0;  // batches ready ahead; 0 = AUTOTUNE (1..max_prefetch)
  int max_prefetch = 8;
  int64_t epochs = 0;  // 0 = repeat forever
  // Packing (pretraining records; data/packing.h): 0 = a batch is batch_size instances; N = a
  // batch is the instances that fit into batch_size rows of seq_len tokens, N at most a row,
  // with at most batch_size x max_predictions weighted masked predictions (Batch::packed_rows).
  int64_t pack_per_row = 0;
  bool drop_remainder = true;
  OnCorrupt on_corrupt = OnCorrupt::Fail;
  std::string compression = "auto";
  // Objects (s3://, oss://): bytes per ranged read, and reads in flight per open file (0: auto,
  // at least 2 and 32 MiB over the cycle_length open files).
  size_t remote_chunk_bytes = size_t{4} << 20;
  int remote_readahead = 0;
  bool verbose_skips = true;  // log skipped records to stderr (the first few, then counts)
  // When set and raised (SIGTERM's flag), next() stops waiting for input once the flag has been
  // up for interrupt_grace_s (checked every 100 ms) and throws Interrupted.
  const std::atomic<int>* interrupt = nullptr;
  double interrupt_grace_s = 0;
};

// Thrown by Pipeline::next when `interrupt` was raised while it waited.
class Interrupted : public Error {
 public:
  using Error::Error;
};

// Examples [begin, end) of the stream that rank `rank` of `world` ranks reads in one epoch, in
// the order it reads them (after the interleave and the shuffle buffer).
struct StreamPart {
  int world = 1, rank = 0;
  uint64_t begin = 0, end = 0;
  uint64_t size() const { return end - begin; }
};

// What one rank reads in `epoch` instead of its own shard: parts of the streams of another
// layout's ranks, one after the other (a resume on another number of ranks; see remap_positions).
struct EpochPlan {
  uint64_t epoch = 0;
  std::vector<StreamPart> parts;
};

struct PipelinePosition {
  uint64_t epoch = 0;        // epochs completed before the current one
  uint64_t batches = 0;      // batches already returned in the current epoch
  uint64_t fingerprint = 0;  // of the file list (names, sizes): resuming on other data fails
  // Epochs this rank reads by a plan rather than by its shard (those from `epoch` on count).
  std::vector<EpochPlan> plans;
  // Instances in the batches returned in the current epoch (batches x batch size unless packed).
  uint64_t examples = 0;
  const EpochPlan* plan_for(uint64_t e) const;
};

// Examples per epoch in each rank's stream, for any number of ranks: from the files' record
// counts (every record counted as usable; a corrupt record that is skipped makes a stream end
// early, never read twice) and the same file order and sharding as the pipeline.
class StreamSizes {
 public:
  StreamSizes(std::vector<std::string> files, std::vector<uint64_t> records, uint64_t seed,
              bool shuffle);
  uint64_t examples(uint64_t epoch, int world, int rank) const;

 private:
  std::vector<std::string> files_;
  std::vector<uint64_t> records_;
  uint64_t seed_;
  bool shuffle_;
};

// Records in a TFRecord file (its framing read, the data skipped; compressed files inflated).
uint64_t count_records(const std::string& path, const std::string& compression = "auto");

// A resume on another number of ranks. `old` holds the position of every rank of the run that
// wrote the checkpoint (batches of old_batch examples); the result, one position per rank of
// `world` ranks with batches of `batch`. For every epoch that some old rank had begun but not
// every one had finished, the examples the old ranks had still to read (their streams' full
// batches past their positions; parts of plans for a run already remapped) are laid end to end
// in old-rank order and cut into whole batches, dealt out as contiguous runs: rank q gets
// floor(K/world) batches of the K, one more for q < K % world. Within such an epoch no example
// is read twice and none is skipped, except the last (< batch) examples of the cut when they
// do not fill a batch (counted in `dropped`). Later epochs are each rank's own shard again.
struct Remap {
  std::vector<PipelinePosition> positions;  // per new rank
  uint64_t first_epoch = 0, last_epoch = 0;
  uint64_t remaining = 0, dropped = 0;  // examples re-divided; dropped as less than a batch
};
// Packed runs (`packed`): what was read is each position's `examples`, the rest of a stream is
// all of it (a packed batch holds a varying number of instances), and the rest is dealt out
// instance by instance, none dropped.
Remap remap_positions(const std::vector<PipelinePosition>& old, int64_t old_batch, int world,
                      int64_t batch, const StreamSizes& sizes, bool packed = false);

struct PipelineStats {
  uint64_t batches = 0, examples = 0, bytes = 0, skipped = 0;
  double consumer_wait_s = 0, elapsed_s = 0;
  int readers = 0, prefetch = 0;
  int64_t queued_batches = 0;
  double examples_per_s() const { return elapsed_s > 0 ? examples / elapsed_s : 0; }
};

// Files matching the comma-separated glob patterns, sorted; Error when none match. Patterns may
// name objects (s3://bucket/train-*.tfrecord; storage.h).
std::vector<std::string> list_files(const std::string& patterns);

// The read-ahead of each open object for these options.
ReadAhead read_ahead(const PipelineOptions& opt);

class Pipeline {
 public:
  Pipeline(const PipelineOptions& opt, const Schema& schema, PipelinePosition start = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // The next batch (swapped into `out`; out's old buffers are recycled). False at the end of
  // the last epoch. Throws Error (file, offset, record) on corrupt data with OnCorrupt::Fail,
  // and when a whole epoch yields no usable record (every record skipped, or none at all).
  bool next(Batch& out);
  PipelinePosition position() const;  // after the last batch returned
  PipelineStats stats() const;
  size_t memory_bound_bytes() const;
  // The same bound from the options and the schema alone, before any file is opened (what
  // `estimate` adds to the memory plan for the input).
  static size_t memory_bound(const PipelineOptions& opt, const Schema& schema);
  const std::vector<std::string>& files() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bertrain::data
