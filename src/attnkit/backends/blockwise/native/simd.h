// attnkit's SIMD layer: one vector type at the native width of the target, the few
// operations the kernel needs on it, and the register tile its products use.
//
// GCC/Clang vector extensions at exactly the hardware's width, so that every operation
// (arithmetic, compares, selects, widening a byte mask) maps to one instruction and
// nothing is lowered to scalar code:
//
//   target                         W (floats)   registers   register tile (rows x vectors)
//   AVX-512 (x86-64-v4)            16           32          6 x 4   (24 accumulators)
//   AVX2 + FMA (x86-64-v3)          8           16          3 x 4   (12 accumulators)
//   aarch64 NEON                    4           32          6 x 4   (24 accumulators)
//
// (The AVX2 tile is 3 x 4, not the usual 6 x 2: each row's broadcast feeds 4 FMAs, and a
// step of the product issues 3 broadcasts, 3 loads and 3 FMAs reading B's fourth vector
// from memory (17 registers would hold it) instead of 6 broadcasts and 2 loads. The
// AVX2 build's forward, causal T=4096 d=64 on 1 thread of a Zen 4 held to AVX2 (session
// 18, interleaved A/B): 76.6% -> 78.2-78.5% of the FMA peak, the same bits; 4 x 3 gave
// 76.8%. On the Zen 3 of sessions 11 and 13 it measured 0.975-1.01x of 6 x 2.)
// Any other target is an #error: the Python side then runs torch's kernel and says why.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ATTNKIT_W 16
#define ATTNKIT_TILE_R_ 6
#define ATTNKIT_TILE_C_ 4
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ATTNKIT_BF16 1
#define ATTNKIT_AMX 1  // (amx.h: bf16 products on AMX tiles)
#define ATTNKIT_ISA "avx512-amx"
#elif defined(__AVX512BF16__)
#define ATTNKIT_BF16 1
#define ATTNKIT_ISA "avx512-bf16"
#else
#define ATTNKIT_ISA "avx512"
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTNKIT_W 8
#define ATTNKIT_TILE_R_ 3
#define ATTNKIT_TILE_C_ 4
#define ATTNKIT_TILE_T_R_ 6  // (gemm_t: 3 x 4 there took 6-9% more of the backward's time)
#define ATTNKIT_TILE_T_C_ 2
#define ATTNKIT_ISA "avx2"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define ATTNKIT_W 4
#define ATTNKIT_TILE_R_ 6
#define ATTNKIT_TILE_C_ 4
#define ATTNKIT_ISA "neon"
#include <arm_neon.h>
#else
#error "attnkit's kernel is built for AVX-512, AVX2+FMA or aarch64 NEON"
#endif

#ifndef ATTNKIT_TILE_R  // (-D overrides, to tune a target)
#define ATTNKIT_TILE_R ATTNKIT_TILE_R_
#endif
#ifndef ATTNKIT_TILE_C
#define ATTNKIT_TILE_C ATTNKIT_TILE_C_
#endif
#ifndef ATTNKIT_TILE_T_R_  // (gemm_t's tile: the same where a target sets none)
#define ATTNKIT_TILE_T_R_ ATTNKIT_TILE_R
#define ATTNKIT_TILE_T_C_ ATTNKIT_TILE_C
#endif
#ifndef ATTNKIT_TILE_T_R
#define ATTNKIT_TILE_T_R ATTNKIT_TILE_T_R_
#endif
#ifndef ATTNKIT_TILE_T_C
#define ATTNKIT_TILE_T_C ATTNKIT_TILE_T_C_
#endif

