// Random sampling (`worker.random_race.sample_random_rows_reference` in a few passes per row,
// rows spread over threads). Per row: temperature, min-p, top-k (ties with the k-th kept), top-p,
// then the race argmax(s - log(-log u)) with the counter-based noise `u(key, token)` of
// `worker.random_race` (the same numbers bit for bit; the logs differ from PyTorch's in the last
// bit at most, which can only matter between two all but equal scores).
//
// - The race skips every token whose scaled logit lies more than 16.7 below the best score so
//   far: no noise lifts a token that far (u <= 1 - 2^-24 bounds -log(-log u) by 16.64). The
//   noise of 16 tokens is computed at once.
// - Top-k and top-p bisect on a value threshold x, counting the tokens at or above x and summing
//   their weights exp(s - max) in one pass over the row (in L2) per probe, until the cut lies
//   among at most 256 tokens; only those are sorted.
#include "kernels.h"
#include "sampling_race.h"

namespace {

struct Tally {
  int64_t count = 0;
  double mass = 0.0;
};

// How many tokens lie at or above x, and their weight (the weights are 0 below min-p).
Tally tally_at_or_above(const float* s, const float* w, int64_t vocab, float x) {
  Tally out;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 mass = _mm512_setzero_ps();
  const __m512 threshold = _mm512_set1_ps(x);
  for (; i + 16 <= vocab; i += 16) {
    const __mmask16 at = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), threshold, _CMP_GE_OQ);
    out.count += __builtin_popcount(at);
    mass = _mm512_mask_add_ps(mass, at, mass, _mm512_loadu_ps(w + i));
  }
  out.mass = _mm512_reduce_add_ps(mass);
#endif
  for (; i < vocab; ++i)
    if (s[i] >= x) {
      out.count += 1;
      out.mass += w[i];
    }
  return out;
}

// Narrows [a, b) so that `reached(tally(a))` holds and `reached(tally(b))` does not, until at
// most kBracketTokens tokens lie in it; b starts above every token. Returns tally(b).
template <typename Reached>
Tally bisect(const float* s, const float* w, int64_t vocab, float& a, float& b, Tally at_a, Reached reached) {
  Tally at_b;
  for (int step = 0; step < kMaxBisections && at_a.count - at_b.count > kBracketTokens; ++step) {
    const float mid = a + (b - a) * 0.5f;
    if (!(mid > a && mid < b)) break;  // a and b are adjacent floats
    const Tally at_mid = tally_at_or_above(s, w, vocab, mid);
    if (reached(at_mid)) {
      a = mid;
      at_a = at_mid;
    } else {
      b = mid;
      at_b = at_mid;
    }
  }
  return at_b;
}

// Tokens with a <= s < b, sorted by value, descending, then by token.
void collect(const float* s, int64_t vocab, float a, float b, std::vector<std::pair<float, int32_t>>& out) {
  out.clear();
  for (int64_t i = 0; i < vocab; ++i)
    if (s[i] >= a && s[i] < b) out.emplace_back(s[i], static_cast<int32_t>(i));
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  });
}

struct RowScratch {
  std::vector<float> scaled, weights;
  std::vector<std::pair<float, int32_t>> bracket;
};

template <typename T>
int64_t sample_row(const T* row, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                   uint64_t key, RowScratch& scratch) {
  scratch.scaled.resize(vocab);
  float* s = scratch.scaled.data();
  float top = kNegInf;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 top_v = _mm512_set1_ps(kNegInf);
  for (; i + 16 <= vocab; i += 16) {
    const __m512 v = _mm512_div_ps(load16(row + i), _mm512_set1_ps(temperature));
    _mm512_storeu_ps(s + i, v);
    top_v = _mm512_max_ps(top_v, v);
  }
  top = _mm512_reduce_max_ps(top_v);
#endif
  for (; i < vocab; ++i) {
    s[i] = load_float(row + i) / temperature;
    top = std::max(top, s[i]);
  }
  int64_t top_token = 0;
  while (top_token < vocab && s[top_token] != top) ++top_token;
  if (top_token == vocab || !std::isfinite(top)) return top_token == vocab ? 0 : top_token;  // NaN, all masked or +inf
  const float floor = min_p > 0.0f ? top + std::log(min_p) : kNegInf;
  RaceBest best;
  if (top_k <= 0 && !(top_p < 1.0f)) {
    race_row(s, vocab, std::max(floor, std::numeric_limits<float>::lowest()), top, top_token, key, best);
    return best.token;
  }
  // Weights exp(s - top) of the tokens min-p keeps (0 for the others), their number and lowest value.
  scratch.weights.resize(vocab);
  float* w = scratch.weights.data();
  Tally kept;
  float lowest = top;
  i = 0;
#if defined(__AVX512F__)
  __m512 mass = _mm512_setzero_ps(), lowest_v = _mm512_set1_ps(top);
  for (; i + 16 <= vocab; i += 16) {
    const __m512 v = _mm512_loadu_ps(s + i);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, _mm512_set1_ps(floor), _CMP_GE_OQ) &
                           _mm512_cmp_ps_mask(v, _mm512_set1_ps(kNegInf), _CMP_GT_OQ);
    const __m512 weight = _mm512_maskz_mov_ps(keep, exp_ps(_mm512_sub_ps(v, _mm512_set1_ps(top))));
    _mm512_storeu_ps(w + i, weight);
    mass = _mm512_add_ps(mass, weight);
    lowest_v = _mm512_mask_min_ps(lowest_v, keep, lowest_v, v);
    kept.count += __builtin_popcount(keep);
  }
  kept.mass = _mm512_reduce_add_ps(mass);
  lowest = _mm512_reduce_min_ps(lowest_v);
