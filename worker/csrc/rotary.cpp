// The rotary embedding of q and k in bfloat16 (HF's rotate_half layout), registered as the
// operator `pagedserve::rotary_qk` so that compiled graphs call it without going through Python.
// It reads q and k straight out of the fused qkv projection and writes them contiguous, rounding
// where eager bfloat16 PyTorch rounds (`x * cos` and `rotate_half(x) * sin` each rounded to
// bfloat16, then their sum): bit for bit `worker.models.rotary.apply_rotary`.
#include "bf16_rounding.h"
#include "kernels.h"
#include "op_namespace.h"

namespace {

// One head: out[i] = x[i] * cos[i] - x[i + half] * sin[i], out[i + half] = x[i + half] * cos[i + half]
// + x[i] * sin[i + half], each product and the sum rounded to bf16.
inline void rotate_head(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin, c10::BFloat16* out,
                        int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__)
  auto store = [](c10::BFloat16* dst, __m512 rounded) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16_bits(rounded));
  };
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
    const __m512 first = _mm512_sub_ps(round_bf16_ps(_mm512_mul_ps(x1, load16(cos + i))),
                                       round_bf16_ps(_mm512_mul_ps(x2, load16(sin + i))));
    const __m512 second = _mm512_add_ps(round_bf16_ps(_mm512_mul_ps(x2, load16(cos + half + i))),
                                        round_bf16_ps(_mm512_mul_ps(x1, load16(sin + half + i))));
    store(out + i, round_bf16_ps(first));
    store(out + half + i, round_bf16_ps(second));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = load_float(x + i), x2 = load_float(x + half + i);
    const float first = round_to_bf16(x1 * load_float(cos + i)) - round_to_bf16(x2 * load_float(sin + i));
    const float second =
        round_to_bf16(x2 * load_float(cos + half + i)) + round_to_bf16(x1 * load_float(sin + half + i));
    out[i] = static_cast<c10::BFloat16>(first);
    out[half + i] = static_cast<c10::BFloat16>(second);
  }
}

}  // namespace

// qkv [T, >= (heads + kv_heads) * D] bf16 (q's heads, then k's), cos/sin [T, D] bf16
// -> (q [T, heads, D], k [T, kv_heads, D]) rotated, contiguous.
std::tuple<torch::Tensor, torch::Tensor> rotary_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                   int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "rotary_qk runs on CPU tensors");
  TORCH_CHECK(
      qkv.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
      "rotary_qk takes bfloat16");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) % 2 == 0,
              "cos/sin must be [tokens, head_dim] with an even head_dim");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == cos.size(0), "qkv must be [tokens, features] matching cos/sin");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) >= (heads + kv_heads) * cos.size(1),
              "qkv is narrower than (heads + kv_heads) * head_dim");
  TORCH_CHECK(qkv.stride(1) == 1, "qkv rows must be contiguous");
  const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
  const int64_t tokens = qkv.size(0), dim = c.size(1), half = dim / 2, row = qkv.stride(0);
  torch::Tensor q = torch::empty({tokens, heads, dim}, qkv.options());
  torch::Tensor k = torch::empty({tokens, kv_heads, dim}, qkv.options());
  const c10::BFloat16* src = qkv.data_ptr<c10::BFloat16>();
  const c10::BFloat16* cp = c.data_ptr<c10::BFloat16>();
  const c10::BFloat16* sp = s.data_ptr<c10::BFloat16>();
  c10::BFloat16* qp = q.data_ptr<c10::BFloat16>();
  c10::BFloat16* kp = k.data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, 8192 / ((heads + kv_heads) * dim));  // ~8k values a task
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* x = src + t * row;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        c10::BFloat16* out = h < heads ? qp + (t * heads + h) * dim : kp + (t * kv_heads + h - heads) * dim;
        rotate_head(x + h * dim, cp + t * dim, sp + t * dim, out, half);
      }
    }
  });
  return {q, k};
}

TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("rotary_qk(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("rotary_qk", &rotary_qk); }
