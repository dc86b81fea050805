// Prefill and extend chunks, and decodes, of bfloat16 queries over a bfloat16 or 8-bit float
// (e4m3, e5m2) paged cache on AMX tiles (the flash attention of amx_attention.h): the chosen
// sequences of a batch, each query at position seq_len - query_len + i seeing the positions up to
// its own. Work items of up to 256 rows (one sequence and KV head; rows are query x query head of
// that KV head) go to the threads longest first. Decodes (one query, gq <= 16 rows per KV head)
// go 16 / gq sequences of similar length to an item, as the members of one tile
// (attend_members of amx_member_attention.h): alone, each would leave most of a tile idle.
#include "amx_member_attention.h"
#include "kernels.h"

bool amx_attention_available() {
#if defined(PAGEDSERVE_AMX_ATTENTION)
  return amx::permitted();
#else
  return false;
#endif
}

#if defined(PAGEDSERVE_AMX_ATTENTION)
namespace {

// An item: `rows` rows from `first` of sequence seqs[0] (count 0), or the decodes seqs[0 .. count).
struct Item {
  int64_t head, first, rows, cost, count;
  int32_t seqs[amx::ROWS];
};

template <typename T>
void run_items(const std::vector<Item>& items, torch::Tensor& out, const torch::Tensor& query,
               const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
               const int32_t* qs, const int32_t* lens, float fscale, float out_scale) {
  const int64_t heads = query.size(1), dim = query.size(2), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1), gq = heads / kv_heads;
  const auto* q_data = reinterpret_cast<const c10::BFloat16*>(query.data_ptr());
  const auto* k_data = reinterpret_cast<const T*>(k_cache.data_ptr());
  const auto* v_data = reinterpret_cast<const T*>(v_cache.data_ptr());
  auto* o_data = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
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
    int64_t row_token_head[amx::MAX_BLOCKS * amx::ROWS];  // an item's rows: token x heads + query head
    for (int64_t index = next++; index < count; index = next++) {
      const Item& item = items[index];
      const int64_t head = item.head;
      auto at = [&](const T* cache, int64_t s, int64_t pos) {
        const int32_t* table = tables + s * max_blocks;
        return cache + ((static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * kv_heads +
                        head) * dim;
      };
      int64_t written = item.rows;
      if (item.count > 0) {  // decodes: member j has rows [j * gq, (j + 1) * gq)
        int64_t his[amx::ROWS];
        std::fill(limit, limit + 16, 0);
        for (int64_t j = 0; j < item.count; ++j) {
          const int64_t s = item.seqs[j];
          his[j] = lens[s];
          for (int64_t i = 0; i < 16; ++i) {
            const bool own = i / gq == j;
            rows[i] = own ? q_data + (qs[s] * heads + head * gq + i % gq) * dim : nullptr;
            if (own) {
              limit[i] = lens[s];
              row_token_head[i] = qs[s] * heads + head * gq + i % gq;
            }
          }
          amx::pack_queries(rows, 16, dim, qt.data() + j * dim * 8);
        }
        std::fill(m, m + 16, -std::numeric_limits<float>::infinity());
        std::fill(l, l + 16, 0.0f);
        std::fill(acc.begin(), acc.begin() + amx::ROWS * dim, 0.0f);
        const int32_t* seqs = item.seqs;
        amx::attend_members(
            qt.data(), item.count, gq, dim, [&](int64_t j, int64_t pos) { return at(k_data, seqs[j], pos); },
            [&](int64_t j, int64_t pos) { return at(v_data, seqs[j], pos); }, kv_heads * dim, 0, his, limit, fscale,
            m, l, acc.data(), scratch);
        written = item.count * gq;
      } else {
        const int64_t s = item.seqs[0], qlen = qs[s + 1] - qs[s], context = lens[s] - qlen;
        const int64_t blocks = (item.rows + amx::ROWS - 1) / amx::ROWS;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t n = std::min<int64_t>(amx::ROWS, item.rows - b * amx::ROWS);
          for (int64_t i = 0; i < 16; ++i) {
            const int64_t r = item.first + b * amx::ROWS + i;  // query r / gq, query head head * gq + r % gq
            if (i < n) row_token_head[b * 16 + i] = (qs[s] + r / gq) * heads + head * gq + r % gq;
            rows[i] = i < n ? q_data + row_token_head[b * 16 + i] * dim : nullptr;
            limit[b * 16 + i] = i < n ? static_cast<int32_t>(context + r / gq + 1) : 0;
            m[b * 16 + i] = -std::numeric_limits<float>::infinity();
            l[b * 16 + i] = 0.0f;
          }
          amx::pack_queries(rows, n, dim, qt.data() + b * dim * 8);
        }
        std::fill(acc.begin(), acc.begin() + blocks * amx::ROWS * dim, 0.0f);
        amx::attend_rows(
            qt.data(), blocks, dim, [&](int64_t pos) { return at(k_data, s, pos); },
            [&](int64_t pos) { return at(v_data, s, pos); }, kv_heads * dim, 0, lens[s], limit, fscale, m, l,
            acc.data(), scratch);
      }
      for (int64_t i = 0; i < written; ++i) {
        c10::BFloat16* o = o_data + row_token_head[i] * dim;
        const __m512 inv = _mm512_set1_ps(out_scale / l[i]);
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
}

}  // namespace
#endif

void amx_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens,
                           torch::Tensor seqs, double scale, double k_scale, double v_scale) {
  TORCH_CHECK(amx_attention_available(), "amx_prefill_attention needs AMX-BF16 (and the kernel's permission)");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [tokens, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [blocks, block_size, kv_heads, dim]");
  for (const torch::Tensor* t : {&out, &query})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous(), "query/out must be contiguous bfloat16");
  const auto cache_type = k_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK((cache_type == torch::kBFloat16 || fp8) && v_cache.scalar_type() == cache_type &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous bfloat16 or 8-bit floats (e4m3, e5m2), both the same");
  TORCH_CHECK(k_scale > 0 && v_scale > 0 && (fp8 || (k_scale == 1 && v_scale == 1)),
              "k_scale/v_scale must be positive, and 1 unless the cache holds 8-bit floats");
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
  std::vector<Item> items;
  std::vector<int32_t> decodes;
  for (int64_t i = 0; i < seqs.size(0); ++i) {
    const int64_t s = chosen[i];
    TORCH_CHECK(s >= 0 && s < num_seqs, "sequence index out of range");
    const int64_t qlen = qs[s + 1] - qs[s];
    TORCH_CHECK(qlen >= 0 && qs[s] >= 0 && qs[s + 1] <= query.size(0) && lens[s] >= qlen &&
                    lens[s] <= max_blocks * block_size,
                "a sequence's length must cover its queries and fit its block table");
    if (qlen == 1 && gq <= amx::ROWS) {
      decodes.push_back(static_cast<int32_t>(s));
      continue;
    }
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t first = 0; first < qlen * gq; first += amx::MAX_BLOCKS * amx::ROWS) {
        Item item{h, first, std::min<int64_t>(amx::MAX_BLOCKS * amx::ROWS, qlen * gq - first), 0, 0, {}};
        item.cost = item.rows * (lens[s] - qlen + (first + item.rows) / gq);
        item.seqs[0] = static_cast<int32_t>(s);
        items.push_back(item);
      }
  }
  // Decodes of similar lengths share a tile: the tile runs to its longest member's end.
  std::sort(decodes.begin(), decodes.end(), [&](int32_t a, int32_t b) { return lens[a] > lens[b]; });
  const int64_t per_tile = amx::ROWS / gq, num_decodes = static_cast<int64_t>(decodes.size());
  for (int64_t first = 0; first < num_decodes; first += per_tile)
    for (int64_t h = 0; h < kv_heads; ++h) {
      Item item{h, 0, 0, amx::ROWS * lens[decodes[first]], std::min<int64_t>(per_tile, num_decodes - first), {}};
      std::copy(decodes.begin() + first, decodes.begin() + first + item.count, item.seqs);
      items.push_back(item);
    }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float fscale = static_cast<float>(scale * k_scale);
  const float out_scale = static_cast<float>(v_scale);
  if (cache_type == at::kFloat8_e4m3fn)
    run_items<c10::Float8_e4m3fn>(items, out, query, k_cache, v_cache, block_tables, qs, lens,
                                  fscale * kReadFactor<c10::Float8_e4m3fn>,
                                  out_scale * kReadFactor<c10::Float8_e4m3fn>);
  else if (cache_type == at::kFloat8_e5m2)
    run_items<c10::Float8_e5m2>(items, out, query, k_cache, v_cache, block_tables, qs, lens, fscale, out_scale);
  else
    run_items<c10::BFloat16>(items, out, query, k_cache, v_cache, block_tables, qs, lens, fscale, out_scale);
#endif
}
