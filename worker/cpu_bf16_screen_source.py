"""C++ source of the int8 screen of a bfloat16 lm_head for greedy steps (after
`worker.cpu_argmax_source`, whose `ScreenPart` it shares, and
`worker.cpu_linear_source`, whose matmul driver runs it).

A greedy bfloat16 step otherwise writes [rows, vocab] bfloat16 logits from the
packed matmul, scans each row for the tokens within two rounding steps of its
maximum, and settles near ties in float32 (`worker.greedy_refine`). This finds
the same near-top tokens with the same bfloat16 values while computing most
logits only approximately, with `vpdpbusd` (u8 x s8 into int32), which has
twice `vdpbf16ps`'s MAC rate:

- The final hidden states carry a few outlier channels (a row's max |x| is ~45
  where its median is ~0.6). Those channels (chosen at start-up from a
  calibration batch, `worker.models.bf16_lm_head_screen`) are multiplied
  exactly, in bfloat16 pairs, in the tile's tail; the rest are scaled per row
  into int8 (|q| <= 127, offset by 128 into u8) against W scaled per column.
- Every column gets an approximate logit and a rigorous bound on its distance
  to the float32 value the bf16 packed kernel computes (before its rounding to
  bfloat16): the rounding of x and W (largest element error times the l1 norm
  of the other factor), the kernel's own float32 summation error (gamma_K
  max|x| ||W_n||_1), and slack for float32 rounding of the approximation.
- Let L be the largest lower bound of a row. Its largest bfloat16 logit M is at
  least L rounded, and the near-top window [M - 2 spacing(M), M] lies above
  L (1 - 2^-8)(63/64) / (1 + 2^-8) > 31 L / 32 (for L > 0), so only columns
  whose upper bound reaches 31 L / 32 can be in it. That floor only rises with
  L, so a tile drops a column as soon as its upper bound falls below the floor
  of the lower bounds seen so far.
- The survivors (a few dozen of 49,152 on average) are computed again with
  `vdpbf16ps` over K in order from zero, lane for lane what the plain kernel
  computes, and rounded the same way: the maximum, its first column and the
  near-top window are those of the plain logits, bit for bit.

A row whose largest lower bound is not positive computes every column exactly
(it never happened on W1 or W2); a row that is not finite sends the whole call
back to the plain path (an empty result).
"""

