// The headers every kernel uses and the vector helpers they share: widening loads of float32,
// bfloat16 and the 8-bit float KV cache types (`load_float`, `load16`), a 16 x 16 dword
// transpose (`transpose16`), a vectorized exp for x <= 0 that overflows to inf like exp
// (`exp_ps`) and a cheaper 2^t for probabilities that are rounded to bfloat16 (`exp2_ps`).
// Everything here has internal linkage (an unnamed namespace), as when all the
// kernels were one translation unit: each .cpp gets its own copy and the same inlining.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float load_float(const T* p) {
  return static_cast<float>(*p);
}
inline float load_float(const c10::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// 8-bit float caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2). Loads return the stored value divided
// by kReadFactor<T> (a power of two, so exactly): e4m3 widens through float16 bits that hold it
// times 2^-8 (below). Callers fold the factor into the softmax scale and the output.
template <typename T>
constexpr bool kFp8 = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;
template <typename T>
constexpr float kReadFactor = std::is_same_v<T, c10::Float8_e4m3fn> ? 256.0f : 1.0f;
inline float load_float(const c10::Float8_e4m3fn* p) { return static_cast<float>(*p) * (1.0f / 256.0f); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// The lanes of `mask` only (others 0): row tails.
inline __m512 load16(__mmask16 mask, const float* p) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(__mmask16 mask, const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
// e5m2 is the top byte of a float16: widen, shift, vcvtph2ps (AVX-512F, no FP16 extension needed).
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
}
// e4m3 (s eeee mmm, bias 7) as the float16 s 0eeee mmm0000000 (bias 15): the value times 2^-8, subnormals
// included. Sign-extending the byte and shifting by 7 puts the sign in bits 15 and 14; bit 14 is
// cleared. The NaN byte (s 1111 111) reads as +-480 / 256: writes saturate, so only NaN K/V make it.
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i bytes = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(bytes, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF))));
}

// Lane j of the result is the sum of the 16 lanes of v[j].
inline __m512 horizontal_sums(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]), _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
  const __m512 x = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, x);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 32 elements of an 8-bit float cache as 32 bfloat16 (the value / kReadFactor<T>, exactly: both formats
// fit in bfloat16), for vdpbf16ps: widened to float16 bits as load16 does, then to float32 and packed.
template <typename T>
inline __m512i load32_bf16(const T* p) {
  static_assert(kFp8<T>, "8-bit float caches only");
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m512i half;
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>)
    half = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
  else
    half = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                            _mm512_set1_epi16(static_cast<short>(0xBFFF)));
  const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
  const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
// load32_bf16 for 64 elements at once by table lookup (vpermi2b): the low and the high byte of the
// bfloat16 of each magnitude code (0..127, built by load32_bf16 itself, so bit for bit the same),
// the sign bit ORed in. A first vpermb orders the bytes so that the two byte-interleaving unpacks
// give elements 0..31 and 32..63 in order.
template <typename T>
struct Fp8Bf16Lookup {
  __m512i low[2], high[2], order;
  Fp8Bf16Lookup() {
    alignas(64) uint8_t codes[128], lo[128], hi[128], idx[64];
    alignas(64) uint16_t words[128];
    for (int i = 0; i < 128; ++i) codes[i] = static_cast<uint8_t>(i);
    for (int i = 0; i < 128; i += 32)
      _mm512_storeu_si512(words + i, load32_bf16(reinterpret_cast<const T*>(codes + i)));
    for (int i = 0; i < 128; ++i) lo[i] = static_cast<uint8_t>(words[i]), hi[i] = static_cast<uint8_t>(words[i] >> 8);
    for (int lane = 0; lane < 4; ++lane)
      for (int i = 0; i < 8; ++i) idx[16 * lane + i] = 8 * lane + i, idx[16 * lane + 8 + i] = 32 + 8 * lane + i;
    low[0] = _mm512_load_si512(lo), low[1] = _mm512_load_si512(lo + 64);
    high[0] = _mm512_load_si512(hi), high[1] = _mm512_load_si512(hi + 64);
    order = _mm512_load_si512(idx);
  }
  // dst[0 .. 64) <- src[0 .. 64) as bfloat16 (divided by kReadFactor<T>, as load32_bf16).
  inline void widen64(const T* src, c10::BFloat16* dst) const {
    const __m512i x = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(src));
    const __m512i l = _mm512_permutex2var_epi8(low[0], x, low[1]);
    __m512i h = _mm512_permutex2var_epi8(high[0], x, high[1]);
    h = _mm512_ternarylogic_epi32(h, x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // h | (x & 0x80)
    _mm512_storeu_si512(dst, _mm512_unpacklo_epi8(l, h));
    _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi8(l, h));
  }
};
template <typename T>
inline const Fp8Bf16Lookup<T>& fp8_bf16_lookup() {
  static const Fp8Bf16Lookup<T> lookup;
  return lookup;
}
#endif

// r[e] <- dword e of each of the 16 registers (a 16 x 16 dword transpose).
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + e], 128-bit lane k: element 4k + e of rows 4g .. 4g + 3.
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), b = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88),
                  d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

// exp(x) for x <= 0 (max-subtracted scores): 2^n * p(r) with a degree-6 polynomial.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.3981999507e-3f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073e-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894e-2f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201e-1f));
  poly = _mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(poly, n);
}

// 2^t for t <= ~16 (attention probabilities, rounded to bfloat16 after): 2^n * p(t - n) with a
// degree-4 polynomial (relative error < 5e-5); t of -inf or below -200 gives 0.
inline __m512 exp2_ps(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-200.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(t, n);
  __m512 poly = _mm512_set1_ps(9.6181291e-3f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.5504109e-2f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(2.4022651e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(6.9314718e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(poly, n);
}
#endif

}  // namespace
