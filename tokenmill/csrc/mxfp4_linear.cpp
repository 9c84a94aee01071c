// MXFP4 linear: y = x W^T (+ bias) for W kept in OCP microscaling FP4 as gpt-oss checkpoints ship it
// (layers/quantization/mxfp4.py): blocks uint8 [N, K/32, 16], two e2m1 codes a byte (element 2i of a block in
// byte i's low nibble, 2i+1 in its high one), and scales uint8 [N, K/32], one e8m0 byte (2^(s-127)) a block.
// - Few rows of x (M < MXFP4_GEMM_MIN_ROWS, decode and small batches): each weight row is widened in registers
//   and multiplied at once with up to MR rows of x (8 with AVX-512, else 4), reading its bytes once per MR rows. The low nibbles of a
//   block are its even elements and the high nibbles its odd ones, so x is reordered once per call into that
//   order ([32 values] -> [16 even | 16 odd] per block) and the codes never need interleaving. AVX-512: a nibble
//   becomes its float by one permute from a 16-float table; AVX2: pshufb from a table of twice the values as
//   int8, widened (the 1/2 folded into the block's power of two). Every output element is computed by one
//   thread, in float32, in an order fixed by K alone: the result does not depend on the thread count, nor on M.
// - More rows: panels of weight rows decoded (in the same reordered columns) into a per-thread buffer that stays
//   in L2, each multiplied by all of the reordered x with SGEMM.
#include "vec.h"
#include "panel_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace tokenmill {
namespace {

constexpr int64_t BLOCK = 32;        // values per scale
constexpr int64_t BLOCK_BYTES = 16;  // their codes
// Rows of x sharing one pass over a weight row (their accumulators stay in registers: 2 a row).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int MR = 8;
#else
constexpr int MR = 4;
#endif
// From this many rows of x: decode panels, then SGEMM. Measured on gpt-oss's 5760 x 2880 gate_up and 2880 x 2880
// down shapes (2 threads, a quiet 2-core AVX-512 Xeon VM; docs/quantization.md): the register path is faster to
// 24 rows (gate_up 5.7-5.9 against 6.0-6.6 ms), SGEMM from 32 (7.4-7.5 against 7.7; down 3.5-3.8 against 3.9-4.0).
// TOKENMILL_MXFP4_GEMM_MIN_ROWS overrides it.
const int64_t MXFP4_GEMM_MIN_ROWS = [] {
  const char* v = std::getenv("TOKENMILL_MXFP4_GEMM_MIN_ROWS");
  return v != nullptr ? std::max<int64_t>(1, std::atoll(v)) : int64_t{32};
}();
constexpr int64_t PARALLEL_MIN_BYTES = 64 * 1024;  // smaller weights run on one thread (a wake-up costs more)

constexpr float FP4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// e8m0 -> float for all 256 bytes: 2^(s-127) (s = 0 is the subnormal 2^-127, s = 255 overflows to inf, as
// torch.exp2 on float32 gives). `half` holds 2^(s-128) for the AVX2 path's doubled integer table.
struct ScaleTable {
  float full[256];
  float half[256];
  ScaleTable() {
    for (int s = 0; s < 256; ++s) {
      full[s] = std::ldexp(1.0f, s - 127);
      half[s] = std::ldexp(1.0f, s - 128);
    }
  }
};
const ScaleTable& scales_table() {
  static const ScaleTable t;
  return t;
}

// x [M, K] -> the same rows with each block's values as [even elements | odd elements].
void reorder_x(const float* x, int64_t M, int64_t K, float* xd) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K; b += BLOCK) {
      const float* s = x + m * K + b;
      float* d = xd + m * K + b;
      for (int j = 0; j < 16; ++j) {
        d[j] = s[2 * j];
        d[16 + j] = s[2 * j + 1];
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline float acc_sum(Acc a, Acc b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
inline const float* block_scales() { return scales_table().full; }

// One block's 32 weights: (even elements, odd elements) as floats, unscaled.
TOKENMILL_INLINE inline void decode(const uint8_t* q, __m512* lo, __m512* hi) {
  const __m512 table = _mm512_loadu_ps(FP4);
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  *lo = _mm512_permutexvar_ps(e, table);  // the permute reads the low 4 bits of each index
  *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(e, 4), table);
}

// The block's power of two is applied to the decoded weights (exact), once for all R rows: two multiply-adds a
// row, one into each accumulator (even elements into a0, odd into a1).
template <int R>
TOKENMILL_INLINE inline void block_dot(const uint8_t* q, float s, const float* x, int64_t K, Acc* a0, Acc* a1) {
  __m512 lo, hi;
  decode(q, &lo, &hi);
  const __m512 sv = _mm512_set1_ps(s);
  lo = _mm512_mul_ps(lo, sv);
  hi = _mm512_mul_ps(hi, sv);
  for (int m = 0; m < R; ++m) {
    a0[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * K), a0[m]);
    a1[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * K + 16), a1[m]);
  }
}

