// Shared-prefix ("cascade") decode attention on CPU. Decodes whose block tables start with the
// same blocks (prefix cache hits) are grouped by the caller; for each group and KV head, the
// query rows of every member (members x query heads of that KV head) attend to the shared
// prefix together: each K/V position of the prefix is loaded (and widened) once and used by all
// the rows, at matrix-matrix efficiency. Each member then continues its own online softmax (the
// running max, sum and accumulator carried over) through the rest of its sequence, so no merge
// pass is needed. Softmax and the weighted sum are float32; results match paged_attention up to
// float rounding.
//
// Layout of the shared part: rows in vector lanes. A work item holds up to MAX_VECS x 16 rows;
// its queries are stored transposed (qt[d][row], pre-scaled), scores as [key][row], the
// accumulator as [d][row], so the scoring (broadcast key element x query lanes; bfloat16 pairs
// on vdpbf16ps where the CPU has AVX512-BF16), the softmax (max, exp and sums down the keys) and
// the weighted sum (broadcast value element x probability lanes) need no horizontal reductions.
// A member's own positions have only its few rows: dims in lanes there, as in paged_attention.
// AVX-512 only: without it the caller keeps paged_attention.
#include "kernels.h"
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
struct Problem {
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

// Continues the state's rows over positions [lo, hi) of `seq`, KV head `head`.
template <int V, typename Q, typename T>
void attend_span(const Problem<Q, T>& p, int64_t seq, int64_t head, int64_t lo, int64_t hi, RowState& s) {
  constexpr int KB = V == 1 ? 8 : 4;  // keys scored together: KB x V accumulators
  constexpr int DB = V <= 2 ? 8 : 4;  // value dims weighed together (head_dim is a multiple of 16)
  const T* rows[TILE];
  const float* keys[TILE];
  const float* values[TILE];
  for (int64_t first = lo; first < hi; first += TILE) {
    const int64_t n = std::min<int64_t>(TILE, hi - first);
    const int64_t padded = (n + KB - 1) / KB * KB;
    for (int64_t j = 0; j < n; ++j) rows[j] = p.row(p.k_cache, seq, first + j, head);
    bool scored = false;
    if constexpr (kHaveBf16Dot && std::is_same_v<Q, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__)
      for (int64_t j = n; j < padded; ++j) rows[j] = reinterpret_cast<const T*>(s.zeros.data());
      score_tile_bf16<V, KB>(s.qpairs.data(), rows, padded, p.dim, p.scale, s.scores.data());
      scored = true;
#endif
    }
    if (!scored) {
      as_float(rows, n, p.dim, s.kf.data(), keys);
      for (int64_t j = n; j < padded; ++j) keys[j] = s.zeros.data();
      score_tile<V, KB>(s.qt.data(), keys, padded, p.dim, s.scores.data());
    }
    __m512 correction[V];
    softmax_tile<V>(s.scores.data(), n, padded, s.m.data(), s.l.data(), correction);
    for (int64_t j = 0; j < n; ++j) rows[j] = p.row(p.v_cache, seq, first + j, head);
    as_float(rows, n, p.dim, s.vf.data(), values);
    for (int64_t j = n; j < padded; ++j) values[j] = s.zeros.data();
    weigh_tile<V, DB>(s.scores.data(), values, padded, p.dim, correction, s.acc.data());
  }
}

// Lane j of the result is the sum of the 16 lanes of v[j].
inline __m512 horizontal_sums(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]), _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
  const __m512 x = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, x);
}

