// Paged attention on the CPU, reading K/V where they lie in the block-paged cache.
//
// Cache layout (shared with the torch_sdpa backend and KV offload): [num_blocks, block_size, Hk, D].
// One call per layer writes this step's K/V into the cache, then attends:
//   - decode rows (query_len == 1): one work item per (request, KV head, KV-length partition); the
//     item walks the block table, scores all query heads of the GQA group against each K row read
//     once, softmaxes in float32 and accumulates V. Requests split into several partitions are
//     merged afterwards (split-K), so one long request still keeps every core busy.
//   - prompt chunks (query_len > 1): one work item per (request, KV head, tile of query positions);
//     flash-attention style over tiles of keys (online softmax), each tile staged from its blocks
//     into a small buffer, causal and sliding-window masks as column intervals.
// Only keys a query may see are read: never the padding after a request's last token, never blocks
// that slid out of the window.
#include "vec.h"
#include "kv_quant.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace tokenmill {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int VS = fVec::size();
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
inline fVec load_f(const T* p);
template <>
inline fVec load_f<float>(const float* p) { return fVec::loadu(p); }
template <>
inline fVec load_f<at::BFloat16>(const at::BFloat16* p) {
  fVec out;
  at::vec::load_to_float(p, out);
  return out;
}
template <>
inline fVec load_f<int8_t>(const int8_t* p) { return kvq::load_int8(p); }
template <>
inline fVec load_f<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) { return kvq::load_fp8(p); }

inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

inline float row_max(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, x, n);
}

// x[i] = exp(x[i] - m); returns the sum. exp(-inf) is 0, so masked entries drop out.
inline float exp_sum(float* x, int64_t n, float m) {
  const fVec mv(m);
  at::vec::map([mv](fVec v) { return (v - mv).exp_u20(); }, x, x, n);
  return at::vec::reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, x, n);
}

inline void soft_cap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

// The thread count that decode partitions are planned for (0: the threads of the moment). The engine's thread
// governor (executor/thread_governor.py) runs some steps on fewer threads when another process holds a core;
// planning for its full count keeps every partition, and so every request's sums, the same on any step.
std::atomic<int64_t> PLAN_THREADS{0};

// Decode steps reading less K/V than this run on the calling thread: waking the others costs more than they save
// (one request, 3 KV heads of 64, float32, 2 threads of a Xeon VM: 7.3 against 11.5 us at 64 tokens of context,
// 12.3 against 13.2 at 128, 36.7 against 29.2 at 512). Which thread runs an item never changes its sums.
constexpr int64_t PARALLEL_MIN_KV_BYTES = 256 * 1024;

// Runs fn(i) for i in [0, n), up to max_threads threads taking the next item as they finish (work is ragged).
template <typename F>
void run_items(int64_t n, const F& fn, int64_t max_threads = std::numeric_limits<int64_t>::max()) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>({at::get_num_threads(), n, max_threads});
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

struct Geometry {
  int64_t H, Hk, G, D, BS, tok_stride;  // tok_stride = Hk * D elements between tokens of a block
  int64_t table_stride;
  float scale, cap;
  int64_t window;  // 0: none
  // Attention sinks (gpt-oss): a logit per query head [H] that joins each softmax's denominator only, applied
  // where a row is normalised (exp(sink - m) added to its sum l of exp(score - m)); nullptr: none.
  const float* sinks = nullptr;
};

// The normaliser of query head j's row, whose scores have running max m and sum l of exp(score - m).
inline float row_denominator(const Geometry& g, int64_t j, float m, float l) {
  return g.sinks ? l + std::exp(g.sinks[j] - m) : l;
}

// ---------------------------------------------------------------- decode --------------------------

// s[j] = q[j] . k for NG query heads sharing one K row (read once).
template <typename T, int NG>
inline void dot_heads(const float* q, const T* kp, int64_t D, float scale, float* s, int64_t s_stride) {
  fVec acc[NG];
#pragma GCC unroll 4
  for (int j = 0; j < NG; ++j) acc[j] = fVec(0.f);
  int64_t d = 0;
  for (; d + VS <= D; d += VS) {
    const fVec kv = load_f(kp + d);
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) acc[j] = at::vec::fmadd(fVec::loadu(q + j * D + d), kv, acc[j]);
  }
  float x[NG];
#pragma GCC unroll 4
  for (int j = 0; j < NG; ++j) x[j] = hsum(acc[j]);
  if (d < D) {  // head sizes that are not whole vectors
    for (int j = 0; j < NG; ++j)
      for (int64_t e = d; e < D; ++e) x[j] += q[j * D + e] * static_cast<float>(kp[e]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < NG; ++j) s[j * s_stride] = x[j] * scale;
}

#if defined(CPU_CAPABILITY_AVX512)
// The sums of four vectors, each by exactly the additions hsum (at::vec::vec_reduce_all) makes on it — the
// same tree (lanes i and i^8, then i^4, i^2, i^1) — so each result is bit for bit hsum's, for a third of the
// instructions: the pairs of a level travel in one register.
inline void hsum4(const fVec* v, float* out) {
  // level 1 (i^8): lanes 0-7 of a + its upper half, lanes 8-15 of b + its lower half; c, d alike.
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0xE4), _mm512_shuffle_f32x4(v[0], v[1], 0x4E));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0xE4), _mm512_shuffle_f32x4(v[2], v[3], 0x4E));
  // level 2 (i^4): 128-bit chunk k holds vector k's four partial sums.
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  // levels 3 and 4 inside each chunk, as hsum's last two shuffles.
  const __m512 f = _mm512_add_ps(e, _mm512_shuffle_ps(e, e, 0x4E));
  const __m512 g = _mm512_add_ps(f, _mm512_shuffle_ps(f, f, 0xB1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, g);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}

