// The int8 screen of a bfloat16 lm_head for greedy steps: the rows' split into int8 rest
// channels and bf16 outliers (`split_row`), the sinks that bound every column's logit
// (`Bf16ScreenSink`, `Bf16BoundSink`) and the exact re-computation of the survivors
// (`settle_row`). Defines PAGEDSERVE_BF16_SCREEN on CPUs with AVX512-BF16 and AVX512-VNNI;
// bf16_lm_head_screen.cpp holds the entry points. See worker/lm_head/bf16_int8_screen.py for
// the bound.
#pragma once

#include "near_top.h"
#include "screen_parts.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define PAGEDSERVE_BF16_SCREEN 1
constexpr float SCREEN_INT8_LEVELS = 127.0f;  // |q| of a row's rest channels
constexpr int SCREEN_U8_OFFSET = 128;         // q + 128: vpdpbusd's unsigned operand

// Groups of four int8 into vpdpbusd (x as u8, W as s8): the int16 screen's units and int32
// accumulators in float registers, another instruction.
struct I8Math : I16Math {
  static inline __m512 madd(__m512 acc, Vec a, Vec b) {
    return _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc), a, b));
  }
};

// What a row's bound needs (see the module docstring).
struct Bf16ScreenRow {
  float scale;            // of the rest channels' levels
  float quantized_l1;     // sum |scale q| over the rest channels (times a column's largest weight error)
  float rest_error;       // largest |x - scale q| (times the column's l1 over the rest channels)
  float outlier_top;      // largest |x| of the outlier channels (for the rounding slack)
  float reference_error;  // gamma_K max|x|: the plain kernel's summation error per ||W_n||_1
};

// Per column, padded to whole panels.
struct Bf16ScreenColumns {
  const float *scale, *weight_error, *l1_rest, *l1_outlier, *l1;
  const int32_t* offset_share;  // 128 sum q: what the u8 offset adds to a column's dot
};

// The lowest upper bound that may still reach the near-top window, given the largest lower bound
// seen: 31 L / 32 for L > 0 (see the module docstring), and non-decreasing in L.
inline float window_floor(float lower) { return lower - std::fabs(lower) * (1.0f / 32.0f) * 1.0001f; }

struct Bf16ScreenSink {
  static constexpr bool kTail = true;
  const Bf16ScreenRow* rows;
  const uint32_t* outlier_x;  // [m, outlier_pairs]: each row's outlier channels as bf16 pairs
  const uint32_t* outlier_w;  // [panels, outlier_pairs, 16]: their weights, packed
  int64_t outlier_pairs;
  Bf16ScreenColumns columns;
  ScreenPart* part;
  int64_t row, col;
  Bf16ScreenSink at(int64_t r, int64_t c) const {
    Bf16ScreenSink s = *this;
    s.row = row + r;
    s.col = col + c;
    return s;
  }

  // int32 dots -> approximate logits, then plus the outlier channels' products in bf16 pairs.
  template <int R, int NV>
  inline void tail(__m512 (&acc)[R][NV]) const {
    for (int v = 0; v < NV; ++v) {
      const int64_t first = col + v * LINEAR_LANES;
      const __m512i share = _mm512_loadu_si512(columns.offset_share + first);
      const __m512 scale = _mm512_loadu_ps(columns.scale + first);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_sub_epi32(_mm512_castps_si512(acc[r][v]), share);
        acc[r][v] = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(rows[row + r].scale), scale));
      }
    }
    const uint32_t* w = outlier_w + col / LINEAR_LANES * outlier_pairs * LINEAR_LANES;
    for (int64_t p = 0; p < outlier_pairs; ++p) {
      __m512bh b[NV];
      for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(w + (v * outlier_pairs + p) * LINEAR_LANES);
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(outlier_x[(row + r) * outlier_pairs + p]));
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
      }
    }
  }

  // The bound on |approx - the plain kernel's float32 value| of the 16 columns from `first`.
  __m512 bound(int64_t row_index, int64_t first, __m512 approx) const {
    const Bf16ScreenRow& x = rows[row_index];
    __m512 bound = _mm512_mul_ps(_mm512_loadu_ps(columns.weight_error + first), _mm512_set1_ps(x.quantized_l1));
    bound = _mm512_fmadd_ps(_mm512_loadu_ps(columns.l1_rest + first), _mm512_set1_ps(x.rest_error), bound);
    bound = _mm512_fmadd_ps(_mm512_loadu_ps(columns.l1 + first), _mm512_set1_ps(x.reference_error), bound);
    // Slack for the float32 rounding of the scaled dot, the outlier products and the bound itself.
    const __m512 size = _mm512_fmadd_ps(_mm512_loadu_ps(columns.l1_outlier + first), _mm512_set1_ps(x.outlier_top),
                                        _mm512_abs_ps(approx));
    return _mm512_fmadd_ps(bound, _mm512_set1_ps(1.001f),
                           _mm512_fmadd_ps(size, _mm512_set1_ps(1e-5f), _mm512_set1_ps(1e-30f)));
  }

  void put(int r, int v, __mmask16 valid, __m512 approx) const {
    if (!valid) return;
    const int64_t first = col + v * LINEAR_LANES;
    keep_columns(part, row + r, first, valid, approx, bound(row + r, first, approx), window_floor);
  }
  void put_gated(int, int, __mmask16, __m512, __m512) const {}
};