// A member's own positions [lo, hi) for its `rows` query rows of KV head `head`, dims in lanes
// (few rows: the rows-in-lanes layout would leave most lanes idle): q, acc [rows][dim], m, l
// [rows] carry on from the shared prefix. 16 keys at a time, each widened once for every row.
template <typename Q, typename T>
void attend_own(const Problem<Q, T>& p, int64_t seq, int64_t head, int64_t lo, int64_t hi, int64_t rows,
                const Q* query, const float* q, float* m, float* l, float* acc, RowState& s) {
  constexpr bool kBf16Dot = kHaveBf16Dot && std::is_same_v<Q, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>;
  const int64_t dim = p.dim;
  const T* cache_rows[LANES];
  const float* keys[LANES];
  const float* values[LANES];
  alignas(64) float probs[LANES];
  for (int64_t first = lo; first < hi; first += LANES) {
    const int64_t n = std::min<int64_t>(LANES, hi - first);
    const __mmask16 valid = n == LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    const T* key_rows[LANES];
    for (int64_t j = 0; j < n; ++j) key_rows[j] = p.row(p.k_cache, seq, first + j, head);
    for (int64_t j = n; j < LANES; ++j) key_rows[j] = reinterpret_cast<const T*>(s.zeros.data());
    if constexpr (!kBf16Dot) {
      as_float(key_rows, n, dim, s.kf.data(), keys);
      for (int64_t j = n; j < LANES; ++j) keys[j] = s.zeros.data();
    }
    for (int64_t j = 0; j < n; ++j) cache_rows[j] = p.row(p.v_cache, seq, first + j, head);
    as_float(cache_rows, n, dim, s.vf.data(), values);
    for (int64_t j = n; j < LANES; ++j) values[j] = s.zeros.data();
    for (int64_t r = 0; r < rows; ++r) {
      __m512 a[LANES];
#pragma GCC unroll 16
      for (int j = 0; j < LANES; ++j) a[j] = _mm512_setzero_ps();
      __m512 scores;
      if constexpr (kBf16Dot) {  // as paged_attention scores bfloat16: pairs on vdpbf16ps, then scaled
#if defined(__AVX512BF16__)
        for (int64_t d = 0; d < dim; d += 2 * LANES) {
          const __mmask32 mask = dim - d >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (dim - d)) - 1);
          const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(mask, query + r * dim + d);
#pragma GCC unroll 16
          for (int j = 0; j < LANES; ++j)
            a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(mask, key_rows[j] + d));
        }
        scores = _mm512_mul_ps(horizontal_sums(a), _mm512_set1_ps(p.scale));
#endif
      } else {
        for (int64_t d = 0; d < dim; d += LANES) {
          const __m512 qv = _mm512_loadu_ps(q + r * dim + d);
#pragma GCC unroll 16
          for (int j = 0; j < LANES; ++j) a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[j] + d), a[j]);
        }
        scores = horizontal_sums(a);
      }
      const float new_max = std::max(m[r], _mm512_mask_reduce_max_ps(valid, scores));
      const float correction = std::exp(m[r] - new_max);  // 0 while m is -inf (an empty prefix)
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
      _mm512_store_ps(probs, e);
      l[r] = l[r] * correction + _mm512_reduce_add_ps(e);
      m[r] = new_max;
      float* out = acc + r * dim;
      for (int64_t d = 0; d < dim; d += LANES) {
        __m512 av = _mm512_mul_ps(_mm512_loadu_ps(out + d), _mm512_set1_ps(correction));
        for (int64_t j = 0; j < n; ++j)
          av = _mm512_fmadd_ps(_mm512_set1_ps(probs[j]), _mm512_loadu_ps(values[j] + d), av);
        _mm512_storeu_ps(out + d, av);
      }
    }
  }
}

template <typename F>
inline void with_vecs(int64_t vecs, F&& f) {
  switch (vecs) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    default:
      f(std::integral_constant<int, 4>{});
      break;
  }
}

// A group's members [first, first + count) of `members` and one KV head.
struct Item {
  int64_t group, first, count, head, cost;
};

template <typename Q, typename T>
void run_item(const Problem<Q, T>& p, const Item& item, const int32_t* members, int64_t prefix, RowState& shared,
              RowState& own) {
  const int64_t dim = p.dim, gq = p.heads / p.kv_heads;
  const int64_t rows = item.count * gq;
  const int64_t vecs = (rows + LANES - 1) / LANES, w = vecs * LANES;
  shared.reset(static_cast<int>(vecs), dim);
  // Row r: member r / gq, query head item.head * gq + r % gq.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seq = members[item.first + r / gq];
    const Q* q = p.query + (static_cast<int64_t>(p.query_start[seq]) * p.heads + item.head * gq + r % gq) * dim;
    for (int64_t d = 0; d < dim; ++d) shared.qt[d * w + r] = load_float(q + d) * p.scale;
    if constexpr (std::is_same_v<Q, c10::BFloat16>) {
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);
      for (int64_t i = 0; i < dim / 2; ++i) shared.qpairs[i * w + r] = pairs[i];
    }
  }
  with_vecs(vecs, [&](auto v) {
    attend_span<decltype(v)::value>(p, members[item.first], item.head, 0, prefix, shared);
  });
  // Each member's own positions, from the shared state of its rows.
  own.qt.resize(gq * dim);
  own.acc.resize(gq * dim);
  own.m.resize(gq);
  own.l.resize(gq);
  for (int64_t i = 0; i < item.count; ++i) {
    const int64_t seq = members[item.first + i];
    for (int64_t j = 0; j < gq; ++j) {
      const int64_t r = i * gq + j;
      own.m[j] = shared.m[r];
      own.l[j] = shared.l[r];
      for (int64_t d = 0; d < dim; ++d) {
        own.qt[j * dim + d] = shared.qt[d * w + r];
        own.acc[j * dim + d] = shared.acc[d * w + r];
      }
    }
    const Q* query = p.query + (static_cast<int64_t>(p.query_start[seq]) * p.heads + item.head * gq) * dim;
    attend_own(p, seq, item.head, prefix, p.seq_lens[seq], gq, query, own.qt.data(), own.m.data(), own.l.data(),
               own.acc.data(), shared);
    Q* out = p.out + (static_cast<int64_t>(p.query_start[seq]) * p.heads + item.head * gq) * dim;
    for (int64_t j = 0; j < gq; ++j) {
      const float inv = 1.0f / own.l[j];
      for (int64_t d = 0; d < dim; ++d) out[j * dim + d] = static_cast<Q>(own.acc[j * dim + d] * inv);
    }
  }
}

