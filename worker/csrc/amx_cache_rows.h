// Cache rows as the bfloat16 the AMX tiles multiply: a bfloat16 cache as it lies, an 8-bit float
// cache (e4m3, e5m2) widened through load16 of vector_helpers.h. Every e4m3 and e5m2 value is
// exactly a bfloat16 (after e4m3's read factor 2^-8, see kReadFactor), so the tiles see the
// stored values; callers fold k_scale x kReadFactor into the softmax scale and v_scale x
// kReadFactor into the output.
#pragma once

#include "vector_helpers.h"

#if defined(__AVX512BF16__)
namespace {
namespace amx {

// 16 values from p as bfloat16 words (lanes outside `mask` zero and not read).
inline __m256i bf16x16(__mmask16 mask, const c10::BFloat16* p) { return _mm256_maskz_loadu_epi16(mask, p); }
inline __m256i bf16x16(__mmask16 mask, const c10::Float8_e5m2* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, p));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8)));
}
inline __m256i bf16x16(__mmask16 mask, const c10::Float8_e4m3fn* p) {
  const __m256i bytes = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(mask, p));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(bytes, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_cvtph_ps(half));
}

// 16 K rows (`stride` elements apart) from k as bfloat16 rows of `dim` in dst; rows from `valid` on zero.
template <typename T>
inline void widen_rows(const T* k, int64_t stride, int64_t valid, int64_t dim, c10::BFloat16* dst) {
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t d = 0; d < dim; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * dim + d),
                          i < valid ? bf16x16(0xFFFF, k + i * stride + d) : _mm256_setzero_si256());
}

}  // namespace amx
}  // namespace
#endif