// s[j, u] = scale[u] * (q[j] . k_u) for NG query heads and four K rows k_u (each read once): q is loaded
// once per four rows and the horizontal sums go four at a time. Bit for bit dot_heads on each row.
template <typename T, int NG>
inline void dot_heads4(const float* q, const T* const* kp, int64_t D, const float* scale, float* s,
                       int64_t s_stride) {
  fVec acc[NG][4];
  for (int j = 0; j < NG; ++j)
    for (int u = 0; u < 4; ++u) acc[j][u] = fVec(0.f);
  int64_t d = 0;
  for (; d + VS <= D; d += VS) {
    fVec kv[4];
    for (int u = 0; u < 4; ++u) kv[u] = load_f(kp[u] + d);
    for (int j = 0; j < NG; ++j) {
      const fVec qv = fVec::loadu(q + j * D + d);
      for (int u = 0; u < 4; ++u) acc[j][u] = at::vec::fmadd(qv, kv[u], acc[j][u]);
    }
  }
  float x[NG][4];
  for (int j = 0; j < NG; ++j) hsum4(acc[j], x[j]);
  if (d < D) {  // head sizes that are not whole vectors
    for (int j = 0; j < NG; ++j)
      for (int u = 0; u < 4; ++u)
        for (int64_t e = d; e < D; ++e) x[j][u] += q[j * D + e] * static_cast<float>(kp[u][e]);
  }
  for (int j = 0; j < NG; ++j)
    for (int u = 0; u < 4; ++u) s[j * s_stride + u] = x[j][u] * scale[u];
}
#define TOKENMILL_DOT4 1
#endif

// o[j, d0:d0+NC*VS] += sum_i p[j, i] * v_i[d0:...] over the rows of one block, NG heads sharing each
// V row, the output slice held in registers for the whole block.
template <typename T, int NG, int NC>
inline void axpy_rows(const float* p, int64_t p_stride, const T* vp, int64_t v_stride, int64_t rows, int64_t D,
                      float* o) {
  fVec acc[NG][NC];
  for (int j = 0; j < NG; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = fVec::loadu(o + j * D + c * VS);
  for (int64_t i = 0; i < rows; ++i, vp += v_stride) {
    fVec v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load_f(vp + c * VS);
    for (int j = 0; j < NG; ++j) {
      const fVec w(p[j * p_stride + i]);
      for (int c = 0; c < NC; ++c) acc[j][c] = at::vec::fmadd(w, v[c], acc[j][c]);
    }
  }
  for (int j = 0; j < NG; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c].store(o + j * D + c * VS);
}

template <typename T, int NG>
inline void axpy_heads(const float* p, int64_t p_stride, const T* vp, int64_t v_stride, int64_t rows, int64_t D,
                       float* o) {
  int64_t d = 0;
  for (; d + 2 * VS <= D; d += 2 * VS) axpy_rows<T, NG, 2>(p, p_stride, vp + d, v_stride, rows, D, o + d);
  if (d + VS <= D) {
    axpy_rows<T, NG, 1>(p, p_stride, vp + d, v_stride, rows, D, o + d);
    d += VS;
  }
  for (int64_t i = 0; i < rows; ++i)  // head sizes that are not whole vectors
    for (int64_t e = d; e < D; ++e)
      for (int j = 0; j < NG; ++j) o[j * D + e] += p[j * p_stride + i] * static_cast<float>(vp[i * v_stride + e]);
}

// Calls f(j0, NG) over the G heads of a group in chunks of up to 4 (NG a compile-time constant).
template <typename F>
inline void head_chunks(int64_t G, const F& f) {
  int64_t j0 = 0;
  for (; j0 + 4 <= G; j0 += 4) f(j0, std::integral_constant<int, 4>());
  switch (G - j0) {
    case 3: f(j0, std::integral_constant<int, 3>()); break;
    case 2: f(j0, std::integral_constant<int, 2>()); break;
    case 1: f(j0, std::integral_constant<int, 1>()); break;
    default: break;
  }
}

// Blocks lie anywhere in the pool, so the hardware prefetcher cannot guess the next one: ask for all
// of it while this block is used (measured: whole block ~1.5x faster than its first lines alone).
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 1);
}

