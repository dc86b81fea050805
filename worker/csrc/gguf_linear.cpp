// The GGUF quantized matmuls `pagedserve::gguf_linear` and `pagedserve::gguf_linear_silu`: y = x @ W.T
// (+ bias), or the gated MLP's silu(gate) * up, with W kept in its GGUF blocks (gguf_blocks.h) and
// x in bfloat16 or float32. Mostly the weights are dequantized to x's type and fed to the packed
// kernel's dot products (packed_linear.h), so the result is the packed matmul's over the dequantized
// weight rounded to x's type: bit for bit, both sum in K order. Few rows (decode) unpack each step's
// weights in registers; more rows dequantize one block of panels into a scratch packing and run
// the packed kernel's tiles over all rows from it. One exception, for speed: few bfloat16 rows
// times 4-bit weights (Q4_0, Q4_1, Q4_K) multiply by the 4-bit integers and apply each chunk's
// scale and offset after (`gguf_tile_affine4`), with the weights' exact values.
#include <vector>

#include "gguf_blocks.h"
#include "op_namespace.h"
#include "packed_linear.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t REGISTER_ROWS = 4;  // at most this many rows: weights unpacked in registers

// The packed kernel's step units of one chunk: M::Unit values, K order (float32: [G, 16];
// bf16: [G / 2, 16] pairs).
template <typename M, int BITS>
inline void dequantize_chunk(const uint8_t* chunk, int64_t g, int64_t header, typename M::Unit* out) {
  __m512 scale, offset;
  gguf_header(chunk, header, scale, offset);
  for (int64_t j = 0; j < g / 2; ++j) {
    __m512 w0, w1;
    unpack_pair<BITS>(chunk + header, scale, offset, g, j, w0, w1);
    if constexpr (std::is_same_v<M, F32Math>) {
      _mm512_storeu_ps(out + 2 * j * GGUF_ROWS, w0);
      _mm512_storeu_ps(out + (2 * j + 1) * GGUF_ROWS, w1);
    } else {
#if defined(__AVX512BF16__)
      _mm512_storeu_si512(out + j * GGUF_ROWS, (__m512i)gguf_bf16_pair(w0, w1));
#endif
    }
  }
}

// R rows x NV panels with the weights unpacked in registers each step; as linear_tile, whose
// accumulators, bias and sink handling this follows.
template <typename M, int BITS, int R, int NV, bool GATED, typename Sink>
inline void gguf_tile(const typename M::Unit* x, int64_t ldx, const uint8_t* w, int64_t panel_bytes, int64_t chunks,
                      int64_t g, int64_t chunk_bytes, int64_t header, const float* bias, const float* bias_up,
                      const Sink& sink, int64_t cols) {
  constexpr int OUT = GATED ? NV / 2 : NV;
  constexpr bool F32 = std::is_same_v<M, F32Math>;
  __mmask16 valid[OUT];
  __m512 acc[R][NV];
  tile_start<R, NV, GATED>(cols, bias, bias_up, valid, acc);
  const int64_t units_per_chunk = F32 ? g : g / 2;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* chunk[NV];
    __m512 scale[NV], offset[NV];
    for (int v = 0; v < NV; ++v) {
      chunk[v] = w + v * panel_bytes + c * chunk_bytes;
      const char* ahead = reinterpret_cast<const char*>(chunk[v] + 4 * chunk_bytes);  // 4 chunks on
      for (int64_t line = 0; line < chunk_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      gguf_header(chunk[v], header, scale[v], offset[v]);
    }
    const typename M::Unit* xc = x + c * units_per_chunk;
    for (int64_t j = 0; j < g / 2; ++j) {
      __m512 w0[NV], w1[NV];
      for (int v = 0; v < NV; ++v) unpack_pair<BITS>(chunk[v] + header, scale[v], offset[v], g, j, w0[v], w1[v]);
      if constexpr (F32) {
        for (int r = 0; r < R; ++r) {
          const __m512 a0 = _mm512_set1_ps(xc[r * ldx + 2 * j]);
          for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a0, w0[v], acc[r][v]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 a1 = _mm512_set1_ps(xc[r * ldx + 2 * j + 1]);
          for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a1, w1[v], acc[r][v]);
        }
      } else {
#if defined(__AVX512BF16__)
        typename M::Vec b[NV];
        for (int v = 0; v < NV; ++v) b[v] = gguf_bf16_pair(w0[v], w1[v]);
        for (int r = 0; r < R; ++r) {
          const typename M::Vec a = M::broadcast(xc[r * ldx + j]);
          for (int v = 0; v < NV; ++v) acc[r][v] = M::madd(acc[r][v], a, b[v]);
        }
#endif
      }
    }
  }
  tile_finish<R, NV, GATED>(sink, valid, acc);
}

