// TensorFlow checkpoints as TF1 and TF2 write them (the "tensor bundle"): PREFIX.index, a
// LevelDB-format table (sorted keys, prefix-compressed blocks, each with its masked CRC32C)
// mapping variable names to BundleEntryProto (dtype, shape, data file, offset, size, masked
// CRC32C of the bytes), the empty key holding the BundleHeaderProto; and PREFIX.data-NNNNN-of-
// MMMMM holding the raw little-endian tensor bytes. The reader checks every block's and every
// tensor's CRC and names the file, the variable and the fix when one is wrong.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace bertrain::data {

struct BundleVariable {
  std::string name;
  int dtype = 0;  // tensorflow.DataType: 1 float, 2 double, 3 int32, 9 int64, 14 bfloat16, 19 half
  Shape shape;
  int shard = 0;
  int64_t offset = 0, size = 0;
  uint32_t masked_crc = 0;
  bool sliced = false;  // a partitioned variable (its slices are entries of their own)
};

// TensorFlow's spelling of a DataType ("float32", "int64", ...; "dtype N" for the rest).
std::string tf_dtype_name(int dtype);
// float, double, bfloat16 or half: what read_f32 reads.
bool tf_dtype_is_float(int dtype);

class TensorBundle {
 public:
  // `path`: the checkpoint prefix (".../bert_model.ckpt"), its .index file, or a directory
  // holding exactly one *.index (or a TensorFlow `checkpoint` file naming the latest).
  explicit TensorBundle(const std::string& path);

  const std::string& prefix() const { return prefix_; }
  int num_shards() const { return num_shards_; }
  // In the index's (sorted) order.
  const std::vector<BundleVariable>& variables() const { return vars_; }
  const BundleVariable* find(const std::string& name) const;
  // The values of a float, double, bfloat16 or half variable as fp32 (CRC checked).
  std::vector<float> read_f32(const BundleVariable& v) const;
  // The values of an int32 or int64 variable (e.g. global_step).
  std::vector<int64_t> read_i64(const BundleVariable& v) const;

  // The prefix of the checkpoint `path` names, or "" when it names none (no .index).
  static std::string find_prefix(const std::string& path);

 private:
  std::string read_bytes(const BundleVariable& v) const;
  std::string data_file(int shard) const;

  std::string prefix_;
  int num_shards_ = 1;
  std::vector<BundleVariable> vars_;
};

}  // namespace bertrain::data