namespace simd {

constexpr int W = ATTNKIT_W;
constexpr int TILE_R = ATTNKIT_TILE_R;  // rows of a register tile
constexpr int TILE_C = ATTNKIT_TILE_C;  // vectors of a register tile
constexpr int TILE_T_R = ATTNKIT_TILE_T_R, TILE_T_C = ATTNKIT_TILE_T_C;  // (gemm_t)

typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint8_t vb __attribute__((vector_size(W)));

// (Not vf{} + x: adding 0.0 is no identity for -0.0, so that costs an add and a shuffle.)
inline vf splat(float x) {
#if ATTNKIT_W == 16
  return (vf)_mm512_set1_ps(x);
#elif ATTNKIT_W == 8
  return (vf)_mm256_set1_ps(x);
#else
  return (vf)vdupq_n_f32(x);
#endif
}
inline vf load(const float *p) {
  vf r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
inline void store(float *p, vf x) { std::memcpy(p, &x, sizeof x); }
inline vf select(vi keep, vf a, vf b) { return keep ? a : b; }
// a > b ? a : b, lane by lane (so b where either is NaN): x86's max instruction is
// exactly that (GCC writes the ternary as a compare and a blend, two instructions).
inline vf vmax(vf a, vf b) {
#if ATTNKIT_W == 16
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif ATTNKIT_W == 8
  return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return a > b ? a : b;
#endif
}
// Lanes whose byte is nonzero (W bytes at p).
inline vi nonzero(const uint8_t *p) {
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi) != 0;
}
// W bf16 values (the high halves of float32s) at p, as float32 lanes: each widened and
// shifted into the high half (two instructions on every target).
inline vf load_bf16(const uint16_t *p) {
#if ATTNKIT_W == 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif ATTNKIT_W == 8
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
  return (vf)vshll_n_u16(vld1_u16(p), 16);
#endif
}
inline vi lanes() {
  vi r;
  for (int l = 0; l < W; ++l) r[l] = l;
  return r;
}

// Reductions of the lanes (log2 W shuffles deep). hmax: a NaN lane may or may not win.
inline float hsum(vf x) {
#if ATTNKIT_W == 16
  return _mm512_reduce_add_ps((__m512)x);
#elif ATTNKIT_W == 8
  __m128 v = _mm_add_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
#else
  return vaddvq_f32((float32x4_t)x);
#endif
}
inline float hmax(vf x) {
#if ATTNKIT_W == 16
  return _mm512_reduce_max_ps((__m512)x);
#elif ATTNKIT_W == 8
  __m128 v = _mm_max_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
  v = _mm_max_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_max_ss(v, _mm_movehdup_ps(v)));
#else
  return vmaxvq_f32((float32x4_t)x);
#endif
}
// out[x] = the sum of the lanes of v[x], x < 4: four reductions as one transposing tree
// (a few shuffles for all four instead of log2 W for each).
inline void hsum4(const vf *v, float *out) {
#if ATTNKIT_W == 16
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps((__m512)v[0], (__m512)v[1]),
                                  _mm512_unpackhi_ps((__m512)v[0], (__m512)v[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps((__m512)v[2], (__m512)v[3]),
                                  _mm512_unpackhi_ps((__m512)v[2], (__m512)v[3]));
  // per 128-bit lane: the four rows' partial sums, in order
  const __m512 u = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#elif ATTNKIT_W == 8
  const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps((__m256)v[0], (__m256)v[1]),
                                  _mm256_unpackhi_ps((__m256)v[0], (__m256)v[1]));
  const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps((__m256)v[2], (__m256)v[3]),
                                  _mm256_unpackhi_ps((__m256)v[2], (__m256)v[3]));
  const __m256 u = _mm256_add_ps(
      _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t1))),
      _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t1))));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
#else
  const float32x4_t p01 = vpaddq_f32((float32x4_t)v[0], (float32x4_t)v[1]);
  const float32x4_t p23 = vpaddq_f32((float32x4_t)v[2], (float32x4_t)v[3]);
  vst1q_f32(out, vpaddq_f32(p01, p23));
#endif
}
inline bool any(vi x) {  // some lane nonzero
  int32_t t[W];
  std::memcpy(t, &x, sizeof t);
  int32_t r = 0;
  for (int l = 0; l < W; ++l) r |= t[l];
  return r != 0;
}
inline bool any_nan(vf x) {
  float t[W];
  store(t, x);
  for (int l = 0; l < W; ++l)
    if (t[l] != t[l]) return true;
  return false;
}

