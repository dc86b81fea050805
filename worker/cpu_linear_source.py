"""C++ source of the bfloat16 matmuls of the CPU kernel extension (built by
`worker.attention.cpu_kernels`), registered as `pagedserve::bf16_linear` and
`pagedserve::bf16_linear_silu` so that compiled graphs call them without going
through Python.

`y = x @ W.T + b` with W packed once at load time (`worker.models.packed_linear`)
into panels of 16 output columns, each [K/2, 16, 2]: one 64-byte load gives the
16 columns of one pair of K, the operand layout of `vdpbf16ps`. A micro-kernel
keeps 8 rows x 48 columns (24 registers) of float32 accumulators over the
whole K, broadcasting a pair of x per row; threads split the output columns,
walk them once per 256 rows (whose x stays in L2), and prefetch the weights of
their next 48 columns while computing the current ones, because at decode
sizes every weight is read from DRAM once per step. Accumulation is float32
(bias included) and the result is rounded once to bfloat16 (round to nearest
even), as oneDNN and eager PyTorch do; only the summation order differs.

The gated version computes the MLP's `silu(gate) * up` from a fused gate/up
weight packed with each block's gate panels next to the up panels of the same
columns: a tile of 6 rows x (2 + 2) panels holds both factors of 32 outputs, and
its epilogue applies the activation in registers (`silu_mul_bf16`, rounding as
eager does) instead of writing [T, 2 x intermediate] and reading it back. For
a 4,096-token step that took 37 instead of 41 ms a layer.

Measured on this machine (2 cores, AVX512-BF16, vdpbf16ps peak ~466 GFLOP/s)
over the layers of SmolLM2-135M against oneDNN with pre-packed weights, side by
side: 64 rows ~400 vs ~350 GFLOP/s, 256 rows ~415 vs ~410, 4096 rows ~400 vs
~405 (within noise); tiles of 4 x 96 were 10 % slower, and K split into
L1-sized chunks slower still.
"""