#if defined(__AVX512BF16__)
// bfloat16 rows x 4-bit panels with gguf's exact weights: per chunk of 32 K values and row,
// A = sum_k x[k] * q[k] through vdpbf16ps with each 4-bit q as a bfloat16 integer (a table lookup,
// exact), then y += scale * A + offset * sum_k x[k] in float32. Four instructions per 32 weights
// (against ten to build each weight in float32 and round it to bfloat16), and the weights are
// scale * q + offset unrounded: y differs from the dequantized path's (weights rounded to
// bfloat16) by about one bfloat16 step of the weights.
template <int R, int NV, bool GATED, typename Sink>
inline void gguf_tile_affine4(const uint32_t* x, int64_t ldx, const uint8_t* w, int64_t panel_bytes, int64_t chunks,
                              int64_t chunk_bytes, int64_t header, const float* bias, const float* bias_up,
                              const Sink& sink, int64_t cols) {
  constexpr int64_t PAIRS = 16;  // pairs of K values per 4-bit chunk of 32
  constexpr int OUT = GATED ? NV / 2 : NV;
  __mmask16 valid[OUT];
  __m512 acc[R][NV];
  tile_start<R, NV, GATED>(cols, bias, bias_up, valid, acc);
  // bfloat16 of 0..15 (words 16..31 unused: the indices are 4-bit).
  const __m512i integers = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                            0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
                                            0x4040, 0x4000, 0x3F80, 0x0000);
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F), high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* chunk[NV];
    for (int v = 0; v < NV; ++v) {
      chunk[v] = w + v * panel_bytes + c * chunk_bytes;
      const char* ahead = reinterpret_cast<const char*>(chunk[v] + 4 * chunk_bytes);  // 4 chunks on
      for (int64_t line = 0; line < chunk_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    const uint32_t* xc = x + c * PAIRS;
    __m512 part[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) part[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < PAIRS; ++j) {
      __m512bh q[NV];
      for (int v = 0; v < NV; ++v) {
        // Byte r = q(r, k0) | q(r, k1) << 4 -> word 2r = q(r, k0), word 2r + 1 = q(r, k1) -> bfloat16.
        const __m512i e = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk[v] + header + 16 * j)));
        const __m512i words = _mm512_ternarylogic_epi32(e, _mm512_slli_epi32(e, 12), nibbles, 0xA8);  // (e | e << 12) & mask
        q[v] = (__m512bh)_mm512_permutexvar_epi16(words, integers);
      }
      for (int r = 0; r < R; ++r) {
        const __m512bh a = Bf16Math::broadcast(xc[r * ldx + j]);
        for (int v = 0; v < NV; ++v) part[r][v] = _mm512_dpbf16_ps(part[r][v], a, q[v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xc + r * ldx);  // the chunk's 32 bfloat16 values of row r
      const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_add_ps(
          _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16)), _mm512_castsi512_ps(_mm512_and_si512(xv, high_half)))));
      for (int v = 0; v < NV; ++v) {
        __m512 scale, offset;
        gguf_header(chunk[v], header, scale, offset);
        acc[r][v] = _mm512_fmadd_ps(scale, part[r][v], acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(offset, sum, acc[r][v]);
      }
    }
  }
  tile_finish<R, NV, GATED>(sink, valid, acc);
}
#endif

