#include "kernels/memory.h"

#include <ATen/ATen.h>

#include <sys/mman.h>

#include <cstdint>

namespace dmi::kernels {

at::Tensor huge_page_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  constexpr std::size_t kHuge = 2u << 20;
  std::size_t bytes = c10::elementSize(dtype);
  for (const std::int64_t s : sizes) bytes *= static_cast<std::size_t>(s);
  const std::size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  const std::size_t mapped = rounded + kHuge;  // room to align the start
  void* m = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return at::zeros(sizes, at::TensorOptions().dtype(dtype));
  char* base = static_cast<char*>(m);
  char* p = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(base) + kHuge - 1) / kHuge * kHuge);
  ::madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
  return at::from_blob(
      p, sizes, [base, mapped](void*) { ::munmap(base, mapped); }, at::TensorOptions().dtype(dtype));
}

at::Tensor huge_page_copy(const at::Tensor& src) {
  at::Tensor dst = huge_page_zeros(src.sizes(), src.scalar_type());
  dst.copy_(src);
  return dst;
}

}  // namespace dmi::kernels
