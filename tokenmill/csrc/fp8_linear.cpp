// FP8 linear: y = x W^T with W float8_e4m3fn [N, K] (1 byte a weight) and a float scale per output row.
// Decode (1-2 rows of x): weight bytes are widened to floats in registers (AVX2 + F16C: 8 at a time, see
// e4m3x8; elsewhere a 256-float table) and multiplied at once, reading the bytes once, rows split over
// threads. More rows: the weight is converted
// to float once per call (rows in parallel) and ATen's SGEMM multiplies. e4m3fn has no infinities; its
// NaN encodings (0x7F, 0xFF) are not expected in weights and read as 480.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#endif

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

// All 256 codes as floats (1 KB, stays in L1): the portable path, and the tails of the vector path.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3(static_cast<uint8_t>(i));
  }
};
const E4m3Table& table() {
  static const E4m3Table t;
  return t;
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr int64_t V = 8;
// 8 e4m3 bytes -> 8 floats / 256: e4m3 is fp16 with the exponent field cut to 4 bits, so shifting the
// bits into place gives an fp16 of 2^-8 times the value (subnormals included), and F16C converts it
// exactly. The 2^8 is folded into the row scale (a power of two: exact).
inline __m256 e4m3x8(const uint8_t* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
  return _mm256_cvtph_ps(h);
}
inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_hadd_ps(a, a);
  a = _mm_hadd_ps(a, a);
  return _mm_cvtss_f32(a);
}
#else
constexpr int64_t V = 0;  // no vector path: the table does everything
#endif

// Dot products of four weight rows with x, sharing each load of x.
inline void dot4(const float* x, int64_t K, const uint8_t* w0, int64_t ld, float* out) {
  const float* lut = table().v;
  int64_t k = 0;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + V <= K; k += V) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(e4m3x8(w0 + k), xv, a0);
    a1 = _mm256_fmadd_ps(e4m3x8(w0 + ld + k), xv, a1);
    a2 = _mm256_fmadd_ps(e4m3x8(w0 + 2 * ld + k), xv, a2);
    a3 = _mm256_fmadd_ps(e4m3x8(w0 + 3 * ld + k), xv, a3);
  }
  acc[0] = hsum(a0) * 256.f;
  acc[1] = hsum(a1) * 256.f;
  acc[2] = hsum(a2) * 256.f;
  acc[3] = hsum(a3) * 256.f;
#endif
  for (; k < K; ++k)
    for (int i = 0; i < 4; ++i) acc[i] += lut[w0[i * ld + k]] * x[k];
  for (int i = 0; i < 4; ++i) out[i] = acc[i];
}

void fp8_gemv(const float* x, int64_t K, const uint8_t* w, const float* scale, float* y, int64_t n0, int64_t nb) {
  const float* lut = table().v;
  int64_t r = 0;
  for (; r + 4 <= nb; r += 4) {
    float d[4];
    dot4(x, K, w + (n0 + r) * K, K, d);
    for (int i = 0; i < 4; ++i) y[n0 + r + i] = d[i] * scale[n0 + r + i];
  }
  for (; r < nb; ++r) {
    const uint8_t* wr = w + (n0 + r) * K;
    float a = 0.f;
    for (int64_t k = 0; k < K; ++k) a += lut[wr[k]] * x[k];
    y[n0 + r] = a * scale[n0 + r];
  }
}

// Row r of W as floats into d (scaled).
inline void dequant_row(const uint8_t* src, int64_t K, float sc, float* d) {
  const float* lut = table().v;
  int64_t k = 0;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  const __m256 s = _mm256_set1_ps(sc * 256.f);
  for (; k + V <= K; k += V) _mm256_storeu_ps(d + k, _mm256_mul_ps(e4m3x8(src + k), s));
#endif
  for (; k < K; ++k) d[k] = lut[src[k]] * sc;
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
        dequant_row(src, K, sp[r], d);
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
