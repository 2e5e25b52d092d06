#include "kernels/linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "kernels/gemm_impl.h"
#include "kernels/memory.h"
#include "kernels/pool.h"

namespace dmi::kernels {

using detail::GemmArgs;
using detail::kPanel;

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::aten: return "aten";
    case Isa::scalar: return "scalar";
    case Isa::sse2: return "sse2";
    case Isa::avx: return "avx";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  for (Isa i : {Isa::aten, Isa::scalar, Isa::sse2, Isa::avx, Isa::avx2, Isa::avx512, Isa::avx512_bf16})
    if (name == isa_name(i)) return i;
  DMI_FAIL("kernels '{}': expected one of aten, scalar, sse2, avx, avx2, avx512, avx512_bf16", name);
}

Isa detect_isa() {
  static const Isa best = [] {  // once: PackedLinear::run checks it on every call
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16")) return Isa::avx512_bf16;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return Isa::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
    // Sandy and Ivy Bridge: a 256-bit multiply and add (gemm_avx.cpp).
    if (__builtin_cpu_supports("avx")) return Isa::avx;
    // Every x86-64 CPU: without FMA, the portable kernels' fmaf is a libm
    // call per multiply-add (gemm_sse2.cpp).
    if (__builtin_cpu_supports("sse2")) return Isa::sse2;
    return Isa::scalar;
  }();
  return best;
}

Isa default_isa() {
  const Isa best = detect_isa();
  // Intel's vdpbf16ps does half the multiply-adds per cycle of its fp32 FMA
  // (Xeon family 6 model 207, AVX512-BF16 without AMX exposed: 1.3 G
  // vdpbf16ps/s = 83 GFLOP/s per core against 5.3 G FMA/s = 171), so the
  // widening FMA kernels are faster there once compute counts: batch 8 and
  // prefill (docs/benchmarks.md, 2026-12-02 Intel). AMD's Zen 4 issues
  // vdpbf16ps as fast as its FMA (3.6 G/s each per core on one host, 6.2 G/s
  // vdpbf16ps on another), twice the multiply-adds: the fastest choice
  // there. Decided by the vendor, never by a timing, so the same machine
  // always computes the same bits.
  if (best == Isa::avx512_bf16 && __builtin_cpu_is("intel")) return Isa::avx512;
  return best;
}

Isa selected_isa() {
  const Isa best = detect_isa();
  const char* env = std::getenv("DMI_KERNELS");
  if (!env || !*env) return default_isa();
  const Isa want = parse_isa(env);
  DMI_CHECK(want == Isa::aten || static_cast<int>(want) <= static_cast<int>(best),
            "DMI_KERNELS={}: this CPU supports up to {}", env, isa_name(best));
  return want;
}

std::string describe(Isa isa, at::ScalarType dtype) {
  const char* how = "";
  switch (isa) {
    case Isa::aten: how = "at::linear"; break;
    case Isa::scalar: how = "portable C++"; break;
    case Isa::sse2:
    case Isa::avx:
      how = dtype == at::kBFloat16 ? "bf16 widened in registers, multiply then add" : "multiply then add";
      break;
    case Isa::avx2: how = dtype == at::kBFloat16 ? "bf16 widened in registers, FMA" : "FMA"; break;
    case Isa::avx512: how = dtype == at::kBFloat16 ? "bf16 widened in registers, FMA" : "FMA"; break;
    case Isa::avx512_bf16: how = dtype == at::kBFloat16 ? "vdpbf16ps" : "FMA"; break;
  }
  return fmt::format("{} ({}), {} threads", isa_name(isa), how, at::get_num_threads());
}

