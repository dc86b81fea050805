// The race of random sampling: argmax(s - log(-log u)) over a row's tokens with the counter-based
// noise u(key, token) of `worker.random_race` (splitmix64 of key and token), skipping every token
// that no noise can lift to the best score so far; 16 tokens at a time on AVX-512 (with DQ).
#pragma once

#include "vector_helpers.h"

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
    if (s > score || (s == score && (token < 0 || t < token))) {
      score = s;
      token = t;
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define PAGEDSERVE_VECTOR_RACE 1

inline __m512i splitmix_lanes(uint64_t key, __m512i tokens) {  // 8 tokens (int64)
  __m512i z = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(key)),
                               _mm512_mullo_epi64(_mm512_add_epi64(tokens, _mm512_set1_epi64(1)),
                                                  _mm512_set1_epi64(static_cast<long long>(kGolden))));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                         _mm512_set1_epi64(static_cast<long long>(kMix1)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                         _mm512_set1_epi64(static_cast<long long>(kMix2)));
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
  const __m256i high =
      _mm512_cvtepi64_epi32(splitmix_lanes(key, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(tokens, 1))));
  const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  const __m512 u =
      _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(0.5f)), _mm512_set1_ps(1.0f / 8388608.0f));
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

}  // namespace
