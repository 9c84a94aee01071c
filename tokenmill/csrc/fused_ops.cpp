// The small per-layer ops of a decoder step, fused: at batch 1 the weights are a few MB per layer but a
// dozen elementwise torch ops each cost a dispatch, an allocation and a pass over memory. One pass each:
// - rms_norm / add_rms_norm: (residual add +) RMSNorm with (offset +) weight;
// - rotary: rotate-half rotary embedding of q and k read through their strides (views of the fused qkv
//   output), written contiguous;
// - silu_and_mul / gelu_tanh_and_mul: act(gate) * up over the fused gate_up output.
// float32 and bfloat16 (rows read into float32, computed there, rounded once to bf16 on the way out; the
// residual sum of add_rms_norm is rounded to bf16 before the norm reads it, as in the torch reference);
// the Python callers fall back to torch ops for other dtypes and when this is not built.
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace tokenmill {
namespace {

using Vec = at::vec::Vectorized<float>;
using BF16 = at::BFloat16;
constexpr int64_t ROWS_PER_TASK = 16;  // rows of a [T, D] op per parallel work item

// float32 rows are used in place; bf16 rows go through float32 scratch (a work item's own buffer).
template <typename T>
constexpr bool is_f32 = std::is_same_v<T, float>;

template <typename T>
inline const float* as_float(const T* src, float* scratch, int64_t n) {
  if constexpr (is_f32<T>) {
    return src;
  } else {
    at::vec::convert(src, scratch, n);
    return scratch;
  }
}
template <typename T>
inline float* out_float(T* dst, float* scratch) {
  if constexpr (is_f32<T>) return dst; else return scratch;
}
template <typename T>
inline void finish(const float* scratch, T* dst, int64_t n) {
  if constexpr (!is_f32<T>) at::vec::convert(scratch, dst, n);
}
template <typename T>
std::vector<float> scratch(int64_t n) { return std::vector<float>(is_f32<T> ? 0 : n); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, dim] with a contiguous last dim");
}

// fn<T>() for the float32 or bf16 `dtype` (checked by the caller).
template <typename F>
decltype(auto) dispatch(at::ScalarType dtype, const F& fn) {
  if (dtype == at::kBFloat16) return fn(BF16{});
  return fn(float{});
}

inline float sum_squares(const float* x, int64_t D) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) {
    Vec v = Vec::loadu(x + d);
    acc = at::vec::fmadd(v, v, acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; d < D; ++d) s += x[d] * x[d];
  return s;
}

// out[d] = x[d] * inv * (offset + w[d])
inline void scale_row(const float* x, const float* w, float inv, float offset, int64_t D, float* out) {
  const Vec vi(inv), vo(offset);
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size())
    (Vec::loadu(x + d) * vi * (vo + Vec::loadu(w + d))).store(out + d);
  for (; d < D; ++d) out[d] = x[d] * inv * (offset + w[d]);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  check_rows(x, "x");
  const int64_t T = x.size(0), D = x.size(1);
  auto w = weight.contiguous().to(at::kFloat);
  TORCH_CHECK(w.numel() == D, "weight has ", w.numel(), " elements, x rows have ", D);
  auto out = at::empty({T, D}, x.options());
  const float* wp = w.data_ptr<float>();
  const int64_t ld = x.stride(0);
  dispatch(x.scalar_type(), [&](auto tag) {
    using S = decltype(tag);
    const S* xp = x.data_ptr<S>();
    S* op = out.data_ptr<S>();
    at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t b, int64_t e) {
      auto buf = scratch<S>(2 * D);
      for (int64_t t = b; t < e; ++t) {
        const float* row = as_float(xp + t * ld, buf.data(), D);
        float* o = out_float(op + t * D, buf.data() + D);
        const float inv = 1.f / std::sqrt(sum_squares(row, D) / D + (float)eps);
        scale_row(row, wp, inv, (float)offset, D, o);
        finish(o, op + t * D, D);
      }
    });
  });
  return out;
}

// s = x + h (rounded to x's dtype); returns (s, rms_norm(s)).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h, const at::Tensor& weight,
                                                double eps, double offset) {
  check_rows(x, "x");
  check_rows(h, "h");
  TORCH_CHECK(x.sizes() == h.sizes(), "x and h differ in shape");
  TORCH_CHECK(x.scalar_type() == h.scalar_type(), "x and h differ in dtype");
  const int64_t T = x.size(0), D = x.size(1);
  auto w = weight.contiguous().to(at::kFloat);
  TORCH_CHECK(w.numel() == D, "weight has ", w.numel(), " elements, x rows have ", D);
  auto sum = at::empty({T, D}, x.options());
  auto out = at::empty({T, D}, x.options());
  const float* wp = w.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldh = h.stride(0);
  dispatch(x.scalar_type(), [&](auto tag) {
    using S = decltype(tag);
    const S* xp = x.data_ptr<S>();
    const S* hp = h.data_ptr<S>();
    S* sp = sum.data_ptr<S>();
    S* op = out.data_ptr<S>();
    at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t b, int64_t e) {
      auto buf = scratch<S>(4 * D);
      for (int64_t t = b; t < e; ++t) {
        const float* xr = as_float(xp + t * ldx, buf.data(), D);
        const float* hr = as_float(hp + t * ldh, buf.data() + D, D);
        float* sr = out_float(sp + t * D, buf.data() + 2 * D);
        int64_t d = 0;
        for (; d + Vec::size() <= D; d += Vec::size()) (Vec::loadu(xr + d) + Vec::loadu(hr + d)).store(sr + d);
        for (; d < D; ++d) sr[d] = xr[d] + hr[d];
        if constexpr (!is_f32<S>) {  // the norm reads the sum as stored (rounded), as the reference does
          finish(sr, sp + t * D, D);
          sr = buf.data() + 2 * D;
          at::vec::convert(sp + t * D, sr, D);
        }
        float* o = out_float(op + t * D, buf.data() + 3 * D);
        const float inv = 1.f / std::sqrt(sum_squares(sr, D) / D + (float)eps);
        scale_row(sr, wp, inv, (float)offset, D, o);
        finish(o, op + t * D, D);
      }
    });
  });
  return {sum, out};
}