// R rows of reordered x (xd, stride K) times weight row (q, sc) -> y[0], y[ldy], ...
template <int R>
void rows_dot(const uint8_t* q, const uint8_t* sc, int64_t G, const float* xd, int64_t K, float* y, int64_t ldy) {
  const float* S = block_scales();
  Acc a0[R], a1[R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = acc_zero();
  for (int64_t g = 0; g < G; ++g) block_dot<R>(q + g * BLOCK_BYTES, S[sc[g]], xd + g * BLOCK, K, a0, a1);
  for (int m = 0; m < R; ++m) y[m * ldy] = acc_sum(a0[m], a1[m]);
}

inline void decode_block(const uint8_t* q, float s, float* out) {
  __m512 lo, hi;
  decode(q, &lo, &hi);
  const __m512 sv = _mm512_set1_ps(s);
  _mm512_storeu_ps(out, _mm512_mul_ps(lo, sv));
  _mm512_storeu_ps(out + 16, _mm512_mul_ps(hi, sv));
}

#elif defined(CPU_CAPABILITY_AVX2)
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc a, Acc b) {
  const __m256 v = _mm256_add_ps(a, b);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}
inline const float* block_scales() { return scales_table().half; }  // the table below holds 2x the values

// One block's 32 weights as four vectors of 8 floats, twice their e2m1 values: even elements 0-7, 8-15, odd
// elements 0-7, 8-15 (the -0 code reads as +0: the same in any sum).
TOKENMILL_INLINE inline void decode(const uint8_t* q, __m256* w) {
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, nib));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), nib));
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

template <int R>
TOKENMILL_INLINE inline void block_dot(const uint8_t* q, float s, const float* x, int64_t K, Acc* acc) {
  __m256 w[4];
  decode(q, w);
  const __m256 sv = _mm256_set1_ps(s);
  for (int m = 0; m < R; ++m) {
    const float* xm = x + m * K;
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xm));
    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), t);
    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), t);
    t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), t);
    acc[m] = _mm256_fmadd_ps(t, sv, acc[m]);
  }
}

inline void decode_block(const uint8_t* q, float s, float* out) {  // s from block_scales(): 2^(e-128)
  __m256 w[4];
  decode(q, w);
  const __m256 sv = _mm256_set1_ps(s);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(w[i], sv));
}

#else
using Acc = float;
inline Acc acc_zero() { return 0.f; }
inline float acc_sum(Acc a, Acc b) { return a + b; }
inline const float* block_scales() { return scales_table().full; }

inline void decode_block(const uint8_t* q, float s, float* out) {
  for (int j = 0; j < 16; ++j) {
    out[j] = FP4[q[j] & 0x0F] * s;
    out[16 + j] = FP4[q[j] >> 4] * s;
  }
}

template <int R>
inline void block_dot(const uint8_t* q, float s, const float* x, int64_t K, Acc* acc) {
  float w[BLOCK];
  decode_block(q, 1.f, w);
  for (int m = 0; m < R; ++m) {
    float t = 0.f;
    for (int j = 0; j < BLOCK; ++j) t += w[j] * x[m * K + j];
    acc[m] += t * s;
  }
}
#endif

#if !defined(CPU_CAPABILITY_AVX512)
// R rows of reordered x (xd, stride K) times weight row (q, sc) -> y[0], y[ldy], ... Two accumulators per row
// of x (even and odd blocks) so consecutive blocks' multiply-adds do not wait on each other.
template <int R>
void rows_dot(const uint8_t* q, const uint8_t* sc, int64_t G, const float* xd, int64_t K, float* y, int64_t ldy) {
  const float* S = block_scales();
  Acc a0[R], a1[R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = acc_zero();
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    block_dot<R>(q + g * BLOCK_BYTES, S[sc[g]], xd + g * BLOCK, K, a0);
    block_dot<R>(q + (g + 1) * BLOCK_BYTES, S[sc[g + 1]], xd + (g + 1) * BLOCK, K, a1);
  }
  if (g < G) block_dot<R>(q + g * BLOCK_BYTES, S[sc[g]], xd + g * BLOCK, K, a0);
  for (int m = 0; m < R; ++m) y[m * ldy] = acc_sum(a0[m], a1[m]);
}
#endif

