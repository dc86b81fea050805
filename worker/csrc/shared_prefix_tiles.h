// The pieces of shared_prefix_attention.cpp (see it for the kernel): its problem and per-thread
// state, and the AVX-512 tiles of the shared part (rows in lanes: score, online softmax, weigh),
// plus the horizontal sums of the members' own positions (dims in lanes).
#pragma once

#include "vector_helpers.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
constexpr int MAX_VECS = 4;     // rows of an item: up to 64
constexpr int64_t TILE = 32;    // keys scored, softmaxed and weighed together

// One work item's running state and scratch: rows in lanes, `vecs` registers of them (or, for a
// member's own positions, row-major: qt and acc [rows][dim]).
struct RowState {
  int vecs = 1;
  std::vector<float> qt, m, l, acc;  // qt, acc: [dim][vecs * 16]; m, l: [vecs * 16]
  std::vector<uint32_t> qpairs;      // bfloat16 queries, unscaled: [dim / 2][vecs * 16] pairs of dims
  std::vector<float> scores;         // [TILE][vecs * 16]: scores, then probabilities
  std::vector<float> kf, vf;         // a tile's keys / values widened to float32: [TILE][dim]
  std::vector<float> zeros;          // a zero row of dim floats

  void reset(int v, int64_t dim) {
    vecs = v;
    const int64_t w = v * LANES;
    qt.assign(dim * w, 0.0f);
    acc.assign(dim * w, 0.0f);
    qpairs.assign(dim / 2 * w, 0u);
    m.assign(w, -std::numeric_limits<float>::infinity());
    l.assign(w, 0.0f);
    scores.resize(TILE * w);
    kf.resize(TILE * dim);
    vf.resize(TILE * dim);
    zeros.assign(dim, 0.0f);
  }
};

template <typename Q, typename T>
struct SharedPrefixProblem {
  const Q* query;  // [tokens, heads, dim]
  const T* k_cache;
  const T* v_cache;  // [blocks, block_size, kv_heads, dim]
  const int32_t* block_tables;
  const int32_t* query_start;
  const int32_t* seq_lens;
  Q* out;
  int64_t max_blocks, block_size, heads, kv_heads, dim;
  float scale;

  const T* row(const T* cache, int64_t seq, int64_t pos, int64_t head) const {
    const int64_t block = block_tables[seq * max_blocks + pos / block_size];
    return cache + ((block * block_size + pos % block_size) * kv_heads + head) * dim;
  }
};

// Pointers to n rows as float32: the cache itself for float32, else widened into `buffer`.
template <typename T>
inline void as_float(const T* const* rows, int64_t n, int64_t dim, float* buffer, const float** out) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < n; ++j) out[j] = rows[j];
  } else {
    for (int64_t j = 0; j < n; ++j) {
      float* dst = buffer + j * dim;
      for (int64_t d = 0; d < dim; d += LANES) _mm512_storeu_ps(dst + d, load16(rows[j] + d));
      out[j] = dst;
    }
  }
}

// scores[k][lanes] = sum_d keys[k][d] * qt[d][lanes] for KB keys at a time (padded keys point
// at a zero row).
template <int V, int KB>
inline void score_tile(const float* qt, const float* const* keys, int64_t padded, int64_t dim, float* scores) {
  constexpr int64_t W = V * LANES;
  for (int64_t k = 0; k < padded; k += KB) {
    __m512 a[KB][V];
    for (int b = 0; b < KB; ++b)
      for (int v = 0; v < V; ++v) a[b][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      __m512 q[V];
      for (int v = 0; v < V; ++v) q[v] = _mm512_loadu_ps(qt + d * W + v * LANES);
      for (int b = 0; b < KB; ++b) {
        const __m512 kv = _mm512_set1_ps(keys[k + b][d]);
        for (int v = 0; v < V; ++v) a[b][v] = _mm512_fmadd_ps(kv, q[v], a[b][v]);
      }
    }
    for (int b = 0; b < KB; ++b)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(scores + (k + b) * W + v * LANES, a[b][v]);
  }
}