PeakRate measure_peak_macs_per_second(Isa isa, at::ScalarType dtype) {
  DMI_CHECK(isa == Isa::aten || static_cast<int>(isa) <= static_cast<int>(detect_isa()),
            "peak rate: this CPU cannot run the {} kernels", isa_name(isa));
  PeakRate rate;
  std::int64_t (*loop)(std::int64_t) = nullptr;
  if (isa == Isa::avx512_bf16 && dtype == at::kBFloat16) {
    loop = detail::peak_macs_avx512bf16, rate.instruction = "vdpbf16ps";
  } else if (isa == Isa::avx512_bf16 || isa == Isa::avx512) {
    loop = detail::peak_macs_avx512, rate.instruction = "FMA zmm";
  } else if (isa == Isa::avx2) {
    loop = detail::peak_macs_avx2, rate.instruction = "FMA ymm";
  } else if (isa == Isa::avx) {
    loop = detail::peak_macs_avx, rate.instruction = "vmulps+vaddps ymm";
  } else if (isa == Isa::sse2) {
    loop = detail::peak_macs_sse2, rate.instruction = "mulps+addps";
  } else {
    return rate;
  }
  // Every thread of the pool runs the loop at once, as the projections do:
  // two threads on one core's SMT siblings share its units.
  const std::int64_t threads = at::get_num_threads();
  auto run = [&](std::int64_t iterations) {  // multiply-adds per second
    std::atomic<std::int64_t> macs{0};
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, threads, 1, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t t = begin; t < end; ++t) macs += loop(iterations);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return std::make_pair(static_cast<double>(macs.load()) / s, s);
  };
  std::int64_t iterations = 1 << 14;
  while (iterations < (std::int64_t{1} << 30) && run(iterations).second < 0.02) iterations *= 2;
  for (int i = 0; i < 3; ++i) rate.macs_per_second = std::max(rate.macs_per_second, run(iterations).first);
  return rate;
}

namespace {

// What held thread 1 read ahead (PackedLinear::prefetch): the first
// `panels` panels of the packed weights at `w`. One per holding thread.
struct ReadAhead {
  const void* w = nullptr;
  std::atomic<std::int64_t> panels{0};
};
ReadAhead& read_ahead() {
  thread_local ReadAhead r;
  return r;
}

// The panels of w that held thread 1 has in its cache, once its task is
// stopped; 0 when it read another matrix or nothing.
std::int64_t take_ahead(const void* w) {
  ReadAhead& r = read_ahead();
  if (r.w != w) return 0;
  wait_background();
  r.w = nullptr;
  return r.panels.load(std::memory_order_relaxed);
}

}  // namespace

PackedLinear::PackedLinear(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& biases,
                           at::ScalarType dtype, Isa isa)
    : isa_(isa), dtype_(dtype) {
  DMI_CHECK(!weights.empty() && weights.size() == biases.size(), "PackedLinear: one bias (or none) per weight");
  DMI_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "PackedLinear: dtype must be float32 or bfloat16");
  k_ = weights[0].size(1);
  std::vector<at::Tensor> b;
  bool any_bias = false;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    DMI_CHECK(weights[i].dim() == 2 && weights[i].size(1) == k_, "PackedLinear: weights must be [N, {}]", k_);
    n_ += weights[i].size(0);
    any_bias = any_bias || biases[i].defined();
  }
  at::Tensor w = weights.size() == 1 ? weights[0].to(dtype) : at::cat(weights, 0).to(dtype);
  if (any_bias) {
    for (std::size_t i = 0; i < weights.size(); ++i)
      b.push_back(biases[i].defined() ? biases[i].to(at::kFloat) : at::zeros({weights[i].size(0)}, at::kFloat));
    bias_ = at::cat(b, 0);
  }
  if (isa == Isa::aten) {
    packed_ = w.contiguous();
    if (bias_.defined()) bias_ = bias_.to(dtype);
    kp_ = k_;
    return;
  }
  // Packed weights live on huge pages (kernels/memory.h): a decode step
  // streams all of them. Packed on the heap, the q/k/v, o and down
  // projections of the Qwen3-0.6B shape (8, 4 and 6 MiB per layer) had no
  // huge pages and streamed at ~18 GB/s against ~40 for gate/up (12 MiB).
  const std::int64_t panels = (n_ + kPanel - 1) / kPanel;
  if (dtype == at::kBFloat16) {
    // [Np, Kp] -> [P, 64, Kp/2, 2] -> [P, Kp/2, 64, 2]
    kp_ = k_ + (k_ % 2);
    w = at::constant_pad_nd(w, {0, kp_ - k_, 0, panels * kPanel - n_});
    packed_ = huge_page_copy(w.view({panels, kPanel, kp_ / 2, 2}).permute({0, 2, 1, 3}));
  } else {
    // [Np, K] -> [P, 64, K] -> [P, K, 64]
    kp_ = k_;
    w = at::constant_pad_nd(w, {0, 0, 0, panels * kPanel - n_});
    packed_ = huge_page_copy(w.view({panels, kPanel, k_}).permute({0, 2, 1}));
  }
}

at::Tensor PackedLinear::operator()(const at::Tensor& x) const { return run(x, isa_); }

