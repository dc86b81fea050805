// The W8A8 matmuls (`--quantization int8`), registered as `pagedserve::int8_linear` and
// `pagedserve::int8_linear_silu` so that compiled graphs call them: x (float32 or bfloat16) is
// quantized per token into u8 rows, multiplied with the int8 panels by `linear_run` with
// `Int8Math` (VNNI) or, batches of AMX_ROWS rows or more, on AMX tiles (int8_amx.h: the same
// bits), and `Int8Sink` writes y in x's dtype. `int8_quantize_rows` exposes the activation
// quantization (for the tests and the PyTorch path's reference). See int8_linear.h.
#include <cstdlib>
#include <cstring>
#include <strings.h>

#include "int8_amx.h"
#include "int8_linear.h"
#include "op_namespace.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// x's rows quantized: u8 [rows, ld] (K padded to 4, then zeros to ld), the scales and the zero
// points [rows]. In parallel from 64k values (a 256-row decode batch of 576: 34 -> 20 us on 2
// cores); a few rows cost less than waking the other threads for a region before the matmul's.
template <typename In>
void quantize_rows(const In* x, int64_t rows, int64_t k, uint8_t* u8, int64_t ld, float* scales, int32_t* zeros) {
  const int64_t padded = (k + INT8_UNIT - 1) / INT8_UNIT * INT8_UNIT;
  constexpr int64_t VALUES_PER_TASK = 1 << 16;
  at::parallel_for(0, rows, std::max<int64_t>(1, VALUES_PER_TASK / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scales[r] = quantize_row(x + r * k, k, u8 + r * ld, zeros + r);
      if (ld > padded) std::memset(u8 + r * ld + padded, 0, ld - padded);
    }
  });
}
#endif

// Batches of at least this many rows multiply on AMX tiles where they run (int8_amx.h); fewer
// rows take the VNNI loop. PAGEDSERVE_INT8_AMX=0 (read once) or set_int8_amx_rows(huge): never.
constexpr int64_t AMX_ROWS = 8;  // measured: from 8 rows the tiles beat vpdpbusd on SmolLM2-135M's shapes
std::atomic<int64_t>& amx_rows() {
  static std::atomic<int64_t> rows{[] {
    const char* value = std::getenv("PAGEDSERVE_INT8_AMX");
    const bool off = value != nullptr && (!std::strcmp(value, "0") || !strcasecmp(value, "false") ||
                                          !strcasecmp(value, "no") || !strcasecmp(value, "off"));
    return off ? std::numeric_limits<int64_t>::max() : AMX_ROWS;
  }()};
  return rows;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

template <typename Out, bool GATED>
void int8_matmul(const torch::Tensor& rows, const torch::Tensor& packed, const torch::Tensor& col_scale,
                 const torch::Tensor& col_sum, const float* bias, int64_t out_features, torch::Tensor& out) {
  const int64_t m = rows.size(0), k = rows.size(1), steps = packed.size(1);
#if defined(PAGEDSERVE_INT8_AMX)
  const bool tiles = m >= amx_rows().load(std::memory_order_relaxed) && amx::permitted();
  const int64_t ld = tiles ? int8_amx::row_stride(steps) : steps * INT8_UNIT;
  const int64_t u8_rows = tiles ? int8_amx::padded_rows(m) : m;
#else
  const int64_t ld = steps * INT8_UNIT, u8_rows = m;
#endif
  torch::Tensor u8 = torch::empty({u8_rows, ld}, rows.options().dtype(at::kByte));
  if (u8_rows > m) u8.narrow(0, m, u8_rows - m).zero_();  // whole A tiles: the padding rows multiply to 0
  torch::Tensor scales = torch::empty({m}, rows.options().dtype(at::kFloat));
  torch::Tensor zeros = torch::empty({m}, rows.options().dtype(at::kInt));
  if (rows.scalar_type() == at::kFloat)
    quantize_rows(rows.data_ptr<float>(), m, k, u8.data_ptr<uint8_t>(), ld, scales.data_ptr<float>(),
                  zeros.data_ptr<int32_t>());
  else
    quantize_rows(reinterpret_cast<const c10::BFloat16*>(rows.data_ptr()), m, k, u8.data_ptr<uint8_t>(), ld,
                  scales.data_ptr<float>(), zeros.data_ptr<int32_t>());
  const Int8Sink<Out> sink{reinterpret_cast<Out*>(out.data_ptr()), out_features, scales.data_ptr<float>(),
                           zeros.data_ptr<int32_t>(), col_scale.data_ptr<float>(), col_sum.data_ptr<int32_t>(),
                           bias, out_features};
#if defined(PAGEDSERVE_INT8_AMX)
  if (tiles) {
    int8_amx::run<GATED>(u8.data_ptr<uint8_t>(), ld, m, packed.data_ptr<int8_t>(), packed.size(0), steps, out_features,
                         sink);
    return;
  }
#endif
  linear_run<Int8Math, GATED>(reinterpret_cast<const uint32_t*>(u8.data_ptr()), m,
                              reinterpret_cast<const uint32_t*>(packed.data_ptr()), packed.size(0), steps, nullptr,
                              out_features, [&](int64_t) { return sink; });
}
#endif

// x [..., K] (float32 or bfloat16) through the int8 panels -> [..., out_features] in x's dtype.
template <bool GATED>
torch::Tensor int8_linear_impl(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& col_scale,
                               const torch::Tensor& col_sum, int64_t out_features,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(int8_linear_available(), "int8_linear needs a CPU with AVX512-VNNI");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "int8_linear runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_linear takes float32 or bfloat16 activations");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 4 &&
                  packed.is_contiguous(),
              "int8_linear: the packed weight must be a contiguous int8 [N / 16, K / 4, 16, 4] tensor");
  TORCH_CHECK(x.dim() >= 1 && (x.size(-1) + 3) / 4 == packed.size(1), "x's last dimension does not match the weight");
  TORCH_CHECK(out_features > 0, "out_features must be positive");
  const int64_t copies = GATED ? 2 : 1, columns = copies * out_features;
  TORCH_CHECK(copies * ((out_features + 15) / 16) == packed.size(0), "out_features does not match the weight");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.dim() == 1 && col_scale.size(0) == columns &&
                  col_scale.is_contiguous(),
              "col_scale must be a contiguous float32 [", columns, "]");
  TORCH_CHECK(col_sum.scalar_type() == at::kInt && col_sum.dim() == 1 && col_sum.size(0) == columns &&
                  col_sum.is_contiguous(),
              "col_sum must be a contiguous int32 [", columns, "]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == columns), "bias must be [", columns, "]");
  const int64_t k = x.size(-1);
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  torch::Tensor out = torch::empty(shape, x.options());
  if (rows.size(0) == 0) return out;
  const torch::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  const float* bias_ptr = bias ? bias_f.data_ptr<float>() : nullptr;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kFloat)
    int8_matmul<float, GATED>(rows, packed, col_scale, col_sum, bias_ptr, out_features, out);
  else
    int8_matmul<c10::BFloat16, GATED>(rows, packed, col_scale, col_sum, bias_ptr, out_features, out);
