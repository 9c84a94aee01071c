// Linear layers over GGUF blocks kept as the file stores them: W is uint8 [N, row_bytes], each row the blocks
// of one output row (K / block_size blocks). Types: Q4_0, Q4_1, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K
// (super-blocks of 256); the layouts are the ones gguf-py's numpy dequantizers read.
// - Few rows of x (decode, M < GEMM_MIN_ROWS): the blocks are widened in registers and multiplied at once,
//   reading each weight byte once per call. Q4_0 / Q4_1 / Q8_0 are repacked at load into split rows (scales,
//   mins, then quants: split_rows_f32, four blocks per prefetch step into four accumulators; with AVX-512 a
//   nibble becomes a float by one permute from a table). K-quants decode their sub-block scales once per
//   super-block; their min/offset term is one multiply by the block's sum of x (xsum). Weights under
//   PARALLEL_MIN_BYTES run on one thread. From 2 rows of x over file-order blocks, each weight row is instead
//   dequantized once into an L1 buffer and multiplied with every row.
// - More rows: panels of weight rows dequantized into a per-thread L2-sized buffer, each multiplied by SGEMM.
// - bfloat16 batches (--quantized-batch-dtype bfloat16, off by default): from BF16_MIN_ROWS rows, panels of weight
//   rows dequantized into a per-thread bf16 buffer, each multiplied by bf16 GEMM (oneDNN: AMX or AVX-512 BF16
//   where the CPU has them); x and the result rounded to bf16.
// - int8 activations (--activation-quantization int8, off by default): rows of x against Q4_0 / Q4_1 / Q8_0
//   quantized to int8 and multiplied with integer dot products, any number of rows (gemm_x8, int8_dot.h).
#include "vec.h"
#include "int8_dot.h"
#include "gguf_r16.h"
#include "panel_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define TOKENMILL_GGUF_AVX2 1
#endif

namespace tokenmill {
namespace {

// ggml type ids (gguf.GGMLQuantizationType)
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Split rows: the kernels' own layout for Q4_0 / Q4_1 / Q8_0 (made at load by layers/quantization/gguf.py,
// split_rows): a row's bytes reordered as every block's f16 scale d, then (Q4_1) every block's f16 min m, then
// every block's quants. The scales convert 8 at a time and the min term is one vector dot per row, where the
// file's interleaved blocks cost two scalar f16 conversions and a scalar accumulate per block. Type id: SPLIT
// plus the ggml type. The batch-1 kernels read split rows directly; the other paths unsplit a row at a time.
constexpr int64_t SPLIT = 1000;

inline bool is_split(int64_t qt) { return qt == SPLIT + Q4_0 || qt == SPLIT + Q4_1 || qt == SPLIT + Q8_0; }
using r16::is_r16;  // interleaved rows (gguf_r16.h): 16 split rows interleaved for the batch-1 kernels
inline int64_t base_type(int64_t qt) { return is_split(qt) ? qt - SPLIT : is_r16(qt) ? qt - r16::R16 : qt; }
// Bytes of scales (and mins) before a split row's quants.
inline int64_t split_header(int64_t qt, int64_t nb) { return (base_type(qt) == Q4_1 ? 4 : 2) * nb; }

constexpr int64_t GEMM_MIN_ROWS = 8;         // from this many rows of x: dequantize, then SGEMM
// --quantized-batch-dtype bfloat16: from this many rows of x. The dequantization writes 2 bytes per weight (a
// fixed cost per call), which the bf16 GEMM's speed repays from ~30 rows on a 2048 x 8192 Q4_0 weight (AMX, Xeon).
constexpr int64_t BF16_MIN_ROWS = 32;
constexpr int64_t BF16_PANEL_BYTES = 1024 * 1024;  // one thread's panel of bf16 weight rows (256 rows at K 2048)
constexpr int64_t MAX_FUSED_ROWS = 4;        // rows of x sharing one pass over a weight row
// Decode: a weight smaller than this runs on one thread. Waking a second one costs microseconds on an idle
// machine and a scheduler time slice (milliseconds) when the other core is busy. Measured on SmolLM2 Q4_1
// (2 cores, AVX2, quiet): at 64 KiB the attention projections (207-345 KiB) split too and batch-1 decode
// runs 8 % faster than at 512 KiB; on a busy machine every split call risks the time slice.
// TOKENMILL_GGUF_PARALLEL_MIN_BYTES overrides it.
const int64_t PARALLEL_MIN_BYTES = [] {
  const char* v = std::getenv("TOKENMILL_GGUF_PARALLEL_MIN_BYTES");
  return v != nullptr ? std::max<int64_t>(1, std::atoll(v)) : int64_t{64 << 10};
}();

struct Format {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

Format format_of(int64_t qtype) {
  switch (base_type(qtype)) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "gguf: no block kernel for ggml type ", qtype);
  }
  return {0, 0};
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K / Q5_K: 8 sub-blocks of 32, a 6-bit scale and min each, packed into 12 bytes.
inline void k_scales(const uint8_t* s, float d, float dmin, float* sc, float* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = d * static_cast<float>(s[j] & 63);
    mn[j] = dmin * static_cast<float>(s[j + 4] & 63);
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = d * static_cast<float>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    mn[j] = dmin * static_cast<float>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// One block into `block` floats (the reference layout; also the SGEMM path's dequantizer).
void dequant_block(int64_t qt, const uint8_t* b, float* y) {
  switch (qt) {
    case Q4_0: {
      const float d = f16(b);
      const uint8_t* q = b + 2;
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>((q[i] & 0xF) - 8);
        y[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
      }
      break;
    }
    case Q4_1: {
      const float d = f16(b), m = f16(b + 2);
      const uint8_t* q = b + 4;
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>(q[i] & 0xF) + m;
        y[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
      }
      break;
    }
    case Q8_0: {
      const float d = f16(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(q[i]);
      break;
    }
    case Q4_K:
    case Q5_K: {
      float sc[8], mn[8];
      k_scales(b + 4, f16(b), f16(b + 2), sc, mn);
      const bool five = qt == Q5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; ++c) {
        const int j0 = 2 * c, j1 = 2 * c + 1;
        for (int l = 0; l < 32; ++l) {
          int q0 = qs[32 * c + l] & 0xF, q1 = qs[32 * c + l] >> 4;
          if (five) {
            q0 |= ((qh[l] >> j0) & 1) << 4;
            q1 |= ((qh[l] >> j1) & 1) << 4;
          }
          y[64 * c + l] = sc[j0] * static_cast<float>(q0) - mn[j0];
          y[64 * c + 32 + l] = sc[j1] * static_cast<float>(q1) - mn[j1];
        }
      }
      break;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 128; ++j) {
          const int s = j / 64, i = j % 64, k = j / 32, l = j % 32;
          const int q = ((ql[64 * h + i] >> (4 * s)) & 0xF) | (((qh[32 * h + l] >> (2 * k)) & 3) << 4);
          const int e = 128 * h + j;
          y[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(q - 32);
        }
      }
      break;
    }
    default: TORCH_CHECK(false, "gguf: no block kernel for ggml type ", qt);
  }
}

// A split row back in the file's block order (into `out`, row bytes).
void unsplit_row(int64_t qt, const Format& f, const uint8_t* row, int64_t nb, uint8_t* out) {
  const int64_t base = base_type(qt), q = f.bytes - (base == Q4_1 ? 4 : 2);  // quant bytes per block
  const uint8_t* quants = row + split_header(qt, nb);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = out + b * f.bytes;
    std::memcpy(o, row + 2 * b, 2);
    if (base == Q4_1) std::memcpy(o + 2, row + 2 * nb + 2 * b, 2);
    std::memcpy(o + f.bytes - q, quants + b * q, q);
  }
}

// Row n of a weight for the paths that dequantize rows: an interleaved row gathered into a per-thread buffer as a
// split row (qt becomes the split type), any other row where it lies.
const uint8_t* row_at(int64_t& qt, const Format& f, const uint8_t* wp, int64_t n, int64_t K) {
  if (!is_r16(qt)) return wp + n * (K / f.block) * f.bytes;
  thread_local std::vector<uint8_t> buf;
  buf.resize((K / f.block) * f.bytes);
  r16::split_row(base_type(qt), wp, n, K, buf.data());
  qt = SPLIT + base_type(qt);
  return buf.data();
}

// For the paths that read file-order blocks: a split row unsplit into a per-thread buffer, else the row itself.
const uint8_t* file_order(int64_t& qt, const Format& f, const uint8_t* row, int64_t nb) {
  if (!is_split(qt)) return row;
  thread_local std::vector<uint8_t> buf;
  buf.resize(nb * f.bytes);
  unsplit_row(qt, f, row, nb, buf.data());
  qt = base_type(qt);
  return buf.data();
}

void dequant_row(int64_t qt, const Format& f, const uint8_t* row, int64_t K, float* y) {
  row = file_order(qt, f, row, K / f.block);
  for (int64_t b = 0; b < K / f.block; ++b) dequant_block(qt, row + b * f.bytes, y + b * f.block);
}

// Rows of x summed per 32 columns: the offset terms' multiplier (xs[m * (K / 32) + g]).
std::vector<float> group_sums(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  std::vector<float> xs(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += x[m * K + g * 32 + i];
      xs[m * G + g] = s;
    }
  return xs;
}

// Portable decode path: one weight row dequantized into a buffer that stays in L1, dotted with each row of x.
void row_dot_generic(int64_t qt, const Format& f, const uint8_t* row, int64_t K, const float* x, int64_t M,
                     float* buf, float* out) {
  dequant_row(qt, f, row, K, buf);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t k = 0; k < K; ++k) a += buf[k] * xm[k];
    out[m] = a;
  }
}