void PackedLinear::prefetch() const {
  if (isa_ == Isa::aten || !defined() || !holding_threads()) return;
  // About what one core's L2 holds (1 MiB on Zen 4 and 5, 1-2 MiB on recent
  // Xeons), in whole panels; at least one.
  constexpr std::int64_t kAheadBytes = 768 << 10;
  const std::int64_t panels = (n_ + kPanel - 1) / kPanel;
  const std::int64_t lines = kp_ * kPanel * packed_.element_size() / 64;  // per panel
  const std::int64_t limit = std::clamp<std::int64_t>(kAheadBytes / (lines * 64), 1, panels);
  const char* w = static_cast<const char*>(packed_.data_ptr());
  ReadAhead& r = read_ahead();
  wait_background();  // a previous task may still write r.panels
  r.w = w;
  r.panels.store(0, std::memory_order_relaxed);
  std::atomic<std::int64_t>* done = &r.panels;
  in_background([w, lines, limit, done](const std::atomic<bool>& stop) {
    for (std::int64_t p = 0; p < limit; ++p) {
      for (std::int64_t l = 0; l < lines; l += 64) {
        if (stop.load(std::memory_order_relaxed)) return;
        // Loads, not prefetch instructions: the thread has nothing else to
        // do, a load waits for its line where a prefetch beyond the core's
        // outstanding misses may be dropped, and on a Zen 3 EPYC batch-1
        // steps with prefetch instructions here took 1.01-1.02x as long
        // (3 of 3 alternating rounds; docs/benchmarks.md).
        const char* c = w + (p * lines + l) * 64;
        std::uint64_t sink = 0;
        for (std::int64_t i = 0; i < 64 && l + i < lines; ++i)
          sink ^= *reinterpret_cast<const volatile std::uint64_t*>(c + 64 * i);
        __asm__ volatile("" : : "r"(sink));  // the loads' result is used
      }
      done->store(p + 1, std::memory_order_relaxed);
    }
  });
}

