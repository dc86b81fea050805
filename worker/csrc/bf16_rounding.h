// Rounding like eager bfloat16 PyTorch (`round_to_bf16`, `round_bf16_ps`, `bf16_bits`), and the
// gated MLP's activation `silu(gate) * up` on it (`silu_mul_bf16`, the gated matmul's epilogue).
// The activation rounds where eager bfloat16 PyTorch rounds: silu in float32 rounded to
// bfloat16, then the product rounded again (round to nearest even, as c10::BFloat16). Eager
// computes silu as x / (1 + exp(-x)) with SLEEF's exp; the polynomial exp_ps differs from it in
// the last bits of float32, which changes a bfloat16 result only when it sits on a rounding
// boundary (the tests compare bit for bit).
#pragma once

#include "vector_helpers.h"

namespace {

inline float round_to_bf16(float x) {  // c10::BFloat16's rounding, kept in a float
  return static_cast<float>(static_cast<c10::BFloat16>(x));
}

#if defined(__AVX512F__)
// Round to nearest even at bit 16, as c10::round_to_nearest_even (NaN stays NaN).
inline __m512 round_bf16_ps(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                           _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(rounded),
                              _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// The 16 bf16 values held exactly in floats (rounded above), as bf16 bits: their top halves.
// Storing these keeps subnormals, which vcvtneps2bf16 would flush to zero.
inline __m256i bf16_bits(__m512 exact) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(exact), 16));
}

// silu(gate) * up of bf16 values held in floats, rounded where eager bf16 rounds (the result
// is a bf16 value in a float).
inline __m512 silu_mul_bf16(__m512 g, __m512 up) {
  const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return round_bf16_ps(_mm512_mul_ps(round_bf16_ps(s), up));
}
#endif

}  // namespace
