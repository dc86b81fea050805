// The greedy near-tie scan (`worker.lm_head.near_tie_rescore.near_top_scan` in one pass per row over the
// logits, rows spread over threads). Per row of logits [N, vocab] (float32 or bfloat16): the
// argmax (the first index of the maximum, as torch.argmax) and how many logits lie at or above
// `max - 2 * spacing(max)`, the spacing of the model dtype's numbers around the maximum
// (`model_eps` times the power of two at or below |max|). The row is read once from memory and
// twice more from L2.
#include "kernels.h"
#include "near_top.h"

namespace {

template <typename T>
void scan_row(const T* row, int64_t vocab, float model_eps, float model_tiny, int64_t* argmax, int64_t* count) {
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 top_v = _mm512_set1_ps(top);
  for (; i + 16 <= vocab; i += 16) top_v = _mm512_max_ps(top_v, load16(row + i));
  top = _mm512_reduce_max_ps(top_v);
#endif
  for (; i < vocab; ++i) top = std::max(top, load_float(row + i));
  int64_t first = -1;
  i = 0;
#if defined(__AVX512F__)
  const __m512 top_all = _mm512_set1_ps(top);
  for (; i + 16 <= vocab && first < 0; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(row + i), top_all, _CMP_EQ_OQ);
    if (hit) first = i + __builtin_ctz(hit);
  }
#endif
  for (; i < vocab && first < 0; ++i)
    if (load_float(row + i) == top) first = i;
  if (first < 0) first = 0;  // no element equals the maximum: NaNs in the row
  const float threshold = near_top_threshold(top, model_eps, model_tiny);
  int64_t n = 0;
  i = 0;
#if defined(__AVX512F__)
  const __m512 threshold_v = _mm512_set1_ps(threshold);
  for (; i + 16 <= vocab; i += 16)
    n += __builtin_popcount(_mm512_cmp_ps_mask(load16(row + i), threshold_v, _CMP_GE_OQ));
#endif
  for (; i < vocab; ++i) n += load_float(row + i) >= threshold;
  *argmax = first;
  *count = n;
}

}  // namespace

std::vector<torch::Tensor> near_top_scan(torch::Tensor logits, double model_eps, double model_tiny) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [rows, vocab] tensor");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16,
              "logits must be float32 or bfloat16");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "logits need at least one column");
  auto argmax = torch::empty({rows}, torch::kInt64);
  auto counts = torch::empty({rows}, torch::kInt64);
  int64_t* argmax_out = argmax.data_ptr<int64_t>();
  int64_t* counts_out = counts.data_ptr<int64_t>();
  auto scan = [&](auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        scan_row(data + r * vocab, vocab, static_cast<float>(model_eps), static_cast<float>(model_tiny), argmax_out + r,
                 counts_out + r);
    });
  };
  if (logits.scalar_type() == torch::kBFloat16)
    scan(logits.data_ptr<c10::BFloat16>());
  else
    scan(logits.data_ptr<float>());
  return {argmax, counts};
}
