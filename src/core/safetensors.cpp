#include "core/safetensors.h"
#include "core/setting.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace bertrain {

namespace {

constexpr uint64_t kMaxHeader = 100u << 20;  // the format's own limit (100 MB)

// A header's array of whole numbers (a shape, data offsets). JSON parsers read an integer past
// 64 bits as floating point, and a negative or fractional one is no size: the file's error.
std::vector<uint64_t> whole_numbers(const nlohmann::json& j, const std::string& tensor,
                                    const char* field) {
  if (!j.is_array()) fail("tensor ", tensor, ": ", field, " ", j.dump(), " is not an array");
  std::vector<uint64_t> v;
  for (const auto& x : j) {
    if (!x.is_number_unsigned())
      fail("tensor ", tensor, ": ", field, " holds ", x.dump(),
           ", not a whole number from 0 to 2^64 - 1");
    v.push_back(x.get<uint64_t>());
  }
  return v;
}

}  // namespace

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail("cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail("cannot stat ", path, ": ", std::strerror(errno));
  }
  map_size_ = static_cast<size_t>(st.st_size);
  if (map_size_ < 8) {
    ::close(fd);
    fail(path, ": not a safetensors file (", map_size_, " bytes; the header alone needs 8)");
  }
  void* m = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) fail("cannot map ", path, ": ", std::strerror(errno));
  map_ = static_cast<const unsigned char*>(m);

  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | map_[i];
  if (n > kMaxHeader || n + 8 > map_size_) {
    unmap();
    fail(path, ": header length ", n, " does not fit the file of ", map_size_,
         " bytes (truncated or not safetensors)");
  }
  data_ = map_ + 8 + n;
  const size_t data_size = map_size_ - 8 - n;
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(map_ + 8, map_ + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    unmap();
    fail(path, ": header is not valid JSON: ", e.what());
  }
  try {
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m2 = it->begin(); m2 != it->end(); ++m2)
          metadata_[m2.key()] = m2->is_string() ? m2->get<std::string>() : m2->dump();
        continue;
      }
      SafeTensorInfo t;
      t.name = it.key();
      t.dtype = dtype_from_name(it->at("dtype").get<std::string>());
      // Elements of at most the data section's bytes (so neither the count nor its bytes
      // overflow 64 bits, whatever the header claims).
      uint64_t numel = 1;
      for (uint64_t d : whole_numbers(it->at("shape"), t.name, "shape")) {
        if (d != 0 && numel > data_size / d)
          fail("tensor ", t.name, ": shape ", it->at("shape").dump(), " holds more elements than ",
               "the data section has bytes (", data_size, ")");
        numel *= d;
        t.shape.push_back(static_cast<int64_t>(d));
      }
      const auto off = whole_numbers(it->at("data_offsets"), t.name, "data_offsets");
      if (off.size() != 2) fail("data_offsets must have 2 entries");
      t.begin = off[0];
      t.end = off[1];
      const uint64_t want = numel * dtype_size(t.dtype);
      if (t.end < t.begin || t.end > data_size || t.end - t.begin != want)
        fail("tensor ", t.name, " ", shape_str(t.shape), " ", dtype_name(t.dtype),
             " has data_offsets [", t.begin, ", ", t.end, "] but needs ", want,
             " bytes within a data section of ", data_size);
      tensors_.push_back(std::move(t));
    }
  } catch (const nlohmann::json::exception& e) {
    unmap();
    fail(path, ": malformed header entry: ", e.what());
  } catch (const Error& e) {
    unmap();
    fail(path, ": ", e.what());
  }
}

SafetensorsReader::~SafetensorsReader() {
  unmap();
}

void SafetensorsReader::unmap() {
  if (map_) ::munmap(const_cast<unsigned char*>(map_), map_size_);
  map_ = nullptr;
}

const SafeTensorInfo* SafetensorsReader::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void SafetensorsReader::read_f32(const SafeTensorInfo& t, float* out) const {
  const size_t n = static_cast<size_t>(shape_numel(t.shape));
  const unsigned char* p = data_ + t.begin;
  switch (t.dtype) {
    case DType::F32:
      std::memcpy(out, p, n * 4);
      break;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      break;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      break;
    case DType::F64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, p + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    default:
      fail(path_, ": tensor ", t.name, " is ", dtype_name(t.dtype), ", expected a float dtype");
  }
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name) const {
  const SafeTensorInfo* t = find(name);
  if (!t) fail(path_, ": no tensor named ", name);
  std::vector<float> out(static_cast<size_t>(shape_numel(t->shape)));
  read_f32(*t, out.data());
  return out;
}