// Tokens [t0, t1) of one request, KV heads [h0, h1) (and their query heads): unnormalised o[H, D], running max
// m[H] and sum l[H], written for those heads only.
// A block holds each token's K (or V) of all KV heads side by side: walking it token by token reads
// contiguous memory, and the next block (anywhere in the pool) is prefetched while this one is used.
template <typename T>
void decode_item(const float* q, const T* kc, const T* vc, const float* ks, const float* vs, const int32_t* table,
                 const Geometry& g, int64_t t0, int64_t t1, int64_t h0, int64_t h1, float* o, float* m, float* l,
                 std::vector<float>& buf) {
  const int64_t n = t1 - t0, G = g.G, D = g.D, H = g.H;
  const int64_t block_bytes = g.BS * g.tok_stride * (int64_t)sizeof(T);
  buf.resize(H * n);
  float* sc = buf.data();  // [H, n]
  // K pass. Each token also prefetches the same row of the block after this one (anywhere in the
  // pool; the hardware prefetcher cannot guess it) and its own V row, for the V pass: the item's heads only.
  const int64_t head_off = h0 * D, row_bytes = (h1 - h0) * D * (int64_t)sizeof(T);
  const int64_t first_block = t0 / g.BS, last_block = (t1 - 1) / g.BS;
  prefetch_block(kc + (int64_t)table[first_block] * g.BS * g.tok_stride, block_bytes);
  for (int64_t t = t0; t < t1;) {
    const int64_t b = t / g.BS;
    const int64_t end = std::min(t1, (b + 1) * g.BS);
    const T* base = kc + (int64_t)table[b] * g.BS * g.tok_stride;
    const T* ahead = b < last_block ? kc + (int64_t)table[b + 1] * g.BS * g.tok_stride : nullptr;
    const T* vbase = vc + (int64_t)table[b] * g.BS * g.tok_stride;
    // Token tt's K row; its int8 scales (the row's scale multiplies its finished dot products) or nullptr.
    auto token = [&](int64_t tt, const float*& row_scales) {
      const int64_t off = (tt - b * g.BS) * g.tok_stride;
      if (ahead) prefetch_block(ahead + off + head_off, row_bytes);
      prefetch_block(vbase + off + head_off, row_bytes);  // the partition's K and V fit in L2
      row_scales = ks ? ks + ((int64_t)table[b] * g.BS + (tt - b * g.BS)) * g.Hk : nullptr;
      return base + off;
    };
#if defined(TOKENMILL_DOT4)
    // Four tokens of the block at a time (the same products as one at a time, bit for bit).
    for (; t + 4 <= end; t += 4) {
      const T* rows[4];
      const float* rs[4];
      for (int u = 0; u < 4; ++u) rows[u] = token(t + u, rs[u]);
      const int64_t i = t - t0;
      for (int64_t h = h0; h < h1; ++h) {
        float scale[4];
        for (int u = 0; u < 4; ++u) scale[u] = rs[u] ? g.scale * rs[u][h] : g.scale;
        const T* kp[4] = {rows[0] + h * D, rows[1] + h * D, rows[2] + h * D, rows[3] + h * D};
        head_chunks(G, [&](int64_t j0, auto ng) {
          const int64_t head = h * G + j0;
          dot_heads4<T, decltype(ng)::value>(q + head * D, kp, D, scale, sc + head * n + i, n);
        });
      }
    }
#endif
    for (; t < end; ++t) {
      const float* row_scales;
      const T* row = token(t, row_scales);
      const int64_t i = t - t0;
      for (int64_t h = h0; h < h1; ++h) {
        const float scale = row_scales ? g.scale * row_scales[h] : g.scale;
        head_chunks(G, [&](int64_t j0, auto ng) {
          const int64_t head = h * G + j0;
          dot_heads<T, decltype(ng)::value>(q + head * D, row + h * D, D, scale, sc + head * n + i, n);
        });
      }
    }
  }
  for (int64_t j = h0 * G; j < h1 * G; ++j) {
    float* s = sc + j * n;
    if (g.cap > 0.f) soft_cap(s, n, g.cap);
    m[j] = row_max(s, n);
    l[j] = exp_sum(s, n, m[j]);
  }
  if (vs) {  // int8 V rows: fold each row's scale into its softmax weights (after their sum is taken)
    for (int64_t t = t0; t < t1; ++t) {
      const float* row_scales = vs + ((int64_t)table[t / g.BS] * g.BS + t % g.BS) * g.Hk;
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t j = h * G; j < (h + 1) * G; ++j) sc[j * n + (t - t0)] *= row_scales[h];
    }
  }
  std::fill(o + h0 * G * D, o + h1 * G * D, 0.f);
  // V pass, a block at a time (its rows were prefetched during the K pass).
  for (int64_t t = t0; t < t1;) {
    const int64_t b = t / g.BS;
    const int64_t end = std::min(t1, (b + 1) * g.BS);
    const T* base = vc + ((int64_t)table[b] * g.BS + (t - b * g.BS)) * g.tok_stride;
    for (int64_t h = h0; h < h1; ++h) {
      head_chunks(G, [&](int64_t j0, auto ng) {
        const int64_t head = h * G + j0;
        axpy_heads<T, decltype(ng)::value>(sc + head * n + (t - t0), n, base + h * D, g.tok_stride, end - t, D,
                                           o + head * D);
      });
    }
    t = end;
  }
}

// ---------------------------------------------------------------- prefill -------------------------
//
// Scores are kept transposed, St[key, row], so the softmax and the mask vectorise over query rows and
// K rows are read straight from their cache blocks (each element broadcast against a vector of
// queries); the queries are transposed once per work item instead of the keys once per tile.

// St[NK keys, NC*VS rows] = K[NK, D] . Qt[D, rows]
template <int NK, int NC>
inline void qk_block(const float* const* k, int64_t D, const float* Qt, int64_t ldq, float* St, int64_t lds) {
  fVec acc[NK][NC];
  for (int a = 0; a < NK; ++a)
    for (int c = 0; c < NC; ++c) acc[a][c] = fVec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    fVec qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = fVec::loadu(Qt + d * ldq + c * VS);
    for (int a = 0; a < NK; ++a) {
      const fVec kb(k[a][d]);
      for (int c = 0; c < NC; ++c) acc[a][c] = at::vec::fmadd(kb, qv[c], acc[a][c]);
    }
  }
  for (int a = 0; a < NK; ++a)
    for (int c = 0; c < NC; ++c) acc[a][c].store(St + a * lds + c * VS);
}

template <int NC>
inline void qk_keys(int nk, const float* const* k, int64_t D, const float* Qt, int64_t ldq, float* St, int64_t lds) {
  switch (nk) {
    case 6: qk_block<6, NC>(k, D, Qt, ldq, St, lds); break;
    case 5: qk_block<5, NC>(k, D, Qt, ldq, St, lds); break;
    case 4: qk_block<4, NC>(k, D, Qt, ldq, St, lds); break;
    case 3: qk_block<3, NC>(k, D, Qt, ldq, St, lds); break;
    case 2: qk_block<2, NC>(k, D, Qt, ldq, St, lds); break;
    default: qk_block<1, NC>(k, D, Qt, ldq, St, lds); break;
  }
}

// Keys per register block: 6 keys x 2 vectors of rows = 12 accumulators fit AVX2's 16 registers.
constexpr int QK_KEYS = 6;