// e^x, 1-2 ulp; 0 below -87.3 (and for -inf); NaN stays NaN. 2^n e^r with
// n = round(x / ln 2), |r| <= ln 2 / 2, a degree-6 polynomial for e^r (Cephes' expf).
inline vf exp(vf x) {
  const vf tiny = splat(-87.33f);
  const vi dead = x < tiny;
  x = select(dead, tiny, x);
  const vf shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = x * splat(1.44269504088896341f) + shifter;
  const vf n = t - shifter;
  const vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const vi bits = (vi)t - (vi)shifter;  // n as an integer
  const vf scale = (vf)((bits + 127) << 23);
  return select(dead, splat(0.0f), p * scale);
}

// 2^x = 2^n 2^r, the range reduction of exp2() and exp2_bf16(): n = round(x), r = x - n in
// [-1/2, 1/2] (set), and what exp2_scale() needs to multiply 2^r by 2^n (returned).
// AVX-512 (feature "kfwd3"): n and r one instruction each (vrndscaleps, vreduceps, which
// gives r = 0 for +-inf) and 2^n applied by vscalefps (0 for n = -inf or below the
// subnormals, NaN stays NaN): three instructions where the portable reduction below takes
// six, of the 16 or so a weight costs (its two products: 128 FMAs).
// Elsewhere: x clamped to >= -127 (2^-127 is +0 here, so -inf gives 0), n rounded by
// adding 1.5 * 2^23 + 127, whose low bits then hold n + 127: 2^n's bits, returned.
#if ATTNKIT_W == 16
inline vf exp2_reduce(vf x, vf &r) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  r = (vf)_mm512_reduce_ps((__m512)x, nearest);
  return (vf)_mm512_roundscale_ps((__m512)x, nearest);  // n
}
inline vf exp2_scale(vf p, vf n) { return (vf)_mm512_scalef_ps((__m512)p, (__m512)n); }
#else
inline vf exp2_reduce(vf x, vf &r) {
  typedef uint32_t vu __attribute__((vector_size(4 * W)));
  x = vmax(splat(-127.0f), x);  // (vmax(a, b) is b when b is NaN)
  const vf shifter = splat(12583039.0f);
  const vf t = x + shifter;
  r = x - (t - shifter);
  return (vf)((vu)t << 23);  // (n + 127) << 23: 2^n (+0 for n = -127)
}
inline vf exp2_scale(vf p, vf scale) { return p * scale; }
#endif

// 2^x for x <= 127, within 2.3 ulp; 0 below -127 (AVX-512: below the subnormals, -149) and
// for -inf; NaN stays NaN; exact for whole x >= -126 (O's rescale by a power of 2). The
// forward's softmax works in base 2 (its scores pre-multiplied by log2(e)), which saves
// exp()'s multiply and its two-part reduction: 2^n 2^r (exp2_reduce) and 2^r = 1 + r P(r),
// P of degree 4 fitted to 2^r's relative error on [-1/2, 1/2] by attnkit (max 9.1e-8,
// float32's rounding step: 6e-8 to 1.2e-7).
// (kfwd3) Degree 5 (max 2e-9, 1.2 ulp) took 1.008x the forward's time on AVX-512 (causal
// T=8192, 2 threads, native_ab, session 23) and left its error against float64 the same.
#if ATTNKIT_W == 8
// (kfwd4) AVX2: 2^x = 2^(k/8) 2^r, k = round(8x), r = x - k/8 in [-1/16, 1/16], so that
// a cubic does (max relative error 2.5e-8, fitted by attnkit; 1.9 ulp in all). Adding
// S0 = 1.5 * 2^20 + 127 to x rounds it to 1/8 and leaves 127 * 8 + k in t's low bits:
// t << 20 puts 127 + floor(k/8) in the exponent field and k mod 8 in the 3 bits below it,
// and the table entry for k mod 8 (vpermd reads an index's low 3 bits only) swaps those
// for the mantissa of 2^((k mod 8) / 8). x is clamped to -127 first: k = -1016 gives +0.
// Two FMAs fewer than the portable exp2 for one permute and one integer add: the AVX2
// forward 0.991-0.993x the time (causal, T=4096 on 1 thread and 8192 on 2; session 25).
inline vf exp2(vf x) {
  x = vmax(splat(-127.0f), x);  // (NaN stays)
  const vf shifter = splat(1572991.0f);
  const vf t = x + shifter;
  const vf r = x - (t - shifter);
  const __m256i table = _mm256_setr_epi32(0, -289342, -509968, -655657, -719629, -694486,
                                          -572163, -343865);  // 2^(j/8)'s mantissa - j << 20
  const vf scale = (vf)(((vi)t << 20) + (vi)_mm256_permutevar8x32_epi32(table, (__m256i)t));
  vf p = splat(5.549622327e-2f);
  p = p * r + splat(2.402576357e-1f);
  p = p * r + splat(6.931472421e-1f);
  p = p * r + splat(1.0f);
  return p * scale;
}
#else
inline vf exp2(vf x) {
  vf r;
  const vf scale = exp2_reduce(x, r);
  vf p = splat(1.3264724e-3f);
  p = p * r + splat(9.671513e-3f);
  p = p * r + splat(5.5507336e-2f);
  p = p * r + splat(2.4022242e-1f);
  p = p * r + splat(6.931470e-1f);
  p = p * r + splat(1.0f);
  return exp2_scale(p, scale);
}
#endif