// All m (<= REGISTER_ROWS) rows of one block of NV panels, unpacked in registers.
template <typename M, int BITS, int NV, bool GATED, typename Sink>
void gguf_register_block(const typename M::Unit* x, int64_t m, int64_t ldx, const uint8_t* w, int64_t panel_bytes,
                         int64_t chunks, int64_t g, int64_t chunk_bytes, int64_t header, const float* bias,
                         const float* bias_up, const Sink& sink, int64_t cols) {
#define PAGEDSERVE_GGUF_GENERAL(R)                                                                      \
  gguf_tile<M, BITS, R, NV, GATED>(x, ldx, w, panel_bytes, chunks, g, chunk_bytes, header, bias, bias_up, \
                                   sink, cols)
#if defined(__AVX512BF16__)
#define PAGEDSERVE_GGUF_TILE(R)                                                                                    \
  if constexpr (std::is_same_v<M, Bf16Math> && BITS == 4)                                                       \
    gguf_tile_affine4<R, NV, GATED>(x, ldx, w, panel_bytes, chunks, chunk_bytes, header, bias, bias_up, sink, cols); \
  else                                                                                                           \
    PAGEDSERVE_GGUF_GENERAL(R);                                                                                  \
  break
#else
#define PAGEDSERVE_GGUF_TILE(R) \
  PAGEDSERVE_GGUF_GENERAL(R);   \
  break
#endif
  switch (m) {
    case 4:
      PAGEDSERVE_GGUF_TILE(4);
    case 3:
      PAGEDSERVE_GGUF_TILE(3);
    case 2:
      PAGEDSERVE_GGUF_TILE(2);
    default:
      PAGEDSERVE_GGUF_TILE(1);
  }
#undef PAGEDSERVE_GGUF_TILE
#undef PAGEDSERVE_GGUF_GENERAL
}

