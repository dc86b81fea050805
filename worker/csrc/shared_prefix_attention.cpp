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
#include "amx_member_attention.h"
#include "kernels.h"
#include "shared_prefix_tiles.h"

namespace {

#if defined(__AVX512F__)
// Continues the state's rows over positions [lo, hi) of `seq`, KV head `head`.
template <int V, typename Q, typename T>
void attend_span(const SharedPrefixProblem<Q, T>& p, int64_t seq, int64_t head, int64_t lo, int64_t hi, RowState& s) {
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

// A member's own positions [lo, hi) for its `rows` query rows of KV head `head`, dims in lanes
// (few rows: the rows-in-lanes layout would leave most lanes idle): q, acc [rows][dim], m, l
// [rows] carry on from the shared prefix. 16 keys at a time, each widened once for every row.
template <typename Q, typename T>
void attend_own(const SharedPrefixProblem<Q, T>& p, int64_t seq, int64_t head, int64_t lo, int64_t hi, int64_t rows,
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

#if defined(PAGEDSERVE_AMX_ATTENTION)
// Whether items run on AMX tiles: bfloat16 queries and cache, 16-token-aligned blocks.
template <typename Q, typename T>
bool use_amx(const SharedPrefixProblem<Q, T>& p) {
  if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>)
    return p.block_size % 16 == 0 && p.dim % 32 == 0 && amx::permitted();
  return false;
}

// A whole item on AMX tiles (amx_attention.h): the shared prefix for all rows together, then
// the members' own positions, 16 / gq members a tile (attend_members), written to the output.
template <typename Q, typename T>
void item_on_tiles(const SharedPrefixProblem<Q, T>& p, const Item& item, const int32_t* members, int64_t prefix,
                   amx::Scratch& scratch) {
  const int64_t dim = p.dim, gq = p.heads / p.kv_heads, rows = item.count * gq, head = item.head;
  const int64_t blocks = (rows + amx::ROWS - 1) / amx::ROWS;
  static_assert(MAX_VECS <= amx::MAX_BLOCKS, "an item's rows must fit the tiles' blocks");
  const auto* query = reinterpret_cast<const c10::BFloat16*>(p.query);
  auto* output = reinterpret_cast<c10::BFloat16*>(p.out);
  auto row_of = [&](int64_t r) {  // row r: member r / gq, query head head * gq + r % gq
    return (static_cast<int64_t>(p.query_start[members[item.first + r / gq]]) * p.heads + head * gq + r % gq) * dim;
  };
  std::vector<uint32_t> qt(MAX_VECS * dim * 8), own_qt(std::max<int64_t>(MAX_VECS, amx::ROWS) * dim * 8);
  std::vector<float> acc(MAX_VECS * amx::ROWS * dim, 0.0f), own_acc(MAX_VECS * amx::ROWS * dim);
  alignas(64) float m[amx::MAX_BLOCKS * 16], l[amx::MAX_BLOCKS * 16], own_m[amx::MAX_BLOCKS * 16],
      own_l[amx::MAX_BLOCKS * 16];
  alignas(64) int32_t limit[amx::MAX_BLOCKS * 16];
  const c10::BFloat16* row_ptrs[16];
  auto pack = [&](int64_t first_row, int64_t count, int32_t visible, uint32_t* packed) {
    for (int64_t b = 0; b * amx::ROWS < count; ++b) {
      const int64_t n = std::min<int64_t>(amx::ROWS, count - b * amx::ROWS);
      for (int64_t i = 0; i < 16; ++i) {
        row_ptrs[i] = i < n ? query + row_of(first_row + b * amx::ROWS + i) : nullptr;
        limit[b * 16 + i] = i < n ? visible : 0;
      }
      amx::pack_queries(row_ptrs, n, dim, packed + b * dim * 8);
    }
  };
  auto cache_rows = [&](const T* cache, int64_t seq) {
    return [&p, cache, seq, head](int64_t pos) {
      return reinterpret_cast<const c10::BFloat16*>(p.row(cache, seq, pos, head));
    };
  };
  std::fill(m, m + blocks * 16, -std::numeric_limits<float>::infinity());
  std::fill(l, l + blocks * 16, 0.0f);
  pack(0, rows, static_cast<int32_t>(prefix), qt.data());
  const int64_t first_seq = members[item.first];
  amx::attend_rows(qt.data(), blocks, dim, cache_rows(p.k_cache, first_seq), cache_rows(p.v_cache, first_seq),
                   p.kv_heads * dim, 0, prefix, limit, p.scale, m, l, acc.data(), scratch);
  auto finish = [&](int64_t row, const float* row_acc, float row_l) {  // writes output row `row`
    c10::BFloat16* o = output + row_of(row);
    const __m512 inv = _mm512_set1_ps(1.0f / row_l);
    for (int64_t d = 0; d < dim; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row_acc + d), inv)));
  };
  if (gq <= amx::ROWS) {
    // Own positions: the members of a tile (16 / gq of them) together, each with its rows.
    const int64_t per_tile = amx::ROWS / gq;
    int64_t his[amx::ROWS];
    for (int64_t t = 0; t < item.count; t += per_tile) {
      const int64_t n = std::min<int64_t>(per_tile, item.count - t);
      std::fill(own_m, own_m + 16, -std::numeric_limits<float>::infinity());
      std::fill(own_l, own_l + 16, 0.0f);
      std::fill(limit, limit + 16, 0);
      std::fill(own_acc.begin(), own_acc.begin() + 16 * dim, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t seq = members[item.first + t + j];
        his[j] = p.seq_lens[seq];
        for (int64_t i = 0; i < 16; ++i) row_ptrs[i] = i / gq == j ? query + row_of((t + j) * gq + i % gq) : nullptr;
        amx::pack_queries(row_ptrs, 16, dim, own_qt.data() + j * dim * 8);
        for (int64_t i = 0; i < gq; ++i) {
          const int64_t from = (t + j) * gq + i, to = j * gq + i;
          limit[to] = static_cast<int32_t>(his[j]);
          own_m[to] = m[from];
          own_l[to] = l[from];
          std::memcpy(own_acc.data() + to * dim, acc.data() + from * dim, dim * sizeof(float));
        }
      }
      amx::attend_members(
          own_qt.data(), n, gq, dim,
          [&](int64_t j, int64_t pos) {
            return reinterpret_cast<const c10::BFloat16*>(p.row(p.k_cache, members[item.first + t + j], pos, head));
          },
          [&](int64_t j, int64_t pos) {
            return reinterpret_cast<const c10::BFloat16*>(p.row(p.v_cache, members[item.first + t + j], pos, head));
          },
          p.kv_heads * dim, prefix, his, limit, p.scale, own_m, own_l, own_acc.data(), scratch);
      for (int64_t r = 0; r < n * gq; ++r) finish(t * gq + r, own_acc.data() + r * dim, own_l[r]);
    }
    return;
  }
  const int64_t own_blocks = (gq + amx::ROWS - 1) / amx::ROWS;
  for (int64_t i = 0; i < item.count; ++i) {
    const int64_t seq = members[item.first + i], len = p.seq_lens[seq];
    pack(i * gq, gq, static_cast<int32_t>(len), own_qt.data());
    std::fill(own_m, own_m + own_blocks * 16, -std::numeric_limits<float>::infinity());
    std::fill(own_l, own_l + own_blocks * 16, 0.0f);
    for (int64_t j = 0; j < gq; ++j) {
      own_m[j] = m[i * gq + j];
      own_l[j] = l[i * gq + j];
      std::memcpy(own_acc.data() + j * dim, acc.data() + (i * gq + j) * dim, dim * sizeof(float));
    }
    amx::attend_rows(own_qt.data(), own_blocks, dim, cache_rows(p.k_cache, seq), cache_rows(p.v_cache, seq),
                     p.kv_heads * dim, prefix, len, limit, p.scale, own_m, own_l, own_acc.data(), scratch);
    for (int64_t j = 0; j < gq; ++j) finish(i * gq + j, own_acc.data() + j * dim, own_l[j]);
  }
}
#endif

template <typename Q, typename T>
void run_item(const SharedPrefixProblem<Q, T>& p, const Item& item, const int32_t* members, int64_t prefix, RowState& shared,
              RowState& own, void* tiles) {
#if defined(PAGEDSERVE_AMX_ATTENTION)
  if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>)
    if (tiles != nullptr) return item_on_tiles(p, item, members, prefix, *static_cast<amx::Scratch*>(tiles));
#endif
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
void run(const SharedPrefixProblem<Q, T>& p, const int32_t* group_start, const int32_t* members, const int32_t* prefix_lens,
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
    void* tiles = nullptr;
#if defined(PAGEDSERVE_AMX_ATTENTION)
    std::optional<amx::TileScope> scope;
    thread_local amx::Scratch scratch;  // kept across calls: the shared span's packed V is large
    if (use_amx(p)) {
      scope.emplace();
      tiles = &scratch;
    }
#endif
    for (int64_t index = next++; index < count; index = next++) {
      const Item& item = items[index];
      run_item(p, item, members, prefix_lens[item.group], shared, own, tiles);
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
  const SharedPrefixProblem<Q, T> p{query.data_ptr<Q>(),       k_cache.data_ptr<T>(),           v_cache.data_ptr<T>(),
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