// Every column's approximate logit and bound, into out [m, out_features, 2] (bf16_screen_bounds).
struct Bf16BoundSink : Bf16ScreenSink {
  float* out;
  int64_t out_features;
  Bf16BoundSink at(int64_t r, int64_t c) const { return {Bf16ScreenSink::at(r, c), out, out_features}; }
  void put(int r, int v, __mmask16 valid, __m512 approx) const {
    const int64_t first = col + v * LINEAR_LANES;
    alignas(64) float values[LINEAR_LANES], bounds[LINEAR_LANES];
    _mm512_store_ps(values, approx);
    _mm512_store_ps(bounds, bound(row + r, first, approx));
    for (int j = 0; j < LINEAR_LANES; ++j)
      if (valid >> j & 1) {
        out[((row + r) * out_features + first + j) * 2] = values[j];
        out[((row + r) * out_features + first + j) * 2 + 1] = bounds[j];
      }
  }
};

// Row r of x (bf16, K padded to pairs) split into its rest channels as u8 levels and its outlier
// channels as bf16 pairs (channel -1: padding, zero), and its Bf16ScreenRow; false when not finite.
bool split_row(const c10::BFloat16* x, int64_t k, int64_t pairs, const int64_t* rest, int64_t rest_count,
               const int64_t* outliers, int64_t outlier_count, uint8_t* levels, c10::BFloat16* outlier_x,
               Bf16ScreenRow& out) {
  float top = 0.0f, rest_top = 0.0f, outlier_top = 0.0f;
  for (int64_t p = 0; p < k; ++p) {
    const float value = static_cast<float>(x[p]);
    if (!std::isfinite(value)) return false;
    top = std::max(top, std::fabs(value));
  }
  for (int64_t i = 0; i < rest_count; ++i)
    if (rest[i] >= 0) rest_top = std::max(rest_top, std::fabs(static_cast<float>(x[rest[i]])));
  for (int64_t i = 0; i < outlier_count; ++i) {
    outlier_x[i] = outliers[i] >= 0 ? x[outliers[i]] : c10::BFloat16(0.0f);
    outlier_top = std::max(outlier_top, std::fabs(static_cast<float>(outlier_x[i])));
  }
  const float scale = rest_top > 0.0f ? rest_top / SCREEN_INT8_LEVELS : 1.0f;
  const float inverse = 1.0f / scale;
  double quantized_l1 = 0.0, error = 0.0;
  for (int64_t i = 0; i < rest_count; ++i) {
    const double value = rest[i] >= 0 ? static_cast<double>(static_cast<float>(x[rest[i]])) : 0.0;
    const float level = std::min(SCREEN_INT8_LEVELS,
                                 std::max(-SCREEN_INT8_LEVELS, std::nearbyint(static_cast<float>(value) * inverse)));
    levels[i] = static_cast<uint8_t>(static_cast<int>(level) + SCREEN_U8_OFFSET);
    quantized_l1 += std::fabs(static_cast<double>(scale) * level);
    error = std::max(error, std::fabs(value - static_cast<double>(scale) * level));
  }
  // The plain kernel rounds once per product added: 2 x pairs times, gamma_n = n u / (1 - n u).
  const double unit = std::ldexp(1.0, -24), n = 2.0 * pairs, gamma = n * unit / (1.0 - n * unit);
  out = {scale, static_cast<float>(quantized_l1 * 1.0001), static_cast<float>(error * 1.001 + top * 1e-7), outlier_top,
         static_cast<float>(gamma * top * 1.001)};
  return true;
}

// The float32 values the bf16 packed kernel computes for up to 16 columns of one row (`weight`: W
// [N, K] as rows of bf16 pairs, each column's own cache lines, where the packing would spread them
// over a line per pair; x: the row's pairs): vdpbf16ps over the pairs in order from zero, each lane
// as the kernel's lane for that column.
inline __m512 exact_lanes(const uint32_t* x, const uint32_t* weight, int64_t pairs, const int32_t* columns, int n) {
  alignas(64) int32_t base[16];
  for (int j = 0; j < 16; ++j) base[j] = static_cast<int32_t>(columns[j < n ? j : 0] * pairs);
  const __m512i index = _mm512_load_si512(base);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i w = _mm512_i32gather_epi32(index, weight + p, 4);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[p])), (__m512bh)w);
  }
  return acc;
}

// One row's near-top columns from its `columns` (ascending): writes the first column of the largest
// bfloat16 value to `chosen` and those at or above two spacings below it (ascending) to `near`;
// false if a value is not finite.
bool settle_row(const uint32_t* x, const uint32_t* weight, int64_t pairs, const std::vector<int32_t>& columns,
                float model_eps, float model_tiny, int64_t& chosen, std::vector<int32_t>& near) {
  std::vector<float> values(columns.size());
  for (size_t i = 0; i < columns.size(); i += 16) {
    const int n = static_cast<int>(std::min<size_t>(16, columns.size() - i));
    const __m512 exact = exact_lanes(x, weight, pairs, columns.data() + i, n);
    const __m512 rounded = widen_bf16(_mm512_cvtneps_pbh(exact));  // the bf16 logits the plain kernel stores
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, rounded);
    std::copy(lanes, lanes + n, values.begin() + i);
  }
  float top = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) return false;
    if (values[i] > top) {
      top = values[i];
      chosen = columns[i];
    }
  }
  const float threshold = near_top_threshold(top, model_eps, model_tiny);
  near.clear();
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i] >= threshold) near.push_back(columns[i]);
  return true;
}
#endif

}  // namespace