// (feature "kfwd2") 2^x as exp2() but within 1.1e-4 relative: P of degree 2 (fitted as
// above). For weights that are then rounded to bf16 (a relative step of 2^-8), where the
// two FMAs fewer are a tenth of the softmax's work and the error is 1/40 of the rounding's.
inline vf exp2_bf16(vf x) {
  vf r;
  const vf scale = exp2_reduce(x, r);
  vf p = splat(5.5008929e-2f);
  p = p * r + splat(2.4221097e-1f);
  p = p * r + splat(6.9328290e-1f);
  p = p * r + splat(1.0f);
  return exp2_scale(p, scale);
}

// x rounded up to a whole multiple of `step`, a power of 2 (x itself where it is one;
// infinities and NaN stay).
inline vf round_up(vf x, float step) {
  x *= splat(1.0f / step);
#if ATTNKIT_W == 16
  x = (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
#elif ATTNKIT_W == 8
  x = (vf)_mm256_round_ps((__m256)x, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
#else
  x = (vf)vrndpq_f32((float32x4_t)x);
#endif
  return x * splat(step);
}

// -- register tiles at full width (feature "kfwd") ------------------------------------
// A tile whose rows all keep alpha = 1 (their max did not move: most chunks of a long row)
// skips the rescale, exactly; and a product's last rows are cut into tiles of nearly equal
// height (an 8-row rest: 4 + 4, not 6 + 2 of which 4 rows are computed twice and dropped).

// alpha, or null where its first nr entries are all 1.
inline const float *rescaled(const float *alpha, int nr) {
  if (!alpha) return nullptr;
  for (int r = 0; r < nr; ++r)
    if (alpha[r] != 1.0f) return alpha;
  return nullptr;
}

// Rows of the next register tile (TR rows high: the build's TILE_R by default) of a
// product with `left` rows to go: TR, or where fewer than 2 TR are left, half of them
// (rounded up), then the rest.
template <int TR = TILE_R>
inline int tile_rows(int64_t left) {
  if (left >= 2 * TR || left == TR) return TR;
  return int(left > TR ? (left + 1) / 2 : left);
}

// C (rows x NC vectors, row stride ldc) = alpha (.) C + A B, or = A B when !ACC, with
// A(r, k) = a[r * ars + k * aks] and B(k, :) the NC vectors at b + k * ldb, k < kn.
// Rows past `nr` (< R) are computed on a copy of the last row and not stored.
// `alpha` (per row, or null for 1) rescales the loaded C first.

// out[r] = hmax(x[r]) for the first nr of R <= 8 rows (fold: the max of that and out[r],
// a row's later columns). AVX-512: the rows' lanes folded together, two rows a shuffle
// (22 instructions for 6 rows, not 6 x 8), NaN as hmax.
template <int R>
inline void hmax_rows(const vf *x, float *out, int nr, bool fold = false) {
  if (fold) {
    for (int r = 0; r < R; ++r)
      if (r < nr) {
        const float h = hmax(x[r]);
        out[r] = h > out[r] ? h : out[r];
      }
    return;
  }
#if ATTNKIT_W == 16
  static_assert(R <= 8, "8 rows at most");
  auto row = [&](int r) { return (__m512)x[r < R ? r : R - 1]; };
  // 16 -> 8 lanes a row: rows 2i and 2i + 1 side by side (128-bit blocks 0-1, 2-3)
  auto fold8 = [](__m512 a, __m512 b) {
    return _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  };
  // 8 -> 4: block j holds row j of the four
  auto fold4 = [](__m512 a, __m512 b) {
    return _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  };
  const __m512 y01 = fold8(row(0), row(1)), y23 = fold8(row(2), row(3));
  const __m512 z0 = fold4(y01, y23);  // rows 0-3
  __m512 z1 = z0;
  if constexpr (R > 4) {
    const __m512 y45 = fold8(row(4), row(5));
    z1 = fold4(y45, R > 6 ? fold8(row(6), row(7)) : y45);  // rows 4-7
  }
  // 4 -> 2 in each block: lanes 0-1 row j, 2-3 row j + 4; then 2 -> 1
  const __m512 u = _mm512_max_ps(_mm512_shuffle_ps(z0, z1, 0x44), _mm512_shuffle_ps(z0, z1, 0xEE));
  const __m512 m = _mm512_max_ps(u, _mm512_shuffle_ps(u, u, 0xB1));  // row j: lane 4j (+2)
  const __m512i at = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm512_mask_storeu_ps(out, __mmask16((1u << nr) - 1), _mm512_permutexvar_ps(at, m));
#else
  for (int r = 0; r < R; ++r)
    if (r < nr) out[r] = hmax(x[r]);
#endif
}

// (kfwd3) Each of a register tile's first nr rows' max (its NC accumulators, float32 or
// __m512) into row_max, folded into what is there when `fold` (a row's later tiles).
template <int R, int NC, class V>
inline void tile_row_max(const V (&acc)[R][NC], float *row_max, int nr, bool fold) {
  vf x[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    x[r] = (vf)acc[r][0];
#pragma GCC unroll 4
    for (int v = 1; v < NC; ++v) x[r] = vmax(x[r], (vf)acc[r][v]);
  }
  hmax_rows<R>(x, row_max, nr, fold);
}

// PAIR (feature "pv2"): then C += A2 B2 over kn more k, in the same registers (a2, b2: A's
// and B's second parts, at the same strides).
template <int R, int NC, bool ACC, bool PAIR = false>
inline void tile(float *c, int64_t ldc, int nr, const float *a, int64_t ars, int64_t aks,
                 const float *b, int64_t ldb, int64_t kn, const float *alpha,
                 float *row_max = nullptr, bool fold = false, const float *a2 = nullptr,
                 const float *b2 = nullptr) {
  vf acc[R][NC];
  const float *ar[R];
  alpha = ACC ? rescaled(alpha, nr) : nullptr;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int rr = r < nr ? r : nr - 1;
    ar[r] = a + rr * ars;
    if (ACC) {
      const vf al = splat(alpha ? alpha[rr] : 1.0f);
      for (int v = 0; v < NC; ++v) acc[r][v] = alpha ? load(c + rr * ldc + W * v) * al
                                                     : load(c + rr * ldc + W * v);
    } else {
      for (int v = 0; v < NC; ++v) acc[r][v] = vf{};
    }
  }
  auto products = [&](const float *bp) {
    for (int64_t k = 0; k < kn; ++k) {
      vf bv[NC];
#pragma GCC unroll 4
      for (int v = 0; v < NC; ++v) bv[v] = load(bp + k * ldb + W * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vf av = splat(ar[r][k * aks]);
#pragma GCC unroll 4
        for (int v = 0; v < NC; ++v) acc[r][v] += av * bv[v];
      }
    }
  };
  products(b);
  if constexpr (PAIR) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) ar[r] = a2 + (r < nr ? r : nr - 1) * ars;
    products(b2);
  }
  // (kfwd2) every index known at compile time: a loop to nr kept acc in memory (zeroed,
  // stored and reloaded around the products: 3 extra stores or loads per accumulator)
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NC; ++v)
      if (r < nr) store(c + r * ldc + W * v, acc[r][v]);
  if (!ACC && row_max) tile_row_max(acc, row_max, nr, fold);  // (see gemm)
}

