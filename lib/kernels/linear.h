// Linear layers on packed weights: y = x·Wᵀ + b with hand-written CPU kernels
// chosen at run time (AVX512-BF16, AVX-512F, AVX2+FMA, SSE2, portable C++), or
// ATen's at::linear. The model packs each projection once at load (q/k/v and
// gate/up fused into one matrix each) and calls it every forward pass.
//
// Results are batch invariant by construction: each output is one fp32
// accumulator over k in a fixed order, so a row's values do not depend on
// how many rows are computed with it (kernels/gemm_impl.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dmi::kernels {

// In order: a CPU that runs one runs those before it. sse2 (every x86-64
// CPU) and avx (Sandy and Ivy Bridge) multiply, then add: the kernels of
// CPUs without AVX2 and FMA, which agree with each other bit for bit and
// round differently from scalar, avx2 and avx512 (gemm_impl.h), which agree
// bit for bit.
enum class Isa { aten, scalar, sse2, avx, avx2, avx512, avx512_bf16 };

const char* isa_name(Isa isa);
// "aten", "scalar", "sse2", "avx", "avx2", "avx512", "avx512_bf16"; throws dmi::Error otherwise.
Isa parse_isa(const std::string& name);
// The best kernels this CPU (and OS) supports: sse2 at least on x86-64.
Isa detect_isa();
// What runs by default: detect_isa(), except that Intel CPUs with
// AVX512-BF16 run the avx512 kernels (bf16 widened, fp32 FMA), faster there.
Isa default_isa();
// default_isa(), or $DMI_KERNELS when that names a choice this CPU supports
// (aten selects at::linear); an unknown or unsupported value is an error.
Isa selected_isa();
// One line for logs and benchmark reports: "avx512_bf16 (vdpbf16ps), 2 threads".
std::string describe(Isa isa, at::ScalarType dtype);

// The compute ceiling of the projections: multiply-adds per second that the
// instruction of `isa`'s kernels for `dtype` sustains when it does nothing
// else, on all of LibTorch's threads at once (vdpbf16ps: 32 per instruction;
// the fp32 FMA: 16 with AVX-512, 8 with AVX2, also where bf16 weights are
// widened first; SSE2: a multiply and an add, 4). Best of three runs of
// about 20 ms. A kernel also loads and broadcasts, so it can only come
// close. 0 for aten and scalar, whose instructions are the compiler's
// choice. dmi-bench's compute floor.
struct PeakRate {
  double macs_per_second = 0;
  std::string instruction;  // "vdpbf16ps", "FMA zmm", "FMA ymm", "mulps+addps"; empty when unknown
};
PeakRate measure_peak_macs_per_second(Isa isa, at::ScalarType dtype);

class PackedLinear {
 public:
  PackedLinear() = default;
  // The weights [N_i, K] are stacked along N (one matrix for fused
  // projections); biases are each empty or [N_i]. dtype: kFloat or kBFloat16.
  PackedLinear(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& biases, at::ScalarType dtype,
               Isa isa);
  // x [..., K] of the packed dtype -> [..., N].
  at::Tensor operator()(const at::Tensor& x) const;
  // The same product with a lower ISA on the same packing (tests).
  at::Tensor run(const at::Tensor& x, Isa isa) const;
  // Inside kernels::hold_threads() (kernels/pool.h): held thread 1 reads the
  // first panels of these weights (~768 KiB) into its cache while the caller
  // goes on, until the next parallel operation; this projection's next call
  // then gives that thread those panels first. Memory idles while the small
  // operations between two projections of a decode step run on one thread.
  // Elsewhere nothing. Changes no result: only which thread computes a panel.
  void prefetch() const;

  std::int64_t in_features() const { return k_; }
  std::int64_t out_features() const { return n_; }
  Isa isa() const { return isa_; }
  bool defined() const { return n_ > 0; }

 private:
  Isa isa_ = Isa::aten;
  at::ScalarType dtype_{};
  std::int64_t k_ = 0, kp_ = 0, n_ = 0;
  at::Tensor packed_;  // panels (gemm_impl.h), or the plain [N, K] weight for aten
  at::Tensor bias_;    // [N] float32 (packed) or dtype (aten); undefined when there is none
};

}  // namespace dmi::kernels
