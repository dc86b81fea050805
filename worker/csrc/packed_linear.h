// The packed matmul driver shared by the packed linear layers and the screened lm_heads:
// `linear_run` walks y [m, N] = x [m, K] @ W.T in tiles of rows x panels of 16 output columns
// (W packed once at load time, `worker.models.packed_linear`), each tile's float32 accumulators
// held over the whole K and handed to a sink (`StoreSink` writes them; the lm_head sinks keep an
// argmax or a screen's candidates). Element types: float32 (`F32Math`, any AVX-512 CPU: panels
// [K, 16, 1], one FMA per K step, each output the products summed in K order whatever the batch)
// and bfloat16 (`Bf16Math`, AVX512-BF16: panels [K/2, 16, 2] for vdpbf16ps, rounded once to
// bfloat16). `checked_rows` checks a call's arguments against the packing.
#pragma once

#include <atomic>
#include <type_traits>

#include "bf16_rounding.h"
#include "kernels.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t LINEAR_LANES = 16;  // output columns per register
// Plain: 8 rows x 3 panels (48 columns) of accumulators. Gated: 6 rows x 2 gate + 2 up panels
// (32 output columns), the gate and up panels of the same columns side by side in the packing.
constexpr int PLAIN_ROWS = 8, PLAIN_PANELS = 3, GATED_ROWS = 6, GATED_PANELS = 4;

// float32: a step is one K value; x and the panels hold floats.
struct F32Math {
  using Unit = float;
  using Vec = __m512;
  using Out = float;
  static constexpr int64_t ROW_BLOCK = 128;  // rows whose x stays in L2 next to a block's weights
  static inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
  static inline __m512 madd(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
  static inline void store(float* out, __mmask16 valid, __m512 acc) { _mm512_mask_storeu_ps(out, valid, acc); }
  // eager float32 F.silu(gate) * up: gate / (1 + exp(-gate)), times up.
  static inline void store_gated(float* out, __mmask16 valid, __m512 gate, __m512 up) {
    const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate)));
    store(out, valid, _mm512_mul_ps(_mm512_div_ps(gate, denominator), up));
  }
};

#if defined(__AVX512BF16__)
inline __m512 widen_bf16(__m256bh v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

// bfloat16: a step is one pair of K values (one uint32); vdpbf16ps.
struct Bf16Math {
  using Unit = uint32_t;
  using Vec = __m512bh;
  using Out = c10::BFloat16;
  static constexpr int64_t ROW_BLOCK = 256;
  static inline Vec load(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static inline Vec broadcast(uint32_t x) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(x)); }
  static inline __m512 madd(__m512 acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, a, b); }
  static inline void store(c10::BFloat16* out, __mmask16 valid, __m512 acc) {
    _mm256_mask_storeu_epi16(out, valid, (__m256i)_mm512_cvtneps_pbh(acc));
  }
  // The product is a bf16 value already (a tiny one may be subnormal, which vcvtneps2bf16
  // would flush): its top half is the result.
  static inline void store_gated(c10::BFloat16* out, __mmask16 valid, __m512 gate, __m512 up) {
    const __m512 product = silu_mul_bf16(widen_bf16(_mm512_cvtneps_pbh(gate)), widen_bf16(_mm512_cvtneps_pbh(up)));
    _mm256_mask_storeu_epi16(out, valid, bf16_bits(product));
  }
};
#endif

// Where a tile's results go. `at(row, col)` is the sink of the tile whose first result is that row
// and column (relative to this sink); `put` takes output register v of tile row r.
template <typename M>
struct StoreSink {  // the rows of y [m, ldo]
  typename M::Out* out;
  int64_t ldo;
  StoreSink at(int64_t row, int64_t col) const { return {out + row * ldo + col, ldo}; }
  void put(int r, int v, __mmask16 valid, __m512 acc) const { M::store(out + r * ldo + v * LINEAR_LANES, valid, acc); }
  void put_gated(int r, int v, __mmask16 valid, __m512 gate, __m512 up) const {
    M::store_gated(out + r * ldo + v * LINEAR_LANES, valid, gate, up);
  }
};

// Whether a sink has `kTail`: then linear_tile hands it the accumulators (`tail(acc)`) before the puts.
template <typename S, typename = void>
struct SinkHasTail : std::false_type {};
template <typename S>
struct SinkHasTail<S, std::void_t<decltype(S::kTail)>> : std::true_type {};

