// Linear layers over packed weights: y = x W^T with W as int8 rows (a scale each) or int4 groups (a scale
// and zero point each). Three paths, by the number of rows of x (packed_linear):
// - decode (1-2 rows): each format's kernel widens the packed values in registers and multiplies at once,
//   reading the packed bytes once: bandwidth-bound, as decoding is;
// - 3-7 rows: tiles of TILE_ROWS weight rows dequantized into an L1-sized buffer, transposed, and multiplied
//   by a register-blocked broadcast micro-kernel;
// - 8 rows and more: panels of weight rows dequantized into L2 and multiplied by ATen's SGEMM.
// Opt-in (--activation-quantization int8): every row of x quantized to int8, integer dot products (int8_dot.h),
// any number of rows, each row's result independent of the others (gemm_x8).
#include "vec.h"
#include "panel_gemm.h"
#include "int8_dot.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENMILL_AVX2_INTRINSICS 1
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace tokenmill {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t TILE_ROWS = 16;     // weight rows dequantized per tile
constexpr int64_t GEMM_MIN_ROWS = 8;  // from this many rows of x on, dequantized panels and SGEMM
constexpr int64_t DECODE_MAX_ROWS = 2;  // up to this many rows of x, the format's own decode kernel
constexpr int64_t DECODE_ROWS = 64;   // weight rows per decode work item

// Batches: the tile transposed to [K, TILE_ROWS], and MR rows of x at a time against all TILE_ROWS weight
// rows: vectors run along the output rows, x[m, k] is broadcast (the classic GEMM micro-kernel; no
// horizontal sums, MR x TILE_ROWS/V accumulators stay in registers).
template <int MR>
inline void micro_t(const float* x, int64_t K, const float* tile_t, float* y, int64_t ldy, int64_t nb) {
  constexpr int64_t NV = TILE_ROWS / Vec::size() > 0 ? TILE_ROWS / Vec::size() : 1;
  Vec acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Vec(0.f);
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Vec::loadu(tile_t + k * TILE_ROWS + j * Vec::size());
    for (int i = 0; i < MR; ++i) {
      const Vec xb(x[i * K + k]);
      for (int j = 0; j < NV; ++j) acc[i][j] = at::vec::fmadd(xb, wv[j], acc[i][j]);
    }
  }
  float out[TILE_ROWS];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) acc[i][j].store(out + j * Vec::size());
    std::copy(out, out + nb, y + i * ldy);
  }
}

// Multiplies all M rows of x (M > DECODE_MAX_ROWS) with one dequantized tile (rows n0 .. n0 + nb of the
// output). `tile_t` is scratch of TILE_ROWS * K floats for the transposed tile.
void tile_gemm(const float* x, int64_t M, int64_t K, const float* tile, int64_t nb, float* y, int64_t N,
               int64_t n0, float* tile_t) {
  for (int64_t r = 0; r < TILE_ROWS; ++r)
    for (int64_t k = 0; k < K; ++k) tile_t[k * TILE_ROWS + r] = tile[r * K + k];
  constexpr int MRB = 6;
  int64_t m0 = 0;
  for (; m0 + MRB <= M; m0 += MRB) micro_t<MRB>(x + m0 * K, K, tile_t, y + m0 * N + n0, N, nb);
  switch (M - m0) {
    case 5: micro_t<5>(x + m0 * K, K, tile_t, y + m0 * N + n0, N, nb); break;
    case 4: micro_t<4>(x + m0 * K, K, tile_t, y + m0 * N + n0, N, nb); break;
    case 3: micro_t<3>(x + m0 * K, K, tile_t, y + m0 * N + n0, N, nb); break;
    case 2: micro_t<2>(x + m0 * K, K, tile_t, y + m0 * N + n0, N, nb); break;
    case 1: micro_t<1>(x + m0 * K, K, tile_t, y + m0 * N + n0, N, nb); break;
    default: break;
  }
}

