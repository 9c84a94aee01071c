// Kernels of the interleaved-row (R16) layout of Q4_0 / Q4_1 / Q8_0 weights: see gguf_r16.h for the layout and why.
// One vector lane is one weight row, so 16 rows' dot products accumulate side by side in one register:
// - int8 activations: a block of 16 rows is four 64-byte loads; its low and high nibbles are eight vectors of
//   16 rows x 4 weights, each multiplied with 4 bytes of x broadcast to every lane by one vpdpbusd (16 rows x 4
//   products into 16 int32 lanes). Q4_0's -8 is folded into the integer accumulator's start (-8 * the block's sum
//   of x's quants), Q4_1's min is one FMA of the 16 rows' mins by the block's sum of x. Q8_0's signed weights
//   are flipped to unsigned (w + 128: one xor) and -128 times the block's sum of x's quants starts the sum.
// - float activations: each weight of 16 rows becomes a vector of floats by one shift and one permute from a
//   16-entry table (Q8_0: two shifts and a conversion), then one FMA with x's element broadcast.
// Measured on the Xeon of docs/performance.md; see there.
#include "gguf_r16.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include "int8_dot.h"
#define TOKENMILL_R16 1
#define TOKENMILL_R16_INLINE inline __attribute__((always_inline))
#endif

