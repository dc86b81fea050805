// Flash attention of many bfloat16 query rows on AMX tiles: 16 rows at a time over the paged K/V
// of one sequence and KV head, with an online softmax whose state (running max m, sum l and the
// float32 accumulator acc [row][dim]) the caller keeps, so a span can continue where another
// stopped. Used for prefill chunks (amx_prefill_attention.cpp) and the shared prefix of grouped
// decodes (shared_prefix_attention.cpp).
//
// Per 32 keys: scores^T [key][row] = K (16 keys x 32 dims, loaded from the cache as they lie) x
// Q^T (the rows' queries as pairs of dims, made once); the softmax runs with rows in lanes (no
// horizontal reductions) and a max that moves only by more than kSlack; the probabilities,
// transposed to [row][key pairs], multiply V as pairs of keys (interleaved once per 32 keys)
// and add to acc [row][dim] on the tiles. Tiles: 0-1 scores, 2 K, 3 Q; then 2 the
// probabilities, 0, 1 and 3 V; 4-7 acc. V is packed once for the whole span (it stays in L2),
// so each row block runs alone through it with its acc on tiles. Needs block_size % 16 == 0
// (16 keys never straddle blocks) and head_dim % 32 == 0. 8-bit float caches: K rows are widened
// to bfloat16 per 16 keys (amx_cache_rows.h) and V while it is packed.
#pragma once

#include "amx_cache_rows.h"
#include "amx_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDSERVE_AMX_ATTENTION 1
#include <memory>
#include <optional>

namespace {
namespace amx {

constexpr int64_t ROWS = 16;   // query rows of a tile
constexpr int64_t CHUNK = 32;  // keys per step
constexpr int64_t MAX_BLOCKS = 16;  // blocks of 16 rows attended together

// Flushes denormal results to zero (and reads denormals as zero) while alive. Masked scores
// make 2^-200 and the like; without FTZ every such vector takes a microcode assist that costs
// more than the whole softmax of a chunk.
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// Per-thread scratch of one row block.
struct Scratch {
  alignas(64) float scores[CHUNK * ROWS];  // [key][row]
  alignas(64) uint32_t probs[ROWS * 16];   // [row][key pair], bfloat16 pairs
  // Per 32 keys [dim / 16][16 key pairs][16 dims] of bfloat16 pairs; attend_rows sizes it.
  std::vector<uint32_t> values;
  std::vector<uint32_t> member_probs;       // attend_members: [member][row][key pair]
  std::vector<c10::BFloat16> padded_keys;  // attend_members: a partial group of 16 K rows
  std::vector<c10::BFloat16> keys;         // attend_rows over an 8-bit cache: 32 widened K rows
};

// The B tiles of 16 rows' queries: qt[c][pair][row] (dim / 32 tiles), from rows of bfloat16
// (row pointers; rows past n or null are zero).
inline void pack_queries(const c10::BFloat16* const* rows, int64_t n, int64_t dim, uint32_t* qt) {
  for (int64_t c = 0; c < dim / 32; ++c) {
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = i < n && rows[i] != nullptr ? _mm512_loadu_si512(rows[i] + c * 32) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(qt + (c * 16 + p) * 16, r[p]);
  }
}

// GCC's tile intrinsics take literal tile numbers, hence a macro: tile C = probabilities (tile 2)
// x V's pairs of group `group` (loaded into tile B), added to acc's 16 dims of that group.
#define PAGEDSERVE_PRODUCT_TILE(C, B, values, acc, dim, group) \
  do {                                                         \
    _tile_loadd(C, (acc) + (group) * 16, (dim) * 4);           \
    _tile_loadd(B, (values) + (group) * 256, 64);              \
    _tile_dpbf16ps(C, 2, B);                                   \
    _tile_stored(C, (acc) + (group) * 16, (dim) * 4);          \
  } while (0)

// Interleaves the words of two vectors a (words 0-15) and b (16-31): dword n = (a[n], b[n]).
inline __m512i pair_index() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                          19, 3, 18, 2, 17, 1, 16, 0);
}

