// attnkit's native CPU attention: FlashAttention tiles, skipping and masks in one kernel,
// forward and backward.
//
// Built on first use by native/build.py (one g++ call, no torch headers) and called through
// ctypes; see native/__init__.py for when it runs and what it returns. float32 only.
//
// The keys are first transposed, chunk by chunk, into one packed copy (read by every query
// block). For a block of query rows [i0, i1) of one (batch, head), the kernel walks the
// chunks of KC keys the block may see (the rows of a chunk that the band leaves nothing
// in are not computed): scores S = Q K^T (register tiles of 4 rows x KC keys),
// scale, relative bias, masks (a diagonal band keep iff lo <= j - i <= hi, a block mask's
// stored bool tile, a bool or float mask tensor), online softmax, then O += P V (4 rows x
// up to 64 value columns).
// Every row keeps its running max m and sum l; at the end out = O / l, lse = m + log(l),
// and a row that kept no key gets out = 0, lse = -inf. The backward (its section below)
// recomputes the weights from lse.
//
// Vectors are GCC vector extensions (16 floats): AVX-512 where the machine has it
// (-march=native), pairs of AVX2 registers elsewhere.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

constexpr int KC = 64;        // keys per chunk
constexpr int NV = KC / 16;   // vectors per chunk row
constexpr int R = 4;          // query rows per register tile
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int8_t EMPTY = 0, FULL = 2;  // attnkit.block_mask's kinds (PARTIAL = 1)

// The call, as native/__init__.py fills it (ctypes.Structure of 8-byte fields).
struct Args {
  const float *q, *k, *v;
  float *out, *lse;
  int64_t sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t;
  int64_t B, H, HKV, T, S, D, DV;
  double scale;
  int64_t band_lo, band_hi;  // keep key j for query i iff band_lo <= j - i <= band_hi
  int64_t bq;                // query rows per block (the block mask's rows when it has one)
  const int8_t *bm_kind;     // (B|1, H|1, nq, nk) kinds, or null: no block mask
  const int64_t *bm_index;   // same strides: index of a PARTIAL tile's stored mask
  const uint8_t *bm_masks;   // (n_partial, bm_qb, bm_kb) bool
  int64_t bm_sb, bm_sh, bm_si, bm_qb, bm_kb;  // strides of kind/index (row j stride 1)
  const float *rel;          // (H|1, n) bias of j - i = rel_lo + n, or null
  int64_t rel_sh, rel_lo;
  const void *mask;          // a mask tensor (b, h, t, s strides below), or null
  int64_t mask_kind;         // MASK_BOOL (keep where nonzero) or MASK_FLOAT (added)
  int64_t sm_b, sm_h, sm_t, sm_s;
  int64_t threads;
};

constexpr int64_t MASK_BOOL = 1, MASK_FLOAT = 2;

inline v16 splat(float x) { return v16{} + x; }
inline v16 load(const float *p) { v16 r; std::memcpy(&r, p, sizeof r); return r; }
inline void store(float *p, v16 x) { std::memcpy(p, &x, sizeof x); }

// e^x, 1-2 ulp, 0 below -87.3 (and for -inf): 2^n e^r, n = round(x / ln 2), |r| <= ln2 / 2.
inline v16 vexp(v16 x) {
  const v16 tiny = splat(-87.33f);
  v16i dead = x < tiny;
  x = dead ? tiny : x;
  const v16 shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v16 t = x * splat(1.44269504088896341f) + shifter;
  v16 n = t - shifter;
  v16 r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  v16i bits = (v16i)t - (v16i)shifter;  // n as an integer
  v16 scale = (v16)((bits + 127) << 23);
  v16 e = p * scale;
  return dead ? splat(0.0f) : e;
}

inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

