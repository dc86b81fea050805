"""C++ source of the CPU paged attention kernel (compiled at first use by `worker.attention.cpu_kernels`).

One call per layer covers the whole flattened batch (decodes and prefill
chunks), reading K/V in place through the block tables: no gather copies, no
per-sequence Python loop. A work item is one sequence and a tile of its query
tokens, with every head: the K/V of a cache slot (all KV heads) is one
contiguous run of memory, so an item streams whole blocks (prefetching the
next chunk), converts each chunk of 16 positions to float once and reuses it
for every query row. Items run longest first (prefill chunks and decodes
differ in size by orders of magnitude), torch's intra-op threads claiming
them one by one from a shared counter.

With AVX-512 (head_dim a multiple of 16) the scores of 16 keys come from 16
FMA accumulators and one transposing horizontal sum, exp is a vectorized
polynomial, and value accumulators stay in registers across a chunk; other
CPUs use plain loops the compiler vectorizes. Softmax (max-subtracted, over
the visible positions) and the weighted sum of values are float32; the
result is cast to the query dtype. The cache holds the query's dtype, or
bfloat16 under float32 queries (`--kv-cache-dtype bfloat16`: widened as it
is read, prefill keys before their transpose). A query at position p sees positions
(p - sliding_window, p].
"""

from worker.attention.cpu_attention_avx512 import AVX512_PATH
from worker.attention.cpu_attention_bf16 import BF16_PATH
from worker.attention.cpu_attention_transposed import TRANSPOSED_PATH

COMMON = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
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
// Query rows (tokens x heads) per prefill work item: 16 tokens of 9 heads. Against 8 tokens, each
// K/V row read and transposed serves twice the rows: prefill attention 0.90 of the time (0.88 with
// 32 tokens, whose scores, rows x keys, outgrow L2 sooner on long contexts).
constexpr int64_t TILE_ROWS = 144;
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

// Q: the query's and output's element type; T: the cache's (the same, or bfloat16 under float32
// queries: --kv-cache-dtype bfloat16 on a float32 model).
template <typename Q, typename T = Q>
struct Problem {
  const Q* query;     // [tokens, heads, dim]
  const T* k_cache;   // [blocks, block_size, kv_heads, dim]
  const T* v_cache;
  const int32_t* block_tables;  // [seqs, max_blocks]
  const int32_t* query_start;   // [seqs + 1]
  const int32_t* seq_lens;      // [seqs]
  Q* out;                       // [tokens, heads, dim]
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
  std::vector<float> scores, acc, inv_sums, zeros;
  std::vector<float> packed;       // one KV head's keys of a span, transposed (prefill items)
  std::vector<float> queries;      // the query rows of each KV head, step by step (prefill items)
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
    const float inv = s.inv_sums[r];
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

"""

DRIVER = r"""
template <typename Q, typename T>
void run(const Problem<Q, T>& p, int64_t num_seqs) {
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
  constexpr bool kVectorType = (std::is_same_v<Q, float> || std::is_same_v<Q, c10::BFloat16>) &&
                               (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
  const bool vector_path = kHaveAvx512 && kVectorType && p.dim % 16 == 0;
  const bool bf16_path = kHaveBf16Path && p.dim % 32 == 0;
  int64_t total_cost = 0;
  for (const WorkItem& item : items) total_cost += item.cost;
  // Tiny batches run on the calling thread: waking the pool costs more than they do.
  const int64_t threads = total_cost < SERIAL_COST ? 1 : std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), items.size()));
  // Longest first, each thread claiming its next item from a shared counter one item ahead (so
  // that it can prefetch that item's K/V while computing the current one): a core that runs
  // slower on a shared host takes fewer items instead of keeping the other waiting at the end.
  std::sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  const int64_t count = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_item{0};
  auto work = [&](int64_t, int64_t) {
    Scratch scratch;
    bool read_ahead = false;  // whether the previous item prefetched this one's K/V
    for (int64_t index = next_item++; index < count;) {
      const int64_t ahead = next_item++;
      const WorkItem& item = items[index];
      const WorkItem* next = ahead < count ? &items[ahead] : nullptr;
      index = ahead;
      const bool prefetched = std::exchange(read_ahead, false);
      const bool transposed = item.num_queries * (p.heads / p.kv_heads) >= TRANSPOSED_MIN_ROWS;
      if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>) {
        if (bf16_path && transposed) {
          run_item_bf16(p, item, scratch);
          continue;
        }
      }
      if constexpr (std::is_same_v<Q, float>) {  // float32 queries, float32 or bfloat16 keys
        if (kHaveTransposedPath && vector_path && transposed) {
          run_item_f32(p, item, scratch);
          continue;
        }
      }
      if constexpr (kVectorType) {
        if (vector_path) {
          read_ahead = run_item_avx512(p, item, scratch, next, prefetched);
          continue;
        }
      }
      run_item_portable(p, item, scratch);
    }
  };
  if (threads == 1) work(0, 1);
  else at::parallel_for(0, threads, 1, work);
}

