// The CPU paged attention kernel's shared pieces: its constants, the problem (tensors, shapes,
// block tables), the work items and their geometry, per-thread scratch, and the portable path
// (plain loops the compiler vectorizes) that CPUs without AVX-512 run. paged_attention.cpp
// puts the paths together; see it for the kernel's contract.
#pragma once

#include "vector_helpers.h"

namespace {

constexpr int64_t CHUNK = 16;  // key positions converted and scored together
// Query rows (tokens x heads) per prefill work item: 16 tokens of 9 heads. Against 8 tokens, each
// K/V row read and transposed serves twice the rows: prefill attention 0.90 of the time (0.88 with
// 32 tokens, whose scores, rows x keys, outgrow L2 sooner on long contexts).
constexpr int64_t TILE_ROWS = 144;
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1
#endif
constexpr int64_t SERIAL_COST = 20000;  // below this many (row x key) units, stay on one thread

struct WorkItem {
  int64_t seq, first_query, num_queries, cost;
};

// Q: the query's and output's element type; T: the cache's (the same, bfloat16 under float32
// queries: --kv-cache-dtype bfloat16 on a float32 model, or an 8-bit float: --kv-cache-dtype fp8*).
// `scale` includes the K scale (and kReadFactor); `out_scale` is the V scale (and kReadFactor).
template <typename Q, typename T = Q>
struct Problem {
  const Q* query;    // [tokens, heads, dim]
  const T* k_cache;  // [blocks, block_size, kv_heads, dim]
  const T* v_cache;
  const int32_t* block_tables;                                   // [seqs, max_blocks]
  const int32_t* query_start;                                    // [seqs + 1]
  const int32_t* seq_lens;                                       // [seqs]
  Q* out;                                                        // [tokens, heads, dim]
  int64_t max_blocks, block_size, heads, kv_heads, dim, window;  // window <= 0: none
  float scale;
  float out_scale;  // multiplies the output: 8-bit caches' V scale, else 1

  // Cache rows (all KV heads of a slot) of positions [first, first + n) of a sequence.
  void chunk_rows(const T* cache, int64_t seq, int64_t first, int64_t n, const T** rows) const {
    const int32_t* table = block_tables + seq * max_blocks;
    int64_t block = first / block_size, offset = first % block_size;
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = cache + (static_cast<int64_t>(table[block]) * block_size + offset) * kv_heads * dim;
      if (++offset == block_size) {
        offset = 0;
        ++block;
      }
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
  std::vector<float> scores, acc, inv_sums, zeros;
  std::vector<float> packed;       // one KV head's keys of a span, transposed (prefill items)
  std::vector<float> queries;      // the query rows of each KV head, step by step (prefill items)
  std::vector<c10::BFloat16> widened;  // a chunk of 8-bit keys as bfloat16 (decode items)
  std::vector<int64_t> head_rows;  // rows of each KV head (AVX-512 paths)
};

// Which part of a sequence one item covers, and the key range it reads.
struct ItemGeometry {
  int64_t rows, first_token, first_pos, key_lo, key_hi, stride;

  template <typename P>
  ItemGeometry(const P& p, const WorkItem& item) {
    const int64_t query_len = p.query_start[item.seq + 1] - p.query_start[item.seq];
    rows = item.num_queries * p.heads;  // row r: query token r / heads, head r % heads
    first_token = p.query_start[item.seq] + item.first_query;
    first_pos = p.seq_lens[item.seq] - query_len + item.first_query;
    key_lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
    key_hi = first_pos + item.num_queries;
    stride = (key_hi - key_lo + CHUNK - 1) / CHUNK * CHUNK;  // scores kept per row
  }

  // Visible keys of row r, relative to key_lo.
  template <typename P>
  std::pair<int64_t, int64_t> visible(const P& p, int64_t r) const {
    const int64_t pos = first_pos + r / p.heads;
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    return {lo - key_lo, pos + 1 - key_lo};
  }
};

template <typename Q, typename T>
void write_output(const Problem<Q, T>& p, const ItemGeometry& g, const Scratch& s) {
  Q* out = p.out + g.first_token * p.heads * p.dim;
  for (int64_t r = 0; r < g.rows; ++r) {
    const float inv = s.inv_sums[r] * p.out_scale;
    for (int64_t d = 0; d < p.dim; ++d) out[r * p.dim + d] = static_cast<Q>(s.acc[r * p.dim + d] * inv);
  }
}

// ---------------------------------------------------------------------------------------------
// Portable path: plain loops.
template <typename Q, typename T>
void run_item_portable(const Problem<Q, T>& p, const WorkItem& item, Scratch& s) {
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
      const Q* q = p.query + (g.first_token * p.heads + r) * dim;
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
}  // namespace
