// MemoryPlan and Arena: "one memory plan" (DESIGN.md). A plan is a list of named regions with
// sizes; an Arena reserves the plan's total once (64-byte aligned regions) and hands out views.
// `bertrain estimate` prints the same plan the trainer allocates from, so estimate = allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace bertrain {

inline constexpr size_t kAlign = 64;
inline size_t align_up(size_t n, size_t a = kAlign) {
  return (n + a - 1) / a * a;
}

struct PlanRegion {
  std::string name;
  std::string group;  // "parameters", "gradients", "optimizer", "activations", "scratch", ...
  size_t bytes = 0;
  size_t offset = 0;  // within the arena of its group, assigned by MemoryPlan::add
  // Byte ranges of the region, from the group's base and page-aligned, that are address space
  // only: their pages are never touched (an access faults), so they never become resident (the
  // fp32 master weights another rank holds; BertModel's ModelDims::master_shard).
  std::vector<std::pair<size_t, size_t>> holes;
  size_t hole_bytes() const;
  size_t resident_bytes() const { return bytes - hole_bytes(); }
};

class MemoryPlan {
 public:
  // Adds a region and returns its index. Regions of one group are laid out back to back.
  size_t add(const std::string& group, const std::string& name, size_t bytes);
  const std::vector<PlanRegion>& regions() const { return regions_; }
  const PlanRegion& region(const std::string& name) const;  // fails if absent
  // Leaves the page-aligned byte ranges (from the group's base) of region `index` unbacked.
  void set_holes(size_t index, std::vector<std::pair<size_t, size_t>> holes);
  // Resident bytes: the group's span less its holes (what memory it costs).
  size_t group_bytes(const std::string& group) const;
  size_t group_span(const std::string& group) const;  // the address space it reserves
  size_t total_bytes() const;                         // resident, all groups
  std::vector<std::string> groups() const;            // in the order first added

 private:
  std::vector<PlanRegion> regions_;
};

// Owns one 64-byte aligned, zero-initialised allocation for one group of a plan. A group with
// holes is mapped from the kernel (page-aligned, zero pages on first touch) with its holes made
// inaccessible (PROT_NONE), so a stray read of memory that is not there faults instead of
// returning zeros.
inline constexpr size_t kPage = 4096;

class Arena {
 public:
  Arena() = default;
  Arena(const MemoryPlan& plan, const std::string& group);
  // The group placed in memory owned elsewhere (at least group_bytes, 64-byte aligned), e.g.
  // a communicator's shared-memory window; the Arena does not free it.
  Arena(const MemoryPlan& plan, const std::string& group, std::byte* external);
  Arena(Arena&&) = default;
  Arena& operator=(Arena&&) = default;

  std::byte* base() const { return data_.get(); }
  size_t bytes() const { return bytes_; }  // resident (holes excluded)
  // A view of a named region as a tensor; the shape must fit the region.
  Tensor view(const std::string& name, DType t, Shape shape) const;
  float* f32(const std::string& name) const;

 private:
  struct Free {
    bool external;  // value-initialised: false
    size_t mapped;  // > 0: bytes mapped with mmap (a group with holes)
    void operator()(std::byte* p) const;
  };
  const MemoryPlan* plan_ = nullptr;
  std::unique_ptr<std::byte, Free> data_;
  size_t bytes_ = 0;
};

std::string human_bytes(double bytes);  // "12.3 MiB"

}  // namespace bertrain
