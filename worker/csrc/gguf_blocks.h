// GGUF quantized weights repacked for the CPU matmul (worker/quantization/gguf_packing.py): panels
// of 16 output rows, each a run of chunks of G consecutive K values (G = 32, or 16 when a Q6_K
// part needs its 16-value scales). A chunk is [scale: 16 floats][offset: 16 floats][values], the
// floats float16 where every scale and offset of the tensor is one exactly (Q4_0, Q4_1, Q8_0: a
// sixth fewer bytes to read per 4-bit weight), else float32,
// the weight of row r at K value k being scale[r] * q + offset[r] with q the stored unsigned value
// (each GGUF type's d, d * sub-scale, min and zero point folded into scale and offset at load, the
// quantized values' bits unchanged). `values` are stored by pairs of K values (k0, k1), 16 rows each:
//   BITS 4: 16 bytes per pair, byte r = q(r, k0) | q(r, k1) << 4;
//   BITS 6: those 16 bytes per pair for the low 4 bits, then G / 4 x 16 bytes of high bits, byte r
//           of row r holding 2 bits of each of 2 pairs (pair 2i at bits 0-3, k0 first);
//   BITS 8: 32 bytes per pair, the 16 rows' k0 then their k1.
// `unpack_pair` gives the float32 weights of pair j for the 16 rows. scale * q is exact in float32
// for every type (at most 24 significant bits), so the one rounding of the add is gguf's own: the
// value equals gguf.quants.dequantize's bit for bit whether or not the compiler fuses the FMA (a
// zero weight is +0.0 where gguf's d * (q - z) may give -0.0: the same in every product and sum).
// The chunk's size names its layout (`gguf_layout_of`): 8-bit chunks of 16 are padded to tell them
// from 4-bit chunks of 32, and 6-bit chunks to tell them from 4-bit chunks with a float16 header.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <utility>

namespace {

constexpr int64_t GGUF_ROWS = 16;            // rows per panel
constexpr int64_t GGUF_CHUNK_HEADER = 128;   // the scales and offsets of a chunk in float32, in bytes
constexpr int64_t GGUF_HALF_HEADER = 64;     // ... in float16

struct GgufLayout {
  int64_t g = 0;       // K values per chunk
  int bits = 0;        // bits per stored value; 0: no layout
  int64_t header = 0;  // header bytes: GGUF_CHUNK_HEADER or GGUF_HALF_HEADER
};

// The layout of chunks of `chunk` bytes: 4-bit chunks of 32 (Q4_0, Q4_1, Q4_K), 6-bit of 16 (Q6_K,
// padded), 8-bit of 32 (Q8_0) or of 16 (Q8_0 fused with Q6_K, padded); bits 0: none.
inline GgufLayout gguf_layout_of(int64_t chunk) {
  switch (chunk) {
    case GGUF_CHUNK_HEADER + 32 * 8:
      return {32, 4, GGUF_CHUNK_HEADER};
    case GGUF_HALF_HEADER + 32 * 8:
      return {32, 4, GGUF_HALF_HEADER};
    case GGUF_CHUNK_HEADER + 16 * 12 + 16:
      return {16, 6, GGUF_CHUNK_HEADER};
    case GGUF_CHUNK_HEADER + 32 * 16:
      return {32, 8, GGUF_CHUNK_HEADER};
    case GGUF_HALF_HEADER + 32 * 16:
      return {32, 8, GGUF_HALF_HEADER};
    case GGUF_CHUNK_HEADER + 16 * 16 + 64:
      return {16, 8, GGUF_CHUNK_HEADER};
    default:
      return {};
  }
}

#if defined(__AVX512F__)
// The 16 rows' scale and offset of a chunk whose header has `header` bytes.
inline void gguf_header(const uint8_t* chunk, int64_t header, __m512& scale, __m512& offset) {
  if (header == GGUF_HALF_HEADER) {
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
    offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32)));
  } else {
    scale = _mm512_loadu_ps(reinterpret_cast<const float*>(chunk));
    offset = _mm512_loadu_ps(reinterpret_cast<const float*>(chunk) + GGUF_ROWS);
  }
}

// Pair j (K values 2j, 2j + 1 of the chunk) of the 16 rows: w0 (k0), w1 (k1), in float32;
// `values`: the chunk's values, after its header.
template <int BITS>
inline void unpack_pair(const uint8_t* values, __m512 scale, __m512 offset, int64_t g, int64_t j, __m512& w0,
                        __m512& w1) {
  __m512i q0, q1;
  if constexpr (BITS == 8) {
    q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values + 32 * j)));
    q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values + 32 * j + 16)));
  } else {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values + 16 * j)));
    q0 = _mm512_and_si512(e, _mm512_set1_epi32(0xF));
    q1 = _mm512_srli_epi32(e, 4);
    if constexpr (BITS == 6) {
      const uint8_t* high = values + 8 * g + 16 * (j / 2);
      const __m512i h = _mm512_srli_epi32(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high))), static_cast<int>(4 * (j & 1)));
      q0 = _mm512_or_si512(q0, _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x3)), 4));
      q1 = _mm512_or_si512(q1, _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0xC)), 2));
    }
  }
  w0 = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(q0), offset);
  w1 = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(q1), offset);
}

#if defined(__AVX512BF16__)
// w0 and w1 rounded to bfloat16 (as a float -> bfloat16 cast) and interleaved as the bf16 packed
// kernel's step: (row 0 k0, row 0 k1, row 1 k0, ...).
inline __m512bh gguf_bf16_pair(__m512 w0, __m512 w1) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (__m512bh)_mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}
#endif
#endif

}  // namespace