#ifdef TOKENMILL_GGUF_AVX2
// Software prefetch of the weight stream. A decode GEMV reads each weight byte once; on the 2-vCPU VMs measured
// (Intel Xeon with AVX-512, 2026-12) the hardware prefetchers kept such a loop at 2-4 GB/s where plain streaming
// reads reach 14-21 GB/s, so a thread keeps a cursor PREFETCH_BYTES ahead of the byte it reads and prefetches
// each 64-byte line of its range once (docs/performance.md has the figures).
// TOKENMILL_GGUF_PREFETCH_BYTES overrides the distance; 0 turns it off.
const int64_t PREFETCH_BYTES = [] {
  const char* v = std::getenv("TOKENMILL_GGUF_PREFETCH_BYTES");
  return v != nullptr ? std::max<int64_t>(0, std::atoll(v)) : int64_t{2048};
}();

struct Ahead {
  const char* next;  // the next line to prefetch
  const char* stop;  // the end of the thread's rows: nothing past it
  int64_t dist;
  Ahead(const uint8_t* begin, const uint8_t* end)
      : next(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63})),
        stop(reinterpret_cast<const char*>(end)),
        dist(PREFETCH_BYTES) {
    if (dist == 0) stop = next;
  }
  // Everything up to p + dist prefetched (p: the byte about to be read).
  TOKENMILL_INLINE void upto(const void* p) {
    const char* up = std::min(stop, static_cast<const char*>(p) + dist);
    for (; next < up; next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 bytes -> 8 int32 lanes (zero- or sign-extended).
inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i i8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256 f32(__m256i v) { return _mm256_cvtepi32_ps(v); }

// The integer weights of 32 columns as 4 float vectors (columns 0..7, 8..15, 16..23, 24..31).
// Q4_0 / Q4_1: 16 bytes, low nibbles are columns 0..15, high nibbles 16..31.
inline void q4_block(const uint8_t* q, __m256* w) {
  const __m256i m15 = _mm256_set1_epi32(0xF);
  const __m256i e0 = u8x8(q), e1 = u8x8(q + 8);
  w[0] = f32(_mm256_and_si256(e0, m15));
  w[1] = f32(_mm256_and_si256(e1, m15));
  w[2] = f32(_mm256_srli_epi32(e0, 4));
  w[3] = f32(_mm256_srli_epi32(e1, 4));
}

inline void q8_block(const uint8_t* q, __m256* w) {
  for (int v = 0; v < 4; ++v) w[v] = f32(i8x8(q + 8 * v));
}

// Q4_K / Q5_K chunk c (columns 64c .. 64c + 63 of the super-block): sub-block 2c in wl (low nibbles of
// qs[32c ..]), 2c + 1 in wh (high nibbles); Q5_K adds bit 2c / 2c + 1 of qh[l] as the fifth bit. hi4: the
// 32 qh bytes widened and shifted left by 4 (so bit j lands on bit 4 after >> j).
inline void k4_chunk(const uint8_t* qs, int c, bool five, const __m256i* hi4, __m256* wl, __m256* wh) {
  const __m256i m15 = _mm256_set1_epi32(0xF), b16 = _mm256_set1_epi32(16);
  for (int v = 0; v < 4; ++v) {
    const __m256i e = u8x8(qs + 32 * c + 8 * v);
    __m256i lo = _mm256_and_si256(e, m15), hi = _mm256_srli_epi32(e, 4);
    if (five) {
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srli_epi32(hi4[v], 2 * c), b16));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi32(hi4[v], 2 * c + 1), b16));
    }
    wl[v] = f32(lo);
    wh[v] = f32(hi);
  }
}

inline void q5_high_bits(const uint8_t* qh, __m256i* hi4) {
  for (int v = 0; v < 4; ++v) hi4[v] = _mm256_slli_epi32(u8x8(qh + 8 * v), 4);
}

// Q6_K half h, p in {0, 1}: 32-column group k = p in wl (low nibbles of ql[32p ..], qh bits 2p) and k = p + 2
// in wh (high nibbles, qh bits 2p + 4), both minus 32. ql points at the half's 64 bytes, qh at its 4 widened
// vectors of 8 qh bytes.
inline void q6_pair(const uint8_t* ql, const __m256i* qh, int p, __m256* wl, __m256* wh) {
  const __m256i m15 = _mm256_set1_epi32(0xF), m3 = _mm256_set1_epi32(3), b32 = _mm256_set1_epi32(32);
  for (int v = 0; v < 4; ++v) {
    const __m256i e = u8x8(ql + 32 * p + 8 * v);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(e, m15),
                                       _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh[v], 2 * p), m3), 4));
    const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(e, 4),
                                       _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh[v], 2 * p + 4), m3), 4));
    wl[v] = f32(_mm256_sub_epi32(lo, b32));
    wh[v] = f32(_mm256_sub_epi32(hi, b32));
  }
}

// sum_v w[v] * x[8v ..] over 4 (dot4) or 2 (dot2) vectors.
inline __m256 dot4(const __m256* w, const float* x) {
  __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
  t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), t);
  t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), t);
  return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), t);
}

