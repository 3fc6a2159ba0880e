// bf16 products on Intel AMX tiles (feature "amx"): the avx512-amx build's gemm_bf16.
//
// AMX (Sapphire Rapids and later) multiplies bf16 in tiles: TDPBF16PS adds to a 16 x 16
// float32 tile C the products of a 16 x 32 bf16 tile A and a 32 x 16 one B, held as 16
// rows of 16 pairs, each pair two consecutive K-dims of one column: the very layout
// simd::gemm_bf16 reads (A(r, pair p) at a + r ars + 2 p, B(pair p, col) at b + p ldb + 2
// col). So amx::gemm_bf16 is the same product with the same arguments, in tiles: whole
// 16-row strips of A and whole 16-pair runs of K; rows and pairs past the last whole tile
// go through simd::gemm_bf16 (vdpbf16ps). Every product of two bf16 is exact in float32;
// only the order of the float32 sums differs from vdpbf16ps's (as between any two tilings).
//
// The tiles are a per-thread state that other code (torch's oneDNN micro-kernels) uses too,
// and that Linux hands a process only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, Linux
// 5.16 and later). So:
// * usable(): asked once per process; where Linux refuses, every product takes
//   simd::gemm_bf16, the avx512-bf16 build's (the results differ only in rounding order);
// * a thread loads attnkit's tile configuration on its first product and keeps the one it
//   found (_tile_storeconfig); the outermost Scope (one in each thread's part of a
//   parallel call, one around each exported call, one in any product outside those) puts
//   it back when it ends, or releases the tiles where none was loaded: code that left its
//   own configuration loaded (torch's oneDNN micro-kernels keep theirs between calls on a
//   thread) finds it again, and attnkit never trusts a configuration it did not load
//   within the same Scope.
#pragma once

#include "simd.h"

#if defined(ATTNKIT_AMX)

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// Linux's request for the AMX tile data state (arch/x86/include/uapi/asm/prctl.h).
constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

