// The CPU paged attention kernel: one call per layer covers the whole flattened batch (decodes
// and prefill chunks), reading K/V in place through the block tables: no gather copies, no
// per-sequence Python loop. A work item is one sequence and a tile of its query tokens, with
// every head: the K/V of a cache slot (all KV heads) is one contiguous run of memory, so an item
// streams whole blocks (prefetching the next chunk), converts each chunk of 16 positions to
// float once and reuses it for every query row. Items run longest first, torch's intra-op
// threads claiming them one by one from a shared counter.
//
// Paths by CPU and shapes: AVX-512 (attention_avx512.h, head_dim a multiple of 16), transposed
// prefill scoring (attention_transposed.h, attention_bf16.h), else the portable loops
// (attention_common.h). Softmax (max-subtracted, over the visible positions) and the weighted
// sum of values are float32; the result is cast to the query dtype. The cache holds the query's
// dtype, or bfloat16 under float32 queries (`--kv-cache-dtype bfloat16`: widened as it is read),
// or 8-bit floats (`--kv-cache-dtype fp8*`: widened in registers, value = stored x per-layer scale;
// the K scale folds into the softmax scale, the V scale into the output).
// A query at position p sees positions (p - sliding_window, p].
#include "attention_bf16.h"
#include "kernels.h"

namespace {

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
  constexpr bool kQueryVector = std::is_same_v<Q, float> || std::is_same_v<Q, c10::BFloat16>;
  constexpr bool kCacheVector = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || kFp8<T>;
  constexpr bool kVectorType = kQueryVector && kCacheVector;
  const bool vector_path = kHaveAvx512 && kVectorType && p.dim % 16 == 0;
  const bool bf16_path = kHaveBf16Path && p.dim % 32 == 0;
  int64_t total_cost = 0;
  for (const WorkItem& item : items) total_cost += item.cost;
  // Tiny batches run on the calling thread: waking the pool costs more than they do.
  const int64_t threads =
      total_cost < SERIAL_COST ? 1 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
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
      if constexpr (std::is_same_v<Q, c10::BFloat16> && (std::is_same_v<T, c10::BFloat16> || kFp8<T>)) {
        if (bf16_path && transposed) {
          run_item_bf16(p, item, scratch);
          continue;
        }
      }
      // float32 queries over float32, bfloat16 or 8-bit keys; bfloat16 queries over 8-bit keys
      // without AVX512-BF16
      if constexpr (std::is_same_v<Q, float> || (kFp8<T> && kVectorType)) {
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
  if (threads == 1)
    work(0, 1);
  else
    at::parallel_for(0, threads, 1, work);
}

template <typename Q, typename T>
void run_tensors(torch::Tensor& out, torch::Tensor& query, torch::Tensor& k_cache, torch::Tensor& v_cache,
                 torch::Tensor& block_tables, torch::Tensor& query_start, torch::Tensor& seq_lens, double scale,
                 int64_t window, double k_scale, double v_scale) {
  const Problem<Q, T> p{query.data_ptr<Q>(),
                        k_cache.data_ptr<T>(),
                        v_cache.data_ptr<T>(),
                        block_tables.data_ptr<int32_t>(),
                        query_start.data_ptr<int32_t>(),
                        seq_lens.data_ptr<int32_t>(),
                        out.data_ptr<Q>(),
                        block_tables.size(1),
                        k_cache.size(1),
                        query.size(1),
                        k_cache.size(2),
                        query.size(2),
                        window,
                        static_cast<float>(scale * k_scale * kReadFactor<T>),
                        static_cast<float>(v_scale * kReadFactor<T>)};
  run(p, seq_lens.size(0));
}

}  // namespace

void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens, double scale,
                     int64_t window, double k_scale, double v_scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [tokens, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "tensors must be contiguous");
  const bool bf16_cache = query.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kBFloat16;
  const bool fp8_cache =
      k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == query.scalar_type() || bf16_cache || fp8_cache),
              "out must have the query's dtype, and the caches the query's, an 8-bit float or (float32 "
              "queries) bfloat16");
  TORCH_CHECK(k_scale > 0 && v_scale > 0 && (fp8_cache || (k_scale == 1 && v_scale == 1)),
              "k_scale/v_scale must be positive, and 1 unless the cache holds 8-bit floats");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && query_start.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32,
              "metadata must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && query_start.is_contiguous() && seq_lens.is_contiguous(),
              "metadata must be contiguous");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), dim = query.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "metadata sizes differ");
  if (bf16_cache) {
    run_tensors<float, c10::BFloat16>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window,
                                      1.0, 1.0);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
      run_tensors<scalar_t, c10::Float8_e4m3fn>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens,
                                                scale, window, k_scale, v_scale);
    else if (k_cache.scalar_type() == at::kFloat8_e5m2)
      run_tensors<scalar_t, c10::Float8_e5m2>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens,
                                              scale, window, k_scale, v_scale);
    else
      run_tensors<scalar_t, scalar_t>(out, query, k_cache, v_cache, block_tables, query_start, seq_lens, scale,
                                      window, 1.0, 1.0);
  });
}
