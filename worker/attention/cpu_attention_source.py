"""C++ source of the CPU paged attention kernel (compiled at first use by `worker.attention.cpu_kernels`).

One call per layer covers the whole flattened batch (decodes and prefill
chunks), reading K/V in place through the block tables: no gather copies, no
per-sequence Python loop. A work item is one sequence and a tile of its query
tokens, with every head: the K/V of a cache slot (all KV heads) is one
contiguous run of memory, so an item streams whole blocks (prefetching the
next chunk), converts each chunk of 16 positions to float once and reuses it
for every query row. Items are spread over torch's intra-op threads by
estimated cost (longest first onto the least loaded thread), because prefill
chunks and decodes differ in size by orders of magnitude.

With AVX-512 (head_dim a multiple of 16) the scores of 16 keys come from 16
FMA accumulators and one transposing horizontal sum, exp is a vectorized
polynomial, and value accumulators stay in registers across a chunk; other
CPUs use plain loops the compiler vectorizes. Softmax (max-subtracted, over
the visible positions) and the weighted sum of values are float32; the
result is cast to the query dtype. A query at position p sees positions
(p - sliding_window, p].
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t CHUNK = 16;      // key positions converted and scored together
constexpr int64_t TILE_ROWS = 64;  // query rows (tokens x heads) per prefill work item
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1
#endif
constexpr int64_t SERIAL_COST = 20000;  // below this many (row x key) units, stay on one thread

template <typename T>
inline float load_float(const T* p) { return static_cast<float>(*p); }
inline float load_float(const c10::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

struct WorkItem {
  int64_t seq, first_query, num_queries, cost;
};

template <typename T>
struct Problem {
  const T* query;     // [tokens, heads, dim]
  const T* k_cache;   // [blocks, block_size, kv_heads, dim]
  const T* v_cache;
  const int32_t* block_tables;  // [seqs, max_blocks]
  const int32_t* query_start;   // [seqs + 1]
  const int32_t* seq_lens;      // [seqs]
  T* out;                       // [tokens, heads, dim]
  int64_t max_blocks, block_size, heads, kv_heads, dim, window;  // window <= 0: none
  float scale;

  // Cache rows (all KV heads of a slot) of positions [first, first + n) of a sequence.
  void chunk_rows(const T* cache, int64_t seq, int64_t first, int64_t n, const T** rows) const {
    const int32_t* table = block_tables + seq * max_blocks;
    int64_t block = first / block_size, offset = first % block_size;
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = cache + (static_cast<int64_t>(table[block]) * block_size + offset) * kv_heads * dim;
      if (++offset == block_size) { offset = 0; ++block; }
    }
  }

  // Asks for the cache rows of positions [first, end) ahead of use, line by line in
  // address order: the loops read a chunk head by head (strided), which the hardware
  // prefetcher alone does not run ahead of.
  void prefetch(const T* cache, int64_t seq, int64_t first, int64_t end) const {
    const T* rows[CHUNK];
    const int64_t n = std::min<int64_t>(CHUNK, end - first);
    if (n <= 0) return;
    chunk_rows(cache, seq, first, n, rows);
    const int64_t bytes = kv_heads * dim * static_cast<int64_t>(sizeof(T));
    for (int64_t j = 0; j < n; ++j) {
      const char* row = reinterpret_cast<const char*>(rows[j]);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
    }
  }
};

// Per-thread buffers, reused across items.
struct Scratch {
  std::vector<float> q, scores, acc, keys, values, inv_sums, zeros;
};

// Which part of a sequence one item covers, and the key range it reads.
struct ItemGeometry {
  int64_t rows, first_token, first_pos, key_lo, key_hi, stride;

  template <typename T>
  ItemGeometry(const Problem<T>& p, const WorkItem& item) {
    const int64_t query_len = p.query_start[item.seq + 1] - p.query_start[item.seq];
    rows = item.num_queries * p.heads;  // row r: query token r / heads, head r % heads
    first_token = p.query_start[item.seq] + item.first_query;
    first_pos = p.seq_lens[item.seq] - query_len + item.first_query;
    key_lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
    key_hi = first_pos + item.num_queries;
    stride = (key_hi - key_lo + CHUNK - 1) / CHUNK * CHUNK;  // scores kept per row
  }

  // Visible keys of row r, relative to key_lo.
  template <typename T>
  std::pair<int64_t, int64_t> visible(const Problem<T>& p, int64_t r) const {
    const int64_t pos = first_pos + r / p.heads;
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    return {lo - key_lo, pos + 1 - key_lo};
  }
};

template <typename T>
void write_output(const Problem<T>& p, const ItemGeometry& g, const Scratch& s) {
  T* out = p.out + g.first_token * p.heads * p.dim;
  for (int64_t r = 0; r < g.rows; ++r) {
    const float inv = s.inv_sums[r];
    for (int64_t d = 0; d < p.dim; ++d) out[r * p.dim + d] = static_cast<T>(s.acc[r * p.dim + d] * inv);
  }
}

// ---------------------------------------------------------------------------------------------
// Portable path: plain loops.
template <typename T>
void run_item_portable(const Problem<T>& p, const WorkItem& item, Scratch& s) {
  const ItemGeometry g(p, item);
  const int64_t dim = p.dim, group = p.heads / p.kv_heads, row = p.kv_heads * dim;
  s.scores.assign(g.rows * g.stride, 0.0f);
  s.acc.assign(g.rows * dim, 0.0f);
  s.inv_sums.resize(g.rows);
  const T* rows[CHUNK];
  for (int64_t c = g.key_lo; c < g.key_hi; c += CHUNK) {
    const int64_t n = std::min<int64_t>(CHUNK, g.key_hi - c);
    p.chunk_rows(p.k_cache, item.seq, c, n, rows);
    for (int64_t r = 0; r < g.rows; ++r) {
      const T* q = p.query + (g.first_token * p.heads + r) * dim;
      const int64_t head_offset = (r % p.heads) / group * dim;
      for (int64_t j = 0; j < n; ++j) {
        float dot = 0.0f;
        for (int64_t d = 0; d < dim; ++d) dot += load_float(q + d) * load_float(rows[j] + head_offset + d);
        s.scores[r * g.stride + (c - g.key_lo) + j] = dot * p.scale;
      }
    }
  }
  for (int64_t r = 0; r < g.rows; ++r) {
    const auto [lo, hi] = g.visible(p, r);
    float* sr = s.scores.data() + r * g.stride;
    const float max_score = *std::max_element(sr + lo, sr + hi);
    float sum = 0.0f;
    for (int64_t k = lo; k < hi; ++k) sum += (sr[k] = std::exp(sr[k] - max_score));
    std::fill(sr, sr + lo, 0.0f);
    std::fill(sr + hi, sr + g.stride, 0.0f);
    s.inv_sums[r] = 1.0f / sum;
  }
  for (int64_t a = 0; a < PREFETCH_AHEAD; ++a) p.prefetch(p.v_cache, item.seq, g.key_lo + a * CHUNK, g.key_hi);
  for (int64_t c = g.key_lo; c < g.key_hi; c += CHUNK) {
    const int64_t n = std::min<int64_t>(CHUNK, g.key_hi - c);
    p.prefetch(p.v_cache, item.seq, c + PREFETCH_AHEAD * CHUNK, g.key_hi);
    p.chunk_rows(p.v_cache, item.seq, c, n, rows);
    for (int64_t r = 0; r < g.rows; ++r) {
      const int64_t head_offset = (r % p.heads) / group * dim;
      float* acc = s.acc.data() + r * dim;
      for (int64_t j = 0; j < n; ++j) {
        const float w = s.scores[r * g.stride + (c - g.key_lo) + j];
        if (w == 0.0f) continue;
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * load_float(rows[j] + head_offset + d);
      }
    }
  }
  (void)row;
  write_output(p, g, s);
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------
// AVX-512 path (float32 or bfloat16, head_dim a multiple of 16). K and V are read
// straight from the cache: scores of 16 positions come from 16 accumulators (FMA,
// or vdpbf16ps on bf16 pairs) and one transposing horizontal sum; values are
// widened in registers and added into register-resident accumulators of a few
// query rows at a time. Nothing is copied: staging K/V in a buffer turned out to
// be several times slower (the buffer's stores stall the cache loads).
constexpr int64_t SLICE = 16;  // floats per register

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
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

// exp(x) for x <= 0 (max-subtracted scores): 2^n * p(r) with a degree-6 polynomial.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.3981999507e-3f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073e-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894e-2f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201e-1f));
  poly = _mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(poly, n);
}

// out[j] = scale * (q . keys[j]) for the 16 keys of a chunk (a short chunk points its
// missing keys at a zero row: fixed-size loops unroll and keep all 16 accumulators in registers).
inline void score_chunk(const float* q, const float* const* keys, int64_t dim, float scale, float* out) {
  __m512 acc[CHUNK];
#pragma GCC unroll 16
  for (int j = 0; j < CHUNK; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
    for (int j = 0; j < CHUNK; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[j] + d), acc[j]);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(horizontal_sums(acc), _mm512_set1_ps(scale)));
}
#if defined(__AVX512BF16__)
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
#else
inline void score_chunk(const c10::BFloat16* q, const c10::BFloat16* const* keys, int64_t dim, float scale,
                        float* out) {
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
#endif

// acc[r][0 .. 16 NV) += sum_j w[r][j] * values[j] for ROWS rows sharing one KV head:
// each value register is widened once and used by every row.
template <int NV, int ROWS, typename T>
inline void weigh(const float* const* w, const T* const* values, float* const* acc) {
  __m512 a[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(acc[r] + v * SLICE);
#pragma GCC unroll 16
  for (int j = 0; j < CHUNK; ++j) {
    __m512 val[NV];
    for (int v = 0; v < NV; ++v) val[v] = load16(values[j] + v * SLICE);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 wj = _mm512_set1_ps(w[r][j]);
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_fmadd_ps(wj, val[v], a[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc[r] + v * SLICE, a[r][v]);
}

template <int ROWS, typename T>
void weigh_rows(const float* const* w, const T* const* values, int64_t dim, float* const* acc) {
  constexpr int WIDTH = ROWS >= 3 ? 4 : 8;  // registers per row: ROWS * WIDTH + WIDTH <= 32
  for (int64_t d = 0; d < dim; d += WIDTH * SLICE) {
    const T* vals[CHUNK];
    float* accs[ROWS];
    for (int64_t j = 0; j < CHUNK; ++j) vals[j] = values[j] + d;
    for (int r = 0; r < ROWS; ++r) accs[r] = acc[r] + d;
    switch (std::min<int64_t>(WIDTH, (dim - d) / SLICE)) {
      case 1: weigh<1, ROWS>(w, vals, accs); break;
      case 2: weigh<2, ROWS>(w, vals, accs); break;
      case 3: weigh<3, ROWS>(w, vals, accs); break;
      case 4: weigh<4, ROWS>(w, vals, accs); break;
      case 5: if constexpr (WIDTH > 4) { weigh<5, ROWS>(w, vals, accs); } break;
      case 6: if constexpr (WIDTH > 4) { weigh<6, ROWS>(w, vals, accs); } break;
      case 7: if constexpr (WIDTH > 4) { weigh<7, ROWS>(w, vals, accs); } break;
      default: if constexpr (WIDTH > 4) { weigh<WIDTH, ROWS>(w, vals, accs); } break;
    }
  }
}

template <typename T>
void run_item_avx512(const Problem<T>& p, const WorkItem& item, Scratch& s) {
  const ItemGeometry g(p, item);
  const int64_t dim = p.dim, group = p.heads / p.kv_heads;
  s.scores.resize(g.rows * g.stride);
  s.acc.assign(g.rows * dim, 0.0f);
  s.inv_sums.resize(g.rows);
  s.zeros.assign(dim, 0.0f);  // all-zero bits: a zero row in any dtype
  const T* zero_row = reinterpret_cast<const T*>(s.zeros.data());

  const T* rows[CHUNK];
  const T* head_rows[CHUNK];
  for (int64_t a = 0; a < PREFETCH_AHEAD; ++a) p.prefetch(p.k_cache, item.seq, g.key_lo + a * CHUNK, g.key_hi);
  for (int64_t c = g.key_lo; c < g.key_hi; c += CHUNK) {
    const int64_t n = std::min<int64_t>(CHUNK, g.key_hi - c);
    p.prefetch(p.k_cache, item.seq, c + PREFETCH_AHEAD * CHUNK, g.key_hi);
    p.chunk_rows(p.k_cache, item.seq, c, n, rows);
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      for (int64_t j = 0; j < CHUNK; ++j) head_rows[j] = j < n ? rows[j] + h * dim : zero_row;
      for (int64_t i = 0; i < item.num_queries; ++i)
        for (int64_t r = i * p.heads + h * group; r < i * p.heads + (h + 1) * group; ++r)
          score_chunk(p.query + (g.first_token * p.heads + r) * dim, head_rows, dim, p.scale,
                      s.scores.data() + r * g.stride + (c - g.key_lo));
    }
  }

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

  // Rows of one KV head, three at a time (the GQA group of a decode is often exactly that).
  std::vector<int64_t> head_rows_idx;
  for (int64_t a = 0; a < PREFETCH_AHEAD; ++a) p.prefetch(p.v_cache, item.seq, g.key_lo + a * CHUNK, g.key_hi);
  for (int64_t c = g.key_lo; c < g.key_hi; c += CHUNK) {
    const int64_t n = std::min<int64_t>(CHUNK, g.key_hi - c);
    p.prefetch(p.v_cache, item.seq, c + PREFETCH_AHEAD * CHUNK, g.key_hi);
    p.chunk_rows(p.v_cache, item.seq, c, n, rows);
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      for (int64_t j = 0; j < CHUNK; ++j) head_rows[j] = j < n ? rows[j] + h * dim : zero_row;
      head_rows_idx.clear();
      for (int64_t i = 0; i < item.num_queries; ++i)
        for (int64_t r = i * p.heads + h * group; r < i * p.heads + (h + 1) * group; ++r) head_rows_idx.push_back(r);
      for (size_t k = 0; k < head_rows_idx.size(); k += 3) {
        const int64_t count = std::min<int64_t>(3, head_rows_idx.size() - k);
        const float* w[3];
        float* acc[3];
        for (int64_t i = 0; i < count; ++i) {
          w[i] = s.scores.data() + head_rows_idx[k + i] * g.stride + (c - g.key_lo);
          acc[i] = s.acc.data() + head_rows_idx[k + i] * dim;
        }
        if (count == 3) weigh_rows<3>(w, head_rows, dim, acc);
        else if (count == 2) weigh_rows<2>(w, head_rows, dim, acc);
        else weigh_rows<1>(w, head_rows, dim, acc);
      }
    }
  }
  write_output(p, g, s);
}
constexpr bool kHaveAvx512 = true;
#else
template <typename T>
void run_item_avx512(const Problem<T>& p, const WorkItem& item, Scratch& s) { run_item_portable(p, item, s); }
constexpr bool kHaveAvx512 = false;
#endif

// Longest-processing-time-first assignment of items to threads.
std::vector<std::vector<WorkItem>> assign(std::vector<WorkItem> items, int64_t threads) {
  std::sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  std::vector<std::vector<WorkItem>> bins(threads);
  std::vector<int64_t> load(threads, 0);
  for (const WorkItem& item : items) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    bins[t].push_back(item);
    load[t] += item.cost;
  }
  return bins;
}

template <typename T>
void run(const Problem<T>& p, int64_t num_seqs) {
  const int64_t tile = std::max<int64_t>(1, TILE_ROWS / p.heads);
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = p.query_start[s + 1] - p.query_start[s];
    const int64_t seq_len = p.seq_lens[s];
    for (int64_t first = 0; first < query_len; first += tile) {
      const int64_t n = std::min<int64_t>(tile, query_len - first);
      int64_t keys = seq_len - query_len + first + n;
      if (p.window > 0) keys = std::min<int64_t>(keys, p.window + n - 1);
      items.push_back({s, first, n, (keys + 8) * (n * p.heads + 2 * p.kv_heads)});  // rows x keys + loads
    }
  }
  constexpr bool kVectorType = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
  const bool vector_path = kHaveAvx512 && kVectorType && p.dim % 16 == 0;
  int64_t total_cost = 0;
  for (const WorkItem& item : items) total_cost += item.cost;
  // Tiny batches run on the calling thread: waking the pool costs more than they do.
  const int64_t threads = total_cost < SERIAL_COST ? 1 : std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), items.size()));
  const auto bins = assign(std::move(items), threads);
  auto work = [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t t = begin; t < end; ++t)
      for (const WorkItem& item : bins[t]) {
        if constexpr (kVectorType) {
          if (vector_path) { run_item_avx512(p, item, scratch); continue; }
        }
        run_item_portable(p, item, scratch);
      }
  };
  if (threads == 1) work(0, 1);
  else at::parallel_for(0, threads, 1, work);
}

}  // namespace

void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens,
                     double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [tokens, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "tensors must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
              v_cache.scalar_type() == query.scalar_type(), "query, out and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && query_start.scalar_type() == torch::kInt32 &&
              seq_lens.scalar_type() == torch::kInt32, "metadata must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && query_start.is_contiguous() && seq_lens.is_contiguous(),
              "metadata must be contiguous");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), dim = query.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "metadata sizes differ");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    Problem<scalar_t> p{query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                        block_tables.data_ptr<int32_t>(), query_start.data_ptr<int32_t>(),
                        seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), block_tables.size(1),
                        k_cache.size(1), heads, kv_heads, dim, window, static_cast<float>(scale)};
    run(p, num_seqs);
  });
}
"""

FUNCTIONS = ["paged_attention"]
