#include "data/tensor_bundle.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "core/dtype.h"
#include "core/error.h"
#include "data/crc32c.h"
#include "tensorflow/core/protobuf/tensor_bundle.pb.h"

namespace bertrain::data {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kTableMagic = 0xdb4775248b80fb57ull;  // LevelDB's, which TensorFlow keeps
constexpr size_t kFooterSize = 48;  // two block handles padded to 40 bytes, then the magic
constexpr size_t kTrailerSize = 5;  // after each block: compression type, masked CRC32C

uint32_t fixed32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

bool varint(const char*& p, const char* end, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && p < end; shift += 7) {
    const uint8_t b = static_cast<uint8_t>(*p++);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

struct BlockHandle {
  uint64_t offset = 0, size = 0;
};

// An index that cannot be read: the file, what is wrong, and what to do.
[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  fail(path, ": ", what,
       "; the checkpoint index is damaged or not a TensorFlow checkpoint (copy it again from "
       "its source)");
}

BlockHandle decode_handle(const char*& p, const char* end, const std::string& path) {
  BlockHandle h;
  if (!varint(p, end, h.offset) || !varint(p, end, h.size)) corrupt(path, "bad block handle");
  return h;
}

// A block's contents, after checking its trailer's CRC.
std::string_view read_block(const std::string& file, const BlockHandle& h,
                            const std::string& path) {
  if (h.offset > file.size() || h.size > file.size() - h.offset ||
      file.size() - h.offset - h.size < kTrailerSize)
    corrupt(path, str("a block at byte ", h.offset, " (", h.size, " bytes) runs past the end (",
                      file.size(), " bytes)"));
  const char* data = file.data() + h.offset;
  const char type = data[h.size];
  const uint32_t stored = fixed32(data + h.size + 1);
  const uint32_t actual = mask_crc(crc32c_extend(crc32c(data, h.size), &type, 1));
  if (stored != actual) corrupt(path, str("the block at byte ", h.offset, " fails its CRC32C"));
  if (type != 0)
    fail(path, ": the block at byte ", h.offset, " is compressed (type ", int(type),
         "); TensorFlow writes checkpoint indexes uncompressed and bertrain reads only those");
  return {data, h.size};
}

// Calls f(key, value) for each entry of a block, in order (keys are prefix-compressed against
// the previous entry).
template <class F>
void for_each_entry(std::string_view block, const std::string& path, F&& f) {
  if (block.size() < 4) corrupt(path, "a block shorter than its restart count");
  const uint32_t restarts = fixed32(block.data() + block.size() - 4);
  if (restarts > (block.size() - 4) / 4) corrupt(path, "a block's restart count is too large");
  const char* p = block.data();
  const char* end = block.data() + block.size() - 4 - 4 * static_cast<size_t>(restarts);
  std::string key;
  while (p < end) {
    uint64_t shared, unshared, value_len;
    if (!varint(p, end, shared) || !varint(p, end, unshared) || !varint(p, end, value_len) ||
        shared > key.size() || unshared > static_cast<uint64_t>(end - p) ||
        value_len > static_cast<uint64_t>(end - p) - unshared)
      corrupt(path, "a malformed block entry");
    key.resize(shared);
    key.append(p, unshared);
    p += unshared;
    f(key, std::string_view(p, value_len));
    p += value_len;
  }
}

size_t dtype_bytes(int dtype) {
  switch (dtype) {
    case tensorflow::DT_FLOAT:
    case tensorflow::DT_INT32:
      return 4;
    case tensorflow::DT_DOUBLE:
    case tensorflow::DT_INT64:
      return 8;
    case tensorflow::DT_BFLOAT16:
    case tensorflow::DT_HALF:
      return 2;
    default:
      return 0;
  }
}

}  // namespace

bool tf_dtype_is_float(int dtype) {
  return dtype == tensorflow::DT_FLOAT || dtype == tensorflow::DT_DOUBLE ||
         dtype == tensorflow::DT_BFLOAT16 || dtype == tensorflow::DT_HALF;
}

std::string tf_dtype_name(int dtype) {
  switch (dtype) {
    case tensorflow::DT_FLOAT:
      return "float32";
    case tensorflow::DT_DOUBLE:
      return "float64";
    case tensorflow::DT_INT32:
      return "int32";
    case tensorflow::DT_INT64:
      return "int64";
    case tensorflow::DT_BFLOAT16:
      return "bfloat16";
    case tensorflow::DT_HALF:
      return "float16";
    case tensorflow::DT_STRING:
      return "string";
    case tensorflow::DT_BOOL:
      return "bool";
    default:
      return str("dtype ", dtype);
  }
}

std::string TensorBundle::find_prefix(const std::string& path) {
  if (path.ends_with(".index") && fs::is_regular_file(path)) return path.substr(0, path.size() - 6);
  const size_t data = path.rfind(".data-");
  if (data != std::string::npos && fs::is_regular_file(path.substr(0, data) + ".index"))
    return path.substr(0, data);
  if (fs::is_regular_file(path + ".index")) return path;
  if (!fs::is_directory(path)) return "";
  // TensorFlow's `checkpoint` file names the latest checkpoint of a training directory.
  std::ifstream state(fs::path(path) / "checkpoint");
  std::string line;
  const std::string key = "model_checkpoint_path:";
  while (std::getline(state, line))
    if (line.starts_with(key) && line.find('"') != std::string::npos &&
        line.rfind('"') > line.find('"')) {  // model_checkpoint_path: "model.ckpt-1000"
      const size_t open = line.find('"'), close = line.rfind('"');
      fs::path p = line.substr(open + 1, close - open - 1);
      if (p.is_relative()) p = fs::path(path) / p;
      if (fs::is_regular_file(p.string() + ".index")) return p.string();
    }
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(path))
    if (e.path().extension() == ".index") found.push_back(e.path().string());
  if (found.size() > 1) {
    std::sort(found.begin(), found.end());
    std::string names;
    for (const auto& f : found) names += "\n  " + f;
    fail(path, " holds ", found.size(), " TensorFlow checkpoints; name one by its prefix (the ",
         ".index file without .index):", names);
  }
  return found.empty() ? "" : found[0].substr(0, found[0].size() - 6);
}

