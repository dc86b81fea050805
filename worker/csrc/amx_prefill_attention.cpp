// Prefill and extend chunks of bfloat16 queries over a bfloat16 paged cache on AMX tiles (the
// flash attention of amx_attention.h): the chosen sequences of a batch, each query at position
// seq_len - query_len + i seeing the positions up to its own. Work items of up to 256 rows (one
// sequence and KV head; rows are query x query head of that KV head) go to the threads longest
// first.
#include "amx_attention.h"
#include "kernels.h"

bool amx_attention_available() {
#if defined(PAGEDSERVE_AMX_ATTENTION)
  return amx::permitted();
#else
  return false;
#endif
}

void amx_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens,
                           torch::Tensor seqs, double scale) {
  TORCH_CHECK(amx_attention_available(), "amx_prefill_attention needs AMX-BF16 (and the kernel's permission)");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [tokens, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [blocks, block_size, kv_heads, dim]");
  for (const torch::Tensor* t : {&out, &query, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous(), "tensors must be contiguous bfloat16");
  for (const torch::Tensor* t : {&block_tables, &query_start, &seq_lens, &seqs})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "metadata must be contiguous int32");
  const int64_t heads = query.size(1), dim = query.size(2), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(dim % 32 == 0 && block_size % 16 == 0, "amx_prefill_attention needs head_dim % 32 == 0 and block_size % 16 == 0");
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "metadata sizes differ");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* chosen = seqs.data_ptr<int32_t>();
#if defined(PAGEDSERVE_AMX_ATTENTION)
  const int64_t gq = heads / kv_heads;
  struct Item {
    int64_t seq, head, first, rows, cost;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < seqs.size(0); ++i) {
    const int64_t s = chosen[i];
    TORCH_CHECK(s >= 0 && s < num_seqs, "sequence index out of range");
    const int64_t qlen = qs[s + 1] - qs[s];
    TORCH_CHECK(qlen >= 0 && qs[s + 1] <= query.size(0) && lens[s] >= qlen && lens[s] <= max_blocks * block_size,
                "a sequence's length must cover its queries and fit its block table");
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t first = 0; first < qlen * gq; first += amx::MAX_BLOCKS * amx::ROWS) {
        const int64_t rows = std::min<int64_t>(amx::MAX_BLOCKS * amx::ROWS, qlen * gq - first);
        items.push_back({s, h, first, rows, rows * (lens[s] - qlen + (first + rows) / gq)});
      }
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const auto* q_data = reinterpret_cast<const c10::BFloat16*>(query.data_ptr());
  const auto* k_data = reinterpret_cast<const c10::BFloat16*>(k_cache.data_ptr());
  const auto* v_data = reinterpret_cast<const c10::BFloat16*>(v_cache.data_ptr());
  auto* o_data = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    amx::TileScope tiles;
    // Kept per thread across calls: the packed V of a long span is too big to fault in anew.
    thread_local amx::Scratch scratch;
    thread_local std::vector<uint32_t> qt;
    thread_local std::vector<float> acc;
    qt.resize(amx::MAX_BLOCKS * dim * 8);
    acc.resize(amx::MAX_BLOCKS * amx::ROWS * dim);
    alignas(64) float m[amx::MAX_BLOCKS * 16], l[amx::MAX_BLOCKS * 16];
    alignas(64) int32_t limit[amx::MAX_BLOCKS * 16];
    const c10::BFloat16* rows[16];
    for (int64_t index = next++; index < count; index = next++) {
      const Item& item = items[index];
      const int64_t s = item.seq, qlen = qs[s + 1] - qs[s], context = lens[s] - qlen;
      const int32_t* table = tables + s * max_blocks;
      const int64_t head = item.head;
      auto at = [&](const c10::BFloat16* cache, int64_t pos) {
        return cache + ((static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * kv_heads +
                        head) * dim;
      };
      auto key_rows = [&](int64_t pos) { return at(k_data, pos); };
      auto value_rows = [&](int64_t pos) { return at(v_data, pos); };
      // Row r of the item: query r / gq, query head head * gq + r % gq.
      auto token_head = [&](int64_t r) { return (qs[s] + r / gq) * heads + head * gq + r % gq; };
      const int64_t blocks = (item.rows + amx::ROWS - 1) / amx::ROWS;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n = std::min<int64_t>(amx::ROWS, item.rows - b * amx::ROWS);
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t r = item.first + b * amx::ROWS + i;
          rows[i] = i < n ? q_data + token_head(r) * dim : nullptr;
          limit[b * 16 + i] = i < n ? static_cast<int32_t>(context + r / gq + 1) : 0;
          m[b * 16 + i] = -std::numeric_limits<float>::infinity();
          l[b * 16 + i] = 0.0f;
        }
        amx::pack_queries(rows, n, dim, qt.data() + b * dim * 8);
      }
      std::fill(acc.begin(), acc.begin() + blocks * amx::ROWS * dim, 0.0f);
      amx::attend_rows(qt.data(), blocks, dim, key_rows, value_rows, kv_heads * dim, 0, lens[s], limit, fscale, m, l,
                       acc.data(), scratch);
      for (int64_t i = 0; i < item.rows; ++i) {
        c10::BFloat16* o = o_data + token_head(item.first + i) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
        for (int64_t d = 0; d < dim; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc.data() + i * dim + d), inv)));
      }
    }
  };
  if (threads == 1)
    work(0, 1);
  else
    at::parallel_for(0, threads, 1, work);
#endif
}
