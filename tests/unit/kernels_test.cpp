// The linear kernels (lib/kernels) against a float64 reference, against each
// other, and against themselves at other batch sizes (bitwise).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "engine/runtime.h"
#include "kernels/linear.h"
#include "kernels/memory.h"
#include "kernels/pool.h"

using dmi::kernels::Isa;
using dmi::kernels::PackedLinear;

namespace {

std::vector<Isa> supported() {
  std::vector<Isa> out;
  for (Isa i : {Isa::scalar, Isa::sse2, Isa::avx, Isa::avx2, Isa::avx512, Isa::avx512_bf16})
    if (static_cast<int>(i) <= static_cast<int>(dmi::kernels::detect_isa())) out.push_back(i);
  return out;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

// Kernels whose bits are their own: vdpbf16ps (bf16 weights) and SSE2's and AVX's multiply-then-add.
bool own_bits(Isa isa, at::ScalarType dtype) {
  return isa == Isa::sse2 || isa == Isa::avx || (isa == Isa::avx512_bf16 && dtype == at::kBFloat16);
}

struct Shape {
  std::int64_t n, k;
  bool bias;
};
const std::vector<Shape> kShapes = {{1, 1, false}, {3, 5, true}, {64, 64, false}, {100, 37, true}, {130, 256, false},
                                    {200, 130, true}};

}  // namespace

TEST_CASE("kernels: every ISA matches a float64 reference, fp32 and bf16, odd shapes, bias") {
  at::manual_seed(1);
  for (auto dtype : {at::kFloat, at::kBFloat16})
    for (const auto& s : kShapes) {
      at::Tensor w = at::randn({s.n, s.k}).to(dtype), b = s.bias ? at::randn({s.n}).to(dtype) : at::Tensor();
      at::Tensor x = at::randn({7, s.k}).to(dtype);
      at::Tensor ref = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
      if (s.bias) ref = ref + b.to(at::kDouble);
      // fp32 accumulation error bound, plus the output's rounding for bf16.
      at::Tensor scale = at::matmul(x.to(at::kDouble).abs(), w.to(at::kDouble).abs().t()) + 1;
      const double out_rel = dtype == at::kBFloat16 ? 1.0 / 256 : 0;
      PackedLinear lin({w}, {b}, dtype, Isa::scalar);
      for (Isa isa : supported()) {
        CAPTURE(dmi::kernels::isa_name(isa));
        CAPTURE(s.n);
        CAPTURE(s.k);
        at::Tensor y = lin.run(x, isa).to(at::kDouble);
        REQUIRE(y.sizes() == ref.sizes());
        at::Tensor excess = (y - ref).abs() - (ref.abs() * out_rel + scale * 1e-6);
        CHECK(excess.max().item<double>() <= 0);
      }
    }
}

TEST_CASE("kernels: scalar, AVX2 and AVX-512 agree bit for bit") {
  at::manual_seed(2);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor w = at::randn({200, 130}).to(dtype);
    PackedLinear lin({w}, {at::Tensor()}, dtype, Isa::scalar);
    // 5 rows: one whole-depth tile; 8 and 9: one whole-depth tile with more accumulators than registers
    // (AVX-512; 9 in k blocks on the widening kernel); 12: decode-sized k blocks; 300: row blocks of whole tiles
    // and a short one. AVX2: 1 row one whole-depth pass; 2 to 32 rows 4-row tiles of 16-column strips in k
    // blocks (13: 4 + 4 + 4 + 1, the last without prefetches); 300: 5-row (bf16) or 6-row (fp32) tiles.
    for (std::int64_t m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 300}) {
      const at::Tensor x = at::randn({m, 130}).to(dtype);
      const at::Tensor ref = lin.run(x, Isa::scalar);
      for (Isa isa : supported()) {
        if (own_bits(isa, dtype)) continue;
        CAPTURE(dmi::kernels::isa_name(isa));
        CAPTURE(m);
        CHECK(same_bits(lin.run(x, isa), ref));
      }
    }
  }
}

TEST_CASE("kernels: SSE2 and AVX round each product, then each sum, over k in order: an ATen op per step, bit for bit") {
  // The reference: y = ((0 + x[:, 0] w[:, 0]) + x[:, 1] w[:, 1]) + ..., every multiply and add an ATen
  // elementwise op on fp32 (bf16 weights and inputs widened exactly), then the bias in fp32, then the
  // output's dtype (round to nearest even). The same rows as the bitwise test above: one-row passes,
  // 4-row decode tiles in k blocks with a short last tile, 5-row (AVX fp32: 6-row) prefill tiles in row
  // blocks. AVX where the CPU has it (tests/e2e/older_cpus_test.py runs this under qemu's Ivy Bridge).
  at::manual_seed(7);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor w = at::randn({200, 130}).to(dtype), b = at::randn({200}).to(dtype);
    const PackedLinear lin({w}, {b}, dtype, Isa::scalar);
    const at::Tensor wf = w.to(at::kFloat);
    for (std::int64_t m : {1, 2, 3, 4, 5, 8, 13, 300}) {
      const at::Tensor x = at::randn({m, 130}).to(dtype), xf = x.to(at::kFloat);
      at::Tensor acc = at::zeros({m, 200});
      for (std::int64_t k = 0; k < 130; ++k) acc = at::add(acc, at::mul(xf.narrow(1, k, 1), wf.narrow(1, k, 1).t()));
      const at::Tensor want = at::add(acc, b.to(at::kFloat)).to(dtype);
      CAPTURE(std::string(c10::toString(dtype)));
      CAPTURE(m);
      for (Isa isa : supported()) {
        if (isa != Isa::sse2 && isa != Isa::avx) continue;
        CAPTURE(dmi::kernels::isa_name(isa));
        const at::Tensor got = lin.run(x, isa);
        CHECK(same_bits(got, want));
        // The FMA kernels' fp32 bits differ (in bf16 outputs the difference rarely survives the rounding).
        if (dtype == at::kFloat && m == 8) CHECK(!same_bits(got, lin.run(x, Isa::scalar)));
      }
    }
  }
}

TEST_CASE("kernels: a row's result does not depend on the batch (sizes 1, 2, 3, 8, 17, 250, 300), bitwise") {
  at::manual_seed(3);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor w = at::randn({150, 96}).to(dtype), b = at::randn({150}).to(dtype);
    at::Tensor x = at::randn({300, 96}).to(dtype);
    PackedLinear lin({w}, {b}, dtype, Isa::scalar);
    for (Isa isa : supported()) {
      CAPTURE(dmi::kernels::isa_name(isa));
      CAPTURE(c10::toString(dtype));
      const at::Tensor all = lin.run(x, isa);
      // 250 and 300 rows: prefill units of 120 rows, the last one 10 (a one-tile batch) or 60 rows.
      for (std::int64_t m : {1, 2, 3, 8, 17, 250, 300}) {
        CAPTURE(m);
        // Rows [m, 2m) alone in a batch of m, or the last rows when 2m > 300.
        const std::int64_t first = std::min<std::int64_t>(m, 300 - m);
        CHECK(same_bits(lin.run(x.narrow(0, first, m), isa), all.narrow(0, first, m)));
      }
      for (std::int64_t r : {0, 5, 127, 128, 299}) CHECK(same_bits(lin.run(x.narrow(0, r, 1), isa), all.narrow(0, r, 1)));
    }
  }
}