LINEAR_SOURCE = r"""
bool bf16_linear_available();

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t LINEAR_LANES = 16;       // output columns per register
constexpr int64_t LINEAR_ROW_BLOCK = 256;  // rows whose x stays in L2 while a thread walks its blocks
// Plain: 8 rows x 3 panels (48 columns) of accumulators. Gated: 6 rows x 2 gate + 2 up panels
// (32 output columns), the gate and up panels of the same columns side by side in the packing.
constexpr int PLAIN_ROWS = 8, PLAIN_PANELS = 3, GATED_ROWS = 6, GATED_PANELS = 4;

inline __m512 widen_bf16(__m256bh v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

// Plain: out[r][0 .. 16 NV) = bias + sum over pairs p of x[r][p] . w[v][p], rounded to bf16.
// Gated (NV even, the first NV / 2 panels gates, the rest the ups of the same columns):
// out[r][0 .. 8 NV) = silu(gate) * up, each of gate, up, silu(gate) and the product rounded to
// bf16 as the plain matmul followed by eager F.silu(gate) * up rounds them. `cols` output columns are valid
// (the last panel may be partial). Issues one prefetch per pair for the first `prefetch_lines`
// lines at `prefetch` (at most `pairs` of them: a tile of few rows prefetches part of the next
// block; more per pair slowed the loop).
template <int R, int NV, bool GATED>
inline void linear_tile(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t panel, int64_t pairs,
                        const float* bias, const float* bias_up, c10::BFloat16* out, int64_t ldo, int64_t cols,
                        const char* prefetch, int64_t prefetch_lines) {
  constexpr int OUT = GATED ? NV / 2 : NV;  // output registers per row
  __mmask16 valid[OUT];
  for (int v = 0; v < OUT; ++v) {
    const int64_t left = cols - v * LINEAR_LANES;
    valid[v] = left >= LINEAR_LANES ? (__mmask16)0xFFFF : (__mmask16)(left > 0 ? (1u << left) - 1 : 0);
  }
  __m512 acc[R][NV];
  for (int v = 0; v < NV; ++v) {
    const int o = v % OUT;
    const float* bv = GATED && v >= OUT ? bias_up : bias;
    const __m512 b = bv ? _mm512_maskz_loadu_ps(valid[o], bv + o * LINEAR_LANES) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][v] = b;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(w + v * panel + p * LINEAR_LANES);
    if (p < prefetch_lines) _mm_prefetch(prefetch + p * 64, _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + p]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int v = 0; v < OUT; ++v)
    for (int r = 0; r < R; ++r) {
      __m256i result = (__m256i)_mm512_cvtneps_pbh(acc[r][v]);
      if constexpr (GATED) {  // the product is a bf16 value already (a tiny one may be subnormal,
                              // which vcvtneps2bf16 would flush): its top half is the result
        const __m512 product = silu_mul_bf16(widen_bf16((__m256bh)result),
                                             widen_bf16(_mm512_cvtneps_pbh(acc[r][v + OUT])));
        result = bf16_bits(product);
      }
      _mm256_mask_storeu_epi16(out + r * ldo + v * LINEAR_LANES, valid[v], result);
    }
}

// All m rows of one block of NV panels; the prefetch of the next block is spread over the row groups.
template <int ROWS, int NV, bool GATED>
void linear_block(const uint32_t* x, int64_t m, const uint32_t* w, int64_t panel, int64_t pairs, const float* bias,
                  const float* bias_up, c10::BFloat16* out, int64_t ldo, int64_t cols, const char* prefetch,
                  int64_t prefetch_lines) {
  const int64_t groups = (m + ROWS - 1) / ROWS;
  const int64_t per_group = (prefetch_lines + groups - 1) / groups;
  for (int64_t r = 0, g = 0; r < m; r += ROWS, ++g) {
    const int64_t lines = std::max<int64_t>(0, std::min(per_group, prefetch_lines - g * per_group));
    const char* ahead = prefetch + g * per_group * 64;
    const uint32_t* xr = x + r * pairs;
    c10::BFloat16* o = out + r * ldo;
#define PAGEDSERVE_TILE(R) linear_tile<R, NV, GATED>(xr, pairs, w, panel, pairs, bias, bias_up, o, ldo, cols, ahead, lines)
    switch (std::min<int64_t>(ROWS, m - r)) {
      case 8: if constexpr (ROWS >= 8) { PAGEDSERVE_TILE(8); } break;
      case 7: if constexpr (ROWS >= 7) { PAGEDSERVE_TILE(7); } break;
      case 6: PAGEDSERVE_TILE(6); break;
      case 5: PAGEDSERVE_TILE(5); break;
      case 4: PAGEDSERVE_TILE(4); break;
      case 3: PAGEDSERVE_TILE(3); break;
      case 2: PAGEDSERVE_TILE(2); break;
      default: PAGEDSERVE_TILE(1); break;
    }
#undef PAGEDSERVE_TILE
  }
}

// y [m, out_features] from x [m, pairs] (bf16 pairs) and `panels` packed panels: threads split
// the blocks of PANELS panels, walking them once per LINEAR_ROW_BLOCK rows and prefetching the
// weights of their next block while computing the current one. Gated, a block's panels are its
// gates then its ups, and its output columns are half its panel columns.
template <int ROWS, int PANELS, bool GATED>
void linear_run(const uint32_t* xp, int64_t m, const uint32_t* wp, int64_t panels, int64_t pairs, const float* b,
                c10::BFloat16* op, int64_t out_features) {
  constexpr int64_t OUT_PANELS = GATED ? PANELS / 2 : PANELS;
  const int64_t panel = pairs * LINEAR_LANES;  // uint32 per panel
  const int64_t blocks = (panels + PANELS - 1) / PANELS;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += LINEAR_ROW_BLOCK) {
      const int64_t rows_here = std::min<int64_t>(LINEAR_ROW_BLOCK, m - r0);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t first = blk * PANELS, nv = std::min<int64_t>(PANELS, panels - first);
        const int64_t col = blk * OUT_PANELS * LINEAR_LANES;
        const int64_t cols = std::min<int64_t>((GATED ? nv / 2 : nv) * LINEAR_LANES, out_features - col);
        // This thread's next block: its weights are contiguous after this block's.
        const int64_t ahead = blk + 1 < end ? std::min<int64_t>(PANELS, panels - first - nv) : 0;
        const char* prefetch = reinterpret_cast<const char*>(wp + (first + nv) * panel);
        const int64_t lines = ahead * panel * 4 / 64;
        const uint32_t* xr = xp + r0 * pairs;
        const uint32_t* w = wp + first * panel;
        const float* bb = b ? b + col : nullptr;
        const float* bu = b && GATED ? b + out_features + col : nullptr;
        c10::BFloat16* o = op + r0 * out_features + col;
#define PAGEDSERVE_BLOCK(NV) linear_block<ROWS, NV, GATED>(xr, rows_here, w, panel, pairs, bb, bu, o, out_features, cols, prefetch, lines)
        if constexpr (GATED) {
          if (nv == 4) PAGEDSERVE_BLOCK(4); else PAGEDSERVE_BLOCK(2);
        } else {
          if (nv == 3) PAGEDSERVE_BLOCK(3); else if (nv == 2) PAGEDSERVE_BLOCK(2); else PAGEDSERVE_BLOCK(1);
        }
#undef PAGEDSERVE_BLOCK
      }
    }
  });
}
#endif

// x [..., K] bf16 through a packed weight of `panels` panels -> [..., out_features]; GATED: the
// weight is a gated packing of twice out_features columns and the MLP's activation is applied.
template <bool GATED>
torch::Tensor packed_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(bf16_linear_available(), "bf16_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "bf16_linear runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16_linear takes bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed weight must be a contiguous [N / 16, K / 2, 16, 2] tensor");
  TORCH_CHECK(x.dim() >= 1 && (x.size(-1) + 1) / 2 == packed.size(1), "x's last dimension does not match the weight");
  TORCH_CHECK(out_features > 0, "out_features must be positive");
  const int64_t columns = (GATED ? 2 : 1) * out_features;  // of the weight, and of the bias
  TORCH_CHECK((GATED ? 2 : 1) * ((out_features + 15) / 16) == packed.size(0), "out_features does not match the weight");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == columns), "bias must be [", columns, "]");
  const int64_t k = x.size(-1);
  torch::Tensor rows = x.reshape({-1, k});
  if (k % 2) rows = at::constant_pad_nd(rows, {0, 1});  // the packed weight's padded K is zero
  rows = rows.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  torch::Tensor out = torch::empty(shape, x.options());
#if defined(__AVX512BF16__)
  if (rows.size(0) == 0) return out;
  const torch::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  constexpr int ROWS = GATED ? GATED_ROWS : PLAIN_ROWS, PANELS = GATED ? GATED_PANELS : PLAIN_PANELS;
  linear_run<ROWS, PANELS, GATED>(
      reinterpret_cast<const uint32_t*>(rows.data_ptr()), rows.size(0), reinterpret_cast<const uint32_t*>(packed.data_ptr()),
      packed.size(0), packed.size(1), bias ? bias_f.data_ptr<float>() : nullptr,
      reinterpret_cast<c10::BFloat16*>(out.data_ptr()), out_features);
#endif
  return out;
}

}  // namespace

bool bf16_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [..., K] bf16, packed [ceil(N / 16), K / 2, 16, 2] bf16 (see packed_linear), bias [N] or none -> [..., N].
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias) {
  return packed_matmul<false>(x, packed, out_features, bias);
}

// silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias) of a fused gate/up projection packed gated
// (see packed_linear.pack_gated): x [..., K], packed [2 ceil(N / 16), K / 2, 16, 2], bias [2N] or
// none -> [..., N]. Bit for bit bf16_linear followed by eager F.silu(gate) * up, without the [..., 2N] pass.
torch::Tensor bf16_linear_silu(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                               c10::optional<torch::Tensor> bias) {
  return packed_matmul<true>(x, packed, out_features, bias);
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("bf16_linear_silu(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_linear_silu", &bf16_linear_silu);
}
"""