inline __m256 dot2(const __m256* w, const float* x) {
  return _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(x)));
}

// One weight row against MR rows of x (ldx apart). xs: per-32-column sums of x (ldxs apart). Two sets of
// accumulators (even / odd blocks or sub-blocks) so consecutive blocks do not wait on one FMA chain.
template <int MR>
void row_dot_avx2(int64_t qt, const Format& f, const uint8_t* row, int64_t K, const float* x, int64_t ldx,
                  const float* xs, int64_t ldxs, float* out, Ahead& pf) {
  const bool split = is_split(qt);
  if (split) pf.upto(row + (K / f.block) * f.bytes);  // read once, into a buffer, by file_order
  Ahead none(row, row);
  Ahead& ahead = split ? none : pf;  // (the loops below read that buffer: nothing of it to prefetch)
  row = file_order(qt, f, row, K / f.block);
  __m256 acc[2][MR];
  float off[2][MR];
  for (int p = 0; p < 2; ++p)
    for (int m = 0; m < MR; ++m) {
      acc[p][m] = _mm256_setzero_ps();
      off[p][m] = 0.f;
    }
  const int64_t nb = K / f.block;
  switch (qt) {
    case Q4_0:
    case Q4_1: {
      const bool has_min = qt == Q4_1;
      const auto step = [&](int64_t b, __m256* A, float* O) TOKENMILL_INLINE {
        const uint8_t* blk = row + b * f.bytes;
        const float d = f16(blk);
        const float o = has_min ? f16(blk + 2) : -8.f * d;
        __m256 w[4];
        q4_block(blk + (has_min ? 4 : 2), w);
        const __m256 vd = _mm256_set1_ps(d);
        for (int m = 0; m < MR; ++m) {
          A[m] = _mm256_fmadd_ps(vd, dot4(w, x + m * ldx + b * 32), A[m]);
          O[m] += o * xs[m * ldxs + b];
        }
      };
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {
        ahead.upto(row + b * f.bytes);
        step(b, acc[0], off[0]);
        step(b + 1, acc[1], off[1]);
      }
      if (b < nb) step(b, acc[0], off[0]);
      break;
    }
    case Q8_0: {
      const auto step = [&](int64_t b, __m256* A) TOKENMILL_INLINE {
        const uint8_t* blk = row + b * f.bytes;
        const __m256 vd = _mm256_set1_ps(f16(blk));
        __m256 w[4];
        q8_block(blk + 2, w);
        for (int m = 0; m < MR; ++m) A[m] = _mm256_fmadd_ps(vd, dot4(w, x + m * ldx + b * 32), A[m]);
      };
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {
        ahead.upto(row + b * f.bytes);
        step(b, acc[0]);
        step(b + 1, acc[1]);
      }
      if (b < nb) step(b, acc[0]);
      break;
    }
    case Q4_K:
    case Q5_K: {
      const bool five = qt == Q5_K;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * f.bytes;
        ahead.upto(blk);
        float sc[8], mn[8];
        k_scales(blk + 4, f16(blk), f16(blk + 2), sc, mn);
        __m256i hi4[4];
        if (five) q5_high_bits(blk + 16, hi4);
        const uint8_t* qs = blk + (five ? 48 : 16);
        for (int c = 0; c < 4; ++c) {
          __m256 wl[4], wh[4];
          k4_chunk(qs, c, five, hi4, wl, wh);
          const __m256 s0 = _mm256_set1_ps(sc[2 * c]), s1 = _mm256_set1_ps(sc[2 * c + 1]);
          const int64_t g = b * 8 + 2 * c;  // 32-column group of the low sub-block
          for (int m = 0; m < MR; ++m) {
            const float* xm = x + m * ldx + g * 32;
            acc[0][m] = _mm256_fmadd_ps(s0, dot4(wl, xm), acc[0][m]);
            acc[1][m] = _mm256_fmadd_ps(s1, dot4(wh, xm + 32), acc[1][m]);
            off[c & 1][m] -= mn[2 * c] * xs[m * ldxs + g] + mn[2 * c + 1] * xs[m * ldxs + g + 1];
          }
        }
      }
      break;
    }
    case Q6_K: {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * f.bytes;
        ahead.upto(blk);
        const int8_t* scl = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = f16(blk + 208);
        for (int h = 0; h < 2; ++h) {
          __m256i qh[4];
          for (int v = 0; v < 4; ++v) qh[v] = u8x8(blk + 128 + 32 * h + 8 * v);
          for (int p = 0; p < 2; ++p) {
            __m256 wl[4], wh[4];
            q6_pair(blk + 64 * h, qh, p, wl, wh);
            const int il = 8 * h + 2 * p, ih = 8 * h + 2 * (p + 2);  // scale of the first 16 columns
            const __m256 sl0 = _mm256_set1_ps(d * scl[il]), sl1 = _mm256_set1_ps(d * scl[il + 1]);
            const __m256 sh0 = _mm256_set1_ps(d * scl[ih]), sh1 = _mm256_set1_ps(d * scl[ih + 1]);
            for (int m = 0; m < MR; ++m) {
              const float* xl = x + m * ldx + b * 256 + 128 * h + 32 * p;
              const float* xh = xl + 64;
              acc[0][m] = _mm256_fmadd_ps(sl0, dot2(wl, xl), acc[0][m]);
              acc[1][m] = _mm256_fmadd_ps(sl1, dot2(wl + 2, xl + 16), acc[1][m]);
              acc[0][m] = _mm256_fmadd_ps(sh0, dot2(wh, xh), acc[0][m]);
              acc[1][m] = _mm256_fmadd_ps(sh1, dot2(wh + 2, xh + 16), acc[1][m]);
            }
          }
        }
      }
      break;
    }
    default: TORCH_CHECK(false, "gguf: no block kernel for ggml type ", qt);
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(_mm256_add_ps(acc[0][m], acc[1][m])) + (off[0][m] + off[1][m]);
}

// Batch 1, Q4_0 / Q4_1: two weight rows per pass share each load of x (held in registers) and keep two
// independent accumulator chains.
void q4_rows2(const Format& f, bool has_min, const uint8_t* r0, const uint8_t* r1, int64_t nb, const float* x,
              const float* xs, float* out, Ahead& pf) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  float o0 = 0.f, o1 = 0.f;
  const int64_t qoff = has_min ? 4 : 2;
  for (int64_t b = 0; b < nb; ++b) {
    pf.upto(r1 + b * f.bytes);
    const float* xb = x + b * 32;
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
                 x3 = _mm256_loadu_ps(xb + 24);
    const uint8_t* b0 = r0 + b * f.bytes;
    const uint8_t* b1 = r1 + b * f.bytes;
    const float d0 = f16(b0), d1 = f16(b1);
    __m256 w[4], v[4];
    q4_block(b0 + qoff, w);
    q4_block(b1 + qoff, v);
    __m256 t0 = _mm256_mul_ps(w[0], x0), t1 = _mm256_mul_ps(v[0], x0);
    t0 = _mm256_fmadd_ps(w[1], x1, t0);
    t1 = _mm256_fmadd_ps(v[1], x1, t1);
    t0 = _mm256_fmadd_ps(w[2], x2, t0);
    t1 = _mm256_fmadd_ps(v[2], x2, t1);
    t0 = _mm256_fmadd_ps(w[3], x3, t0);
    t1 = _mm256_fmadd_ps(v[3], x3, t1);
    a0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), t0, a0);
    a1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), t1, a1);
    const float s = xs[b];
    o0 += (has_min ? f16(b0 + 2) : -8.f * d0) * s;
    o1 += (has_min ? f16(b1 + 2) : -8.f * d1) * s;
  }
  out[0] = hsum(a0) + o0;
  out[1] = hsum(a1) + o1;
}