TEST_CASE("kernels: one and two rows, two panels per tile, have the bits of one-panel tiles and of scalar") {
  // 17 panels (the last 2 columns wide) on one thread: chunks of 2 panels and a last single one, so both the
  // two-panel tiles of 1 and 2 rows (AVX-512) and the one-panel tile run.
  at::manual_seed(6);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor w = at::randn({1026, 130}).to(dtype), b = at::randn({1026}).to(dtype);
    PackedLinear lin({w}, {b}, dtype, Isa::scalar);
    const at::Tensor x = at::randn({5, 130}).to(dtype);
    const at::Tensor ref = lin.run(x, Isa::scalar);
    for (Isa isa : supported()) {
      CAPTURE(dmi::kernels::isa_name(isa));
      CAPTURE(c10::toString(dtype));
      const at::Tensor five = lin.run(x, isa);  // one 5-row tile per panel
      if (!own_bits(isa, dtype)) CHECK(same_bits(five, ref));
      for (std::int64_t m : {1, 2}) {
        CAPTURE(m);
        for (std::int64_t r = 0; r + m <= 5; r += m)
          CHECK(same_bits(lin.run(x.narrow(0, r, m), isa), five.narrow(0, r, m)));
      }
    }
  }
}

TEST_CASE("kernels: fused projections equal the separate ones; leading dims kept; bad input named") {
  at::manual_seed(4);
  const auto isa = dmi::kernels::detect_isa();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor w1 = at::randn({70, 48}).to(dtype), w2 = at::randn({20, 48}).to(dtype), b2 = at::randn({20}).to(dtype);
    at::Tensor x = at::randn({2, 3, 48}).to(dtype);
    PackedLinear fused({w1, w2}, {at::Tensor(), b2}, dtype, isa);
    PackedLinear one({w1}, {at::Tensor()}, dtype, isa), two({w2}, {b2}, dtype, isa);
    at::Tensor y = fused(x);
    CHECK(y.sizes() == at::IntArrayRef({2, 3, 90}));
    CHECK(same_bits(y.narrow(2, 0, 70), one(x)));
    CHECK(same_bits(y.narrow(2, 70, 20), two(x)));
    CHECK_THROWS_WITH_AS(fused(at::randn({2, 47}).to(dtype)), "linear: input has 47 features, the weight 48",
                         dmi::Error);
  }
  CHECK_THROWS_AS(dmi::kernels::parse_isa("avx9"), dmi::Error);
  CHECK(dmi::kernels::parse_isa("avx2") == Isa::avx2);
}

// Unsets $DMI_KERNELS for a test's scope and puts back what was there.
struct KernelsEnvUnset {
  std::optional<std::string> saved;
  KernelsEnvUnset() {
    if (const char* env = std::getenv("DMI_KERNELS")) saved = env;
    ::unsetenv("DMI_KERNELS");
  }
  ~KernelsEnvUnset() {
    if (saved) ::setenv("DMI_KERNELS", saved->c_str(), 1);
    else ::unsetenv("DMI_KERNELS");
  }
};

TEST_CASE("kernels: Intel CPUs default to the FMA kernels; DMI_KERNELS sets the choice up to the CPU's best") {
  using namespace dmi::kernels;
  std::string vendor;  // read from /proc/cpuinfo, not through the compiler's builtin the library uses
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; vendor.empty() && std::getline(cpuinfo, line);)
    if (line.rfind("vendor_id", 0) == 0) vendor = line.substr(line.find(':') + 2);
  REQUIRE(!vendor.empty());
  const Isa best = detect_isa();
  const Isa want = best == Isa::avx512_bf16 && vendor == "GenuineIntel" ? Isa::avx512 : best;
  CHECK(default_isa() == want);

  const KernelsEnvUnset unset;  // DMI_KERNELS is restored when the test ends, however it ends
  CHECK(selected_isa() == default_isa());
  ::setenv("DMI_KERNELS", isa_name(best), 1);
  CHECK(selected_isa() == best);  // avx512_bf16 stays selectable on Intel
  ::setenv("DMI_KERNELS", "scalar", 1);
  CHECK(selected_isa() == Isa::scalar);
  if (best != Isa::avx512_bf16) {
    ::setenv("DMI_KERNELS", "avx512_bf16", 1);
    CHECK_THROWS_AS(selected_isa(), dmi::Error);
  }
}

TEST_CASE("runtime: OpenMP owns the cores wherever dmi's kernels run the projections, OpenBLAS for ATen's float32") {
  using dmi::engine::MathOwner;
  using dmi::engine::math_owner_for;
  const KernelsEnvUnset unset;  // DMI_KERNELS is restored when the test ends, however it ends
  const std::string hf_dir = "/tmp", torchscript_file = "/proc/self/exe";  // a directory; a regular file
  CHECK(math_owner_for("bfloat16", hf_dir) == MathOwner::openmp);
  CHECK(math_owner_for("bfloat16", torchscript_file) == MathOwner::openmp);
  CHECK(math_owner_for("float32", "") == MathOwner::openmp);  // the embedded model
  CHECK(math_owner_for("float32", hf_dir) == MathOwner::openmp);
  CHECK(math_owner_for("float32", torchscript_file) == MathOwner::openblas);
  ::setenv("DMI_KERNELS", "aten", 1);
  CHECK(math_owner_for("float32", hf_dir) == MathOwner::openblas);
  CHECK(math_owner_for("bfloat16", hf_dir) == MathOwner::openmp);
  ::setenv("DMI_KERNELS", "avx2", 1);
  CHECK(math_owner_for("float32", hf_dir) == MathOwner::openmp);
}

TEST_CASE("kernels: aten (at::linear) stays available for comparison") {
  at::manual_seed(5);
  at::Tensor w = at::randn({33, 20}), b = at::randn({33}), x = at::randn({4, 20});
  PackedLinear lin({w}, {b}, at::kFloat, Isa::aten);
  CHECK(at::allclose(lin(x), at::linear(x, w, b), 1e-5, 1e-5));
}