std::vector<double> SafetensorsReader::read_f64(const std::string& name) const {
  const SafeTensorInfo* t = find(name);
  if (!t) fail(path_, ": no tensor named ", name);
  std::vector<double> out(static_cast<size_t>(shape_numel(t->shape)));
  if (t->dtype == DType::F64) {
    std::memcpy(out.data(), data_ + t->begin, out.size() * 8);
  } else {
    std::vector<float> f(out.size());
    read_f32(*t, f.data());
    for (size_t i = 0; i < f.size(); ++i) out[i] = f[i];
  }
  return out;
}

std::vector<int64_t> SafetensorsReader::read_i64(const std::string& name) const {
  const SafeTensorInfo* t = find(name);
  if (!t) fail(path_, ": no tensor named ", name);
  std::vector<int64_t> out(static_cast<size_t>(shape_numel(t->shape)));
  if (t->dtype == DType::I64) {
    std::memcpy(out.data(), data_ + t->begin, out.size() * 8);
  } else if (t->dtype == DType::I32) {
    for (size_t i = 0; i < out.size(); ++i) {
      int32_t v;
      std::memcpy(&v, data_ + t->begin + 4 * i, 4);
      out[i] = v;
    }
  } else {
    fail(path_, ": tensor ", name, " is ", dtype_name(t->dtype), ", expected I64 or I32");
  }
  return out;
}

namespace {

// Writes all of buf to fd or throws with the path and errno text (ENOSPC -> "disk full").
void write_all(int fd, const void* buf, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      fail("cannot write ", path, ": ", std::strerror(e),
           e == ENOSPC
               ? str(" (the disk is full; free space or choose another ", setting("output"), ")")
               : std::string());
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// Opens a temp file next to `path`, runs body(fd, tmp), fsyncs, renames over path, fsyncs the
// directory. Any failure removes the temp file and leaves `path` as it was.
template <typename Body>
void atomic_write(const std::string& path, Body body) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_regular_file(path, ec))
    fail("refusing to replace ", path, ": it exists and is not a regular file");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail("cannot create ", tmp, ": ", std::strerror(errno));
  try {
    body(fd, tmp);
    if (::fsync(fd) != 0) fail("cannot sync ", tmp, ": ", std::strerror(errno));
    if (::close(fd) != 0) {
      fd = -1;
      fail("cannot close ", tmp, ": ", std::strerror(errno));
    }
    fd = -1;
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail("cannot rename ", tmp, " to ", path, ": ", std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  std::string dir = fs::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& bytes) {
  atomic_write(path, [&](int fd, const std::string& tmp) {
    write_all(fd, bytes.data(), bytes.size(), tmp);
  });
}

void write_safetensors(const std::string& path, const std::vector<SafeTensorOut>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h;
  if (!metadata.empty()) h["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& t : tensors) {
    const size_t bytes = static_cast<size_t>(shape_numel(t.shape)) * dtype_size(t.dtype);
    h[t.name] = {{"dtype", dtype_name(t.dtype)},
                 {"shape", t.shape},
                 {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  atomic_write(path, [&](int fd, const std::string& tmp) {
    unsigned char len[8];
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    write_all(fd, len, 8, tmp);
    write_all(fd, header.data(), header.size(), tmp);
    std::vector<unsigned char> buf;
    std::vector<float> filled;
    for (const auto& t : tensors) {
      const size_t n_el = static_cast<size_t>(shape_numel(t.shape));
      const size_t bytes = n_el * dtype_size(t.dtype);
      if (t.raw) {
        write_all(fd, t.raw, bytes, tmp);
        continue;
      }
      const float* f32 = t.f32;
      if (t.fill) {
        filled.resize(n_el);
        t.fill(filled.data());
        f32 = filled.data();
      }
      BT_CHECK(f32, "tensor ", t.name, " has no data");
      if (t.dtype == DType::F32) {
        write_all(fd, f32, bytes, tmp);
        continue;
      }
      buf.resize(bytes);
      auto* h16 = reinterpret_cast<uint16_t*>(buf.data());
      if (t.dtype == DType::BF16)
        convert_f32_to_bf16(f32, h16, n_el);
      else if (t.dtype == DType::F16)
        convert_f32_to_f16(f32, h16, n_el);
      else
        fail("cannot write tensor ", t.name, " as ", dtype_name(t.dtype));
      write_all(fd, buf.data(), bytes, tmp);
    }
  });
}

}  // namespace bertrain