// f16 values h[0..n) as floats into out (8 at a time), each times mul[i] when mul is given.
void f16_row(const uint8_t* h, int64_t n, const float* mul, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * i)));
    if (mul != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(mul + i));
    _mm256_storeu_ps(out + i, v);
  }
  for (; i < n; ++i) out[i] = f16(h + 2 * i) * (mul != nullptr ? mul[i] : 1.f);
}

// sum_i f16(h[i]) * v[i]
float f16_dot(const uint8_t* h, int64_t n, const float* v) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * i))),
                        _mm256_loadu_ps(v + i), a);
  float r = hsum(a);
  for (; i < n; ++i) r = std::fma(f16(h + 2 * i), v[i], r);  // explicit: the int8 path's dot_f32 is the same sum
  return r;
}

// Float x against split rows (Q4_0 / Q4_1 / Q8_0), 1 to 4 rows of x per pass over a weight row (a decode,
// a few decodes, speculative drafts being verified). Each block of 32 weights is widened to floats once and
// dotted with every row of x; its scale multiplies the block's dot into one of four accumulators (block b
// into b % 4), and the loop takes 4 blocks per step of the prefetch cursor. Measured on the Xeon of
// docs/performance.md (1.7B Q4_0 shapes, 2 threads): two accumulators with the cursor advanced every 2 blocks
// ran at 13 GB/s, this shape at 20 (read bandwidth 30): the float path was bound by the loop's own work, not
// by memory. Every row's sum is kept in the same order whatever MR, so a row's result is bit for bit its
// MR == 1 one (a request answers the same alone and in a batch).
//
// With AVX-512 a block is two 16-float vectors; Q4_0 / Q4_1 nibbles become floats by one permute from a
// 16-entry table (Q4_0's table holds -8..7, so it has no offset term), where a conversion costs one more
// instruction per vector. With AVX2 a block is four 8-float vectors from integer conversions, and Q4_0's -8
// is one multiply by the block sums of x (xsum) per row.
#if defined(CPU_CAPABILITY_AVX512)
using BVec = __m512;
struct Block {
  __m512 lo, hi;  // columns 0..15, 16..31
};
inline BVec bzero() { return _mm512_setzero_ps(); }
inline BVec badd(BVec a, BVec b) { return _mm512_add_ps(a, b); }
inline float breduce(BVec a) { return _mm512_reduce_add_ps(a); }
inline Block widen(int64_t base, const uint8_t* qs, int64_t b) {
  if (base == Q8_0) {
    const uint8_t* q = qs + 32 * b;
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))))};
  }
  // vpermps reads the low 4 bits of each index: the low nibble needs no mask.
  const __m512 table = base == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                    : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * b)));
  return {_mm512_permutexvar_ps(e, table), _mm512_permutexvar_ps(_mm512_srli_epi32(e, 4), table)};
}
// acc + d * (w . x[0..32))
inline BVec bdot(const Block& w, const float* x, float d, BVec acc) {
  const __m512 t = _mm512_fmadd_ps(w.hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(w.lo, _mm512_loadu_ps(x)));
  return _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc);
}
constexpr bool Q4_0_HAS_OFFSET = false;
#else
using BVec = __m256;
struct Block {
  __m256 w[4];
};
inline BVec bzero() { return _mm256_setzero_ps(); }
inline BVec badd(BVec a, BVec b) { return _mm256_add_ps(a, b); }
inline float breduce(BVec a) { return hsum(a); }
inline Block widen(int64_t base, const uint8_t* qs, int64_t b) {
  Block k;
  if (base == Q8_0) q8_block(qs + 32 * b, k.w);
  else q4_block(qs + 16 * b, k.w);
  return k;
}
inline BVec bdot(const Block& w, const float* x, float d, BVec acc) {
  return _mm256_fmadd_ps(_mm256_set1_ps(d), dot4(w.w, x), acc);
}
constexpr bool Q4_0_HAS_OFFSET = true;
#endif

// The min / offset term of a split row: Q4_1 sum_b m_b xs_b, Q4_0 -8 sum_b d_b xs_b (AVX2 only), Q8_0 none.
float split_offset(int64_t base, const uint8_t* row, int64_t nb, const float* xs) {
  if (base == Q4_1) return f16_dot(row + 2 * nb, nb, xs);
  if (base == Q4_0 && Q4_0_HAS_OFFSET) return -8.f * f16_dot(row, nb, xs);
  return 0.f;
}

// MR rows of x (ldx apart; xs: their per-block sums, G apart) against one split row. sc: nb floats of scratch.
template <int MR>
void split_rows_f32(int64_t qt, const uint8_t* row, int64_t nb, const float* x, int64_t ldx, const float* xs,
                    int64_t G, float* sc, float* out, Ahead& pf) {
  const int64_t base = base_type(qt);
  f16_row(row, nb, nullptr, sc);
  const uint8_t* qs = row + split_header(qt, nb);
  BVec acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = bzero();
  const auto step = [&](int64_t b, int j) TOKENMILL_INLINE {
    const Block w = widen(base, qs, b);
    for (int m = 0; m < MR; ++m) acc[m][j] = bdot(w, x + m * ldx + 32 * b, sc[b], acc[m][j]);
  };
  const int64_t qbytes = base == Q8_0 ? 32 : 16;
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    pf.upto(qs + qbytes * b);
    step(b, 0);
    step(b + 1, 1);
    step(b + 2, 2);
    step(b + 3, 3);
  }
  for (int j = 0; b < nb; ++b, ++j) step(b, j);
  for (int m = 0; m < MR; ++m)
    out[m] = breduce(badd(badd(acc[m][0], acc[m][1]), badd(acc[m][2], acc[m][3]))) +
             split_offset(base, row, nb, xs + m * G);
}