TEST_CASE("kernels: the peak multiply-add rate is measured with each kernel's own instruction") {
  using namespace dmi::kernels;
  for (Isa isa : supported())
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      CAPTURE(isa_name(isa));
      CAPTURE(dtype);
      const PeakRate r = measure_peak_macs_per_second(isa, dtype);
      if (isa == Isa::scalar) {
        CHECK(r.macs_per_second == 0);
        CHECK(r.instruction.empty());
        continue;
      }
      CHECK(r.macs_per_second > 0);
      const char* want = isa == Isa::sse2                                           ? "mulps+addps"
                         : isa == Isa::avx                                         ? "vmulps+vaddps ymm"
                         : isa == Isa::avx2                                        ? "FMA ymm"
                         : isa == Isa::avx512_bf16 && dtype == at::kBFloat16 ? "vdpbf16ps"
                                                                                    : "FMA zmm";
      CHECK(r.instruction == want);
    }
  CHECK(measure_peak_macs_per_second(Isa::aten, at::kBFloat16).macs_per_second == 0);
  if (detect_isa() != Isa::avx512_bf16) CHECK_THROWS_AS(measure_peak_macs_per_second(Isa::avx512_bf16, at::kBFloat16), dmi::Error);
}

// ---------------------------------------------------------------------------
// kernels/ops: against the ATen expressions of Hugging Face's eager code.

#include "kernels/ops.h"

namespace {

// |a - b| <= rel |b| + abs, elementwise (float64).
double excess(const at::Tensor& a, const at::Tensor& b, double rel, double abs) {
  at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return ((x - y).abs() - (y.abs() * rel + abs)).max().item<double>();
}

at::Tensor rotate_half(const at::Tensor& x) {
  const std::int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

}  // namespace

TEST_CASE("ops: RMSNorm, RoPE and SwiGLU follow HF's eager expressions") {
  at::manual_seed(6);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    CAPTURE(c10::toString(dtype));
    const double ulp = dtype == at::kBFloat16 ? 1.0 / 128 : 2e-6;
    at::Tensor x = at::randn({3, 5, 96}).to(dtype), w = at::randn({96}).to(dtype);
    at::Tensor h = x.to(at::kFloat);
    at::Tensor want = w * (h * at::rsqrt(h.pow(2).mean(-1, true) + 1e-6)).to(dtype);
    CHECK(excess(dmi::kernels::rms_norm(x, w, 1e-6), want, ulp, 1e-6) <= 0);

    // RoPE: the same roundings in the same places, so the same bits.
    at::Tensor q = at::randn({2, 3, 4, 64}).to(dtype);
    at::Tensor cos = at::randn({2, 3, 1, 64}).to(dtype), sin = at::randn({2, 3, 1, 64}).to(dtype);
    CHECK(at::equal(dmi::kernels::rope(q, cos, sin), q * cos + rotate_half(q) * sin));

    // SwiGLU on halves of one projection (strided views).
    at::Tensor gu = at::randn({2, 3, 80}).to(dtype);
    at::Tensor g = gu.narrow(2, 0, 40), u = gu.narrow(2, 40, 40);
    CHECK(excess(dmi::kernels::silu_mul(g, u), at::silu(g) * u, 2 * ulp, 1e-6) <= 0);
  }
  CHECK_THROWS_AS(dmi::kernels::rms_norm(at::randn({2, 8}), at::randn({7}), 1e-6), dmi::Error);
}

TEST_CASE("ops: views of the fused q/k/v output are read in place with the bits of their contiguous copies") {
  at::manual_seed(11);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    CAPTURE(dtype);
    for (std::int64_t T : {1, 5}) {
      const std::int64_t B = 3, H = 4, KV = 2, D = 16;
      at::Tensor qkv = at::randn({B, T, (H + 2 * KV) * D}).to(dtype);
      at::Tensor q = qkv.narrow(2, 0, H * D).view({B, T, H, D});
      at::Tensor k = qkv.narrow(2, H * D, KV * D).view({B, T, KV, D});
      at::Tensor v = qkv.narrow(2, (H + KV) * D, KV * D).view({B, T, KV, D});
      REQUIRE(!q.is_contiguous());
      at::Tensor w = at::randn({D}).to(dtype), cos = at::randn({B, T, 1, D}).to(dtype), sin = at::randn({B, T, 1, D}).to(dtype);
      for (const at::Tensor& x : {q, k, v}) {
        CHECK(same_bits(dmi::kernels::rms_norm(x, w, 1e-6), dmi::kernels::rms_norm(x.contiguous(), w, 1e-6)));
        CHECK(same_bits(dmi::kernels::rope(x, cos, sin), dmi::kernels::rope(x.contiguous(), cos, sin)));
        CHECK(dmi::kernels::rms_norm(x, w, 1e-6).is_contiguous());
      }
      // Views the loops cannot read in place are copied first: same bits.
      at::Tensor t = q.transpose(1, 2);  // [B, H, T, D]: rows not evenly spaced when T > 1
      CHECK(same_bits(dmi::kernels::rms_norm(t, w, 1e-6), dmi::kernels::rms_norm(t.contiguous(), w, 1e-6)));
      at::Tensor c = at::randn({B, T, 1, D}).to(dtype).expand({B, T, H, D});  // heads stride 0
      CHECK(same_bits(dmi::kernels::rope(c, cos, sin), dmi::kernels::rope(c.contiguous(), cos, sin)));

      // The cache append equals ATen's copy into the same columns; the other
      // columns keep their values.
      const std::int64_t cap = T + 4, start = 2;
      at::Tensor mine = at::randn({B, KV, cap, D}).to(dtype), ref = mine.clone();
      dmi::kernels::write_cache(mine, v, start);
      ref.narrow(2, start, T).copy_(v.transpose(1, 2));
      CHECK(same_bits(mine, ref));
      dmi::kernels::write_cache(mine, k.contiguous(), start);
      ref.narrow(2, start, T).copy_(k.transpose(1, 2));
      CHECK(same_bits(mine, ref));
      CHECK_THROWS_WITH_AS(dmi::kernels::write_cache(mine, v, cap - T + 1), doctest::Contains("outside the cache"),
                           dmi::Error);
      CHECK_THROWS_WITH_AS(dmi::kernels::write_cache(mine, q, 0), doctest::Contains("do not fit"), dmi::Error);
    }
  }
  CHECK_THROWS_WITH_AS(dmi::kernels::rope(at::zeros({2, 3, 4}), at::zeros({2, 3, 1, 4}), at::zeros({2, 3, 1, 4})),
                       doctest::Contains("rope: x [B, T, H, D]"), dmi::Error);
}