// y [m, out_features] from x [m, steps] (M::Unit steps) and `panels` quantized panels, threaded as
// linear_run: each thread claims the next unit from a shared counter. Few rows: a unit is one block
// of panels over all rows, unpacked in registers. More rows: a unit is a block of panels by a block
// of rows, ordered block of panels first so that a thread mostly reuses the block it dequantized
// into its scratch (the packed layout) for the next rows.
template <typename M, int BITS, bool GATED, typename Sink>
void gguf_run(const typename M::Unit* xp, int64_t m, int64_t steps, const uint8_t* wp, int64_t panels,
              int64_t chunks, int64_t g, int64_t chunk_bytes, int64_t header, const float* b, int64_t out_features,
              const Sink& sink) {
  constexpr int ROWS = GATED ? GATED_ROWS : PLAIN_ROWS, PANELS = GATED ? GATED_PANELS : PLAIN_PANELS;
  constexpr int64_t OUT_PANELS = GATED ? PANELS / 2 : PANELS;
  constexpr int64_t ROW_BLOCK = M::ROW_BLOCK / ROWS * ROWS;
  const int64_t panel_bytes = chunks * chunk_bytes, panel_units = steps * LINEAR_LANES;
  const int64_t blocks = (panels + PANELS - 1) / PANELS;
  const bool in_registers = m <= REGISTER_ROWS;
  const int64_t row_blocks = in_registers ? 1 : (m + ROW_BLOCK - 1) / ROW_BLOCK;
  const int64_t units = blocks * row_blocks;
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), units), 1, [&](int64_t, int64_t) {
    std::vector<typename M::Unit> scratch;
    int64_t scratch_block = -1;
    for (int64_t unit = next_unit++; unit < units; unit = next_unit++) {
      const int64_t blk = unit / row_blocks, r0 = unit % row_blocks * ROW_BLOCK;
      const int64_t rows_here = in_registers ? m : std::min<int64_t>(ROW_BLOCK, m - r0);
      const int64_t first = blk * PANELS, nv = std::min<int64_t>(PANELS, panels - first);
      const int64_t col = blk * OUT_PANELS * LINEAR_LANES;
      const int64_t cols = std::min<int64_t>((GATED ? nv / 2 : nv) * LINEAR_LANES, out_features - col);
      const float* bb = b ? b + col : nullptr;
      const float* bu = b && GATED ? b + out_features + col : nullptr;
      const uint8_t* w = wp + first * panel_bytes;
      const auto o = sink.at(r0, col);
      const typename M::Unit* xr = xp + r0 * steps;
      if (in_registers) {
        with_block_panels<GATED>(nv, [&](auto panels) {
          gguf_register_block<M, BITS, decltype(panels)::value, GATED>(xr, rows_here, steps, w, panel_bytes, chunks,
                                                                       g, chunk_bytes, header, bb, bu, o, cols);
        });
        continue;
      }
      if (scratch_block != blk) {
        scratch.resize(PANELS * panel_units);
        const int64_t units_per_chunk = panel_units / chunks;
        for (int64_t v = 0; v < nv; ++v)
          for (int64_t c = 0; c < chunks; ++c)
            dequantize_chunk<M, BITS>(w + v * panel_bytes + c * chunk_bytes, g, header,
                                      scratch.data() + v * panel_units + c * units_per_chunk);
        scratch_block = blk;
      }
      const typename M::Unit* s = scratch.data();
      with_block_panels<GATED>(nv, [&](auto panels) {
        linear_block<M, ROWS, decltype(panels)::value, GATED>(xr, rows_here, s, panel_units, steps, bb, bu, o, cols,
                                                              nullptr, 0);
      });
    }
  });
}

template <typename M, bool GATED, typename Sink>
void gguf_dispatch(const GgufLayout& layout, const typename M::Unit* xp, int64_t m, int64_t steps, const uint8_t* wp,
                   int64_t panels, int64_t chunks, int64_t chunk_bytes, const float* b, int64_t out_features,
                   const Sink& sink) {
  const int64_t g = layout.g, header = layout.header;
  if (layout.bits == 4)
    gguf_run<M, 4, GATED>(xp, m, steps, wp, panels, chunks, g, chunk_bytes, header, b, out_features, sink);
  else if (layout.bits == 6)
    gguf_run<M, 6, GATED>(xp, m, steps, wp, panels, chunks, g, chunk_bytes, header, b, out_features, sink);
  else
    gguf_run<M, 8, GATED>(xp, m, steps, wp, panels, chunks, g, chunk_bytes, header, b, out_features, sink);
}
#endif

// The chunk layout of a packed weight [panels, chunks, chunk_bytes] for K input columns.
GgufLayout checked_layout(const torch::Tensor& packed, int64_t k) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.is_contiguous(),
              "gguf_linear: the packed weight must be a contiguous uint8 CPU tensor [panels, chunks, chunk_bytes]");
  GgufLayout layout;
#if defined(__AVX512F__)
  layout = gguf_layout_of(packed.size(2));
#endif
  TORCH_CHECK(layout.bits, "gguf_linear: chunks of ", packed.size(2), " bytes match no layout");
  TORCH_CHECK(packed.size(1) * layout.g == k, "gguf_linear: x's ", k, " columns are not the weight's ",
              packed.size(1), " chunks of ", layout.g);
  return layout;
}

// Rows from which a bfloat16 matmul allowed the dense route (on AMX CPUs; see
// worker.models.packed_linear) dequantizes the weight and multiplies it through ATen (oneDNN's
// AMX tiles): from about here the tiles outrun the 4-bit kernel by more than the dequantizing costs.
constexpr int64_t kGgufDenseMinRows = 64;

