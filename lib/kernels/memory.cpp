#include "kernels/memory.h"

#include <ATen/ATen.h>

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <mutex>
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

}  // namespace

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
