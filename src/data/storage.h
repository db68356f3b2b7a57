// Where data lives: local files and objects (s3://, oss://; object_store.h) behind one set of
// functions, so that every reader of the data (pipeline, prepare, inspect, eval) takes either.
// An object is read as parallel ranged GETs kept `chunks` ahead of the reader (ReadAhead), so
// the store's latency is paid once per file, not once per read; written objects are staged in
// a local temporary file and uploaded in one PUT when closed (atomic: nothing is visible before).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace bertrain::data {

// A sequential byte stream: a file, an object, or either through zlib inflate.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Reads up to n bytes; fewer only at the end of the stream.
  virtual size_t read(void* buf, size_t n) = 0;
};

bool is_remote(const std::string& path);

// Read-ahead of one open object: `chunks` ranged GETs of chunk_bytes in flight ahead of the
// reader. The pipeline sizes it from its interleave (cycle_length files open at once).
struct ReadAhead {
  size_t chunk_bytes = size_t{8} << 20;
  int chunks = 4;
};

// An object's first reads are in flight when this returns: opened ahead of its use (the
// pipeline's next files), its round trip overlaps the reading of others.
std::unique_ptr<ByteSource> open_raw(const std::string& path, const ReadAhead& ra = {});
// A whole file or object (task files, not training shards).
std::string read_all(const std::string& path);
// The first n bytes (fewer if the file is shorter).
std::string read_prefix(const std::string& path, size_t n);
uint64_t file_size(const std::string& path);
// A named pipe (a local one: read once per opening, cannot be peeked at).
bool is_fifo(const std::string& path);

// Files and objects matching one glob: local through glob(3); remote by listing the bucket
// under the pattern's literal prefix and matching keys with fnmatch ('*' stays within a '/'
// level, as locally). A pattern without wildcards names one file or object.
std::vector<std::string> match_files(const std::string& pattern);

// Stages a file to write: the local path to write and, on commit, put it in place.
class StagedOutput {
 public:
  explicit StagedOutput(const std::string& path);
  ~StagedOutput();  // uncommitted: the staged file is removed
  const std::string& local_path() const { return local_; }
  // Local: rename into place. Remote: upload, then remove the staged file.
  void commit();

 private:
  std::string path_, local_;
  bool done_ = false;
};

// Remote reads since the start of the process, over every object store.
struct RemoteReadStats {
  uint64_t requests = 0, retries = 0, bytes = 0, opened = 0;
  double request_seconds = 0, reader_wait_seconds = 0;
};
RemoteReadStats remote_read_stats();

}  // namespace bertrain::data
