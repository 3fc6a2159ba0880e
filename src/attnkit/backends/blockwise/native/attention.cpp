// attnkit's native CPU attention forward: FlashAttention tiles, skipping and masks in one kernel.
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
// and a row that kept no key gets out = 0, lse = -inf.
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

// The keys of one (batch, kv head) transposed chunk by chunk: kt[c][d][j] = k[KC c + j][d],
// zero past the last key. Packed once per call, read by every query block.
struct PackedKeys {
  int64_t chunks;
  std::unique_ptr<float[]> kt;  // (B, HKV, chunks, D, KC), every element written
};

struct Scratch {
  std::vector<float> s, o, m, l, alpha;
  Scratch(const Args &a) : s(a.bq * KC), o(a.bq * a.DV), m(a.bq), l(a.bq), alpha(a.bq) {}
};

// Chunk c of the keys (keys KC c .. KC c + KC) as one block sees it: the columns [lo, hi)
// of it that are in range, the block's rows [r0, r1) that may keep one of them by the
// band, and what masks them.
struct Chunk {
  int64_t c0;           // first key of the chunk (a multiple of KC)
  int64_t lo, hi;       // columns in range
  int64_t r0, r1;       // rows of the block to compute
  bool band;            // some row drops some column by the band
  const uint8_t *keep;  // the block mask's bool tile (rows of bm_kb), or null
  int64_t keep_col;     // column of key c0 in that tile (negative: the chunk starts before it)
};

// S[r][0..KC) = q_r . k_{c0 + j} for rows [r0, r1) (padding keys give 0).
void scores(const Args &a, const float *qh, const float *kt, int64_t i0, const Chunk &c,
            Scratch &w) {
  for (int64_t r0 = c.r0; r0 < c.r1; r0 += R) {
    const float *qr[R];
    for (int rr = 0; rr < R; ++rr)
      qr[rr] = qh + (i0 + r0 + std::min<int64_t>(rr, c.r1 - r0 - 1)) * a.sq_t;
    v16 acc[R][NV] = {};
    for (int64_t d = 0; d < a.D; ++d) {
      v16 kv[NV];
#pragma GCC unroll 4
      for (int vv = 0; vv < NV; ++vv) kv[vv] = load(kt + d * KC + 16 * vv);
#pragma GCC unroll 4
      for (int rr = 0; rr < R; ++rr) {
        v16 qv = splat(qr[rr][d]);
#pragma GCC unroll 4
        for (int vv = 0; vv < NV; ++vv) acc[rr][vv] += qv * kv[vv];
      }
    }
    for (int rr = 0; rr < R && r0 + rr < c.r1; ++rr)
      for (int vv = 0; vv < NV; ++vv) store(w.s.data() + (r0 + rr) * KC + 16 * vv, acc[rr][vv]);
  }
}

// Row i of the mask tensor over the chunk's KC columns: a pointer to read 16 at a time
// (`buf` filled with the chunk's columns [lo, hi) where the row is broadcast or the
// chunk runs past the last key).
template <class T>
const T *mask_row(const Args &a, int64_t b, int64_t h, int64_t i, const Chunk &c, T *buf) {
  const T *row = static_cast<const T *>(a.mask) + b * a.sm_b + h * a.sm_h + i * a.sm_t;
  if (a.sm_s == 1 && c.c0 + KC <= a.S) return row + c.c0;
  for (int64_t j = 0; j < KC; ++j) buf[j] = (j >= c.lo && j < c.hi) ? row[(c.c0 + j) * a.sm_s] : T(0);
  return buf;
}