// rows: a multiple of VS (Qt is zero-padded to it).
void qk_tile(const float* const* k, int64_t nk, int64_t D, const float* Qt, int64_t rows, float* St) {
  for (int64_t k0 = 0; k0 < nk; k0 += QK_KEYS) {
    const int n = (int)std::min<int64_t>(QK_KEYS, nk - k0);
    int64_t r0 = 0;
    for (; r0 + 2 * VS <= rows; r0 += 2 * VS) qk_keys<2>(n, k + k0, D, Qt + r0, rows, St + k0 * rows + r0, rows);
    if (r0 < rows) qk_keys<1>(n, k + k0, D, Qt + r0, rows, St + k0 * rows + r0, rows);
  }
}

// acc[NR rows, NC*VS of D] += Pt[keys, rows]^T . V[keys, ...]
template <int NR, int NC>
inline void pv_block(const float* Pt, int64_t ldp, int64_t nk, const float* const* v, int64_t d0, float* acc,
                     int64_t lda) {
  fVec a[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = fVec::loadu(acc + r * lda + c * VS);
  for (int64_t k = 0; k < nk; ++k) {
    fVec vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = fVec::loadu(v[k] + d0 + c * VS);
    for (int r = 0; r < NR; ++r) {
      const fVec pb(Pt[k * ldp + r]);
      for (int c = 0; c < NC; ++c) a[r][c] = at::vec::fmadd(pb, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) a[r][c].store(acc + r * lda + c * VS);
}

template <int NC>
inline void pv_rows(int nr, const float* Pt, int64_t ldp, int64_t nk, const float* const* v, int64_t d0, float* acc,
                    int64_t lda) {
  switch (nr) {
    case 6: pv_block<6, NC>(Pt, ldp, nk, v, d0, acc, lda); break;
    case 5: pv_block<5, NC>(Pt, ldp, nk, v, d0, acc, lda); break;
    case 4: pv_block<4, NC>(Pt, ldp, nk, v, d0, acc, lda); break;
    case 3: pv_block<3, NC>(Pt, ldp, nk, v, d0, acc, lda); break;
    case 2: pv_block<2, NC>(Pt, ldp, nk, v, d0, acc, lda); break;
    default: pv_block<1, NC>(Pt, ldp, nk, v, d0, acc, lda); break;
  }
}

void pv_tile(const float* Pt, int64_t ldp, int64_t rows, int64_t nk, const float* const* v, int64_t D, float* acc) {
  for (int64_t r0 = 0; r0 < rows; r0 += 6) {
    const int nr = (int)std::min<int64_t>(6, rows - r0);
    int64_t d0 = 0;
    for (; d0 + 2 * VS <= D; d0 += 2 * VS) pv_rows<2>(nr, Pt + r0, ldp, nk, v, d0, acc + r0 * D + d0, D);
    if (d0 + VS <= D) {
      pv_rows<1>(nr, Pt + r0, ldp, nk, v, d0, acc + r0 * D + d0, D);
      d0 += VS;
    }
    for (int64_t r = r0; r < r0 + nr; ++r)  // head sizes that are not whole vectors
      for (int64_t k = 0; k < nk; ++k)
        for (int64_t d = d0; d < D; ++d) acc[r * D + d] += Pt[k * ldp + r] * v[k][d];
  }
}

constexpr int64_t KEY_TILE = 128;

struct PrefillScratch {
  std::vector<float> qrows, qt, st, acc, m, l, corr, kbuf, vbuf;
  std::vector<const float*> krows, vrows;
};

// Rows of the tile's keys as float pointers: straight into the cache for float32, converted for bf16.
template <typename T>
inline void key_rows(const T* cache, const float* scales, const int32_t* table, const Geometry& g, int64_t h,
                     int64_t k0, int64_t nk, std::vector<float>& buf, std::vector<const float*>& rows) {
  rows.resize(nk);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < nk; ++i) {
      const int64_t t = k0 + i;
      rows[i] = cache + ((int64_t)table[t / g.BS] * g.BS + t % g.BS) * g.tok_stride + h * g.D;
    }
  } else {
    buf.resize(nk * g.D);
    for (int64_t i = 0; i < nk; ++i) {
      const int64_t t = k0 + i;
      const int64_t slot = (int64_t)table[t / g.BS] * g.BS + t % g.BS;
      const T* src = cache + slot * g.tok_stride + h * g.D;
      float* dst = buf.data() + i * g.D;
      int64_t d = 0;
      if (scales) {  // int8: dequantized with the row's scale into the tile buffer
        const float s = scales[slot * g.Hk + h];
        const fVec sv(s);
        for (; d + VS <= g.D; d += VS) (load_f(src + d) * sv).store(dst + d);
        for (; d < g.D; ++d) dst[d] = static_cast<float>(src[d]) * s;
      } else {
        for (; d + VS <= g.D; d += VS) load_f(src + d).store(dst + d);
        for (; d < g.D; ++d) dst[d] = static_cast<float>(src[d]);
      }
      rows[i] = dst;
    }
  }
}

// Query positions [pos0, pos0 + nq) of one request and KV head; query rows r = i*G + j.
template <typename T>
void prefill_item(const float* q, int64_t q_row_stride, const T* kc, const T* vc, const float* ks, const float* vs,
                  const int32_t* table,
                  const Geometry& g, int64_t h, int64_t pos0, int64_t nq, float* out, int64_t out_row_stride,
                  PrefillScratch& w) {
  const int64_t G = g.G, D = g.D, rows = nq * G;
  const int64_t R = (rows + VS - 1) / VS * VS;  // rows padded to whole vectors
  w.qt.assign(D * R, 0.f);
  w.st.resize(KEY_TILE * R);
  w.acc.assign(R * D, 0.f);
  w.m.assign(R, NEG_INF);
  w.l.assign(R, 0.f);
  w.corr.resize(R);
  // Q scaled into rows r = i*G + j (contiguous copies of D floats), then transposed 16 x 16 at a time: a scalar
  // strided transpose straight from q (its rows H*D apart, cold in cache) was ~40 % of this function's own time.
  w.qrows.resize(rows * D);
  const fVec sv(g.scale);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < G; ++j) {
      const float* src = q + i * q_row_stride + j * D;
      float* dst = w.qrows.data() + (i * G + j) * D;
      int64_t d = 0;
      for (; d + VS <= D; d += VS) (fVec::loadu(src + d) * sv).store(dst + d);
      for (; d < D; ++d) dst[d] = src[d] * g.scale;
    }
  at::vec::transpose_mxn<float>(w.qrows.data(), D, w.qt.data(), R, static_cast<int>(rows), static_cast<int>(D));
  const int64_t klo = g.window > 0 ? std::max<int64_t>(0, pos0 - g.window + 1) : 0;
  const int64_t khi = pos0 + nq;
  const fVec neg_inf(NEG_INF), zero(0.f);
  for (int64_t k0 = klo; k0 < khi; k0 += KEY_TILE) {
    const int64_t nk = std::min(khi, k0 + KEY_TILE) - k0;
    key_rows(kc, ks, table, g, h, k0, nk, w.kbuf, w.krows);
    qk_tile(w.krows.data(), nk, D, w.qt.data(), R, w.st.data());
    // Key k is visible to rows [lo, hi): causal (pos >= key) and inside the window (pos < key + window).
    for (int64_t k = 0; k < nk; ++k) {
      const int64_t key = k0 + k;
      const int64_t lo = std::clamp<int64_t>((key - pos0) * G, 0, rows);
      const int64_t hi = g.window > 0 ? std::clamp<int64_t>((key + g.window - pos0) * G, 0, rows) : rows;
      float* s = w.st.data() + k * R;
      if (g.cap > 0.f && hi > lo) soft_cap(s + lo, hi - lo, g.cap);
      std::fill(s, s + std::min(lo, R), NEG_INF);
      std::fill(s + std::max(hi, lo), s + R, NEG_INF);
    }
    // Online softmax, a vector of rows at a time.
    for (int64_t r = 0; r < R; r += VS) {
      fVec mx = fVec::loadu(w.m.data() + r);
      const fVec m_old = mx;
      for (int64_t k = 0; k < nk; ++k) mx = at::vec::maximum(mx, fVec::loadu(w.st.data() + k * R + r));
      const fVec m_use = fVec::blendv(mx, zero, mx == neg_inf);  // rows with nothing visible yet
      const fVec corr = (m_old - m_use).exp_u20();
      fVec sum(0.f);
      for (int64_t k = 0; k < nk; ++k) {
        float* s = w.st.data() + k * R + r;
        const fVec p = (fVec::loadu(s) - m_use).exp_u20();
        p.store(s);
        sum = sum + p;
      }
      (fVec::loadu(w.l.data() + r) * corr + sum).store(w.l.data() + r);
      mx.store(w.m.data() + r);
      corr.store(w.corr.data() + r);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float c = w.corr[r];
      if (c != 1.f) {
        float* a = w.acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= c;
      }
    }
    key_rows(vc, vs, table, g, h, k0, nk, w.vbuf, w.vrows);
    pv_tile(w.st.data(), R, rows, nk, w.vrows.data(), D, w.acc.data());
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < G; ++j) {
      const float* a = w.acc.data() + (i * G + j) * D;
      const float inv = 1.f / row_denominator(g, h * G + j, w.m[i * G + j], w.l[i * G + j]);
      float* o = out + i * out_row_stride + j * D;
      for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
    }
}

