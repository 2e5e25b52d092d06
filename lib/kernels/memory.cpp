#include "kernels/memory.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace dmi::kernels {
namespace {

constexpr std::size_t kHuge = 2u << 20;

// One anonymous mapping: [base, base + mapped), of which [p, p + usable) is
// 2 MiB-aligned and advised for huge pages.
struct Mapping {
  void* base = nullptr;
  std::size_t mapped = 0;
  char* p = nullptr;
  std::size_t usable = 0;
};

std::size_t bytes_of(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  std::size_t bytes = c10::elementSize(dtype);
  for (const std::int64_t s : sizes) bytes *= static_cast<std::size_t>(s);
  return bytes;
}

bool map_huge(std::size_t bytes, Mapping& m) {
  m.usable = (bytes + kHuge - 1) / kHuge * kHuge;
  m.mapped = m.usable + kHuge;  // room to align the start
  m.base = ::mmap(nullptr, m.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m.base == MAP_FAILED) return false;
  m.p = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(m.base) + kHuge - 1) / kHuge * kHuge);
  ::madvise(m.p, m.usable, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
  return true;
}

// The mappings recycled_huge_page_zeros() keeps, oldest first. Never
// destroyed: a tensor freed during static destruction still finds it.
struct Kept {
  std::mutex mutex;
  std::vector<Mapping> mappings;
};
Kept& kept() {
  static Kept* k = new Kept;
  return *k;
}

void keep(const Mapping& m) {
  Mapping evicted;
  {
    Kept& k = kept();
    std::lock_guard<std::mutex> lock(k.mutex);
    k.mappings.push_back(m);
    if (k.mappings.size() <= kKeptMappings) return;
    evicted = k.mappings.front();
    k.mappings.erase(k.mappings.begin());
  }
  ::munmap(evicted.base, evicted.mapped);
}

// The smallest kept mapping that holds `bytes`, taken out of the pool.
bool take_kept(std::size_t bytes, Mapping& out) {
  Kept& k = kept();
  std::lock_guard<std::mutex> lock(k.mutex);
  auto best = k.mappings.end();
  for (auto it = k.mappings.begin(); it != k.mappings.end(); ++it)
    if (it->usable >= bytes && (best == k.mappings.end() || it->usable < best->usable)) best = it;
  if (best == k.mappings.end()) return false;
  out = *best;
  k.mappings.erase(best);
  return true;
}

// ---- the large-block cache behind ATen's CPU allocator -------------------

// Everything here lives until the process ends: a tensor freed during static
// destruction still finds its block.
struct LargeBlocks {
  std::mutex mutex;
  std::unordered_map<void*, Mapping> live;  // by Mapping::p
  std::vector<Mapping> kept;                // oldest first
  std::size_t kept_bytes = 0;
  LargeBlockStats stats;
  c10::Allocator* fallback = nullptr;  // the allocator installed before
  c10::DeleterFnPtr fallback_raw_deleter = nullptr;
};
LargeBlocks& large_blocks() {
  static LargeBlocks* b = new LargeBlocks;
  return *b;
}

// The deleter of every large block, and the raw deleter of the wrapped
// allocator: a pointer that is not a live large block came from the
// fallback's raw interface.
void free_block(void* p) {
  LargeBlocks& b = large_blocks();
  std::vector<Mapping> evicted;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    const auto it = b.live.find(p);
    if (it != b.live.end()) {
      const Mapping m = it->second;  // m.usable <= kKeptLargeBytes (allocate_block)
      b.live.erase(it);
      b.kept.push_back(m);
      b.kept_bytes += m.usable;
      std::size_t drop = 0;
      while (b.kept_bytes > kKeptLargeBytes) {
        b.kept_bytes -= b.kept[drop].usable;
        evicted.push_back(b.kept[drop++]);
      }
      b.kept.erase(b.kept.begin(), b.kept.begin() + static_cast<std::ptrdiff_t>(drop));
      p = nullptr;
    }
  }
  for (const Mapping& m : evicted) ::munmap(m.base, m.mapped);
  if (p) b.fallback_raw_deleter(p);
}