// Scores -> weights in place, online softmax state updated (alpha: the rescale of O).
void softmax(const Args &a, int64_t b, int64_t h, int64_t i0, const Chunk &c, Scratch &w) {
  const v16 scale = splat(float(a.scale));
  v16i lane;
  for (int i = 0; i < 16; ++i) lane[i] = i;
  const float *rel = a.rel ? a.rel + h * a.rel_sh : nullptr;
  const bool keep_direct = c.keep && c.keep_col >= 0 && c.keep_col + KC <= a.bm_kb;
  uint8_t kbuf[KC], mbuf[KC];
  float fbuf[KC];
  for (int64_t r = c.r0; r < c.r1; ++r) {
    const int64_t i = i0 + r;
    float *s = w.s.data() + r * KC;
    int64_t lo = c.lo, hi = c.hi;  // the columns this row keeps by range and band
    if (c.band) {
      lo = std::min<int64_t>(KC, std::max<int64_t>(lo, i + a.band_lo - c.c0));
      hi = std::max<int64_t>(0, std::min<int64_t>(hi, i + a.band_hi - c.c0 + 1));
    }
    const uint8_t *keep = nullptr;
    if (c.keep) {
      const uint8_t *tile_row = c.keep + r * a.bm_kb;  // column n is key c0 + n - keep_col
      if (keep_direct) {
        keep = tile_row + c.keep_col;
      } else {  // the tile covers part of the chunk: copy its columns
        for (int64_t j = 0; j < KC; ++j)
          kbuf[j] = (j >= c.lo && j < c.hi) ? tile_row[c.keep_col + j] : 0;
        keep = kbuf;
      }
    }
    const uint8_t *mkeep = nullptr;
    const float *madd = nullptr;
    if (a.mask_kind == MASK_BOOL) mkeep = mask_row<uint8_t>(a, b, h, i, c, mbuf);
    if (a.mask_kind == MASK_FLOAT) madd = mask_row<float>(a, b, h, i, c, fbuf);
    v16 x[NV];
    v16 mx = splat(NEG_INF);
#pragma GCC unroll 4
    for (int vv = 0; vv < NV; ++vv) {
      v16 sv = load(s + 16 * vv) * scale;
      if (rel) sv += load(rel + (c.c0 + 16 * vv - i - a.rel_lo));  // bias of j - i
      if (madd) sv += load(madd + 16 * vv);
      v16i col = lane + int32_t(16 * vv);
      v16i drop = (col < int32_t(lo)) | (col >= int32_t(hi));
      if (keep) {
        v16b kb;
        std::memcpy(&kb, keep + 16 * vv, 16);
        drop |= (__builtin_convertvector(kb, v16i) == 0);
      }
      if (mkeep) {
        v16b kb;
        std::memcpy(&kb, mkeep + 16 * vv, 16);
        drop |= (__builtin_convertvector(kb, v16i) == 0);
      }
      x[vv] = drop ? splat(NEG_INF) : sv;
      mx = vmax(mx, x[vv]);
    }
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
      v16 p = vexp(x[vv] - m);
      store(s + 16 * vv, p);
      sum += p;
    }
    const float alpha = (m_old == NEG_INF) ? 0.0f : std::exp(m_old - m_new);
    w.alpha[r] = alpha;
    w.l[r] = w.l[r] * alpha + hsum(sum);
    w.m[r] = m_new;
  }
}

// O[r] = alpha[r] O[r] + P[r] V_chunk for NW vectors of value columns from col.
template <int NW>
void pv_cols(const Args &a, const float *vh, const Chunk &c, Scratch &w, int64_t col) {
  for (int64_t r0 = c.r0; r0 < c.r1; r0 += R) {
    const int nr = int(std::min<int64_t>(R, c.r1 - r0));
    v16 acc[R][NW];
    const float *p[R];
    for (int rr = 0; rr < R; ++rr) {
      const int64_t r = r0 + std::min(rr, nr - 1);
      const v16 al = splat(w.alpha[r]);
      for (int vv = 0; vv < NW; ++vv)
        acc[rr][vv] = load(w.o.data() + r * a.DV + col + 16 * vv) * al;
      p[rr] = w.s.data() + r * KC;
    }
    for (int64_t j = c.lo; j < c.hi; ++j) {
      const float *vr = vh + (c.c0 + j) * a.sv_t + col;
      v16 vj[NW];
#pragma GCC unroll 4
      for (int vv = 0; vv < NW; ++vv) vj[vv] = load(vr + 16 * vv);
#pragma GCC unroll 4
      for (int rr = 0; rr < R; ++rr) {
        const v16 pj = splat(p[rr][j]);
#pragma GCC unroll 4
        for (int vv = 0; vv < NW; ++vv) acc[rr][vv] += pj * vj[vv];
      }
    }
    for (int rr = 0; rr < nr; ++rr)
      for (int vv = 0; vv < NW; ++vv)
        store(w.o.data() + (r0 + rr) * a.DV + col + 16 * vv, acc[rr][vv]);
  }
}

void pv(const Args &a, const float *vh, const Chunk &c, Scratch &w) {
  for (int64_t col = 0; col < a.DV; col += 64) {
    switch (std::min<int64_t>(4, (a.DV - col) / 16)) {
      case 4: pv_cols<4>(a, vh, c, w, col); break;
      case 3: pv_cols<3>(a, vh, c, w, col); break;
      case 2: pv_cols<2>(a, vh, c, w, col); break;
      default: pv_cols<1>(a, vh, c, w, col); break;
    }
  }
}