// The plain row of packed panel p's first row: in order, or for a gated packing (blocks of two gate
// panels, then the two up panels of the same columns; the last block may hold one of each) gate
// rows first, then the up rows from `out_features` on. *index: the panel's first row within its half.
inline int64_t dense_row(int64_t p, int64_t panels, bool gated, int64_t out_features, int64_t* index) {
  if (!gated) return *index = p * GGUF_ROWS;
  const int64_t base = p / 4 * 4, half = std::min<int64_t>(4, panels - base) / 2, within = p - base;
  *index = (base / 2 + (within < half ? within : within - half)) * GGUF_ROWS;
  return (within < half ? 0 : out_features) + *index;
}

// The packed weight as the plain bfloat16 [copies x out_features, K] it stands for (each value
// gguf's, rounded once to bfloat16), the layout F.linear takes: a chunk's [G, 16] values are
// turned into 16 rows of G through a small scratch.
torch::Tensor dense_weight(const torch::Tensor& packed, const GgufLayout& layout, int64_t k, int64_t out_features,
                           bool gated) {
  const int64_t panels = packed.size(0), chunks = packed.size(1), chunk_bytes = packed.size(2), g = layout.g;
  torch::Tensor out = torch::empty({(gated ? 2 : 1) * out_features, k}, torch::dtype(at::kBFloat16));
#if defined(__AVX512BF16__)
  TORCH_CHECK(g % 2 == 0 && g <= 64, "gguf_linear: groups of ", g, " are not dequantized densely");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());  // bf16 pairs along K
  const int64_t pairs_per_row = k / 2, pairs = g / 2;
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t end) {
    alignas(64) uint32_t scratch[32 * GGUF_ROWS];  // [pair j][row r]
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t p = first; p < end; ++p) {
      int64_t index;
      const int64_t row0 = dense_row(p, panels, gated, out_features, &index);
      const int64_t valid = std::min<int64_t>(GGUF_ROWS, out_features - index);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* chunk = w + (p * chunks + c) * chunk_bytes;
        __m512 scale, offset;
        gguf_header(chunk, layout.header, scale, offset);
        for (int64_t j = 0; j < pairs; ++j) {
          __m512 w0, w1;
          if (layout.bits == 4) unpack_pair<4>(chunk + layout.header, scale, offset, g, j, w0, w1);
          else if (layout.bits == 6) unpack_pair<6>(chunk + layout.header, scale, offset, g, j, w0, w1);
          else unpack_pair<8>(chunk + layout.header, scale, offset, g, j, w0, w1);
          _mm512_store_si512(scratch + j * GGUF_ROWS, (__m512i)gguf_bf16_pair(w0, w1));
        }
        for (int64_t r = 0; r < valid; ++r) {
          uint32_t* row = dst + (row0 + r) * pairs_per_row + c * pairs;
          for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
            const __mmask16 mask = (__mmask16)((1u << std::min<int64_t>(16, pairs - j0)) - 1);
            const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(iota, _mm512_set1_epi32(j0)),
                                                                   _mm512_set1_epi32(GGUF_ROWS)),
                                                _mm512_set1_epi32(r));
            _mm512_mask_storeu_epi32(row + j0, mask,
                                     _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, at, scratch, 4));
          }
        }
      }
    }
  });
#endif
  return out;
}

