// W8A8 linear (--activation-quantization int8_per_token on int8 weights, vLLM's dynamic per-token scheme):
// each row of x quantized to int8 with one scale (max|row| / 127, round half to even), the product in exact
// int32 by at::_int_mm (oneDNN's u8s8 kernels: VNNI / AMX where the CPU has them), then y = acc * s_x * s_w
// (+ bias). One native call instead of the ~10 torch ops of the Python form (weight_only.int8_per_token_matmul,
// the same arithmetic): at 64-256 rows those passes over x and y cost more than the integer product itself.
// Integer sums are exact and every other step is per element or per row, so a row's result does not depend on
// the other rows.
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace tokenmill {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t VS = fVec::size();

// One row: q = round(x * 127 / amax) (half to even, as torch.round), |q| <= 127; returns the scale amax / 127.
float quantize_row(const float* x, int64_t K, int8_t* q) {
  fVec vmax(0.f);
  int64_t k = 0;
  for (; k + VS <= K; k += VS) vmax = at::vec::maximum(vmax, fVec::loadu(x + k).abs());
  float amax = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (k = 0; k < K; ++k) q[k] = static_cast<int8_t>(std::clamp(std::nearbyint(x[k] * inv), -127.f, 127.f));
  return amax / 127.f;
}

}  // namespace

at::Tensor int8_linear_per_token(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "int8_linear_per_token: x must be [M, ", K, "], got ", x_in.sizes());
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat, "scale must be float [", N, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  std::vector<float> sx(M);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) sx[m] = quantize_row(xp + m * K, K, qp + m * K);
  });
  const at::Tensor acc = at::_int_mm(xq, w.t());  // int32 [M, N], exact
  const at::Tensor s = scale.contiguous();
  const at::Tensor bf = bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sp = s.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // y = (float(acc) * s_x) * s_w (+ b): vector ops only (a partial last vector for the tail), so no element is
  // computed with a fused multiply-add that another would not get.
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / N), [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
      const fVec vs(sx[m]);
      for (int64_t n = 0; n < N; n += VS) {
        const int64_t c = std::min<int64_t>(VS, N - n);
        fVec v = at::vec::convert<float>(at::vec::Vectorized<int32_t>::loadu(ap + m * N + n, c)) * vs *
                 fVec::loadu(sp + n, c);
        if (bp != nullptr) v = v + fVec::loadu(bp + n, c);
        v.store(yp + m * N + n, c);
      }
    }
  });
  return y;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int8_linear_per_token(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  m.impl("int8_linear_per_token", c10::DispatchKey::CPU, &tokenmill::int8_linear_per_token);
}