TEST_CASE("ops: attention_inputs has the bits of rms_norm, rope and write_cache in turn") {
  at::manual_seed(12);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    CAPTURE(c10::toString(dtype));
    // head_dim 16: the row functions; 128: the AVX-512 pass where the CPU has it.
    for (auto [T, D] : {std::pair<std::int64_t, std::int64_t>{1, 16}, {5, 16}, {1, 128}, {5, 128}}) {
      CAPTURE(T);
      CAPTURE(D);
      const std::int64_t B = 3, H = 4, KV = 2, cap = T + 4, start = 2;
      at::Tensor qkv = at::randn({B, T, (H + 2 * KV) * D}).to(dtype);
      at::Tensor q = qkv.narrow(2, 0, H * D).view({B, T, H, D});
      at::Tensor k = qkv.narrow(2, H * D, KV * D).view({B, T, KV, D});
      at::Tensor v = qkv.narrow(2, (H + KV) * D, KV * D).view({B, T, KV, D});
      at::Tensor qn = at::randn({D}).to(dtype), kn = at::randn({D}).to(dtype);
      at::Tensor cos = at::randn({B, T, 1, D}).to(dtype), sin = at::randn({B, T, 1, D}).to(dtype);
      const at::Tensor k0 = at::randn({B, KV, cap, D}).to(dtype), v0 = at::randn({B, KV, cap, D}).to(dtype);
      for (bool norms : {true, false}) {
        CAPTURE(norms);
        // The separate operations, as the forward pass runs them for HookPoints.
        at::Tensor qs = norms ? dmi::kernels::rms_norm(q, qn, 1e-6) : q;
        at::Tensor ks = norms ? dmi::kernels::rms_norm(k, kn, 1e-6) : k;
        qs = dmi::kernels::rope(qs, cos, sin);
        ks = dmi::kernels::rope(ks, cos, sin);
        at::Tensor k_want = k0.clone(), v_want = v0.clone();
        dmi::kernels::write_cache(k_want, ks, start);
        dmi::kernels::write_cache(v_want, v, start);
        // Views of the fused projection read in place, and contiguous copies.
        for (bool views : {true, false}) {
          CAPTURE(views);
          at::Tensor k_got = k0.clone(), v_got = v0.clone();
          at::Tensor got = dmi::kernels::attention_inputs(
              views ? q : q.contiguous(), views ? k : k.contiguous(), views ? v : v.contiguous(),
              norms ? qn : at::Tensor(), norms ? kn : at::Tensor(), 1e-6, cos, sin, k_got, v_got, start);
          CHECK(got.is_contiguous());
          CHECK(same_bits(got, qs));
          CHECK(same_bits(k_got, k_want));  // columns outside [start, start + T) untouched too
          CHECK(same_bits(v_got, v_want));
        }
      }
      at::Tensor kc = k0.clone(), vc = v0.clone();
      CHECK_THROWS_WITH_AS(dmi::kernels::attention_inputs(q, k, v, qn, at::Tensor(), 1e-6, cos, sin, kc, vc, 0),
                           doctest::Contains("both or neither"), dmi::Error);
      CHECK_THROWS_WITH_AS(dmi::kernels::attention_inputs(q, k, v, qn, kn, 1e-6, cos, sin, kc, vc, cap - T + 1),
                           doctest::Contains("outside the cache"), dmi::Error);
      CHECK_THROWS_WITH_AS(dmi::kernels::attention_inputs(q, q, q, qn, kn, 1e-6, cos, sin, kc, vc, 0),
                           doctest::Contains("caches must be [B, KV, capacity, D]"), dmi::Error);
      CHECK_THROWS_WITH_AS(dmi::kernels::attention_inputs(q, k, v, qn, kn, 1e-6, cos.narrow(1, 0, 1).narrow(0, 0, 1),
                                                          sin, kc, vc, 0),
                           doctest::Contains("cos, sin must be"), dmi::Error);
    }
  }
}

TEST_CASE("ops: the head shapes whose bf16 attention dmi_attention decides") {
  // head_dim a multiple of 32 up to 512 (the blocked kernels' limit), at
  // most 16 query heads per KV head (one block's rows); whatever this CPU has.
  CHECK(dmi::kernels::vdpbf16ps_attention_shape(32, 1));
  CHECK(dmi::kernels::vdpbf16ps_attention_shape(128, 2));
  CHECK(dmi::kernels::vdpbf16ps_attention_shape(512, 16));
  CHECK_FALSE(dmi::kernels::vdpbf16ps_attention_shape(16, 1));
  CHECK_FALSE(dmi::kernels::vdpbf16ps_attention_shape(80, 1));
  CHECK_FALSE(dmi::kernels::vdpbf16ps_attention_shape(544, 1));
  CHECK_FALSE(dmi::kernels::vdpbf16ps_attention_shape(128, 17));
  CHECK_FALSE(dmi::kernels::vdpbf16ps_attention_shape(0, 1));
  // Where this CPU runs it, it runs for exactly those head_dims.
  const bool here = dmi::kernels::attention_arithmetic() == "vdpbf16ps";
  for (std::int64_t D : {16, 32, 48, 64, 96, 128, 256, 512, 544}) {
    CAPTURE(D);
    CHECK(dmi::kernels::bf16_attention_on_vdpbf16ps(D) == (here && dmi::kernels::vdpbf16ps_attention_shape(D, 1)));
  }
}

TEST_CASE("ops: decode attention equals the matmul path and does not depend on the batch") {
  at::manual_seed(7);
  const std::int64_t B = 3, H = 8, KV = 2, G = H / KV, D = 32, cap = 40, L = 29;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    CAPTURE(c10::toString(dtype));
    const double ulp = dtype == at::kBFloat16 ? 1.0 / 128 : 1e-5;
    at::Tensor q = at::randn({B, 1, H, D}).to(dtype);
    at::Tensor keys = at::randn({B, KV, cap, D}).to(dtype), values = at::randn({B, KV, cap, D}).to(dtype);
    at::Tensor masked = at::rand({B, 1, 1, L}) < 0.3;
    masked.select(3, L - 1).fill_(false);  // every query sees its own column
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    at::Tensor s = dmi::kernels::attention_scores(q, keys, L, masked, scale);
    // The same products as float64 matmuls. Not in the dtype: LibTorch
    // 1.13's bf16 matmul on an AVX2-only CPU is itself off from float64 by
    // more than 2 bf16 ulps (a Zen 3 EPYC, 2026-12-06).
    at::Tensor qg = q.to(at::kDouble).view({B, 1, KV, G, D}).permute({0, 2, 3, 1, 4}).reshape({B, KV, G, D});
    at::Tensor want = at::matmul(qg, keys.narrow(2, 0, L).to(at::kDouble).transpose(-1, -2))
                          .mul_(scale)
                          .reshape({B, H, 1, L});
    want.masked_fill_(masked, -std::numeric_limits<double>::infinity());
    CHECK(at::equal(at::isinf(s), at::isinf(want)));
    at::Tensor finite = at::logical_not(at::isinf(want));
    CHECK(excess(s.masked_select(finite), want.masked_select(finite), 2 * ulp, 1e-5) <= 0);

    at::Tensor p = at::softmax(s, -1, at::kFloat).to(dtype);
    at::Tensor z = dmi::kernels::attention_values(p, values, L);
    at::Tensor zwant = at::matmul(p.to(at::kDouble).reshape({B, KV, G, L}), values.narrow(2, 0, L).to(at::kDouble))
                           .reshape({B, KV, G, 1, D}).permute({0, 3, 1, 2, 4}).reshape({B, 1, H, D});
    CHECK(excess(z, zwant, 2 * ulp, 1e-5) <= 0);

    // Sequence 1 alone: the same bits.
    at::Tensor s1 = dmi::kernels::attention_scores(q.narrow(0, 1, 1), keys.narrow(0, 1, 1), L, masked.narrow(0, 1, 1), scale);
    CHECK(at::equal(s1, s.narrow(0, 1, 1)));
    CHECK(at::equal(dmi::kernels::attention_values(p.narrow(0, 1, 1), values.narrow(0, 1, 1), L), z.narrow(0, 1, 1)));
  }
}

