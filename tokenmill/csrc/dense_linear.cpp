// Dense float32 linear for few rows of x: y = x W^T + b with W the nn.Linear layout [N, K], contiguous.
//
// ATen's SGEMM (MKL) streams the weights of a few-row product at 5-10 GB/s on a 2-core Zen 4, where a plain
// read reaches ~28 GB/s: batch-1 decode of a float32 model ran at ~30 % of its bandwidth roofline. Here each
// block of DL_ROWS weight rows is read from memory once and dotted with every row of x (x stays in L1/L2):
// register tiles of up to DL_MR rows of x by DL_ROWS weight rows, one vector accumulator per output element,
// K walked in Vectorized<float> steps (AVX-512 or AVX2, whatever the build targets), the K tail by a masked
// load into the same accumulator, one horizontal sum, then the bias. Every output element is thus computed
// by the same instructions in the same order whatever M is and whichever tile or thread it falls in: a row's
// result does not depend on the other rows of the call (nor on the thread count).
//
// Above DL_MAX_ROWS rows of x (measured crossover, below), and for other dtypes, devices or layouts,
// at::linear. TOKENMILL_DENSE_LINEAR=0 (read once) sends every call to at::linear.
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace tokenmill {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();
// Register tile: DL_MR rows of x by DL_ROWS weight rows, 16 accumulators + 8 weight vectors + 1 of x (AVX-512
// has 32 registers). Measured on the 2-core Zen 4 (weights from DRAM, best of 5, noisy +-20 %): 8x2 was the
// best or even with every other shape tried (4x4, 4x6, 6x3, 2x8, 2x4, 16x1; 8x3 spills), e.g. [576, 1536] M=1
// 26-30 GB/s against 20-25 for 4x4; in L2, 8x2 ran 1.3-1.5x faster than 4x4. Software prefetch (each row
// ahead by 1-8 KB, or the next block in address order, T0 or NTA) never helped: left out.
// AVX2 has 16 vector registers: 4 weight rows there (8 + 4 + 1).
#if defined(CPU_CAPABILITY_AVX2)
constexpr int DL_ROWS = 4;
#else
constexpr int DL_ROWS = 8;
#endif
constexpr int DL_MR = 2;
// Crossover to at::linear. GB/s of weights, 2 threads, own kernel / at::linear (MKL), interleaved, best of 5
// (M up to 32 and from 48 on are two runs):
//   shape [N, K]   M=8        M=16       M=32       M=48       M=64      M=96      M=128
//   49152x576      14.9/6.1   11.5/5.2   6.2/3.6    3.0/1.8    2.3/1.6   2.5/2.0   2.1/1.5
//   1536x576       10.6/5.7   9.6/5.2    6.0/3.6    4.3/3.7    3.5/3.2   2.5/2.7   1.8/2.1
//   576x1536       18.2/7.3   11.5/6.2   7.3/5.0    5.3/4.9    3.9/3.9   2.7/2.7   2.0/2.2
//   576x576        12.5/6.6   8.8/5.5    6.3/4.2    5.6/4.8    4.3/3.8   2.4/2.8   2.2/2.2
//   2048x8192      20.8/6.6   13.0/5.6   5.8/5.1    4.0/4.1
//   8192x2048      17.3/5.1   13.3/4.4   7.3/3.8    5.1/3.1
// The own kernel wins clearly through M=32 at every shape and only marginally (or not: K=8192) at 48-64;
// from 96 on SGEMM is as fast or faster. M=1: 20-30 GB/s against 8-14 (a plain read: ~28-33 GB/s).
constexpr int64_t DL_MAX_ROWS = 32;

bool enabled() {
  static const bool on = [] {
    const char* e = std::getenv("TOKENMILL_DENSE_LINEAR");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

// MR rows of x (stride ldx) by NR weight rows (stride K) -> y[m * ldy + r] (+ bias[r]).
template <int MR, int NR>
TOKENMILL_INLINE inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias,
                                  float* y, int64_t ldy) {
  Vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = Vec(0.f);
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    Vec wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = Vec::loadu(w + r * K + k);
    for (int m = 0; m < MR; ++m) {
      const Vec xv = Vec::loadu(x + m * ldx + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = at::vec::fmadd(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {  // masked loads: the missing lanes are zero, the same accumulators go on
    const int64_t n = K - k;
    Vec wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = Vec::loadu(w + r * K + k, n);
    for (int m = 0; m < MR; ++m) {
      const Vec xv = Vec::loadu(x + m * ldx + k, n);
      for (int r = 0; r < NR; ++r) acc[m][r] = at::vec::fmadd(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      const float s = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc[m][r]);
      y[m * ldy + r] = bias ? s + bias[r] : s;
    }
}

// All M rows of x against NR weight rows starting at w (output columns from y): the weight rows come from
// memory in the first tile and from L1/L2 in the others.
template <int NR>
TOKENMILL_INLINE inline void rows_block(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K,
                                        const float* bias, float* y, int64_t N) {
  static_assert(DL_MR == 2, "the remainder below is one row");
  int64_t m = 0;
  for (; m + DL_MR <= M; m += DL_MR) tile<DL_MR, NR>(x + m * ldx, ldx, w, K, bias, y + m * N, N);
  if (m < M) tile<1, NR>(x + m * ldx, ldx, w, K, bias, y + m * N, N);
}

void dense_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t N, int64_t K, const float* bias,
                float* y) {
  const int64_t blocks = (N + DL_ROWS - 1) / DL_ROWS;
  // A thread's share at least ~64 KB of weights: smaller products are not worth a second thread.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (DL_ROWS * K * 4 + 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * DL_ROWS;
      const float* bn = bias ? bias + n0 : nullptr;
      if (n0 + DL_ROWS <= N) {
        rows_block<DL_ROWS>(x, ldx, M, w + n0 * K, K, bn, y + n0, N);
      } else {
        for (int64_t n = n0; n < N; ++n)
          rows_block<1>(x, ldx, M, w + n * K, K, bias ? bias + n : nullptr, y + n, N);
      }
    }
  });
}

}  // namespace

// x [M, K] float32; w [N, K] float32 contiguous; bias [N] float32 or None. Anything else: at::linear.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  const bool own = enabled() && x.dim() == 2 && w.dim() == 2 && x.device().is_cpu() && w.device().is_cpu() &&
                   x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                   x.size(0) <= DL_MAX_ROWS && x.size(1) == w.size(1) &&
                   (!has_bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                                  bias->size(0) == w.size(0) && bias->device().is_cpu()));
  if (!own) return at::linear(x, w, bias);
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  // Rows of x may have any stride as long as each row is contiguous (narrowed columns, row slices).
  const at::Tensor xx = (x.stride(1) == 1 || K <= 1) ? x : x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  at::Tensor b;
  if (has_bias) b = bias->contiguous();
  dense_rows(xx.data_ptr<float>(), xx.stride(0), M, w.data_ptr<float>(), N, K,
             has_bias ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("dense_linear", c10::DispatchKey::CPU, &tokenmill::dense_linear);
}
