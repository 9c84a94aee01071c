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
// Batches from WIDE_PANEL_MIN_ROWS rows of x take panels of up to WIDE_PANEL_ROWS weight rows whatever their bytes,
// split evenly over the threads (four panels each at least). An SGEMM of 512 rows of x by 16 weight rows (what
// 192 KiB holds at K = 2048) ran at 76 GFLOP/s on one Xeon core, by 256 rows at 137 (K = 8192: 70 against 136;
// 128 rows of x: 91 against 124): each call streams all of x again. Q4_0 linears with weights from DRAM (Xeon, two
// threads): 2048 -> 8192 and 8192 -> 2048 gained 10-25 % from 16 rows of x; at 8 rows 8192 -> 2048 lost. A narrow
// weight (1536 -> 576) lost ~15 % at 16-32 rows with eight panels of 80 rows against 36 of 16, and gained from 64:
// so the wide panels start at 16 rows for weights of WIDE_PANEL_MIN_N rows or more, at 64 for the others.
constexpr int64_t WIDE_PANEL_MIN_ROWS = 16;
constexpr int64_t WIDE_PANEL_MIN_N = 2048;
constexpr int64_t WIDE_PANEL_ANY_N_ROWS = 64;
constexpr int64_t WIDE_PANEL_ROWS = 256;

// Weight rows per panel: a whole multiple of `align`, at least one.
inline int64_t panel_rows(int64_t M, int64_t N, int64_t K, int64_t align) {
  const bool wide = M >= WIDE_PANEL_ANY_N_ROWS || (M >= WIDE_PANEL_MIN_ROWS && N >= WIDE_PANEL_MIN_N);
  if (!wide) return std::max<int64_t>(align, PANEL_BYTES / (K * 4) / align * align);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t panels = std::max<int64_t>(4 * threads, (N + WIDE_PANEL_ROWS - 1) / WIDE_PANEL_ROWS);
  panels = (panels + threads - 1) / threads * threads;
  const int64_t rows = (N + panels - 1) / panels;
  return std::max<int64_t>(align, (rows + align - 1) / align * align);
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
