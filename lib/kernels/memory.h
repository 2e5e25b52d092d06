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

#include <cstddef>

namespace dmi::kernels {

// A zero-filled contiguous tensor of `sizes` in a fresh anonymous mapping
// advised for huge pages, unmapped when its storage goes; pages are faulted
// in (zeroed by the OS) on first touch. Falls back to at::zeros if mmap fails.
at::Tensor huge_page_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype);

// The same, for buffers made again and again (the KV cache of every
// generate call, replay and patching run): when the tensor's storage goes,
// its mapping, pages still faulted in, is kept for the next call that fits
// in it, which zeroes it with memset. A fresh mapping's first touch costs a
// page fault and the OS's zeroing per page, several times a memset on a
// virtual machine: a batch-8, 256-token prefill spent 3-4 % of its samples
// in the kernel's clear_page on a Zen 5 EPYC VM (docs/benchmarks.md,
// 2026-12-05 fourth session). At most kKeptMappings mappings are kept (the
// most recently freed), holding their memory until reused or
// release_kept_huge_pages().
at::Tensor recycled_huge_page_zeros(c10::IntArrayRef sizes, c10::ScalarType dtype);
constexpr std::size_t kKeptMappings = 2;

// Unmaps the mappings recycled_huge_page_zeros() keeps; returns their bytes.
std::size_t release_kept_huge_pages();

// A contiguous copy of src in such memory.
at::Tensor huge_page_copy(const at::Tensor& src);

}  // namespace dmi::kernels
