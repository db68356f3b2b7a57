#include "data/tfrecord.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <vector>

#include "data/crc32c.h"

namespace bertrain::data {

namespace {

constexpr size_t kBufSize = 1 << 20;

class ZlibSource : public ByteSource {
 public:
  ZlibSource(const std::string& path, std::unique_ptr<ByteSource> file, Compression c)
      : path_(path), file_(std::move(file)), in_(kBufSize) {
    std::memset(&zs_, 0, sizeof zs_);
    // gzip: 16 + 15; zlib: 15. TensorFlow may concatenate members; we continue across them.
    window_ = c == Compression::Gzip ? 15 + 16 : 15;
    if (inflateInit2(&zs_, window_) != Z_OK) fail("zlib init failed for ", path);
  }
  ~ZlibSource() override { inflateEnd(&zs_); }
  size_t read(void* buf, size_t n) override {
    zs_.next_out = static_cast<Bytef*>(buf);
    zs_.avail_out = static_cast<uInt>(n);
    while (zs_.avail_out > 0) {
      if (zs_.avail_in == 0) {
        size_t got = file_->read(in_.data(), in_.size());
        if (got == 0) {
          if (!stream_end_ && produced_any_)
            throw CorruptRecord(CorruptRecord::Kind::Decompress, path_, total_out(), 0,
                                "compressed stream ends early (truncated file)");
          break;
        }
        zs_.next_in = in_.data();
        zs_.avail_in = static_cast<uInt>(got);
      }
      if (stream_end_) {  // another gzip member follows
        inflateReset2(&zs_, window_);
        stream_end_ = false;
      }
      int rc = inflate(&zs_, Z_NO_FLUSH);
      produced_any_ = true;
      if (rc == Z_STREAM_END) {
        stream_end_ = true;
        out_before_ += zs_.total_out;
        continue;
      }
      if (rc != Z_OK && rc != Z_BUF_ERROR)
        throw CorruptRecord(CorruptRecord::Kind::Decompress, path_, total_out(), 0,
                            str("cannot decompress (", zs_.msg ? zs_.msg : "zlib error", ")"));
    }
    return n - zs_.avail_out;
  }

 private:
  uint64_t total_out() const { return out_before_ + (stream_end_ ? 0 : zs_.total_out); }
  std::string path_;
  std::unique_ptr<ByteSource> file_;
  std::vector<Bytef> in_;
  z_stream zs_;
  int window_;
  bool stream_end_ = false, produced_any_ = false;
  uint64_t out_before_ = 0;
};

// Buffers reads of a source so that records are copied out of one large buffer.
class Buffered : public ByteSource {
 public:
  explicit Buffered(std::unique_ptr<ByteSource> s) : src_(std::move(s)), buf_(kBufSize) {}
  size_t read(void* out, size_t n) override {
    char* p = static_cast<char*>(out);
    size_t got = 0;
    while (got < n) {
      if (pos_ == end_) {
        if (n - got >= buf_.size()) {  // large read: bypass the buffer
          size_t r = src_->read(p + got, n - got);
          got += r;
          break;
        }
        end_ = src_->read(buf_.data(), buf_.size());
        pos_ = 0;
        if (end_ == 0) break;
      }
      size_t take = std::min(n - got, end_ - pos_);
      std::memcpy(p + got, buf_.data() + pos_, take);
      pos_ += take;
      got += take;
    }
    return got;
  }

 private:
  std::unique_ptr<ByteSource> src_;
  std::vector<char> buf_;
  size_t pos_ = 0, end_ = 0;
};

void put_u32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t get_u64(const unsigned char* p) {
  return get_u32(p) | (static_cast<uint64_t>(get_u32(p + 4)) << 32);
}

}  // namespace

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::None:
      return "none";
    case Compression::Gzip:
      return "gzip";
    case Compression::Zlib:
      return "zlib";
  }
  return "?";
}