namespace tokenmill {
namespace r16 {
namespace {

constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;

// Software prefetch, in blocks ahead of the one being read (its 256 bytes of quants and 32 of scales).
// TOKENMILL_R16_PREFETCH_BLOCKS overrides it; 0 turns it off.
const int64_t PREFETCH_BLOCKS = [] {
  const char* v = std::getenv("TOKENMILL_R16_PREFETCH_BLOCKS");
  return v != nullptr ? std::max<int64_t>(0, std::atoll(v)) : int64_t{8};
}();

inline int64_t block_bytes(int64_t base) { return base == Q4_1 ? 20 : base == Q8_0 ? 34 : 18; }
inline int64_t quant_bytes(int64_t base) { return base == Q8_0 ? 32 : 16; }  // a row's quants per block
// Bytes of a group's scales (and mins) before its quants.
inline int64_t header_bytes(int64_t base, int64_t nb) { return (base == Q4_1 ? 4 : 2) * ROWS * nb; }
inline int64_t group_bytes(int64_t base, int64_t nb) { return ROWS * nb * block_bytes(base); }

#ifdef TOKENMILL_R16
inline __m512 f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Block b + PREFETCH_BLOCKS of a group on its way (past the group's end: the next group's bytes, or nothing).
template <int C>  // 64-byte vectors per block of 16 rows: 4 (Q4_0 / Q4_1) or 8 (Q8_0)
TOKENMILL_R16_INLINE void prefetch(const uint8_t* g, const uint8_t* qs, int64_t b) {
  if (PREFETCH_BLOCKS == 0) return;
  const uint8_t* q = qs + 64 * C * (b + PREFETCH_BLOCKS);
  for (int j = 0; j < C; ++j) _mm_prefetch(reinterpret_cast<const char*>(q + 64 * j), _MM_HINT_T0);
  if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(g + 32 * (b + PREFETCH_BLOCKS)), _MM_HINT_T0);
}

inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One group against MR rows of quantized x (xq: K apart; xd, xs, xo: nb apart, from row m0). y: this group's
// 16 outputs of the first row, N apart. xo: the integer accumulator's start per block, the offset that makes
// the weights unsigned for vpdpbusd (Q4_0: -8 * the block's sum of x's quants; Q8_0: its weights are flipped to
// w + 128, -128 * that sum; Q4_1: 0, its min is a float term).
template <int MR, int64_t BASE>
void group_x8(const uint8_t* g, int64_t nb, const int8_t* xq, int64_t K, const float* xd, const float* xs,
              const int32_t* xo, float* y, int64_t N) {
  constexpr int C = BASE == Q8_0 ? 8 : 4;
  const uint8_t* qs = g + header_bytes(BASE, nb);
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + 64 * C * b;
    prefetch<C>(g, qs, b);
    __m512i w[8];  // the block's weights of 16 rows: vector j holds weights 4j..4j+3 of every row
    for (int j = 0; j < C; ++j) {
      const __m512i raw = _mm512_loadu_si512(q + 64 * j);
      if (BASE == Q8_0) {
        w[j] = _mm512_xor_si512(raw, flip);
      } else {
        w[j] = _mm512_and_si512(raw, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
    }
    const __m512 dw = f16x16(g + 32 * b);
    for (int m = 0; m < MR; ++m) {
      const int8_t* xb = xq + m * K + 32 * b;
      // Two chains of four dot products each.
      __m512i a0 = BASE == Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(xo[m * nb + b]);
      __m512i a1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        a0 = _mm512_dpbusd_epi32(a0, w[j], bcast4(xb + 4 * j));
        a1 = _mm512_dpbusd_epi32(a1, w[j + 1], bcast4(xb + 4 * j + 4));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(xd[m * nb + b])), acc[m]);
      if (BASE == Q4_1) acc[m] = _mm512_fmadd_ps(f16x16(g + 32 * nb + 32 * b), _mm512_set1_ps(xs[m * nb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * N, acc[m]);
}

// One group against MR rows of float x (K apart; xsum: per-block sums of x, nb apart, Q4_1's min term).
// Per block and row of x, four chains of eight FMAs (weights 4j+k and 16+4j+k for even and odd j), added in one
// fixed order, then scaled.
template <int MR, int64_t BASE>
void group_f32(const uint8_t* g, int64_t nb, const float* x, int64_t K, const float* xsum, float* y, int64_t N) {
  constexpr int C = BASE == Q8_0 ? 8 : 4;
  const uint8_t* qs = g + header_bytes(BASE, nb);
  // vpermps reads the low 4 bits of each lane: a shift puts any nibble there, no mask needed.
  const __m512 table = BASE == Q4_1 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                    : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + 64 * C * b;
    prefetch<C>(g, qs, b);
    __m512 t[MR][4];
    for (int m = 0; m < MR; ++m) t[m][0] = t[m][1] = t[m][2] = t[m][3] = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const int c = 2 * (j & 1);
      if (BASE == Q8_0) {  // weights 4j+k (vector j) and 16+4j+k (vector j + 4): a byte sign-extended by shifts
        const __m512i lo = _mm512_loadu_si512(q + 64 * j), hi = _mm512_loadu_si512(q + 64 * (j + 4));
        for (int k = 0; k < 4; ++k) {
          const __m512 wl = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lo, 24 - 8 * k), 24));
          const __m512 wh = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(hi, 24 - 8 * k), 24));
          for (int m = 0; m < MR; ++m) {
            const float* xb = x + m * K + 32 * b;
            t[m][c] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xb[4 * j + k]), t[m][c]);
            t[m][c + 1] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xb[16 + 4 * j + k]), t[m][c + 1]);
          }
        }
        continue;
      }
      const __m512i raw = _mm512_loadu_si512(q + 64 * j);
      for (int k = 0; k < 4; ++k) {
        const __m512 wl = _mm512_permutexvar_ps(k == 0 ? raw : _mm512_srli_epi32(raw, 8 * k), table);
        const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * k + 4), table);
        for (int m = 0; m < MR; ++m) {
          const float* xb = x + m * K + 32 * b;
          t[m][c] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xb[4 * j + k]), t[m][c]);
          t[m][c + 1] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xb[16 + 4 * j + k]), t[m][c + 1]);
        }
      }
    }
    const __m512 dw = f16x16(g + 32 * b);
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_add_ps(_mm512_add_ps(t[m][0], t[m][1]), _mm512_add_ps(t[m][2], t[m][3]));
      acc[m] = _mm512_fmadd_ps(s, dw, acc[m]);
      if (BASE == Q4_1) acc[m] = _mm512_fmadd_ps(f16x16(g + 32 * nb + 32 * b), _mm512_set1_ps(xsum[m * nb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * N, acc[m]);
}

template <int64_t BASE>
void groups_x8(int64_t mr, const uint8_t* g, int64_t nb, const int8_t* xq, int64_t K, const float* xd,
               const float* xs, const int32_t* xo, float* y, int64_t N) {
  switch (mr) {
    case 1: return group_x8<1, BASE>(g, nb, xq, K, xd, xs, xo, y, N);
    case 2: return group_x8<2, BASE>(g, nb, xq, K, xd, xs, xo, y, N);
    case 3: return group_x8<3, BASE>(g, nb, xq, K, xd, xs, xo, y, N);
    default: return group_x8<4, BASE>(g, nb, xq, K, xd, xs, xo, y, N);
  }
}

template <int64_t BASE>
void groups_f32(int64_t mr, const uint8_t* g, int64_t nb, const float* x, int64_t K, const float* xsum, float* y,
                int64_t N) {
  switch (mr) {
    case 1: return group_f32<1, BASE>(g, nb, x, K, xsum, y, N);
    case 2: return group_f32<2, BASE>(g, nb, x, K, xsum, y, N);
    case 3: return group_f32<3, BASE>(g, nb, x, K, xsum, y, N);
    default: return group_f32<4, BASE>(g, nb, x, K, xsum, y, N);
  }
}
#endif

constexpr int64_t MR_MAX = 4;  // rows of x per pass over a group

void check(int64_t base, int64_t N, int64_t K) {
  TORCH_CHECK(base == Q4_0 || base == Q4_1 || base == Q8_0, "gguf r16: no interleaved kernel for ggml type ", base);
  TORCH_CHECK(N % ROWS == 0 && K % 32 == 0, "gguf r16: N=", N, " and K=", K, " must be multiples of 16 and 32");
#ifndef TOKENMILL_R16
  TORCH_CHECK(false, "gguf r16: this build has no AVX-512 VNNI kernels for interleaved rows");
#endif
}

int64_t grain(int64_t base, int64_t nb, int64_t min_bytes) {
  return std::max<int64_t>(1, min_bytes / group_bytes(base, nb));
}

}  // namespace