namespace {

// The portable attention arithmetic, written out: a score is the dot product
// in 16 fp32 lanes (lane l sums q[l + 16 i] * k[l + 16 i] over i), the lanes
// added pairwise (l + 8, + 4, + 2, + 1), rounded to the dtype, times scale,
// rounded; a value output sums p * v over keys in order, skipping p == 0.
float ref_round(float v, at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? static_cast<float>(c10::BFloat16(v)) : v;
}

// vdpbf16ps on one lane as Intel's pseudocode gives it: the odd product, then
// the even one, each a fused multiply-add with round to nearest even, inputs
// and results below FLT_MIN taken as zero (checked against a Zen 5 EPYC's
// instruction on 3.2 M random operands, denormals among them; the other
// orders tried, even first or the two products summed first, differed).
float flush(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }
float ref_dpbf16(float acc, float a0, float a1, float b0, float b1) {
  acc = flush(std::fma(flush(a1), flush(b1), flush(acc)));
  return flush(std::fma(flush(a0), flush(b0), acc));
}

// dp: the AVX512-BF16 arithmetic instead (bf16 only): lane l of a score takes
// the element pairs (32 i + 2 l, + 1) for i in order by vdpbf16ps, then the
// same tree and roundings; a value output takes the key pairs (c, c + 1), c
// even, in order, a key of weight 0 (or past L) as +0 * +0, a pair of two
// such keys skipped.
at::Tensor ref_scores(const at::Tensor& q, const at::Tensor& keys, std::int64_t L, const at::Tensor& masked,
                      float scale, bool dp = false) {
  const auto dtype = q.scalar_type();
  const std::int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), G = H / keys.size(1);
  at::Tensor qf = q.to(at::kFloat).contiguous(), kf = keys.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, H, T, L}, at::kFloat);
  auto qa = qf.accessor<float, 4>(), ka = kf.accessor<float, 4>();
  auto ma = masked.accessor<bool, 4>();
  auto oa = out.accessor<float, 4>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t c = 0; c < L; ++c) {
          if (ma[b][0][t][c]) {
            oa[b][h][t][c] = -std::numeric_limits<float>::infinity();
            continue;
          }
          float lane[16] = {};
          if (dp) {
            for (std::int64_t d = 0; d < D; d += 2)
              lane[d / 2 % 16] = ref_dpbf16(lane[d / 2 % 16], qa[b][t][h][d], qa[b][t][h][d + 1], ka[b][h / G][c][d],
                                            ka[b][h / G][c][d + 1]);
          } else {
            for (std::int64_t d = 0; d < D; ++d) lane[d % 16] += qa[b][t][h][d] * ka[b][h / G][c][d];
          }
          for (int w = 8; w >= 1; w /= 2)
            for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
          oa[b][h][t][c] = ref_round(ref_round(lane[0], dtype) * scale, dtype);
        }
  return out.to(dtype);
}

at::Tensor ref_values(const at::Tensor& probs, const at::Tensor& values, std::int64_t L, bool dp = false) {
  const auto dtype = probs.scalar_type();
  const std::int64_t B = probs.size(0), H = probs.size(1), T = probs.size(2), D = values.size(3);
  const std::int64_t G = H / values.size(1);
  at::Tensor pf = probs.to(at::kFloat).contiguous(), vf = values.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, T, H, D}, at::kFloat);
  auto pa = pf.accessor<float, 4>(), va = vf.accessor<float, 4>();
  auto oa = out.accessor<float, 4>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t d = 0; d < D; ++d) {
          float acc = 0.0f;
          for (std::int64_t c = 0; c < L && !dp; ++c)
            if (pa[b][h][t][c] != 0.0f) acc += pa[b][h][t][c] * va[b][h / G][c][d];
          for (std::int64_t c = 0; c < L && dp; c += 2) {
            const bool live0 = pa[b][h][t][c] != 0.0f, live1 = c + 1 < L && pa[b][h][t][c + 1] != 0.0f;
            if (!live0 && !live1) continue;
            acc = ref_dpbf16(acc, live0 ? pa[b][h][t][c] : 0.0f, live1 ? pa[b][h][t][c + 1] : 0.0f,
                             live0 ? va[b][h / G][c][d] : 0.0f, live1 ? va[b][h / G][c + 1][d] : 0.0f);
          }
          oa[b][t][h][d] = acc;
        }
  return out.to(dtype);
}

}  // namespace