inline float hmax(v16 x) {
  x = vmax(x, __builtin_shuffle(x, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  x = vmax(x, __builtin_shuffle(x, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  x = vmax(x, __builtin_shuffle(x, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  x = vmax(x, __builtin_shuffle(x, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return x[0];
}

inline float hsum(v16 x) {
  x += __builtin_shuffle(x, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x += __builtin_shuffle(x, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x += __builtin_shuffle(x, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x += __builtin_shuffle(x, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return x[0];
}

// Keys (or values) transposed chunk by chunk: kt[b][hk][c][d][j] = k[b][hk][KC c + j][d],
// zero past the last key. Packed once per call, read by every query block.
struct Packed {
  int64_t chunks = 0, depth = 0;
  std::unique_ptr<float[]> t;  // (B, HKV, chunks, depth, KC), every element written
  const float *chunk(const Args &a, int64_t b, int64_t hk, int64_t c) const {
    return t.get() + ((b * a.HKV + hk) * chunks + c) * depth * KC;
  }
};

// Chunk c of the keys (keys KC c .. KC c + KC) as one block of query rows sees it: the
// columns [lo, hi) of it that are in range, the block's rows [r0, r1) that may keep one of
// them by the band, and what masks them.
struct Chunk {
  int64_t ci, c0;       // the chunk and its first key (KC ci)
  int64_t lo, hi;       // columns in range
  int64_t r0, r1;       // rows of the block to compute
  bool band;            // some row drops some column by the band
  const uint8_t *keep;  // the block mask's bool tile, or null
  int64_t keep_width;   // its row length (bm_kb, or KC for a chunk's rows assembled)
  int64_t keep_col;     // column of key c0 in that tile (negative: the chunk starts before it)
};

// f(chunk) for every chunk with index in [cmin, cmax] that the rows [i0, i1) of (b, h) may
// see: by the band, then by the block mask's kinds. kv blocks of a multiple of KC keys hold
// whole chunks (a call per chunk of each non-empty block, its tile read in place); narrower
// or unaligned ones are assembled, a chunk at a time, into `buf` ((i1 - i0) x KC bytes).
template <class F>
void for_each_chunk(const Args &a, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t cmin,
                    int64_t cmax, uint8_t *buf, F f) {
  const int64_t rows = i1 - i0;
  // keys any row may see by the band, within the chunks asked for
  const int64_t lo = std::max({int64_t(0), i0 + a.band_lo, cmin * KC});
  const int64_t hi = std::min({a.S, i1 - 1 + a.band_hi + 1, (cmax + 1) * KC});
  if (lo >= hi) return;
  // keys [k0, k1), masked by `keep` (rows `width` long, key k0 at column keep_col0) or not
  auto run = [&](int64_t k0, int64_t k1, const uint8_t *keep, int64_t width, int64_t keep_col0) {
    for (int64_t ci = k0 / KC; ci * KC < k1; ++ci) {
      Chunk c;
      c.ci = ci;
      c.c0 = ci * KC;
      c.lo = std::max<int64_t>(0, k0 - c.c0);
      c.hi = std::min<int64_t>(KC, k1 - c.c0);
      // rows whose band meets keys [c0 + lo, c0 + hi)
      c.r0 = std::max<int64_t>(0, c.c0 + c.lo - a.band_hi - i0);
      c.r1 = std::min<int64_t>(rows, c.c0 + c.hi - 1 - a.band_lo - i0 + 1);
      if (c.r0 >= c.r1) continue;
      c.band = (i0 + c.r1 - 1 + a.band_lo > c.c0 + c.lo) ||
               (i0 + c.r0 + a.band_hi < c.c0 + c.hi - 1);
      c.keep = keep;
      c.keep_width = width;
      c.keep_col = keep_col0 + (c.c0 - k0);
      f(c);
    }
  };
  if (!a.bm_kind) {
    run(lo, hi, nullptr, 0, 0);
    return;
  }
  const int64_t kb = a.bm_kb, at = b * a.bm_sb + h * a.bm_sh + (i0 / a.bm_qb) * a.bm_si;
  const int8_t *kind = a.bm_kind + at;
  const int64_t *index = a.bm_index + at;
  auto tile = [&](int64_t bj) { return a.bm_masks + index[bj] * a.bm_qb * kb; };
  if (kb % KC == 0) {
    for (int64_t bj = lo / kb; bj * kb < hi; ++bj) {
      if (kind[bj] == EMPTY) continue;
      const int64_t k0 = std::max(lo, bj * kb), k1 = std::min(hi, (bj + 1) * kb);
      run(k0, k1, kind[bj] == FULL ? nullptr : tile(bj), kb, k0 - bj * kb);
    }
    return;
  }
  for (int64_t ci = lo / KC; ci * KC < hi; ++ci) {
    const int64_t c0 = ci * KC, k0 = std::max(lo, c0), k1 = std::min(hi, c0 + KC);
    bool any = false, full = true;
    for (int64_t bj = k0 / kb; bj * kb < k1; ++bj) {
      any |= kind[bj] != EMPTY;
      full &= kind[bj] == FULL;
    }
    if (!any) continue;
    if (full) {
      run(k0, k1, nullptr, 0, 0);
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {  // the chunk's row r: key c0 + n at column n
      uint8_t *row = buf + r * KC;
      for (int64_t bj = k0 / kb; bj * kb < k1; ++bj) {
        const int64_t from = std::max(k0, bj * kb), to = std::min(k1, (bj + 1) * kb);
        if (kind[bj] == EMPTY || kind[bj] == FULL) {
          std::fill(row + (from - c0), row + (to - c0), uint8_t(kind[bj] == FULL));
        } else {
          const uint8_t *src = tile(bj) + r * kb - bj * kb;  // key k at src[k]
          std::copy(src + from, src + to, row + (from - c0));
        }
      }
    }
    run(k0, k1, buf, KC, k0 - c0);
  }
}

// out[r][0..KC) = x_{i0 + r} . packed[:, j] for rows [r0, r1): x rows of `depth` floats
// `stride` apart (scores with K^T, or dO V^T in the backward; padding keys give 0).
void dots(const float *x, int64_t stride, int64_t depth, int64_t i0, const float *packed,
          const Chunk &c, float *out) {
  for (int64_t r0 = c.r0; r0 < c.r1; r0 += R) {
    const float *xr[R];
    for (int rr = 0; rr < R; ++rr) xr[rr] = x + (i0 + r0 + std::min<int64_t>(rr, c.r1 - r0 - 1)) * stride;
    v16 acc[R][NV] = {};
    for (int64_t d = 0; d < depth; ++d) {
      v16 kv[NV];
#pragma GCC unroll 4
      for (int vv = 0; vv < NV; ++vv) kv[vv] = load(packed + d * KC + 16 * vv);
#pragma GCC unroll 4
      for (int rr = 0; rr < R; ++rr) {
        const v16 xv = splat(xr[rr][d]);
#pragma GCC unroll 4
        for (int vv = 0; vv < NV; ++vv) acc[rr][vv] += xv * kv[vv];
      }
    }
    for (int rr = 0; rr < R && r0 + rr < c.r1; ++rr)
      for (int vv = 0; vv < NV; ++vv) store(out + (r0 + rr) * KC + 16 * vv, acc[rr][vv]);
  }
}

// Row i's scores over the chunk as the softmax sees them: scaled, biased, and -inf where
// any mask drops the key (x[0..NV)); `s` the row's raw dot products.
struct Masker {
  const Args &a;
  const Chunk &c;
  int64_t b, h;
  const float *rel;
  bool keep_direct;
  v16i lane;
  uint8_t kbuf[KC], mbuf[KC];
  float fbuf[KC];

  Masker(const Args &a_, const Chunk &c_, int64_t b_, int64_t h_) : a(a_), c(c_), b(b_), h(h_) {
    rel = a.rel ? a.rel + h * a.rel_sh : nullptr;
    keep_direct = c.keep && c.keep_col >= 0 && c.keep_col + KC <= c.keep_width;
    for (int l = 0; l < 16; ++l) lane[l] = l;
  }

  // Row i of the mask tensor over the chunk: a pointer to read 16 at a time (`buf` filled
  // with the columns [lo, hi) where the row is broadcast or runs past the last key).
  template <class T>
  const T *mask_row(int64_t i, T *buf) const {
    const T *row = static_cast<const T *>(a.mask) + b * a.sm_b + h * a.sm_h + i * a.sm_t;
    if (a.sm_s == 1 && c.c0 + KC <= a.S) return row + c.c0;
    for (int64_t j = 0; j < KC; ++j)
      buf[j] = (j >= c.lo && j < c.hi) ? row[(c.c0 + j) * a.sm_s] : T(0);
    return buf;
  }

  void row(int64_t r, int64_t i, const float *s, v16 *x) {
    const v16 scale = splat(float(a.scale));
    int64_t lo = c.lo, hi = c.hi;  // the columns this row keeps by range and band
    if (c.band) {
      lo = std::min<int64_t>(KC, std::max<int64_t>(lo, i + a.band_lo - c.c0));
      hi = std::max<int64_t>(0, std::min<int64_t>(hi, i + a.band_hi - c.c0 + 1));
    }
    const uint8_t *keep = nullptr;
    if (c.keep) {
      const uint8_t *tile_row = c.keep + r * c.keep_width;  // column n: key c0 + n - keep_col
      if (keep_direct) {
        keep = tile_row + c.keep_col;
      } else {  // the tile covers part of the chunk: copy its columns
        for (int64_t j = 0; j < KC; ++j)
          kbuf[j] = (j >= c.lo && j < c.hi) ? tile_row[c.keep_col + j] : 0;
        keep = kbuf;
      }
    }
    const uint8_t *mkeep = a.mask_kind == MASK_BOOL ? mask_row<uint8_t>(i, mbuf) : nullptr;
    const float *madd = a.mask_kind == MASK_FLOAT ? mask_row<float>(i, fbuf) : nullptr;
#pragma GCC unroll 4
    for (int vv = 0; vv < NV; ++vv) {
      v16 sv = load(s + 16 * vv) * scale;
      if (rel) sv += load(rel + (c.c0 + 16 * vv - i - a.rel_lo));  // bias of j - i
      if (madd) sv += load(madd + 16 * vv);
      const v16i col = lane + int32_t(16 * vv);
      v16i drop = (col < int32_t(lo)) | (col >= int32_t(hi));
      for (const uint8_t *k : {keep, mkeep}) {
        if (!k) continue;
        v16b kb;
        std::memcpy(&kb, k + 16 * vv, 16);
        drop |= (__builtin_convertvector(kb, v16i) == 0);
      }
      x[vv] = drop ? splat(NEG_INF) : sv;
    }
  }
};

// dst[r] (times alpha[r] first, if given) += sum_{j in [lo, hi)} p[r][j] src[c0 + j] for
// rows [r0, r1) and NW vectors of columns from col (P V forward, dS K for dQ).
template <int NW>
void rows_acc_cols(float *dst, int64_t dst_stride, const float *alpha, const float *p,
                   const float *src, int64_t src_stride, const Chunk &c, int64_t col) {
  for (int64_t r0 = c.r0; r0 < c.r1; r0 += R) {
    const int nr = int(std::min<int64_t>(R, c.r1 - r0));
    v16 acc[R][NW];
    const float *pr[R];
    for (int rr = 0; rr < R; ++rr) {
      const int64_t r = r0 + std::min(rr, nr - 1);
      const v16 al = splat(alpha ? alpha[r] : 1.0f);
      for (int vv = 0; vv < NW; ++vv) acc[rr][vv] = load(dst + r * dst_stride + col + 16 * vv) * al;
      pr[rr] = p + r * KC;
    }
    for (int64_t j = c.lo; j < c.hi; ++j) {
      const float *sr = src + (c.c0 + j) * src_stride + col;
      v16 sj[NW];
#pragma GCC unroll 4
      for (int vv = 0; vv < NW; ++vv) sj[vv] = load(sr + 16 * vv);
#pragma GCC unroll 4
      for (int rr = 0; rr < R; ++rr) {
        const v16 pj = splat(pr[rr][j]);
#pragma GCC unroll 4
        for (int vv = 0; vv < NW; ++vv) acc[rr][vv] += pj * sj[vv];
      }
    }
    for (int rr = 0; rr < nr; ++rr)
      for (int vv = 0; vv < NW; ++vv) store(dst + (r0 + rr) * dst_stride + col + 16 * vv, acc[rr][vv]);
  }
}

// dst[j] += sum_{r in [r0, r1)} p[r][j] src[i0 + r] for the chunk's columns [lo, hi) and
// NW vectors of columns from col (P^T dO for dV, dS^T Q for dK); dst rows are the chunk's.
template <int NW>
void keys_acc_cols(float *dst, int64_t dst_stride, const float *p, const float *src,
                   int64_t src_stride, int64_t i0, const Chunk &c, int64_t col) {
  for (int64_t j0 = c.lo; j0 < c.hi; j0 += R) {
    const int nj = int(std::min<int64_t>(R, c.hi - j0));
    v16 acc[R][NW];
    for (int jj = 0; jj < R; ++jj)
      for (int vv = 0; vv < NW; ++vv)
        acc[jj][vv] = load(dst + (j0 + std::min(jj, nj - 1)) * dst_stride + col + 16 * vv);
    for (int64_t r = c.r0; r < c.r1; ++r) {
      const float *sr = src + (i0 + r) * src_stride + col;
      const float *pr = p + r * KC + j0;
      v16 sv[NW];
#pragma GCC unroll 4
      for (int vv = 0; vv < NW; ++vv) sv[vv] = load(sr + 16 * vv);
#pragma GCC unroll 4
      for (int jj = 0; jj < R; ++jj) {
        const v16 pj = splat(pr[std::min(jj, nj - 1)]);
#pragma GCC unroll 4
        for (int vv = 0; vv < NW; ++vv) acc[jj][vv] += pj * sv[vv];
      }
    }
    for (int jj = 0; jj < nj; ++jj)
      for (int vv = 0; vv < NW; ++vv) store(dst + (j0 + jj) * dst_stride + col + 16 * vv, acc[jj][vv]);
  }
}

// The column loops above over a row `width` floats wide (a multiple of 16), 64 at a time.
template <class F>
void by_columns(int64_t width, F f) {
  for (int64_t col = 0; col < width; col += 64) {
    switch (std::min<int64_t>(4, (width - col) / 16)) {
      case 4: f(std::integral_constant<int, 4>(), col); break;
      case 3: f(std::integral_constant<int, 3>(), col); break;
      case 2: f(std::integral_constant<int, 2>(), col); break;
      default: f(std::integral_constant<int, 1>(), col); break;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------

struct Scratch {
  std::vector<float> s, o, m, l, alpha;
  std::vector<uint8_t> keep;  // a chunk's assembled block-mask rows
  Scratch(const Args &a)
      : s(a.bq * KC), o(a.bq * a.DV), m(a.bq), l(a.bq), alpha(a.bq), keep(a.bq * KC) {}
};

// Scores -> weights in place, the online softmax state updated (alpha: O's rescale).
void softmax(const Args &a, int64_t b, int64_t h, int64_t i0, const Chunk &c, Scratch &w) {
  Masker masker(a, c, b, h);
  for (int64_t r = c.r0; r < c.r1; ++r) {
    float *s = w.s.data() + r * KC;
    v16 x[NV];
    masker.row(r, i0 + r, s, x);
    v16 mx = x[0];
    for (int vv = 1; vv < NV; ++vv) mx = vmax(mx, x[vv]);
    const float m_old = w.m[r];
    const float m_new = std::max(m_old, hmax(mx));
    if (m_new == NEG_INF) {  // nothing kept yet: weights 0, O untouched
      for (int vv = 0; vv < NV; ++vv) store(s + 16 * vv, splat(0.0f));
      w.alpha[r] = 1.0f;
      continue;
    }
    v16 sum = splat(0.0f);
    const v16 m = splat(m_new);
#pragma GCC unroll 4
    for (int vv = 0; vv < NV; ++vv) {
      const v16 p = vexp(x[vv] - m);
      store(s + 16 * vv, p);
      sum += p;
    }
    const float alpha = (m_old == NEG_INF) ? 0.0f : std::exp(m_old - m_new);
    w.alpha[r] = alpha;
    w.l[r] = w.l[r] * alpha + hsum(sum);
    w.m[r] = m_new;
  }
}

// One block of query rows [i0, i1) of batch b, head h.
void forward_block(const Args &a, const Packed &kt, int64_t b, int64_t h, int64_t i0,
                   int64_t i1, Scratch &w) {
  const int64_t rows = i1 - i0;
  const int64_t hk = h / (a.H / a.HKV);
  const float *qh = a.q + b * a.sq_b + h * a.sq_h;
  const float *vh = a.v + b * a.sv_b + hk * a.sv_h;
  std::fill(w.o.begin(), w.o.begin() + rows * a.DV, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, NEG_INF);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  for_each_chunk(a, b, h, i0, i1, 0, kt.chunks - 1, w.keep.data(), [&](const Chunk &c) {
    dots(qh, a.sq_t, a.D, i0, kt.chunk(a, b, hk, c.ci), c, w.s.data());
    softmax(a, b, h, i0, c, w);
    by_columns(a.DV, [&](auto nw, int64_t col) {
      rows_acc_cols<decltype(nw)::value>(w.o.data(), a.DV, w.alpha.data(), w.s.data(), vh,
                                         a.sv_t, c, col);
    });
  });
  float *out = a.out + b * a.so_b + h * a.so_h;
  float *lse = a.lse + (b * a.H + h) * a.T;
  for (int64_t r = 0; r < rows; ++r) {
    float *o = out + (i0 + r) * a.so_t;
    if (w.m[r] == NEG_INF) {
      std::fill(o, o + a.DV, 0.0f);
      lse[i0 + r] = NEG_INF;
      continue;
    }
    const float inv = 1.0f / w.l[r];
    for (int64_t d = 0; d < a.DV; ++d) o[d] = w.o[r * a.DV + d] * inv;
    lse[i0 + r] = w.m[r] + std::log(w.l[r]);
  }
}

// ---------------------------------------------------------------------------------------
// Backward (FlashAttention-2's, in two passes that write disjoint rows): for a chunk and a
// block, P = exp(x - lse), dP = dO V^T, dS = scale P (dP - delta) with
// delta = rowsum(dO O) - dlse; pass 1 (a task per key chunk) sums dV += P^T dO and
// dK += dS^T Q over the query heads of its kv head and their blocks, pass 2 (a task per
// query block) dQ += dS K.
// ---------------------------------------------------------------------------------------

// The gradients' tensors (contiguous: (B, H, T, D|DV), (B, HKV, S, D|DV), (B, H, T)).
struct Grads {
  const float *dout, *delta;
  float *dq, *dk, *dv;
};

struct BackScratch {
  std::vector<float> p, ds, acc, acc2;
  std::vector<uint8_t> keep;  // a chunk's assembled block-mask rows
  BackScratch(const Args &a)
      : p(a.bq * KC), ds(a.bq * KC), acc(std::max(a.bq, int64_t(KC)) * a.D), acc2(KC * a.DV),
        keep(a.bq * KC) {}
};

// p = the chunk's weights, ds = scale * p * (dO V^T - delta), for rows [r0, r1).
void weights_and_ds(const Args &a, const Grads &g, const Packed &kt, const Packed &vt,
                    int64_t b, int64_t h, int64_t i0, const Chunk &c, BackScratch &w) {
  const int64_t hk = h / (a.H / a.HKV);
  const float *qh = a.q + b * a.sq_b + h * a.sq_h;
  const float *doh = g.dout + (b * a.H + h) * a.T * a.DV;
  const float *lse = a.lse + (b * a.H + h) * a.T;
  const float *delta = g.delta + (b * a.H + h) * a.T;
  dots(qh, a.sq_t, a.D, i0, kt.chunk(a, b, hk, c.ci), c, w.p.data());
  dots(doh, a.DV, a.DV, i0, vt.chunk(a, b, hk, c.ci), c, w.ds.data());
  Masker masker(a, c, b, h);
  const v16 scale = splat(float(a.scale));
  for (int64_t r = c.r0; r < c.r1; ++r) {
    float *p = w.p.data() + r * KC, *ds = w.ds.data() + r * KC;
    v16 x[NV];
    masker.row(r, i0 + r, p, x);
    const v16 l = splat(lse[i0 + r]), dl = splat(delta[i0 + r]);  // a dead row: lse +inf
#pragma GCC unroll 4
    for (int vv = 0; vv < NV; ++vv) {
      const v16 pv = vexp(x[vv] - l);
      store(p + 16 * vv, pv);
      store(ds + 16 * vv, scale * pv * (load(ds + 16 * vv) - dl));
    }
  }
}

// Pass 1: dK, dV of key chunk ci of (b, hk).
void backward_keys(const Args &a, const Grads &g, const Packed &kt, const Packed &vt,
                   int64_t b, int64_t hk, int64_t ci, BackScratch &w) {
  const int64_t n = std::min<int64_t>(KC, a.S - ci * KC);  // keys of the chunk
  float *dk = w.acc.data(), *dv = w.acc2.data();  // (KC, D), (KC, DV), chunk-relative rows
  std::fill(dk, dk + KC * a.D, 0.0f);
  std::fill(dv, dv + KC * a.DV, 0.0f);
  const int64_t group = a.H / a.HKV;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const float *qh = a.q + b * a.sq_b + h * a.sq_h;
    const float *doh = g.dout + (b * a.H + h) * a.T * a.DV;
    for (int64_t i0 = 0; i0 < a.T; i0 += a.bq) {
      const int64_t i1 = std::min(a.T, i0 + a.bq);
      for_each_chunk(a, b, h, i0, i1, ci, ci, w.keep.data(), [&](const Chunk &c) {
        weights_and_ds(a, g, kt, vt, b, h, i0, c, w);
        by_columns(a.DV, [&](auto nw, int64_t col) {
          keys_acc_cols<decltype(nw)::value>(dv, a.DV, w.p.data(), doh, a.DV, i0, c, col);
        });
        by_columns(a.D, [&](auto nw, int64_t col) {
          keys_acc_cols<decltype(nw)::value>(dk, a.D, w.ds.data(), qh, a.sq_t, i0, c, col);
        });
      });
    }
  }
  float *dk_out = g.dk + ((b * a.HKV + hk) * a.S + ci * KC) * a.D;
  float *dv_out = g.dv + ((b * a.HKV + hk) * a.S + ci * KC) * a.DV;
  std::copy(dk, dk + n * a.D, dk_out);
  std::copy(dv, dv + n * a.DV, dv_out);
}

// Pass 2: dQ of the query rows [i0, i1) of (b, h).
void backward_queries(const Args &a, const Grads &g, const Packed &kt, const Packed &vt,
                      int64_t b, int64_t h, int64_t i0, int64_t i1, BackScratch &w) {
  const int64_t hk = h / (a.H / a.HKV);
  const float *kh = a.k + b * a.sk_b + hk * a.sk_h;
  float *dq = w.acc.data();  // (rows, D)
  std::fill(dq, dq + (i1 - i0) * a.D, 0.0f);
  for_each_chunk(a, b, h, i0, i1, 0, kt.chunks - 1, w.keep.data(), [&](const Chunk &c) {
    weights_and_ds(a, g, kt, vt, b, h, i0, c, w);
    by_columns(a.D, [&](auto nw, int64_t col) {
      rows_acc_cols<decltype(nw)::value>(dq, a.D, nullptr, w.ds.data(), kh, a.sk_t, c, col);
    });
  });
  std::copy(dq, dq + (i1 - i0) * a.D, g.dq + ((b * a.H + h) * a.T + i0) * a.D);
}

// Run f(state, item) for items [0, n) on up to `threads` threads (the calling one
// included), each thread with its own State(a).
template <class State, class F>
void parallel(const Args &a, int64_t n, F f) {
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    State state(a);
    for (int64_t it = next++; it < n; it = next++) f(state, it);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < std::min(a.threads, n); ++t) pool.emplace_back(worker);
  worker();
  for (auto &t : pool) t.join();
}

struct NoState {
  NoState(const Args &) {}
};

// x (B, HKV, S, depth) with strides (sb, sh, st), transposed chunk by chunk.
Packed pack(const Args &a, const float *x, int64_t sb, int64_t sh, int64_t st, int64_t depth) {
  Packed pk;
  pk.chunks = (a.S + KC - 1) / KC;
  pk.depth = depth;
  pk.t.reset(new float[a.B * a.HKV * pk.chunks * depth * KC]);
  parallel<NoState>(a, a.B * a.HKV * pk.chunks, [&](NoState &, int64_t it) {
    const int64_t ci = it % pk.chunks, bh = it / pk.chunks;
    const float *src = x + (bh / a.HKV) * sb + (bh % a.HKV) * sh;
    float *dst = pk.t.get() + it * depth * KC;
    for (int64_t j = 0; j < KC; ++j) {
      const int64_t key = ci * KC + j;
      for (int64_t d = 0; d < depth; ++d) dst[d * KC + j] = key < a.S ? src[key * st + d] : 0.0f;
    }
  });
  return pk;
}

int check(const Args &a) {
  if (a.D <= 0 || a.DV <= 0 || a.DV % 16 || a.bq <= 0 || a.HKV <= 0 || a.H % a.HKV) return 1;
  if (a.bm_kind && a.bq != a.bm_qb) return 2;
  return 0;
}

}  // namespace

extern "C" int attnkit_forward(const Args *args) {
  const Args &a = *args;
  if (int bad = check(a)) return bad;
  const Packed kt = pack(a, a.k, a.sk_b, a.sk_h, a.sk_t, a.D);
  const int64_t nq = (a.T + a.bq - 1) / a.bq;  // query blocks per (batch, head)
  parallel<Scratch>(a, a.B * a.H * nq, [&](Scratch &w, int64_t it) {
    const int64_t qi = it % nq, bh = it / nq;
    const int64_t i0 = qi * a.bq, i1 = std::min(a.T, i0 + a.bq);
    forward_block(a, kt, bh / a.H, bh % a.H, i0, i1, w);
  });
  return 0;
}

// dq, dk, dv from dout, delta and the forward's lse (Args.lse, +inf on dead rows).
extern "C" int attnkit_backward(const Args *args, const Grads *grads) {
  const Args &a = *args;
  const Grads &g = *grads;
  if (int bad = check(a)) return bad;
  if (a.D % 16) return 3;
  const Packed kt = pack(a, a.k, a.sk_b, a.sk_h, a.sk_t, a.D);
  const Packed vt = pack(a, a.v, a.sv_b, a.sv_h, a.sv_t, a.DV);
  parallel<BackScratch>(a, a.B * a.HKV * kt.chunks, [&](BackScratch &w, int64_t it) {
    const int64_t ci = it % kt.chunks, bh = it / kt.chunks;
    backward_keys(a, g, kt, vt, bh / a.HKV, bh % a.HKV, ci, w);
  });
  const int64_t nq = (a.T + a.bq - 1) / a.bq;
  parallel<BackScratch>(a, a.B * a.H * nq, [&](BackScratch &w, int64_t it) {
    const int64_t qi = it % nq, bh = it / nq;
    const int64_t i0 = qi * a.bq, i1 = std::min(a.T, i0 + a.bq);
    backward_queries(a, g, kt, vt, bh / a.H, bh % a.H, i0, i1, w);
  });
  return 0;
}
