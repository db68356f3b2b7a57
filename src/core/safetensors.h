// safetensors files (HuggingFace's format): u64 little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the raw tensor bytes.
// Reading validates every offset against the file and converts F32/F16/BF16/F64 to fp32 on
// request; writing is atomic (temp file, fsync, rename) so a crash never leaves half a file.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace bertrain {

struct SafeTensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  size_t begin = 0, end = 0;  // byte offsets within the data section
};

class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafeTensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafeTensorInfo* find(const std::string& name) const;
  const void* data(const SafeTensorInfo& t) const { return data_ + t.begin; }
  // Converts the tensor to fp32 into out[numel].
  void read_f32(const SafeTensorInfo& t, float* out) const;
  std::vector<float> read_f32(const std::string& name) const;  // fails if absent
  std::vector<double> read_f64(const std::string& name) const;
  std::vector<int64_t> read_i64(const std::string& name) const;

 private:
  void unmap();
  std::string path_;
  const unsigned char* map_ = nullptr;
  size_t map_size_ = 0;
  const unsigned char* data_ = nullptr;
  std::vector<SafeTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

struct SafeTensorOut {
  std::string name;
  DType dtype;  // storage dtype in the file
  Shape shape;
  const float* f32 = nullptr;  // source data in fp32, converted to dtype when written
  const void* raw = nullptr;   // or raw bytes already in dtype
  // or fp32 data written into a buffer of numel floats when the tensor's turn comes (data
  // assembled from several places, one tensor in memory at a time)
  std::function<void(float*)> fill = {};
};

// Writes atomically: path.tmp.<pid>, fsync, rename, fsync of the directory. On failure (disk
// full, permissions) the temp file is removed, any previous file at `path` is untouched, and an
// Error names the path and the cause.
void write_safetensors(const std::string& path, const std::vector<SafeTensorOut>& tensors,
                       const std::map<std::string, std::string>& metadata);

// Writes bytes to path atomically with the same guarantees (used for config.json and state).
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace bertrain