bool available() {
#ifdef TOKENMILL_R16
  return true;
#else
  return false;
#endif
}

void gemv_f32(int64_t base, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
              int64_t min_bytes) {
  check(base, N, K);
#ifdef TOKENMILL_R16
  const int64_t nb = K / 32, gb = group_bytes(base, nb);
  std::vector<float> xsum(base == Q4_1 ? M * nb : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
    float s = 0.f;
    for (int k = 0; k < 32; ++k) s += x[i * 32 + k];
    xsum[i] = s;
  }
  at::parallel_for(0, N / ROWS, grain(base, nb, min_bytes), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int64_t mr = std::min(MR_MAX, M - m0);
        float* yg = y + m0 * N + g * ROWS;
        const uint8_t* grp = w + g * gb;
        if (base == Q4_1) groups_f32<Q4_1>(mr, grp, nb, x + m0 * K, K, xsum.data() + m0 * nb, yg, N);
        else if (base == Q8_0) groups_f32<Q8_0>(mr, grp, nb, x + m0 * K, K, nullptr, yg, N);
        else groups_f32<Q4_0>(mr, grp, nb, x + m0 * K, K, nullptr, yg, N);
      }
  });
#else
  (void)w, (void)x, (void)M, (void)y, (void)min_bytes;
#endif
}

void gemm_x8(int64_t base, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
             int64_t min_bytes) {
  check(base, N, K);
#ifdef TOKENMILL_R16
  const int64_t nb = K / 32, gb = group_bytes(base, nb);
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  std::vector<int32_t> xo(M * nb);
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t a, int64_t b) {
    x8::quantize(x + a * K, b - a, K, xq.data() + a * K, xd.data() + a * nb, xs.data() + a * nb);
    const int32_t shift = base == Q8_0 ? 128 : 8;  // the weights' offset from unsigned (group_x8)
    for (int64_t i = a * nb; i < b * nb; ++i) {
      int32_t s = 0;
      for (int k = 0; k < 32; ++k) s += xq[i * 32 + k];
      xo[i] = -shift * s;
    }
  });
  at::parallel_for(0, N / ROWS, grain(base, nb, min_bytes / std::max<int64_t>(1, M)), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int64_t mr = std::min(MR_MAX, M - m0);
        const int64_t o = m0 * nb;
        float* yg = y + m0 * N + g * ROWS;
        const uint8_t* grp = w + g * gb;
        const int8_t* q = xq.data() + m0 * K;
        if (base == Q4_1) groups_x8<Q4_1>(mr, grp, nb, q, K, xd.data() + o, xs.data() + o, xo.data() + o, yg, N);
        else if (base == Q8_0) groups_x8<Q8_0>(mr, grp, nb, q, K, xd.data() + o, xs.data() + o, xo.data() + o, yg, N);
        else groups_x8<Q4_0>(mr, grp, nb, q, K, xd.data() + o, xs.data() + o, xo.data() + o, yg, N);
      }
  });
#else
  (void)w, (void)x, (void)M, (void)y, (void)min_bytes;
#endif
}

#ifdef TOKENMILL_R16
namespace {
// float -> bfloat16, round to nearest even (NaN stays NaN): 16 lanes into 16 halves.
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i r = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// A 16 x 16 matrix of 32-bit elements, one row a register, transposed in place (columns become registers).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
  }
}

