"""The AVX512-BF16 scoring of the CPU paged attention kernel's C++ source (see
`worker.attention.cpu_attention_source`, which puts the pieces together).

Prefill items over bfloat16 caches (head_dim a multiple of 32, at least
TRANSPOSED_MIN_ROWS query rows per KV head) on CPUs with AVX512-BF16 compute their
scores on `vdpbf16ps` without horizontal sums (`cpu_attention_transposed`): the 16 keys of a chunk are
transposed once per KV head into key lanes (register p holds dims 2p and
2p+1 of every key), and every query row of that head then adds the products
of its broadcast dims 2p, 2p+1 into one register of 16 scores. One transpose
serves all the rows of the head (24 in a SmolLM2 tile). The prefill
micro-benchmark (4,096 tokens of prompts of 256-512) went from 15-16 to
12-13 ms a layer. Decode items, bound by memory and with three rows per
head, keep `score_chunk`.

The values keep the float32 FMA path (`weigh_values`). Interleaving them in
pairs of keys for `vdpbf16ps` made prefill attention another 20 % faster
(10.6 ms), but needs the probabilities rounded to bfloat16 (as PyTorch's CPU
flash attention does), and that flipped 2 more of 128 random-prompt first
tokens away from float32's (122 against 124 of 128), too close to the
95 % bar that issue 5 sets.
"""

BF16_PATH = r"""
#if defined(__AVX512F__) && defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------
// bfloat16 on vdpbf16ps (see cpu_attention_bf16.py): kt register p holds dims 2p and 2p + 1 of
// the 16 keys (transpose_dwords of the bf16 pairs).

// A score step on vdpbf16ps: the broadcast pair of query dims 2p, 2p + 1 times kt row p.
struct Bf16Dot {
  using Unit = uint32_t;
  static inline __m512 madd(__m512 acc, uint32_t q, __m512 k) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(q)), (__m512bh)k);
  }
};

void run_item_bf16(const Problem<c10::BFloat16>& p, const WorkItem& item, Scratch& s) {
  run_item_transposed<c10::BFloat16, c10::BFloat16, Bf16Dot>(p, item, s, p.dim / 2);
}
constexpr bool kHaveBf16Path = true;
#else
void run_item_bf16(const Problem<c10::BFloat16>& p, const WorkItem& item, Scratch& s) {
  run_item_avx512(p, item, s, nullptr, false);
}
constexpr bool kHaveBf16Path = false;
#endif
"""