// y = x W^T for a packed W. Up to DECODE_MAX_ROWS rows of x, `decode(xm, ym)` computes one row of y from
// one row of x with the format's own kernel; beyond, `dequant(n0, nb, dst)` writes rows n0 .. n0 + nb of W
// as floats, tile by tile (then tile_gemm) or all at once for ATen's SGEMM from GEMM_MIN_ROWS rows on.
template <typename Dequant, typename Decode>
at::Tensor packed_linear(const at::Tensor& x_in, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                         Dequant dequant, Decode decode) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "x must be [M, ", K, "], got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
  if (M <= DECODE_MAX_ROWS) {
    for (int64_t m = 0; m < M; ++m) decode(xp + m * K, yp + m * N);
  } else if (M >= GEMM_MIN_ROWS) {
    // Compute-bound: panels of dequantized weight rows, each multiplied by all of x with SGEMM (panel_gemm.h).
    panel_sgemm(x, y, N, K, TILE_ROWS, [&](int64_t n0, int64_t nb, float* out) {
      for (int64_t r = 0; r < nb; r += TILE_ROWS) dequant(n0 + r, std::min<int64_t>(TILE_ROWS, nb - r), out + r * K);
    });
  } else {
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> tile(TILE_ROWS * K, 0.f), tile_t(TILE_ROWS * K);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * TILE_ROWS;
        const int64_t nb = std::min<int64_t>(TILE_ROWS, N - n0);
        dequant(n0, nb, tile.data());
        tile_gemm(xp, M, K, tile.data(), nb, yp, N, n0, tile_t.data());
      }
    });
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y;
}

// Calls fn(n0, nb) over the N output rows in DECODE_ROWS items, in parallel.
template <typename Fn>
void over_rows(int64_t N, Fn fn) {
  at::parallel_for(0, (N + DECODE_ROWS - 1) / DECODE_ROWS, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(t * DECODE_ROWS, std::min<int64_t>(DECODE_ROWS, N - t * DECODE_ROWS));
  });
}

// Decode, one row of x: int8 rows straight into registers, no float tile: per 8 weights one widening load,
// one convert and one FMA per row of x, so the loop keeps up with memory. Four weight rows share each
// load of x; the row's scale multiplies the finished dot product.
void int8_gemv(const float* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t n0, int64_t nb) {
  int64_t r = 0;
  for (; r + 4 <= nb; r += 4) {
    const int8_t* w0 = w + (n0 + r) * K;
    const int8_t* w1 = w0 + K;
    const int8_t* w2 = w1 + K;
    const int8_t* w3 = w2 + K;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[k];
      a0 += static_cast<float>(w0[k]) * xv;
      a1 += static_cast<float>(w1[k]) * xv;
      a2 += static_cast<float>(w2[k]) * xv;
      a3 += static_cast<float>(w3[k]) * xv;
    }
    y[n0 + r] = a0 * scale[n0 + r];
    y[n0 + r + 1] = a1 * scale[n0 + r + 1];
    y[n0 + r + 2] = a2 * scale[n0 + r + 2];
    y[n0 + r + 3] = a3 * scale[n0 + r + 3];
  }
  for (; r < nb; ++r) {
    const int8_t* wr = w + (n0 + r) * K;
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t k = 0; k < K; ++k) a += static_cast<float>(wr[k]) * x[k];
    y[n0 + r] = a * scale[n0 + r];
  }
}

// Decode for int4 groups: x is split once into even and odd columns (xe, xo) so low and high nibbles
// multiply contiguous vectors; each group's (q - z) * s * x accumulates into a lane array that stays in
// registers across groups (no horizontal sum per group: groups are only 16 bytes).
void int4_gemv(const float* xe, const float* xo, int64_t K, int64_t group, const uint8_t* w, const float* scale,
               const float* zero, float* y, int64_t n0, int64_t nb) {
  const int64_t G = K / group, half = group / 2;
  for (int64_t r = 0; r < nb; ++r) {
    const uint8_t* wr = w + (n0 + r) * (K / 2);
    const float* sr = scale + (n0 + r) * G;
    const float* zr = zero + (n0 + r) * G;
    alignas(64) float lanes[64] = {0.f};
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = wr + g * half;
      const float* e = xe + g * half;
      const float* o = xo + g * half;
      const float sc = sr[g], z = zr[g];
#pragma omp simd aligned(lanes : 64)
      for (int64_t i = 0; i < half; ++i)
        lanes[i] += ((static_cast<float>(b[i] & 0xF) - z) * e[i] + (static_cast<float>(b[i] >> 4) - z) * o[i]) * sc;
    }
    float acc = 0.f;
    for (int64_t i = 0; i < half; ++i) acc += lanes[i];
    y[n0 + r] = acc;
  }
}

