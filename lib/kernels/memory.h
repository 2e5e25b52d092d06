// Memory that a decode step streams through: on transparent huge pages.
//
// A decode step reads every packed weight and the whole KV cache once. With
// 4 KiB pages each page costs a TLB miss whose page walk stalls the loads and
// prefetches behind it; on 2 MiB pages a walk covers 512 times as much. Linux
// gives an anonymous mapping huge pages when it is 2 MiB-aligned and advised
// MADV_HUGEPAGE (the mode Debian ships: "madvise"); heap memory is neither
// (glibc keeps freed heap pages mapped, and pages faulted in as 4 KiB stay
// so after madvise). Where the kernel refuses, the memory is the same, on
// small pages.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

namespace dmi::kernels {

// A zero-filled contiguous tensor of `sizes` in a fresh anonymous mapping
// advised for huge pages, unmapped when its storage goes; pages are faulted
// in (zeroed by the OS) on first touch. Falls back to at::zeros if mmap fails.
at::Tensor huge_page_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype);

// A contiguous copy of src in such memory.
at::Tensor huge_page_copy(const at::Tensor& src);

}  // namespace dmi::kernels
