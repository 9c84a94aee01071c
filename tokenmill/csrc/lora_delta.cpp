// The LoRA delta of one linear layer for a step that mixes adapters, in one call (layers/lora.py has the layout
// and the torch fallback). Each token t with an adapter slot s = token_slot[t] (< 0: the base model, skipped)
// adds, per shard k of the layer (q/k/v or gate/up, else one):
//     u = A[s, :S*r] x_t                (shrink: S*r dot products of length K; r = ranks[s])
//     y[t, shard k] += B[s, rows of k, :r] u[k*r : (k+1)*r]      (expand)
// The adapters' ranks are small (1-64): a token's work is a few hundred short dot products, which torch would
// spend a dispatch (or a gather and a scatter) on per adapter and shard; here it is one loop over tokens, split
// over the threads, with A and B read where they lie.
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace tokenmill {
namespace {

using Vec = at::vec::Vectorized<float>;

inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t V = Vec::size();
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + V <= n; i += V) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

// y [T, N] (rows contiguous) += deltas; x [T, K]; a [L, S * R, K]; b [L, N, R]; token_slot int32 [T];
// ranks int64 [L]; sizes: the S shards' rows of y, summing to N.
at::Tensor lora_delta(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& token_slot, const at::Tensor& ranks, at::IntArrayRef sizes) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat,
              "lora_delta: float32 only");
  TORCH_CHECK(token_slot.scalar_type() == at::kInt && ranks.scalar_type() == at::kLong, "lora_delta: index dtypes");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora_delta: ranks of tensors");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && b.is_contiguous() && token_slot.is_contiguous() &&
                  ranks.is_contiguous() && y.stride(1) == 1,
              "lora_delta: contiguous inputs");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), L = a.size(0), R = b.size(2);
  const int64_t S = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(y.size(0) == T && token_slot.numel() == T && a.size(2) == K && a.size(1) == S * R && b.size(0) == L &&
                  b.size(1) == N && ranks.numel() == L,
              "lora_delta: shapes disagree");
  std::vector<int64_t> off(S + 1, 0);
  for (int64_t k = 0; k < S; ++k) off[k + 1] = off[k] + sizes[k];
  TORCH_CHECK(off[S] == N, "lora_delta: shard sizes sum to ", off[S], ", not ", N);
  const int32_t* slot = token_slot.data_ptr<int32_t>();
  const int64_t* rank = ranks.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] < L, "lora_delta: slot ", slot[t], " of token ", t);
  for (int64_t s = 0; s < L; ++s) TORCH_CHECK(rank[s] >= 0 && rank[s] <= R, "lora_delta: rank ", rank[s]);
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> u(S * R);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slot[t];
      const int64_t r = s < 0 ? 0 : rank[s];
      if (r == 0) continue;
      const float* xt = xp + t * K;
      const float* as = ap + s * S * R * K;
      for (int64_t j = 0; j < S * r; ++j) u[j] = dot(as + j * K, xt, K);
      const float* bs = bp + s * N * R;
      float* yt = yp + t * ldy;
      for (int64_t k = 0; k < S; ++k)
        for (int64_t o = off[k]; o < off[k + 1]; ++o) yt[o] += dot(bs + o * R, u.data() + k * r, r);
    }
  });
  return y;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("lora_delta(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor token_slot, Tensor ranks, int[] sizes) "
        "-> Tensor(a!)");
  m.impl("lora_delta", c10::DispatchKey::CPU, &tokenmill::lora_delta);
}