#if defined(__AVX512BF16__)
// score_tile on vdpbf16ps for bfloat16 queries and keys: lane pairs hold dims 2i, 2i + 1 of each
// row, times the broadcast pair of each key (read straight from the cache), then scaled.
template <int V, int KB>
inline void score_tile_bf16(const uint32_t* qpairs, const c10::BFloat16* const* keys, int64_t padded, int64_t dim,
                            float scale, float* scores) {
  constexpr int64_t W = V * LANES;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t k = 0; k < padded; k += KB) {
    __m512 a[KB][V];
    for (int b = 0; b < KB; ++b)
      for (int v = 0; v < V; ++v) a[b][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim / 2; ++i) {
      __m512bh q[V];
      for (int v = 0; v < V; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qpairs + i * W + v * LANES);
      for (int b = 0; b < KB; ++b) {
        const __m512bh kv = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(keys[k + b])[i]);
        for (int v = 0; v < V; ++v) a[b][v] = _mm512_dpbf16_ps(a[b][v], kv, q[v]);
      }
    }
    for (int b = 0; b < KB; ++b)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(scores + (k + b) * W + v * LANES, _mm512_mul_ps(a[b][v], scale_v));
  }
}
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

// Online softmax over the first n keys of the tile: new running max, probabilities in place
// (zero for the padded keys), sums updated; returns each lane's factor for the old accumulator.
template <int V>
inline void softmax_tile(float* scores, int64_t n, int64_t padded, float* m, float* l, __m512* correction) {
  constexpr int64_t W = V * LANES;
  for (int v = 0; v < V; ++v) {
    const __m512 old_max = _mm512_loadu_ps(m + v * LANES);
    __m512 mx = old_max;
    for (int64_t k = 0; k < n; ++k) mx = _mm512_max_ps(mx, _mm512_loadu_ps(scores + k * W + v * LANES));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; ++k) {
      float* s = scores + k * W + v * LANES;
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s), mx));
      _mm512_storeu_ps(s, e);
      sum = _mm512_add_ps(sum, e);
    }
    for (int64_t k = n; k < padded; ++k) _mm512_storeu_ps(scores + k * W + v * LANES, _mm512_setzero_ps());
    // The first tile: the old max is -inf (exp_ps gives ~0 and the old sums are 0 anyway).
    const __m512 c = exp_ps(_mm512_sub_ps(old_max, mx));
    correction[v] = c;
    _mm512_storeu_ps(l + v * LANES, _mm512_fmadd_ps(_mm512_loadu_ps(l + v * LANES), c, sum));
    _mm512_storeu_ps(m + v * LANES, mx);
  }
}

// acc[d][lanes] = acc * correction + sum_k values[k][d] * probs[k][lanes], DB dims at a time.
template <int V, int DB>
inline void weigh_tile(const float* probs, const float* const* values, int64_t padded, int64_t dim,
                       const __m512* correction, float* acc) {
  constexpr int64_t W = V * LANES;
  for (int64_t d = 0; d < dim; d += DB) {
    __m512 a[DB][V];
    for (int b = 0; b < DB; ++b)
      for (int v = 0; v < V; ++v) a[b][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + (d + b) * W + v * LANES), correction[v]);
    for (int64_t k = 0; k < padded; ++k) {
      __m512 pr[V];
      for (int v = 0; v < V; ++v) pr[v] = _mm512_loadu_ps(probs + k * W + v * LANES);
      for (int b = 0; b < DB; ++b) {
        const __m512 x = _mm512_set1_ps(values[k][d + b]);
        for (int v = 0; v < V; ++v) a[b][v] = _mm512_fmadd_ps(x, pr[v], a[b][v]);
      }
    }
    for (int b = 0; b < DB; ++b)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (d + b) * W + v * LANES, a[b][v]);
  }
}

#endif

}  // namespace
