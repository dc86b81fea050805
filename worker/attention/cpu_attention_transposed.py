"""Prefill scoring against transposed keys, the part of the CPU paged attention
kernel's C++ source shared by float32 (here) and bfloat16 (`cpu_attention_bf16`);
`cpu_attention_source` puts the pieces together.

Prefill items (at least TRANSPOSED_MIN_ROWS query rows per KV head, head_dim a
multiple of 16) score without horizontal sums: the 16 keys of a chunk are
transposed once per KV head into key lanes, and every query row of that head
then adds its broadcast query elements times those lanes into one register of
16 scores. One transpose serves all the rows of the head (24 in a SmolLM2
tile). In float32, register d of the transpose holds dim d of the 16 keys and
each step is one FMA; `score_chunk`'s 16 accumulators and transposing
horizontal sum per row and chunk cost about as much shuffling as multiplying,
and prefill attention ran at a quarter of the FMA peak with them. Decode
items, bound by memory and with three rows per head, keep `score_chunk`.
Softmax and values are `run_item_avx512`'s.
"""

TRANSPOSED_PATH = r"""
// Rows per KV head from which an item takes the transposed scoring: below, the transpose costs
// about what it saves (and decode items, bound by memory, went no faster with it).
constexpr int64_t TRANSPOSED_MIN_ROWS = 6;
#if defined(__AVX512F__)
constexpr int SCORE_ROWS = 8;  // query rows scored together: 8 accumulators + a key register

// Calls f(std::integral_constant<int, R>{}) with R = count (1 .. SCORE_ROWS): fixed-size row loops unroll.
template <typename F>
inline void with_rows(int64_t count, F&& f) {
  switch (count) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

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

// kt register e of each block of 16 dwords of the keys' rows: dword e of the 16 keys (for
// float32, register d holds dim d; for bf16 pairs, dims 2p and 2p + 1).
inline void transpose_dwords(const void* const* keys, int64_t dwords, float* kt) {
  for (int64_t b = 0; b < dwords; b += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(static_cast<const uint32_t*>(keys[j]) + b);
    transpose16(r);
    for (int e = 0; e < 16; ++e) _mm512_storeu_si512(kt + (b + e) * 16, r[e]);
  }
}

// out[r][j] = scale * (q_r . key j) for the 16 keys of kt (float32: [dim][16]) and R query rows.
template <int R>
inline void score_rows_f32(const float* const* q, const float* kt, int64_t dim, float scale, float* const* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 k = _mm512_loadu_ps(kt + d * 16);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d]), k, acc[r]);
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], _mm512_mul_ps(acc[r], s));
}

// One item scored against transposed keys: `steps` kt registers per chunk and head (query
// elements of type U per row: floats, or bf16 pairs as uint32), `score(count, q, kt, steps,
// scale, out)` scoring up to SCORE_ROWS rows; softmax and values as run_item_avx512.
template <typename T, typename U, typename Score>
void run_item_transposed(const Problem<T>& p, const WorkItem& item, Scratch& s, int64_t steps, Score&& score) {
  const ItemGeometry g(p, item);
  const T* zero_row = start_item(p, item, g, s, false);
  const int64_t per_head = item.num_queries * (p.heads / p.kv_heads);
  s.packed.resize(steps * 16);  // one head's transposed keys of one chunk
  float* kt = s.packed.data();
  const U* query = reinterpret_cast<const U*>(p.query) + g.first_token * p.heads * steps;
  for_each_chunk_head(p, p.k_cache, item, g, zero_row, [&](int64_t offset, int64_t h, const T* const* head_rows) {
    transpose_dwords(reinterpret_cast<const void* const*>(head_rows), steps, kt);
    const int64_t* mine = s.head_rows.data() + h * per_head;
    for (int64_t k = 0; k < per_head; k += SCORE_ROWS) {
      const int64_t count = std::min<int64_t>(SCORE_ROWS, per_head - k);
      const U* q[SCORE_ROWS];
      float* out[SCORE_ROWS];
      for (int64_t i = 0; i < count; ++i) {
        q[i] = query + mine[k + i] * steps;
        out[i] = s.scores.data() + mine[k + i] * g.stride + offset;
      }
      score(count, q, kt, steps, p.scale, out);
    }
  });
  softmax_rows(p, g, s);
  weigh_values(p, item, g, s, zero_row, [] {});
  write_output(p, g, s);
}

void run_item_f32(const Problem<float>& p, const WorkItem& item, Scratch& s) {
  run_item_transposed<float, float>(p, item, s, p.dim, [](int64_t count, const float* const* q, const float* kt,
                                                          int64_t dim, float scale, float* const* out) {
    with_rows(count, [&](auto rows) { score_rows_f32<decltype(rows)::value>(q, kt, dim, scale, out); });
  });
}
constexpr bool kHaveTransposedPath = true;
#else
void run_item_f32(const Problem<float>& p, const WorkItem& item, Scratch& s) { run_item_portable(p, item, s); }
constexpr bool kHaveTransposedPath = false;
#endif
"""