// V's 32 positions from `first` as pairs of keys: values[g][pair][dim 16g + j] =
// (V[2 pair][.], V[2 pair + 1][.]); positions at or past hi are zeros.
template <typename ValueAt>
inline void pack_values(ValueAt&& value_rows, int64_t stride, int64_t first, int64_t hi, int64_t dim, uint32_t* values) {
  for (int64_t half = 0; half < 2; ++half) {
    const auto* v = first + half * 16 < hi ? value_rows(first + half * 16) : nullptr;
    for (int64_t p = 0; p < 8; ++p) {
      const int64_t pos = first + half * 16 + 2 * p;
      const __mmask16 a_ok = v != nullptr && pos < hi ? 0xFFFF : 0, b_ok = v != nullptr && pos + 1 < hi ? 0xFFFF : 0;
      for (int64_t g = 0; g < dim / 16; ++g) {
        const __m256i a = bf16x16(a_ok, a_ok ? v + (2 * p) * stride + g * 16 : nullptr);
        const __m256i b = bf16x16(b_ok, b_ok ? v + (2 * p + 1) * stride + g * 16 : nullptr);
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(values + (g * 16 + half * 8 + p) * 16, _mm512_permutexvar_epi16(pair_index(), ab));
      }
    }
  }
}

// Tiles 4.. hold acc's 16 dims a tile (OP: _tile_loadd or _tile_stored; dim <= 64).
#define PAGEDSERVE_ACC_TILES(OP, acc, dim)                 \
  do {                                                     \
    OP(4, (acc), (dim) * 4);                               \
    if ((dim) > 16) OP(5, (acc) + 16, (dim) * 4);          \
    if ((dim) > 32) OP(6, (acc) + 32, (dim) * 4);          \
    if ((dim) > 48) OP(7, (acc) + 48, (dim) * 4);          \
  } while (0)

// The online softmax of one chunk of one block of 16 rows, on the raw scores^T [key][row] in
// s.scores (`keys` of them from position `first`; the scale joins the exponent). Positions
// outside [lo, bhi) or at or past a row's limit get -inf (all of them are visible when
// `all_visible`). Updates the block's m and l, rescales its acc (on tiles 4-7 when `resident`)
// and leaves the probabilities as bfloat16 pairs [row][key pair] in `pairs`.
inline void softmax_chunk(Scratch& s, int64_t keys, int64_t first, int64_t lo, int64_t bhi, bool all_visible,
                          __m512i limits, float scale, float* m, float* l, float* block_acc, int64_t dim,
                          bool resident, __m512i* pairs) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  constexpr float kSlack = 8.0f;  // how far a row's max may run ahead of m before m moves
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), to_log2 = _mm512_set1_ps(scale * 1.44269504088896341f);
  float* scores = s.scores;
  __m512 chunk_max = minus_inf;
  if (all_visible) {
    for (int64_t k = 0; k < keys; ++k) chunk_max = _mm512_max_ps(chunk_max, _mm512_load_ps(scores + k * 16));
  } else {
    for (int64_t k = 0; k < keys; ++k) {
      const int64_t pos = first + k;
      const __mmask16 valid = pos >= lo && pos < bhi ? _mm512_cmpgt_epi32_mask(limits, _mm512_set1_epi32(pos)) : 0;
      const __m512 x = _mm512_mask_load_ps(minus_inf, valid, scores + k * 16);
      _mm512_store_ps(scores + k * 16, x);
      chunk_max = _mm512_max_ps(chunk_max, x);
    }
  }
  // The running max m (of scaled scores) moves only when a row's new scores pass it by more
  // than kSlack, so most steps rescale nothing: probabilities relative to a stale max stay
  // below e^kSlack, and acc and l share the same base.
  const __m512 mv = _mm512_loadu_ps(m);
  const __m512 scaled_max = _mm512_mul_ps(chunk_max, _mm512_set1_ps(scale));
  const __mmask16 grow = _mm512_cmp_ps_mask(scaled_max, _mm512_add_ps(mv, _mm512_set1_ps(kSlack)), _CMP_GT_OQ);
  const __m512 new_max = _mm512_mask_mov_ps(mv, grow, scaled_max);
  // Rows that have seen nothing yet keep -inf: base 0 there (their probabilities are 0).
  const __m512 base =
      _mm512_mask_mov_ps(new_max, _mm512_cmp_ps_mask(new_max, minus_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
  const __m512 offset = _mm512_mul_ps(base, log2e);  // p = 2^(x * scale * log2e - offset)
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < CHUNK; k += 2) {
    __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
    if (k < keys) {
      p0 = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(scores + k * 16), to_log2, offset));
      p1 = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(scores + (k + 1) * 16), to_log2, offset));
    }
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 in words 0-15, p1 in 16-31
    pairs[k / 2] = _mm512_permutexvar_epi16(pair_index(), both);  // dword lane n: (p0[n], p1[n])
    // The sum takes the probabilities as rounded, as the product with V does.
    sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(pairs[k / 2], 16)),
                                           _mm512_castsi512_ps(_mm512_and_si512(pairs[k / 2],
                                                                                _mm512_set1_epi32(-65536)))));
  }
  // Rows whose max moved after they had seen something scale their sum and acc down.
  const __mmask16 rescale = grow & _mm512_cmp_ps_mask(mv, minus_inf, _CMP_NEQ_OQ);
  const __m512 correction = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(mv, base), log2e));
  const __m512 lv = _mm512_loadu_ps(l);
  _mm512_storeu_ps(l, _mm512_add_ps(_mm512_mask_mul_ps(lv, rescale, lv, correction), sum));
  _mm512_storeu_ps(m, new_max);
  if (rescale) {
    if (resident) PAGEDSERVE_ACC_TILES(_tile_stored, block_acc, dim);
    alignas(64) float corr[16];
    _mm512_store_ps(corr, correction);
    for (uint32_t bits = rescale; bits != 0; bits &= bits - 1) {
      const int r = __builtin_ctz(bits);
      const __m512 f = _mm512_set1_ps(corr[r]);
      float* a = block_acc + r * dim;
      for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), f));
    }
    if (resident) PAGEDSERVE_ACC_TILES(_tile_loadd, block_acc, dim);
  }
  transpose16(pairs);  // [row][key pair]
}

