// W8A8 matmuls on AVX512-VNNI through the packed matmul driver (`linear_run`, packed_linear.h):
// `Int8Math` steps over 4 K values at a time with vpdpbusd (u8 x s8 -> int32), the activations
// quantized per token to u8 with a zero point (asymmetric: the row's [min, max], widened to hold 0,
// in 255 steps), the weight's panels [N / 16, K / 4, 16, 4] of int8 (one 64-byte load per step).
// The accumulators hold int32 (in __m512 registers, cast); `Int8Sink` finishes them:
// acc - zero[row] * sum_k w[col][k] (the column sums precomputed), times the row's and the column's
// scales, plus the bias, silu(gate) * up for the gated MLP, all in float32, rounded once to the
// output dtype (float32 or bfloat16).
#pragma once

#include <cmath>

#include "packed_linear.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t INT8_UNIT = 4;  // K values per step

struct Int8Math {
  using Unit = uint32_t;  // 4 bytes of K: x as u8, the weight as s8
  using Vec = __m512i;
  static constexpr int64_t ROW_BLOCK = 256;
  static inline Vec load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static inline Vec broadcast(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static inline __m512 madd(__m512 acc, Vec a, Vec b) {
    return _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc), a, b));
  }
};

inline void store_out(float* out, __mmask16 valid, __m512 y) { _mm512_mask_storeu_ps(out, valid, y); }
inline void store_out(c10::BFloat16* out, __mmask16 valid, __m512 y) {
  _mm256_mask_storeu_epi16(out, valid, bf16_bits(round_bf16_ps(y)));
}

// v as computed: an empty asm that the compiler must assume reads and changes v, so that
// -ffast-math can neither reassociate nor fuse the operations on either side of it. The epilogue
// is inlined into the VNNI and the AMX loops (int8_amx.h); pinned, both round the same way.
inline __m512 pin(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

// The epilogue: rows of y [m, ldo]; per row its activation scale and zero point, per column the
// weight's scale, its sum and the bias (gated: the up columns `up` entries after the gates').
template <typename Out>
struct Int8Sink {
  Out* out;
  int64_t ldo;
  const float* row_scale;
  const int32_t* row_zero;
  const float* col_scale;
  const int32_t* col_sum;
  const float* bias;
  int64_t up;
  Int8Sink at(int64_t row, int64_t col) const {
    return {out + row * ldo + col, ldo, row_scale + row, row_zero + row, col_scale + col, col_sum + col,
            bias ? bias + col : nullptr, up};
  }
  inline __m512 value(int r, int64_t c, __mmask16 valid, __m512 acc) const {
    const __m512i offset = _mm512_mullo_epi32(_mm512_set1_epi32(row_zero[r]), _mm512_maskz_loadu_epi32(valid, col_sum + c));
    const __m512i exact = _mm512_sub_epi32(_mm512_castps_si512(acc), offset);
    const __m512 y = pin(_mm512_mul_ps(pin(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(row_scale[r]))),
                                       _mm512_maskz_loadu_ps(valid, col_scale + c)));
    return bias ? pin(_mm512_add_ps(y, _mm512_maskz_loadu_ps(valid, bias + c))) : y;
  }
  void put(int r, int v, __mmask16 valid, __m512 acc) const {
    store_out(out + r * ldo + v * LINEAR_LANES, valid, value(r, v * LINEAR_LANES, valid, acc));
  }
  void put_gated(int r, int v, __mmask16 valid, __m512 gate, __m512 upv) const {
    const __m512 g = value(r, v * LINEAR_LANES, valid, gate), u = value(r, v * LINEAR_LANES + up, valid, upv);
    const __m512 denominator = pin(_mm512_add_ps(_mm512_set1_ps(1.0f), pin(exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    store_out(out + r * ldo + v * LINEAR_LANES, valid, pin(_mm512_mul_ps(pin(_mm512_div_ps(g, denominator)), u)));
  }
};

// One row of x (k values) quantized asymmetrically: lo = min(x, 0), hi = max(x, 0), inv = 255 / (hi - lo)
// (0 for a zero row), zero = round(-lo * inv), u8 = clamp(round(x * inv) + zero, 0, 255), rounding to
// nearest even; stored into `u8` (k rounded up to a multiple of 4, the padding `zero`, so that it
// adds nothing). Returns the scale (hi - lo) / 255 and sets *zero.
template <typename In>
inline float quantize_row(const In* x, int64_t k, uint8_t* u8, int32_t* zero) {
  auto load = [&](int64_t i, __mmask16 m) { return load16(m, x + i); };
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();  // masked-off lanes load 0: in range
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
    const __m512 v = load(i, m);
    lo = _mm512_min_ps(lo, v);
    hi = _mm512_max_ps(hi, v);
  }
  const float low = _mm512_reduce_min_ps(lo), range = _mm512_reduce_max_ps(hi) - low;
  const volatile float steps = 255.0f;  // volatile: keep these divisions exact under -ffast-math
  const float inv = range > 0.0f ? steps / range : 0.0f;
  const int32_t z = std::min(255, std::max(0, static_cast<int32_t>(std::nearbyint(-low * inv))));
  *zero = z;
  const __m512 scale = _mm512_set1_ps(inv);
  const __m512i offset = _mm512_set1_epi32(z), top = _mm512_set1_epi32(255);
  // The quarter-lane order the two packs leave, back to value order (dword e <- dword idx[e]).
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const int64_t padded = (k + INT8_UNIT - 1) / INT8_UNIT * INT8_UNIT;
  for (int64_t i = 0; i < padded; i += 64) {  // 64 values a store: 4 vectors packed with saturation
    __m512i v[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t left = k - i - 16 * j;
      const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)(left > 0 ? (1u << left) - 1 : 0);
      const __m512 scaled = _mm512_mul_ps(load(i + 16 * j, m), scale);
      // round + zero, at most 255; the packs clamp below at 0 (unsigned saturation)
      v[j] = _mm512_min_epi32(
          _mm512_add_epi32(_mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), offset), top);
    }
    const __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(v[0], v[1]), _mm512_packus_epi32(v[2], v[3]));
    const int64_t n = std::min<int64_t>(64, padded - i);
    const __mmask64 store = n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
    _mm512_mask_storeu_epi8(u8 + i, store, _mm512_permutexvar_epi32(order, bytes));
  }
  return range > 0.0f ? range / steps : 0.0f;
}
#endif

}  // namespace