template <typename Q, typename T>
void run_tensors(torch::Tensor& out, torch::Tensor& query, torch::Tensor& k_cache, torch::Tensor& v_cache,
                 torch::Tensor& block_tables, torch::Tensor& query_start, torch::Tensor& seq_lens, double scale,
                 int64_t window) {
  const Problem<Q, T> p{query.data_ptr<Q>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        block_tables.data_ptr<int32_t>(), query_start.data_ptr<int32_t>(),
                        seq_lens.data_ptr<int32_t>(), out.data_ptr<Q>(), block_tables.size(1), k_cache.size(1),
                        query.size(1), k_cache.size(2), query.size(2), window, static_cast<float>(scale)};
  run(p, seq_lens.size(0));
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
  const bool bf16_cache = query.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
              (k_cache.scalar_type() == query.scalar_type() || bf16_cache),
              "out must have the query's dtype, and the caches the query's or (float32 queries) bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && query_start.scalar_type() == torch::kInt32 &&
              seq_lens.scalar_type() == torch::kInt32, "metadata must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && query_start.is_contiguous() && seq_lens.is_contiguous(),
              "metadata must be contiguous");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), dim = query.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "metadata sizes differ");
  if (bf16_cache) {
    run_tensors<float, c10::BFloat16>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    run_tensors<scalar_t, scalar_t>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window);
  });
}
"""

KV_WRITE = r"""
// Copies each new token's K and V rows (all KV heads) into its cache slot, tokens spread over
// threads: index_copy_ does it row by row on one thread, about 1 ms a layer for a 4096-token step.
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value must be [tokens, kv_heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == key.size(1) &&
              k_cache.size(3) == key.size(2), "caches must be [blocks, block_size, kv_heads, dim] matching key");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "key and value, and the two caches, must share a dtype");
  // A float32 model may keep a bfloat16 cache (--kv-cache-dtype): rounded to nearest even on the way in.
  const bool narrowing = key.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() || narrowing,
              "the caches must have key's dtype, or bfloat16 under float32 key/value");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t row = key.size(1) * key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2), "key/value rows (all heads of a token) must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
              slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(), "slot_mapping must be int64 [tokens]");
  const int64_t tokens = key.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  if (narrowing) {
    const float* k_src = key.data_ptr<float>();
    const float* v_src = value.data_ptr<float>();
    c10::BFloat16* k_dst = k_cache.data_ptr<c10::BFloat16>();
    c10::BFloat16* v_dst = v_cache.data_ptr<c10::BFloat16>();
    const int64_t k_stride = key.stride(0), v_stride = value.stride(0);
    at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t i = 0; i < row; ++i) {
          k_dst[slots[t] * row + i] = c10::BFloat16(k_src[t * k_stride + i]);
          v_dst[slots[t] * row + i] = c10::BFloat16(v_src[t * v_stride + i]);
        }
    });
    return;
  }
  const int64_t bytes = row * key.element_size();
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(k_dst + slots[t] * bytes, k_src + t * k_stride, bytes);
      std::memcpy(v_dst + slots[t] * bytes, v_src + t * v_stride, bytes);
    }
  });
}
"""

SOURCE = COMMON + AVX512_PATH + TRANSPOSED_PATH + BF16_PATH + DRIVER + KV_WRITE

FUNCTIONS = ["paged_attention", "write_kv_cache"]