// Weight k of a block for the group's 16 rows (lane r: row r), as floats.
template <int64_t BASE>
TOKENMILL_R16_INLINE void block_weights(const uint8_t* q, __m512 d, __m512 m, __m512* w) {
  if (BASE == Q8_0) {  // weights 4j+k (vector j) and 16+4j+k (vector j + 4)
    for (int j = 0; j < 4; ++j) {
      const __m512i lo = _mm512_loadu_si512(q + 64 * j), hi = _mm512_loadu_si512(q + 64 * (j + 4));
      for (int k = 0; k < 4; ++k) {
        w[4 * j + k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lo, 24 - 8 * k), 24)), d);
        w[16 + 4 * j + k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(hi, 24 - 8 * k), 24)), d);
      }
    }
    return;
  }
  const __m512 table = BASE == Q4_1 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                    : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  for (int j = 0; j < 4; ++j) {
    const __m512i raw = _mm512_loadu_si512(q + 64 * j);
    for (int k = 0; k < 4; ++k) {
      const __m512 wl = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * k), table);
      const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * k + 4), table);
      // d * q is exact in float (an f16 times a 4-bit integer), so the min's add is the only rounding, as in the
      // split rows' dequantizer.
      w[4 * j + k] = BASE == Q4_1 ? _mm512_add_ps(_mm512_mul_ps(wl, d), m) : _mm512_mul_ps(wl, d);
      w[16 + 4 * j + k] = BASE == Q4_1 ? _mm512_add_ps(_mm512_mul_ps(wh, d), m) : _mm512_mul_ps(wh, d);
    }
  }
}

// One group into 16 rows of bf16 (ld apart). Per block: its 32 weights of 16 rows, rounded to bf16, weights 2i and
// 2i+1 paired into 32-bit elements (unpack works within 128-bit lanes: the pairs of rows 0-3, 8-11 from the low
// unpack, 4-7, 12-15 from the high one), and the 16 x 16 matrix of pairs transposed into one register per row.
template <int64_t BASE>
void group_bf16(const uint8_t* g, int64_t nb, uint16_t* out, int64_t ld) {
  constexpr int C = BASE == Q8_0 ? 8 : 4;
  static constexpr int ROW_OF_LANE[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  const uint8_t* qs = g + header_bytes(BASE, nb);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 d = f16x16(g + 32 * b);
    const __m512 m = BASE == Q4_1 ? f16x16(g + 32 * nb + 32 * b) : _mm512_setzero_ps();
    __m512 w[32];
    block_weights<BASE>(qs + 64 * C * b, d, m, w);
    __m512i pairs[16];
    for (int i = 0; i < 16; ++i) {
      const __m256i even = to_bf16(w[2 * i]), odd = to_bf16(w[2 * i + 1]);
      pairs[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(even, odd)),
                                    _mm256_unpackhi_epi16(even, odd), 1);
    }
    transpose16(pairs);
    for (int lane = 0; lane < 16; ++lane) _mm512_storeu_si512(out + ROW_OF_LANE[lane] * ld + 32 * b, pairs[lane]);
  }
}
}  // namespace
#endif

void dequant_bf16(int64_t base, const uint8_t* w, int64_t g0, int64_t g1, int64_t K, uint16_t* out, int64_t ld) {
  check(base, ROWS * g1, K);
#ifdef TOKENMILL_R16
  const int64_t nb = K / 32, gb = group_bytes(base, nb);
  for (int64_t g = g0; g < g1; ++g) {
    uint16_t* o = out + ROWS * (g - g0) * ld;
    if (base == Q4_1) group_bf16<Q4_1>(w + g * gb, nb, o, ld);
    else if (base == Q8_0) group_bf16<Q8_0>(w + g * gb, nb, o, ld);
    else group_bf16<Q4_0>(w + g * gb, nb, o, ld);
  }
#else
  (void)w, (void)g0, (void)out, (void)ld;
#endif
}

void split_row(int64_t base, const uint8_t* w, int64_t n, int64_t K, uint8_t* out) {
  const int64_t nb = K / 32, r = n % ROWS;
  const uint8_t* g = w + (n / ROWS) * group_bytes(base, nb);
  const int64_t heads = base == Q4_1 ? 2 : 1;  // f16 scales, then (Q4_1) f16 mins
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t b = 0; b < nb; ++b) std::memcpy(out + 2 * (h * nb + b), g + 32 * (h * nb + b) + 2 * r, 2);
  const uint8_t* qs = g + header_bytes(base, nb);
  uint8_t* oq = out + 2 * heads * nb;
  const int64_t qb = quant_bytes(base), c = qb / 4;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t j = 0; j < c; ++j) std::memcpy(oq + qb * b + 4 * j, qs + 64 * c * b + 64 * j + 4 * r, 4);
}

}  // namespace r16
}  // namespace tokenmill
