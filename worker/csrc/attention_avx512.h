// The AVX-512 path of the CPU paged attention kernel (float32 or bfloat16, head_dim a multiple
// of 16). K and V are read straight from the cache: scores of 16 positions come from 16
// accumulators (FMA, or vdpbf16ps on bfloat16 pairs) and one transposing horizontal sum; exp is
// a vectorized polynomial; values are widened in registers and added into register-resident
// accumulators of a few query rows at a time. Decode items are bound by memory about as much as
// by compute: while one computes, it prefetches the K/V of the thread's next item (`ReadAhead`)
// so that memory and compute overlap; an item nothing read ahead (a thread's first) reads its
// own K/V into L2 with plain sequential loads first (`stream_kv`). Without AVX-512,
// run_item_avx512 runs the portable loops and kHaveAvx512 is false.
#pragma once

#include "attention_prefetch.h"

namespace {

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------
// AVX-512 path (float32 or bfloat16, head_dim a multiple of 16). K and V are read
// straight from the cache: scores of 16 positions come from 16 accumulators (FMA,
// or vdpbf16ps on bf16 pairs) and one transposing horizontal sum; values are
// widened in registers and added into register-resident accumulators of a few
// query rows at a time. Nothing is copied: staging K/V in a buffer turned out to
// be several times slower (the buffer's stores stall the cache loads).
constexpr int64_t SLICE = 16;  // floats per register

// out[j] = scale * (q . keys[j]) for the 16 keys of a chunk (a short chunk points its
// missing keys at a zero row: fixed-size loops unroll and keep all 16 accumulators in registers).
// float32, and bfloat16 widened to float32 on CPUs without AVX512-BF16.
template <typename Q, typename T>
inline void score_chunk(const Q* q, const T* const* keys, int64_t dim, float scale, float* out) {
  __m512 acc[CHUNK];
#pragma GCC unroll 16
  for (int j = 0; j < CHUNK; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 qv = load16(q + d);
#pragma GCC unroll 16
    for (int j = 0; j < CHUNK; ++j) acc[j] = _mm512_fmadd_ps(qv, load16(keys[j] + d), acc[j]);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(horizontal_sums(acc), _mm512_set1_ps(scale)));
}
#if defined(__AVX512BF16__)
// bfloat16 pairs straight into vdpbf16ps (a non-template overload: preferred over the one above).
inline void score_chunk(const c10::BFloat16* q, const c10::BFloat16* const* keys, int64_t dim, float scale,
                        float* out) {
  __m512 acc[CHUNK];
#pragma GCC unroll 16
  for (int j = 0; j < CHUNK; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 32) {
    const __mmask32 m = dim - d >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (dim - d)) - 1);
    const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + d);
#pragma GCC unroll 16
    for (int j = 0; j < CHUNK; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, keys[j] + d));
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(horizontal_sums(acc), _mm512_set1_ps(scale)));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The 16 keys of a chunk of an 8-bit cache widened to bfloat16 (see load32_bf16) into the item's
// scratch; keys[j] points at key j's copy (head_dim a multiple of 32).
template <typename T>
inline void widen_chunk_bf16(const T* const* head_rows, int64_t dim, Scratch& s, const c10::BFloat16** keys) {
  s.widened.resize(CHUNK * dim);
#if defined(__AVX512VBMI__)
  if (dim % 64 == 0) {  // by table lookup, 64 at a time (the same bits)
    const Fp8Bf16Lookup<T>& lookup = fp8_bf16_lookup<T>();
    for (int j = 0; j < CHUNK; ++j) {
      c10::BFloat16* row = s.widened.data() + j * dim;
      for (int64_t d = 0; d < dim; d += 64) lookup.widen64(head_rows[j] + d, row + d);
      keys[j] = row;
    }
    return;
  }
#endif
  for (int j = 0; j < CHUNK; ++j) {
    c10::BFloat16* row = s.widened.data() + j * dim;
    for (int64_t d = 0; d < dim; d += 32) _mm512_storeu_si512(row + d, load32_bf16(head_rows[j] + d));
    keys[j] = row;
  }
}
#endif