// ---------------------------------------------------------------- entry ---------------------------

struct DecodeItem {
  int64_t req, t0, t1, part;  // part: -1 when the request is one partition (written directly)
  int64_t h0, h1;             // KV heads
};

struct PrefillItem {
  int64_t req, head, i0, i1;
};

template <typename T>
void attend(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& query_len,
            const at::Tensor& kv_len, const Geometry& g, const float* ks = nullptr, const float* vs = nullptr) {
  const int64_t B = query_len.size(0);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* ql = query_len.data_ptr<int32_t>();
  const int32_t* kl = kv_len.data_ptr<int32_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t H = g.H, D = g.D, G = g.G;
  const int64_t threads = at::get_num_threads();

  // Decode partitions: as long as possible, short enough that every thread gets several items.
  int64_t decode_tokens = 0;
  for (int64_t r = 0; r < B; ++r)
    if (ql[r] == 1) decode_tokens += g.window > 0 ? std::min<int64_t>(kl[r], g.window) : kl[r];
  const int64_t fixed = PLAN_THREADS.load(std::memory_order_relaxed), plan = fixed > 0 ? fixed : threads;
  int64_t part = (decode_tokens + plan * 4 - 1) / (plan * 4);
  part = std::clamp<int64_t>((part + 63) / 64 * 64, 256, 4096);

  std::vector<PrefillItem> prefill;
  std::vector<DecodeItem> decode;
  std::vector<int64_t> split_reqs, first_part;  // requests whose partitions need merging
  int64_t num_parts = 0;
  const int64_t q_tile = std::max<int64_t>(4, 64 / G);
  for (int64_t r = 0; r < B; ++r) {
    const int64_t n_q = ql[r];
    if (n_q == 0) continue;
    if (n_q > 1) {
      for (int64_t h = 0; h < g.Hk; ++h)
        for (int64_t i0 = 0; i0 < n_q; i0 += q_tile) prefill.push_back({r, h, i0, std::min(n_q, i0 + q_tile)});
      continue;
    }
    const int64_t t1 = kl[r];
    const int64_t t0 = g.window > 0 ? std::max<int64_t>(0, t1 - g.window) : 0;
    const int64_t parts = (t1 - t0 + part - 1) / part;
    if (parts > 1) {
      split_reqs.push_back(r);
      first_part.push_back(num_parts);
    }
    for (int64_t p = 0; p < parts; ++p)
      decode.push_back({r, t0 + p * part, std::min(t1, t0 + (p + 1) * part), parts > 1 ? num_parts++ : -1, 0, g.Hk});
  }
  // Fewer decode items than threads (one request, short contexts: partitions are 256 tokens or more) would
  // leave cores idle: the items split by KV heads too, each head's arithmetic unchanged (measured on a 32-head
  // 1.7B model at batch 1: one core had done all of a layer's attention).
  if (!decode.empty() && (int64_t)decode.size() < 2 * threads && g.Hk > 1) {
    const int64_t splits = std::min<int64_t>(g.Hk, (2 * threads + (int64_t)decode.size() - 1) / (int64_t)decode.size());
    std::vector<DecodeItem> by_heads;
    for (const DecodeItem& it : decode)
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t a = g.Hk * s / splits, b = g.Hk * (s + 1) / splits;
        if (a < b) by_heads.push_back({it.req, it.t0, it.t1, it.part, a, b});
      }
    decode.swap(by_heads);
  }

  // Split partitions park their unnormalised outputs here: [num_parts, H, D + 2] (o, then m, l).
  const int64_t rec = H * (D + 2);
  std::vector<float> parts_buf(num_parts * rec);

  // Prompt tiles first (the heaviest items), then decode items, taken by whichever thread is free.
  const int64_t n_prefill = prefill.size();
  int64_t decode_bytes = 0;
  for (const DecodeItem& it : decode) decode_bytes += (it.t1 - it.t0) * (it.h1 - it.h0) * D * 2 * (int64_t)sizeof(T);
  const int64_t max_threads = n_prefill == 0 && decode_bytes < PARALLEL_MIN_KV_BYTES ? 1 : threads;
  run_items(n_prefill + (int64_t)decode.size(), [&](int64_t i) {
    if (i < n_prefill) {
      thread_local PrefillScratch w;
      const PrefillItem& it = prefill[i];
      const int64_t row = qs[it.req] + it.i0;
      const int64_t pos0 = kl[it.req] - ql[it.req] + it.i0;
      prefill_item<T>(qp + row * H * D + it.head * G * D, H * D, kc, vc, ks, vs, tables + it.req * g.table_stride, g,
                      it.head, pos0, it.i1 - it.i0, op + row * H * D + it.head * G * D, H * D, w);
      return;
    }
    thread_local std::vector<float> buf, own;
    const DecodeItem& it = decode[i - n_prefill];
    float* o;
    if (it.part >= 0) {
      o = parts_buf.data() + it.part * rec;
    } else {
      own.resize(rec);
      o = own.data();
    }
    float* m = o + H * D;
    float* l = m + H;
    decode_item<T>(qp + (int64_t)qs[it.req] * H * D, kc, vc, ks, vs, tables + it.req * g.table_stride, g, it.t0, it.t1,
                   it.h0, it.h1, o, m, l, buf);
    if (it.part < 0) {
      float* dst = op + (int64_t)qs[it.req] * H * D;
      for (int64_t j = it.h0 * G; j < it.h1 * G; ++j) {
        const float inv = 1.f / row_denominator(g, j, m[j], l[j]);
        for (int64_t d = 0; d < D; ++d) dst[j * D + d] = o[j * D + d] * inv;
      }
    }
  }, max_threads);

  // Merge each split request's partitions: rescale by exp(m_p - M) and normalise by the total sum.
  at::parallel_for(0, (int64_t)split_reqs.size() * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t idx = x / H, j = x % H, r = split_reqs[idx];
      const int64_t first = first_part[idx];
      const int64_t n = (idx + 1 < (int64_t)first_part.size() ? first_part[idx + 1] : num_parts) - first;
      const float* recs = parts_buf.data() + first * rec;
      float* dst = op + (int64_t)qs[r] * H * D + j * D;
      float M = NEG_INF;
      for (int64_t p = 0; p < n; ++p) M = std::max(M, recs[p * rec + H * D + j]);
      float L = 0.f;
      std::fill(dst, dst + D, 0.f);
      for (int64_t p = 0; p < n; ++p) {
        const float* pr = recs + p * rec;
        const float w = std::exp(pr[H * D + j] - M);
        L += pr[H * D + H + j] * w;
        for (int64_t d = 0; d < D; ++d) dst[d] += pr[j * D + d] * w;
      }
      const float inv = 1.f / row_denominator(g, j, M, L);
      for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
    }
  });
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  const int64_t T = k.size(0);
  const int64_t row = k.size(1) * k.size(2) * k.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + slots[t] * row, ks + t * row, row);
      std::memcpy(vd + slots[t] * row, vs + t * row, row);
    }
  });
}