#endif
  return out;
}

}  // namespace

bool int8_linear_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// Whether batches can multiply on AMX-INT8 tiles here (the build has them and the OS grants them).
bool int8_amx_available() {
#if defined(PAGEDSERVE_INT8_AMX)
  return amx::permitted();
#else
  return false;
#endif
}

// The fewest rows that go to the tiles; sets it to `rows` (> 0) and returns the previous value.
int64_t set_int8_amx_rows(int64_t rows) {
  TORCH_CHECK(rows > 0, "the AMX row threshold must be positive");
  return amx_rows().exchange(rows);
}

// x [..., K], packed int8 [ceil(N / 16), ceil(K / 4), 16, 4], col_scale float32 [N], col_sum int32
// [N] (each column's weight sum), bias [N] or none -> [..., N] in x's dtype.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale, torch::Tensor col_sum,
                          int64_t out_features, c10::optional<torch::Tensor> bias) {
  return int8_linear_impl<false>(x, packed, col_scale, col_sum, out_features, bias);
}

// silu(gate) * up of a fused gate/up weight packed gated (blocks of two gate panels, then the up
// panels of the same columns); col_scale, col_sum and bias [2N]: the gates' then the ups'.
torch::Tensor int8_linear_silu(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale, torch::Tensor col_sum,
                               int64_t out_features, c10::optional<torch::Tensor> bias) {
  return int8_linear_impl<true>(x, packed, col_scale, col_sum, out_features, bias);
}

// (u8 [..., K], scales float32 [...], zero points int32 [...]) of x [..., K]: the quantization
// int8_linear applies (x ~ (u8 - zero) * scale).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> int8_quantize_rows(torch::Tensor x) {
  TORCH_CHECK(int8_linear_available(), "int8_quantize_rows needs a CPU with AVX512-VNNI");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_quantize_rows takes float32 or bfloat16 CPU tensors");
  const int64_t k = x.size(-1);
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> row_shape(x.sizes().begin(), x.sizes().end() - 1);
  torch::Tensor scales = torch::empty(row_shape, x.options().dtype(at::kFloat));
  torch::Tensor zeros = torch::empty(row_shape, x.options().dtype(at::kInt));
  torch::Tensor u8 = torch::empty({rows.size(0), (k + 3) / 4 * 4}, x.options().dtype(at::kByte));
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kFloat)
    quantize_rows(rows.data_ptr<float>(), rows.size(0), k, u8.data_ptr<uint8_t>(), u8.size(1),
                  scales.data_ptr<float>(), zeros.data_ptr<int32_t>());
  else
    quantize_rows(reinterpret_cast<const c10::BFloat16*>(rows.data_ptr()), rows.size(0), k, u8.data_ptr<uint8_t>(),
                  u8.size(1), scales.data_ptr<float>(), zeros.data_ptr<int32_t>());
#endif
  return {u8.narrow(1, 0, k).reshape(x.sizes()), scales, zeros};
}

TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor col_scale, Tensor col_sum, int out_features, Tensor? bias) -> Tensor");
  m.def(
      "int8_linear_silu(Tensor x, Tensor packed, Tensor col_scale, Tensor col_sum, int out_features, Tensor? bias) -> "
      "Tensor");
  m.def("int8_quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_silu", &int8_linear_silu);
  m.impl("int8_quantize_rows", &int8_quantize_rows);
}
