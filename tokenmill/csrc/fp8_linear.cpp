// FP8 linear: y = x W^T with W float8_e4m3fn [N, K] (1 byte a weight) and a float scale per output row.
// Decode (1-2 rows of x): each weight byte is widened to float in registers (bit arithmetic, no table) and
// multiplied at once, reading the bytes once, rows split over threads. More rows: the weight is converted
// to float once per call (rows in parallel) and ATen's SGEMM multiplies. e4m3fn has no infinities; its
// NaN encodings (0x7F, 0xFF) are not expected in weights and read as 480.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace tokenmill {
namespace {

constexpr int64_t FP8_DECODE_MAX_ROWS = 2;
constexpr int64_t FP8_ROWS_PER_ITEM = 32;

// e4m3fn -> float, exactly: normal numbers move their exponent from bias 7 to bias 127; subnormals
// (exponent 0) are m * 2^-9. Both are computed and one selected, so the loop vectorises.
inline float e4m3(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t e = (b >> 3) & 0xF, m = b & 0x7;
  const uint32_t bits = sign | ((e + 120u) << 23) | (m << 20);
  float normal;
  std::memcpy(&normal, &bits, sizeof(float));
  const float sub = static_cast<float>(m) * 0x1p-9f;
  return e ? normal : (sign ? -sub : sub);
}

void fp8_gemv(const float* x, int64_t K, const uint8_t* w, const float* scale, float* y, int64_t n0, int64_t nb) {
  for (int64_t r = 0; r < nb; ++r) {
    const uint8_t* wr = w + (n0 + r) * K;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < K; ++k) acc += e4m3(wr[k]) * x[k];
    y[n0 + r] = acc * scale[n0 + r];
  }
}

}  // namespace

// x [M, K] float (other float dtypes are converted); w [N, K] float8_e4m3fn; scale [N] float.
at::Tensor fp8_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat8_e4m3fn && w.is_contiguous(),
              "w must be contiguous float8_e4m3fn [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat, "scale must be float [", N, "]");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "x must be [M, ", K, "], got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor s = scale.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* sp = s.data_ptr<float>();
  const int64_t items = (N + FP8_ROWS_PER_ITEM - 1) / FP8_ROWS_PER_ITEM;
  if (M <= FP8_DECODE_MAX_ROWS) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x.data_ptr<float>() + m * K;
      float* ym = y.data_ptr<float>() + m * N;
      at::parallel_for(0, items, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t n0 = t * FP8_ROWS_PER_ITEM;
          fp8_gemv(xm, K, wp, sp, ym, n0, std::min<int64_t>(FP8_ROWS_PER_ITEM, N - n0));
        }
      });
    }
  } else {
    at::Tensor wf = at::empty({N, K}, x.options());
    float* dst = wf.data_ptr<float>();
    at::parallel_for(0, N, FP8_ROWS_PER_ITEM, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* src = wp + r * K;
        float* d = dst + r * K;
        const float sc = sp[r];
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) d[k] = e4m3(src[k]) * sc;
      }
    });
    at::mm_out(y, x, wf.t());
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  m.impl("fp8_linear", c10::DispatchKey::CPU, &tokenmill::fp8_linear);
}