// f(std::integral_constant<int, R>{}) with R the height of the register tile that runs
// nr <= TR rows (TILE_R by default): nr itself from 3 rows up, TR below (rows past nr
// computed on copies of the last and not stored).
template <int TR = TILE_R, class F>
inline void by_height(int nr, F f) {
  if constexpr (TR > 5)
    if (nr == 5) return f(std::integral_constant<int, 5>{});
  if constexpr (TR > 4)
    if (nr == 4) return f(std::integral_constant<int, 4>{});
  if constexpr (TR > 3)
    if (nr == 3) return f(std::integral_constant<int, 3>{});
  f(std::integral_constant<int, TR>{});
}

// tile() of nr rows (by_height).
template <int NC, bool ACC, bool PAIR = false, int TR = TILE_R>
inline void tile_n(float *c, int64_t ldc, int nr, const float *a, int64_t ars, int64_t aks,
                   const float *b, int64_t ldb, int64_t kn, const float *alpha,
                   float *row_max = nullptr, bool fold = false, const float *a2 = nullptr,
                   const float *b2 = nullptr) {
  by_height<TR>(nr, [&](auto rows) {
    tile<decltype(rows)::value, NC, ACC, PAIR>(c, ldc, nr, a, ars, aks, b, ldb, kn, alpha,
                                               row_max, fold, a2, b2);
  });
}