namespace {

// By the option, else by the name; nullopt: "auto" with a name that does not say.
std::optional<Compression> compression_by_name(const std::string& option, const std::string& path) {
  if (option == "none" || option == "") return Compression::None;
  if (option == "gzip" || option == "GZIP") return Compression::Gzip;
  if (option == "zlib" || option == "ZLIB") return Compression::Zlib;
  if (option != "auto") fail("unknown compression '", option, "' (use none, gzip, zlib or auto)");
  if (path.ends_with(".gz") || path.ends_with(".gzip")) return Compression::Gzip;
  if (path.ends_with(".zlib") || path.ends_with(".zz")) return Compression::Zlib;
  return std::nullopt;
}

Compression compression_by_bytes(const std::string& first) {
  if (first.size() < 2) return Compression::None;
  const auto* head = reinterpret_cast<const unsigned char*>(first.data());
  if (head[0] == 0x1f && head[1] == 0x8b) return Compression::Gzip;
  // zlib header: CMF 0x78 and (CMF*256 + FLG) % 31 == 0. An uncompressed TFRecord starts with
  // a little-endian length whose low byte is rarely 0x78 with a matching check; the CRC
  // verification catches a wrong guess anyway.
  if (head[0] == 0x78 && ((head[0] << 8) | head[1]) % 31 == 0) return Compression::Zlib;
  return Compression::None;
}

// The bytes already read from a source (to look at them), then the rest of it.
class Prefixed : public ByteSource {
 public:
  Prefixed(std::string head, std::unique_ptr<ByteSource> rest)
      : head_(std::move(head)), rest_(std::move(rest)) {}
  size_t read(void* buf, size_t n) override {
    char* p = static_cast<char*>(buf);
    const size_t take = std::min(n, head_.size() - pos_);
    std::memcpy(p, head_.data() + pos_, take);
    pos_ += take;
    return take == n ? n : take + rest_->read(p + take, n - take);
  }

 private:
  std::string head_;
  size_t pos_ = 0;
  std::unique_ptr<ByteSource> rest_;
};

}  // namespace

Compression resolve_compression(const std::string& option, const std::string& path) {
  if (const auto c = compression_by_name(option, path)) return *c;
  // A named pipe cannot be peeked at (what is read is gone): its name says, or it is plain.
  if (is_fifo(path)) return Compression::None;
  return compression_by_bytes(read_prefix(path, 2));
}

CorruptRecord::CorruptRecord(Kind k, const std::string& p, uint64_t off, uint64_t rec,
                             const std::string& what)
    : Error(str(p, ": corrupt record ", rec, " at byte ", off, ": ", what, "; re-create the file")),
      kind(k),
      path(p),
      offset(off),
      record(rec) {}

std::unique_ptr<ByteSource> open_source(const std::string& path, Compression c,
                                        const ReadAhead& ra) {
  std::unique_ptr<ByteSource> raw = open_raw(path, ra);
  if (c == Compression::None) return std::make_unique<Buffered>(std::move(raw));
  return std::make_unique<Buffered>(std::make_unique<ZlibSource>(path, std::move(raw), c));
}

TFRecordReader::TFRecordReader(const std::string& path, Compression c, const ReadAhead& ra)
    : path_(path), src_(open_source(path, c, ra)) {}

TFRecordReader::TFRecordReader(const std::string& path, const std::string& compression,
                               std::unique_ptr<ByteSource> raw)
    : path_(path) {
  std::optional<Compression> c = compression_by_name(compression, path);
  if (!c) {
    std::string head(2, '\0');
    head.resize(raw->read(head.data(), 2));
    c = compression_by_bytes(head);
    raw = std::make_unique<Prefixed>(std::move(head), std::move(raw));
  }
  if (*c == Compression::None)
    src_ = std::make_unique<Buffered>(std::move(raw));
  else
    src_ = std::make_unique<Buffered>(std::make_unique<ZlibSource>(path, std::move(raw), *c));
}

bool TFRecordReader::read_header(uint64_t& len) {
  if (dead_) return false;
  unsigned char h[12];
  size_t got;
  try {
    got = src_->read(h, 12);
  } catch (CorruptRecord& e) {
    dead_ = true;
    throw CorruptRecord(e.kind, path_, offset_, records_, "compressed stream is damaged");
  }
  if (got == 0) return false;
  if (got < 12) {
    dead_ = true;
    throw CorruptRecord(CorruptRecord::Kind::Truncated, path_, offset_, records_,
                        str("file ends inside a record header (", got, " of 12 bytes)"));
  }
  len = get_u64(h);
  if (mask_crc(crc32c(h, 8)) != get_u32(h + 8)) {
    dead_ = true;
    throw CorruptRecord(CorruptRecord::Kind::LengthCrc, path_, offset_, records_,
                        "length CRC mismatch (the record length is damaged)");
  }
  return true;
}

