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

// ATen's CPU allocator, wrapped so that blocks of kLargeBlock bytes or more
// are reused instead of mapped and unmapped per tensor. glibc serves them
// with mmap whatever its threshold (32 MiB is the most it can be set to),
// so a long prefill's intermediates (a batch-8, 1024-token prefill's
// gate/up output is 96 MiB in bf16) page-faulted and zeroed every page of
// every layer again: ~1.06 M 4 KiB faults per run. With this cache that
// prefill runs 1.40-1.44x as fast, an fp32 256 x 8 one 1.72x
// (docs/benchmarks.md, 2026-12-06).
//
// A freed large block stays mapped, advised for huge pages, for the next
// allocation it fits (the smallest such, at most twice the request); the
// most recently freed blocks up to kKeptLargeBytes are kept, older ones
// unmapped. Smaller blocks, and blocks over kKeptLargeBytes, go to the
// allocator that was installed before, unchanged. Reused memory holds
// stale bytes, as malloc's does: ATen never promises zeros. Installing is
// idempotent and process-wide; tensors allocated before keep their own
// deleters.
void install_large_block_cache();
constexpr std::size_t kLargeBlock = std::size_t{32} << 20;
constexpr std::size_t kKeptLargeBytes = std::size_t{512} << 20;

struct LargeBlockStats {
  std::size_t mapped = 0;       // allocations served by a fresh mapping
  std::size_t reused = 0;       // allocations served by a kept block
  std::size_t kept_blocks = 0;  // freed blocks held now
  std::size_t kept_bytes = 0;
};
LargeBlockStats large_block_stats();

// Unmaps the blocks the cache keeps; returns their bytes.
std::size_t release_kept_large_blocks();

}  // namespace dmi::kernels