// One row of blocks into K floats with the same widening as the dot products (the SGEMM path's scratch).
void dequant_row_avx2(int64_t qt, const Format& f, const uint8_t* row, int64_t K, float* y) {
  const int64_t nb = K / f.block;
  row = file_order(qt, f, row, nb);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * f.bytes;
    float* yb = y + b * f.block;
    __m256 w[4], wl[4], wh[4];
    switch (qt) {
      case Q4_0:
      case Q4_1: {
        const float d = f16(blk);
        const __m256 vd = _mm256_set1_ps(d), vo = _mm256_set1_ps(qt == Q4_1 ? f16(blk + 2) : -8.f * d);
        q4_block(blk + (qt == Q4_1 ? 4 : 2), w);
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(yb + 8 * v, _mm256_fmadd_ps(w[v], vd, vo));
        break;
      }
      case Q8_0: {
        const __m256 vd = _mm256_set1_ps(f16(blk));
        q8_block(blk + 2, w);
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(yb + 8 * v, _mm256_mul_ps(w[v], vd));
        break;
      }
      case Q4_K:
      case Q5_K: {
        const bool five = qt == Q5_K;
        float sc[8], mn[8];
        k_scales(blk + 4, f16(blk), f16(blk + 2), sc, mn);
        __m256i hi4[4];
        if (five) q5_high_bits(blk + 16, hi4);
        for (int c = 0; c < 4; ++c) {
          k4_chunk(blk + (five ? 48 : 16), c, five, hi4, wl, wh);
          const __m256 s0 = _mm256_set1_ps(sc[2 * c]), m0 = _mm256_set1_ps(-mn[2 * c]);
          const __m256 s1 = _mm256_set1_ps(sc[2 * c + 1]), m1 = _mm256_set1_ps(-mn[2 * c + 1]);
          for (int v = 0; v < 4; ++v) {
            _mm256_storeu_ps(yb + 64 * c + 8 * v, _mm256_fmadd_ps(wl[v], s0, m0));
            _mm256_storeu_ps(yb + 64 * c + 32 + 8 * v, _mm256_fmadd_ps(wh[v], s1, m1));
          }
        }
        break;
      }
      case Q6_K: {
        const int8_t* scl = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = f16(blk + 208);
        for (int h = 0; h < 2; ++h) {
          __m256i qh[4];
          for (int v = 0; v < 4; ++v) qh[v] = u8x8(blk + 128 + 32 * h + 8 * v);
          for (int p = 0; p < 2; ++p) {
            q6_pair(blk + 64 * h, qh, p, wl, wh);
            for (int v = 0; v < 4; ++v) {
              const int el = 128 * h + 32 * p + 8 * v, eh = el + 64;
              _mm256_storeu_ps(yb + el, _mm256_mul_ps(wl[v], _mm256_set1_ps(d * scl[el / 16])));
              _mm256_storeu_ps(yb + eh, _mm256_mul_ps(wh[v], _mm256_set1_ps(d * scl[eh / 16])));
            }
          }
        }
        break;
      }
      default: TORCH_CHECK(false, "gguf: no block kernel for ggml type ", qt);
    }
  }
}
#endif

void check_blocks(const at::Tensor& w, int64_t qtype, int64_t K, const Format& f) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf: blocks must be contiguous uint8 [N, row_bytes], got ", w.sizes(), " ", w.scalar_type());
  TORCH_CHECK(K > 0 && K % f.block == 0, "gguf: K=", K, " is not a multiple of type ", qtype, "'s block of ", f.block);
  TORCH_CHECK(w.size(1) == K / f.block * f.bytes, "gguf: rows of ", w.size(1), " bytes, expected ",
              K / f.block * f.bytes, " for K=", K, " of type ", qtype);
  TORCH_CHECK(!is_r16(qtype) || (w.size(0) % r16::ROWS == 0 && r16::available()),
              "gguf: interleaved rows (type ", qtype, ") need a multiple of 16 rows, got ", w.size(0),
              ", and a build with AVX-512 VNNI");
}

#ifdef TOKENMILL_GGUF_AVX2
// Two dequantized weight rows (w0, w1: K floats, L1-resident) against MR rows of x: 2 MR independent
// accumulators, one load of x per pair of FMAs.
template <int MR>
void dot_pair(const float* w0, const float* w1, const float* x, int64_t K, float* y0, float* y1) {
  __m256 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      a0[m] = _mm256_fmadd_ps(v0, xv, a0[m]);
      a1[m] = _mm256_fmadd_ps(v1, xv, a1[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    y0[m] = hsum(a0[m]);
    y1[m] = hsum(a1[m]);
  }
}

// y[M, N] = x W^T for 2 <= M < GEMM_MIN_ROWS (a few decodes, or one request verifying speculative drafts):
// each pair of weight rows is dequantized once into a per-thread buffer that stays in L1, then multiplied
// with every row of x. Widening the blocks is the expensive part of the fused path; here it is paid once
// per weight row instead of once per MAX_FUSED_ROWS rows of x, and no per-row offset term is needed.
void decode_dequant_rows(int64_t qt, const Format& f, const uint8_t* wp, int64_t N, int64_t K, const float* xp,
                         int64_t M, float* yp) {
  const int64_t row_bytes = (K / f.block) * f.bytes;
  const int64_t grain = std::max<int64_t>(16, PARALLEL_MIN_BYTES / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> buf(2 * K);
    float y0[MAX_FUSED_ROWS], y1[MAX_FUSED_ROWS];
    for (int64_t n = n0; n < n1; n += 2) {
      const bool pair = n + 1 < n1;
      dequant_row_avx2(qt, f, wp + n * row_bytes, K, buf.data());
      if (pair) dequant_row_avx2(qt, f, wp + (n + 1) * row_bytes, K, buf.data() + K);
      const float* w1 = pair ? buf.data() + K : buf.data();
      for (int64_t m0 = 0; m0 < M; m0 += MAX_FUSED_ROWS) {
        const int64_t mr = std::min<int64_t>(MAX_FUSED_ROWS, M - m0);
        const float* x = xp + m0 * K;
        switch (mr) {
          case 1: dot_pair<1>(buf.data(), w1, x, K, y0, y1); break;
          case 2: dot_pair<2>(buf.data(), w1, x, K, y0, y1); break;
          case 3: dot_pair<3>(buf.data(), w1, x, K, y0, y1); break;
          default: dot_pair<4>(buf.data(), w1, x, K, y0, y1); break;
        }
        for (int64_t m = 0; m < mr; ++m) {
          yp[(m0 + m) * N + n] = y0[m];
          if (pair) yp[(m0 + m) * N + n + 1] = y1[m];
        }
      }
    }
  });
}

// ---- int8 activations (--activation-quantization int8, int8_dot.h) ------------------------------------------
// Every row of x is quantized on its own (per 32 columns) and each output is summed in one fixed order, so a
// row's result does not depend on how many other rows share the call: a request's greedy output is the same
// alone, batched or prefilled in chunks. MR rows of x share each weight block's load and unpacking.
// The min / offset term of Q4_0 / Q4_1 multiplies the quantized x's block sums (llama.cpp's Q8_1 does too).

#ifdef TOKENMILL_INT8_DOT
constexpr int X8_ROWS = 4;  // rows of x per pass over a weight row: 8 accumulators, 16 ymm registers in all

// Quantized rows of x: q [M, K] int8, per 32 columns the scale d and the quantized sum s ([M, K / 32] each).
struct XQ {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K, G;
};

// One weight row of Q4_0, Q4_1 or Q8_0 blocks (file order) against MR rows of quantized x. Per row, even and
// odd blocks accumulate separately; the offset term per row is a scalar fma chain.
template <int MR>
void row_dot_x8(int64_t qt, const Format& f, const uint8_t* row, const XQ& x, int64_t m0, float* out, Ahead& pf) {
  __m256 acc[MR][2];
  float off[MR][2];
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    off[m][0] = off[m][1] = 0.f;
  }
  const bool has_min = qt == Q4_1;
  const auto step = [&](int64_t b, int p) TOKENMILL_INLINE {
    const uint8_t* blk = row + b * f.bytes;
    const float dw = f16(blk);
    const float ow = qt == Q8_0 ? 0.f : has_min ? f16(blk + 2) : -8.f * dw;
    if (qt == Q8_0) {
      const __m256i w = x8::load32(blk + 2);
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int m = 0; m < MR; ++m) {
        const int64_t r = (m0 + m) * x.G + b;
        const __m256 dot = x8::dot_u8s8(aw, _mm256_sign_epi8(x8::load32(x.q + 32 * r), w));
        acc[m][p] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * x.d[r]), acc[m][p]);
      }
    } else {
      const __m256i w = x8::nibbles(blk + (has_min ? 4 : 2));
      for (int m = 0; m < MR; ++m) {
        const int64_t r = (m0 + m) * x.G + b;
        const __m256 dot = x8::dot_u8s8(w, x8::load32(x.q + 32 * r));
        acc[m][p] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * x.d[r]), acc[m][p]);
        off[m][p] = std::fma(ow, x.s[r], off[m][p]);
      }
    }
  };
  const int64_t nb = x.G;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    pf.upto(row + b * f.bytes);
    step(b, 0);
    step(b + 1, 1);
  }
  if (b < nb) step(b, 0);
  for (int m = 0; m < MR; ++m) out[m] = x8::hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + (off[m][0] + off[m][1]);
}

