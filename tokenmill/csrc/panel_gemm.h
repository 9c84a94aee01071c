// The compute-bound path of the quantized linears (GGUF, MXFP4, int4/int8 weights): weight rows decoded a panel at
// a time into a per-thread float buffer that stays in L2, each panel multiplied by all of x with SGEMM
// (single-threaded inside the parallel loop) straight into y's columns. A float copy of the whole weight would be
// written to and read back from DRAM; a panel never leaves the cache.
#pragma once

#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace tokenmill {

constexpr int64_t PANEL_BYTES = 192 * 1024;  // one thread's decoded weight rows: fits L2 beside x

// y [M, N] float32 = x [M, K] float32 . W^T, where decode_rows(n0, nb, out) writes W's rows [n0, n0 + nb) as
// float [nb, K] into out. Panels are whole multiples of `align` rows (a decoder's tile), at least one.
template <typename DecodeRows>
void panel_sgemm(const at::Tensor& x, at::Tensor& y, int64_t N, int64_t K, int64_t align,
                 const DecodeRows& decode_rows) {
  const int64_t panel = std::max<int64_t>(align, PANEL_BYTES / (K * 4) / align * align);
  at::parallel_for(0, (N + panel - 1) / panel, 1, [&](int64_t p0, int64_t p1) {
    c10::InferenceMode guard;  // worker threads do not inherit the caller's; y may be an inference tensor
    std::vector<float> buf(panel * K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * panel, nb = std::min(panel, N - n0);
      decode_rows(n0, nb, buf.data());
      at::Tensor yv = y.narrow(1, n0, nb);  // rows of stride N: SGEMM's leading dimension
      at::mm_out(yv, x, at::from_blob(buf.data(), {nb, K}, x.options()).t());
    }
  });
}

}  // namespace tokenmill
