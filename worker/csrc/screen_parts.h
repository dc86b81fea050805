// What the lm_head screens share (lm_head_argmax.cpp's int16 screen, bf16_lm_head_screen.cpp's
// int8 one): the int16 tile math for vpdpwssd (`I16Math`), each thread's surviving columns
// (`ScreenPart`) and the rule that keeps a column while its upper bound reaches the row's largest
// lower bound (`keep_columns`).
#pragma once

#include "packed_linear.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// int16 pairs into vpdpwssd; the accumulators hold int32 bit patterns in float registers.
struct I16Math {
  using Unit = uint32_t;
  using Vec = __m512i;
  using Out = float;
  static constexpr int64_t ROW_BLOCK = 256;
  static inline Vec load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static inline Vec broadcast(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static inline __m512 madd(__m512 acc, Vec a, Vec b) {
    return _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(acc), a, b));
  }
};

// What the bound of a row needs: its scale, sum |scale q| (times a column's largest weight
// error) and its largest element error plus float32's summation error per |x| (times ||W_n||_1).
struct ScreenRow {
  float scale, quantized_l1, error_per_weight_l1;
};

// One thread's columns that may still be a row's argmax: (upper bound, column), and the largest
// lower bound it has seen; a column is kept while its upper bound reaches that.
struct ScreenPart {
  std::vector<float> lower;
  std::vector<std::vector<std::pair<float, int32_t>>> kept;
};

// Folds the bounds of 16 columns (from `first`) of a row into a part: the row's largest lower bound
// so far, and the columns whose upper bound reaches floor(that lower bound); floor must not decrease.
template <typename Floor>
inline void keep_columns(ScreenPart* part, int64_t row, int64_t first, __mmask16 valid, __m512 approx, __m512 bound,
                         Floor floor) {
  float& lower = part->lower[row];
  lower = std::max(lower, _mm512_mask_reduce_max_ps(valid, _mm512_sub_ps(approx, bound)));
  const __m512 upper = _mm512_add_ps(approx, bound);
  __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, upper, _mm512_set1_ps(floor(lower)), _CMP_GE_OQ);
  alignas(64) float uppers[16];
  _mm512_store_ps(uppers, upper);
  for (; keep; keep &= keep - 1) {
    const int j = __builtin_ctz(keep);
    part->kept[row].push_back({uppers[j], static_cast<int32_t>(first + j)});
  }
}

#endif

}  // namespace