#ifdef TOKENMILL_AVX2_INTRINSICS
inline __m256 i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// int8_gemv by hand: 32 weights per step as four 8-wide widenings, two accumulator chains (even / odd steps)
// so consecutive FMAs do not wait on each other; the row's scale multiplies the finished sum.
void int8_gemv_avx2(const float* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t n0,
                    int64_t nb) {
  const int64_t K32 = K / 32 * 32;
  for (int64_t r = 0; r < nb; ++r) {
    const int8_t* wr = w + (n0 + r) * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < K32; k += 32) {
      a0 = _mm256_fmadd_ps(i8x8(wr + k), _mm256_loadu_ps(x + k), a0);
      a1 = _mm256_fmadd_ps(i8x8(wr + k + 8), _mm256_loadu_ps(x + k + 8), a1);
      a0 = _mm256_fmadd_ps(i8x8(wr + k + 16), _mm256_loadu_ps(x + k + 16), a0);
      a1 = _mm256_fmadd_ps(i8x8(wr + k + 24), _mm256_loadu_ps(x + k + 24), a1);
    }
    const __m256 acc = _mm256_add_ps(a0, a1);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    float total = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    for (; k < K; ++k) total += static_cast<float>(wr[k]) * x[k];
    y[n0 + r] = total * scale[n0 + r];
  }
}

// int4_gemv by hand. The group's 16 packed bytes are loaded into both 128-bit lanes and one byte shuffle
// spreads 8 of them over 8 int32 lanes; the low nibble (even column) is `& 15`, the high one (odd column)
// `>> 4`: 32 weights cost two shuffles (the port that limits widening) instead of six. Per group
// s * sum(q * x) accumulates in registers; the zero point's share, s * z * sum(x over the group), is one
// scalar FMA per group against the group sums of x computed once per call.
void int4_gemv_avx2(const float* xe, const float* xo, const float* xsum, int64_t K, int64_t group,
                    const uint8_t* w, const float* scale, const float* zero, float* y, int64_t n0, int64_t nb) {
  const int64_t G = K / group, half = group / 2;
  const __m256i lo_bytes = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i hi_bytes = _mm256_add_epi32(lo_bytes, _mm256_set1_epi32(8));  // -1 + 8 keeps bit 7 set
  const __m256i m15 = _mm256_set1_epi32(15);
  for (int64_t r = 0; r < nb; ++r) {
    const uint8_t* wr = w + (n0 + r) * (K / 2);
    const float* sr = scale + (n0 + r) * G;
    const float* zr = zero + (n0 + r) * G;
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      __m256 ga = _mm256_setzero_ps(), gb = _mm256_setzero_ps();
      for (int64_t i = g * half; i < (g + 1) * half; i += 16) {
        const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i)));
        const __m256i v0 = _mm256_shuffle_epi8(b, lo_bytes);  // bytes i .. i + 7 as int32
        const __m256i v1 = _mm256_shuffle_epi8(b, hi_bytes);  // bytes i + 8 .. i + 15
        ga = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, m15)), _mm256_loadu_ps(xe + i), ga);
        gb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_loadu_ps(xo + i), gb);
        ga = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, m15)), _mm256_loadu_ps(xe + i + 8), ga);
        gb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), _mm256_loadu_ps(xo + i + 8), gb);
      }
      acc = _mm256_fmadd_ps(_mm256_set1_ps(sr[g]), _mm256_add_ps(ga, gb), acc);
      off += sr[g] * zr[g] * xsum[g];
    }
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    y[n0 + r] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) - off;
  }
}
#endif