template <bool GATED>
torch::Tensor gguf_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                          const c10::optional<torch::Tensor>& bias, bool dense) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "gguf_linear runs on CPU tensors");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "gguf_linear takes bfloat16 or float32");
  TORCH_CHECK(bf16 ? bf16_linear_available() : f32_linear_available(),
              bf16 ? "gguf_linear in bfloat16 needs a CPU with AVX512-BF16" : "gguf_linear needs a CPU with AVX-512");
  const int64_t k = x.size(-1);
  const GgufLayout layout = checked_layout(packed, k);
  const int64_t copies = GATED ? 2 : 1;
  TORCH_CHECK(out_features > 0 && copies * ((out_features + 15) / 16) == packed.size(0),
              "gguf_linear: out_features does not match the weight");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == copies * out_features), "bias must be [",
              copies * out_features, "]");
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  if (dense && bf16 && rows.size(0) >= kGgufDenseMinRows)
    return aten_linear(rows, dense_weight(packed, layout, k, out_features, GATED), out_features, bias, GATED)
        .view(shape);
  torch::Tensor out = torch::empty(shape, x.options());
  if (rows.size(0) == 0) return out;
  const torch::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  const float* b = bias ? bias_f.data_ptr<float>() : nullptr;
  const uint8_t* w = packed.data_ptr<uint8_t>();
#if defined(__AVX512F__)
  if (!bf16) {
    const StoreSink<F32Math> sink{out.data_ptr<float>(), out_features};
    gguf_dispatch<F32Math, GATED>(layout, rows.data_ptr<float>(), rows.size(0), k, w, packed.size(0), packed.size(1),
                                  packed.size(2), b, out_features, sink);
  }
#endif
#if defined(__AVX512BF16__)
  if (bf16) {
    const StoreSink<Bf16Math> sink{reinterpret_cast<c10::BFloat16*>(out.data_ptr()), out_features};
    gguf_dispatch<Bf16Math, GATED>(layout, reinterpret_cast<const uint32_t*>(rows.data_ptr()), rows.size(0), k / 2, w,
                                   packed.size(0), packed.size(1), packed.size(2), b, out_features, sink);
  }
#endif
  return out;
}

}  // namespace

// x [..., K], packed [ceil(N / 16), K / G, chunk bytes] (gguf_blocks.h), bias [N] or none -> [..., N].
// dense: bfloat16 batches of kGgufDenseMinRows rows or more may go through the dequantized weight.
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias, bool dense) {
  return gguf_matmul<false>(x, packed, out_features, bias, dense);
}

// silu(gate) * up of a fused gate/up weight packed gated (panels in blocks of two gate panels then
// the two up panels of the same columns, as packed_linear.pack_gated): [..., K] -> [..., N].
torch::Tensor gguf_linear_silu(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                               c10::optional<torch::Tensor> bias, bool dense) {
  return gguf_matmul<true>(x, packed, out_features, bias, dense);
}

// The float32 weights [16 panels, K] a packed weight holds (what the matmuls multiply by), for tests.
torch::Tensor gguf_dequantize(torch::Tensor packed, int64_t k) {
  const GgufLayout layout = checked_layout(packed, k);
  const int64_t g = layout.g;
  torch::Tensor out = torch::empty({packed.size(0), k, 16}, torch::kFloat);
#if defined(__AVX512F__)
  const int64_t chunks = packed.size(1), chunk_bytes = packed.size(2);
  for (int64_t p = 0; p < packed.size(0); ++p)
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* chunk = packed.data_ptr<uint8_t>() + (p * chunks + c) * chunk_bytes;
      float* dst = out.data_ptr<float>() + (p * k + c * g) * 16;
      if (layout.bits == 4)
        dequantize_chunk<F32Math, 4>(chunk, g, layout.header, dst);
      else if (layout.bits == 6)
        dequantize_chunk<F32Math, 6>(chunk, g, layout.header, dst);
      else
        dequantize_chunk<F32Math, 8>(chunk, g, layout.header, dst);
    }
#endif
  return out.permute({0, 2, 1}).reshape({packed.size(0) * 16, k});
}

TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("gguf_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, bool dense=False) -> Tensor");
  m.def("gguf_linear_silu(Tensor x, Tensor packed, int out_features, Tensor? bias, bool dense=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_linear_silu", &gguf_linear_silu);
}
