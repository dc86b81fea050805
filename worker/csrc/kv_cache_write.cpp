// The paged K/V cache write: each new token's K and V rows into its slot.
#include <cstring>

#include "kernels.h"

namespace {

// Stored = real / scale, clamped to the format's largest finite value (vLLM's saturating write; NaN
// stays NaN), then rounded to nearest even by c10's conversion: torch's `.to(float8)` of the same float.
template <typename F, typename S>
void write_fp8(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache, torch::Tensor& v_cache,
               const int64_t* slots, int64_t row, double k_scale, double v_scale) {
  const float largest = static_cast<float>(std::numeric_limits<F>::max());
  const S* k_src = key.data_ptr<S>();
  const S* v_src = value.data_ptr<S>();
  F* k_dst = k_cache.data_ptr<F>();
  F* v_dst = v_cache.data_ptr<F>();
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  const int64_t k_stride = key.stride(0), v_stride = value.stride(0), tokens = key.size(0);
  const auto convert = [largest](float x, float scale) {
    return F(std::min(std::max(x / scale, -largest), largest));
  };
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = 0; i < row; ++i) {
        k_dst[slots[t] * row + i] = convert(static_cast<float>(k_src[t * k_stride + i]), ks);
        v_dst[slots[t] * row + i] = convert(static_cast<float>(v_src[t * v_stride + i]), vs);
      }
  });
}

}  // namespace

// Copies each new token's K and V rows (all KV heads) into its cache slot, tokens spread over
// threads (index_copy_ does it row by row on one thread).
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value must be [tokens, kv_heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == key.size(1) &&
                  k_cache.size(3) == key.size(2),
              "caches must be [blocks, block_size, kv_heads, dim] matching key");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "key and value, and the two caches, must share a dtype");
  // A float32 model may keep a bfloat16 cache (--kv-cache-dtype): rounded to nearest even on the way in.
  const bool narrowing = key.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kBFloat16;
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() || narrowing || fp8,
              "the caches must have key's dtype, an 8-bit float, or bfloat16 under float32 key/value");
  TORCH_CHECK(k_scale > 0 && v_scale > 0 && (fp8 || (k_scale == 1 && v_scale == 1)),
              "k_scale/v_scale must be positive, and 1 unless the cache holds 8-bit floats");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t row = key.size(1) * key.size(2);
  TORCH_CHECK(
      key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
      "key/value rows (all heads of a token) must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be int64 [tokens]");
  const int64_t tokens = key.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  if (fp8) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv_cache", [&] {
      if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
        write_fp8<c10::Float8_e4m3fn, scalar_t>(key, value, k_cache, v_cache, slots, row, k_scale, v_scale);
      else
        write_fp8<c10::Float8_e5m2, scalar_t>(key, value, k_cache, v_cache, slots, row, k_scale, v_scale);
    });
    return;
  }
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
