// Prefill scoring against transposed keys, shared by float32 (here: run_item_f32) and bfloat16
// (attention_bf16.h). Items of at least TRANSPOSED_MIN_ROWS query rows per KV head (head_dim a
// multiple of 16) score without horizontal sums: the 16 keys of a chunk are transposed once per
// KV head into key lanes, and every query row of that head adds its broadcast query elements
// times those lanes into one register of 16 scores, so one transpose serves all the rows of the
// head. A span of SCORE_CHUNKS chunks is scored at once (SCORE_ROWS rows x SCORE_CHUNKS chunks
// of accumulators); the rows' query elements are transposed into lanes once per item. Values are
// weighed over the same spans (`weigh_values<SCORE_CHUNKS>`); softmax is run_item_avx512's. The
// results are bit for bit those of the one-chunk path. Decode items keep `score_chunk`.
#pragma once

#include "attention_avx512.h"

namespace {

// Rows per KV head from which an item takes the transposed scoring: below, the transpose costs
// about what it saves (and decode items, bound by memory, went no faster with it).
constexpr int64_t TRANSPOSED_MIN_ROWS = 6;
#if defined(__AVX512F__)
constexpr int SCORE_ROWS = 8;                     // query rows scored together
constexpr int SCORE_CHUNKS = 3;                   // key chunks scored together: 8 x 3 accumulators + 3 key registers
constexpr int64_t SPAN_KEYS = SCORE_CHUNKS * 16;  // keys transposed and scored together

// Calls f(std::integral_constant<int, R>{}) with R = count (1 .. SCORE_ROWS): fixed-size row loops unroll.
template <typename F>
inline void with_rows(int64_t count, F&& f) {
  switch (count) {
    case 8:
      f(std::integral_constant<int, 8>{});
      break;
    case 7:
      f(std::integral_constant<int, 7>{});
      break;
    case 6:
      f(std::integral_constant<int, 6>{});
      break;
    case 5:
      f(std::integral_constant<int, 5>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    default:
      f(std::integral_constant<int, 1>{});
      break;
  }
}

// kt row e (of `ld` floats) of each block of 16 dwords of 16 rows: dword e of each row, the rows'
// blocks coming from load(j, b) (row j, dwords b .. b + 16).
template <typename Load>
inline void transpose_blocks(int64_t dwords, float* kt, int64_t ld, Load&& load) {
  for (int64_t b = 0; b < dwords; b += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = load(j, b);
    transpose16(r);
    for (int e = 0; e < 16; ++e) _mm512_storeu_si512(kt + (b + e) * ld, r[e]);
  }
}

// The raw dwords of the keys' rows: for float32, row d holds dim d; for bf16 pairs, dims 2p and 2p + 1.
inline void transpose_dwords(const void* const* keys, int64_t dwords, float* kt, int64_t ld) {
  transpose_blocks(dwords, kt, ld,
                   [&](int j, int64_t b) { return _mm512_loadu_si512(static_cast<const uint32_t*>(keys[j]) + b); });
}

// Keys (or query rows) of a narrower type widened to float32 (F32Dot over a bfloat16 or 8-bit cache,
// or bfloat16 queries over an 8-bit cache): row d holds dim d.
template <typename E>
inline void transpose_widened(const E* const* rows, int64_t dim, float* kt, int64_t ld) {
  transpose_blocks(dim, kt, ld, [&](int j, int64_t b) { return _mm512_castps_si512(load16(rows[j] + b)); });
}

// Keys of an 8-bit cache as the bf16 pairs of transpose_dwords (load32_bf16; AVX512-BF16 only).
template <typename T>
inline void transpose_fp8_pairs(const T* const* rows, int64_t dwords, float* kt, int64_t ld) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  transpose_blocks(dwords, kt, ld, [&](int j, int64_t b) { return load32_bf16(rows[j] + 2 * b); });
#endif
}

// Calls f(std::integral_constant<int, C>{}) with C = chunks (1 .. SCORE_CHUNKS).
template <typename F>
inline void with_chunks(int64_t chunks, F&& f) {
  switch (chunks) {
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    default:
      f(std::integral_constant<int, 1>{});
      break;
  }
}

// One step of a score: float32 multiplies dim d; bf16 (AVX512-BF16 only) the pair of dims 2p, 2p + 1.
struct F32Dot {
  using Unit = float;
  static inline __m512 madd(__m512 acc, float q, __m512 k) { return _mm512_fmadd_ps(_mm512_set1_ps(q), k, acc); }
};

// out[r][16 c + j] = scale * (q_r . key j of chunk c) for R query rows and the C chunks of kt
// ([steps][SPAN_KEYS]): R x C accumulators, each kt register loaded once for all R rows. qt holds
// the rows' query elements step by step ([steps][16], rows in the first lanes), so that one
// pointer reaches them all.
template <typename Dot, int R, int C>
inline void score_tile(const typename Dot::Unit* qt, const float* kt, int64_t steps, float scale, float* const* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t d = 0; d < steps; ++d) {
    __m512 k[C];
    for (int c = 0; c < C; ++c) k[c] = _mm512_loadu_ps(kt + d * SPAN_KEYS + c * 16);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = Dot::madd(acc[r][c], qt[d * 16 + r], k[c]);
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[r] + c * 16, _mm512_mul_ps(acc[r][c], s));
}

