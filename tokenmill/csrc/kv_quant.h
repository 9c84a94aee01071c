// Quantized KV cache elements for paged attention (--kv-cache-dtype int8 / fp8_e4m3).
//
// int8: symmetric, one float32 scale per (cache slot, KV head) for K and one for V, kept beside the
// cache ([num_blocks, block_size, Hk]); value = q * scale with scale = max|x| / 127.
// fp8: float8_e4m3fn values with one scale per layer for K and one for V (value = q * scale).
// Loads widen 8-bit values to a float vector in registers; the scales are applied by the caller
// (folded into the score of a row, or into the softmax weight of a V row).
#pragma once

#include "vec.h"

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace tokenmill {
namespace kvq {

using fVec = at::vec::Vectorized<float>;
constexpr int VS = fVec::size();
constexpr float FP8_MAX = 448.f;

// Every float8_e4m3fn bit pattern as a float (scalar decoding, and the portable vector path).
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

inline fVec load_int8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float tmp[VS];
  for (int i = 0; i < VS; ++i) tmp[i] = static_cast<float>(p[i]);
  return fVec::loadu(tmp);
#endif
}

// e4m3fn -> float in registers: the 7 magnitude bits shifted to the top of a float's exponent and
// mantissa read as a float 2^120 times too small (the exponent biases differ by 127 - 7), subnormals
// included; then the sign, and NaN (magnitude 0x7f) kept NaN.
inline fVec load_fp8(const c10::Float8_e4m3fn* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)), _mm512_set1_ps(0x1p120f));
  f = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f),
                                          _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24)));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
  return fVec(_mm512_mask_blend_ps(nan, f, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
  f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24)));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
  return fVec(_mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan));
#else
  const float* lut = fp8_table();
  float tmp[VS];
  for (int i = 0; i < VS; ++i) tmp[i] = lut[p[i].x];
  return fVec::loadu(tmp);
#endif
}

// One row of D values -> int8 and its scale, as the torch reference does it: scale = max|x| / 127,
// q = round_half_even(x / scale) (all zero when the row is).
inline void quantize_row_int8(const float* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float s = amax / 127.f;
  *scale = s;
  if (s == 0.f) {
    std::fill(q, q + D, int8_t(0));
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    const float r = std::nearbyint(x[d] / s);
    q[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
}

// x / scale, saturated to e4m3's finite range (NaN stays NaN, as torch.clamp keeps it), rounded to
// nearest even.
inline void quantize_row_fp8(const float* x, int64_t n, float scale, c10::Float8_e4m3fn* q) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = x[i] / scale;
    q[i] = c10::Float8_e4m3fn(std::isnan(y) ? y : std::min(FP8_MAX, std::max(-FP8_MAX, y)));
  }
}

}  // namespace kvq
}  // namespace tokenmill
