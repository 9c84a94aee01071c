// Interleaved rows (R16): Q4_0 / Q4_1 / Q8_0 weights (linear layers, embedding tables) in groups of 16 rows, made at load
// by layers/quantization/gguf.py (interleave_rows) where the build has AVX-512 VNNI. The batch-1 kernels of
// split rows spend as much on each row's fixed work (its scales, its offset term, reducing its accumulators) as
// on its blocks when rows are short (K = 576: 18 blocks), and widen every weight to a vector of its own row. Here
// one vector lane is one row: a block of 16 rows is four 64-byte loads, and 16 rows' dot products come out in
// one vector, with no reduction. A group of 16 rows of nb blocks is laid out as
//   scales  [nb][16] f16      (block b's d of rows 0..15)
//   mins    [nb][16] f16      (Q4_1 only)
//   quants  [nb][c][16][4]    (block b: for each 4-byte column j < c, row r's quant bytes 4j..4j+3; c = 4 for
//                             Q4_0 / Q4_1, 8 for Q8_0)
// so that byte k of lane r of the j-th 64-byte vector holds row r's weights 4j+k (low nibble) and 16+4j+k (high
// nibble), as its split row did (Q8_0: its weight 4j+k). Same bytes as the 16 split rows, same tensor shape [N, row_bytes]; type id
// R16 + the ggml type.
#pragma once

#include <cstdint>

namespace tokenmill {
namespace r16 {

constexpr int64_t R16 = 2000;
constexpr int64_t ROWS = 16;

inline bool is_r16(int64_t qt) { return qt == R16 + 2 || qt == R16 + 3 || qt == R16 + 8; }  // Q4_0, Q4_1, Q8_0

// Whether this build has the kernels (AVX-512 F/BW + VNNI).
bool available();

// y[M, N] = x W^T, float activations, for the few rows of a decode (every row's sum in the same order
// whatever M: a request answers the same alone and in a batch).
// min_bytes: weights smaller than this run on one thread (gguf_linear.cpp's PARALLEL_MIN_BYTES).
void gemv_f32(int64_t base, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
              int64_t min_bytes);

// y[M, N] = x W^T with every row of x quantized to int8 per 32 columns (--activation-quantization int8).
void gemm_x8(int64_t base, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
             int64_t min_bytes);

// Groups [g0, g1) dequantized into rows of bfloat16: out[(16 (g - g0) + r) * ld + k] is weight k of row 16 g + r.
// Each weight is the exact float product of its quant and scale (plus min), rounded to nearest even: the values
// of dequantizing its split row and converting it (--quantized-batch-dtype bfloat16, gguf_linear.cpp).
void dequant_bf16(int64_t base, const uint8_t* w, int64_t g0, int64_t g1, int64_t K, uint16_t* out, int64_t ld);

// Row n of an R16 matrix as a split row (scales, mins, quants: gguf_linear.cpp's layout) into `out`.
void split_row(int64_t base, const uint8_t* w, int64_t n, int64_t K, uint8_t* out);

}  // namespace r16
}  // namespace tokenmill
