// The greedy lm_head: each row's argmax of x @ W.T without the [rows, vocab] logits.
// `pagedserve::packed_linear_argmax` runs the float32 packed matmul into a running argmax;
// `screened_argmax` finds the same column with int16 dot products first (CPUs with
// AVX512-VNNI: vpdpwssd). Each row of x is scaled into int16 (|q| <= 2047) and W was scaled per
// column at load time (`worker.lm_head.int16_screen`), so every column gets an approximate
// logit and a rigorous bound on its distance to the float32 logit the plain kernel computes: the
// rounding of x and of W (the largest per-element errors times the l1 norms of the other factor)
// plus float32's own summation error (gamma_K times max|x| times ||W_n||_1), with slack for the
// rounding of the bound itself. Only columns whose upper bound reaches the largest lower bound of
// their row can be its argmax; they are computed again exactly as `packed_linear_argmax` computes
// them (bias-free FMAs in K order, one rounding each), and the argmax follows its rules (the first
// of equal values). A row that is not finite or all zero (no usable scale) sends the whole call
// to the plain kernel.
#include <deque>
#include <mutex>

#include "op_namespace.h"
#include "screen_parts.h"

namespace {

#if defined(__AVX512F__)
// Each row's largest result and its column over the columns this sink sees, in any order: the
// lowest column of equal values, and a NaN above anything (the lowest NaN column), as torch.max.
inline bool argmax_takes(float value, int64_t column, float top, int64_t top_column) {
  if (top != top) return value != value && column < top_column;
  return value != value || value > top || (value == top && column < top_column);
}

struct ArgmaxSink {
  float* best;
  int64_t* index;
  int64_t col;  // of the tile's first output
  ArgmaxSink at(int64_t row, int64_t column) const { return {best + row, index + row, col + column}; }
  void put(int r, int v, __mmask16 valid, __m512 acc) const {
    const int64_t first = col + v * LINEAR_LANES;
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(valid, acc, acc, _CMP_UNORD_Q);
    if (nan) {
      const int64_t column = first + __builtin_ctz(nan);
      if (argmax_takes(std::numeric_limits<float>::quiet_NaN(), column, best[r], index[r])) {
        best[r] = std::numeric_limits<float>::quiet_NaN();
        index[r] = column;
      }
      return;
    }
    const float peak = _mm512_mask_reduce_max_ps(valid, acc);
    const int64_t column = first + __builtin_ctz(_mm512_mask_cmp_ps_mask(valid, acc, _mm512_set1_ps(peak), _CMP_EQ_OQ));
    if (valid && argmax_takes(peak, column, best[r], index[r])) {
      best[r] = peak;
      index[r] = column;
    }
  }
  void put_gated(int, int, __mmask16, __m512, __m512) const {}  // never instantiated with a gate
};

// One thread's running argmax: per row its best value and column.
struct ArgmaxPart {
  std::vector<float> best;
  std::vector<int64_t> index;
};

#endif

}  // namespace

// argmax over the columns of x @ W.T for float32 x [..., K] and a plain float32 packing of W
// [N, K] -> int64 [...]: torch.max(x @ W.T, dim=-1).indices (the first of equal values, the
// first NaN if any) without writing the [..., N] product (the lm_head of greedy rows).
torch::Tensor packed_linear_argmax(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_linear_argmax takes float32");
  const torch::Tensor rows = checked_rows(x, packed, out_features, c10::nullopt, false);
  const int64_t m = rows.size(0);
  torch::Tensor indices = torch::zeros(std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1), at::kLong);
#if defined(__AVX512F__)
  if (m == 0) return indices;
  std::mutex lock;
  std::deque<ArgmaxPart> parts;  // a deque: a thread's arrays never move while others are added
  linear_run<F32Math, false>(rows.data_ptr<float>(), m, packed.data_ptr<float>(), packed.size(0), packed.size(1),
                             nullptr, out_features, [&](int64_t) {
                               std::lock_guard<std::mutex> guard(lock);
                               parts.push_back({std::vector<float>(m, -std::numeric_limits<float>::infinity()),
                                                std::vector<int64_t>(m, out_features)});
                               return ArgmaxSink{parts.back().best.data(), parts.back().index.data(), 0};
                             });
  int64_t* out = indices.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    int64_t column = out_features;  // none yet: a row of -inf ends at column 0 below
    for (const ArgmaxPart& part : parts)
      if (argmax_takes(part.best[r], part.index[r], top, column)) {
        top = part.best[r];
        column = part.index[r];
      }
    out[r] = column == out_features ? 0 : column;
  }
