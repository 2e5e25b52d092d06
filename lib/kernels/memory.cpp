#include "kernels/memory.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
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

// Freed mappings kept for reuse, oldest first: at most max_count of them
// and max_bytes in all; what falls out is unmapped. Instances are never
// destroyed: a tensor freed during static destruction still finds its pool.
class KeptMappings {
 public:
  KeptMappings(std::size_t max_count, std::size_t max_bytes) : max_count_(max_count), max_bytes_(max_bytes) {}

  // The smallest kept mapping that holds `bytes` and has at most
  // `max_usable`, taken out of the pool.
  bool take(std::size_t bytes, std::size_t max_usable, Mapping& out) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it)
      if (it->usable >= bytes && it->usable <= max_usable && (best == kept_.end() || it->usable < best->usable))
        best = it;
    if (best == kept_.end()) return false;
    out = *best;
    bytes_ -= best->usable;
    kept_.erase(best);
    return true;
  }

  void put(const Mapping& m) {
    std::vector<Mapping> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept_.push_back(m);
      bytes_ += m.usable;
      std::size_t drop = 0;
      while (kept_.size() - drop > max_count_ || bytes_ > max_bytes_) {
        bytes_ -= kept_[drop].usable;
        evicted.push_back(kept_[drop++]);
      }
      kept_.erase(kept_.begin(), kept_.begin() + static_cast<std::ptrdiff_t>(drop));
    }
    for (const Mapping& e : evicted) ::munmap(e.base, e.mapped);
  }

  // Unmaps every kept mapping; returns their usable bytes.
  std::size_t release() {
    std::vector<Mapping> kept;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept.swap(kept_);
      bytes_ = 0;
    }
    std::size_t bytes = 0;
    for (const Mapping& m : kept) {
      bytes += m.usable;
      ::munmap(m.base, m.mapped);
    }
    return bytes;
  }

  std::pair<std::size_t, std::size_t> count_and_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {kept_.size(), bytes_};
  }

 private:
  const std::size_t max_count_, max_bytes_;
  std::mutex mutex_;
  std::vector<Mapping> kept_;
  std::size_t bytes_ = 0;
};

constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();

// The KV-cache blocks recycled_huge_page_zeros() keeps.
KeptMappings& kept_caches() {
  static KeptMappings* k = new KeptMappings(kKeptMappings, kNoLimit);
  return *k;
}

// ---- the large-block cache behind ATen's CPU allocator -------------------

// The blocks handed out (by Mapping::p), counters, and the allocator
// underneath. Never destroyed, as the pools.
struct LargeBlocks {
  std::mutex mutex;
  std::unordered_map<void*, Mapping> live;
  LargeBlockStats stats;  // mapped and reused; the kept counts are the pool's
  KeptMappings kept{kNoLimit, kKeptLargeBytes};
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
  Mapping m;  // m.p stays null for a pointer that is not a live block
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    const auto it = b.live.find(p);
    if (it != b.live.end()) {
      m = it->second;
      b.live.erase(it);
    }
  }
  if (m.p) b.kept.put(m);  // m.usable <= kKeptLargeBytes (allocate_block)
  else b.fallback_raw_deleter(p);
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
    const bool reused = b.kept.take(n, 2 * n, m);
    if (!reused && !map_huge(n, m)) return b.fallback->allocate(n);
    {
      std::lock_guard<std::mutex> lock(b.mutex);
      ++(reused ? b.stats.reused : b.stats.mapped);
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
  LargeBlockStats s;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    s = b.stats;
  }
  std::tie(s.kept_blocks, s.kept_bytes) = b.kept.count_and_bytes();
  return s;
}

std::size_t release_kept_large_blocks() { return large_blocks().kept.release(); }

at::Tensor huge_page_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  Mapping m;
  if (!map_huge(bytes_of(sizes, dtype), m)) return at::zeros(sizes, at::TensorOptions().dtype(dtype));
  return at::from_blob(
      m.p, sizes, [m](void*) { ::munmap(m.base, m.mapped); }, at::TensorOptions().dtype(dtype));
}

at::Tensor recycled_huge_page_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  const std::size_t bytes = bytes_of(sizes, dtype);
  Mapping m;
  if (kept_caches().take(bytes, kNoLimit, m)) {
    std::memset(m.p, 0, bytes);
  } else if (!map_huge(bytes, m)) {
    return at::zeros(sizes, at::TensorOptions().dtype(dtype));
  }
  return at::from_blob(
      m.p, sizes, [m](void*) { kept_caches().put(m); }, at::TensorOptions().dtype(dtype));
}

std::size_t release_kept_huge_pages() { return kept_caches().release(); }

at::Tensor huge_page_copy(const at::Tensor& src) {
  at::Tensor dst = huge_page_zeros(src.sizes(), src.scalar_type());
  dst.copy_(src);
  return dst;
}

}  // namespace dmi::kernels
