// Grouped small-M linear for mixture-of-experts layers: y[rows of expert e] = x[rows of e] W[e]^T for all
// experts in one call. At decode batches each expert sees a few tokens (batch 32, top-2 of 8: ~8), where
// SGEMM spends as long packing W as multiplying; here each weight row is read once per tile of tokens and
// multiplied in registers (R weight rows x T tokens of accumulators along K, one horizontal sum per
// output), and every (expert, block of output rows) is one work item, so both threads stay busy without a
// barrier per expert.
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <utility>
#include <vector>

namespace tokenmill {
namespace {

using Vec = at::vec::Vectorized<float>;
// Output rows (weight rows) per work item: long runs stream best (256 measured fastest at 2 threads on
// SmolLM-sized experts), halved while there are fewer than 4 items per thread.
constexpr int64_t MAX_BLOCK_ROWS = 256;
constexpr int64_t MIN_BLOCK_ROWS = 16;

// acc[r][t] = dot(w row r, x row t) over K; y[t * ldy + r] = the sums.
template <int R, int T>
void micro(const float* w, const float* x, int64_t K, float* y, int64_t ldy) {
  constexpr int64_t V = Vec::size();
  Vec acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = Vec(0.f);
  int64_t k = 0;
  for (; k + V <= K; k += V) {
    Vec xv[T];
    for (int t = 0; t < T; ++t) xv[t] = Vec::loadu(x + t * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec wv = Vec::loadu(w + r * K + k);
      for (int t = 0; t < T; ++t) acc[r][t] = at::vec::fmadd(wv, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += w[r * K + kk] * x[t * K + kk];
      y[t * ldy + r] = s;
    }
  }
}

template <int R>
void micro_t(const float* w, const float* x, int64_t K, float* y, int64_t ldy, int64_t t) {
  switch (t) {
    case 3: micro<R, 3>(w, x, K, y, ldy); break;
    case 2: micro<R, 2>(w, x, K, y, ldy); break;
    default: micro<R, 1>(w, x, K, y, ldy); break;
  }
}

// Weight rows [n0, n1) of one expert against its `count` tokens.
void block(const float* w, const float* x, int64_t count, int64_t K, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t TT = 3;
  for (int64_t t0 = 0; t0 < count; t0 += TT) {
    const int64_t t = std::min(TT, count - t0);
    const float* xt = x + t0 * K;
    float* yt = y + t0 * N;
    int64_t r = n0;
    for (; r + 4 <= n1; r += 4) micro_t<4>(w + r * K, xt, K, yt + r, N, t);
    for (; r < n1; ++r) micro_t<1>(w + r * K, xt, K, yt + r, N, t);
  }
}

}  // namespace

// x [n, K] float32, rows sorted by expert; w [E, N, K] float32; counts [E] int64 (rows of x per expert,
// summing to n). Returns y [n, N].
at::Tensor grouped_linear(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& counts_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 3, "grouped_linear: x [n, K] and w [E, N, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "grouped_linear: float32 only");
  TORCH_CHECK(x_in.size(1) == w_in.size(2), "grouped_linear: K of x and w differ");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const at::Tensor counts = counts_in.to(at::kLong).contiguous();
  const int64_t n = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1);
  TORCH_CHECK(counts.numel() == E, "grouped_linear: one count per expert");
  const int64_t* c = counts.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(c[e] >= 0, "grouped_linear: negative count");
    start[e + 1] = start[e] + c[e];
  }
  TORCH_CHECK(start[E] == n, "grouped_linear: counts must sum to the rows of x");
  at::Tensor y = at::empty({n, N}, x.options());
  int64_t active = 0;
  for (int64_t e = 0; e < E; ++e) active += c[e] > 0;
  int64_t rows = MAX_BLOCK_ROWS;
  while (rows > MIN_BLOCK_ROWS && active * ((N + rows - 1) / rows) < 4 * at::get_num_threads()) rows /= 2;
  // (expert, first output row), row blocks outermost: parallel_for hands each thread a contiguous range, and
  // this way every range holds a share of every expert, however unevenly the tokens were routed.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t n0 = 0; n0 < N; n0 += rows)
    for (int64_t e = 0; e < E; ++e)
      if (c[e] > 0) items.emplace_back(e, n0);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const auto [e, n0] = items[i];
      block(wp + e * N * K, xp + start[e] * K, c[e], K, yp + start[e] * N, N, n0, std::min(N, n0 + rows));
    }
  });
  return y;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("grouped_linear(Tensor x, Tensor w, Tensor counts) -> Tensor");
  m.impl("grouped_linear", c10::DispatchKey::CPU, &tokenmill::grouped_linear);
}