// The product above over `rows` rows and `cols` columns (a multiple of W), in register
// tiles of TR rows x TC vectors (the build's TILE_R x TILE_C unless a product asks for
// another: gemm_t; the last ones lower: tile_rows).
// row_max (!ACC): each row's max of C, set too where cols is a multiple of TC * W
// (whole tiles: a row's first tile sets it, the next ones fold theirs in); returns whether
// it was set.
// row_max, or null where a product of `cols` columns cannot give its rows' maxima: an
// accumulating one (ACC), or one whose columns are not whole register tiles. (gemm and
// gemm_bf16.)
template <bool ACC, int TC = TILE_C>
inline float *tiles_row_max(int64_t cols, float *row_max) {
  return ACC || cols % (TC * W) != 0 ? nullptr : row_max;
}

// PAIR (feature "pv2", ACC): C = alpha (.) C + A B + A2 B2, A2 and B2 at A's and B's
// strides: two chunks' P V in one pass over C, each register tile of C loaded and stored
// once for both (the products in the order of gemm(A, B) then gemm(A2, B2)).
template <bool ACC, bool PAIR = false, int TR = TILE_R, int TC = TILE_C>
inline bool gemm(float *c, int64_t ldc, int64_t rows, int64_t cols, const float *a,
                 int64_t ars, int64_t aks, const float *b, int64_t ldb, int64_t kn,
                 const float *alpha, float *row_max = nullptr, const float *a2 = nullptr,
                 const float *b2 = nullptr) {
  static_assert(ACC || !PAIR, "a pair accumulates");
  static_assert(TC >= 1 && TC <= 4, "register tiles of 1-4 vectors (the cases below)");
  row_max = tiles_row_max<ACC, TC>(cols, row_max);
  for (int64_t c0 = 0; c0 < cols; c0 += TC * W) {
    const int64_t nv = (cols - c0) / W < TC ? (cols - c0) / W : TC;
    const float *bb2 = PAIR ? b2 + c0 : nullptr;
    for (int64_t r0 = 0, nr = 0; r0 < rows; r0 += nr) {
      nr = tile_rows<TR>(rows - r0);
      float *cc = c + r0 * ldc + c0;
      const float *aa = a + r0 * ars, *aa2 = PAIR ? a2 + r0 * ars : nullptr;
      const float *al = alpha ? alpha + r0 : nullptr;
      float *mx = row_max ? row_max + r0 : nullptr;
      const bool fold = c0 > 0;
      switch (nv) {
#define ATTNKIT_CASE(n)                                                                \
  case n:                                                                              \
    if constexpr (n <= TC)                                                             \
      tile_n<n, ACC, PAIR, TR>(cc, ldc, int(nr), aa, ars, aks, b + c0, ldb, kn, al, \
                               mx, fold, aa2, bb2);                                \
    break;
        ATTNKIT_CASE(4)
        ATTNKIT_CASE(3)
        ATTNKIT_CASE(2)
        default:
          tile_n<1, ACC, PAIR, TR>(cc, ldc, int(nr), aa, ars, aks, b + c0, ldb, kn, al,
                                   nullptr, false, aa2, bb2);
#undef ATTNKIT_CASE
      }
    }
  }
  return row_max != nullptr;
}

