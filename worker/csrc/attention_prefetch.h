// How decode items of the AVX-512 attention path get their K/V into L2: `stream_kv` reads an
// item's K/V with plain sequential loads before its compute starts, and `ReadAhead` prefetches
// the thread's next item's K/V while the current one computes, so that memory and compute
// overlap instead of taking turns.
#pragma once

#include "attention_common.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t STREAM_MAX_QUERIES = 2;  // longer items are compute-bound: their loads overlap

// Reads the K and V cache rows of positions [first, end) of a sequence, block by block, with
// plain loads (two streams side by side), so that an item's K/V sit in L2 before its compute
// starts. Short (decode) items otherwise run at a third of the memory bandwidth: their strided,
// compute-interleaved reads keep few misses in flight, and the chunk-ahead software prefetches
// (which still pay off from L2 to L1) come too late to hide DRAM latency.
template <typename Q, typename T>
inline void stream_kv(const Problem<Q, T>& p, int64_t seq, int64_t first, int64_t end) {
  const int32_t* table = p.block_tables + seq * p.max_blocks;
  const int64_t row_bytes = p.kv_heads * p.dim * static_cast<int64_t>(sizeof(T));
  const char* k_base = reinterpret_cast<const char*>(p.k_cache);
  const char* v_base = reinterpret_cast<const char*>(p.v_cache);
  __m512i sink_a = _mm512_setzero_si512(), sink_b = _mm512_setzero_si512();
  for (int64_t pos = first; pos < end;) {
    const int64_t block = pos / p.block_size, offset = pos % p.block_size;
    const int64_t n = std::min<int64_t>(p.block_size - offset, end - pos);
    const int64_t start = (table[block] * p.block_size + offset) * row_bytes, bytes = n * row_bytes;
    const char* k = k_base + start;
    const char* v = v_base + start;
    int64_t b = 0;
    for (; b + 128 <= bytes; b += 128) {
      sink_a = _mm512_or_si512(sink_a, _mm512_or_si512(_mm512_loadu_si512(k + b), _mm512_loadu_si512(v + b)));
      sink_b = _mm512_or_si512(sink_b, _mm512_or_si512(_mm512_loadu_si512(k + b + 64), _mm512_loadu_si512(v + b + 64)));
    }
    for (; b + 64 <= bytes; b += 64)
      sink_a = _mm512_or_si512(sink_a, _mm512_or_si512(_mm512_loadu_si512(k + b), _mm512_loadu_si512(v + b)));
    pos += n;
  }
  volatile int keep = _mm512_reduce_or_epi32(_mm512_or_si512(sink_a, sink_b));  // loads must stay
  (void)keep;
}

// The next decode item's K/V, fetched into L2 while the current item computes: a cursor over its
// cache lines that issues an even share of prefetches after each (chunk, KV head) step of the
// current item's two passes. Alone, stream_kv leaves the memory idle during compute; with this,
// the next item finds its K/V in L2 (decode attention B/A 0.73-0.85 in alternating A/B at
// 64 x 370 and 256 x 170 positions; prefetching into L1 instead evicted the working set).
template <typename Q, typename T>
class ReadAhead {
 public:
  // `steps`: how many times step() will be called over the current item.
  ReadAhead(const Problem<Q, T>& p, const WorkItem* next, int64_t steps)
      : p_(p), row_bytes_(p.kv_heads * p.dim * static_cast<int64_t>(sizeof(T))) {
    if (!next || next->num_queries > STREAM_MAX_QUERIES) return;
    const ItemGeometry g(p, *next);
    table_ = p.block_tables + next->seq * p.max_blocks;
    pos_ = g.key_lo;
    end_ = g.key_hi;
    per_step_ = ((end_ - pos_) * row_bytes_ / 64 + steps - 1) / std::max<int64_t>(1, steps);
  }

  bool active() const { return pos_ < end_; }
  bool reading() const { return table_ != nullptr; }  // whether there is a next item to read

  inline void step() {
    const char* k_base = reinterpret_cast<const char*>(p_.k_cache);
    const char* v_base = reinterpret_cast<const char*>(p_.v_cache);
    for (int64_t left = per_step_; left > 0 && pos_ < end_;) {
      const int64_t block = pos_ / p_.block_size, offset = pos_ % p_.block_size;
      const int64_t n = std::min<int64_t>(p_.block_size - offset, end_ - pos_);
      const int64_t start = (table_[block] * p_.block_size + offset) * row_bytes_, bytes = n * row_bytes_;
      for (; byte_ < bytes && left > 0; byte_ += 64, --left) {
        _mm_prefetch(k_base + start + byte_, _MM_HINT_T1);
        _mm_prefetch(v_base + start + byte_, _MM_HINT_T1);
      }
      if (byte_ >= bytes) {
        pos_ += n;
        byte_ = 0;
      }
    }
  }

 private:
  const Problem<Q, T>& p_;
  const int64_t row_bytes_;
  const int32_t* table_ = nullptr;
  int64_t pos_ = 0, end_ = 0, byte_ = 0, per_step_ = 0;  // byte_: within the block run at pos_
};
#endif

}  // namespace
