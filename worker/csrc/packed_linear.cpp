// The packed matmuls, registered as `pagedserve::packed_linear` and
// `pagedserve::packed_linear_silu` so that compiled graphs call them without going through
// Python. The gated version computes the MLP's `silu(gate) * up` from a fused gate/up weight
// packed with each block's gate panels next to the up panels of the same columns, applying the
// activation in registers (bf16: `silu_mul_bf16`, rounding as eager does) instead of writing
// [T, 2 x intermediate] and reading it back.
#include "op_namespace.h"
#include "packed_linear.h"

namespace {

// x [..., K] through a packed weight of `panels` panels -> [..., out_features], in x's dtype
// (bfloat16 or float32, the packing's); GATED: the weight is a gated packing of twice
// out_features columns and the MLP's activation is applied.
template <bool GATED>
torch::Tensor packed_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                            const c10::optional<torch::Tensor>& bias) {
  const torch::Tensor rows = checked_rows(x, packed, out_features, bias, GATED);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  torch::Tensor out = torch::empty(shape, x.options());
  if (rows.size(0) == 0) return out;
  const torch::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  const float* bias_ptr = bias ? bias_f.data_ptr<float>() : nullptr;
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    const StoreSink<F32Math> sink{out.data_ptr<float>(), out_features};
    linear_run<F32Math, GATED>(rows.data_ptr<float>(), rows.size(0), packed.data_ptr<float>(), packed.size(0),
                               packed.size(1), bias_ptr, out_features, [&](int64_t) { return sink; });
  }
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const StoreSink<Bf16Math> sink{reinterpret_cast<c10::BFloat16*>(out.data_ptr()), out_features};
    linear_run<Bf16Math, GATED>(reinterpret_cast<const uint32_t*>(rows.data_ptr()), rows.size(0),
                                reinterpret_cast<const uint32_t*>(packed.data_ptr()), packed.size(0), packed.size(1),
                                bias_ptr, out_features, [&](int64_t) { return sink; });
  }
#endif
  return out;
}

// Rows from which a matmul given its plain weight runs it through ATen (oneDNN) instead: on a
// CPU with AMX, oneDNN's tile multiplies outrun the packed kernel from about this many rows
// (the caller passes the plain weight only there; see worker.models.packed_linear).
constexpr int64_t kDenseMinRows = 16;

// x through `dense` (the plain [N or 2N, K] weight) with ATen, as the packed kernel would
// return it: GATED applies silu(gate) * up as eager PyTorch does.
torch::Tensor dense_matmul(const torch::Tensor& x, const torch::Tensor& dense, int64_t out_features,
                           const c10::optional<torch::Tensor>& bias, bool gated) {
  TORCH_CHECK(dense.dim() == 2 && dense.size(0) == (gated ? 2 : 1) * out_features && dense.size(1) == x.size(-1)
                  && dense.scalar_type() == x.scalar_type(),
              "the plain weight must be [", (gated ? 2 : 1) * out_features, ", ", x.size(-1), "] in x's dtype");
  return aten_linear(x, dense, out_features, bias, gated);
}

bool use_dense(const torch::Tensor& x, const c10::optional<torch::Tensor>& dense) {
  return dense && dense->defined() && x.dim() >= 1 && x.numel() / std::max<int64_t>(x.size(-1), 1) >= kDenseMinRows;
}

}  // namespace

bool bf16_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool f32_linear_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x [..., K], packed [ceil(N / 16), K / unit, 16, unit] of x's dtype (unit 2 for bfloat16, 1 for
// float32; see packed_linear), bias [N] or none -> [..., N]. dense: the plain weight [N, K],
// used instead from kDenseMinRows rows on (given only where ATen's matmul is the faster).
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                            c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> dense) {
  if (use_dense(x, dense)) return dense_matmul(x, *dense, out_features, bias, false);
  return packed_matmul<false>(x, packed, out_features, bias);
}

// silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias) of a fused gate/up projection packed gated
// (see packed_linear.pack_gated): x [..., K], packed [2 ceil(N / 16), K / unit, 16, unit], bias
// [2N] or none -> [..., N]. packed_linear followed by eager F.silu(gate) * up (bf16: bit for
// bit), without the [..., 2N] pass. dense: the plain fused weight [2N, K], as for packed_linear.
torch::Tensor packed_linear_silu(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                 c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> dense) {
  if (use_dense(x, dense)) return dense_matmul(x, *dense, out_features, bias, true);
  return packed_matmul<true>(x, packed, out_features, bias);
}

TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, Tensor? dense=None) -> Tensor");
  m.def("packed_linear_silu(Tensor x, Tensor packed, int out_features, Tensor? bias, Tensor? dense=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_silu", &packed_linear_silu);
}
