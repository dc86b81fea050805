// What every AMX kernel needs: the OS's permission to use the tile state (`permitted`) and a
// scope that configures eight 16 x 64-byte tiles for the running thread (`TileScope`). Shared by
// the bfloat16 attention tiles (amx_attention.h) and the int8 matmul tiles (int8_amx.h).
#pragma once

#include "vector_helpers.h"

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

namespace {
namespace amx {

// Linux hands out the AMX tile state only on request (once per process).
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures eight 16 x 64-byte tiles for this thread while alive (other code, oneDNN's
// included, configures its own, so every call sets ours again).
struct TileScope {
  TileScope() {
    TileConfig config;
    for (int i = 0; i < 8; ++i) {
      config.colsb[i] = 64;
      config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
};

}  // namespace amx
}  // namespace
#endif
