// Sampled tokens' logprobs (`worker.logprobs.select_logprobs` of log_softmax(logits) without
// materializing it). Per row of raw logits (float32 or bfloat16): the log normalizer max +
// log(sum exp(l - max)), the chosen token's logprob and rank (1 + how many logits are larger:
// ties share the better rank), and the `num_top` largest logprobs with their ids (larger first,
// the lower id first on ties). Three passes over the row, the last two from L2; the top list
// only takes a token that beats its current last entry.
#include "kernels.h"
#include "vector_helpers.h"

namespace {

template <typename T>
void logprobs_row(const T* row, int64_t vocab, int64_t chosen, int64_t num_top, float* chosen_logprob, int64_t* rank,
                  float* top_logprobs, int64_t* top_ids) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 top_v = _mm512_set1_ps(top);
  for (; i + 16 <= vocab; i += 16) top_v = _mm512_max_ps(top_v, load16(row + i));
  top = _mm512_reduce_max_ps(top_v);
#endif
  for (; i < vocab; ++i) top = std::max(top, load_float(row + i));
  const float chosen_value = load_float(row + chosen);
  double total = 0.0;
  int64_t larger = 0;
  i = 0;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= vocab; i += 16) {
    const __m512 v = load16(row + i);
    sum = _mm512_add_ps(sum, exp_ps(_mm512_sub_ps(v, _mm512_set1_ps(top))));
    larger += __builtin_popcount(_mm512_cmp_ps_mask(v, _mm512_set1_ps(chosen_value), _CMP_GT_OQ));
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; i < vocab; ++i) {
    const float v = load_float(row + i);
    total += std::exp(v - top);
    larger += v > chosen_value;
  }
  const float log_total = static_cast<float>(std::log(total));
  *chosen_logprob = (chosen_value - top) - log_total;
  *rank = larger + 1;
  if (num_top <= 0) return;
  // The num_top largest (value, id), kept sorted; `last` is the entry a newcomer must beat.
  std::vector<std::pair<float, int64_t>> best;
  best.reserve(num_top + 1);
  float last = -std::numeric_limits<float>::infinity();
  auto offer = [&](float v, int64_t id) {
    if (static_cast<int64_t>(best.size()) == num_top && !(v > last)) return;
    auto at = std::upper_bound(best.begin(), best.end(), std::make_pair(v, id), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    best.insert(at, {v, id});
    if (static_cast<int64_t>(best.size()) > num_top) best.pop_back();
    if (static_cast<int64_t>(best.size()) == num_top) last = best.back().first;
  };
  i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= vocab; i += 16) {
    const __m512 v = load16(row + i);
    __mmask16 hit = static_cast<int64_t>(best.size()) < num_top
                        ? __mmask16(0xFFFF)
                        : _mm512_cmp_ps_mask(v, _mm512_set1_ps(last), _CMP_GT_OQ);
    while (hit) {
      const int lane = __builtin_ctz(hit);
      hit &= hit - 1;
      offer(load_float(row + i + lane), i + lane);
    }
  }
#endif
  for (; i < vocab; ++i) offer(load_float(row + i), i);
  for (int64_t j = 0; j < num_top; ++j) {
    top_logprobs[j] = (best[j].first - top) - log_total;
    top_ids[j] = best[j].second;
  }
}

}  // namespace

std::vector<torch::Tensor> token_logprobs_rows(torch::Tensor logits, torch::Tensor chosen, int64_t num_top) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [rows, vocab] tensor");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16,
              "logits must be float32 or bfloat16");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(chosen.scalar_type() == torch::kLong && chosen.is_contiguous() && chosen.numel() == rows,
              "chosen must be int64 [rows]");
  TORCH_CHECK(num_top >= 0 && num_top <= vocab, "num_top must lie in [0, vocab]");
  const int64_t* chosen_ids = chosen.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(chosen_ids[r] >= 0 && chosen_ids[r] < vocab, "a chosen token lies outside the vocabulary");
  auto chosen_logprobs = torch::empty({rows}, torch::kFloat);
  auto ranks = torch::empty({rows}, torch::kInt64);
  auto top_logprobs = torch::empty({rows, num_top}, torch::kFloat);
  auto top_ids = torch::empty({rows, num_top}, torch::kInt64);
  float* lp = chosen_logprobs.data_ptr<float>();
  int64_t* rk = ranks.data_ptr<int64_t>();
  float* tl = top_logprobs.data_ptr<float>();
  int64_t* ti = top_ids.data_ptr<int64_t>();
  auto run = [&](auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        logprobs_row(data + r * vocab, vocab, chosen_ids[r], num_top, lp + r, rk + r, tl + r * num_top,
                     ti + r * num_top);
    });
  };
  if (logits.scalar_type() == torch::kBFloat16)
    run(logits.data_ptr<c10::BFloat16>());
  else
    run(logits.data_ptr<float>());
  return {chosen_logprobs, ranks, top_logprobs, top_ids};
}