BF16_SCREEN_SOURCE = r"""
bool bf16_screen_available();

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
      for (int v = 0; v < NV; ++v)
        b[v] = (__m512bh)_mm512_loadu_si512(w + (v * outlier_pairs + p) * LINEAR_LANES);
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(outlier_x[(row + r) * outlier_pairs + p]));
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
      }
    }
  }

  void put(int r, int v, __mmask16 valid, __m512 approx) const {
    if (!valid) return;
    const int64_t first = col + v * LINEAR_LANES, row_index = row + r;
    const Bf16ScreenRow& x = rows[row_index];
    __m512 bound = _mm512_mul_ps(_mm512_loadu_ps(columns.weight_error + first), _mm512_set1_ps(x.quantized_l1));
    bound = _mm512_fmadd_ps(_mm512_loadu_ps(columns.l1_rest + first), _mm512_set1_ps(x.rest_error), bound);
    bound = _mm512_fmadd_ps(_mm512_loadu_ps(columns.l1 + first), _mm512_set1_ps(x.reference_error), bound);
    // Slack for the float32 rounding of the scaled dot, the outlier products and the bound itself.
    const __m512 size = _mm512_fmadd_ps(_mm512_loadu_ps(columns.l1_outlier + first), _mm512_set1_ps(x.outlier_top),
                                        _mm512_abs_ps(approx));
    bound = _mm512_fmadd_ps(bound, _mm512_set1_ps(1.001f),
                            _mm512_fmadd_ps(size, _mm512_set1_ps(1e-5f), _mm512_set1_ps(1e-30f)));
    keep_columns(part, row_index, first, valid, approx, bound, window_floor);
  }
  void put_gated(int, int, __mmask16, __m512, __m512) const {}
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
    const float level = std::min(SCREEN_INT8_LEVELS, std::max(-SCREEN_INT8_LEVELS,
                                                              std::nearbyint(static_cast<float>(value) * inverse)));
    levels[i] = static_cast<uint8_t>(static_cast<int>(level) + SCREEN_U8_OFFSET);
    quantized_l1 += std::fabs(static_cast<double>(scale) * level);
    error = std::max(error, std::fabs(value - static_cast<double>(scale) * level));
  }
  // The plain kernel rounds once per product added: 2 x pairs times, gamma_n = n u / (1 - n u).
  const double unit = std::ldexp(1.0, -24), n = 2.0 * pairs, gamma = n * unit / (1.0 - n * unit);
  out = {scale, static_cast<float>(quantized_l1 * 1.0001), static_cast<float>(error * 1.001 + top * 1e-7),
         outlier_top, static_cast<float>(gamma * top * 1.001)};
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
    if (values[i] > top) { top = values[i]; chosen = columns[i]; }
  }
  const float threshold = near_top_threshold(top, model_eps, model_tiny);
  near.clear();
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i] >= threshold) near.push_back(columns[i]);
  return true;
}
#endif

}  // namespace

// Greedy tokens of bf16 x [m, K] through the lm_head screen (see the module docstring): {chosen [m],
// counts [m] (tokens in each row's near-top window), candidate_rows, candidate_tokens (the windows of
// rows with counts > 1, ascending)}, as `near_top_scan` of the plain logits gives them; empty when a
// row is not finite. `weight`: W [N, K] (K even); `packed`: its bf16 packing; `screen_packed` [panels, rest / 4, 16, 4] int8;
// `outlier_packed` [panels, outliers / 2, 16, 2] bf16; `rest`/`outliers`: x's channels in the
// packings' order (-1: padding); `column_terms` float32 [5, panels x 16]: scale, weight error, l1
// of the rest, l1 of the outliers, l1; `offset_share` int32 [panels x 16].
std::vector<torch::Tensor> screened_bf16_argmax(torch::Tensor x, torch::Tensor weight, torch::Tensor packed,
                                                torch::Tensor screen_packed,
                                                torch::Tensor outlier_packed, torch::Tensor rest,
                                                torch::Tensor outliers, torch::Tensor column_terms,
                                                torch::Tensor offset_share, int64_t out_features, double model_eps,
                                                double model_tiny) {
  TORCH_CHECK(bf16_screen_available(), "screened_bf16_argmax needs a CPU with AVX512-BF16 and AVX512-VNNI");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "screened_bf16_argmax takes bfloat16");
  const torch::Tensor rows = checked_rows(x, packed, out_features, c10::nullopt, false);
  const int64_t m = rows.size(0), k = x.size(-1), pairs = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(screen_packed.scalar_type() == at::kChar && screen_packed.dim() == 4 && screen_packed.size(0) == panels &&
              screen_packed.size(2) == 16 && screen_packed.size(3) == 4 && screen_packed.is_contiguous(),
              "screen_packed must be [panels, rest / 4, 16, 4] int8");
  TORCH_CHECK(outlier_packed.scalar_type() == at::kBFloat16 && outlier_packed.dim() == 4 &&
              outlier_packed.size(0) == panels && outlier_packed.size(2) == 16 && outlier_packed.size(3) == 2 &&
              outlier_packed.is_contiguous(), "outlier_packed must be [panels, outliers / 2, 16, 2] bfloat16");
  TORCH_CHECK(rest.scalar_type() == at::kLong && rest.dim() == 1 && rest.size(0) == 4 * screen_packed.size(1) &&
              outliers.scalar_type() == at::kLong && outliers.dim() == 1 && outliers.size(0) == 2 * outlier_packed.size(1),
              "rest and outliers must list the packings' channels (int64)");
  TORCH_CHECK(rest.max().item<int64_t>() < k && outliers.max().item<int64_t>() < k, "a channel is out of range");
  TORCH_CHECK(column_terms.scalar_type() == at::kFloat && column_terms.dim() == 2 && column_terms.size(0) == 5 &&
              column_terms.size(1) == panels * 16 && column_terms.is_contiguous(), "column_terms must be [5, panels x 16]");
  TORCH_CHECK(offset_share.scalar_type() == at::kInt && offset_share.numel() == panels * 16 && offset_share.is_contiguous(),
              "offset_share must be int32 [panels x 16]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.size(0) == out_features &&
              weight.size(1) == 2 * pairs && weight.is_contiguous(), "weight must be a contiguous bf16 [N, K], K even");
  TORCH_CHECK(out_features * pairs < (int64_t{1} << 31), "the lm_head is too large for 32-bit gathers");
#if defined(PAGEDSERVE_BF16_SCREEN)
  auto chosen = torch::zeros({m}, at::kLong), counts = torch::zeros({m}, at::kLong);
  if (m == 0) return {chosen, counts, torch::zeros({0}, at::kLong), torch::zeros({0}, at::kLong)};
  const int64_t rest_count = rest.size(0), outlier_count = outliers.size(0), outlier_pairs = outlier_count / 2;
  const c10::BFloat16* xr = reinterpret_cast<const c10::BFloat16*>(rows.data_ptr());
  std::vector<uint8_t> levels(m * rest_count);
  std::vector<c10::BFloat16> outlier_x(m * outlier_count);
  std::vector<Bf16ScreenRow> info(m);
  std::atomic<bool> finite{true};
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (!split_row(xr + r * 2 * pairs, k, pairs, rest.data_ptr<int64_t>(), rest_count, outliers.data_ptr<int64_t>(),
                     outlier_count, levels.data() + r * rest_count, outlier_x.data() + r * outlier_count, info[r]))
        finite = false;
  });
  if (!finite) return {};
  const float* terms = column_terms.data_ptr<float>();
  const int64_t width = panels * 16;
  const Bf16ScreenColumns columns{terms, terms + width, terms + 2 * width, terms + 3 * width, terms + 4 * width,
                                  offset_share.data_ptr<int32_t>()};
  std::mutex lock;
  std::deque<ScreenPart> parts;  // a deque: a thread's part never moves while others are added
  linear_run<I8Math, false>(reinterpret_cast<const uint32_t*>(levels.data()), m,
                            reinterpret_cast<const uint32_t*>(screen_packed.data_ptr()), panels, rest_count / 4,
                            nullptr, out_features, [&](int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    parts.push_back({std::vector<float>(m, -std::numeric_limits<float>::infinity()),
                     std::vector<std::vector<std::pair<float, int32_t>>>(m)});
    return Bf16ScreenSink{info.data(), reinterpret_cast<const uint32_t*>(outlier_x.data()),
                          reinterpret_cast<const uint32_t*>(outlier_packed.data_ptr()), outlier_pairs, columns,
                          &parts.back(), 0, 0};
  });
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(rows.data_ptr());
  const uint32_t* w = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  std::vector<std::vector<int32_t>> windows(m);
  int64_t* chosen_out = chosen.data_ptr<int64_t>();
  int64_t* counts_out = counts.data_ptr<int64_t>();
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> columns_left;
    for (int64_t r = begin; r < end; ++r) {
      float lower = -std::numeric_limits<float>::infinity();
      for (const ScreenPart& part : parts) lower = std::max(lower, part.lower[r]);
      columns_left.clear();
      if (lower > 1e-30f) {
        const float floor = window_floor(lower);
        for (const ScreenPart& part : parts)
          for (const auto& [upper, c] : part.kept[r])
            if (upper >= floor) columns_left.push_back(c);
        std::sort(columns_left.begin(), columns_left.end());
      } else {  // no positive lower bound: the window is not confined; every column
        columns_left.resize(out_features);
        for (int64_t c = 0; c < out_features; ++c) columns_left[c] = static_cast<int32_t>(c);
      }
      if (!settle_row(x_pairs + r * pairs, w, pairs, columns_left, static_cast<float>(model_eps),
                      static_cast<float>(model_tiny), chosen_out[r], windows[r]))
        finite = false;
      counts_out[r] = static_cast<int64_t>(windows[r].size());
    }
  });
  if (!finite) return {};
  std::vector<int64_t> candidate_rows, candidate_tokens;
  for (int64_t r = 0; r < m; ++r)
    if (windows[r].size() > 1)
      for (int32_t c : windows[r]) {
        candidate_rows.push_back(r);
        candidate_tokens.push_back(c);
      }
  const auto as_tensor = [](const std::vector<int64_t>& v) {
    return torch::tensor(at::ArrayRef<int64_t>(v), at::kLong);
  };
  return {chosen, counts, as_tensor(candidate_rows), as_tensor(candidate_tokens)};
#else
  return {};
#endif
}

bool bf16_screen_available() {
#if defined(PAGEDSERVE_BF16_SCREEN)
  return true;
#else
  return false;
#endif
}
"""