// One item scored against transposed keys, SCORE_CHUNKS chunks at a time (`steps` kt rows per
// head: query elements of Dot::Unit per row, floats or bf16 pairs as uint32); softmax and
// values as run_item_avx512.
template <typename Q, typename T, typename Dot>
void run_item_transposed(const Problem<Q, T>& p, const WorkItem& item, Scratch& s, int64_t steps) {
  using U = typename Dot::Unit;
  const ItemGeometry g(p, item);
  const T* zero_row = start_item(p, item, g, s, false);
  const int64_t per_head = item.num_queries * (p.heads / p.kv_heads);
  s.packed.resize(steps * SPAN_KEYS);  // one head's transposed keys of one span
  float* kt = s.packed.data();
  const Q* query = p.query + g.first_token * p.heads * p.dim;
  // Each KV head's rows, SCORE_ROWS at a time, transposed into lanes step by step (see score_tile;
  // the lanes past a group's rows read the zero row); bfloat16 queries under F32Dot widened first.
  constexpr bool kWidenQuery = std::is_same_v<U, float> && !std::is_same_v<Q, float>;
  const int64_t groups = (per_head + SCORE_ROWS - 1) / SCORE_ROWS;
  s.queries.resize(p.kv_heads * groups * steps * 16);
  const U* qt = reinterpret_cast<const U*>(s.queries.data());
  for (int64_t h = 0; h < p.kv_heads; ++h)
    for (int64_t k = 0; k < per_head; k += SCORE_ROWS) {
      const Q* q[16];
      for (int64_t i = 0; i < 16; ++i) {
        const bool row = i < SCORE_ROWS && k + i < per_head;
        q[i] = row ? query + s.head_rows[h * per_head + k + i] * p.dim : reinterpret_cast<const Q*>(zero_row);
      }
      float* lanes = s.queries.data() + (h * groups + k / SCORE_ROWS) * steps * 16;
      if constexpr (kWidenQuery)
        transpose_widened(static_cast<const Q* const*>(q), steps, lanes, 16);
      else
        transpose_dwords(reinterpret_cast<const void* const*>(q), steps, lanes, 16);
    }
  for_each_span_head<SCORE_CHUNKS>(
      p, p.k_cache, item, g, zero_row, [&](int64_t offset, int64_t h, const T* const* head_rows, int64_t chunks) {
        // The keys' raw dwords are the Dot's units (float32, or bf16 pairs for vdpbf16ps) unless F32Dot
        // reads a bfloat16 cache.
        constexpr bool kWiden = std::is_same_v<Dot, F32Dot> && !std::is_same_v<T, float>;
        for (int64_t c = 0; c < chunks; ++c) {
          const T* const* keys = head_rows + c * CHUNK;
          if constexpr (kWiden)
            transpose_widened(keys, steps, kt + c * CHUNK, SPAN_KEYS);
          else if constexpr (kFp8<T>)  // vdpbf16ps over an 8-bit cache: its keys widened to bf16 pairs
            transpose_fp8_pairs(keys, steps, kt + c * CHUNK, SPAN_KEYS);
          else
            transpose_dwords(reinterpret_cast<const void* const*>(keys), steps, kt + c * CHUNK, SPAN_KEYS);
        }
        const int64_t* mine = s.head_rows.data() + h * per_head;
        for (int64_t k = 0; k < per_head; k += SCORE_ROWS) {
          const int64_t count = std::min<int64_t>(SCORE_ROWS, per_head - k);
          float* out[SCORE_ROWS];
          for (int64_t i = 0; i < count; ++i) out[i] = s.scores.data() + mine[k + i] * g.stride + offset;
          const U* rows_qt = qt + (h * groups + k / SCORE_ROWS) * steps * 16;
          with_rows(count, [&](auto r) {
            with_chunks(chunks, [&](auto c) {
              score_tile<Dot, decltype(r)::value, decltype(c)::value>(rows_qt, kt, steps, p.scale, out);
            });
          });
        }
      });
  softmax_rows(p, g, s);
  weigh_values<SCORE_CHUNKS>(p, item, g, s, zero_row, [] {});
  write_output(p, g, s);
}

// Float32 queries over a float32, bfloat16 or 8-bit cache; bfloat16 queries over an 8-bit cache.
template <typename Q, typename T>
void run_item_f32(const Problem<Q, T>& p, const WorkItem& item, Scratch& s) {
  run_item_transposed<Q, T, F32Dot>(p, item, s, p.dim);
}
constexpr bool kHaveTransposedPath = true;
#else
template <typename Q, typename T>
void run_item_f32(const Problem<Q, T>& p, const WorkItem& item, Scratch& s) {
  run_item_portable(p, item, s);
}
constexpr bool kHaveTransposedPath = false;
#endif

}  // namespace