// acc[r][d .. d + 16 NV) += sum_j w[r][j] * values[j][d ..] for ROWS rows sharing one KV head
// and the keys of `chunks` (<= SPAN) chunks: the accumulators stay in registers over all of them,
// and each value register is widened once and used by every row.
template <int NV, int ROWS, int SPAN, typename T>
inline void weigh(const float* const* w, const T* const* values, int64_t chunks, int64_t d, float* const* acc) {
  __m512 a[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(acc[r] + d + v * SLICE);
  const int64_t keys = SPAN == 1 ? CHUNK : chunks * CHUNK;  // a single chunk unrolls whole
  for (int64_t c = 0; c < keys; c += CHUNK) {
#pragma GCC unroll 16
    for (int j = 0; j < CHUNK; ++j) {
      __m512 val[NV];
      for (int v = 0; v < NV; ++v) val[v] = load16(values[c + j] + d + v * SLICE);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 wj = _mm512_set1_ps(w[r][c + j]);
        for (int v = 0; v < NV; ++v) a[r][v] = _mm512_fmadd_ps(wj, val[v], a[r][v]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc[r] + d + v * SLICE, a[r][v]);
}

// Kept out of line: inlined into run_item_avx512, it made decode attention slower.
template <int ROWS, int SPAN, typename T>
__attribute__((noinline)) void weigh_rows(const float* const* w, const T* const* values, int64_t chunks, int64_t dim,
                                          float* const* acc) {
  constexpr int WIDTH = ROWS >= 3 ? 4 : 8;  // registers per row: ROWS * WIDTH + WIDTH <= 32
  for (int64_t d = 0; d < dim; d += WIDTH * SLICE) {
    switch (std::min<int64_t>(WIDTH, (dim - d) / SLICE)) {
      case 1:
        weigh<1, ROWS, SPAN>(w, values, chunks, d, acc);
        break;
      case 2:
        weigh<2, ROWS, SPAN>(w, values, chunks, d, acc);
        break;
      case 3:
        weigh<3, ROWS, SPAN>(w, values, chunks, d, acc);
        break;
      case 4:
        weigh<4, ROWS, SPAN>(w, values, chunks, d, acc);
        break;
      case 5:
        if constexpr (WIDTH > 4) {
          weigh<5, ROWS, SPAN>(w, values, chunks, d, acc);
        }
        break;
      case 6:
        if constexpr (WIDTH > 4) {
          weigh<6, ROWS, SPAN>(w, values, chunks, d, acc);
        }
        break;
      case 7:
        if constexpr (WIDTH > 4) {
          weigh<7, ROWS, SPAN>(w, values, chunks, d, acc);
        }
        break;
      default:
        if constexpr (WIDTH > 4) {
          weigh<WIDTH, ROWS, SPAN>(w, values, chunks, d, acc);
        }
        break;
    }
  }
}

// Softmax in place over each row's scores (max-subtracted, over its visible keys; the
// others weigh zero); 1 / sum of each row into s.inv_sums.
template <typename Q, typename T>
void softmax_rows(const Problem<Q, T>& p, const ItemGeometry& g, Scratch& s) {
  for (int64_t r = 0; r < g.rows; ++r) {
    const auto [lo, hi] = g.visible(p, r);
    float* sr = s.scores.data() + r * g.stride;
    __m512 max_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t k = lo; k < hi; k += 16) {
      const __mmask16 mask = hi - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (hi - k)) - 1);
      max_v = _mm512_mask_max_ps(max_v, mask, max_v, _mm512_maskz_loadu_ps(mask, sr + k));
    }
    const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(max_v));
    __m512 total = _mm512_setzero_ps();
    for (int64_t k = lo; k < hi; k += 16) {
      const __mmask16 mask = hi - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (hi - k)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sr + k), max_score));
      _mm512_mask_storeu_ps(sr + k, mask, e);
      total = _mm512_mask_add_ps(total, mask, total, e);
    }
    std::fill(sr, sr + lo, 0.0f);  // invisible positions weigh nothing
    std::fill(sr + hi, sr + g.stride, 0.0f);
    s.inv_sums[r] = 1.0f / _mm512_reduce_add_ps(total);
  }
}