// One block of query rows [i0, i1) of batch b, head h.
void block(const Args &a, const PackedKeys &pk, int64_t b, int64_t h, int64_t i0, int64_t i1,
           Scratch &w) {
  const int64_t rows = i1 - i0;
  const int64_t hk = h / (a.H / a.HKV);
  const float *qh = a.q + b * a.sq_b + h * a.sq_h;
  const float *kt = pk.kt.get() + (b * a.HKV + hk) * pk.chunks * a.D * KC;
  const float *vh = a.v + b * a.sv_b + hk * a.sv_h;
  std::fill(w.o.begin(), w.o.begin() + rows * a.DV, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, NEG_INF);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  // the keys [k0, k1), masked by `keep` (key k0 at column keep_col0 of it) or not
  auto run = [&](int64_t k0, int64_t k1, const uint8_t *keep, int64_t keep_col0) {
    for (int64_t ci = k0 / KC; ci * KC < k1; ++ci) {
      Chunk c;
      c.c0 = ci * KC;
      c.lo = std::max<int64_t>(0, k0 - c.c0);
      c.hi = std::min<int64_t>(KC, k1 - c.c0);
      // rows whose band meets keys [c0 + lo, c0 + hi)
      c.r0 = std::max<int64_t>(0, c.c0 + c.lo - a.band_hi - i0);
      c.r1 = std::min<int64_t>(rows, c.c0 + c.hi - 1 - a.band_lo - i0 + 1);
      if (c.r0 >= c.r1) continue;
      c.band = (i0 + c.r1 - 1 + a.band_lo > c.c0 + c.lo) || (i0 + c.r0 + a.band_hi < c.c0 + c.hi - 1);
      c.keep = keep;
      c.keep_col = keep_col0 + (c.c0 - k0);
      scores(a, qh, kt + ci * a.D * KC, i0, c, w);
      softmax(a, b, h, i0, c, w);
      pv(a, vh, c, w);
    }
  };
  // keys any row of the block may see by the band
  const int64_t lo = std::max<int64_t>(0, i0 + a.band_lo);
  const int64_t hi = std::min<int64_t>(a.S, i1 - 1 + a.band_hi + 1);
  if (lo < hi) {
    if (a.bm_kind) {
      const int64_t bi = i0 / a.bm_qb, at = b * a.bm_sb + h * a.bm_sh + bi * a.bm_si;
      const int8_t *kind = a.bm_kind + at;
      const int64_t *index = a.bm_index + at;
      for (int64_t bj = lo / a.bm_kb; bj * a.bm_kb < hi; ++bj) {
        if (kind[bj] == EMPTY) continue;
        const int64_t k0 = std::max(lo, bj * a.bm_kb), k1 = std::min(hi, (bj + 1) * a.bm_kb);
        const uint8_t *keep = nullptr;
        if (kind[bj] != FULL) keep = a.bm_masks + index[bj] * a.bm_qb * a.bm_kb;
        run(k0, k1, keep, k0 - bj * a.bm_kb);
      }
    } else {
      run(lo, hi, nullptr, 0);
    }
  }
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

}  // namespace

extern "C" int attnkit_forward(const Args *args) {
  const Args &a = *args;
  if (a.D <= 0 || a.DV <= 0 || a.DV % 16 || a.bq <= 0 || a.HKV <= 0 || a.H % a.HKV) return 1;
  if (a.bm_kind && a.bq != a.bm_qb) return 2;
  PackedKeys pk;
  pk.chunks = (a.S + KC - 1) / KC;
  pk.kt.reset(new float[a.B * a.HKV * pk.chunks * a.D * KC]);
  parallel<NoState>(a, a.B * a.HKV * pk.chunks, [&](NoState &, int64_t it) {
    const int64_t ci = it % pk.chunks, bh = it / pk.chunks;
    const float *k = a.k + (bh / a.HKV) * a.sk_b + (bh % a.HKV) * a.sk_h;
    float *kt = pk.kt.get() + it * a.D * KC;
    for (int64_t j = 0; j < KC; ++j) {
      const int64_t key = ci * KC + j;
      for (int64_t d = 0; d < a.D; ++d) kt[d * KC + j] = key < a.S ? k[key * a.sk_t + d] : 0.0f;
    }
  });
  const int64_t nq = (a.T + a.bq - 1) / a.bq;  // query blocks per (batch, head)
  parallel<Scratch>(a, a.B * a.H * nq, [&](Scratch &w, int64_t it) {
    const int64_t qi = it % nq, bh = it / nq;
    const int64_t i0 = qi * a.bq, i1 = std::min(a.T, i0 + a.bq);
    block(a, pk, bh / a.H, bh % a.H, i0, i1, w);
  });
  return 0;
}