// sum_i a[i] * b[i] in one fixed order (8 lanes, then the tail), whatever the caller.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float r = x8::hsum(acc);
  for (; i < n; ++i) r = std::fma(a[i], b[i], r);
  return r;
}

// A split row's block scales d (and Q4_1's mins m) as floats, converted once per weight row and tile, then
// shared by every row of x: ws[nb], wm[nb] (Q4_1 only).
inline void split_scales(int64_t qt, const uint8_t* row, int64_t nb, float* ws, float* wm) {
  f16_row(row, nb, nullptr, ws);
  if (base_type(qt) == Q4_1) f16_row(row + 2 * nb, nb, nullptr, wm);
}

// One split row against MR rows of x. Per row of x: the blocks' combined scales d_w * d_x (sc: MR * nb floats
// of scratch) in one vector pass, the offset term as one dot (Q4_1: sum m xs; Q4_0: -8 sum d xs); the loop is
// the integer dots and one FMA per block and row.
// ws == nullptr: the scales are read from the row's f16 header directly (one row of x: nothing to share), with
// the same products and sums, so both forms give the same bits.
template <int64_t base, int MR>
void split_row_x8(const uint8_t* row, const uint8_t* qs, const float* ws, const float* wm, const XQ& x, int64_t m0,
                  float* sc, float* out, Ahead& pf) {
  const int64_t nb = x.G;
  float off[MR];
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m) {
    const float* xd = x.d + (m0 + m) * nb;
    const float* xs = x.s + (m0 + m) * nb;
    float* s = sc + m * nb;
    if (ws == nullptr) {
      f16_row(row, nb, xd, s);
      off[m] = base == Q4_1 ? f16_dot(row + 2 * nb, nb, xs) : base == Q4_0 ? -8.f * f16_dot(row, nb, xs) : 0.f;
    } else {
      int64_t i = 0;
      for (; i + 8 <= nb; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(ws + i), _mm256_loadu_ps(xd + i)));
      for (; i < nb; ++i) s[i] = ws[i] * xd[i];
      off[m] = base == Q4_1 ? dot_f32(wm, xs, nb) : base == Q4_0 ? -8.f * dot_f32(ws, xs, nb) : 0.f;
    }
    acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
  }
  const auto step = [&](int64_t b, int p) TOKENMILL_INLINE {
    if (base == Q8_0) {
      const __m256i w = x8::load32(qs + 32 * b);
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int m = 0; m < MR; ++m) {
        const __m256 dot = x8::dot_u8s8(aw, _mm256_sign_epi8(x8::load32(x.q + 32 * ((m0 + m) * nb + b)), w));
        acc[m][p] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(sc + m * nb + b), acc[m][p]);
      }
    } else {
      const __m256i w = x8::nibbles(qs + 16 * b);
      for (int m = 0; m < MR; ++m) {
        const __m256 dot = x8::dot_u8s8(w, x8::load32(x.q + 32 * ((m0 + m) * nb + b)));
        acc[m][p] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(sc + m * nb + b), acc[m][p]);
      }
    }
  };
  const int64_t qbytes = base == Q8_0 ? 32 : 16;
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {  // four blocks per cursor step, block b into acc b % 4 (as split_rows_f32)
    pf.upto(qs + qbytes * b);
    step(b, 0);
    step(b + 1, 1);
    step(b + 2, 2);
    step(b + 3, 3);
  }
  for (int p = 0; b < nb; ++b, ++p) step(b, p);
  for (int m = 0; m < MR; ++m)
    out[m] = x8::hsum(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]))) + off[m];
}

// split_row_x8 for the row's base type and mr rows of x (compile-time constants: no branch in the block loop).
template <int64_t base>
void split_x8_rows(int64_t mr, const uint8_t* row, const uint8_t* qs, const float* ws, const float* wm, const XQ& x,
                   int64_t m0, float* sc, float* out, Ahead& pf) {
  switch (mr) {
    case 1: return split_row_x8<base, 1>(row, qs, ws, wm, x, m0, sc, out, pf);
    case 2: return split_row_x8<base, 2>(row, qs, ws, wm, x, m0, sc, out, pf);
    case 3: return split_row_x8<base, 3>(row, qs, ws, wm, x, m0, sc, out, pf);
    default: return split_row_x8<base, 4>(row, qs, ws, wm, x, m0, sc, out, pf);
  }
}

void split_x8(int64_t base, int64_t mr, const uint8_t* row, const uint8_t* qs, const float* ws, const float* wm,
              const XQ& x, int64_t m0, float* sc, float* out, Ahead& pf) {
  if (base == Q4_0) split_x8_rows<Q4_0>(mr, row, qs, ws, wm, x, m0, sc, out, pf);
  else if (base == Q4_1) split_x8_rows<Q4_1>(mr, row, qs, ws, wm, x, m0, sc, out, pf);
  else split_x8_rows<Q8_0>(mr, row, qs, ws, wm, x, m0, sc, out, pf);
}
#endif

bool has_x8_kernel(int64_t qt) {
#ifdef TOKENMILL_INT8_DOT
  qt = base_type(qt);
  return qt == Q4_0 || qt == Q4_1 || qt == Q8_0;
#else
  (void)qt;
  return false;
#endif
}

// y[M, N] = x W^T with every row of x quantized to int8. Parallel over weight rows; a thread walks its rows in
// tiles of X8_TILE_BYTES (kept in L2) and passes each tile once per X8_ROWS rows of x (kept in L1).
constexpr int64_t X8_TILE_BYTES = 64 * 1024;
void gemm_x8(int64_t qt, const Format& f, const uint8_t* wp, int64_t N, int64_t K, const float* xp, int64_t M,
             float* yp) {
#ifdef TOKENMILL_INT8_DOT
  const int64_t G = K / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * G), xs(M * G);
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t a, int64_t b) {
    x8::quantize(xp + a * K, b - a, K, xq.data() + a * K, xd.data() + a * G, xs.data() + a * G);
  });
  const XQ x{xq.data(), xd.data(), xs.data(), K, G};
  const int64_t row_bytes = (K / f.block) * f.bytes;
  const int64_t grain = std::max<int64_t>(16, PARALLEL_MIN_BYTES / (row_bytes * M));
  const int64_t tile = std::max<int64_t>(1, X8_TILE_BYTES / row_bytes);
  const bool split = is_split(qt), shared = split && M > 1;  // M == 1: scales straight from the row
  const int64_t base = base_type(qt);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    Ahead pf(wp + n0 * row_bytes, wp + n1 * row_bytes);
    std::vector<float> sc(X8_ROWS * G);
    std::vector<float> ws(shared ? std::min(tile, n1 - n0) * G : 0), wm(shared && base == Q4_1 ? ws.size() : 0);
    float out[X8_ROWS];
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      if (shared)
        for (int64_t n = t0; n < t1; ++n)
          split_scales(qt, wp + n * row_bytes, G, ws.data() + (n - t0) * G, wm.empty() ? nullptr : wm.data() + (n - t0) * G);
      for (int64_t m0 = 0; m0 < M; m0 += X8_ROWS) {
        const int64_t mr = std::min<int64_t>(X8_ROWS, M - m0);
        for (int64_t n = t0; n < t1; ++n) {
          const uint8_t* row = wp + n * row_bytes;
          if (split) {
            const uint8_t* qs = row + split_header(qt, G);
            const float* s = shared ? ws.data() + (n - t0) * G : nullptr;
            const float* mn = wm.empty() ? nullptr : wm.data() + (n - t0) * G;
            split_x8(base, mr, row, qs, s, mn, x, m0, sc.data(), out, pf);
          } else {
            switch (mr) {
              case 1: row_dot_x8<1>(qt, f, row, x, m0, out, pf); break;
              case 2: row_dot_x8<2>(qt, f, row, x, m0, out, pf); break;
              case 3: row_dot_x8<3>(qt, f, row, x, m0, out, pf); break;
              default: row_dot_x8<4>(qt, f, row, x, m0, out, pf); break;
            }
          }
          for (int64_t m = 0; m < mr; ++m) yp[(m0 + m) * N + n] = out[m];
        }
      }
    }
  });