at::Tensor PackedLinear::run(const at::Tensor& x, Isa isa) const {
  DMI_CHECK(defined(), "PackedLinear used before it was built");
  DMI_CHECK(x.size(-1) == k_, "linear: input has {} features, the weight {}", x.size(-1), k_);
  DMI_CHECK(x.scalar_type() == dtype_, "linear: input is {}, the weight {}", c10::toString(x.scalar_type()),
            c10::toString(dtype_));
  if (isa_ == Isa::aten) return at::linear(x, packed_, bias_);
  DMI_CHECK(isa != Isa::aten, "linear: weights were packed for the dmi kernels, not at::linear");
  DMI_CHECK(static_cast<int>(isa) <= static_cast<int>(detect_isa()), "linear: this CPU cannot run the {} kernels",
            isa_name(isa));
  std::vector<std::int64_t> sizes = x.sizes().vec();
  sizes.back() = n_;
  const std::int64_t M = x.numel() / k_;
  at::Tensor y = at::empty({M, n_}, x.options());
  if (M == 0) return y.view(sizes);

  const bool bf16 = dtype_ == at::kBFloat16;
  const bool dot = bf16 && isa == Isa::avx512_bf16;
  at::Tensor xin = x.reshape({M, k_});
  if (!dot) xin = xin.to(at::kFloat);
  if (kp_ != k_) xin = at::constant_pad_nd(xin, {0, kp_ - k_});
  xin = xin.contiguous();

  void (*fn)(const GemmArgs&) = nullptr;
  switch (isa) {
    case Isa::avx512_bf16: fn = bf16 ? detail::gemm_bf16w_avx512bf16 : detail::gemm_f32w_avx512; break;
    case Isa::avx512: fn = bf16 ? detail::gemm_bf16w_avx512 : detail::gemm_f32w_avx512; break;
    case Isa::avx2: fn = bf16 ? detail::gemm_bf16w_avx2 : detail::gemm_f32w_avx2; break;
    case Isa::avx: fn = bf16 ? detail::gemm_bf16w_avx : detail::gemm_f32w_avx; break;
    case Isa::sse2: fn = bf16 ? detail::gemm_bf16w_sse2 : detail::gemm_f32w_sse2; break;
    default: fn = bf16 ? detail::gemm_bf16w_scalar : detail::gemm_f32w_scalar; break;
  }
  GemmArgs a;
  a.x = xin.data_ptr();
  a.x_stride = kp_;
  a.w = packed_.data_ptr();
  a.bias = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
  a.y = y.data_ptr();
  a.y_stride = n_;
  a.y_bf16 = bf16;
  a.M = M;
  a.K = kp_;
  a.N = n_;
  // Threads split the output columns (whole panels): each output is still
  // computed by one thread, in one order. They take chunks of panels from a
  // shared counter rather than fixed halves, so a thread slowed by a busy
  // core does not leave the other waiting at the end (on 2 shared cores the
  // static split spent ~15 % of a decode step in OpenMP's barrier).
  // A thread gets at least kMinWork multiply-adds (~40 us at decode): the
  // projections of a small model ran as fast on one thread, and forking them
  // onto the pool slowed every other process on the same cores
  // (docs/benchmarks.md, "small models on shared cores"). Threads change no
  // bit: they only split the panels.
  constexpr std::int64_t kMinWork = 1 << 18;
  const std::int64_t panels = (n_ + kPanel - 1) / kPanel;
  const std::int64_t threads =
      std::clamp<std::int64_t>(M * n_ * k_ / kMinWork, 1, std::min<std::int64_t>(pool_threads(), panels));
  // Prefill-sized inputs are cut into units of kPrefillRows rows x a quarter
  // (with 2 threads) of the panels, taken in row order from a shared counter:
  // both threads work on the same rows at a time, each x row block stays in
  // cache across a thread's units, and every panel still streams once per
  // row block, as with one contiguous half per thread. A thread slowed by a
  // busy core then takes fewer units instead of holding the other at the end
  // (the fixed halves left one thread waiting for 3.0-4.9 % of the prefill
  // projections' time on a quiet Zen 5; docs/benchmarks.md, 2026-12-04
  // second session). 120 rows are whole tiles of every kernel (1, 2, 4, 6
  // and 8 rows), so only the last unit of x can end in a short tile.
  // Decode-sized chunks are at most 8 panels (1 MiB of a 1024-deep bf16
  // matrix): the LM head's 2374 panels in 16 chunks had left one thread up to
  // ~1 ms behind the other at the end. They shrink towards the end (a share
  // of what is left, down to one panel), so that the threads finish
  // together: the Qwen3-0.6B shape's 113 projections of a decode step left
  // one thread waiting 1.6 ms in all at batch 8 and 1.4 ms at batch 1 with
  // fixed chunks, 1.0 and 0.7 ms so (docs/benchmarks.md, 2026-12-03 fifth
  // session).
  std::atomic<std::int64_t> next{0};
  if (M > detail::kSmallM) {
    constexpr std::int64_t kPrefillRows = 120;
    const std::int64_t chunk = (panels + 2 * threads - 1) / (2 * threads);
    const std::int64_t per_rows = (panels + chunk - 1) / chunk;
    const std::int64_t units = (M + kPrefillRows - 1) / kPrefillRows * per_rows;
    const std::int64_t x_bytes = xin.element_size(), y_bytes = y.element_size();
    parallel(static_cast<int>(threads), [&](int) {
      GemmArgs part = a;
      for (std::int64_t u = next++; u < units; u = next++) {
        const std::int64_t m0 = u / per_rows * kPrefillRows, c = u % per_rows;
        part.M = std::min(kPrefillRows, M - m0);
        part.x = static_cast<const char*>(a.x) + m0 * a.x_stride * x_bytes;
        part.y = static_cast<char*>(a.y) + m0 * a.y_stride * y_bytes;
        part.panel_begin = c * chunk;
        part.panel_end = std::min(panels, part.panel_begin + chunk);
        fn(part);
      }
    });
    return y.view(sizes);
  }
  // One or two rows take two panels per tile (gemm_impl.h, kWideMR), so
  // their chunks are at least two panels: with single-panel chunks the
  // 16-panel o and down projections of the Qwen3-0.6B shape, a third of
  // the weights, had run one-panel tiles only.
  const std::int64_t least = M <= detail::kWideMR ? 2 : 1;
  const std::int64_t chunk = std::clamp<std::int64_t>(panels / (8 * threads), least, 8);
  // Panels that held thread 1 read ahead (prefetch()) are its first chunk.
  const std::int64_t head = threads > 1 ? std::min(take_ahead(packed_.data_ptr()), panels) : 0;
  next.store(head, std::memory_order_relaxed);
  parallel(static_cast<int>(threads), [&](int t) {
    GemmArgs part = a;
    if (t == 1 && head > 0) {
      part.panel_begin = 0;
      part.panel_end = head;
      fn(part);
    }
    std::int64_t begin = next.load(std::memory_order_relaxed), size = 0;
    for (;;) {
      do {
        size = std::clamp<std::int64_t>((panels - begin) / (2 * threads), least, chunk);
      } while (begin < panels && !next.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed));
      if (begin >= panels) break;
      part.panel_begin = begin;
      part.panel_end = std::min(panels, begin + size);
      fn(part);
      begin = next.load(std::memory_order_relaxed);
    }
  });
  return y.view(sizes);
}

}  // namespace dmi::kernels