// Sizes an item's scratch, lists the rows of each KV head (s.head_rows[h * per_head + i],
// per_head = queries x GQA group) and returns a zero row for chunks cut short. `read_ahead`:
// the previous item prefetched this one's K/V; else a decode item reads them into L2 first
// (not again after the read-ahead: a second pass over them slows decode attention).
template <typename Q, typename T>
const T* start_item(const Problem<Q, T>& p, const WorkItem& item, const ItemGeometry& g, Scratch& s, bool read_ahead) {
  if (!read_ahead && item.num_queries <= STREAM_MAX_QUERIES) stream_kv(p, item.seq, g.key_lo, g.key_hi);
  s.scores.resize(g.rows * g.stride);
  s.acc.assign(g.rows * p.dim, 0.0f);
  s.inv_sums.resize(g.rows);
  s.zeros.assign(p.dim, 0.0f);  // all-zero bits: a zero row in any dtype
  const int64_t group = p.heads / p.kv_heads;
  s.head_rows.clear();
  for (int64_t h = 0; h < p.kv_heads; ++h)
    for (int64_t i = 0; i < item.num_queries; ++i)
      for (int64_t r = i * p.heads + h * group; r < i * p.heads + (h + 1) * group; ++r) s.head_rows.push_back(r);
  return reinterpret_cast<const T*>(s.zeros.data());
}

// Calls fn(offset, h, head_rows, chunks) for every span of up to SPAN chunks of the item's keys
// (offset: its first key relative to key_lo) and KV head h, head_rows pointing at that head's
// rows of `cache` (chunks x 16 of them, the zero row past the end), prefetching a span ahead.
template <int SPAN, typename Q, typename T, typename F>
inline void for_each_span_head(const Problem<Q, T>& p, const T* cache, const WorkItem& item, const ItemGeometry& g,
                               const T* zero_row, F&& fn) {
  constexpr int64_t KEYS = SPAN * CHUNK;
  const T* rows[KEYS];
  const T* head_rows[KEYS];
  for (int64_t a = 0; a < PREFETCH_AHEAD * SPAN; ++a) p.prefetch(cache, item.seq, g.key_lo + a * CHUNK, g.key_hi);
  for (int64_t c = g.key_lo; c < g.key_hi; c += KEYS) {
    const int64_t n = std::min<int64_t>(KEYS, g.key_hi - c), chunks = (n + CHUNK - 1) / CHUNK;
    for (int64_t a = 0; a < SPAN; ++a) p.prefetch(cache, item.seq, c + PREFETCH_AHEAD * KEYS + a * CHUNK, g.key_hi);
    p.chunk_rows(cache, item.seq, c, n, rows);
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      for (int64_t j = 0; j < chunks * CHUNK; ++j) head_rows[j] = j < n ? rows[j] + h * p.dim : zero_row;
      fn(c - g.key_lo, h, static_cast<const T* const*>(head_rows), chunks);
    }
  }
}