// A tile's start, shared by the matmul tiles (here and gguf_linear.cpp): the valid lanes of each of
// the OUT = (GATED ? NV / 2 : NV) output registers (`cols` valid columns; the last panel may be
// partial) and the R x NV accumulators set to the bias (gated: the gates' then the ups').
template <int R, int NV, bool GATED>
inline void tile_start(int64_t cols, const float* bias, const float* bias_up, __mmask16* valid, __m512 (&acc)[R][NV]) {
  constexpr int OUT = GATED ? NV / 2 : NV;
  for (int v = 0; v < OUT; ++v) {
    const int64_t left = cols - v * LINEAR_LANES;
    valid[v] = left >= LINEAR_LANES ? (__mmask16)0xFFFF : (__mmask16)(left > 0 ? (1u << left) - 1 : 0);
  }
  for (int v = 0; v < NV; ++v) {
    const int o = v % OUT;
    const float* bv = GATED && v >= OUT ? bias_up : bias;
    const __m512 b = bv ? _mm512_maskz_loadu_ps(valid[o], bv + o * LINEAR_LANES) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][v] = b;
  }
}

// A tile's end: the accumulators to the sink (a sink with `kTail` gets them first, `tail(acc)`).
template <int R, int NV, bool GATED, typename Sink>
inline void tile_finish(const Sink& sink, const __mmask16* valid, __m512 (&acc)[R][NV]) {
  constexpr int OUT = GATED ? NV / 2 : NV;
  if constexpr (SinkHasTail<Sink>::value) sink.tail(acc);  // a sink that finishes the accumulators itself
  for (int v = 0; v < OUT; ++v)
    for (int r = 0; r < R; ++r) {
      if constexpr (GATED)
        sink.put_gated(r, v, valid[v], acc[r][v], acc[r][v + OUT]);
      else
        sink.put(r, v, valid[v], acc[r][v]);
    }
}

// Plain: out[r][0 .. 16 NV) = bias + sum over steps p of x[r][p] . w[v][p].
// Gated (NV even, the first NV / 2 panels gates, the rest the ups of the same columns):
// out[r][0 .. 8 NV) = silu(gate) * up (bf16: each of gate, up, silu(gate) and the product
// rounded as the plain matmul followed by eager F.silu(gate) * up rounds them). `cols` output
// columns are valid (the last panel may be partial). Issues one prefetch per step for the
// first `prefetch_lines` lines at `prefetch` (at most `steps` of them: a tile of few rows
// prefetches part of the next block; more per step slowed the bf16 loop).
template <typename M, int R, int NV, bool GATED, typename Sink>
inline void linear_tile(const typename M::Unit* x, int64_t ldx, const typename M::Unit* w, int64_t panel, int64_t steps,
                        const float* bias, const float* bias_up, const Sink& sink, int64_t cols, const char* prefetch,
                        int64_t prefetch_lines) {
  constexpr int OUT = GATED ? NV / 2 : NV;  // output registers per row
  __mmask16 valid[OUT];
  __m512 acc[R][NV];
  tile_start<R, NV, GATED>(cols, bias, bias_up, valid, acc);
  for (int64_t p = 0; p < steps; ++p) {
    typename M::Vec b[NV];
    for (int v = 0; v < NV; ++v) b[v] = M::load(w + v * panel + p * LINEAR_LANES);
    if (p < prefetch_lines) _mm_prefetch(prefetch + p * 64, _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      const typename M::Vec a = M::broadcast(x[r * ldx + p]);
      for (int v = 0; v < NV; ++v) acc[r][v] = M::madd(acc[r][v], a, b[v]);
    }
  }
  tile_finish<R, NV, GATED>(sink, valid, acc);
}