#endif
  for (; i < vocab; ++i) {
    const bool keep = s[i] >= floor && s[i] > kNegInf;
    w[i] = keep ? std::exp(s[i] - top) : 0.0f;
    if (keep) {
      kept.count += 1;
      kept.mass += w[i];
      lowest = std::min(lowest, s[i]);
    }
  }
  auto& bracket = scratch.bracket;
  const float above_top = std::nextafter(top, std::numeric_limits<float>::infinity());
  float lower = lowest;  // the lowest value top-k keeps
  Tally universe = kept;
  if (top_k > 0 && top_k < kept.count) {
    float a = lowest, b = above_top;
    const auto has_k = [&](const Tally& t) { return t.count >= top_k; };
    if (has_k(tally_at_or_above(s, w, vocab, top))) a = top;
    const Tally above = bisect(s, w, vocab, a, b, tally_at_or_above(s, w, vocab, a), has_k);
    collect(s, vocab, a, b, bracket);
    lower = bracket[static_cast<size_t>(top_k - above.count) - 1].first;  // the k-th value; its ties stay
    universe = tally_at_or_above(s, w, vocab, lower);
  }
  if (!(top_p < 1.0f)) {
    race_row(s, vocab, lower, top, top_token, key, best);
    return best.token;
  }
  // Top-p: the smallest prefix whose share of the universe's mass reaches p; the top token always stays.
  const auto has_p = [&](const Tally& t) { return t.mass / universe.mass >= top_p; };
  float a = lower, b = above_top;
  Tally at_a = universe;
  const Tally at_top = tally_at_or_above(s, w, vocab, top);
  if (has_p(at_top)) {
    a = top;
    at_a = at_top;
  }
  const Tally above = bisect(s, w, vocab, a, b, at_a, has_p);
  collect(s, vocab, a, b, bracket);
  double before = above.mass;
  size_t end = 0;
  for (; end < bracket.size(); ++end) {
    if ((end > 0 || above.count > 0) && before / universe.mass >= top_p) break;
    before += std::exp(static_cast<double>(bracket[end].first) - top);
  }
  if (above.count > 0) race_row(s, vocab, b, top, top_token, key, best);
  race_list(bracket, end, key, best);
  return best.token;
}

}  // namespace

torch::Tensor sample_random_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                                 torch::Tensor top_p, torch::Tensor min_p, torch::Tensor keys) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [rows, vocab] tensor");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16,
              "logits must be float32 or bfloat16");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "the vocabulary must have 1 to 2^31 - 1 tokens");
  for (const auto* column : {&temperature, &top_p, &min_p})
    TORCH_CHECK(column->scalar_type() == torch::kFloat && column->is_contiguous() && column->numel() == rows,
                "temperature, top_p and min_p must be float32 [rows]");
  for (const auto* column : {&top_k, &keys})
    TORCH_CHECK(column->scalar_type() == torch::kLong && column->is_contiguous() && column->numel() == rows,
                "top_k and keys must be int64 [rows]");
  auto out = torch::empty({rows}, torch::kInt64);
  int64_t* tokens = out.data_ptr<int64_t>();
  const float* t = temperature.data_ptr<float>();
  const float* p = top_p.data_ptr<float>();
  const float* m = min_p.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  const int64_t* key = keys.data_ptr<int64_t>();
  auto run = [&](auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      RowScratch scratch;
      for (int64_t r = begin; r < end; ++r)
        tokens[r] = sample_row(data + r * vocab, vocab, t[r], k[r], p[r], m[r], static_cast<uint64_t>(key[r]), scratch);
    });
  };
  if (logits.scalar_type() == torch::kBFloat16)
    run(logits.data_ptr<c10::BFloat16>());
  else
    run(logits.data_ptr<float>());
  return out;
}