// ---------------------------------------------------------------- index checks --------------------
//
// The kernels trust block tables and slot mappings to stay inside the pool; a bookkeeping bug upstream
// would otherwise read or overwrite another request's KV (or memory past the cache) instead of failing.
// These run once per call on the small index tensors, before any write or parallel work: plain min/max
// loops the compiler vectorises, a few microseconds per layer next to the attention itself.

template <typename I>
inline std::pair<int64_t, int64_t> min_max(const I* p, int64_t n) {
  I lo = p[0], hi = p[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, p[i]);
    hi = std::max(hi, p[i]);
  }
  return {(int64_t)lo, (int64_t)hi};
}

// Every new token's slot lies in the cache's num_blocks * block_size slots.
void check_slots(const at::Tensor& slot_mapping, int64_t num_slots) {
  const int64_t n = slot_mapping.numel();
  if (n == 0) return;
  const auto [lo, hi] = min_max(slot_mapping.data_ptr<int64_t>(), n);
  TORCH_CHECK_INDEX(lo >= 0 && hi < num_slots, "paged_attention: slot_mapping holds slot ", lo < 0 ? lo : hi,
                    ", outside the cache's ", num_slots, " slots");
}

// Each request's rows lie in q, its context in its block-table row, and the block ids it reads (those of
// its visible keys: a sliding window skips the blocks before it) in [0, num_blocks).
void check_requests(const at::Tensor& q, const at::Tensor& block_table, const at::Tensor& query_start,
                    const at::Tensor& query_len, const at::Tensor& kv_len, int64_t num_blocks, int64_t BS,
                    int64_t window) {
  const int64_t B = query_len.size(0), T = q.size(0);
  TORCH_CHECK(query_start.size(0) == B && kv_len.size(0) == B && block_table.dim() == 2 && block_table.size(0) >= B,
              "paged_attention: query_start, query_len, kv_len and block_table must describe the same requests");
  const int64_t width = block_table.size(1);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* ql = query_len.data_ptr<int32_t>();
  const int32_t* kl = kv_len.data_ptr<int32_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  for (int64_t r = 0; r < B; ++r) {
    const int64_t start = qs[r], n = ql[r], ctx = kl[r];
    if (n == 0) continue;  // not attended
    TORCH_CHECK_INDEX(n > 0 && start >= 0 && start + n <= T, "paged_attention: request ", r, " has query rows [",
                      start, ", ", start + n, ") outside q's ", T, " rows");
    TORCH_CHECK_INDEX(ctx >= n && ctx <= width * BS, "paged_attention: request ", r, " has ", ctx,
                      " KV tokens for ", n, " query rows and a block table of ", width, " blocks of ", BS);
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, ctx - n - window + 1) : 0;
    const int64_t b0 = first_key / BS, b1 = (ctx + BS - 1) / BS;
    const auto [lo, hi] = min_max(tables + r * width + b0, b1 - b0);
    TORCH_CHECK_INDEX(lo >= 0 && hi < num_blocks, "paged_attention: request ", r, "'s block table holds block ",
                      lo < 0 ? lo : hi, ", outside the cache's ", num_blocks, " blocks");
  }
}