// acc += the probabilities in `probs` ([row][key pair], loaded into tile 2) x one chunk of packed
// V, 16 dims a tile (V in tiles 0, 1 and 3 by turns); on tiles 4-7 when `resident`.
inline void add_product(const uint32_t* probs, const uint32_t* values, float* block_acc, int64_t dim, bool resident) {
  _tile_loadd(2, probs, 64);
  if (resident) {
    _tile_loadd(0, values, 64);
    _tile_dpbf16ps(4, 2, 0);
    if (dim > 16) {
      _tile_loadd(1, values + 256, 64);
      _tile_dpbf16ps(5, 2, 1);
    }
    if (dim > 32) {
      _tile_loadd(3, values + 512, 64);
      _tile_dpbf16ps(6, 2, 3);
    }
    if (dim > 48) {
      _tile_loadd(0, values + 768, 64);
      _tile_dpbf16ps(7, 2, 0);
    }
    return;
  }
  for (int64_t g = 0; g < dim / 16; g += 4) {
    const int64_t n = std::min<int64_t>(4, dim / 16 - g);
    PAGEDSERVE_PRODUCT_TILE(4, 0, values, block_acc, dim, g);
    if (n > 1) PAGEDSERVE_PRODUCT_TILE(5, 1, values, block_acc, dim, g + 1);
    if (n > 2) PAGEDSERVE_PRODUCT_TILE(6, 3, values, block_acc, dim, g + 2);
    if (n > 3) PAGEDSERVE_PRODUCT_TILE(7, 0, values, block_acc, dim, g + 3);
  }
}

// Per block of 16 rows (rows with limit 0 are padding): the end of what any row sees, and of
// what every used row sees, within hi.
inline void block_bounds(const int32_t* limit, int64_t hi, int64_t* block_hi, int64_t* block_min) {
  const __m512i limits = _mm512_loadu_si512(limit);
  const __mmask16 rows = _mm512_cmpgt_epi32_mask(limits, _mm512_setzero_si512());
  *block_hi = std::min<int64_t>(hi, _mm512_reduce_max_epi32(limits));
  *block_min = std::min<int64_t>(hi, _mm512_mask_reduce_min_epi32(rows, limits));
}

// Packs V's positions [start, hi) of one sequence into `values`, 32 positions a chunk.
template <typename ValueAt>
inline void pack_span(ValueAt&& value_rows, int64_t stride, int64_t start, int64_t hi, int64_t dim,
                      uint32_t* values) {
  for (int64_t first = start, c = 0; first < hi; first += CHUNK, ++c)
    pack_values(value_rows, stride, first, hi, dim, values + c * dim * 16);
}

