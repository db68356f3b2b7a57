#include "kernels/cpu/scratch.h"

#include <atomic>
#include <vector>

namespace bertrain::kernels {
namespace {

struct Binding {
  std::byte* base = nullptr;
  ScratchLayout layout;
};
// The region in use. Written by the model's thread between kernel calls, read by the kernels on
// any thread of its OpenMP team; a second binding while kernels run elsewhere is not supported
// (one model computes at a time in a process).
Binding g_binding;
std::atomic<int64_t> g_unplanned{0};

}  // namespace

void bind_scratch(std::byte* region, const ScratchLayout& layout) {
  g_binding.base = region;
  g_binding.layout = layout;
}

namespace {
// Unplanned scratch: this thread's buffer for a part (index kParts: the caller part), grown to
// the largest need and kept.
std::byte* own_buffer(int i, int64_t bytes) {
  thread_local std::vector<std::byte> own[ScratchLayout::kParts + 1];
  std::vector<std::byte>& v = own[i];
  if (v.size() < static_cast<size_t>(bytes)) {
    g_unplanned += bytes - static_cast<int64_t>(v.size());
    v.resize(static_cast<size_t>(bytes));
  }
  return v.data();
}
}  // namespace

ScratchBlock scratch_block(ScratchPart part, int64_t bytes, int threads) {
  const Binding& b = g_binding;
  const int i = static_cast<int>(part);
  if (b.base && threads <= b.layout.threads && bytes <= b.layout.part[i])
    return {b.base + ScratchLayout::rounded(b.layout.caller) + b.layout.offset(i),
            b.layout.stride()};
  const int64_t stride = ScratchLayout::rounded(bytes);
  return {own_buffer(i, stride * threads), stride};
}

std::byte* caller_scratch(int64_t bytes) {
  const Binding& b = g_binding;
  if (b.base && bytes <= b.layout.caller) return b.base;
  return own_buffer(ScratchLayout::kParts, bytes);
}

int64_t unplanned_scratch_bytes() {
  return g_unplanned.load();
}

}  // namespace bertrain::kernels