// x: [T, H, D] with the last dim contiguous; cos/sin: [P, D] (each half repeated, as the Python table).
at::Tensor rotate(const at::Tensor& x, const int64_t* pos, const float* cos, const float* sin, int64_t P) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 3 &&
                  x.stride(2) == 1,
              "rotary: q/k must be float32 or bfloat16 [T, H, D] with a contiguous last dim");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rotary: head dim must be even");
  auto out = at::empty({T, H, D}, x.options());
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rotary: position ", pos[t], " out of range");
  dispatch(x.scalar_type(), [&](auto tag) {
    using S = decltype(tag);
    const S* xp = x.data_ptr<S>();
    S* op = out.data_ptr<S>();
    at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t b, int64_t e) {
      auto buf = scratch<S>(2 * D);
      for (int64_t t = b; t < e; ++t) {
        const float* c = cos + pos[t] * D;
        const float* s = sin + pos[t] * D;
        for (int64_t h = 0; h < H; ++h) {
          const float* in = as_float(xp + t * s0 + h * s1, buf.data(), D);
          float* o = out_float(op + (t * H + h) * D, buf.data() + D);
          int64_t d = 0;
          for (; d + Vec::size() <= half; d += Vec::size()) {
            Vec x1 = Vec::loadu(in + d), x2 = Vec::loadu(in + half + d);
            (x1 * Vec::loadu(c + d) - x2 * Vec::loadu(s + d)).store(o + d);
            (x2 * Vec::loadu(c + half + d) + x1 * Vec::loadu(s + half + d)).store(o + half + d);
          }
          for (; d < half; ++d) {
            const float x1 = in[d], x2 = in[half + d];
            o[d] = x1 * c[d] - x2 * s[d];
            o[half + d] = x2 * c[half + d] + x1 * s[half + d];
          }
          finish(o, op + (t * H + h) * D, D);
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(),
              "rotary: cos/sin must be contiguous float32 [positions, head_dim]");
  TORCH_CHECK(q.size(2) == cos.size(1) && k.size(2) == cos.size(1), "rotary: head dim differs from the table's");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == q.size(0) && pos.numel() == k.size(0), "rotary: one position per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  return {rotate(q, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0)),
          rotate(k, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0))};
}

inline Vec silu(Vec g) { return g / (Vec(1.f) + g.neg().exp_u20()); }
inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3); tanh(u) = 1 - 2 / (exp(2u) + 1).
inline Vec gelu_tanh(Vec g) {
  const Vec u = Vec(0.7978845608028654f) * (g + Vec(0.044715f) * g * g * g);
  const Vec th = Vec(1.f) - Vec(2.f) / ((u * Vec(2.f)).exp_u20() + Vec(1.f));
  return Vec(0.5f) * g * (Vec(1.f) + th);
}
inline float gelu_tanh(float g) {
  return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

template <bool GELU>
at::Tensor act_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  auto out = at::empty({T, I}, gate_up.options());
  const int64_t ld = gate_up.stride(0);
  // Split over columns too, so one decode row still uses every thread.
  constexpr int64_t COLS = 512;
  const int64_t chunks = (I + COLS - 1) / COLS;
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using S = decltype(tag);
    const S* gp = gate_up.data_ptr<S>();
    S* op = out.data_ptr<S>();
    at::parallel_for(0, T * chunks, 1, [&](int64_t b, int64_t e) {
      auto buf = scratch<S>(3 * COLS);
      for (int64_t it = b; it < e; ++it) {
        const int64_t t = it / chunks, c0 = (it % chunks) * COLS, n = std::min(I, c0 + COLS) - c0;
        const float* g = as_float(gp + t * ld + c0, buf.data(), n);
        const float* u = as_float(gp + t * ld + I + c0, buf.data() + COLS, n);
        float* o = out_float(op + t * I + c0, buf.data() + 2 * COLS);
        int64_t d = 0;
        for (; d + Vec::size() <= n; d += Vec::size()) {
          Vec gv = Vec::loadu(g + d);
          ((GELU ? gelu_tanh(gv) : silu(gv)) * Vec::loadu(u + d)).store(o + d);
        }
        for (; d < n; ++d) o[d] = (GELU ? gelu_tanh(g[d]) : silu(g[d])) * u[d];
        finish(o, op + t * I + c0, n);
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) { return act_and_mul<false>(gate_up); }
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) { return act_and_mul<true>(gate_up); }

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &tokenmill::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor h, Tensor weight, float eps, float offset) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &tokenmill::add_rms_norm);
  m.def("rotary(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("rotary", c10::DispatchKey::CPU, &tokenmill::rotary);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &tokenmill::silu_and_mul);
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, &tokenmill::gelu_tanh_and_mul);
}