// Whether this process may use the tiles (asked once; a forked child keeps the answer).
inline bool usable() {
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

// The LDTILECFG memory layout (palette 1: up to 8 tiles of up to 16 rows x 64 bytes).
struct alignas(64) Config {
  uint8_t palette = 0, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C, a 2 x 2 block of 16 x 16 float32; 4-5: two strips of A; 6-7: two column
// runs of B. Every tile is 16 rows of 64 bytes.
inline const Config &ours() {
  static const Config config = [] {
    Config c;
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  return config;
}

struct ThreadState {
  int scopes = 0;       // Scopes open on this thread
  bool loaded = false;  // attnkit's configuration is loaded (only ever inside a Scope)
  Config found;         // ... and the one it replaced (palette 0: none)
};
inline ThreadState &state() {
  static thread_local ThreadState s;
  return s;
}

// attnkit's use of the tiles on this thread, from its first product to the end of the
// outermost Scope, which puts back the configuration found (or releases the tiles where
// none was loaded). A product outside every Scope opens one of its own.
struct Scope {
  Scope() { ++state().scopes; }
  Scope(const Scope &) = delete;
  Scope &operator=(const Scope &) = delete;
  ~Scope() {
    ThreadState &s = state();
    if (--s.scopes > 0 || !s.loaded) return;
    if (s.found.palette != 0)
      _tile_loadconfig(&s.found);
    else
      _tile_release();
    s.loaded = false;
  }
};

// Loads attnkit's configuration on this thread unless it is (inside a Scope).
inline void configure() {
  ThreadState &s = state();
  if (s.loaded) return;
  _tile_storeconfig(&s.found);
  _tile_loadconfig(&ours());
  s.loaded = true;
}

// C (tile rows [r0, r0 + 16 NR), columns [c0, c0 + 16 NC)) = C + A B (ACC) or A B, over
// the first kp16 pairs (a multiple of 16). Tile numbers are immediates: one instance per
// block shape.
template <int NR, int NC, bool ACC>
inline void block(float *c, int64_t ldc, const uint16_t *a, int64_t ars, const uint16_t *b,
                  int64_t ldb, int64_t kp16) {
  const int64_t sc = ldc * 4, sa = ars * 2, sb = ldb * 2;  // strides in bytes
  if constexpr (ACC) {
    _tile_loadd(0, c, sc);
    if constexpr (NC > 1) _tile_loadd(1, c + 16, sc);
    if constexpr (NR > 1) _tile_loadd(2, c + 16 * ldc, sc);
    if constexpr (NR > 1 && NC > 1) _tile_loadd(3, c + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (NC > 1) _tile_zero(1);
    if constexpr (NR > 1) _tile_zero(2);
    if constexpr (NR > 1 && NC > 1) _tile_zero(3);
  }
  for (int64_t p = 0; p < kp16; p += 16) {
    _tile_loadd(4, a + 2 * p, sa);
    _tile_loadd(6, b + p * ldb, sb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NC > 1) {
      _tile_loadd(7, b + p * ldb + 32, sb);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NR > 1) {
      _tile_loadd(5, a + 16 * ars + 2 * p, sa);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NC > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, sc);
  if constexpr (NC > 1) _tile_stored(1, c + 16, sc);
  if constexpr (NR > 1) _tile_stored(2, c + 16 * ldc, sc);
  if constexpr (NR > 1 && NC > 1) _tile_stored(3, c + 16 * ldc + 16, sc);
}

// simd::gemm_bf16's product (same arguments and result; `cols` a multiple of 16) on the
// tiles; returns false (row_max is never set: the tiles leave their sums in memory only).
template <bool ACC>
inline bool gemm_bf16(float *c, int64_t ldc, int64_t rows, int64_t cols, const uint16_t *a,
                      int64_t ars, const uint16_t *b, int64_t ldb, int64_t kp,
                      const float *alpha, float * /*row_max*/ = nullptr) {
  const int64_t rows16 = rows & ~int64_t(15), kp16 = kp & ~int64_t(15);
  if (!usable() || rows16 == 0 || kp16 == 0) {
    simd::gemm_bf16<ACC>(c, ldc, rows, cols, a, ars, b, ldb, kp, alpha);
    return false;
  }
  if (ACC && alpha) {  // C's rescale first, row by row where it is not 1
    for (int64_t r = 0; r < rows16; ++r) {
      if (alpha[r] == 1.0f) continue;
      const simd::vf al = simd::splat(alpha[r]);
      for (int64_t j = 0; j < cols; j += simd::W)
        simd::store(c + r * ldc + j, simd::load(c + r * ldc + j) * al);
    }
  }
  const Scope scope;  // (a no-op inside the caller's)
  configure();
  for (int64_t r0 = 0; r0 < rows16; r0 += 32) {
    const bool two_rows = rows16 - r0 >= 32;
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
      const bool two_cols = cols - c0 >= 32;
      float *cc = c + r0 * ldc + c0;
      const uint16_t *aa = a + r0 * ars, *bb = b + 2 * c0;
      if (two_rows && two_cols)
        block<2, 2, ACC>(cc, ldc, aa, ars, bb, ldb, kp16);
      else if (two_rows)
        block<2, 1, ACC>(cc, ldc, aa, ars, bb, ldb, kp16);
      else if (two_cols)
        block<1, 2, ACC>(cc, ldc, aa, ars, bb, ldb, kp16);
      else
        block<1, 1, ACC>(cc, ldc, aa, ars, bb, ldb, kp16);
    }
  }
  if (kp16 < kp)  // the last pairs, added on
    simd::gemm_bf16<true>(c, ldc, rows16, cols, a + 2 * kp16, ars, b + kp16 * ldb, ldb,
                          kp - kp16, nullptr);
  if (rows16 < rows)  // the last rows, whole
    simd::gemm_bf16<ACC>(c + rows16 * ldc, ldc, rows - rows16, cols, a + rows16 * ars, ars, b,
                         ldb, kp, alpha ? alpha + rows16 : nullptr);
  return false;
}

}  // namespace amx

#endif  // ATTNKIT_AMX
