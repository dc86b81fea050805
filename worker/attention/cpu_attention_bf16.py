"""The AVX512-BF16 scoring of the CPU paged attention kernel's C++ source (see
`worker.attention.cpu_attention_source`, which puts the pieces together).

Prefill items over bfloat16 caches (head_dim a multiple of 32, at least
BF16_MIN_ROWS query rows per KV head) on CPUs with AVX512-BF16 compute their
scores on `vdpbf16ps` without horizontal sums: the 16 keys of a chunk are
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
// Rows per KV head from which an item takes the bf16 scoring: below, the transpose costs about
// what it saves (and decode items, bound by memory, went no faster with it).
constexpr int64_t BF16_MIN_ROWS = 6;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------
// bfloat16 on vdpbf16ps (see cpu_attention_bf16.py). "Register" below is 16 dwords (32 bf16).
constexpr int SCORE_ROWS = 8;       // query rows scored together: 8 accumulators + a key register

inline __m512i load_reg(const float* p) { return _mm512_loadu_si512(p); }
inline void store_reg(float* p, __m512i v) { _mm512_storeu_si512(p, v); }

// r[e] <- dword e of each of the 16 registers (a 16 x 16 dword transpose).
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + e], 128-bit lane k: element 4k + e of rows 4g .. 4g + 3.
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), b = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88), d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

// kt register p (p < dim / 2): dims 2p, 2p + 1 of the 16 keys (one head's rows).
inline void transpose_keys(const c10::BFloat16* const* keys, int64_t dim, float* kt) {
  for (int64_t b = 0; b < dim; b += 32) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(keys[j] + b);
    transpose16(r);
    for (int e = 0; e < 16; ++e) store_reg(kt + (b / 2 + e) * 16, r[e]);
  }
}

// out[r][j] = scale * (q_r . key j) for the 16 keys of kt and R query rows.
template <int R>
inline void score_rows(const uint32_t* const* q, const float* kt, int64_t pairs, float scale, float* const* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh k = (__m512bh)load_reg(kt + p * 16);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(q[r][p]), k);
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], _mm512_mul_ps(acc[r], s));
}

void run_item_bf16(const Problem<c10::BFloat16>& p, const WorkItem& item, Scratch& s) {
  using T = c10::BFloat16;
  const ItemGeometry g(p, item);
  const T* zero_row = start_item(p, item, g, s, false);
  const int64_t dim = p.dim, pairs = dim / 2, per_head = item.num_queries * (p.heads / p.kv_heads);
  s.packed.resize(pairs * 16);  // one head's transposed keys of one chunk
  float* kt = s.packed.data();
  const uint32_t* query = reinterpret_cast<const uint32_t*>(p.query) + g.first_token * p.heads * pairs;
  for_each_chunk_head(p, p.k_cache, item, g, zero_row, [&](int64_t offset, int64_t h, const T* const* head_rows) {
    transpose_keys(head_rows, dim, kt);
    const int64_t* mine = s.head_rows.data() + h * per_head;
    for (int64_t k = 0; k < per_head; k += SCORE_ROWS) {
      const int64_t count = std::min<int64_t>(SCORE_ROWS, per_head - k);
      const uint32_t* q[SCORE_ROWS];
      float* out[SCORE_ROWS];
      for (int64_t i = 0; i < count; ++i) {
        q[i] = query + mine[k + i] * pairs;
        out[i] = s.scores.data() + mine[k + i] * g.stride + offset;
      }
      switch (count) {  // fixed-size row loops unroll
        case 8: score_rows<8>(q, kt, pairs, p.scale, out); break;
        case 7: score_rows<7>(q, kt, pairs, p.scale, out); break;
        case 6: score_rows<6>(q, kt, pairs, p.scale, out); break;
        case 5: score_rows<5>(q, kt, pairs, p.scale, out); break;
        case 4: score_rows<4>(q, kt, pairs, p.scale, out); break;
        case 3: score_rows<3>(q, kt, pairs, p.scale, out); break;
        case 2: score_rows<2>(q, kt, pairs, p.scale, out); break;
        default: score_rows<1>(q, kt, pairs, p.scale, out); break;
      }
    }
  });
  softmax_rows(p, g, s);
  weigh_values(p, item, g, s, zero_row, [] {});
  write_output(p, g, s);
}
constexpr bool kHaveBf16Path = true;
#else
void run_item_bf16(const Problem<c10::BFloat16>& p, const WorkItem& item, Scratch& s) {
  run_item_avx512(p, item, s, nullptr, false);
}
constexpr bool kHaveBf16Path = false;
#endif
"""