// acc += probabilities x values, SPAN chunks at a time, the rows of one KV head six at a time
// when there are that many (prefill: each widened value register then feeds six rows rather
// than three) and else three (the GQA group of a decode is often exactly that). after_step()
// runs after each (span, KV head).
template <int SPAN, typename Q, typename T, typename F>
void weigh_values(const Problem<Q, T>& p, const WorkItem& item, const ItemGeometry& g, Scratch& s, const T* zero_row,
                  F&& after_step) {
  const int64_t dim = p.dim, per_head = item.num_queries * (p.heads / p.kv_heads);
  for_each_span_head<SPAN>(p, p.v_cache, item, g, zero_row,
                           [&](int64_t offset, int64_t h, const T* const* head_rows, int64_t chunks) {
                             const int64_t* mine = s.head_rows.data() + h * per_head;
                             for (int64_t k = 0; k < per_head;) {
                               const int64_t count = per_head - k >= 6 ? 6 : std::min<int64_t>(3, per_head - k);
                               const float* w[6];
                               float* acc[6];
                               for (int64_t i = 0; i < count; ++i) {
                                 w[i] = s.scores.data() + mine[k + i] * g.stride + offset;
                                 acc[i] = s.acc.data() + mine[k + i] * dim;
                               }
                               k += count;
                               switch (count) {
                                 case 6:
                                   weigh_rows<6, SPAN>(w, head_rows, chunks, dim, acc);
                                   break;
                                 case 3:
                                   weigh_rows<3, SPAN>(w, head_rows, chunks, dim, acc);
                                   break;
                                 case 2:
                                   weigh_rows<2, SPAN>(w, head_rows, chunks, dim, acc);
                                   break;
                                 default:
                                   weigh_rows<1, SPAN>(w, head_rows, chunks, dim, acc);
                                   break;
                               }
                             }
                             after_step();
                           });
}

// `next`: the item this thread runs after this one (none: the last); a decode item reads its K/V
// ahead, and returns whether it did. `read_ahead`: the previous item read this one's.
template <typename Q, typename T>
bool run_item_avx512(const Problem<Q, T>& p, const WorkItem& item, Scratch& s, const WorkItem* next, bool read_ahead) {
  const ItemGeometry g(p, item);
  const T* zero_row = start_item(p, item, g, s, read_ahead);
  const int64_t dim = p.dim, per_head = item.num_queries * (p.heads / p.kv_heads);
  const int64_t steps = 2 * ((g.key_hi - g.key_lo + CHUNK - 1) / CHUNK) * p.kv_heads;  // both passes
  ReadAhead<Q, T> ahead(p, item.num_queries <= STREAM_MAX_QUERIES ? next : nullptr, steps);
  const auto step_ahead = [&] {
    if (ahead.active()) ahead.step();
  };
  for_each_span_head<1>(
      p, p.k_cache, item, g, zero_row, [&](int64_t offset, int64_t h, const T* const* head_rows, int64_t) {
        const int64_t* rows = s.head_rows.data() + h * per_head;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        // bfloat16 queries over an 8-bit cache: the chunk's keys widened to bfloat16 once for all the
        // head's rows (not once a row), then scored on vdpbf16ps as a bfloat16 cache is.
        if constexpr (kFp8<T> && std::is_same_v<Q, c10::BFloat16>) {
          if (dim % 32 == 0) {
            const c10::BFloat16* keys[CHUNK];
            widen_chunk_bf16(head_rows, dim, s, keys);
            for (const int64_t* r = rows; r < rows + per_head; ++r)
              score_chunk(p.query + (g.first_token * p.heads + *r) * dim, keys, dim, p.scale,
                          s.scores.data() + *r * g.stride + offset);
            step_ahead();
            return;
          }
        }
#endif
        for (const int64_t* r = rows; r < rows + per_head; ++r)
          score_chunk(p.query + (g.first_token * p.heads + *r) * dim, head_rows, dim, p.scale,
                      s.scores.data() + *r * g.stride + offset);
        step_ahead();
      });
  softmax_rows(p, g, s);
  weigh_values<1>(p, item, g, s, zero_row, step_ahead);
  write_output(p, g, s);
  return ahead.reading();
}
constexpr bool kHaveAvx512 = true;
#else
template <typename Q, typename T>
bool run_item_avx512(const Problem<Q, T>& p, const WorkItem& item, Scratch& s, const WorkItem*, bool) {
  run_item_portable(p, item, s);
  return false;
}
constexpr bool kHaveAvx512 = false;
#endif

}  // namespace
