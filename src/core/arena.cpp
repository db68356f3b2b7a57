#include "core/arena.h"
#include "core/setting.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace bertrain {

size_t MemoryPlan::add(const std::string& group, const std::string& name, size_t bytes) {
  for (const auto& r : regions_) BT_CHECK(r.name != name, "duplicate plan region ", name);
  size_t offset = 0;
  for (const auto& r : regions_)
    if (r.group == group) offset = std::max(offset, r.offset + align_up(r.bytes));
  regions_.push_back({name, group, bytes, offset, {}});
  return regions_.size() - 1;
}

const PlanRegion& MemoryPlan::region(const std::string& name) const {
  for (const auto& r : regions_)
    if (r.name == name) return r;
  BT_CHECK(false, "no plan region named ", name);
  std::abort();
}

size_t PlanRegion::hole_bytes() const {
  size_t n = 0;
  for (const auto& [b, e] : holes) n += e - b;
  return n;
}

void MemoryPlan::set_holes(size_t index, std::vector<std::pair<size_t, size_t>> holes) {
  BT_CHECK(index < regions_.size(), "no plan region ", index);
  PlanRegion& r = regions_[index];
  for (const auto& [b, e] : holes)
    BT_CHECK(b % kPage == 0 && e % kPage == 0 && b < e && b >= r.offset && e <= r.offset + r.bytes,
             "hole [", b, ", ", e, ") of ", r.name, " is not whole pages inside it");
  r.holes = std::move(holes);
}

size_t MemoryPlan::group_span(const std::string& group) const {
  size_t end = 0;
  for (const auto& r : regions_)
    if (r.group == group) end = std::max(end, r.offset + align_up(r.bytes));
  return end;
}

size_t MemoryPlan::group_bytes(const std::string& group) const {
  size_t holes = 0;
  for (const auto& r : regions_)
    if (r.group == group) holes += r.hole_bytes();
  return group_span(group) - holes;
}

size_t MemoryPlan::total_bytes() const {
  size_t total = 0;
  for (const auto& g : groups()) total += group_bytes(g);
  return total;
}

std::vector<std::string> MemoryPlan::groups() const {
  std::vector<std::string> out;
  for (const auto& r : regions_) {
    bool seen = false;
    for (const auto& g : out) seen |= (g == r.group);
    if (!seen) out.push_back(r.group);
  }
  return out;
}

void Arena::Free::operator()(std::byte* p) const {
  if (mapped > 0)
    ::munmap(p, mapped);
  else if (!external)
    std::free(p);
}

Arena::Arena(const MemoryPlan& plan, const std::string& group, std::byte* external)
    : plan_(&plan), data_(external, Free{true, 0}), bytes_(plan.group_bytes(group)) {
  BT_CHECK(reinterpret_cast<uintptr_t>(external) % kAlign == 0, "external memory for ", group,
           " is not ", kAlign, "-byte aligned");
}

Arena::Arena(const MemoryPlan& plan, const std::string& group)
    : plan_(&plan), bytes_(plan.group_bytes(group)) {
  const size_t n = std::max<size_t>(plan.group_span(group), kAlign);
  auto out_of_memory = [&] {
    fail("out of memory: could not reserve ", human_bytes(static_cast<double>(n)), " for ", group,
         "; lower ", setting("batch_size"), " or ", setting("seq_len"),
         " (bertrain estimate shows the plan)");
  };
  if (bytes_ < plan.group_span(group)) {
    const size_t mapped = align_up(n, kPage);
    void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) out_of_memory();
    data_ = std::unique_ptr<std::byte, Free>(static_cast<std::byte*>(p), Free{false, mapped});
    for (const auto& r : plan.regions())
      if (r.group == group)
        for (const auto& [b, e] : r.holes)
          if (::mprotect(data_.get() + b, e - b, PROT_NONE) != 0)
            fail("cannot unmap the unbacked part of ", r.name, ": ", std::strerror(errno));
    return;
  }
  void* p = std::aligned_alloc(kAlign, align_up(n));
  if (!p) out_of_memory();
  std::memset(p, 0, align_up(n));
  data_.reset(static_cast<std::byte*>(p));
}

Tensor Arena::view(const std::string& name, DType t, Shape shape) const {
  const PlanRegion& r = plan_->region(name);
  size_t need = static_cast<size_t>(shape_numel(shape)) * dtype_size(t);
  BT_CHECK(need <= r.bytes, "view ", name, shape_str(shape), " needs ", need, " bytes, region has ",
           r.bytes);
  return Tensor(data_.get() + r.offset, t, std::move(shape));
}

float* Arena::f32(const std::string& name) const {
  return reinterpret_cast<float*>(data_.get() + plan_->region(name).offset);
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

}  // namespace bertrain