TensorBundle::TensorBundle(const std::string& path) : prefix_(find_prefix(path)) {
  if (prefix_.empty())
    fail(path, " is not a TensorFlow checkpoint (no ", path,
         ".index; name the checkpoint by its prefix, e.g. .../bert_model.ckpt)");
  const std::string index = prefix_ + ".index";
  std::ifstream in(index, std::ios::binary);
  if (!in) fail("cannot open ", index);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (file.size() < kFooterSize) corrupt(index, str("only ", file.size(), " bytes"));
  const char* footer = file.data() + file.size() - kFooterSize;
  uint64_t magic;
  std::memcpy(&magic, footer + kFooterSize - 8, 8);
  if (magic != kTableMagic) corrupt(index, "no table magic number at its end");
  const char* p = footer;
  decode_handle(p, footer + 40, index);  // the meta-index: unused by tensor bundles
  const BlockHandle index_handle = decode_handle(p, footer + 40, index);
  bool header_seen = false;
  for_each_entry(read_block(file, index_handle, index), index,
                 [&](const std::string&, std::string_view handle) {
                   const char* h = handle.data();
                   const BlockHandle data = decode_handle(h, h + handle.size(), index);
                   for_each_entry(
                       read_block(file, data, index), index,
                       [&](const std::string& key, std::string_view value) {
                         if (key.empty()) {
                           tensorflow::BundleHeaderProto header;
                           if (!header.ParseFromArray(value.data(), static_cast<int>(value.size())))
                             corrupt(index, "an unreadable header entry");
                           if (header.endianness() != tensorflow::BundleHeaderProto::LITTLE)
                             fail(index, ": a big-endian checkpoint; bertrain reads little-endian ",
                                  "ones (re-save it on a little-endian machine)");
                           num_shards_ = std::max(1, header.num_shards());
                           header_seen = true;
                           return;
                         }
                         tensorflow::BundleEntryProto e;
                         if (!e.ParseFromArray(value.data(), static_cast<int>(value.size())))
                           corrupt(index, str("an unreadable entry for '", key, "'"));
                         BundleVariable v;
                         v.name = key;
                         v.dtype = e.dtype();
                         for (const auto& d : e.shape().dim()) v.shape.push_back(d.size());
                         v.shard = e.shard_id();
                         v.offset = e.offset();
                         v.size = e.size();
                         v.masked_crc = e.crc32c();
                         v.sliced = e.slices_size() > 0;
                         vars_.push_back(std::move(v));
                       });
                 });
  if (!header_seen) corrupt(index, "no bundle header entry");
}

const BundleVariable* TensorBundle::find(const std::string& name) const {
  auto it =
      std::lower_bound(vars_.begin(), vars_.end(), name,
                       [](const BundleVariable& v, const std::string& n) { return v.name < n; });
  return it != vars_.end() && it->name == name ? &*it : nullptr;
}