template <typename Q, typename T>
void run(const Problem<Q, T>& p, const int32_t* group_start, const int32_t* members, const int32_t* prefix_lens,
         int64_t num_groups) {
  const int64_t gq = p.heads / p.kv_heads, per_item = MAX_VECS * LANES / gq;
  std::vector<Item> items;
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int64_t first = group_start[g]; first < group_start[g + 1]; first += per_item) {
      const int64_t count = std::min<int64_t>(per_item, group_start[g + 1] - first);
      int64_t keys = prefix_lens[g];
      for (int64_t i = first; i < first + count; ++i) keys += p.seq_lens[members[i]] - prefix_lens[g];
      for (int64_t h = 0; h < p.kv_heads; ++h) items.push_back({g, first, count, h, keys});
    }
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    RowState shared, own;
    for (int64_t index = next++; index < count; index = next++) {
      const Item& item = items[index];
      run_item(p, item, members, prefix_lens[item.group], shared, own);
    }
  };
  if (threads == 1)
    work(0, 1);
  else
    at::parallel_for(0, threads, 1, work);
}

template <typename Q, typename T>
void run_tensors(torch::Tensor& out, torch::Tensor& query, torch::Tensor& k_cache, torch::Tensor& v_cache,
                 torch::Tensor& block_tables, torch::Tensor& query_start, torch::Tensor& seq_lens,
                 torch::Tensor& group_start, torch::Tensor& members, torch::Tensor& prefix_lens, double scale) {
  const Problem<Q, T> p{query.data_ptr<Q>(),       k_cache.data_ptr<T>(),           v_cache.data_ptr<T>(),
                        block_tables.data_ptr<int32_t>(), query_start.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                        out.data_ptr<Q>(),         block_tables.size(1),            k_cache.size(1),
                        query.size(1),             k_cache.size(2),                 query.size(2),
                        static_cast<float>(scale)};
  run(p, group_start.data_ptr<int32_t>(), members.data_ptr<int32_t>(), prefix_lens.data_ptr<int32_t>(),
      prefix_lens.size(0));
}
#endif

}  // namespace

bool shared_prefix_attention_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void shared_prefix_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens,
                             torch::Tensor group_start, torch::Tensor members, torch::Tensor prefix_lens,
                             double scale) {
  TORCH_CHECK(shared_prefix_attention_available(), "shared_prefix_attention needs AVX-512");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [tokens, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "tensors must be contiguous");
  const bool bf16_cache = query.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kBFloat16;
  const bool same = k_cache.scalar_type() == query.scalar_type() &&
                    (query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kBFloat16);
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (same || bf16_cache),
              "queries must be float32 or bfloat16, the caches the query's dtype or (float32 queries) bfloat16");
  for (const torch::Tensor* t : {&block_tables, &query_start, &seq_lens, &group_start, &members, &prefix_lens})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "metadata must be contiguous int32");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), dim = query.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
#if defined(__AVX512F__)
  TORCH_CHECK(dim % LANES == 0 && heads / kv_heads <= MAX_VECS * LANES,
              "shared_prefix_attention needs head_dim a multiple of 16 and at most 64 query heads per KV head");
#endif
  const int64_t num_seqs = seq_lens.size(0), num_groups = prefix_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "metadata sizes differ");
  TORCH_CHECK(group_start.size(0) == num_groups + 1, "group_start must have one entry more than prefix_lens");
  const int32_t* starts = group_start.data_ptr<int32_t>();
  const int32_t* seqs = members.data_ptr<int32_t>();
  const int32_t* prefixes = prefix_lens.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  TORCH_CHECK(num_groups == 0 || (starts[0] == 0 && starts[num_groups] == members.size(0)),
              "group_start must run from 0 to the number of members");
  const int64_t block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  for (int64_t g = 0; g < num_groups; ++g) {
    TORCH_CHECK(starts[g] < starts[g + 1], "every group needs a member");
    TORCH_CHECK(prefixes[g] >= 0 && prefixes[g] <= max_blocks * block_size, "prefix length out of range");
    for (int64_t i = starts[g]; i < starts[g + 1]; ++i) {
      TORCH_CHECK(seqs[i] >= 0 && seqs[i] < num_seqs, "member out of range");
      TORCH_CHECK(qs[seqs[i] + 1] - qs[seqs[i]] == 1, "members must be decodes (one query token)");
      TORCH_CHECK(lens[seqs[i]] > prefixes[g] && lens[seqs[i]] <= max_blocks * block_size,
                  "a member's length must exceed its group's prefix and fit its block table");
    }
  }
#if defined(__AVX512F__)
  if (bf16_cache) {
    run_tensors<float, c10::BFloat16>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens, group_start,
                                      members, prefix_lens, scale);
  } else if (query.scalar_type() == torch::kFloat) {
    run_tensors<float, float>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens, group_start, members,
                              prefix_lens, scale);
  } else {
    run_tensors<c10::BFloat16, c10::BFloat16>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens,
                                              group_start, members, prefix_lens, scale);
  }
#endif
}