#else
  (void)qt, (void)f, (void)wp, (void)N, (void)K, (void)xp, (void)M, (void)yp;
  TORCH_CHECK(false, "gguf: int8 activations need AVX2");
#endif
}

// TOKENMILL_GGUF_DEQUANT_ROWS=0: 2-7 rows of x take the fused path below (its widening repeated per 4 rows).
bool use_dequant_rows() {
  static const bool on = [] {
    const char* v = std::getenv("TOKENMILL_GGUF_DEQUANT_ROWS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}
#endif

// TOKENMILL_GGUF_SPLIT_ROWS=0: 2-7 rows of x against split blocks (the repacked Q4_0 / Q4_1 / Q8_0 of the
// decoder and LM head) take the dequantize-rows path instead of split_rows_f32.
bool use_split_rows() {
  static const bool on = [] {
    const char* v = std::getenv("TOKENMILL_GGUF_SPLIT_ROWS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

// y[M, N] = x W^T for M < GEMM_MIN_ROWS: parallel over weight rows, each read once per MAX_FUSED_ROWS rows of x.
void decode(int64_t qt, const Format& f, const uint8_t* wp, int64_t N, int64_t K, const float* xp, int64_t M,
            float* yp) {
  const std::vector<float> xs = group_sums(xp, M, K);
  const int64_t G = K / 32;
  const int64_t row_bytes = (K / f.block) * f.bytes;
  const int64_t grain = std::max<int64_t>(16, PARALLEL_MIN_BYTES / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float out[MAX_FUSED_ROWS];
#ifdef TOKENMILL_GGUF_AVX2
    Ahead pf(wp + n0 * row_bytes, wp + n1 * row_bytes);
#endif
#ifndef TOKENMILL_GGUF_AVX2
    std::vector<float> buf(K);
#endif
    int64_t n = n0;
#ifdef TOKENMILL_GGUF_AVX2
    if (M == 1 && is_split(qt)) {
      std::vector<float> sc(G);
      for (; n < n1; ++n) split_rows_f32<1>(qt, wp + n * row_bytes, G, xp, K, xs.data(), G, sc.data(), yp + n, pf);
    }
    if (M > 1 && is_split(qt)) {  // up to 4 rows of x per pass over each weight row, as M == 1 per row
      std::vector<float> sc(G);
      for (; n < n1; ++n) {
        const uint8_t* row = wp + n * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int64_t mr = std::min<int64_t>(4, M - m0);
          const float* x = xp + m0 * K;
          const float* s = xs.data() + m0 * G;
          switch (mr) {
            case 1: split_rows_f32<1>(qt, row, G, x, K, s, G, sc.data(), out, pf); break;
            case 2: split_rows_f32<2>(qt, row, G, x, K, s, G, sc.data(), out, pf); break;
            case 3: split_rows_f32<3>(qt, row, G, x, K, s, G, sc.data(), out, pf); break;
            default: split_rows_f32<4>(qt, row, G, x, K, s, G, sc.data(), out, pf); break;
          }
          for (int64_t m = 0; m < mr; ++m) yp[(m0 + m) * N + n] = out[m];
        }
      }
    }
    if (M == 1 && (qt == Q4_0 || qt == Q4_1)) {
      for (; n + 2 <= n1; n += 2) {
        q4_rows2(f, qt == Q4_1, wp + n * row_bytes, wp + (n + 1) * row_bytes, K / f.block, xp, xs.data(), out, pf);
        yp[n] = out[0];
        yp[n + 1] = out[1];
      }
    }
#endif
    for (; n < n1; ++n) {
      const uint8_t* row = wp + n * row_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_FUSED_ROWS) {
        const int64_t mr = std::min<int64_t>(MAX_FUSED_ROWS, M - m0);
        const float* x = xp + m0 * K;
#ifdef TOKENMILL_GGUF_AVX2
        const float* s = xs.data() + m0 * G;
        switch (mr) {
          case 1: row_dot_avx2<1>(qt, f, row, K, x, K, s, G, out, pf); break;
          case 2: row_dot_avx2<2>(qt, f, row, K, x, K, s, G, out, pf); break;
          case 3: row_dot_avx2<3>(qt, f, row, K, x, K, s, G, out, pf); break;
          default: row_dot_avx2<4>(qt, f, row, K, x, K, s, G, out, pf); break;
        }
#else
        (void)G;
        row_dot_generic(qt, f, row, K, x, mr, buf.data(), out);
#endif
        for (int64_t m = 0; m < mr; ++m) yp[(m0 + m) * N + n] = out[m];
      }
    }
  });
}

// Row n of the weight into K floats (an interleaved row gathered first).
void dequant_nth(int64_t qt, const Format& f, const uint8_t* wp, int64_t n, int64_t K, float* y) {
  const uint8_t* row = row_at(qt, f, wp, n, K);
#ifdef TOKENMILL_GGUF_AVX2
  dequant_row_avx2(qt, f, row, K, y);
#else
  dequant_row(qt, f, row, K, y);
#endif
}

void dequant_rows(int64_t qt, const Format& f, const uint8_t* wp, int64_t n0, int64_t n1, int64_t K, float* dst) {
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      dequant_nth(qt, f, wp, n, K, dst + (n - n0) * K);
    }
  });
}

