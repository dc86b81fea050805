// The functions the CPU kernel extension exports to Python (bindings.cpp) and calls across its
// translation units. Tensors are CPU tensors; each definition checks its arguments (TORCH_CHECK).
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

// paged_attention.cpp: out [T, H, D] = attention of query [T, H, D] over the paged caches
// [blocks, block_size, KVH, D] of each sequence (int32 metadata); window <= 0: none; k_scale/v_scale:
// an 8-bit cache's per-tensor scales (real = stored x scale), 1 for other caches.
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens, double scale,
                     int64_t window, double k_scale, double v_scale);
// shared_prefix_attention.cpp: paged_attention's output rows of grouped decodes, each group's
// members (sequence indices, members[group_start[g] .. group_start[g + 1]]) sharing their first
// prefix_lens[g] positions' blocks; whether this build runs it (AVX-512).
void shared_prefix_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens,
                             torch::Tensor group_start, torch::Tensor members, torch::Tensor prefix_lens,
                             double scale);
bool shared_prefix_attention_available();
// amx_prefill_attention.cpp: paged_attention's output rows of the sequences `seqs` (bfloat16
// queries, bfloat16 or 8-bit float caches, on AMX tiles); whether this build and CPU run it.
void amx_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens,
                           torch::Tensor seqs, double scale, double k_scale, double v_scale);
bool amx_attention_available();
// kv_cache_write.cpp: the new tokens' K/V [T, KVH, D] into their slots of the caches (8-bit caches:
// divided by k_scale/v_scale, saturated, rounded to nearest even).
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping, double k_scale, double v_scale);
// near_top_scan.cpp: (argmax [N], near-top counts [N]) of logits [N, vocab].
std::vector<torch::Tensor> near_top_scan(torch::Tensor logits, double model_eps, double model_tiny);
// random_sampling.cpp: one sampled token per row of logits [R, vocab].
torch::Tensor sample_random_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                                 torch::Tensor top_p, torch::Tensor min_p, torch::Tensor keys);
// token_logprobs.cpp: {chosen logprobs [R], ranks [R], top logprobs [R, num_top], their ids}.
std::vector<torch::Tensor> token_logprobs_rows(torch::Tensor logits, torch::Tensor chosen, int64_t num_top);
// rotary.cpp (operator rotary_qk): rotated (q [T, heads, D], k [T, kv_heads, D]) from a bf16 qkv.
std::tuple<torch::Tensor, torch::Tensor> rotary_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                   int64_t heads, int64_t kv_heads);
// packed_linear.cpp (operators packed_linear, packed_linear_silu): whether this build runs them.
bool bf16_linear_available();
bool f32_linear_available();
// gguf_linear.cpp (operators gguf_linear, gguf_linear_silu): the float32 weights of a GGUF packing.
torch::Tensor gguf_dequantize(torch::Tensor packed, int64_t k);
// int8_linear.cpp (operators int8_linear, int8_linear_silu, int8_quantize_rows): whether this build runs them.
bool int8_linear_available();
// Whether batches run on AMX-INT8 tiles here, and the fewest rows that do (set, returns the previous).
bool int8_amx_available();
int64_t set_int8_amx_rows(int64_t rows);
// lm_head_argmax.cpp: each row's argmax of x @ W.T (operator packed_linear_argmax), and the same
// screened with W's int16 packing.
torch::Tensor packed_linear_argmax(torch::Tensor x, torch::Tensor packed, int64_t out_features);
torch::Tensor screened_argmax(torch::Tensor x, torch::Tensor screen_packed, torch::Tensor col_scale,
                              torch::Tensor col_error, torch::Tensor col_l1, torch::Tensor weight, torch::Tensor packed,
                              int64_t out_features);
bool screened_argmax_available();
// bf16_lm_head_screen.cpp: greedy tokens of bf16 rows through the int8 screen, and every
// column's bound (for the tests).
std::vector<torch::Tensor> screened_bf16_argmax(torch::Tensor x, torch::Tensor weight, torch::Tensor packed,
                                                torch::Tensor screen_packed, torch::Tensor outlier_packed,
                                                torch::Tensor rest, torch::Tensor outliers, torch::Tensor column_terms,
                                                torch::Tensor offset_share, int64_t out_features, double model_eps,
                                                double model_tiny);
torch::Tensor bf16_screen_bounds(torch::Tensor x, torch::Tensor weight, torch::Tensor packed,
                                 torch::Tensor screen_packed, torch::Tensor outlier_packed, torch::Tensor rest,
                                 torch::Tensor outliers, torch::Tensor column_terms, torch::Tensor offset_share,
                                 int64_t out_features);
bool bf16_screen_available();
