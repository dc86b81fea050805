// W8A8 matmuls of batches on AMX-INT8 tiles (`_tile_dpbusd`, u8 x s8 -> int32): the same u8
// activations and int8 panels as the VNNI loop (int8_linear.h), the same `Int8Sink` epilogue, and
// so the same bits (integer sums are exact in any order). A panel's 16 K steps are 16 rows of
// 64 bytes: a B tile as packed. The u8 rows lie [rows padded to 16][ld], ld = K steps padded to
// 16 (x 4 bytes), the padding zeros: a K tail's A columns are zero, and its B rows come from a
// zero-padded copy (the panel's last rows, so that no tile reads past the weight). Per unit of
// up to 256 rows x 4 panels (one gated block: 2 gates, then their 2 ups), each thread multiplies
// 32 rows x 2 panels at a time (tiles: C 0-3, A 4-5, B 6-7), stores C to its scratch and
// finishes those rows there (gated, the pair is a gate panel and its up).
#pragma once

#include "amx_tiles.h"
#include "int8_linear.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDSERVE_INT8_AMX 1

namespace {
namespace int8_amx {

constexpr int64_t TILE_ROWS = 16;     // rows of an A (and C) tile
constexpr int64_t CHUNK_STEPS = 16;   // K steps of 4 per tile: 64 bytes
constexpr int64_t TILE_BYTES = 1024;  // one B tile: 16 steps of a panel
constexpr int64_t ROW_BLOCK = 256;    // rows of a unit (their u8 stays in L2 while the weights pass)
constexpr int64_t PAIR_ROWS = 2 * TILE_ROWS;
constexpr int64_t BLOCK_PANELS = 4;  // panels of a unit: a gated packing's block
constexpr int64_t PAIR_COLS = 2 * LINEAR_LANES;  // int32 per scratch row: two panels

// The u8 row stride for `steps` K steps: whole tiles.
inline int64_t row_stride(int64_t steps) { return (steps + CHUNK_STEPS - 1) / CHUNK_STEPS * CHUNK_STEPS * INT8_UNIT; }
inline int64_t padded_rows(int64_t m) { return (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS; }

// One K chunk: A tiles from a (rows 16 apart, stride lda), B tiles b0, b1 (stride 64), into C.
#define PAGEDSERVE_INT8_CHUNK(RT, PT, a, lda, b0, b1) \
  do {                                                \
    _tile_loadd(4, (a), (lda));                       \
    if constexpr (RT > 1) _tile_loadd(5, (a) + TILE_ROWS * (lda), (lda)); \
    _tile_loadd(6, (b0), 64);                         \
    _tile_dpbusd(0, 4, 6);                            \
    if constexpr (RT > 1) _tile_dpbusd(2, 5, 6);      \
    if constexpr (PT > 1) {                           \
      _tile_loadd(7, (b1), 64);                       \
      _tile_dpbusd(1, 4, 7);                          \
      if constexpr (RT > 1) _tile_dpbusd(3, 5, 7);    \
    }                                                 \
  } while (0)

// c [16 RT rows][16 PT columns] (int32, row stride PAIR_COLS) = u8 rows a x the panels at w and
// w + apart: `full` whole chunks, then the tail chunk from `tail` (two zero-padded B tiles) if set.
template <int RT, int PT>
inline void product(const uint8_t* a, int64_t lda, const int8_t* w, int64_t apart, int64_t full, const int8_t* tail,
                    int32_t* c) {
  _tile_zero(0);
  if constexpr (PT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && PT > 1) _tile_zero(3);
  for (int64_t ch = 0; ch < full; ++ch) {
    const int8_t* b = w + ch * TILE_BYTES;
    PAGEDSERVE_INT8_CHUNK(RT, PT, a + ch * 64, lda, b, b + apart);
  }
  if (tail != nullptr) PAGEDSERVE_INT8_CHUNK(RT, PT, a + full * 64, lda, tail, tail + TILE_BYTES);
  constexpr int64_t ldc = PAIR_COLS * sizeof(int32_t);
  _tile_stored(0, c, ldc);
  if constexpr (PT > 1) _tile_stored(1, c + LINEAR_LANES, ldc);
  if constexpr (RT > 1) _tile_stored(2, c + TILE_ROWS * PAIR_COLS, ldc);
  if constexpr (RT > 1 && PT > 1) _tile_stored(3, c + TILE_ROWS * PAIR_COLS + LINEAR_LANES, ldc);
}
#undef PAGEDSERVE_INT8_CHUNK

// `rows` rows of a pair's int32 sums through the sink (at the pair's first output column), `cols`
// of them valid: plain, the two panels' columns (`two`: the second one is there); gated, one
// register of silu(gate) * up, the gates in the first panel and the ups in the second.
template <bool GATED, typename Sink>
inline void finish(const Sink& sink, const int32_t* c, int64_t rows, bool two, int64_t cols) {
  auto mask = [&](int64_t v) {
    const int64_t left = cols - v * LINEAR_LANES;
    return left >= LINEAR_LANES ? (__mmask16)0xFFFF : (__mmask16)(left > 0 ? (1u << left) - 1 : 0);
  };
  auto acc = [&](int64_t r, int64_t v) {
    return _mm512_castsi512_ps(_mm512_load_si512(c + r * PAIR_COLS + v * LINEAR_LANES));
  };
  const __mmask16 first = mask(0), second = mask(1);
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (GATED) {
      sink.put_gated(static_cast<int>(r), 0, first, acc(r, 0), acc(r, 1));
    } else {
      sink.put(static_cast<int>(r), 0, first, acc(r, 0));
      if (two) sink.put(static_cast<int>(r), 1, second, acc(r, 1));
    }
  }
}

// y = the sink's rows for u8 [padded_rows(m), ld] x `panels` int8 panels of `steps` K steps.
// Units (ROW_BLOCK rows x BLOCK_PANELS panels, row blocks first) are claimed from a shared
// counter, as linear_run does: a slower core does fewer. In a unit, pair by pair of panels (plain:
// neighbours; gated: a gate and its up), 32 rows at a time: the pair's weights stay in L1.
template <bool GATED, typename Sink>
void run(const uint8_t* u8, int64_t ld, int64_t m, const int8_t* wp, int64_t panels, int64_t steps,
         int64_t out_features, const Sink& sink) {
  const int64_t panel = steps * INT8_UNIT * LINEAR_LANES;  // bytes per panel
  const int64_t full = steps / CHUNK_STEPS, rest = steps % CHUNK_STEPS;
  const int64_t blocks = (panels + BLOCK_PANELS - 1) / BLOCK_PANELS;
  const int64_t units = (m + ROW_BLOCK - 1) / ROW_BLOCK * blocks;
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), units), 1, [&](int64_t, int64_t) {
    amx::TileScope tiles;
    alignas(64) int32_t scratch[PAIR_ROWS * PAIR_COLS];
    alignas(64) int8_t tail[2 * TILE_BYTES] = {};  // rows past `rest` stay zero
    for (int64_t unit = next_unit++; unit < units; unit = next_unit++) {
      const int64_t r0 = unit / blocks * ROW_BLOCK, first = unit % blocks * BLOCK_PANELS;
      const int64_t rows_here = std::min<int64_t>(ROW_BLOCK, m - r0), nv = std::min<int64_t>(BLOCK_PANELS, panels - first);
      const int64_t pairs = GATED ? nv / 2 : (nv + 1) / 2;
      for (int64_t j = 0; j < pairs; ++j) {
        // Gated: gate j and its up nv / 2 panels on; plain: panels 2j and 2j + 1.
        const int64_t p = GATED ? j : 2 * j, apart = GATED ? nv / 2 * panel : panel;
        const bool two = GATED || nv - p > 1;
        const int8_t* w = wp + (first + p) * panel;
        const int64_t col = (GATED ? first / 2 + j : first + p) * LINEAR_LANES;
        const int64_t cols = std::min<int64_t>((GATED ? 1 : 2) * LINEAR_LANES, out_features - col);
        if (rest) {
          std::memcpy(tail, w + full * TILE_BYTES, rest * 64);
          if (two) std::memcpy(tail + TILE_BYTES, w + apart + full * TILE_BYTES, rest * 64);
        }
        const int8_t* t = rest ? tail : nullptr;
        for (int64_t r = 0; r < rows_here; r += PAIR_ROWS) {
          const int64_t n = std::min<int64_t>(PAIR_ROWS, rows_here - r);
          const uint8_t* a = u8 + (r0 + r) * ld;
          if (n > TILE_ROWS)
            two ? product<2, 2>(a, ld, w, apart, full, t, scratch) : product<2, 1>(a, ld, w, apart, full, t, scratch);
          else
            two ? product<1, 2>(a, ld, w, apart, full, t, scratch) : product<1, 1>(a, ld, w, apart, full, t, scratch);
          finish<GATED>(sink.at(r0 + r, col), scratch, n, two, cols);
        }
      }
    }
  });
}

}  // namespace int8_amx
}  // namespace
#endif
