// The entry points of the bfloat16 lm_head screen (bf16_screen.h): the greedy tokens of bf16 rows
// through the int8 screen, and every column's bound for the tests.
#include <deque>
#include <mutex>

#include "bf16_screen.h"

namespace {

// The arguments of screened_bf16_argmax checked against each other; x's rows.
torch::Tensor checked_screen(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& packed,
                             const torch::Tensor& screen_packed, const torch::Tensor& outlier_packed,
                             const torch::Tensor& rest, const torch::Tensor& outliers,
                             const torch::Tensor& column_terms, const torch::Tensor& offset_share,
                             int64_t out_features) {
  TORCH_CHECK(bf16_screen_available(), "screened_bf16_argmax needs a CPU with AVX512-BF16 and AVX512-VNNI");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "screened_bf16_argmax takes bfloat16");
  torch::Tensor rows = checked_rows(x, packed, out_features, c10::nullopt, false);
  const int64_t k = x.size(-1), pairs = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(screen_packed.scalar_type() == at::kChar && screen_packed.dim() == 4 && screen_packed.size(0) == panels &&
                  screen_packed.size(2) == 16 && screen_packed.size(3) == 4 && screen_packed.is_contiguous(),
              "screen_packed must be [panels, rest / 4, 16, 4] int8");
  TORCH_CHECK(outlier_packed.scalar_type() == at::kBFloat16 && outlier_packed.dim() == 4 &&
                  outlier_packed.size(0) == panels && outlier_packed.size(2) == 16 && outlier_packed.size(3) == 2 &&
                  outlier_packed.is_contiguous(),
              "outlier_packed must be [panels, outliers / 2, 16, 2] bfloat16");
  TORCH_CHECK(rest.scalar_type() == at::kLong && rest.dim() == 1 && rest.size(0) == 4 * screen_packed.size(1) &&
                  outliers.scalar_type() == at::kLong && outliers.dim() == 1 &&
                  outliers.size(0) == 2 * outlier_packed.size(1),
              "rest and outliers must list the packings' channels (int64)");
  TORCH_CHECK(rest.max().item<int64_t>() < k && outliers.max().item<int64_t>() < k, "a channel is out of range");
  TORCH_CHECK(column_terms.scalar_type() == at::kFloat && column_terms.dim() == 2 && column_terms.size(0) == 5 &&
                  column_terms.size(1) == panels * 16 && column_terms.is_contiguous(),
              "column_terms must be [5, panels x 16]");
  TORCH_CHECK(
      offset_share.scalar_type() == at::kInt && offset_share.numel() == panels * 16 && offset_share.is_contiguous(),
      "offset_share must be int32 [panels x 16]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.size(0) == out_features &&
                  weight.size(1) == 2 * pairs && weight.is_contiguous(),
              "weight must be a contiguous bf16 [N, K], K even");
  TORCH_CHECK(out_features * pairs < (int64_t{1} << 31), "the lm_head is too large for 32-bit gathers");
  return rows;
}

#if defined(PAGEDSERVE_BF16_SCREEN)
// x's rows split for the screen (split_row) and the columns' terms: what the screen's sinks read.
struct ScreenInputs {
  int64_t m, rest_count, outlier_pairs;
  std::vector<uint8_t> levels;
  std::vector<c10::BFloat16> outlier_x;
  std::vector<Bf16ScreenRow> info;
  Bf16ScreenColumns columns;
  bool finite = true;  // false: a row is not, and nothing else is filled in

  ScreenInputs(const torch::Tensor& rows, int64_t k, int64_t pairs, const torch::Tensor& rest,
               const torch::Tensor& outliers, const torch::Tensor& column_terms, const torch::Tensor& offset_share)
      : m(rows.size(0)),
        rest_count(rest.size(0)),
        outlier_pairs(outliers.size(0) / 2),
        levels(m * rest_count),
        outlier_x(m * 2 * outlier_pairs),
        info(m) {
    const c10::BFloat16* xr = reinterpret_cast<const c10::BFloat16*>(rows.data_ptr());
    std::atomic<bool> all_finite{true};
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        if (!split_row(xr + r * 2 * pairs, k, pairs, rest.data_ptr<int64_t>(), rest_count, outliers.data_ptr<int64_t>(),
                       2 * outlier_pairs, levels.data() + r * rest_count, outlier_x.data() + r * 2 * outlier_pairs,
                       info[r]))
          all_finite = false;
    });
    finite = all_finite;
    const float* terms = column_terms.data_ptr<float>();
    const int64_t width = column_terms.size(1);
    columns = {terms,
               terms + width,
               terms + 2 * width,
               terms + 3 * width,
               terms + 4 * width,
               offset_share.data_ptr<int32_t>()};
  }

  Bf16ScreenSink sink(const torch::Tensor& outlier_packed, ScreenPart* part) const {
    return {info.data(),
            reinterpret_cast<const uint32_t*>(outlier_x.data()),
            reinterpret_cast<const uint32_t*>(outlier_packed.data_ptr()),
            outlier_pairs,
            columns,
            part,
            0,
            0};
  }

  // The int8 tiles over every row and column, into the sinks sink_for(thread slot) gives.
  template <typename SinkFor>
  void run(const torch::Tensor& screen_packed, int64_t out_features, const SinkFor& sink_for) const {
    linear_run<I8Math, false>(reinterpret_cast<const uint32_t*>(levels.data()), m,
                              reinterpret_cast<const uint32_t*>(screen_packed.data_ptr()), screen_packed.size(0),
                              rest_count / 4, nullptr, out_features, sink_for);
  }
};
#endif

}  // namespace

