// Prefill scoring of bfloat16 (and 8-bit float) caches on AVX512-BF16 (head_dim a multiple of 32, at least
// TRANSPOSED_MIN_ROWS query rows per KV head): run_item_transposed with vdpbf16ps, kt register p
// holding dims 2p and 2p + 1 of the 16 keys, so no horizontal sums. The values keep the float32
// FMA path (`weigh_values`): weighing them on vdpbf16ps would need the probabilities rounded to
// bfloat16, which moved greedy first tokens away from float32's too often. Decode items keep
// `score_chunk`.
#pragma once

#include "attention_transposed.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------
// bfloat16 on vdpbf16ps (see the top of this file): kt register p holds dims 2p and 2p + 1 of
// the 16 keys (transpose_dwords of the bf16 pairs).

// A score step on vdpbf16ps: the broadcast pair of query dims 2p, 2p + 1 times kt row p.
struct Bf16Dot {
  using Unit = uint32_t;
  static inline __m512 madd(__m512 acc, uint32_t q, __m512 k) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(q)), (__m512bh)k);
  }
};

// bfloat16 queries over a bfloat16 cache, or over an 8-bit one (its keys widened to bf16 pairs exactly).
template <typename T>
void run_item_bf16(const Problem<c10::BFloat16, T>& p, const WorkItem& item, Scratch& s) {
  run_item_transposed<c10::BFloat16, T, Bf16Dot>(p, item, s, p.dim / 2);
}
constexpr bool kHaveBf16Path = true;
#else
template <typename T>
void run_item_bf16(const Problem<c10::BFloat16, T>& p, const WorkItem& item, Scratch& s) {
  run_item_avx512(p, item, s, nullptr, false);
}
constexpr bool kHaveBf16Path = false;
#endif

}  // namespace
