// Tensor: a non-owning view (pointer, dtype, shape) into memory that an arena or a flat
// buffer owns. Row-major and contiguous; views never allocate or free.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace bertrain {

using Shape = std::vector<int64_t>;

inline int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s);  // "[2, 3, 4]"

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  Shape shape;

  Tensor() = default;
  Tensor(void* p, DType t, Shape s) : data(p), dtype(t), shape(std::move(s)) {}

  int64_t numel() const { return shape_numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape.at(i < 0 ? shape.size() + i : i); }
  int ndim() const { return static_cast<int>(shape.size()); }

  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  float* f32() const {
    BT_CHECK(dtype == DType::F32, "tensor is ", dtype_name(dtype), ", expected F32");
    return static_cast<float*>(data);
  }
};

}  // namespace bertrain
