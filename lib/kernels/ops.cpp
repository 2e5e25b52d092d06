#include "kernels/ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "common/error.h"
#include "kernels/gemm_impl.h"

namespace dmi::kernels {

namespace {

inline float load(const float* p, std::int64_t i) { return p[i]; }
inline float load(const std::uint16_t* p, std::int64_t i) {
  const std::uint32_t u = static_cast<std::uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const std::uint16_t*) {
  const std::uint16_t h = detail::to_bf16(v);
  return load(&h, 0);
}
inline void store(float* p, std::int64_t i, float v) { p[i] = v; }
inline void store(std::uint16_t* p, std::int64_t i, float v) { p[i] = detail::to_bf16(v); }

// Dot product in 16 fp32 lanes, summed pairwise at the end: a fixed order
// the compiler can vectorize without reassociating.
template <class Ta, class Tb>
float dot(const Ta* a, const Tb* b, std::int64_t n) {
  float acc[16] = {};
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += load(a, i + j) * load(b, i + j);
  for (int j = 0; i < n; ++i, ++j) acc[j] += load(a, i) * load(b, i);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

template <class E>
void rms_norm_rows(const E* x, const E* w, E* out, std::int64_t rows, std::int64_t n, float eps) {
  at::parallel_for(0, rows, 64, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const E* xr = x + r * n;
      const float mean = dot(xr, xr, n) / static_cast<float>(n);
      const float inv = 1.0f / std::sqrt(mean + eps);
      E* o = out + r * n;
      for (std::int64_t i = 0; i < n; ++i) {
        const float h = round_to(load(xr, i) * inv, xr);  // h.to(x.dtype)
        store(o, i, load(w, i) * h);                      // w * h in the dtype
      }
    }
  });
}

template <class E>
void rope_rows(const E* x, const E* cos, const E* sin, E* out, std::int64_t B, std::int64_t T, std::int64_t H,
               std::int64_t D) {
  const std::int64_t half = D / 2;
  at::parallel_for(0, B * T, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bt = begin; bt < end; ++bt) {
      const E* c = cos + bt * D;
      const E* s = sin + bt * D;
      for (std::int64_t h = 0; h < H; ++h) {
        const E* xr = x + (bt * H + h) * D;
        E* o = out + (bt * H + h) * D;
        for (std::int64_t i = 0; i < D; ++i) {
          const float rot = i < half ? -load(xr, i + half) : load(xr, i - half);
          const float a = round_to(load(xr, i) * load(c, i), xr), b = round_to(rot * load(s, i), xr);
          store(o, i, a + b);
        }
      }
    }
  });
}

template <class E>
void silu_mul_rows(const E* g, const E* u, E* out, std::int64_t rows, std::int64_t n, std::int64_t g_stride,
                   std::int64_t u_stride) {
  at::parallel_for(0, rows, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const E* gr = g + r * g_stride;
      const E* ur = u + r * u_stride;
      E* o = out + r * n;
      for (std::int64_t i = 0; i < n; ++i) {
        const float x = load(gr, i);
        const float act = round_to(x / (1.0f + std::exp(-x)), gr);
        store(o, i, act * load(ur, i));
      }
    }
  });
}

template <class E>
void scores_impl(const at::Tensor& q, const at::Tensor& keys, std::int64_t L, const at::Tensor& masked, float scale,
                 at::Tensor& out) {
  const std::int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const std::int64_t KV = keys.size(1), cap = keys.size(2), G = H / KV;
  const E* qp = reinterpret_cast<const E*>(q.data_ptr());
  const E* kp = reinterpret_cast<const E*>(keys.data_ptr());
  const bool* mp = masked.data_ptr<bool>();
  E* op = reinterpret_cast<E*>(out.data_ptr());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bh = begin; bh < end; ++bh) {
      const std::int64_t b = bh / H, h = bh % H, kv = h / G;
      const E* kb = kp + (b * KV + kv) * cap * D;
      for (std::int64_t t = 0; t < T; ++t) {
        const E* qr = qp + ((b * T + t) * H + h) * D;
        const bool* m = mp + (b * T + t) * L;
        E* o = op + ((b * H + h) * T + t) * L;
        for (std::int64_t c = 0; c < L; ++c) {
          if (m[c]) {
            store(o, c, neg_inf);
            continue;
          }
          const float s = round_to(dot(qr, kb + c * D, D), qr);  // the matmul's output
          store(o, c, s * scale);                                 // * scaling
        }
      }
    }
  });
}