// Checks shared by both ops; the step's geometry.
Geometry check_geometry(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& query_len,
                        const at::Tensor& kv_len, double scale, int64_t sliding_window, double soft_cap,
                        const float* sinks) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "paged_attention: float32 q/out");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "paged_attention: q, out, k, v must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "paged_attention: cache layout");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0),
              "paged_attention: slot_mapping must be contiguous int64, one slot per new token");
  for (const at::Tensor* t : {&block_table, &query_start, &query_len, &kv_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "paged_attention: int32 metadata");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_attention: out must have q's shape [T, H, D]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_attention: K and V caches differ in shape");
  Geometry g;
  g.H = q.size(1);
  g.D = q.size(2);
  g.BS = k_cache.size(1);
  g.Hk = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == g.D && g.H % g.Hk == 0, "paged_attention: head geometry");
  // The new K/V rows are copied whole into cache slots: they must have the cache's row shape.
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == g.Hk && k.size(2) == g.D,
              "paged_attention: new K/V must be [T, Hk, D] as the cache's rows");
  check_slots(slot_mapping, k_cache.size(0) * g.BS);
  check_requests(q, block_table, query_start, query_len, kv_len, k_cache.size(0), g.BS, sliding_window);
  g.G = g.H / g.Hk;
  g.tok_stride = g.Hk * g.D;
  g.table_stride = block_table.size(1);
  g.scale = (float)scale;
  g.cap = (float)soft_cap;
  g.window = sliding_window;
  g.sinks = sinks;
  return g;
}

void float_cache_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& query_len,
                           const at::Tensor& kv_len, double scale, int64_t sliding_window, double soft_cap,
                           const float* sinks) {
  const Geometry g = check_geometry(out, q, k, v, k_cache, v_cache, slot_mapping, block_table, query_start, query_len,
                                    kv_len, scale, sliding_window, soft_cap, sinks);
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "paged_attention: new K/V must already have the cache dtype");
  if (k.size(0) > 0) write_kv(k, v, k_cache, v_cache, slot_mapping);
  if (k_cache.scalar_type() == at::kFloat) {
    attend<float>(out, q, k_cache, v_cache, block_table, query_start, query_len, kv_len, g);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    attend<at::BFloat16>(out, q, k_cache, v_cache, block_table, query_start, query_len, kv_len, g);
  } else {
    TORCH_CHECK(false, "paged_attention: cache dtype must be float32 or bfloat16, got ", k_cache.scalar_type());
  }
}

// Quantizes this step's float32 K/V into their cache slots (int8 rows with their scales, or fp8).
void write_kv_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    at::Tensor& k_scales, at::Tensor& v_scales, const at::Tensor& slot_mapping, float k_scale,
                    float v_scale) {
  const int64_t T = k.size(0), Hk = k.size(1), D = k.size(2), row = Hk * D;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool int8 = k_cache.scalar_type() == at::kChar;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (int8) {
        for (int64_t h = 0; h < Hk; ++h) {
          kvq::quantize_row_int8(kp + t * row + h * D, D, k_cache.data_ptr<int8_t>() + slot * row + h * D,
                                 k_scales.data_ptr<float>() + slot * Hk + h);
          kvq::quantize_row_int8(vp + t * row + h * D, D, v_cache.data_ptr<int8_t>() + slot * row + h * D,
                                 v_scales.data_ptr<float>() + slot * Hk + h);
        }
      } else {
        kvq::quantize_row_fp8(kp + t * row, row, k_scale, k_cache.data_ptr<c10::Float8_e4m3fn>() + slot * row);
        kvq::quantize_row_fp8(vp + t * row, row, v_scale, v_cache.data_ptr<c10::Float8_e4m3fn>() + slot * row);
      }
    }
  });
}

