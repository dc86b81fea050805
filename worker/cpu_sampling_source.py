"""C++ source of random sampling (`worker.random_race.sample_random_rows_reference` in a
few passes per row, rows spread over threads), built into the CPU kernel extension by
`worker.attention.cpu_kernels` after the attention source, whose `load_float`,
`load16` and `exp_ps` it uses.

Per row: temperature, min-p, top-k (ties with the k-th kept), top-p, then the race
argmax(s - log(-log u)) with the counter-based noise `u(key, token)` of
`worker.random_race` (the same numbers bit for bit; the logs differ from PyTorch's
in the last bit at most, which can only matter between two all but equal scores).
PyTorch sorts every filtered row, draws noise for the whole vocabulary and reads
the row about ten times: 130-800 ms for 256 rows of 49,152 logits. Here:

- The race skips every token whose scaled logit lies more than 16.7 below the
  best score so far: no noise lifts a token that far (u <= 1 - 2^-24 bounds
  -log(-log u) by 16.64). The noise of 16 tokens is computed at once.
- Top-k and top-p bisect on a value threshold x, counting the tokens at or above
  x and summing their weights exp(s - max) in one pass over the row (in L2) per
  probe, until the cut lies among at most 256 tokens; only those are sorted.
"""

SAMPLING_SOURCE = r"""
namespace {

constexpr float kMaxNoiseBoost = 16.7f;  // -log(-log(1 - 2^-24)) = 16.64, with a margin for rounding
constexpr int64_t kBracketTokens = 256;  // bisect until the cut lies among this few tokens
constexpr int kMaxBisections = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull, kMix1 = 0xBF58476D1CE4E5B9ull, kMix2 = 0x94D049BB133111EBull;

inline float race_uniform(uint64_t key, int64_t token) {  // splitmix64 of (key, token): u in (0, 1)
  uint64_t z = key + static_cast<uint64_t>(token + 1) * kGolden;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  z ^= z >> 31;
  return (static_cast<float>(z >> 41) + 0.5f) * (1.0f / 8388608.0f);
}

struct RaceBest {  // the largest score, the lowest token on ties (as argmax)
  float score = kNegInf;
  int64_t token = -1;
  void offer(float s, int64_t t) {
    if (s > score || (s == score && (token < 0 || t < token))) { score = s; token = t; }
  }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define PAGEDSERVE_VECTOR_RACE 1

inline __m512i splitmix_lanes(uint64_t key, __m512i tokens) {  // 8 tokens (int64)
  __m512i z = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(key)),
                               _mm512_mullo_epi64(_mm512_add_epi64(tokens, _mm512_set1_epi64(1)),
                                                  _mm512_set1_epi64(static_cast<long long>(kGolden))));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(static_cast<long long>(kMix1)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(static_cast<long long>(kMix2)));
  return _mm512_srli_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 31)), 41);
}

inline __m512 log_ps(__m512 x) {  // natural log of positive normal floats (Cephes' logf, about 1 ulp)
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 y = _mm512_set1_ps(7.0376836292e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.1514610310e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.1676998740e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.2420140846e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.4249322787e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.6668057665e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.0000714765e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-2.4999993993e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(3.3333331174e-1f));
  y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fmadd_ps(z, _mm512_set1_ps(-0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}

inline __m512 race_noise16(uint64_t key, __m512i tokens) {  // -log(-log u) for 16 int32 tokens
  const __m256i low = _mm512_cvtepi64_epi32(splitmix_lanes(key, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(tokens))));
  const __m256i high = _mm512_cvtepi64_epi32(splitmix_lanes(key, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(tokens, 1))));
  const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(0.5f)),
                                 _mm512_set1_ps(1.0f / 8388608.0f));
  return _mm512_sub_ps(_mm512_setzero_ps(), log_ps(_mm512_sub_ps(_mm512_setzero_ps(), log_ps(u))));
}

// Per-lane bests of the race; ties keep the lane's earlier (lower) token.
struct RaceLanes {
  __m512 score = _mm512_set1_ps(kNegInf);
  __m512i token = _mm512_set1_epi32(-1);
  float top = kNegInf;  // the best score so far, for the cutoff
  void offer(__mmask16 lanes, __m512 values, __m512i tokens, uint64_t key) {
    const __m512 s = _mm512_add_ps(values, race_noise16(key, tokens));
    const __mmask16 better = lanes & _mm512_cmp_ps_mask(s, score, _CMP_GT_OQ);
    score = _mm512_mask_blend_ps(better, score, s);
    token = _mm512_mask_blend_epi32(better, token, tokens);
    top = std::max(top, _mm512_mask_reduce_max_ps(lanes, s));
  }
  void into(RaceBest& best) const {
    alignas(64) float scores[16];
    alignas(64) int32_t tokens[16];
    _mm512_store_ps(scores, score);
    _mm512_store_si512(tokens, token);
    for (int lane = 0; lane < 16; ++lane)
      if (tokens[lane] >= 0) best.offer(scores[lane], tokens[lane]);
  }
};
#endif

inline float race_score(float value, uint64_t key, int64_t token) {
  return value - std::log(-std::log(race_uniform(key, token)));
}

// The race over the tokens at or above `lower` (finite), seeded with the row's top token.
void race_row(const float* s, int64_t vocab, float lower, float top, int64_t top_token, uint64_t key, RaceBest& best) {
  float seed = race_score(top, key, top_token);  // a lower bound of the winning score: tightens the cutoff at once
#if defined(PAGEDSERVE_VECTOR_RACE)
  RaceLanes lanes;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 valid = vocab - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (vocab - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(valid, s + i);
    const float cutoff = std::max(lower, std::max(seed, lanes.top) - kMaxNoiseBoost);
    const __mmask16 hit = valid & _mm512_cmp_ps_mask(v, _mm512_set1_ps(cutoff), _CMP_GE_OQ);
    if (hit) lanes.offer(hit, v, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)), iota), key);
  }
  lanes.into(best);
#else
  for (int64_t i = 0; i < vocab; ++i)
    if (s[i] >= std::max(lower, std::max(seed, best.score) - kMaxNoiseBoost)) best.offer(race_score(s[i], key, i), i);
#endif
}

// The race over a list of (value, token) pairs.
void race_list(const std::vector<std::pair<float, int32_t>>& list, size_t end, uint64_t key, RaceBest& best) {
#if defined(PAGEDSERVE_VECTOR_RACE)
  RaceLanes lanes;
  alignas(64) float values[16];
  alignas(64) int32_t tokens[16];
  for (size_t j = 0; j < end; j += 16) {
    const int n = static_cast<int>(std::min<size_t>(16, end - j));
    for (int lane = 0; lane < 16; ++lane) {
      values[lane] = lane < n ? list[j + lane].first : kNegInf;
      tokens[lane] = lane < n ? list[j + lane].second : 0;
    }
    lanes.offer(__mmask16((1u << n) - 1), _mm512_load_ps(values), _mm512_load_si512(tokens), key);
  }
  lanes.into(best);
#else
  for (size_t j = 0; j < end; ++j) best.offer(race_score(list[j].first, key, list[j].second), list[j].second);
#endif
}

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
    if (s[i] >= x) { out.count += 1; out.mass += w[i]; }
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
    if (reached(at_mid)) { a = mid; at_a = at_mid; } else { b = mid; at_b = at_mid; }
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
    if (keep) { kept.count += 1; kept.mass += w[i]; lowest = std::min(lowest, s[i]); }
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
  if (has_p(at_top)) { a = top; at_a = at_top; }
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
  if (logits.scalar_type() == torch::kBFloat16) run(logits.data_ptr<c10::BFloat16>());
  else run(logits.data_ptr<float>());
  return out;
}
"""