#ifdef TOKENMILL_INT8_DOT
// ---- int8 activations (--activation-quantization int8, int8_dot.h): any number of rows of x -----------------
// Every row of x is quantized on its own (per 32 columns) and each output is summed in one fixed order, so a
// row's result does not depend on how many other rows share the call, nor on the thread count: a request's
// greedy output is the same alone, batched or prefilled in chunks. MR rows of x share each weight block's load
// (and |w|, or the nibbles' unpacking); each row keeps its own accumulators and the same sequence of ops for
// every MR. Scalar sums are explicit fmas: a contracted `a += b * c` could round differently per instantiation.
constexpr int X8_ROWS = 4;                     // rows of x per pass over a weight row: 8 accumulators
constexpr int64_t X8_TILE_BYTES = 64 * 1024;  // one thread's weight rows per tile: stays in L2

// int8 weight row (K columns) against MR rows of quantized x (xq: K apart, xd: K / 32 apart). Per 32 weights
// one signed dot (|w| against x carrying w's sign, |w| computed once for the MR rows) times x's block scale;
// even and odd blocks in two accumulators. out: the unscaled sums.
template <int MR>
void int8_row_x8(const int8_t* wr, const int8_t* xq, const float* xd, int64_t K, float* out) {
  const int64_t G = K / 32;
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const auto step = [&](int64_t g, int p) TOKENMILL_INLINE {
    const __m256i w = x8::load32(wr + 32 * g);
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int m = 0; m < MR; ++m) {
      const __m256 dot = x8::dot_u8s8(aw, _mm256_sign_epi8(x8::load32(xq + m * K + 32 * g), w));
      acc[m][p] = _mm256_fmadd_ps(dot, _mm256_set1_ps(xd[m * G + g]), acc[m][p]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    step(g, 0);
    step(g + 1, 1);
  }
  if (g < G) step(g, 0);
  for (int m = 0; m < MR; ++m) out[m] = x8::hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
}

// int4 weight row (groups of a multiple of 32 columns): byte i of a 32-column block holds columns 2i (low
// nibble) and 2i + 1 (high), so each row of x is quantized with each block's even columns first, then its odd
// ones (xq), matching the nibbles' order. Per block s * d_x * dot; the zero point's share s * z * sum(x) per
// group, as int4_gemv_avx2, with the quantized x's group sums (xsum: K / group apart), so that the result is
// exactly x_quantized . W.
template <int MR>
void int4_row_x8(const uint8_t* wr, const float* sr, const float* zr, const int8_t* xq, const float* xd,
                 const float* xsum, int64_t K, int64_t group, float* out) {
  const int64_t G = K / group, B = K / 32;
  const int shift = group == 32 ? 0 : group == 64 ? 1 : group == 128 ? 2 : -1;  // blocks per group, as a shift
  const auto sc = [&](int64_t b) { return sr[shift >= 0 ? b >> shift : b * 32 / group]; };
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const auto step = [&](int64_t b, int p) TOKENMILL_INLINE {
    const __m256i w = x8::nibbles(wr + 16 * b);
    const float s = sc(b);
    for (int m = 0; m < MR; ++m) {
      const __m256 dot = x8::dot_u8s8(w, x8::load32(xq + m * K + 32 * b));
      acc[m][p] = _mm256_fmadd_ps(dot, _mm256_set1_ps(s * xd[m * B + b]), acc[m][p]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= B; b += 2) {
    step(b, 0);
    step(b + 1, 1);
  }
  if (b < B) step(b, 0);
  float off[MR];
  for (int m = 0; m < MR; ++m) off[m] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    const float sz = sr[g] * zr[g];
    for (int m = 0; m < MR; ++m) off[m] = std::fma(sz, xsum[m * G + g], off[m]);
  }
  for (int m = 0; m < MR; ++m) out[m] = x8::hsum(_mm256_add_ps(acc[m][0], acc[m][1])) - off[m];
}

// y[M, N] over quantized x: parallel over weight rows (row_bytes each); a thread walks its rows in tiles of
// X8_TILE_BYTES (kept in L2) and passes each tile once per X8_ROWS rows of x (kept in L1), so a prefill reads
// the weights from memory once, not once per row. row(MR, n, m0, out) computes y[m0 .. m0 + MR, n]; MR is an
// std::integral_constant, for the kernels' template argument.
template <typename Row>
void gemm_x8(int64_t N, int64_t M, int64_t row_bytes, float* yp, Row row) {
  const int64_t tile = std::max<int64_t>(1, X8_TILE_BYTES / row_bytes);
  const int64_t grain = std::max<int64_t>(1, DECODE_ROWS / M);  // a decode's items as over_rows'
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float out[X8_ROWS];
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += X8_ROWS) {
        const int64_t mr = std::min<int64_t>(X8_ROWS, M - m0);
        for (int64_t n = t0; n < t1; ++n) {
          switch (mr) {
            case 1: row(std::integral_constant<int, 1>(), n, m0, out); break;
            case 2: row(std::integral_constant<int, 2>(), n, m0, out); break;
            case 3: row(std::integral_constant<int, 3>(), n, m0, out); break;
            default: row(std::integral_constant<int, X8_ROWS>(), n, m0, out); break;
          }
          for (int64_t m = 0; m < mr; ++m) yp[(m0 + m) * N + n] = out[m];
        }
      }
    }
  });
}