// Greedy tokens of bf16 x [m, K] through the lm_head screen (see the module docstring): {chosen [m],
// counts [m] (tokens in each row's near-top window), candidate_rows, candidate_tokens (the windows of
// rows with counts > 1, ascending)}, as `near_top_scan` of the plain logits gives them; empty when a
// row is not finite. `weight`: W [N, K] (K even); `packed`: its bf16 packing; `screen_packed` [panels, rest / 4, 16, 4]
// int8; `outlier_packed` [panels, outliers / 2, 16, 2] bf16; `rest`/`outliers`: x's channels in the packings' order
// (-1: padding); `column_terms` float32 [5, panels x 16]: scale, weight error, l1 of the rest, l1 of the outliers, l1;
// `offset_share` int32 [panels x 16].
std::vector<torch::Tensor> screened_bf16_argmax(torch::Tensor x, torch::Tensor weight, torch::Tensor packed,
                                                torch::Tensor screen_packed, torch::Tensor outlier_packed,
                                                torch::Tensor rest, torch::Tensor outliers, torch::Tensor column_terms,
                                                torch::Tensor offset_share, int64_t out_features, double model_eps,
                                                double model_tiny) {
  const torch::Tensor rows = checked_screen(x, weight, packed, screen_packed, outlier_packed, rest, outliers,
                                            column_terms, offset_share, out_features);
  const int64_t m = rows.size(0), pairs = packed.size(1);
#if defined(PAGEDSERVE_BF16_SCREEN)
  auto chosen = torch::zeros({m}, at::kLong), counts = torch::zeros({m}, at::kLong);
  if (m == 0) return {chosen, counts, torch::zeros({0}, at::kLong), torch::zeros({0}, at::kLong)};
  const ScreenInputs inputs(rows, x.size(-1), pairs, rest, outliers, column_terms, offset_share);
  if (!inputs.finite) return {};
  std::atomic<bool> finite{true};
  std::mutex lock;
  std::deque<ScreenPart> parts;  // a deque: a thread's part never moves while others are added
  inputs.run(screen_packed, out_features, [&](int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    parts.push_back({std::vector<float>(m, -std::numeric_limits<float>::infinity()),
                     std::vector<std::vector<std::pair<float, int32_t>>>(m)});
    return inputs.sink(outlier_packed, &parts.back());
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

// Every column's approximate logit and its bound, [m, out_features, 2] float32 (for tests: the
// screen's claim is |approximation - the plain kernel's float32 logit| <= bound); empty when a row
// is not finite. Arguments as screened_bf16_argmax's.
torch::Tensor bf16_screen_bounds(torch::Tensor x, torch::Tensor weight, torch::Tensor packed,
                                 torch::Tensor screen_packed, torch::Tensor outlier_packed, torch::Tensor rest,
                                 torch::Tensor outliers, torch::Tensor column_terms, torch::Tensor offset_share,
                                 int64_t out_features) {
  const torch::Tensor rows = checked_screen(x, weight, packed, screen_packed, outlier_packed, rest, outliers,
                                            column_terms, offset_share, out_features);
  torch::Tensor out = torch::zeros({rows.size(0), out_features, 2}, at::kFloat);
#if defined(PAGEDSERVE_BF16_SCREEN)
  const ScreenInputs inputs(rows, x.size(-1), packed.size(1), rest, outliers, column_terms, offset_share);
  if (!inputs.finite) return torch::Tensor();
  ScreenPart unused;  // the bound sink keeps nothing
  inputs.run(screen_packed, out_features, [&](int64_t) {
    return Bf16BoundSink{inputs.sink(outlier_packed, &unused), out.data_ptr<float>(), out_features};
  });
#endif
  return out;
}

bool bf16_screen_available() {
#if defined(PAGEDSERVE_BF16_SCREEN)
  return true;
#else
  return false;
#endif
}
