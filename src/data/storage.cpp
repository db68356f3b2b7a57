#include "data/storage.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>

#include "core/error.h"
#include "data/object_store.h"

namespace bertrain::data {

namespace {

std::atomic<uint64_t> g_opened{0};
std::atomic<int64_t> g_wait_us{0};

// What listing and HEAD said of each object (size, ETag), so that opening one costs no request
// and a read can insist on the version that was listed.
std::mutex g_info_mu;
std::map<std::string, ObjectInfo> g_info;

ObjectInfo info_of(const std::string& path) {
  {
    std::lock_guard<std::mutex> lock(g_info_mu);
    auto it = g_info.find(path);
    if (it != g_info.end()) return it->second;
  }
  const ObjectUrl u = parse_object_url(path);
  if (u.key.empty() || u.key.back() == '/')
    fail("'", path, "' names a bucket or folder, not an object");
  ObjectInfo i = ObjectStore::of(u.scheme).head(u);
  std::lock_guard<std::mutex> lock(g_info_mu);
  return g_info[path] = i;
}

class FileSource : public ByteSource {
 public:
  explicit FileSource(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY);
    if (fd_ < 0) fail("cannot open ", path, ": ", std::strerror(errno));
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
  }
  ~FileSource() override { ::close(fd_); }
  size_t read(void* buf, size_t n) override {
    size_t got = 0;
    char* p = static_cast<char*>(buf);
    while (got < n) {
      ssize_t r = ::read(fd_, p + got, n - got);
      if (r < 0) {
        if (errno == EINTR) continue;
        fail("cannot read ", path_, ": ", std::strerror(errno));
      }
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    return got;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// An object read front to back: ranged GETs of chunk_bytes, `chunks` of them in flight ahead of
// the reader, each checked against the listed ETag.
class ObjectSource : public ByteSource {
 public:
  ObjectSource(const std::string& path, const ReadAhead& ra)
      : url_(parse_object_url(path)),
        info_(info_of(path)),
        store_(ObjectStore::of(url_.scheme)),
        chunk_(std::max<size_t>(ra.chunk_bytes, 64 << 10)),
        depth_(std::max(1, ra.chunks)) {
    ++g_opened;
    fill();
  }
  size_t read(void* buf, size_t n) override {
    char* p = static_cast<char*>(buf);
    size_t got = 0;
    while (got < n) {
      if (pos_ == cur_.size()) {
        if (inflight_.empty()) break;  // end of the object
        const auto t0 = std::chrono::steady_clock::now();
        cur_ = inflight_.front().get();  // throws the request's Error
        g_wait_us += std::chrono::duration_cast<std::chrono::microseconds>(
                         std::chrono::steady_clock::now() - t0)
                         .count();
        inflight_.pop_front();
        pos_ = 0;
        fill();
      }
      const size_t take = std::min(n - got, cur_.size() - pos_);
      std::memcpy(p + got, cur_.data() + pos_, take);
      pos_ += take;
      got += take;
    }
    return got;
  }

 private:
  void fill() {
    while (static_cast<int>(inflight_.size()) < depth_ && issued_ < info_.size) {
      const uint64_t end = std::min<uint64_t>(info_.size, issued_ + chunk_);
      inflight_.push_back(store_.get(url_, issued_, end, info_.etag));
      issued_ = end;
    }
  }
  ObjectUrl url_;
  ObjectInfo info_;
  ObjectStore& store_;
  size_t chunk_;
  int depth_;
  uint64_t issued_ = 0;
  std::deque<std::future<std::string>> inflight_;
  std::string cur_;
  size_t pos_ = 0;
};

bool has_wildcard(const std::string& s) {
  return s.find_first_of("*?[") != std::string::npos;
}

}  // namespace

bool is_remote(const std::string& path) {
  return is_object_url(path);
}

std::unique_ptr<ByteSource> open_raw(const std::string& path, const ReadAhead& ra) {
  if (!is_remote(path)) return std::make_unique<FileSource>(path);
  return std::make_unique<ObjectSource>(path, ra);
}

std::string read_all(const std::string& path) {
  std::unique_ptr<ByteSource> src = open_raw(path);  // names a missing file
  std::string out;
  // To the end, whatever the size says (a pipe or /dev/stdin has none).
  for (;;) {  // a read returns less than asked only at the end
    const size_t got = out.size(), want = std::max<size_t>(size_t{1} << 20, got);
    out.resize(got + want);
    const size_t n = src->read(out.data() + got, want);
    out.resize(got + n);
    if (n < want) return out;
  }
}

std::string read_prefix(const std::string& path, size_t n) {
  std::string out;
  if (is_remote(path)) {
    // The first bytes of an object are asked again when it is opened again (compression
    // sniffing, once per epoch): small prefixes are kept rather than paying a round trip.
    static std::mutex mu;
    static std::map<std::string, std::string> heads;
    constexpr size_t kKept = 64;
    if (n <= kKept) {
      std::lock_guard<std::mutex> lock(mu);
      auto it = heads.find(path);
      if (it != heads.end()) return it->second.substr(0, n);
    }
    const ObjectInfo i = info_of(path);
    if (i.size == 0 || n == 0) return out;
    const ObjectUrl u = parse_object_url(path);
    out = ObjectStore::of(u.scheme)
              .get(u, 0, std::min<uint64_t>(std::max(n, kKept), i.size), i.etag)
              .get();
    if (n <= kKept) {
      std::lock_guard<std::mutex> lock(mu);
      heads[path] = out;
    }
    return out.substr(0, n);
  }
  out.resize(n);
  out.resize(FileSource(path).read(out.data(), n));
  return out;
}

uint64_t file_size(const std::string& path) {
  if (is_remote(path)) return info_of(path).size;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail("cannot read ", path, ": ", std::strerror(errno));
  return static_cast<uint64_t>(st.st_size);
}

bool is_fifo(const std::string& path) {
  struct stat st {};
  return !is_remote(path) && ::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode);
}

std::vector<std::string> match_files(const std::string& pattern) {
  std::vector<std::string> out;
  if (!is_remote(pattern)) {
    glob_t g{};
    if (::glob(pattern.c_str(), GLOB_BRACE | GLOB_TILDE, nullptr, &g) == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) {
        struct stat st {};
        // Regular files, and named pipes (data streamed in by another program; each epoch
        // opens it again, so its writer must feed it again).
        if (::stat(g.gl_pathv[i], &st) == 0 && (S_ISREG(st.st_mode) || S_ISFIFO(st.st_mode)))
          out.push_back(g.gl_pathv[i]);
      }
    globfree(&g);
    return out;
  }
  const ObjectUrl u = parse_object_url(pattern);
  ObjectStore& store = ObjectStore::of(u.scheme);
  const std::string base = u.scheme + "://" + u.bucket + "/";
  if (!has_wildcard(u.key)) {
    if (u.key.empty() || u.key.back() == '/') {
      // A folder: every object below it.
      for (const ObjectInfo& o : store.list(u.bucket, u.key)) {
        std::lock_guard<std::mutex> lock(g_info_mu);
        g_info[base + o.key] = o;
        out.push_back(base + o.key);
      }
      return out;
    }
    info_of(pattern);  // a missing object is an Error naming it
    out.push_back(pattern);
    return out;
  }
  const std::string prefix = u.key.substr(0, u.key.find_first_of("*?["));
  for (const ObjectInfo& o : store.list(u.bucket, prefix)) {
    if (::fnmatch(u.key.c_str(), o.key.c_str(), FNM_PATHNAME) != 0) continue;
    std::lock_guard<std::mutex> lock(g_info_mu);
    g_info[base + o.key] = o;
    out.push_back(base + o.key);
  }
  return out;
}

StagedOutput::StagedOutput(const std::string& path) : path_(path) {
  if (is_remote(path)) {
    parse_object_url(path);
    std::string tmpl = (std::filesystem::temp_directory_path() / "bertrain-upload-XXXXXX").string();
    const int fd = ::mkstemp(tmpl.data());
    if (fd < 0) fail("cannot stage ", path, " in ", tmpl, ": ", std::strerror(errno));
    ::close(fd);
    local_ = tmpl;
  } else {
    local_ = path + ".tmp." + std::to_string(::getpid());
  }
}

StagedOutput::~StagedOutput() {
  if (!done_) ::unlink(local_.c_str());
}

void StagedOutput::commit() {
  if (done_) return;
  if (!is_remote(path_)) {
    if (::rename(local_.c_str(), path_.c_str()) != 0)
      fail("cannot rename ", local_, " to ", path_, ": ", std::strerror(errno));
    done_ = true;
    return;
  }
  std::string body(file_size(local_), '\0');
  FileSource f(local_);
  if (f.read(body.data(), body.size()) != body.size()) fail("cannot read back ", local_);
  const ObjectUrl u = parse_object_url(path_);
  ObjectStore::of(u.scheme).put(u, std::move(body));
  ::unlink(local_.c_str());
  done_ = true;
}

RemoteReadStats remote_read_stats() {
  const ObjectStoreStats t = ObjectStore::totals();
  RemoteReadStats r;
  r.requests = t.requests;
  r.retries = t.retries;
  r.bytes = t.bytes;
  r.request_seconds = t.request_seconds;
  r.opened = g_opened.load();
  r.reader_wait_seconds = g_wait_us.load() / 1e6;
  return r;
}

}  // namespace bertrain::data