// y = x W^T with every row of x quantized to int8: x and y as packed_linear's, then run(xp, M, yp) (quantizes
// x, once per call, and calls gemm_x8), then the bias, as there.
template <typename Run>
at::Tensor linear_x8(const at::Tensor& x_in, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias, Run run) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "x must be [M, ", K, "], got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  run(x.data_ptr<float>(), M, y.data_ptr<float>());
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y;
}

// Calls fn(m0, m1) over the rows of x (each row is quantized on its own), in parallel from X8_QUANT_FLOATS floats
// a thread on: quantizing is a few instructions a value, a decode batch's x is not worth waking the threads for.
constexpr int64_t X8_QUANT_FLOATS = 64 * 1024;
template <typename Fn>
void over_x_rows(int64_t M, int64_t K, Fn fn) {
  at::parallel_for(0, M, std::max<int64_t>(1, X8_QUANT_FLOATS / K), fn);
}
#endif

}  // namespace

// x [M, K] float, w [N, K] int8, scale [N] float (per output row, symmetric).
// int8_activations: with K a multiple of 32, every row of x is quantized to int8 and multiplied with integer
// dot products (int8_row_x8, gemm_x8); otherwise (or without AVX2) ignored.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool int8_activations) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat, "scale must be float [", N, "]");
  const at::Tensor s = scale.contiguous();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  const auto dequant = [&](int64_t n0, int64_t nb, float* tile) {
    for (int64_t r = 0; r < nb; ++r) {
      const int8_t* src = wp + (n0 + r) * K;
      float* dst = tile + r * K;
      const float sc = sp[n0 + r];
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(src[k]) * sc;
    }
  };
#ifdef TOKENMILL_INT8_DOT
  if (int8_activations && K % 32 == 0) {
    return linear_x8(x, N, K, bias, [&](const float* xp, int64_t M, float* yp) {
      const int64_t B = K / 32;
      std::vector<int8_t> xq(M * K);
      std::vector<float> xd(M * B);
      over_x_rows(M, K, [&](int64_t m0, int64_t m1) {
        x8::quantize(xp + m0 * K, m1 - m0, K, xq.data() + m0 * K, xd.data() + m0 * B);
      });
      gemm_x8(N, M, K, yp, [&](auto mr, int64_t n, int64_t m0, float* out) {
        constexpr int MR = decltype(mr)::value;
        int8_row_x8<MR>(wp + n * K, xq.data() + m0 * K, xd.data() + m0 * B, K, out);
        for (int m = 0; m < MR; ++m) out[m] *= sp[n];
      });
    });
  }
#else
  (void)int8_activations;
#endif
  return packed_linear(x, N, K, bias, dequant, [&](const float* xm, float* ym) {
    over_rows(N, [&](int64_t n0, int64_t nb) {
#ifdef TOKENMILL_AVX2_INTRINSICS
      return int8_gemv_avx2(xm, K, wp, sp, ym, n0, nb);
#endif
      int8_gemv(xm, K, wp, sp, ym, n0, nb);
    });
  });
}

