// Flash attention of many bfloat16 query rows on AMX tiles: 16 rows at a time over the paged K/V
// of one sequence and KV head, with an online softmax whose state (running max m, sum l and the
// float32 accumulator acc [row][dim]) the caller keeps, so a span can continue where another
// stopped. Used for prefill chunks (amx_prefill_attention.cpp) and the shared prefix of grouped
// decodes (shared_prefix_attention.cpp).
//
// Per 32 keys: scores^T [key][row] = K (16 keys x 32 dims, loaded from the cache as they lie) x
// Q^T (the rows' queries as pairs of dims, made once); the softmax runs with rows in lanes (no
// horizontal reductions); the probabilities, transposed to [row][key pairs], multiply V as
// pairs of keys (interleaved once per 32 keys) into [row][dim]. Tiles: 0-1 scores, 2 A, 3 B,
// 4-7 the product with V. Needs block_size % 16 == 0 (16 keys never straddle blocks) and
// head_dim % 32 == 0.
#pragma once

#include "vector_helpers.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDSERVE_AMX_ATTENTION 1
#include <sys/syscall.h>
#include <memory>
#include <optional>
#include <unistd.h>

namespace {
namespace amx {

constexpr int64_t ROWS = 16;   // query rows of a tile
constexpr int64_t CHUNK = 32;  // keys per step
constexpr int64_t MAX_BLOCKS = 4;  // blocks of 16 rows attended together

// Linux hands out the AMX tile state only on request (once per process).
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures eight 16 x 64-byte tiles for this thread while alive (other code, oneDNN's
// included, configures its own, so every call sets ours again).
struct TileScope {
  TileScope() {
    TileConfig config;
    for (int i = 0; i < 8; ++i) {
      config.colsb[i] = 64;
      config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
};

// Per-thread scratch of one row block.
struct Scratch {
  alignas(64) float scores[CHUNK * ROWS];  // [key][row]
  alignas(64) uint32_t probs[ROWS * 16];   // [row][key pair], bfloat16 pairs
  std::vector<uint32_t> values;            // [dim / 16][16 key pairs][16 dims] of bfloat16 pairs
  std::vector<float> product;              // [row][dim]
  void reserve(int64_t dim) {
    values.resize(dim / 16 * 256);
    product.resize(ROWS * dim);
  }
};

// The B tiles of 16 rows' queries: qt[c][pair][row] (dim / 32 tiles), from rows of bfloat16
// (row pointers; missing rows are zero).
inline void pack_queries(const c10::BFloat16* const* rows, int64_t n, int64_t dim, uint32_t* qt) {
  for (int64_t c = 0; c < dim / 32; ++c) {
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = i < n ? _mm512_loadu_si512(rows[i] + c * 32) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(qt + (c * 16 + p) * 16, r[p]);
  }
}

// GCC's tile intrinsics take literal tile numbers, hence a macro: tile C = probabilities (tile 2)
// x V's pairs of group `group` (loaded into tile 3), stored into the product's 16 dims.
#define PAGEDSERVE_PRODUCT_TILE(C, values, product, dim, group) \
  do {                                                          \
    _tile_zero(C);                                              \
    _tile_loadd(3, (values) + (group) * 256, 64);               \
    _tile_dpbf16ps(C, 2, 3);                                    \
    _tile_stored(C, (product) + (group) * 16, (dim) * 4);       \
  } while (0)

// V's 32 positions from `first` as pairs of keys: values[g][pair][dim 16g + j] =
// (V[2 pair][.], V[2 pair + 1][.]); positions at or past hi are zeros.
template <typename ValueAt>
inline void pack_values(ValueAt&& value_rows, int64_t stride, int64_t first, int64_t hi, int64_t dim, uint32_t* values,
                        __m512i pair_index) {
  for (int64_t half = 0; half < 2; ++half) {
    const c10::BFloat16* v = first + half * 16 < hi ? value_rows(first + half * 16) : nullptr;
    for (int64_t p = 0; p < 8; ++p) {
      const int64_t pos = first + half * 16 + 2 * p;
      const __mmask16 a_ok = v != nullptr && pos < hi ? 0xFFFF : 0, b_ok = v != nullptr && pos + 1 < hi ? 0xFFFF : 0;
      for (int64_t g = 0; g < dim / 16; ++g) {
        const __m256i a = _mm256_maskz_loadu_epi16(a_ok, a_ok ? v + (2 * p) * stride + g * 16 : nullptr);
        const __m256i b = _mm256_maskz_loadu_epi16(b_ok, b_ok ? v + (2 * p + 1) * stride + g * 16 : nullptr);
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(values + (g * 16 + half * 8 + p) * 16, _mm512_permutexvar_epi16(pair_index, ab));
      }
    }
  }
}

// Continues `blocks` blocks of 16 rows (queries packed by pack_queries: qt + b * dim * 8 for
// block b) over positions [lo, hi) of one sequence's K/V: `key_rows(pos)` points at the K row
// of position pos (rows of 16 aligned positions lie `stride` elements apart), `value_rows`
// likewise. Row r sees positions below limit[r]. m, l [blocks * 16] and acc [blocks * 16][dim]
// carry the state; scores are scaled by `scale` in float32. Each 32 positions' V is packed once
// for all the blocks.
template <typename KeyAt, typename ValueAt>
void attend_rows(const uint32_t* qt, int64_t blocks, int64_t dim, KeyAt&& key_rows, ValueAt&& value_rows,
                 int64_t stride, int64_t lo, int64_t hi, const int32_t* limit, float scale, float* m, float* l,
                 float* acc, Scratch& s) {
  // Per block: the end of what any row sees, and of what every used row sees (rows with
  // limit 0 are padding).
  int64_t block_hi[MAX_BLOCKS], block_min[MAX_BLOCKS], used[MAX_BLOCKS];
  int64_t all_hi = lo;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512i limits = _mm512_loadu_si512(limit + b * 16);
    const __mmask16 rows = _mm512_cmpgt_epi32_mask(limits, _mm512_setzero_si512());
    block_hi[b] = std::min<int64_t>(hi, _mm512_reduce_max_epi32(limits));
    block_min[b] = std::min<int64_t>(hi, _mm512_mask_reduce_min_epi32(rows, limits));
    used[b] = 32 - __builtin_clz(static_cast<uint32_t>(rows) | 1u);  // rows up to the last used one
    all_hi = std::max(all_hi, block_hi[b]);
  }
  const int64_t row_bytes = stride * 2;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i pair_index = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t first = lo / 16 * 16; first < all_hi; first += CHUNK) {
    pack_values(value_rows, stride, first, all_hi, dim, s.values.data(), pair_index);
    const c10::BFloat16* k0 = key_rows(first);
    const c10::BFloat16* k1 = first + 16 < all_hi ? key_rows(first + 16) : nullptr;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t bhi = block_hi[b];
      if (first >= bhi) continue;  // nothing of these positions is visible to this block's rows
      const bool second = first + 16 < bhi;
      const uint32_t* q = qt + b * dim * 8;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = 0; c < dim / 32; ++c) {
        _tile_loadd(3, q + c * 256, 64);
        _tile_loadd(2, k0 + c * 32, row_bytes);
        _tile_dpbf16ps(0, 2, 3);
        if (second) {
          _tile_loadd(2, k1 + c * 32, row_bytes);
          _tile_dpbf16ps(1, 2, 3);
        }
      }
      _tile_stored(0, s.scores, 64);
      if (second) _tile_stored(1, s.scores + 256, 64);
      // Online softmax, rows in lanes: positions outside [lo, hi) or past a row's limit get -inf.
      const __m512i limits = _mm512_loadu_si512(limit + b * 16);
      const int64_t keys = second ? CHUNK : 16;
      __m512 chunk_max = minus_inf;
      const __m512 scales = _mm512_set1_ps(scale);
      if (first >= lo && first + keys <= block_min[b]) {  // every row sees all of these positions
        for (int64_t k = 0; k < keys; ++k) {
          const __m512 x = _mm512_mul_ps(_mm512_load_ps(s.scores + k * 16), scales);
          _mm512_store_ps(s.scores + k * 16, x);
          chunk_max = _mm512_max_ps(chunk_max, x);
        }
      } else {
        for (int64_t k = 0; k < keys; ++k) {
          const int64_t pos = first + k;
          const __mmask16 valid =
              pos >= lo && pos < bhi ? _mm512_cmpgt_epi32_mask(limits, _mm512_set1_epi32(pos)) : 0;
          const __m512 x = _mm512_mask_mul_ps(minus_inf, valid, _mm512_load_ps(s.scores + k * 16), scales);
          _mm512_store_ps(s.scores + k * 16, x);
          chunk_max = _mm512_max_ps(chunk_max, x);
        }
      }
      const __m512 mv = _mm512_loadu_ps(m + b * 16);
      const __m512 new_max = _mm512_max_ps(mv, chunk_max);
      // Rows that have seen nothing yet keep -inf: subtract 0 there (exp(-inf) = 0, never NaN).
      const __m512 base = _mm512_mask_mov_ps(new_max, _mm512_cmp_ps_mask(new_max, minus_inf, _CMP_EQ_OQ),
                                             _mm512_setzero_ps());
      const __m512 correction = exp_ps(_mm512_sub_ps(mv, base));
      __m512 sum = _mm512_setzero_ps();
      __m512i pairs[16];
      for (int64_t k = 0; k < CHUNK; k += 2) {
        __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
        if (k < keys) {
          const __m512 x0 = _mm512_load_ps(s.scores + k * 16), x1 = _mm512_load_ps(s.scores + (k + 1) * 16);
          p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, minus_inf, _CMP_NEQ_OQ), exp_ps(_mm512_sub_ps(x0, base)));
          p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1, minus_inf, _CMP_NEQ_OQ), exp_ps(_mm512_sub_ps(x1, base)));
        }
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 in words 0-15, p1 in 16-31
        pairs[k / 2] = _mm512_permutexvar_epi16(pair_index, both);  // dword lane n: (p0[n], p1[n])
        // The sum takes the probabilities as rounded, as the product with V does.
        sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(pairs[k / 2], 16)),
                                               _mm512_castsi512_ps(_mm512_and_si512(pairs[k / 2],
                                                                                    _mm512_set1_epi32(-65536)))));
      }
      _mm512_storeu_ps(l + b * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + b * 16), correction, sum));
      _mm512_storeu_ps(m + b * 16, new_max);
      transpose16(pairs);  // [row][key pair]
      for (int r = 0; r < 16; ++r) _mm512_store_si512(s.probs + r * 16, pairs[r]);
      _tile_loadd(2, s.probs, 64);
      const int64_t groups = dim / 16;
      for (int64_t g = 0; g < groups; g += 4) {
        const int64_t n = std::min<int64_t>(4, groups - g);
        PAGEDSERVE_PRODUCT_TILE(4, s.values.data(), s.product.data(), dim, g);
        if (n > 1) PAGEDSERVE_PRODUCT_TILE(5, s.values.data(), s.product.data(), dim, g + 1);
        if (n > 2) PAGEDSERVE_PRODUCT_TILE(6, s.values.data(), s.product.data(), dim, g + 2);
        if (n > 3) PAGEDSERVE_PRODUCT_TILE(7, s.values.data(), s.product.data(), dim, g + 3);
      }
      alignas(64) float corr[16];
      _mm512_store_ps(corr, correction);
      float* block_acc = acc + b * 16 * dim;
      for (int64_t r = 0; r < used[b]; ++r) {
        const __m512 f = _mm512_set1_ps(corr[r]);
        float* a = block_acc + r * dim;
        const float* pv = s.product.data() + r * dim;
        for (int64_t d = 0; d < dim; d += 16)
          _mm512_storeu_ps(a + d, _mm512_fmadd_ps(_mm512_loadu_ps(a + d), f, _mm512_loadu_ps(pv + d)));
      }
    }
  }
}

}  // namespace amx
}  // namespace
#endif