// All m rows of one block of NV panels; the prefetch of the next block is spread over the row groups.
template <typename M, int ROWS, int NV, bool GATED, typename Sink>
void linear_block(const typename M::Unit* x, int64_t m, const typename M::Unit* w, int64_t panel, int64_t steps,
                  const float* bias, const float* bias_up, const Sink& sink, int64_t cols, const char* prefetch,
                  int64_t prefetch_lines) {
  const int64_t groups = (m + ROWS - 1) / ROWS;
  const int64_t per_group = (prefetch_lines + groups - 1) / groups;
  for (int64_t r = 0, g = 0; r < m; r += ROWS, ++g) {
    const int64_t lines = std::max<int64_t>(0, std::min(per_group, prefetch_lines - g * per_group));
    const char* ahead = prefetch + g * per_group * 64;
    const typename M::Unit* xr = x + r * steps;
    const Sink o = sink.at(r, 0);
#define PAGEDSERVE_TILE(R) \
  linear_tile<M, R, NV, GATED>(xr, steps, w, panel, steps, bias, bias_up, o, cols, ahead, lines)
    switch (std::min<int64_t>(ROWS, m - r)) {
      case 8:
        if constexpr (ROWS >= 8) {
          PAGEDSERVE_TILE(8);
        }
        break;
      case 7:
        if constexpr (ROWS >= 7) {
          PAGEDSERVE_TILE(7);
        }
        break;
      case 6:
        PAGEDSERVE_TILE(6);
        break;
      case 5:
        PAGEDSERVE_TILE(5);
        break;
      case 4:
        PAGEDSERVE_TILE(4);
        break;
      case 3:
        PAGEDSERVE_TILE(3);
        break;
      case 2:
        PAGEDSERVE_TILE(2);
        break;
      default:
        PAGEDSERVE_TILE(1);
        break;
    }
#undef PAGEDSERVE_TILE
  }
}

// Calls f(std::integral_constant<int, NV>) for a block of `nv` panels: the compile-time panel
// counts a block can have (plain: 3, 2 or 1; gated: 4 or 2).
template <bool GATED, typename F>
inline void with_block_panels(int64_t nv, F&& f) {
  if constexpr (GATED) {
    if (nv == 4)
      f(std::integral_constant<int, 4>{});
    else
      f(std::integral_constant<int, 2>{});
  } else {
    if (nv == 3)
      f(std::integral_constant<int, 3>{});
    else if (nv == 2)
      f(std::integral_constant<int, 2>{});
    else
      f(std::integral_constant<int, 1>{});
  }
}

// y [m, out_features] from x [m, steps] and `panels` packed panels. The work is cut into units of
// M::ROW_BLOCK rows (whose x stays in L2) by one block of PANELS panels, row blocks first; each
// thread claims the next unit from a shared counter one unit ahead, so that it can prefetch that
// unit's weights while computing the current one (at decode sizes every weight is read from DRAM
// once per step). Claimed this way rather than split evenly up front, a core that runs slower
// (a busier neighbour on a shared host, a slower memory stream) does fewer units instead of
// keeping the other waiting: an even split left both cores waiting 6 % of the matmul time.
// Gated, a block's panels are its gates then its ups, and its output columns are half its
// panel columns.
template <typename M, bool GATED, typename SinkFor>
void linear_run(const typename M::Unit* xp, int64_t m, const typename M::Unit* wp, int64_t panels, int64_t steps,
                const float* b, int64_t out_features, const SinkFor& sink_for) {
  constexpr int ROWS = GATED ? GATED_ROWS : PLAIN_ROWS, PANELS = GATED ? GATED_PANELS : PLAIN_PANELS;
  constexpr int64_t OUT_PANELS = GATED ? PANELS / 2 : PANELS;
  // Whole tiles per row block: a 6-row gated tile leaves 2 rows of 128 to a tile that runs at half speed.
  constexpr int64_t ROW_BLOCK = M::ROW_BLOCK / ROWS * ROWS;
  const int64_t panel = steps * LINEAR_LANES;  // units per panel
  const int64_t blocks = (panels + PANELS - 1) / PANELS;
  const int64_t units = (m + ROW_BLOCK - 1) / ROW_BLOCK * blocks;
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), units), 1, [&](int64_t slot, int64_t) {
    const auto sink = sink_for(slot);
    for (int64_t unit = next_unit++; unit < units;) {
      const int64_t ahead = next_unit++;
      const int64_t r0 = unit / blocks * ROW_BLOCK, blk = unit % blocks;
      const int64_t rows_here = std::min<int64_t>(ROW_BLOCK, m - r0);
      const int64_t first = blk * PANELS, nv = std::min<int64_t>(PANELS, panels - first);
      const int64_t col = blk * OUT_PANELS * LINEAR_LANES;
      const int64_t cols = std::min<int64_t>((GATED ? nv / 2 : nv) * LINEAR_LANES, out_features - col);
      // The next unit's weights, unless it uses this block's again or there is none.
      const int64_t ahead_first = ahead < units ? ahead % blocks * PANELS : first;
      const int64_t ahead_panels = ahead_first == first ? 0 : std::min<int64_t>(PANELS, panels - ahead_first);
      const char* prefetch = reinterpret_cast<const char*>(wp + ahead_first * panel);
      const int64_t lines = ahead_panels * panel * static_cast<int64_t>(sizeof(typename M::Unit)) / 64;
      const typename M::Unit* xr = xp + r0 * steps;
      const typename M::Unit* w = wp + first * panel;
      const float* bb = b ? b + col : nullptr;
      const float* bu = b && GATED ? b + out_features + col : nullptr;
      const auto o = sink.at(r0, col);
      with_block_panels<GATED>(nv, [&](auto panels) {
        linear_block<M, ROWS, decltype(panels)::value, GATED>(xr, rows_here, w, panel, steps, bb, bu, o, cols,
                                                              prefetch, lines);
      });
      unit = ahead;
    }
  });
}
#endif

