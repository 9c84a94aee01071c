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
// Prompts: from this many rows of x, panels of up to WIDE_PANEL_ROWS weight rows whatever their bytes. An SGEMM of
// 512 rows of x by 16 weight rows (what 192 KiB holds at K = 2048) ran at 76 GFLOP/s on one Xeon core, by 256 rows
// at 137 (K = 8192: 70 against 136; 128 rows of x: 91 against 124): each call streams all of x again, and x is
// megabytes. Small batches keep L2-sized panels (measured there before; x is small).
constexpr int64_t WIDE_PANEL_MIN_ROWS = 64;
constexpr int64_t WIDE_PANEL_ROWS = 256;

// Weight rows per panel: a whole multiple of `align`, at least one; wide panels still leave every thread four.
inline int64_t panel_rows(int64_t M, int64_t N, int64_t K, int64_t align) {
  int64_t rows = PANEL_BYTES / (K * 4);
  if (M >= WIDE_PANEL_MIN_ROWS)
    rows = std::max(rows, std::min<int64_t>(WIDE_PANEL_ROWS, N / (4 * at::get_num_threads())));
  return std::max<int64_t>(align, rows / align * align);
}

// y [M, N] float32 = x [M, K] float32 . W^T, where decode_rows(n0, nb, out) writes W's rows [n0, n0 + nb) as
// float [nb, K] into out. The buffer lives with its thread (a wide panel is megabytes: fresh pages per call
// would cost their zeroing every time).
template <typename DecodeRows>
void panel_sgemm(const at::Tensor& x, at::Tensor& y, int64_t N, int64_t K, int64_t align,
                 const DecodeRows& decode_rows) {
  const int64_t panel = panel_rows(x.size(0), N, K, align);
  at::parallel_for(0, (N + panel - 1) / panel, 1, [&](int64_t p0, int64_t p1) {
    c10::InferenceMode guard;  // worker threads do not inherit the caller's; y may be an inference tensor
    thread_local std::vector<float> buf;
    buf.resize(panel * K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * panel, nb = std::min(panel, N - n0);
      decode_rows(n0, nb, buf.data());
      at::Tensor yv = y.narrow(1, n0, nb);  // rows of stride N: SGEMM's leading dimension
      at::mm_out(yv, x, at::from_blob(buf.data(), {nb, K}, x.options()).t());
    }
  });
}

}  // namespace tokenmill
