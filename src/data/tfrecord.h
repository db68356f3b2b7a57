// TFRecord files: [u64 length][u32 masked crc32c(length)][data][u32 masked crc32c(data)],
// uncompressed or as one GZIP/ZLIB stream (TensorFlow's compression_type). The reader checks
// both CRCs of every record; corruption raises CorruptRecord naming the file, the byte offset
// (in the uncompressed stream) and the record number. Files or objects (s3://, oss://) alike.
// The writer is atomic (a staged file renamed into place, or uploaded, when closed).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "core/error.h"
#include "data/storage.h"

namespace bertrain::data {

enum class Compression { None, Gzip, Zlib };

// "none" | "gzip" | "zlib" | "auto" (auto: by extension .gz/.gzip -> gzip, .zlib/.zz -> zlib,
// else by the file's first bytes).
Compression resolve_compression(const std::string& option, const std::string& path);
const char* compression_name(Compression c);

class CorruptRecord : public Error {
 public:
  enum class Kind { Truncated, LengthCrc, DataCrc, Decompress };
  CorruptRecord(Kind k, const std::string& path, uint64_t offset, uint64_t record,
                const std::string& what);
  Kind kind;
  std::string path;
  uint64_t offset, record;
  // Whether the reader can go on with the next record (only a bad data CRC leaves the framing
  // intact; a bad length, truncation or broken compression end the file).
  bool resumable() const { return kind == Kind::DataCrc; }
};

// A file or object (storage.h), inflated when compressed, read through a large buffer.
std::unique_ptr<ByteSource> open_source(const std::string& path, Compression c,
                                        const ReadAhead& ra = {});

class TFRecordReader {
 public:
  TFRecordReader(const std::string& path, Compression c, const ReadAhead& ra = {});
  // From a source already open (open_raw: an object's first reads may be in flight). The
  // compression option as resolve_compression takes it; "auto" with a name that does not say
  // looks at the source's first bytes (no second request, and named pipes work too).
  TFRecordReader(const std::string& path, const std::string& compression,
                 std::unique_ptr<ByteSource> raw);
  // Next record into `out`; false at a clean end of file. Throws CorruptRecord; after a
  // resumable one the next call continues with the following record.
  bool next(std::string& out);
  // Skips the next record's data without returning it (still verifies the CRCs).
  bool skip();
  uint64_t offset() const { return offset_; }  // of the next record
  uint64_t records() const { return records_; }
  const std::string& path() const { return path_; }

 private:
  bool read_header(uint64_t& len);
  std::string path_;
  std::unique_ptr<ByteSource> src_;
  uint64_t offset_ = 0, records_ = 0;
  bool dead_ = false;
};

// Appends one record in TFRecord framing to out: length (u64 LE), masked CRC32C of the length,
// the bytes, masked CRC32C of the bytes. TFRecordWriter writes these; so do appenders such as
// TensorBoard event files, which must be readable while they grow.
void append_tfrecord_frame(std::string& out, std::string_view record);

class TFRecordWriter {
 public:
  TFRecordWriter(const std::string& path, Compression c);
  ~TFRecordWriter();  // an unclosed writer discards its temp file
  void write(std::string_view record);
  void close();  // flush, fsync, rename into place
  uint64_t records() const { return records_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  uint64_t records_ = 0;
};

}  // namespace bertrain::data