// x's rows [rows, K padded to the packing's steps], after checking x, the packing (`gated`: a
// gated packing of twice out_features columns) and the bias against each other.
torch::Tensor checked_rows(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                           const c10::optional<torch::Tensor>& bias, bool gated) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear runs on CPU tensors");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "packed_linear takes bfloat16 or float32");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), "packed_linear: x and the packed weight differ in dtype");
  TORCH_CHECK(bf16 ? bf16_linear_available() : f32_linear_available(),
              bf16 ? "packed_linear in bfloat16 needs a CPU with AVX512-BF16"
                   : "packed_linear in float32 needs a CPU with AVX-512");
  const int64_t unit = bf16 ? 2 : 1;  // K values per step
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == unit && packed.is_contiguous(),
              "packed weight must be a contiguous [N / 16, K / ", unit, ", 16, ", unit, "] tensor");
  TORCH_CHECK(x.dim() >= 1 && (x.size(-1) + unit - 1) / unit == packed.size(1),
              "x's last dimension does not match the weight");
  TORCH_CHECK(out_features > 0, "out_features must be positive");
  const int64_t copies = gated ? 2 : 1, columns = copies * out_features;  // of the weight, and of the bias
  TORCH_CHECK(copies * ((out_features + 15) / 16) == packed.size(0), "out_features does not match the weight");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == columns), "bias must be [", columns, "]");
  const int64_t k = x.size(-1);
  torch::Tensor rows = x.reshape({-1, k});
  if (k % unit) rows = at::constant_pad_nd(rows, {0, unit - k % unit});  // the packed weight's padded K is zero
  return rows.contiguous();
}

// x @ weight.T + bias through ATen's F.linear (oneDNN), the route on AMX CPUs; `gated`: weight is
// a fused gate/up [2N, K] and the result silu(gate) * up as eager PyTorch computes it. The plain and
// the GGUF matmuls both end here, so the dequantized and the GGUF model give the same bits.
// silu(gate) * up of y [..., 2N] (gates first) -> [..., N]: one vectorized pass for bfloat16,
// rounded where eager rounds (silu_mul_bf16); other dtypes through ATen.
inline torch::Tensor silu_mul(const torch::Tensor& y, int64_t n) {
#if defined(__AVX512F__)
  if (y.scalar_type() == torch::kBFloat16 && y.is_contiguous() && n > 0) {
    std::vector<int64_t> sizes = y.sizes().vec();
    sizes.back() = n;
    torch::Tensor out = torch::empty(sizes, y.options());
    const int64_t rows = y.numel() / (2 * n);
    const auto* src = reinterpret_cast<const c10::BFloat16*>(y.data_ptr());
    auto* dst = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const c10::BFloat16* gate = src + r * 2 * n;
        c10::BFloat16* o = dst + r * n;
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 mask = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
          _mm256_mask_storeu_epi16(o + j, mask,
                                   bf16_bits(silu_mul_bf16(load16(mask, gate + j), load16(mask, gate + n + j))));
        }
      }
    });
    return out;
  }
#endif
  return at::silu(y.narrow(-1, 0, n)).mul_(y.narrow(-1, n, n));
}

inline torch::Tensor aten_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t out_features,
                                 const c10::optional<torch::Tensor>& bias, bool gated) {
  torch::Tensor y = at::linear(x, weight, bias);
  return gated ? silu_mul(y, out_features) : y;
}

}  // namespace