template <class E>
void values_impl(const at::Tensor& probs, const at::Tensor& values, std::int64_t L, at::Tensor& out) {
  const std::int64_t B = probs.size(0), H = probs.size(1), T = probs.size(2);
  const std::int64_t KV = values.size(1), cap = values.size(2), D = values.size(3), G = H / KV;
  const E* pp = reinterpret_cast<const E*>(probs.data_ptr());
  const E* vp = reinterpret_cast<const E*>(values.data_ptr());
  E* op = reinterpret_cast<E*>(out.data_ptr());
  at::parallel_for(0, B * H, 1, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> acc(static_cast<std::size_t>(D));
    for (std::int64_t bh = begin; bh < end; ++bh) {
      const std::int64_t b = bh / H, h = bh % H, kv = h / G;
      const E* vb = vp + (b * KV + kv) * cap * D;
      for (std::int64_t t = 0; t < T; ++t) {
        const E* p = pp + ((b * H + h) * T + t) * L;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (std::int64_t c = 0; c < L; ++c) {
          const float pc = load(p, c);
          const E* v = vb + c * D;
          for (std::int64_t d = 0; d < D; ++d) acc[d] += pc * load(v, d);
        }
        E* o = op + ((b * T + t) * H + h) * D;
        for (std::int64_t d = 0; d < D; ++d) store(o, d, acc[d]);
      }
    }
  });
}

void check_dtype(const at::Tensor& t, const char* what) {
  DMI_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "{}: dtype must be float32 or bfloat16",
            what);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_dtype(x, "rms_norm");
  const std::int64_t n = x.size(-1);
  DMI_CHECK(w.numel() == n && w.scalar_type() == x.scalar_type(), "rms_norm: weight must be [{}] of the input's dtype",
            n);
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const std::int64_t rows = n ? x.numel() / n : 0;
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, n, static_cast<float>(eps));
  else
    rms_norm_rows(reinterpret_cast<const std::uint16_t*>(xc.data_ptr()),
                  reinterpret_cast<const std::uint16_t*>(wc.data_ptr()),
                  reinterpret_cast<std::uint16_t*>(out.data_ptr()), rows, n, static_cast<float>(eps));
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(x, "rope");
  const std::int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  DMI_CHECK(x.dim() == 4 && D % 2 == 0 && cos.numel() == B * T * D && sin.numel() == B * T * D &&
                cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
            "rope: x [B, T, H, D] with cos, sin [B, T, 1, D] of its dtype");
  at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat)
    rope_rows(xc.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), out.data_ptr<float>(), B, T, H, D);
  else
    rope_rows(reinterpret_cast<const std::uint16_t*>(xc.data_ptr()), reinterpret_cast<const std::uint16_t*>(cc.data_ptr()),
              reinterpret_cast<const std::uint16_t*>(sc.data_ptr()), reinterpret_cast<std::uint16_t*>(out.data_ptr()),
              B, T, H, D);
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_dtype(gate, "silu_mul");
  DMI_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
            "silu_mul: gate and up must have one shape and dtype");
  const std::int64_t n = gate.size(-1), rows = n ? gate.numel() / n : 0;
  // Rows may be strided views (gate and up are halves of one projection).
  at::Tensor g = gate.reshape({rows, n}), u = up.reshape({rows, n});
  if (g.stride(1) != 1) g = g.contiguous();
  if (u.stride(1) != 1) u = u.contiguous();
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (gate.scalar_type() == at::kFloat)
    silu_mul_rows(g.data_ptr<float>(), u.data_ptr<float>(), out.data_ptr<float>(), rows, n, g.stride(0), u.stride(0));
  else
    silu_mul_rows(reinterpret_cast<const std::uint16_t*>(g.data_ptr()), reinterpret_cast<const std::uint16_t*>(u.data_ptr()),
                  reinterpret_cast<std::uint16_t*>(out.data_ptr()), rows, n, g.stride(0), u.stride(0));
  return out;
}

at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& keys, std::int64_t L, const at::Tensor& masked,
                            double scale) {
  check_dtype(q, "attention_scores");
  DMI_CHECK(q.dim() == 4 && keys.dim() == 4 && keys.scalar_type() == q.scalar_type() && keys.size(3) == q.size(3) &&
                q.size(2) % keys.size(1) == 0 && L <= keys.size(2),
            "attention_scores: q [B, T, H, D] and keys [B, KV, capacity >= L, D] do not fit");
  at::Tensor qc = q.contiguous(), kc = keys.contiguous();
  at::Tensor mc = masked.expand({q.size(0), 1, q.size(1), L}).contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), L}, q.options());
  if (q.scalar_type() == at::kFloat) scores_impl<float>(qc, kc, L, mc, static_cast<float>(scale), out);
  else scores_impl<std::uint16_t>(qc, kc, L, mc, static_cast<float>(scale), out);
  return out;
}

at::Tensor attention_values(const at::Tensor& probs, const at::Tensor& values, std::int64_t L) {
  check_dtype(probs, "attention_values");
  DMI_CHECK(probs.dim() == 4 && values.dim() == 4 && probs.size(3) == L && L <= values.size(2) &&
                values.scalar_type() == probs.scalar_type() && probs.size(1) % values.size(1) == 0,
            "attention_values: probs [B, H, T, L] and values [B, KV, capacity >= L, D] do not fit");
  at::Tensor pc = probs.contiguous(), vc = values.contiguous();
  at::Tensor out = at::empty({probs.size(0), probs.size(2), probs.size(1), values.size(3)}, probs.options());
  if (probs.scalar_type() == at::kFloat) values_impl<float>(pc, vc, L, out);
  else values_impl<std::uint16_t>(pc, vc, L, out);
  return out;
}

}  // namespace dmi::kernels