#endif
  return indices;
}

TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("packed_linear_argmax(Tensor x, Tensor packed, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("packed_linear_argmax", &packed_linear_argmax); }

bool screened_argmax_available();

namespace {

constexpr float SCREEN_ROW_LEVELS = 2047.0f;  // |q| of a row of x; the weight's levels keep K q q' < 2^31

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
struct ScreenSink {
  const ScreenRow* rows;
  const float *col_scale, *col_error, *col_l1;
  ScreenPart* part;
  int64_t row, col;
  ScreenSink at(int64_t r, int64_t c) const { return {rows, col_scale, col_error, col_l1, part, row + r, col + c}; }
  void put(int r, int v, __mmask16 valid, __m512 acc) const {
    if (!valid) return;
    const int64_t first = col + v * LINEAR_LANES, row_index = row + r;
    const ScreenRow& x = rows[row_index];
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_castps_si512(acc));
    const __m512 approx =
        _mm512_mul_ps(dot, _mm512_mul_ps(_mm512_set1_ps(x.scale), _mm512_maskz_loadu_ps(valid, col_scale + first)));
    __m512 bound = _mm512_fmadd_ps(
        _mm512_maskz_loadu_ps(valid, col_error + first), _mm512_set1_ps(x.quantized_l1),
        _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, col_l1 + first), _mm512_set1_ps(x.error_per_weight_l1)));
    // Slack for the float32 rounding of the bound and of the approximation itself.
    bound = _mm512_fmadd_ps(bound, _mm512_set1_ps(1.001f),
                            _mm512_fmadd_ps(_mm512_abs_ps(approx), _mm512_set1_ps(1e-5f), _mm512_set1_ps(1e-30f)));
    keep_columns(part, row_index, first, valid, approx, bound, [](float lower) { return lower; });
  }
  void put_gated(int, int, __mmask16, __m512, __m512) const {}
};

// x . w as the float32 packed kernel computes a lane: FMAs in K order from zero (scalar
// intrinsics: -ffast-math may not reorder them).
inline float exact_dot(const float* x, const float* w, int64_t k) {
  __m128 acc = _mm_setzero_ps();
  for (int64_t p = 0; p < k; ++p) acc = _mm_fmadd_ss(_mm_set_ss(x[p]), _mm_set_ss(w[p]), acc);
  return _mm_cvtss_f32(acc);
}

// Row r of x as int16 (K padded to pairs) and its ScreenRow; false when the row has no usable scale.
bool quantize_row(const float* x, int64_t k, int64_t pairs, int16_t* q, ScreenRow& out) {
  float top = 0.0f;
  for (int64_t p = 0; p < k; ++p) {
    if (!std::isfinite(x[p])) return false;
    top = std::max(top, std::fabs(x[p]));
  }
  if (!(top > 0.0f)) return false;
  const float scale = top / SCREEN_ROW_LEVELS, inverse = SCREEN_ROW_LEVELS / top;
  double quantized_l1 = 0.0;
  float error = 0.0f;
  for (int64_t p = 0; p < k; ++p) {
    const float level = std::min(SCREEN_ROW_LEVELS, std::max(-SCREEN_ROW_LEVELS, std::nearbyint(x[p] * inverse)));
    q[p] = static_cast<int16_t>(level);
    quantized_l1 += std::fabs(static_cast<double>(scale) * level);
    error =
        std::max(error, static_cast<float>(std::fabs(static_cast<double>(x[p]) - static_cast<double>(scale) * level)));
  }
  for (int64_t p = k; p < 2 * pairs; ++p) q[p] = 0;
  // float32's summation error of the exact logit: gamma_K = K u / (1 - K u), u = 2^-24.
  const double unit = std::ldexp(1.0, -24), gamma = k * unit / (1.0 - k * unit);
  out = {scale, static_cast<float>(quantized_l1 * 1.0001),
         static_cast<float>((error * 1.001 + top * 1e-6) + gamma * top * 1.001)};
  return true;
}
#endif

}  // namespace

