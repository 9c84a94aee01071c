// Integer dot products against int8 activations (--activation-quantization int8), shared by the GGUF and the
// int4 / int8 decode kernels. As llama.cpp's vec_dot: a row of x is quantized per 32 columns to int8 (d =
// max|x| / 127, q = round(x / d)), and 32 weights times 32 x values are one maddubs (unsigned 8-bit weights x
// signed 8-bit x, adjacent pairs summed to 16 bits) and one madd (into 8 int32 lanes), then scaled by d_w * d_x
// in float. A third of the instructions of widening the weights to float; the result differs from float
// activations by x's rounding, beyond float noise: hence a switch.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstdint>
#define TOKENMILL_INT8_DOT 1

namespace tokenmill {
namespace x8 {

// rows of x [M, K] (K a multiple of 32) -> int8 [M, K], one scale per 32 columns [M, K / 32] and, if `s` is
// given, each block's sum as quantized (d * sum(q)). Offset terms (Q4_1's min, int4's zero point) multiply
// these sums, not the exact ones: then the whole product is exactly x_quantized . W, and its error x's
// rounding times W, not times W's larger unsigned integer part.
inline void quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s = nullptr) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < M * (K / 32); ++g) {
    const float* xb = x + g * 32;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    d[g] = mx / 127.f;
    const __m256 id = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    __m256i i[4];
    for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));  // to nearest, ties even
    // packs work within 128-bit lanes: the permute puts the 32 bytes back in column order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * 32), _mm256_permutevar8x32_epi32(p, perm));
    if (s != nullptr) {
      const __m256i w = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_permutevar8x32_epi32(p, perm)),
                                          _mm256_set1_epi16(1));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      s[g] = d[g] * static_cast<float>(_mm_cvtsi128_si32(t));
    }
  }
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibbles as 32 unsigned bytes: the low nibbles first, then the high ones.
inline __m256i nibbles(const uint8_t* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xF));
}

// 32 unsigned x 32 signed bytes -> 8 float partial sums (|w| <= 128 and |x| <= 127: no 16-bit saturation).
// With VNNI in the build's target (the avx512_vnni tier's AVX512-VNNI + VL, or the avx2_vnni tier's AVX-VNNI)
// one vpdpbusd does the maddubs + madd pair: the same integers (nothing saturates above), one instruction
// instead of two on the multiply ports. TOKENMILL_INT8_VNNI names the path in use (int8_dot_path()).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENMILL_INT8_VNNI "avx512-vnni"
inline __m256 dot_u8s8(__m256i w, __m256i x) {
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
}
#elif defined(__AVXVNNI__)
#define TOKENMILL_INT8_VNNI "avx-vnni"
inline __m256 dot_u8s8(__m256i w, __m256i x) {
  return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x));
}
#else
inline __m256 dot_u8s8(__m256i w, __m256i x) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#endif

// Signed x signed: |w| against x carrying w's sign.
inline __m256 dot_s8s8(__m256i w, __m256i x) { return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace x8
}  // namespace tokenmill
#endif