// Paged attention over a quantized cache. k/v: this step's float32 K/V, quantized on write.
// int8 caches: k_scales/v_scales [num_blocks, block_size, Hk] float32 (per slot and KV head); k_scale,
// v_scale unused (1). fp8 caches: k_scales/v_scales empty; k_scale/v_scale the layer's scales, folded into
// the softmax scale and the output.
void quant_cache_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scales, at::Tensor v_scales,
                           const at::Tensor& slot_mapping, const at::Tensor& block_table,
                           const at::Tensor& query_start, const at::Tensor& query_len, const at::Tensor& kv_len,
                           double scale, int64_t sliding_window, double soft_cap, double k_scale, double v_scale,
                           const float* sinks) {
  Geometry g = check_geometry(out, q, k, v, k_cache, v_cache, slot_mapping, block_table, query_start, query_len,
                              kv_len, scale, sliding_window, soft_cap, sinks);
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "paged_attention_quant: new K/V must be float32 (they are quantized on write)");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention_quant: K and V caches differ in dtype");
  const auto dtype = k_cache.scalar_type();
  if (dtype == at::kChar) {
    const std::vector<int64_t> want = {k_cache.size(0), g.BS, g.Hk};
    for (const at::Tensor* t : {&k_scales, &v_scales})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == want,
                  "paged_attention_quant: int8 caches need float32 scales [num_blocks, block_size, Hk], got ",
                  t->scalar_type(), " ", t->sizes());
  } else {
    TORCH_CHECK(dtype == at::kFloat8_e4m3fn, "paged_attention_quant: cache dtype must be int8 or float8_e4m3fn, got ",
                dtype);
    TORCH_CHECK(k_scale > 0 && v_scale > 0, "paged_attention_quant: fp8 k_scale/v_scale must be positive");
  }
  if (k.size(0) > 0)
    write_kv_quant(k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, (float)k_scale, (float)v_scale);
  if (dtype == at::kChar) {
    attend<int8_t>(out, q, k_cache, v_cache, block_table, query_start, query_len, kv_len, g,
                   k_scales.data_ptr<float>(), v_scales.data_ptr<float>());
  } else {
    g.scale *= (float)k_scale;
    attend<c10::Float8_e4m3fn>(out, q, k_cache, v_cache, block_table, query_start, query_len, kv_len, g);
    if (v_scale != 1.0) out.mul_(v_scale);
  }
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& query_len,
                     const at::Tensor& kv_len, double scale, int64_t sliding_window, double soft_cap) {
  float_cache_attention(out, q, k, v, k_cache, v_cache, slot_mapping, block_table, query_start, query_len, kv_len,
                        scale, sliding_window, soft_cap, nullptr);
}

void paged_attention_quant(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scales, at::Tensor v_scales,
                           const at::Tensor& slot_mapping, const at::Tensor& block_table,
                           const at::Tensor& query_start, const at::Tensor& query_len, const at::Tensor& kv_len,
                           double scale, int64_t sliding_window, double soft_cap, double k_scale, double v_scale) {
  quant_cache_attention(out, q, k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, block_table, query_start,
                        query_len, kv_len, scale, sliding_window, soft_cap, k_scale, v_scale, nullptr);
}

// Either op above with attention sinks: sinks [H] float32, one logit per query head of q (this rank's heads).
// Float32/bfloat16 caches take paged_attention's path (k_scales, v_scales unused), quantized ones
// paged_attention_quant's. A separate op, so that the two above keep their schemas for every caller.
void paged_attention_sinks(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scales, at::Tensor v_scales,
                           const at::Tensor& slot_mapping, const at::Tensor& block_table,
                           const at::Tensor& query_start, const at::Tensor& query_len, const at::Tensor& kv_len,
                           double scale, int64_t sliding_window, double soft_cap, double k_scale, double v_scale,
                           const at::Tensor& sinks) {
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.dim() == 1 && q.dim() == 3 &&
                  sinks.size(0) == q.size(1),
              "paged_attention_sinks: sinks must be contiguous float32 [H], one per query head");
  const float* sp = sinks.data_ptr<float>();
  const auto dtype = k_cache.scalar_type();
  if (dtype == at::kFloat || dtype == at::kBFloat16) {
    float_cache_attention(out, q, k, v, k_cache, v_cache, slot_mapping, block_table, query_start, query_len, kv_len,
                          scale, sliding_window, soft_cap, sp);
  } else {
    quant_cache_attention(out, q, k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, block_table, query_start,
                          query_len, kv_len, scale, sliding_window, soft_cap, k_scale, v_scale, sp);
  }
}

std::string cpu_capability() { return TOKENMILL_STR(CPU_CAPABILITY); }

// Decode partitions planned for n threads whatever the threads of a step (0: the threads of the moment);
// returns the previous setting.
int64_t set_attention_plan_threads(int64_t n) { return PLAN_THREADS.exchange(std::max<int64_t>(0, n)); }

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY(tokenmill, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor slot_mapping, Tensor block_table, Tensor query_start, Tensor query_len, Tensor kv_len, "
      "float scale, int sliding_window, float soft_cap) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &tokenmill::paged_attention);
  m.def(
      "paged_attention_quant(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor(d!) k_scales, Tensor(e!) v_scales, Tensor slot_mapping, Tensor block_table, Tensor query_start, "
      "Tensor query_len, Tensor kv_len, float scale, int sliding_window, float soft_cap, float k_scale, "
      "float v_scale) -> ()");
  m.impl("paged_attention_quant", c10::DispatchKey::CPU, &tokenmill::paged_attention_quant);
  m.def(
      "paged_attention_sinks(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor(d!) k_scales, Tensor(e!) v_scales, Tensor slot_mapping, Tensor block_table, Tensor query_start, "
      "Tensor query_len, Tensor kv_len, float scale, int sliding_window, float soft_cap, float k_scale, "
      "float v_scale, Tensor sinks) -> ()");
  m.impl("paged_attention_sinks", c10::DispatchKey::CPU, &tokenmill::paged_attention_sinks);
  m.def("cpu_capability() -> str", &tokenmill::cpu_capability);
  m.def("set_attention_plan_threads(int n) -> int", &tokenmill::set_attention_plan_threads);
}