TEST_CASE("ops: prefill attention (blocks of rows, fused or not) has the written-out arithmetic's bits (portable, or vdpbf16ps's), row by row") {
  at::manual_seed(11);
  // head_dim 48 (three 16-lane chunks) and 128; G = 1, 2, 4, 8; lengths that
  // leave partial key blocks and partial position blocks; causal and padding
  // masks; the cache written from column `start` on. Blocks run as register
  // tiles in groups of 4 rows, then 2 and 1; blocks of up to 4 rows (G = 2
  // at T = 1 or 2, G = 4 and G = 1 when decoding) widen keys in registers,
  // larger ones into scratch (G = 3: blocks of 15 and 6 rows; G = 1 at
  // T = 19: 16 and 3; G = 5: 15 rows; head_dim 16: one chunk). Fused, more
  // rows per KV head than one block (T * G > 16) run in blocks of up to 128
  // rows with transposed keys (G = 4 at T = 37: 128 and 20 rows; G = 3 at
  // T = 33: 126 rows, groups of 4, 2 and 1), each group only as far as its
  // last unmasked key (L = 33: the last key alone in its chunk).
  struct Case { std::int64_t B, T, H, KV, D, start; };
  for (const Case cs : {Case{2, 37, 8, 2, 48, 5}, Case{1, 16, 4, 4, 128, 0}, Case{3, 9, 16, 2, 64, 20},
                        Case{2, 1, 8, 1, 128, 40}, Case{2, 5, 4, 2, 128, 33}, Case{3, 2, 2, 1, 48, 50},
                        Case{2, 1, 16, 8, 128, 90}, Case{2, 7, 6, 2, 48, 3}, Case{1, 19, 2, 2, 64, 0},
                        Case{2, 17, 10, 2, 16, 6}, Case{1, 33, 12, 4, 32, 1}, Case{2, 33, 4, 2, 64, 0}}) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      CAPTURE(cs.T);
      CAPTURE(cs.D);
      CAPTURE(c10::toString(dtype));
      const std::int64_t L = cs.start + cs.T, cap = L + 3;
      at::Tensor q = at::randn({cs.B, cs.T, cs.H, cs.D});
      at::Tensor keys = at::randn({cs.B, cs.KV, cap, cs.D}), values = at::randn({cs.B, cs.KV, cap, cs.D});
      // Sums whose order shows in their rounding: terms of +-256 that cancel
      // exactly, while the terms added between them lose low bits to the
      // accumulator. In every score, element d1's product cancels d2's (the
      // keys' two columns equal, q's opposite); in every output, key c1's
      // value cancels c2's (the keys equal, so their weights are; the values
      // opposite) where a row sees both. With randn alone, bf16 results hid
      // most orders: a lane pairing mixed up still passed.
      const std::int64_t d1 = 1, d2 = cs.D - 3, c1 = 1, c2 = std::min<std::int64_t>(12, L - 1);
      keys.select(3, d2).copy_(keys.select(3, d1));
      q.select(3, d1).copy_(at::sign(at::randn({cs.B, cs.T, cs.H})) * 256);
      q.select(3, d2).copy_(-q.select(3, d1));
      keys.select(2, c2).copy_(keys.select(2, c1));
      values.select(2, c1).copy_(at::sign(at::randn({cs.B, cs.KV, cs.D})) * 256);
      values.select(2, c2).copy_(-values.select(2, c1));
      q = q.to(dtype), keys = keys.to(dtype), values = values.to(dtype);
      // With AVX512-BF16, bf16 attention sums in vdpbf16ps's order instead.
      const bool dp = dtype == at::kBFloat16 && dmi::kernels::bf16_attention_on_vdpbf16ps(cs.D);
      CAPTURE(dp);
      // An infinite value at the last key, which only the last position
      // weighs: every other row must skip it (0 * inf would be NaN).
      values.select(2, L - 1).select(2, 0).fill_(std::numeric_limits<double>::infinity());
      at::Tensor qcol = at::arange(cs.start, L).view({cs.T, 1}), kcol = at::arange(0, L).view({1, L});
      at::Tensor pad = at::arange(0, L).view({1, L}) < at::randint(0, cs.start + 1, {cs.B, 1});  // left padding
      at::Tensor masked = ((kcol > qcol).unsqueeze(0).logical_or(pad.unsqueeze(1)))
                              .logical_and((kcol != qcol).unsqueeze(0)).unsqueeze(1);  // [B, 1, T, L]
      masked.select(0, 0).select(1, cs.T / 2).fill_(true);  // a row with no key (a padding position's): zeros
      const float scale = 1.0f / std::sqrt(static_cast<float>(cs.D));
      at::Tensor s = dmi::kernels::attention_scores(q, keys, L, masked, scale);
      CHECK(at::equal(s, ref_scores(q, keys, L, masked, scale, dp)));
      at::Tensor p = dmi::kernels::softmax(s);
      at::Tensor z = dmi::kernels::attention_values(p, values, L);
      CHECK(at::equal(z, ref_values(p, values, L, dp)));
      // The last position alone (a decode step): the same bits as its prefill row.
      const std::int64_t t = cs.T - 1;
      at::Tensor s1 = dmi::kernels::attention_scores(q.narrow(1, t, 1), keys, L, masked.narrow(2, t, 1), scale);
      CHECK(at::equal(s1, s.narrow(2, t, 1)));
      CHECK(at::equal(dmi::kernels::attention_values(p.narrow(2, t, 1), values, L), z.narrow(1, t, 1)));
      // Fused, no scores or probabilities kept (a forward pass that hooks neither): the same bits.
      CHECK(same_bits(dmi::kernels::attention(q, keys, values, L, masked, scale), z));
      CHECK(same_bits(dmi::kernels::attention(q.narrow(1, t, 1), keys, values, L, masked.narrow(2, t, 1), scale),
                      z.narrow(1, t, 1)));
    }
  }
}

namespace {

// ops.cpp's SwiGLU formula one element at a time, in float: silu(g) =
// g / (1 + exp(-g)) with its Cephes exp, rounded to the dtype, times u.
float ref_fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) p = p * r + c;
  std::int32_t bits;
  std::memcpy(&bits, &t, 4);
  bits = (bits - 0x4B400000 + 127) * (1 << 23);
  float scale;
  std::memcpy(&scale, &bits, 4);
  return (p * r * r + r + 1.0f) * scale;
}

}  // namespace

TEST_CASE("ops: SwiGLU has the bits of its formula, element by element (odd lengths, the exp clamped)") {
  at::manual_seed(7);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    CAPTURE(c10::toString(dtype));
    for (std::int64_t n : {1, 15, 16, 37, 3072}) {
      CAPTURE(n);
      at::Tensor gu = (at::randn({3, 2 * n}) * 6).to(dtype);
      gu.view(-1).narrow(0, 0, 1).fill_(100.0);  // exp clamped at the ends of the range
      gu.view(-1).narrow(0, 1, 1).fill_(-100.0);
      at::Tensor g = gu.narrow(1, 0, n), u = gu.narrow(1, n, n);
      at::Tensor got = dmi::kernels::silu_mul(g, u).to(at::kFloat);
      at::Tensor gf = g.to(at::kFloat).contiguous(), uf = u.to(at::kFloat).contiguous();
      at::Tensor want = at::empty({3, n});
      auto ga = gf.accessor<float, 2>(), ua = uf.accessor<float, 2>();
      auto wa = want.accessor<float, 2>();
      for (std::int64_t r = 0; r < 3; ++r)
        for (std::int64_t i = 0; i < n; ++i) {
          const float act = ref_round(ga[r][i] / (1.0f + ref_fast_exp(-ga[r][i])), dtype);
          wa[r][i] = ref_round(act * ua[r][i], dtype);
        }
      CHECK(same_bits(got, want));
    }
  }
}