// --quantized-batch-dtype bfloat16: each thread dequantizes panels of weight rows (BF16_PANEL_BYTES of bf16) into
// its own buffer and multiplies each by all of x in one single-threaded bf16 GEMM (oneDNN: AMX tiles where the CPU
// has them) into its own bf16 product buffer, widened row by row into y's columns. Measured on pp512 of a 1.7B Q4_0
// model (Xeon, AMX): 6 % faster than the whole weight dequantized into a scratch and one threaded GEMM, and no
// weight-sized buffer. The product goes through a buffer because the GEMM has no float32 output on the CPU and
// a strided copy_ into y's columns cost a quarter of the GEMM (2048 -> 8192, 512 rows: 19.9 -> 16.2 ms a call).
// Interleaved (R16) weights are dequantized 16 rows at a time straight into bf16 rows (a register transpose per
// block) instead of gathering each row as a split row, widening it to float and rounding it: the same values in
// the same layout, so the GEMM's sums and the result's bits do not depend on the layout. The buffers live with
// their thread: allocated per call they were fresh pages, and the kernel's zeroing of them was ~5 % of a 1.7B
// pp512 step.
void gemm_bf16_panels(int64_t qt, const Format& f, const uint8_t* wp, int64_t N, int64_t K, const at::Tensor& xb,
                      at::Tensor& y) {
  const int64_t M = xb.size(0);
  const int64_t panel = std::max<int64_t>(16, BF16_PANEL_BYTES / (K * 2) / 16 * 16);
  const bool interleaved = is_r16(qt);
  at::parallel_for(0, (N + panel - 1) / panel, 1, [&](int64_t p0, int64_t p1) {
    c10::InferenceMode guard;
    thread_local std::vector<c10::BFloat16> wbuf, pbuf;
    thread_local std::vector<float> row;
    wbuf.resize(panel * K);
    pbuf.resize(M * panel);
    row.resize(K);
    const auto bf16 = xb.options();
    at::Tensor buf = at::from_blob(wbuf.data(), {panel, K}, bf16);
    at::Tensor prod = at::from_blob(pbuf.data(), {M, panel}, bf16);
    c10::BFloat16* bp = wbuf.data();
    float* yp = y.data_ptr<float>();
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * panel, nb = std::min(panel, N - n0);
      at::Tensor out = prod.narrow(1, 0, nb);
      if (interleaved) {  // N is whole groups of 16 rows, and so is every panel
        r16::dequant_bf16(base_type(qt), wp, n0 / r16::ROWS, (n0 + nb) / r16::ROWS, K, reinterpret_cast<uint16_t*>(bp),
                          K);
      } else {
        for (int64_t n = 0; n < nb; ++n) {
          dequant_nth(qt, f, wp, n0 + n, K, row.data());
          at::vec::convert(row.data(), bp + n * K, K);
        }
      }
      at::mm_out(out, xb, buf.narrow(0, 0, nb).t());
      const c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
      for (int64_t m = 0; m < M; ++m) at::vec::convert(op + m * out.stride(0), yp + m * N + n0, nb);
    }
  });
}

}  // namespace

// x [M, K] float (other float dtypes are converted), blocks uint8 [N, row_bytes] of ggml type `qtype`.
// int8_activations: Q4_0 / Q4_1 / Q8_0 quantize every row of x to int8 (gemm_x8; other types and builds
// without AVX2 ignore it).
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K,
                       const c10::optional<at::Tensor>& bias, bool int8_activations, bool bf16_batches) {
  (void)int8_activations;  // used by the AVX2 build only
  const Format f = format_of(qtype);
  check_blocks(w, qtype, K, f);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "gguf_linear: x must be [M, ", K, "], got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const uint8_t* wp = w.data_ptr<uint8_t>();
#ifdef TOKENMILL_GGUF_AVX2
    const bool x8 = int8_activations && has_x8_kernel(qtype);
#else
    const bool x8 = false;  // no int8 kernels without AVX2: float activations
#endif
    if (bf16_batches && M >= BF16_MIN_ROWS) {
      gemm_bf16_panels(qtype, f, wp, N, K, x.to(at::kBFloat16), y);
    } else if (is_r16(qtype) && (x8 || M < GEMM_MIN_ROWS)) {
      if (x8) r16::gemm_x8(base_type(qtype), wp, N, K, x.data_ptr<float>(), M, y.data_ptr<float>(), PARALLEL_MIN_BYTES);
      else r16::gemv_f32(base_type(qtype), wp, N, K, x.data_ptr<float>(), M, y.data_ptr<float>(), PARALLEL_MIN_BYTES);
    } else if (x8) {
#ifdef TOKENMILL_GGUF_AVX2
      gemm_x8(qtype, f, wp, N, K, x.data_ptr<float>(), M, y.data_ptr<float>());
#endif
    } else if (M < GEMM_MIN_ROWS) {
#ifdef TOKENMILL_GGUF_AVX2
      if (M >= 2 && !(is_split(qtype) && use_split_rows()) && use_dequant_rows()) {
        decode_dequant_rows(qtype, f, wp, N, K, x.data_ptr<float>(), M, y.data_ptr<float>());
      } else
#endif
      decode(qtype, f, wp, N, K, x.data_ptr<float>(), M, y.data_ptr<float>());
    } else {
      // Compute-bound: panels of dequantized weight rows, each multiplied by all of x with SGEMM (panel_gemm.h).
      panel_sgemm(x, y, N, K, 16, [&](int64_t n0, int64_t nb, float* out) {
        for (int64_t n = 0; n < nb; ++n) dequant_nth(qtype, f, wp, n0 + n, K, out + n * K);
      });
    }
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y;
}

// blocks uint8 [N, row_bytes] -> float [N, K].
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t K) {
  const Format f = format_of(qtype);
  check_blocks(w, qtype, K, f);
  at::Tensor y = at::empty({w.size(0), K}, w.options().dtype(at::kFloat));
  if (w.size(0) > 0) dequant_rows(qtype, f, w.data_ptr<uint8_t>(), 0, w.size(0), K, y.data_ptr<float>());
  return y;
}

// Rows `ids` of a block table (an embedding lookup) -> float [len(ids), K], each the bits gguf_dequantize gives
// that row. One op where the torch gather of an interleaved row took about ten (index arithmetic, a gather, a
// dequantize): ~0.1 ms of a 135M batch-1 token once the step's weights have pushed them out of the caches.
at::Tensor gguf_lookup(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& ids_in) {
  const Format f = format_of(qtype);
  check_blocks(w, qtype, K, f);
  TORCH_CHECK(ids_in.dim() == 1 && !at::isFloatingType(ids_in.scalar_type()), "gguf_lookup: ids must be a 1-D integer "
              "tensor, got ", ids_in.scalar_type(), " ", ids_in.sizes());
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.size(0), N = w.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= ip[i] && ip[i] < N, "gguf_lookup: id ", ip[i], " is outside the table's ", N, " rows");
  at::Tensor y = at::empty({n, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) dequant_nth(qtype, f, wp, ip[i], K, yp + i * K);
  });
  return y;
}

}  // namespace tokenmill

namespace tokenmill {
// Which integer dot product the int8-activation kernels were built with (int8_dot.h).
std::string int8_dot_path() {
#if defined(TOKENMILL_INT8_VNNI)
  return TOKENMILL_INT8_VNNI;
#elif defined(TOKENMILL_INT8_DOT)
  return "avx2";
#else
  return "none";
#endif
}
}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int8_dot_path() -> str", &tokenmill::int8_dot_path);
  // Whether this build has the interleaved-row kernels (gguf_r16.h): the loader interleaves only then.
  m.def("gguf_interleaves() -> bool", [] { return tokenmill::r16::available(); });
  m.def("gguf_linear(Tensor x, Tensor blocks, int qtype, int K, Tensor? bias, bool int8_activations=False, "
        "bool bf16_batches=False) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &tokenmill::gguf_linear);
  m.def("gguf_dequantize(Tensor blocks, int qtype, int K) -> Tensor");
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, &tokenmill::gguf_dequantize);
  m.def("gguf_lookup(Tensor blocks, int qtype, int K, Tensor ids) -> Tensor");
  m.impl("gguf_lookup", c10::DispatchKey::CPU, &tokenmill::gguf_lookup);
}