bool TFRecordReader::next(std::string& out) {
  uint64_t len;
  if (!read_header(len)) return false;
  const uint64_t rec_off = offset_;
  if (len > (uint64_t{1} << 34)) {
    dead_ = true;
    throw CorruptRecord(CorruptRecord::Kind::LengthCrc, path_, rec_off, records_,
                        str("record length ", len, " is implausible"));
  }
  out.resize(len + 4);
  size_t got;
  try {
    got = src_->read(out.data(), len + 4);
  } catch (CorruptRecord& e) {
    dead_ = true;
    throw CorruptRecord(e.kind, path_, rec_off, records_, "compressed stream is damaged");
  }
  if (got < len + 4) {
    dead_ = true;
    throw CorruptRecord(CorruptRecord::Kind::Truncated, path_, rec_off, records_,
                        str("file ends inside the record (", got, " of ", len + 4, " bytes)"));
  }
  const uint32_t want = get_u32(reinterpret_cast<const unsigned char*>(out.data()) + len);
  out.resize(len);
  offset_ += 12 + len + 4;
  const uint64_t rec = records_++;
  if (masked_crc32c(out.data(), len) != want)
    throw CorruptRecord(CorruptRecord::Kind::DataCrc, path_, rec_off, rec,
                        "data CRC mismatch (the record's bytes are damaged)");
  return true;
}

bool TFRecordReader::skip() {
  std::string tmp;
  return next(tmp);
}

// ---- writer ----

struct TFRecordWriter::Impl {
  std::string path, tmp;
  std::unique_ptr<StagedOutput> staged;
  int fd = -1;
  Compression comp;
  z_stream zs{};
  std::vector<unsigned char> zbuf = std::vector<unsigned char>(kBufSize);
  std::string pending;  // uncompressed bytes not yet written
  bool closed = false;

  void write_raw(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n) {
      ssize_t w = ::write(fd, c, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        fail("cannot write ", tmp, ": ", std::strerror(e),
             e == ENOSPC ? " (the disk is full; free space or choose another output)" : "");
      }
      c += w;
      n -= static_cast<size_t>(w);
    }
  }
  void flush_pending(bool finish) {
    if (comp == Compression::None) {
      write_raw(pending.data(), pending.size());
      pending.clear();
      return;
    }
    zs.next_in = reinterpret_cast<Bytef*>(pending.data());
    zs.avail_in = static_cast<uInt>(pending.size());
    int rc;
    do {
      zs.next_out = zbuf.data();
      zs.avail_out = static_cast<uInt>(zbuf.size());
      rc = deflate(&zs, finish ? Z_FINISH : Z_NO_FLUSH);
      BT_CHECK(rc != Z_STREAM_ERROR, "deflate failed");
      write_raw(zbuf.data(), zbuf.size() - zs.avail_out);
    } while (zs.avail_out == 0 || (finish && rc != Z_STREAM_END));
    pending.clear();
  }
};

TFRecordWriter::TFRecordWriter(const std::string& path, Compression c) : impl_(new Impl) {
  impl_->path = path;
  impl_->staged = std::make_unique<StagedOutput>(path);
  impl_->tmp = impl_->staged->local_path();
  impl_->comp = c;
  impl_->fd = ::open(impl_->tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (impl_->fd < 0) fail("cannot create ", impl_->tmp, ": ", std::strerror(errno));
  if (c != Compression::None) {
    const int window = c == Compression::Gzip ? 15 + 16 : 15;
    if (deflateInit2(&impl_->zs, Z_DEFAULT_COMPRESSION, Z_DEFLATED, window, 8,
                     Z_DEFAULT_STRATEGY) != Z_OK)
      fail("zlib init failed for ", path);
  }
}

TFRecordWriter::~TFRecordWriter() {
  if (!impl_->closed) ::close(impl_->fd);  // the staged file goes with impl_->staged
  if (impl_->comp != Compression::None) deflateEnd(&impl_->zs);
}

void append_tfrecord_frame(std::string& out, std::string_view rec) {
  char h[12];
  put_u64(h, rec.size());
  put_u32(h + 8, masked_crc32c(h, 8));
  char t[4];
  put_u32(t, masked_crc32c(rec.data(), rec.size()));
  out.append(h, 12).append(rec).append(t, 4);
}

void TFRecordWriter::write(std::string_view rec) {
  BT_CHECK(!impl_->closed, "write after close");
  append_tfrecord_frame(impl_->pending, rec);
  if (impl_->pending.size() >= kBufSize) impl_->flush_pending(false);
  ++records_;
}

void TFRecordWriter::close() {
  if (impl_->closed) return;
  impl_->flush_pending(true);
  if (::fsync(impl_->fd) != 0) fail("cannot sync ", impl_->tmp, ": ", std::strerror(errno));
  ::close(impl_->fd);
  impl_->closed = true;
  impl_->staged->commit();
}

}  // namespace bertrain::data