TEST_CASE("ops: softmax in float32 (masked entries exactly 0), fast exp, padding changes no bit") {
  at::manual_seed(8);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    CAPTURE(c10::toString(dtype));
    const double ulp = dtype == at::kBFloat16 ? 1.0 / 128 : 1e-6;
    at::Tensor s = (at::randn({4, 3, 37}) * 4).to(dtype);
    s.masked_fill_(at::rand({4, 3, 37}) < 0.3, -std::numeric_limits<double>::infinity());
    s.select(2, 36).fill_(1.0);
    at::Tensor p = dmi::kernels::softmax(s);
    at::Tensor want = at::softmax(s, -1, at::kFloat).to(dtype);
    CHECK(excess(p, want, 2 * ulp, 1e-7) <= 0);
    CHECK(at::equal(p.masked_select(at::isinf(s)), at::zeros({at::isinf(s).sum().item<std::int64_t>()}, dtype)));
    // Left padding: the same row with masked columns in front.
    at::Tensor padded = at::cat({at::full({4, 3, 5}, -std::numeric_limits<double>::infinity()).to(dtype), s}, -1);
    CHECK(at::equal(dmi::kernels::softmax(padded).narrow(-1, 5, 37), p));
  }
  // A large softmax input range: relative error of the exp approximation.
  at::Tensor x = at::linspace(-80, 80, 20001).view({1, -1});
  at::Tensor two = at::stack({x.view(-1), at::full({20001}, -std::numeric_limits<double>::infinity())}, 1);
  // softmax over [x, -inf] is exactly 1 wherever exp(x) is finite.
  CHECK(at::equal(dmi::kernels::softmax(two).select(1, 0), at::ones({20001})));
}

TEST_CASE("kernels and ops: one thread computes the same bits as all of them, at sizes that use every thread") {
  struct Restore {
    int n;
    ~Restore() { at::set_num_threads(n); }
  } restore{at::get_num_threads()};
  // As configure_threads() does: a thread per CPU, at least 2 here.
  const int threads = static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
  at::manual_seed(11);
  // Above the per-thread minimums (2^18 multiply-adds, 32768 element
  // operations), so each loop splits over every thread.
  const std::int64_t B = 2, T = 64, H = 8, KV = 2, D = 64, L = T;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    CAPTURE(c10::toString(dtype));
    at::Tensor w = at::randn({1024, 512}).to(dtype), x8 = at::randn({8, 512}).to(dtype);
    at::Tensor x = at::randn({300, 512}).to(dtype), nw = at::randn({512}).to(dtype);
    at::Tensor q = at::randn({B, T, H, D}).to(dtype);
    at::Tensor keys = at::randn({B, KV, L, D}).to(dtype), values = at::randn({B, KV, L, D}).to(dtype);
    at::Tensor cos = at::randn({B, T, 1, D}).to(dtype), sin = at::randn({B, T, 1, D}).to(dtype);
    at::Tensor masked = at::ones({T, L}, at::kBool).triu(1).view({1, 1, T, L}).expand({B, 1, T, L});
    at::Tensor x1 = at::randn({1, 512}).to(dtype);
    const PackedLinear lin({w}, {at::Tensor()}, dtype, Isa::scalar);
    auto run = [&] {
      std::vector<at::Tensor> out;
      for (Isa isa : supported()) {
        out.push_back(lin.run(x8, isa));
        out.push_back(lin.run(x, isa));
        lin.prefetch();  // with held threads: thread 1 takes the panels it read first
        out.push_back(lin.run(x1, isa));
        lin.prefetch();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));  // time to read all it reads ahead
        out.push_back(lin.run(x1, isa));
      }
      out.push_back(dmi::kernels::rms_norm(x, nw, 1e-6));
      out.push_back(dmi::kernels::silu_mul(x, x.flip(0)));
      out.push_back(dmi::kernels::rope(q, cos, sin));
      at::Tensor s = dmi::kernels::attention_scores(q, keys, L, masked, 0.125);
      at::Tensor p = dmi::kernels::softmax(s);
      out.push_back(s);
      out.push_back(p);
      out.push_back(dmi::kernels::attention_values(p, values, L));
      out.push_back(dmi::kernels::attention(q, keys, values, L, masked, 0.125));
      return out;
    };
    at::set_num_threads(threads);
    const std::vector<at::Tensor> many = run();
    // The same with the threads held for the whole run (kernels/pool.h), as
    // a decode step holds them.
    std::vector<at::Tensor> held;
    dmi::kernels::hold_threads([&] {
      CHECK(dmi::kernels::holding_threads());
      CHECK(dmi::kernels::pool_threads() == threads);
      held = run();
    });
    at::set_num_threads(1);
    const std::vector<at::Tensor> one = run();
    at::set_num_threads(threads);
    REQUIRE(one.size() == many.size());
    REQUIRE(one.size() == held.size());
    for (std::size_t i = 0; i < one.size(); ++i) {
      CAPTURE(i);
      CHECK(same_bits(one[i], many[i]));
      CHECK(same_bits(one[i], held[i]));
    }
  }
}

TEST_CASE("memory: a freed KV-cache block is reused, zeroed, by the next call that fits; two are kept") {
  using dmi::kernels::recycled_huge_page_zeros;
  using dmi::kernels::release_kept_huge_pages;
  constexpr std::size_t MiB = std::size_t{1} << 20;
  release_kept_huge_pages();  // what earlier tests' caches left
  at::Tensor a = recycled_huge_page_zeros({3, 1000}, at::kFloat);
  CHECK(a.eq(0).all().item<bool>());
  const void* first = a.data_ptr();
  CHECK(reinterpret_cast<std::uintptr_t>(first) % (2 * MiB) == 0);
  a.fill_(7);
  at::Tensor view = a[1];
  a = at::Tensor();
  // The view still holds the block: a new call maps another.
  at::Tensor other = recycled_huge_page_zeros({3, 1000}, at::kFloat);
  CHECK(other.data_ptr() != first);
  view = at::Tensor();
  other = at::Tensor();
  // Both kept now (the first freed first); the next call takes it back, all zeros again.
  at::Tensor b = recycled_huge_page_zeros({2, 1000}, at::kBFloat16);
  CHECK(b.data_ptr() == first);
  CHECK(b.eq(0).all().item<bool>());
  b = at::Tensor();
  CHECK(release_kept_huge_pages() == 2 * 2 * MiB);
  CHECK(release_kept_huge_pages() == 0);

  // A block too small is not taken; the smallest that fits is.
  at::Tensor small = recycled_huge_page_zeros({static_cast<std::int64_t>(MiB)}, at::kFloat);         // 4 MiB
  at::Tensor large = recycled_huge_page_zeros({static_cast<std::int64_t>(2 * MiB)}, at::kFloat);     // 8 MiB
  const void* small_at = small.data_ptr();
  const void* large_at = large.data_ptr();
  small.fill_(1);
  large.fill_(2);
  small = at::Tensor();
  large = at::Tensor();
  at::Tensor fits_small = recycled_huge_page_zeros({static_cast<std::int64_t>(3 * MiB / 4)}, at::kFloat);  // 3 MiB
  CHECK(fits_small.data_ptr() == small_at);
  CHECK(fits_small.eq(0).all().item<bool>());
  at::Tensor fits_large = recycled_huge_page_zeros({static_cast<std::int64_t>(MiB + 1)}, at::kFloat);  // > 4 MiB
  CHECK(fits_large.data_ptr() == large_at);
  CHECK(fits_large.eq(0).all().item<bool>());
  at::Tensor fresh = recycled_huge_page_zeros({static_cast<std::int64_t>(MiB / 4)}, at::kFloat);  // none kept
  CHECK(fresh.data_ptr() != small_at);
  CHECK(fresh.data_ptr() != large_at);

  // Three freed, the two freed last are kept: 4 + 8 MiB, not the 2 MiB one.
  fresh = at::Tensor();
  fits_small = at::Tensor();
  fits_large = at::Tensor();
  CHECK(release_kept_huge_pages() == 12 * MiB);
}