// x [M, K] float; w [N, K / 2] uint8, two 4-bit values per byte (low nibble first, k even); per group of
// `group` columns a float scale and zero point ([N, K / group] each): value = (q - zero) * scale.
// int8_activations: with groups of a multiple of 32 columns, every row of x is quantized to int8 (int4_row_x8,
// gemm_x8); otherwise (or without AVX2) ignored.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& zero,
                       int64_t group, const c10::optional<at::Tensor>& bias, bool int8_activations) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 [N, K/2]");
  const int64_t N = w.size(0), K = w.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "group ", group, " must be even and divide K=", K);
  const int64_t G = K / group;
  TORCH_CHECK(scale.numel() == N * G && zero.numel() == N * G && scale.scalar_type() == at::kFloat &&
                  zero.scalar_type() == at::kFloat,
              "scale and zero must be float [", N, ", ", G, "]");
  const at::Tensor s = scale.contiguous(), z = zero.contiguous();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  const auto dequant = [&](int64_t n0, int64_t nb, float* tile) {
    for (int64_t r = 0; r < nb; ++r) {
      const uint8_t* src = wp + (n0 + r) * (K / 2);
      float* dst = tile + r * K;
      for (int64_t g = 0; g < G; ++g) {
        const float sc = sp[(n0 + r) * G + g];
        const float z = zp[(n0 + r) * G + g];
        const uint8_t* b = src + g * group / 2;
        float* d = dst + g * group;
        // (q - z) first: exact for these small integers, so a weight quantized to its zero point is 0.
#pragma omp simd
        for (int64_t i = 0; i < group / 2; ++i) {
          d[2 * i] = (static_cast<float>(b[i] & 0xF) - z) * sc;
          d[2 * i + 1] = (static_cast<float>(b[i] >> 4) - z) * sc;
        }
      }
    }
  };
#ifdef TOKENMILL_INT8_DOT
  if (int8_activations && group % 32 == 0) {
    return linear_x8(x, N, K, bias, [&](const float* xp, int64_t M, float* yp) {
      const int64_t B = K / 32;
      std::vector<int8_t> xq(M * K);
      std::vector<float> xd(M * B), xsum(M * G);
      over_x_rows(M, K, [&](int64_t m0, int64_t m1) {
        std::vector<float> xperm(K), xbs(B);
        for (int64_t m = m0; m < m1; ++m) {
          const float* xm = xp + m * K;
          for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < 16; ++i) {
              xperm[32 * b + i] = xm[32 * b + 2 * i];
              xperm[32 * b + 16 + i] = xm[32 * b + 2 * i + 1];
            }
          x8::quantize(xperm.data(), 1, K, xq.data() + m * K, xd.data() + m * B, xbs.data());
          for (int64_t g = 0; g < G; ++g) {
            float t = 0.f;
            for (int64_t b = g * group / 32; b < (g + 1) * group / 32; ++b) t += xbs[b];
            xsum[m * G + g] = t;
          }
        }
      });
      gemm_x8(N, M, K / 2 + 8 * G, yp, [&](auto mr, int64_t n, int64_t m0, float* out) {
        int4_row_x8<decltype(mr)::value>(wp + n * (K / 2), sp + n * G, zp + n * G, xq.data() + m0 * K,
                                         xd.data() + m0 * B, xsum.data() + m0 * G, K, group, out);
      });
    });
  }
#else
  (void)int8_activations;
#endif
  std::vector<float> xe(K / 2), xo(K / 2), xsum(G);
  return packed_linear(x, N, K, bias, dequant, [&](const float* xm, float* ym) {
    for (int64_t i = 0; i < K / 2; ++i) {
      xe[i] = xm[2 * i];
      xo[i] = xm[2 * i + 1];
    }
    for (int64_t g = 0; g < G; ++g) {
      float t = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) t += xm[k];
      xsum[g] = t;
    }
    over_rows(N, [&](int64_t n0, int64_t nb) {
#ifdef TOKENMILL_AVX2_INTRINSICS
      if (group % 32 == 0)
        return int4_gemv_avx2(xe.data(), xo.data(), xsum.data(), K, group, wp, sp, zp, ym, n0, nb);
#endif
      int4_gemv(xe.data(), xo.data(), K, group, wp, sp, zp, ym, n0, nb);
    });
  });
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias, bool int8_activations=False) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, &tokenmill::int8_linear);
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, Tensor zero, int group, Tensor? bias, "
        "bool int8_activations=False) -> Tensor");
  m.impl("int4_linear", c10::DispatchKey::CPU, &tokenmill::int4_linear);
}