// torch.max(x @ W.T, dim=-1).indices as packed_linear_argmax gives it (float32 x [..., K], W
// [N, K]), screened with the int16 packing of W (`screen_packed` [ceil(N / 16), ceil(K / 2), 16,
// 2] int16; per column its scale, largest rounding error and l1 norm): see the module docstring.
// `packed` is W's float32 packing, for rows the screen cannot take.
torch::Tensor screened_argmax(torch::Tensor x, torch::Tensor screen_packed, torch::Tensor col_scale,
                              torch::Tensor col_error, torch::Tensor col_l1, torch::Tensor weight, torch::Tensor packed,
                              int64_t out_features) {
  TORCH_CHECK(screened_argmax_available(), "screened_argmax needs a CPU with AVX512-VNNI");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "screened_argmax takes float32");
  TORCH_CHECK(screen_packed.scalar_type() == at::kShort && screen_packed.dim() == 4 && screen_packed.size(2) == 16 &&
                  screen_packed.size(3) == 2 && screen_packed.is_contiguous(),
              "screen_packed must be [N / 16, K / 2, 16, 2] int16");
  const int64_t k = x.size(-1), pairs = screen_packed.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == out_features && weight.size(1) == k && weight.is_contiguous(),
              "weight must be a contiguous [out_features, K] tensor");
  TORCH_CHECK((k + 1) / 2 == pairs && (out_features + 15) / 16 == screen_packed.size(0),
              "screen_packed does not match");
  for (const torch::Tensor* t : {&col_scale, &col_error, &col_l1})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) >= out_features && t->is_contiguous(),
                "column terms must be float32 [N]");
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  torch::Tensor indices = torch::zeros(std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1), at::kLong);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (m == 0) return indices;
  const float* xr = rows.data_ptr<float>();
  std::vector<int16_t> quantized(m * 2 * pairs);
  std::vector<ScreenRow> info(m);
  for (int64_t r = 0; r < m; ++r)
    if (!quantize_row(xr + r * k, k, pairs, quantized.data() + r * 2 * pairs, info[r]))
      return packed_linear_argmax(x, packed, out_features);
  std::mutex lock;
  std::deque<ScreenPart> parts;  // a deque: a thread's part never moves while others are added
  linear_run<I16Math, false>(reinterpret_cast<const uint32_t*>(quantized.data()), m,
                             reinterpret_cast<const uint32_t*>(screen_packed.data_ptr()), screen_packed.size(0), pairs,
                             nullptr, out_features, [&](int64_t) {
                               std::lock_guard<std::mutex> guard(lock);
                               parts.push_back({std::vector<float>(m, -std::numeric_limits<float>::infinity()),
                                                std::vector<std::vector<std::pair<float, int32_t>>>(m)});
                               return ScreenSink{info.data(),
                                                 col_scale.data_ptr<float>(),
                                                 col_error.data_ptr<float>(),
                                                 col_l1.data_ptr<float>(),
                                                 &parts.back(),
                                                 0,
                                                 0};
                             });
  const float* w = weight.data_ptr<float>();
  int64_t* out = indices.data_ptr<int64_t>();
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float lower = -std::numeric_limits<float>::infinity();
      for (const ScreenPart& part : parts) lower = std::max(lower, part.lower[r]);
      float top = -std::numeric_limits<float>::infinity();
      int64_t column = out_features;
      for (const ScreenPart& part : parts)
        for (const auto& [upper, c] : part.kept[r])
          if (upper >= lower) {
            const float value = exact_dot(xr + r * k, w + static_cast<int64_t>(c) * k, k);
            if (argmax_takes(value, c, top, column)) {
              top = value;
              column = c;
            }
          }
      out[r] = column == out_features ? 0 : column;
    }
  });
#endif
  return indices;
}

bool screened_argmax_available() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}
