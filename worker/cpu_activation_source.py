"""C++ source of the fused SiLU-and-multiply of the gated MLP (`silu(gate) * up`), built
into the CPU kernel extension by `worker.attention.cpu_kernels` after the attention
source, whose `exp_ps` (which overflows to inf like exp) and `load16` it uses, and
registered as the operator `pagedserve::silu_and_mul` so that compiled graphs call it
without going through Python.

It rounds where eager bfloat16 PyTorch rounds: silu in float32 rounded to bfloat16,
then the product rounded again (round to nearest even, as c10::BFloat16). Eager and
inductor compute silu as x / (1 + exp(-x)) with SLEEF's exp, about 70 cycles for 16
values on this machine, which made the op compute-bound (4.9 ms a layer for 4,096
tokens); the polynomial exp here differs from SLEEF's in the last bits of float32,
which changes a bfloat16 result only when it sits on a rounding boundary (none of
6.3 million random values did; the tests compare bit for bit).
"""

ACTIVATION_SOURCE = r"""
namespace {

inline float round_to_bf16(float x) {  // c10::BFloat16's rounding, kept in a float
  return static_cast<float>(static_cast<c10::BFloat16>(x));
}

#if defined(__AVX512F__)
// Round to nearest even at bit 16, as c10::round_to_nearest_even (NaN stays NaN).
inline __m512 round_bf16_ps(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                           _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(rounded), _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
#endif

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kBf16) {
    for (; i + 16 <= n; i += 16) {
      const __m512 g = load16(gate + i);
      __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      const __m512 product = round_bf16_ps(_mm512_mul_ps(round_bf16_ps(s), load16(up + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(product), 16)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float g = load_float(gate + i);
    float s = g / (1.0f + std::exp(-g));
    if constexpr (kBf16) s = round_to_bf16(s);
    out[i] = static_cast<T>(s * load_float(up + i));
  }
}

}  // namespace

// [..., 2n] -> [..., n]: silu of the first half times the second, rows spread over threads.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_and_mul needs an even last dimension");
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_and_mul runs on CPU tensors");
  const torch::Tensor x = gate_up.contiguous();
  const int64_t n = x.size(-1) / 2, rows = n ? x.numel() / (2 * n) : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  torch::Tensor out = torch::empty(shape, x.options());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n));  // ~16k values a task
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(in + r * 2 * n, in + r * 2 * n + n, dst + r * n, n);
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }
TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
"""