void decode_rows(const uint8_t* wq, const uint8_t* ws, int64_t N, int64_t K, const float* xd, int64_t M,
                 float* y) {
  const int64_t G = K / BLOCK, row_bytes = K / 2;
  const int64_t grain = N * (row_bytes + G) < PARALLEL_MIN_BYTES ? N : 16;
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* q = wq + n * row_bytes;
      const uint8_t* sc = ws + n * G;
      for (int64_t m = 0; m < M; m += MR) {
        const float* xm = xd + m * K;
        float* ym = y + m * N + n;
        switch (std::min<int64_t>(MR, M - m)) {
          case 8: rows_dot<8>(q, sc, G, xm, K, ym, N); break;
          case 7: rows_dot<7>(q, sc, G, xm, K, ym, N); break;
          case 6: rows_dot<6>(q, sc, G, xm, K, ym, N); break;
          case 5: rows_dot<5>(q, sc, G, xm, K, ym, N); break;
          case 4: rows_dot<4>(q, sc, G, xm, K, ym, N); break;
          case 3: rows_dot<3>(q, sc, G, xm, K, ym, N); break;
          case 2: rows_dot<2>(q, sc, G, xm, K, ym, N); break;
          default: rows_dot<1>(q, sc, G, xm, K, ym, N); break;
        }
      }
    }
  });
}

void gemm_panels(const uint8_t* wq, const uint8_t* ws, int64_t N, int64_t K, const at::Tensor& xd, at::Tensor& y) {
  const int64_t G = K / BLOCK, row_bytes = K / 2;
  const float* S = block_scales();
  panel_sgemm(xd, y, N, K, 16, [&](int64_t n0, int64_t nb, float* out) {
    for (int64_t n = 0; n < nb; ++n) {
      const uint8_t* q = wq + (n0 + n) * row_bytes;
      const uint8_t* sc = ws + (n0 + n) * G;
      for (int64_t g = 0; g < G; ++g) decode_block(q + g * BLOCK_BYTES, S[sc[g]], out + n * K + g * BLOCK);
    }
  });
}

}  // namespace

// x [M, K] float (other float dtypes are converted); blocks uint8 [N, K/32, 16]; scales uint8 [N, K/32];
// bias [N] or None. Returns float32 [M, N].
at::Tensor mxfp4_linear(const at::Tensor& x_in, const at::Tensor& blocks, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == BLOCK_BYTES && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous(),
              "mxfp4_linear: blocks must be contiguous uint8 [N, K/32, 16], got ", blocks.sizes());
  const int64_t N = blocks.size(0), G = blocks.size(1), K = G * BLOCK;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == G && scales.scalar_type() == at::kByte &&
                  scales.is_contiguous(),
              "mxfp4_linear: scales must be contiguous uint8 [", N, ", ", G, "], got ", scales.sizes());
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "mxfp4_linear: x must be [M, ", K, "], got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0 && K > 0) {
    at::Tensor xd = at::empty_like(x);
    reorder_x(x.data_ptr<float>(), M, K, xd.data_ptr<float>());
    const uint8_t* wq = blocks.data_ptr<uint8_t>();
    const uint8_t* ws = scales.data_ptr<uint8_t>();
    if (M < MXFP4_GEMM_MIN_ROWS) {
      decode_rows(wq, ws, N, K, xd.data_ptr<float>(), M, y.data_ptr<float>());
    } else {
      gemm_panels(wq, ws, N, K, xd, y);
    }
  } else if (M > 0 && N > 0) {
    y.zero_();  // K = 0: an empty sum
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y;
}

// The rows-of-x count from which mxfp4_linear decodes panels and multiplies them with SGEMM.
int64_t mxfp4_gemm_min_rows() { return MXFP4_GEMM_MIN_ROWS; }

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("mxfp4_linear(Tensor x, Tensor blocks, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("mxfp4_linear", c10::DispatchKey::CPU, &tokenmill::mxfp4_linear);
  m.def("mxfp4_gemm_min_rows() -> int", &tokenmill::mxfp4_gemm_min_rows);
}