// Continues `blocks` blocks of 16 rows (queries packed by pack_queries: qt + b * dim * 8 for
// block b) over positions [lo, hi) of one sequence's K/V: `key_rows(pos)` points at the K row
// of position pos (rows of 16 aligned positions lie `stride` elements apart), `value_rows`
// likewise. Row r sees positions below limit[r]. m, l [blocks * 16] and acc [blocks * 16][dim]
// carry the state (acc holds all 16 rows of every block, padding rows included; m may trail a
// row's true max, acc and l are relative to it); scores are scaled by `scale` in float32.
// V is packed once for all the blocks; a block's acc stays on tiles 4-7 while it runs
// (head_dim <= 64; wider heads load and store it every 32 positions).
template <typename KeyAt, typename ValueAt>
void attend_rows(const uint32_t* qt, int64_t blocks, int64_t dim, KeyAt&& key_rows, ValueAt&& value_rows,
                 int64_t stride, int64_t lo, int64_t hi, const int32_t* limit, float scale, float* m, float* l,
                 float* acc, Scratch& s) {
  int64_t block_hi[MAX_BLOCKS], block_min[MAX_BLOCKS];
  int64_t all_hi = lo;
  for (int64_t b = 0; b < blocks; ++b) {
    block_bounds(limit + b * 16, hi, &block_hi[b], &block_min[b]);
    all_hi = std::max(all_hi, block_hi[b]);
  }
  const int64_t start = lo / 16 * 16;
  if (all_hi <= start) return;
  const FlushDenormals flush;
  const int64_t row_bytes = stride * 2, chunk_words = dim * 16;  // one chunk's packed V
  const int64_t chunks = (all_hi - start + CHUNK - 1) / CHUNK;
  if (static_cast<int64_t>(s.values.size()) < chunks * chunk_words) s.values.resize(chunks * chunk_words);
  pack_span(value_rows, stride, start, all_hi, dim, s.values.data());
  const bool resident = dim <= 64;
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(key_rows(lo))>>;
  constexpr bool widen = !std::is_same_v<T, c10::BFloat16>;  // an 8-bit cache's K rows
  if (widen && static_cast<int64_t>(s.keys.size()) < 32 * dim) s.keys.resize(32 * dim);
  const int64_t key_bytes = widen ? dim * 2 : row_bytes;
  __m512i pairs[16];
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t bhi = block_hi[b];
    if (bhi <= start) continue;  // this block's rows see none of the span
    const uint32_t* q = qt + b * dim * 8;
    float* block_acc = acc + b * 16 * dim;
    const __m512i limits = _mm512_loadu_si512(limit + b * 16);
    if (resident) PAGEDSERVE_ACC_TILES(_tile_loadd, block_acc, dim);
    for (int64_t first = start; first < bhi; first += CHUNK) {
      const bool second = first + 16 < bhi;  // the second 16 keys are visible to some row
      const c10::BFloat16 *k0, *k1 = nullptr;
      if constexpr (widen) {
        k0 = s.keys.data(), k1 = k0 + 16 * dim;
        widen_rows(key_rows(first), stride, std::min<int64_t>(16, bhi - first), dim, s.keys.data());
        if (second)
          widen_rows(key_rows(first + 16), stride, std::min<int64_t>(16, bhi - first - 16), dim, s.keys.data() + 16 * dim);
      } else {
        k0 = key_rows(first);
        if (second) k1 = key_rows(first + 16);
      }
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = 0; c < dim / 32; ++c) {
        _tile_loadd(3, q + c * 256, 64);
        _tile_loadd(2, k0 + c * 32, key_bytes);
        _tile_dpbf16ps(0, 2, 3);
        if (second) {
          _tile_loadd(2, k1 + c * 32, key_bytes);
          _tile_dpbf16ps(1, 2, 3);
        }
      }
      _tile_stored(0, s.scores, 64);
      if (second) _tile_stored(1, s.scores + 256, 64);
      const int64_t keys = second ? CHUNK : 16;
      softmax_chunk(s, keys, first, lo, bhi, first >= lo && first + keys <= block_min[b], limits, scale, m + b * 16,
                    l + b * 16, block_acc, dim, resident, pairs);
      for (int r = 0; r < 16; ++r) _mm512_store_si512(s.probs + r * 16, pairs[r]);
      add_product(s.probs, s.values.data() + (first - start) / CHUNK * chunk_words, block_acc, dim, resident);
    }
    if (resident) PAGEDSERVE_ACC_TILES(_tile_stored, block_acc, dim);
  }
}

}  // namespace amx
}  // namespace
#endif