std::string TensorBundle::data_file(int shard) const {
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, ".data-%05d-of-%05d", shard, num_shards_);
  return prefix_ + suffix;
}

std::string TensorBundle::read_bytes(const BundleVariable& v) const {
  if (v.sliced)
    fail(prefix_, ": variable ", v.name, " is partitioned into slices, which bertrain does not ",
         "read; save the checkpoint without partitioned variables");
  const size_t elem = dtype_bytes(v.dtype);
  if (!elem)
    fail(prefix_, ": variable ", v.name, " is ", tf_dtype_name(v.dtype),
         "; only float and integer tensors can be read");
  if (v.shard < 0 || v.shard >= num_shards_)
    fail(prefix_, ".index: variable ", v.name, " names data file ", v.shard, " of ", num_shards_);
  // The shape's element count, checked (a damaged entry may hold any numbers).
  uint64_t numel = 1;
  for (int64_t d : v.shape) {
    if (d < 0 || (d > 0 && numel > (uint64_t{1} << 56) / static_cast<uint64_t>(d)))
      fail(prefix_, ".index: variable ", v.name, " has an impossible shape ", shape_str(v.shape));
    numel *= static_cast<uint64_t>(d);
  }
  if (v.size < 0 || static_cast<uint64_t>(v.size) != numel * elem)
    fail(prefix_, ".index: variable ", v.name, " has ", v.size, " bytes for shape ",
         shape_str(v.shape), " of ", tf_dtype_name(v.dtype));
  const std::string file = data_file(v.shard);
  std::error_code ec;
  const uint64_t file_bytes = fs::file_size(file, ec);
  if (!ec && (v.offset < 0 || static_cast<uint64_t>(v.offset) > file_bytes ||
              static_cast<uint64_t>(v.size) > file_bytes - static_cast<uint64_t>(v.offset)))
    fail(file, " ends before the bytes of ", v.name, " (", v.size, " bytes at offset ", v.offset,
         "; the file has ", file_bytes,
         "): the data file is truncated; copy it again from its "
         "source");
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("cannot open ", file, " (data of ", v.name, "): the checkpoint is incomplete");
  std::string bytes(static_cast<size_t>(v.size), '\0');
  in.seekg(v.offset);
  in.read(bytes.data(), v.size);
  if (in.gcount() != v.size)
    fail(file, " ends before the bytes of ", v.name, " (", v.size, " bytes at offset ", v.offset,
         "): the data file is truncated; copy it again from its source");
  if (masked_crc32c(bytes.data(), bytes.size()) != v.masked_crc)
    fail(file, ": the bytes of ", v.name, " fail their CRC32C check (offset ", v.offset,
         "): the data file is corrupt; copy it again from its source");
  return bytes;
}

std::vector<float> TensorBundle::read_f32(const BundleVariable& v) const {
  const std::string b = read_bytes(v);
  const size_t n = static_cast<size_t>(shape_numel(v.shape));
  std::vector<float> out(n);
  const auto* u16 = reinterpret_cast<const uint16_t*>(b.data());
  switch (v.dtype) {
    case tensorflow::DT_FLOAT:
      std::memcpy(out.data(), b.data(), 4 * n);
      break;
    case tensorflow::DT_DOUBLE:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, b.data() + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case tensorflow::DT_BFLOAT16:
      convert_bf16_to_f32(u16, out.data(), n);
      break;
    case tensorflow::DT_HALF:
      convert_f16_to_f32(u16, out.data(), n);
      break;
    default:
      fail(prefix_, ": variable ", v.name, " is ", tf_dtype_name(v.dtype), ", not a float tensor");
  }
  return out;
}

std::vector<int64_t> TensorBundle::read_i64(const BundleVariable& v) const {
  const std::string b = read_bytes(v);
  const size_t n = static_cast<size_t>(shape_numel(v.shape));
  std::vector<int64_t> out(n);
  if (v.dtype == tensorflow::DT_INT64) {
    std::memcpy(out.data(), b.data(), 8 * n);
  } else if (v.dtype == tensorflow::DT_INT32) {
    for (size_t i = 0; i < n; ++i) {
      int32_t x;
      std::memcpy(&x, b.data() + 4 * i, 4);
      out[i] = x;
    }
  } else {
    fail(prefix_, ": variable ", v.name, " is ", tf_dtype_name(v.dtype), ", not an integer tensor");
  }
  return out;
}

}  // namespace bertrain::data
