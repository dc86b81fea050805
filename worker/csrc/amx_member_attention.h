// Decodes' own positions on AMX tiles, several sequences in one block of 16 rows (attend_members):
// after a shared prefix (shared_prefix_attention.cpp) each decode has gq query rows per KV head
// and its own K/V, so one sequence alone would leave most of a tile's rows idle and run its own
// softmax for a few lanes. Built on the core of amx_attention.h (softmax_chunk, add_product).
#pragma once

#include "amx_attention.h"

#if defined(PAGEDSERVE_AMX_ATTENTION)
namespace {
namespace amx {

// The own positions of several sequences in one block of 16 rows: member j has rows
// [j * gq, (j + 1) * gq) and its own K/V (`key_rows(j, pos)`, `value_rows(j, pos)`) over
// [lo, hi[j]). qt + j * dim * 8 holds member j's packed queries with every other row zero, so
// the members' score products add up in one tile, each row scoring its own member's keys; the
// softmax then runs once for all of them, and each member's probabilities (its rows only)
// multiply its own V. limit, m, l and acc [16][dim] as in attend_rows (one block). Beside the
// per-member softmax, this saves the idle rows: a decode has only gq rows per KV head.
template <typename KeyAt, typename ValueAt>
void attend_members(const uint32_t* qt, int64_t members, int64_t gq, int64_t dim, KeyAt&& key_rows,
                    ValueAt&& value_rows, int64_t stride, int64_t lo, const int64_t* hi, const int32_t* limit,
                    float scale, float* m, float* l, float* acc, Scratch& s) {
  int64_t bhi = lo, bmin = lo;
  block_bounds(limit, std::numeric_limits<int32_t>::max(), &bhi, &bmin);
  const int64_t start = lo / 16 * 16;
  if (bhi <= start) return;
  const FlushDenormals flush;
  const int64_t row_bytes = stride * 2, chunk_words = dim * 16;
  const int64_t chunks = (bhi - start + CHUNK - 1) / CHUNK, member_words = chunks * chunk_words;
  if (static_cast<int64_t>(s.values.size()) < members * member_words) s.values.resize(members * member_words);
  // Each member's probabilities: its own rows, the others zero (written once here).
  s.member_probs.assign(members * ROWS * 16, 0u);
  s.padded_keys.assign(ROWS * dim, c10::BFloat16());
  for (int64_t j = 0; j < members; ++j)
    pack_span([&](int64_t pos) { return value_rows(j, pos); }, stride, start, hi[j], dim,
              s.values.data() + j * member_words);
  const bool resident = dim <= 64;
  const __m512i limits = _mm512_loadu_si512(limit);
  // K rows of 16 positions from `first` for member j; past its end they would be another
  // sequence's (or stale) values, which the zero query rows of other members could not cancel
  // if they were not finite, so a partial group is copied beside zeros.
  // An 8-bit cache's K rows are always widened there.
  auto keys_at = [&](int64_t j, int64_t first) -> std::pair<const c10::BFloat16*, int64_t> {
    const auto* k = key_rows(j, first);
    if constexpr (std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(k)>>, c10::BFloat16>)
      if (first + 16 <= hi[j]) return {k, row_bytes};
    widen_rows(k, stride, std::min<int64_t>(16, hi[j] - first), dim, s.padded_keys.data());
    return {s.padded_keys.data(), dim * 2};
  };
  __m512i pairs[16];
  if (resident) PAGEDSERVE_ACC_TILES(_tile_loadd, acc, dim);
  for (int64_t first = start; first < bhi; first += CHUNK) {
    const bool second = first + 16 < bhi;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t j = 0; j < members; ++j) {
      const uint32_t* q = qt + j * dim * 8;
      for (int half = 0; half < 2; ++half) {
        const int64_t from = first + half * 16;
        if (from >= hi[j]) break;
        const auto [k, bytes] = keys_at(j, from);
        for (int64_t c = 0; c < dim / 32; ++c) {
          _tile_loadd(3, q + c * 256, 64);
          _tile_loadd(2, k + c * 32, bytes);
          if (half == 0)
            _tile_dpbf16ps(0, 2, 3);
          else
            _tile_dpbf16ps(1, 2, 3);
        }
      }
    }
    _tile_stored(0, s.scores, 64);
    if (second) _tile_stored(1, s.scores + 256, 64);
    const int64_t keys = second ? CHUNK : 16;
    softmax_chunk(s, keys, first, lo, bhi, first >= lo && first + keys <= bmin, limits, scale, m, l, acc, dim,
                  resident, pairs);
    const int64_t chunk = (first - start) / CHUNK;
    for (int64_t j = 0; j < members; ++j) {
      if (first >= hi[j]) continue;
      uint32_t* probs = s.member_probs.data() + j * ROWS * 16;
      for (int64_t r = j * gq; r < (j + 1) * gq; ++r) _mm512_storeu_si512(probs + r * 16, pairs[r]);
      add_product(probs, s.values.data() + j * member_words + chunk * chunk_words, acc, dim, resident);
    }
  }
  if (resident) PAGEDSERVE_ACC_TILES(_tile_stored, acc, dim);
}

}  // namespace amx
}  // namespace
#endif