// C += A B (float32) with A read down its columns (A(r, k) = a[r + k * aks]: the
// backward's dV += Pᵀ dO and dK += dSᵀ Q), in a register tile of its own, TILE_T_R x
// TILE_T_C: on AVX2 6 x 2 vectors (the forward's 3 x 4 took 6-9% more of the backward's
// time there, Xeon of session 35); elsewhere the forward's.
inline void gemm_t(float *c, int64_t ldc, int64_t rows, int64_t cols, const float *a,
                   int64_t aks, const float *b, int64_t ldb, int64_t kn) {
  gemm<true, false, TILE_T_R, TILE_T_C>(c, ldc, rows, cols, a, 1, aks, b, ldb, kn, nullptr);
}

#if defined(ATTNKIT_BF16)
// bf16 products (AVX512_BF16's vdpbf16ps: each fp32 lane += a pair of bf16 products).
//
// C (rows x NC vectors) = alpha (.) C + A B, or = A B when !ACC, over kp pairs: A(r, pair p)
// the two bf16 at a + r * ars + 2 p (broadcast as one 32-bit value), B(pair p, :) the NC
// vectors of 16 (pair-interleaved) bf16 pairs at b + p * ldb. Rows past `nr` as in tile().
template <int R, int NC, bool ACC>
inline void tile_bf16(float *c, int64_t ldc, int nr, const uint16_t *a, int64_t ars,
                      const uint16_t *b, int64_t ldb, int64_t kp, const float *alpha,
                      float *row_max = nullptr, bool fold = false) {
  __m512 acc[R][NC];
  const uint16_t *ar[R];
  alpha = ACC ? rescaled(alpha, nr) : nullptr;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int rr = r < nr ? r : nr - 1;
    ar[r] = a + rr * ars;
    for (int v = 0; v < NC; ++v) {
      if (ACC) {
        const __m512 old = _mm512_loadu_ps(c + rr * ldc + W * v);
        acc[r][v] = alpha ? _mm512_mul_ps(old, _mm512_set1_ps(alpha[rr])) : old;
      } else {
        acc[r][v] = _mm512_setzero_ps();
      }
    }
  }
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh bv[NC];
#pragma GCC unroll 4
    for (int v = 0; v < NC; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + 32 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, ar[r] + 2 * p, sizeof pair);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < NC; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)  // (kfwd2: as in tile())
#pragma GCC unroll 4
    for (int v = 0; v < NC; ++v)
      if (r < nr) _mm512_storeu_ps(c + r * ldc + W * v, acc[r][v]);
  if (!ACC && row_max) tile_row_max(acc, row_max, nr, fold);  // (see gemm)
}

// tile_bf16() of nr rows (by_height).
template <int NC, bool ACC>
inline void tile_bf16_n(float *c, int64_t ldc, int nr, const uint16_t *a, int64_t ars,
                        const uint16_t *b, int64_t ldb, int64_t kp, const float *alpha,
                        float *row_max = nullptr, bool fold = false) {
  by_height(nr, [&](auto rows) {
    tile_bf16<decltype(rows)::value, NC, ACC>(c, ldc, nr, a, ars, b, ldb, kp, alpha,
                                              row_max, fold);
  });
}