class LargeBlockAllocator final : public c10::Allocator {
 public:
  // LibTorch 2.3 made allocate() non-const and added copy_data(); both
  // forms are defined, and no member says `override` (clang warns when
  // some do and others cannot), so that this compiles against 1.13 and
  // 2.x alike.
  c10::DataPtr allocate(std::size_t n) const { return allocate_block(n); }
  c10::DataPtr allocate(std::size_t n) { return allocate_block(n); }
  c10::DeleterFnPtr raw_deleter() const {
    return large_blocks().fallback_raw_deleter ? &free_block : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count) std::memcpy(dest, src, count);
  }

 private:
  static c10::DataPtr allocate_block(std::size_t n) {
    LargeBlocks& b = large_blocks();
    // A block the cache could not keep is not taken either: a one-off
    // temporary of that size (a converted copy of a large embedding)
    // would only be mapped on huge pages to be unmapped again.
    if (n < kLargeBlock || n > kKeptLargeBytes) return b.fallback->allocate(n);
    Mapping m;
    bool found = false;
    {
      std::lock_guard<std::mutex> lock(b.mutex);
      auto best = b.kept.end();
      for (auto it = b.kept.begin(); it != b.kept.end(); ++it)
        if (it->usable >= n && it->usable / 2 <= n && (best == b.kept.end() || it->usable < best->usable)) best = it;
      if (best != b.kept.end()) {
        m = *best;
        b.kept_bytes -= m.usable;
        b.kept.erase(best);
        found = true;
        ++b.stats.reused;
      }
    }
    if (!found && !map_huge(n, m)) return b.fallback->allocate(n);
    {
      std::lock_guard<std::mutex> lock(b.mutex);
      if (!found) ++b.stats.mapped;
      b.live.emplace(m.p, m);
    }
    return {m.p, m.p, &free_block, c10::Device(c10::DeviceType::CPU)};
  }
};

}  // namespace

void install_large_block_cache() {
  static const bool installed = [] {
    LargeBlocks& b = large_blocks();
    b.fallback = c10::GetCPUAllocator();
    b.fallback_raw_deleter = b.fallback->raw_deleter();
    static LargeBlockAllocator* allocator = new LargeBlockAllocator;
    c10::SetCPUAllocator(allocator, /*priority=*/1);
    return true;
  }();
  (void)installed;
}

LargeBlockStats large_block_stats() {
  LargeBlocks& b = large_blocks();
  std::lock_guard<std::mutex> lock(b.mutex);
  LargeBlockStats s = b.stats;
  s.kept_blocks = b.kept.size();
  s.kept_bytes = b.kept_bytes;
  return s;
}

std::size_t release_kept_large_blocks() {
  LargeBlocks& b = large_blocks();
  std::vector<Mapping> kept;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    kept.swap(b.kept);
    b.kept_bytes = 0;
  }
  std::size_t bytes = 0;
  for (const Mapping& m : kept) {
    bytes += m.usable;
    ::munmap(m.base, m.mapped);
  }
  return bytes;
}

at::Tensor huge_page_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  Mapping m;
  if (!map_huge(bytes_of(sizes, dtype), m)) return at::zeros(sizes, at::TensorOptions().dtype(dtype));
  return at::from_blob(
      m.p, sizes, [m](void*) { ::munmap(m.base, m.mapped); }, at::TensorOptions().dtype(dtype));
}

at::Tensor recycled_huge_page_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  const std::size_t bytes = bytes_of(sizes, dtype);
  Mapping m;
  if (take_kept(bytes, m)) {
    std::memset(m.p, 0, bytes);
  } else if (!map_huge(bytes, m)) {
    return at::zeros(sizes, at::TensorOptions().dtype(dtype));
  }
  return at::from_blob(
      m.p, sizes, [m](void*) { keep(m); }, at::TensorOptions().dtype(dtype));
}

std::size_t release_kept_huge_pages() {
  std::vector<Mapping> mappings;
  {
    Kept& k = kept();
    std::lock_guard<std::mutex> lock(k.mutex);
    mappings.swap(k.mappings);
  }
  std::size_t bytes = 0;
  for (const Mapping& m : mappings) {
    bytes += m.usable;
    ::munmap(m.base, m.mapped);
  }
  return bytes;
}

at::Tensor huge_page_copy(const at::Tensor& src) {
  at::Tensor dst = huge_page_zeros(src.sizes(), src.scalar_type());
  dst.copy_(src);
  return dst;
}

}  // namespace dmi::kernels