TEST_CASE("memory: ATen's CPU blocks of 32 to 512 MiB are reused after they are freed; other sizes are not touched") {
  using namespace dmi::kernels;
  constexpr std::size_t MiB = std::size_t{1} << 20;
  const auto floats = [](std::size_t bytes) { return static_cast<std::int64_t>(bytes / sizeof(float)); };
  install_large_block_cache();
  install_large_block_cache();  // idempotent: a second wrapper would see the first as its fallback
  release_kept_large_blocks();
  const LargeBlockStats start = large_block_stats();
  CHECK(start.kept_blocks == 0);

  at::Tensor a = at::empty({floats(kLargeBlock)}, at::kFloat);
  void* const first = a.data_ptr();
  CHECK(reinterpret_cast<std::uintptr_t>(first) % (2 * MiB) == 0);
  a.fill_(3);
  at::Tensor view = a.narrow(0, 5, 10);
  a = at::Tensor();
  CHECK(large_block_stats().kept_blocks == 0);  // the view holds it
  view = at::Tensor();
  LargeBlockStats s = large_block_stats();
  CHECK(s.mapped == start.mapped + 1);
  CHECK(s.kept_blocks == 1);
  CHECK(s.kept_bytes == kLargeBlock);

  // The next large allocation that fits takes it back, contents as they were
  // (at::empty promises nothing); at::zeros still zeroes.
  at::Tensor b = at::empty({static_cast<std::int64_t>(kLargeBlock / sizeof(double))}, at::kDouble);
  CHECK(b.data_ptr() == first);
  CHECK(reinterpret_cast<const float*>(b.data_ptr())[7] == 3.0f);
  b = at::Tensor();
  at::Tensor z = at::zeros({floats(kLargeBlock)}, at::kFloat);
  CHECK(z.data_ptr() == first);
  CHECK(z.eq(0).all().item<bool>());
  z = at::Tensor();
  s = large_block_stats();
  CHECK(s.reused == start.reused + 2);
  CHECK(s.kept_blocks == 1);

  // Small allocations go to the allocator underneath, through the raw
  // interface as well.
  at::Tensor small = at::empty({1000}, at::kFloat);
  CHECK(small.data_ptr() != first);
  small = at::Tensor();
  c10::Allocator* cpu = c10::GetCPUAllocator();
  REQUIRE(static_cast<bool>(cpu->raw_deleter()));
  void* raw_small = cpu->raw_allocate(100);
  std::memset(raw_small, 1, 100);
  cpu->raw_deallocate(raw_small);
  void* raw_large = cpu->raw_allocate(kLargeBlock);
  CHECK(raw_large == first);
  cpu->raw_deallocate(raw_large);
  s = large_block_stats();
  CHECK(s.mapped == start.mapped + 1);
  CHECK(s.reused == start.reused + 3);
  CHECK(s.kept_blocks == 1);

  // The smallest kept block that fits, and never one more than twice the
  // request: a 34 MiB request does not take an 80 MiB block, a 40 MiB one does.
  at::Tensor big = at::empty({floats(80 * MiB)}, at::kFloat);
  void* const big_at = big.data_ptr();
  big = at::Tensor();
  at::Tensor mid = at::empty({floats(34 * MiB)}, at::kFloat);
  CHECK(mid.data_ptr() != big_at);
  CHECK(mid.data_ptr() != first);
  at::Tensor fits = at::empty({floats(40 * MiB)}, at::kFloat);
  CHECK(fits.data_ptr() == big_at);
  mid = at::Tensor();
  fits = at::Tensor();

  // Freed from another thread, as ATen's workers may.
  at::Tensor elsewhere = at::empty({floats(kLargeBlock)}, at::kFloat);
  std::thread([t = std::move(elsewhere)]() mutable { t = at::Tensor(); }).join();
  CHECK(large_block_stats().kept_blocks == 3);
  CHECK(release_kept_large_blocks() == (32 + 80 + 34) * MiB);
  CHECK(large_block_stats().kept_bytes == 0);

  // The most recently freed blocks up to kKeptLargeBytes are kept; a block
  // larger than that is not the cache's at all.
  std::vector<at::Tensor> many;
  std::vector<void*> at_;
  const std::size_t each = 96 * MiB;
  const std::size_t count = kKeptLargeBytes / each + 1;
  for (std::size_t i = 0; i < count; ++i) {
    many.push_back(at::empty({floats(each)}, at::kFloat));
    at_.push_back(many.back().data_ptr());
  }
  many.clear();  // freed in order: the first is the oldest
  s = large_block_stats();
  CHECK(s.kept_blocks == count - 1);
  CHECK(s.kept_bytes == (count - 1) * each);
  at::Tensor again = at::empty({floats(each)}, at::kFloat);
  CHECK(again.data_ptr() != at_.front());
  again = at::Tensor();
  const LargeBlockStats before_huge = large_block_stats();
  at::Tensor huge = at::empty({floats(kKeptLargeBytes + 4)}, at::kFloat);
  huge = at::Tensor();
  s = large_block_stats();
  CHECK(s.mapped == before_huge.mapped);
  CHECK(s.reused == before_huge.reused);
  CHECK(s.kept_bytes == before_huge.kept_bytes);
  at::Tensor at_cap = at::empty({floats(kKeptLargeBytes)}, at::kFloat);  // the largest it takes
  at_cap = at::Tensor();
  s = large_block_stats();
  CHECK(s.mapped == before_huge.mapped + 1);
  CHECK(s.kept_blocks == 1);  // it pushed out every older one
  CHECK(s.kept_bytes == kKeptLargeBytes);
  release_kept_large_blocks();
}