// tile_bf16 over `rows` rows and `cols` columns (a multiple of W) in register tiles (the
// last ones lower: tile_rows).
template <bool ACC>
inline bool gemm_bf16(float *c, int64_t ldc, int64_t rows, int64_t cols, const uint16_t *a,
                      int64_t ars, const uint16_t *b, int64_t ldb, int64_t kp,
                      const float *alpha, float *row_max = nullptr) {
  row_max = tiles_row_max<ACC>(cols, row_max);  // (as gemm())
  for (int64_t c0 = 0; c0 < cols; c0 += TILE_C * W) {
    const int64_t nv = (cols - c0) / W < TILE_C ? (cols - c0) / W : TILE_C;
    for (int64_t r0 = 0, nr = 0; r0 < rows; r0 += nr) {
      nr = tile_rows(rows - r0);
      float *cc = c + r0 * ldc + c0;
      const uint16_t *aa = a + r0 * ars, *bb = b + 2 * c0;
      const float *al = alpha ? alpha + r0 : nullptr;
      const int n = int(nr);
      float *mx = row_max ? row_max + r0 : nullptr;
      const bool fold = c0 > 0;
      switch (nv) {
        case 4: tile_bf16_n<4, ACC>(cc, ldc, n, aa, ars, bb, ldb, kp, al, mx, fold); break;
        case 3: tile_bf16_n<3, ACC>(cc, ldc, n, aa, ars, bb, ldb, kp, al, mx, fold); break;
        case 2: tile_bf16_n<2, ACC>(cc, ldc, n, aa, ars, bb, ldb, kp, al, mx, fold); break;
        default: tile_bf16_n<1, ACC>(cc, ldc, n, aa, ars, bb, ldb, kp, al, mx, fold);
      }
    }
  }
  return row_max != nullptr;
}

// acc + the products of the 2 W bf16 at a and at b, lane l summing the pair 2l, 2l + 1
// (vdpbf16ps: bf16 products are exact in float32; denormal inputs read as 0).
inline vf dot_bf16(vf acc, const uint16_t *a, const uint16_t *b) {
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_loadu_si512(a),
                              (__m512bh)_mm512_loadu_si512(b));
}

// The W floats of x rounded to bf16 (round to nearest even), stored in order at dst.
inline void store_bf16(uint16_t *dst, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst), (__m256i)_mm512_cvtneps_pbh((__m512)x));
}

// Two rows of n bf16 (n a multiple of 16; b null: a row of zeros) side by side in pairs:
// dst[2 d] = a[d], dst[2 d + 1] = b[d] (the layout the bf16 products read pairs in), 32
// at a time by one two-source permute.
inline void interleave_bf16(uint16_t *dst, const uint16_t *a, const uint16_t *b, int64_t n) {
  alignas(64) static const uint16_t order[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i lo = _mm512_load_si512(order[0]), hi = _mm512_load_si512(order[1]);
  for (int64_t d = 0; d < n; d += 32) {
    const bool whole = n - d >= 32;
    const __mmask32 m = whole ? ~__mmask32(0) : __mmask32(0xFFFF);
    const __m512i x = _mm512_maskz_loadu_epi16(m, a + d);
    const __m512i y = b ? _mm512_maskz_loadu_epi16(m, b + d) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
    if (whole) _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
  }
}
#endif

// dst[d * ds + j] = rows[j][d0 + d] for j, d < 8: eight keys' dims d0 .. d0 + 8 into eight
// rows of eight keys (the float32 packed keys' layout, a transpose). Every x86 build has
// AVX2: three shuffle steps in registers; other targets plain loops. Moves only: the bits
// are the input's (any 32-bit words: pairs of bf16 dims go through it too).
inline void transpose8(const float *const *rows, int64_t d0, float *dst, int64_t ds) {
#if defined(__AVX2__)
  __m256 a[8], t[8], u[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(rows[j] + d0);
  for (int j = 0; j < 8; j += 2) {  // t[j] = (a_j0 a_j+1,0 a_j1 a_j+1,1 | ...4, 5)
    t[j] = _mm256_unpacklo_ps(a[j], a[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(a[j], a[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {  // u: four keys' dim d in one 128-bit half
    u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
    u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
    u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
  for (int d = 0; d < 4; ++d) {  // keys 0-3 and 4-7 of dims d and d + 4
    _mm256_storeu_ps(dst + d * ds, _mm256_permute2f128_ps(u[d], u[d + 4], 0x20));
    _mm256_storeu_ps(dst + (d + 4) * ds, _mm256_permute2f128_ps(u[d], u[d + 4], 0x31));
  }
#else
  for (int d = 0; d < 8; ++d)  // (4-byte copies: bf16 pairs come here as words too)
    for (int j = 0; j < 8; ++j) std::memcpy(dst + d * ds + j, rows[j] + d0 + d, 4);
#endif
}

}  // namespace simd
