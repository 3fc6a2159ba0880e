// A self-test of attnkit's native kernel that needs no torch: built beside attention.cpp
// for any target (the tests cross-compile it for aarch64 and run it under qemu-user), it
// checks the forward (out, lse) and the backward (dq, dk, dv) of a few calls against a
// float64 reference written here, with flash-attn's rule: the kernel's error is at most
// twice that of the same plain math in float32 (plus a small floor). On a build without
// bf16 products it checks each call's bf16 forward too (inputs rounded to bf16, read by
// the kernel as they are) against float64 of the rounded inputs.
//
// Prints one line per case and a closing "N passed, N failed"; exit 0 iff none failed.
// Arguments, if any, run only the checks whose names contain one of them.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../../src/attnkit/backends/blockwise/native/attention.cpp"

namespace {

struct Case {
  const char *name;
  int64_t B, H, HKV, T, S, D, DV;
  int64_t lo, hi;  // keep key j for query i iff lo <= j - i <= hi
  bool bool_mask;  // also a random bool mask tensor (B, H, T, S)
  int64_t coin_from = 0;  // the mask keeps every key before this one (chunks kept whole)
  bool suffix = false;  // the kernel's mask holds keys coin_from.. alone (Args.mask_c0)
};

constexpr int64_t NONE = int64_t(1) << 40;

// Plain attention in T (double: the reference; float: the yardstick), gradients included.
template <class T>
struct Plain {
  std::vector<T> out, lse, dq, dk, dv;
};

template <class T>
Plain<T> plain(const Case &c, const std::vector<float> &q, const std::vector<float> &k,
               const std::vector<float> &v, const std::vector<uint8_t> &mask,
               const std::vector<float> &dout, double scale) {
  Plain<T> r;
  r.out.assign(c.B * c.H * c.T * c.DV, 0);
  r.lse.assign(c.B * c.H * c.T, 0);
  r.dq.assign(c.B * c.H * c.T * c.D, 0);
  r.dk.assign(c.B * c.HKV * c.S * c.D, 0);
  r.dv.assign(c.B * c.HKV * c.S * c.DV, 0);
  std::vector<T> p(c.S), dp(c.S);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h) {
      const int64_t hk = h / (c.H / c.HKV);
      const float *qh = q.data() + (b * c.H + h) * c.T * c.D;  // (data(): T or S may be 0)
      const float *kh = k.data() + (b * c.HKV + hk) * c.S * c.D;
      const float *vh = v.data() + (b * c.HKV + hk) * c.S * c.DV;
      for (int64_t i = 0; i < c.T; ++i) {
        T mx = -INFINITY;
        for (int64_t j = 0; j < c.S; ++j) {
          const bool keep = j - i >= c.lo && j - i <= c.hi &&
                            (!c.bool_mask || mask[((b * c.H + h) * c.T + i) * c.S + j]);
          T s = 0;
          for (int64_t d = 0; d < c.D; ++d) s += T(qh[i * c.D + d]) * T(kh[j * c.D + d]);
          p[j] = keep ? s * T(scale) : T(-INFINITY);
          mx = std::max(mx, p[j]);
        }
        const int64_t row = (b * c.H + h) * c.T + i;
        if (mx == T(-INFINITY)) {  // no key kept: out 0, lse -inf, no gradient
          r.lse[row] = T(-INFINITY);
          continue;
        }
        T sum = 0;
        for (int64_t j = 0; j < c.S; ++j) sum += p[j] = std::exp(p[j] - mx);
        for (int64_t j = 0; j < c.S; ++j) p[j] /= sum;
        r.lse[row] = mx + std::log(sum);
        T *o = &r.out[row * c.DV];
        for (int64_t j = 0; j < c.S; ++j)
          for (int64_t d = 0; d < c.DV; ++d) o[d] += p[j] * T(vh[j * c.DV + d]);
        // backward: dP = dO V^T, dS = P (dP - sum(dO * O)), dQ = scale dS K, ...
        const float *dor = &dout[row * c.DV];
        T delta = 0;
        for (int64_t d = 0; d < c.DV; ++d) delta += T(dor[d]) * o[d];
        for (int64_t j = 0; j < c.S; ++j) {
          T x = 0;
          for (int64_t d = 0; d < c.DV; ++d) x += T(dor[d]) * T(vh[j * c.DV + d]);
          dp[j] = p[j] * (x - delta) * T(scale);
          T *dvj = &r.dv[((b * c.HKV + hk) * c.S + j) * c.DV];
          for (int64_t d = 0; d < c.DV; ++d) dvj[d] += p[j] * T(dor[d]);
          T *dkj = &r.dk[((b * c.HKV + hk) * c.S + j) * c.D];
          for (int64_t d = 0; d < c.D; ++d) dkj[d] += dp[j] * T(qh[i * c.D + d]);
          for (int64_t d = 0; d < c.D; ++d) r.dq[row * c.D + d] += dp[j] * T(kh[j * c.D + d]);
        }
      }
    }
  return r;
}

// max |x - ref| over finite reference entries; equal infinities count as 0 error
template <class T>
double max_err(const std::vector<T> &x, const std::vector<double> &ref) {
  double e = 0;
  for (size_t n = 0; n < x.size(); ++n) {
    if (std::isinf(ref[n])) {
      if (double(x[n]) != ref[n]) return INFINITY;
      continue;
    }
    const double d = std::fabs(double(x[n]) - ref[n]);
    if (!(d <= e)) e = d;  // a NaN makes e NaN
  }
  return e;
}

bool within(const char *case_name, const char *what, double err, double plain_err) {
  const bool ok = err <= 2 * plain_err + 1e-6;
  std::printf("  %-22s %-4s error %.3g (plain float32 %.3g) %s\n", case_name, what, err,
              plain_err, ok ? "ok" : "FAILED");
  return ok;
}

// x rounded to bf16 (to nearest even): its bits, and its value as a float.
uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// x rounded to bf16: the bits into x16, their values as float32 into xr (same sizes).
void round_to_bf16(const std::vector<float> &x, std::vector<uint16_t> &x16,
                   std::vector<float> &xr) {
  for (size_t n = 0; n < x.size(); ++n) {
    x16[n] = to_bf16(x[n]);
    const uint32_t bits = uint32_t(x16[n]) << 16;
    std::memcpy(&xr[n], &bits, 4);
  }
}

// A bf16 forward on a build without bf16 products (converted to float32 in the kernel:
// attention.cpp's "bf16 read"), or a decode step's (converted as read): the inputs
// rounded to bf16, checked against float64 of the rounded inputs.
bool bf16_forward(const Case &c, Args a, const std::vector<float> &q,
                  const std::vector<float> &k, const std::vector<float> &v,
                  const std::vector<uint8_t> &mask, const std::vector<float> &dout,
                  double scale) {
  std::vector<uint16_t> q16(q.size()), k16(k.size()), v16(v.size());
  std::vector<float> qr(q.size()), kr(k.size()), vr(v.size());
  round_to_bf16(q, q16, qr), round_to_bf16(k, k16, kr), round_to_bf16(v, v16, vr);
  std::vector<float> out(c.B * c.H * c.T * c.DV), lse(c.B * c.H * c.T);
  a.q = reinterpret_cast<const float *>(q16.data());
  a.k = reinterpret_cast<const float *>(k16.data());
  a.v = reinterpret_cast<const float *>(v16.data());
  a.out = out.data(), a.lse = lse.data(), a.dtype = DT_BF16;
  if (attnkit_forward(&a) != 0) {
    std::printf("  %-22s bf16 forward returned an error: FAILED\n", c.name);
    return false;
  }
  const auto ref = plain<double>(c, qr, kr, vr, mask, dout, scale);
  const auto f32 = plain<float>(c, qr, kr, vr, mask, dout, scale);
  return within(c.name, "o16", max_err(out, ref.out), max_err(f32.out, ref.out));
}

bool run(const Case &c, std::mt19937 &rng) {
  std::normal_distribution<float> normal;
  std::bernoulli_distribution coin(0.7);
  auto randn = [&](int64_t n) {
    std::vector<float> x(n);
    for (auto &e : x) e = normal(rng);
    return x;
  };
  const auto q = randn(c.B * c.H * c.T * c.D), k = randn(c.B * c.HKV * c.S * c.D),
             v = randn(c.B * c.HKV * c.S * c.DV), dout = randn(c.B * c.H * c.T * c.DV);
  std::vector<uint8_t> mask(c.bool_mask ? c.B * c.H * c.T * c.S : 0);
  for (size_t n = 0; n < mask.size(); ++n) mask[n] = int64_t(n) % c.S < c.coin_from || coin(rng);
  const double scale = 1.0 / std::sqrt(double(c.D));

  Args a{};
  a.q = q.data(), a.k = k.data(), a.v = v.data();
  std::vector<float> out(c.B * c.H * c.T * c.DV), lse(c.B * c.H * c.T);
  a.out = out.data(), a.lse = lse.data();
  a.sq_b = c.H * c.T * c.D, a.sq_h = c.T * c.D, a.sq_t = c.D;
  a.sk_b = c.HKV * c.S * c.D, a.sk_h = c.S * c.D, a.sk_t = c.D;
  a.sv_b = c.HKV * c.S * c.DV, a.sv_h = c.S * c.DV, a.sv_t = c.DV;
  a.so_b = c.H * c.T * c.DV, a.so_h = c.T * c.DV, a.so_t = c.DV;
  a.B = c.B, a.H = c.H, a.HKV = c.HKV, a.T = c.T, a.S = c.S, a.D = c.D, a.DV = c.DV;
  a.scale = scale, a.band_lo = c.lo, a.band_hi = c.hi, a.bq = 128;
  const int64_t m0 = c.suffix ? c.coin_from : 0, width = c.S - m0;  // the mask's columns
  std::vector<uint8_t> tail(c.bool_mask ? c.B * c.H * c.T * width : 0);  // rows' keys m0..
  for (int64_t row = 0; row * width < int64_t(tail.size()); ++row)
    std::copy(mask.begin() + row * c.S + m0, mask.begin() + (row + 1) * c.S,
              tail.begin() + row * width);
  if (c.bool_mask) {
    a.mask = tail.data(), a.mask_kind = MASK_BOOL, a.mask_c0 = m0;
    a.sm_b = c.H * c.T * width, a.sm_h = c.T * width, a.sm_t = width, a.sm_s = 1;
  }
  a.threads = 2;
  if (attnkit_forward(&a) != 0) {
    std::printf("  %-22s forward returned an error: FAILED\n", c.name);
    return false;
  }
  // backward: lse +inf on dead rows, delta = rowsum(dO * O)
  std::vector<float> lse_b(lse), delta(c.B * c.H * c.T, 0.0f);
  for (size_t n = 0; n < lse_b.size(); ++n) {
    if (std::isinf(lse_b[n])) lse_b[n] = INFINITY;
    for (int64_t d = 0; d < c.DV; ++d) delta[n] += dout[n * c.DV + d] * out[n * c.DV + d];
  }
  std::vector<float> dq(c.B * c.H * c.T * c.D), dk(c.B * c.HKV * c.S * c.D),
      dv(c.B * c.HKV * c.S * c.DV);
  Args ab = a;
  ab.out = nullptr, ab.lse = lse_b.data();
  Grads g{dout.data(), delta.data(), dq.data(), dk.data(), dv.data()};
  if (attnkit_backward(&ab, &g) != 0) {
    std::printf("  %-22s backward returned an error: FAILED\n", c.name);
    return false;
  }
  const auto ref = plain<double>(c, q, k, v, mask, dout, scale);
  const auto f32 = plain<float>(c, q, k, v, mask, dout, scale);
  bool ok = true;
  ok &= within(c.name, "out", max_err(out, ref.out), max_err(f32.out, ref.out));
  ok &= within(c.name, "lse", max_err(lse, ref.lse), max_err(f32.lse, ref.lse));
  ok &= within(c.name, "dq", max_err(dq, ref.dq), max_err(f32.dq, ref.dq));
  ok &= within(c.name, "dk", max_err(dk, ref.dk), max_err(f32.dk, ref.dk));
  ok &= within(c.name, "dv", max_err(dv, ref.dv), max_err(f32.dv, ref.dv));
  if (!attnkit_bf16()) ok &= bf16_forward(c, a, q, k, v, mask, dout, scale);
  return ok;
}

// A shared-prefix cascade (attnkit_cascade): n requests of t queries over p shared keys and
// s keys of their own, against plain attention over each request's prefix ++ suffix
// (causal, aligned bottom-right), float64 and float32.
bool cascade(const char *name, int64_t n, int64_t H, int64_t HKV, int64_t t, int64_t p,
             int64_t s, int64_t D, std::mt19937 &rng) {
  std::normal_distribution<float> normal;
  auto randn = [&](int64_t count) {
    std::vector<float> x(count);
    for (auto &e : x) e = normal(rng);
    return x;
  };
  const int64_t g = H / HKV, rows = n * g * t;
  const auto q = randn(n * H * t * D), pk = randn(HKV * p * D), pv = randn(HKV * p * D),
             sk = randn(n * HKV * s * D), sv = randn(n * HKV * s * D);
  const double scale = 1.0 / std::sqrt(double(D));
  Args pre{}, suf{};
  // (the prefix pass's rows, (1, HKV, n g t, D), the kernel gathers from suf.q: pre.q unset)
  pre.k = pk.data(), pre.v = pv.data();
  pre.sk_b = pre.sv_b = HKV * p * D, pre.sk_h = pre.sv_h = p * D, pre.sk_t = pre.sv_t = D;
  pre.B = 1, pre.H = pre.HKV = HKV, pre.T = rows, pre.S = p, pre.D = pre.DV = D;
  pre.band_lo = -NONE, pre.band_hi = NONE;
  std::vector<float> out(n * H * t * D), lse(n * H * t);
  suf.q = q.data(), suf.k = sk.data(), suf.v = sv.data(), suf.out = out.data();
  suf.lse = lse.data();
  suf.sq_b = H * t * D, suf.sq_h = t * D, suf.sq_t = D;
  suf.sk_b = suf.sv_b = HKV * s * D, suf.sk_h = suf.sv_h = s * D, suf.sk_t = suf.sv_t = D;
  suf.so_b = H * t * D, suf.so_h = t * D, suf.so_t = D;
  suf.B = n, suf.H = H, suf.HKV = HKV, suf.T = t, suf.S = s, suf.D = suf.DV = D;
  suf.band_lo = -NONE, suf.band_hi = s - t;  // causal inside the suffix, bottom-right
  for (Args *a : {&pre, &suf}) a->scale = scale, a->bq = 128, a->threads = 2;
  if (attnkit_cascade(&pre, &suf) != 0) {
    std::printf("  %-22s cascade returned an error: FAILED\n", name);
    return false;
  }
  double err = 0, plain_err = 0, lse_err = 0, lse_plain = 0;
  for (int64_t r = 0; r < n; ++r) {  // request r alone: prefix ++ its suffix, causal
    const Case c{name, 1, H, HKV, t, p + s, D, D, -NONE, p + s - t, false};
    std::vector<float> k((HKV * (p + s)) * D), v(k.size()),
        qr(q.begin() + r * H * t * D, q.begin() + (r + 1) * H * t * D);
    for (int64_t hk = 0; hk < HKV; ++hk) {
      std::memcpy(&k[hk * (p + s) * D], &pk[hk * p * D], p * D * sizeof(float));
      std::memcpy(&v[hk * (p + s) * D], &pv[hk * p * D], p * D * sizeof(float));
      std::memcpy(&k[(hk * (p + s) + p) * D], &sk[(r * HKV + hk) * s * D], s * D * sizeof(float));
      std::memcpy(&v[(hk * (p + s) + p) * D], &sv[(r * HKV + hk) * s * D], s * D * sizeof(float));
    }
    const std::vector<uint8_t> none;
    const std::vector<float> dout(H * t * D, 0.0f);
    const auto ref = plain<double>(c, qr, k, v, none, dout, scale);
    const auto f32 = plain<float>(c, qr, k, v, none, dout, scale);
    const std::vector<float> o(out.begin() + r * H * t * D, out.begin() + (r + 1) * H * t * D),
        l(lse.begin() + r * H * t, lse.begin() + (r + 1) * H * t);
    err = std::max(err, max_err(o, ref.out)), plain_err = std::max(plain_err, max_err(f32.out, ref.out));
    lse_err = std::max(lse_err, max_err(l, ref.lse));
    lse_plain = std::max(lse_plain, max_err(f32.lse, ref.lse));
  }
  return within(name, "out", err, plain_err) & within(name, "lse", lse_err, lse_plain);
}

// x rounded to the nearest bf16, a tie to the even one (finite x): the two bf16 around x
// compared in double, not the kernel's bit trick.
uint16_t nearest_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t lo = u & 0xFFFF0000u, hi = lo + 0x10000u;
  float flo, fhi;
  std::memcpy(&flo, &lo, 4);
  std::memcpy(&fhi, &hi, 4);
  const double dlo = std::fabs(double(x) - flo), dhi = std::fabs(double(fhi) - x);
  if (dlo != dhi) return uint16_t((dlo < dhi ? lo : hi) >> 16);
  return uint16_t((((lo >> 16) & 1) ? hi : lo) >> 16);
}

// The kernel's own bf16 output (Args.out16, lse null) on ties: one query of scores 0 over
// two keys whose values differ by one bf16 step, so each output, their mean, lies exactly
// halfway between two bf16 numbers (and must go to the even one), beside plain values.
bool own_out_ties() {
  const int64_t D = 16;
  std::vector<float> q(D, 0.0f), k(2 * D, 0.5f), v(2 * D), want(D);
  for (int64_t d = 0; d < D; ++d) {
    uint32_t bits = 0x3F800000u + (uint32_t(d) << 16);  // 1, 1 + 2^-7, 1 + 2^-6, ...
    std::memcpy(&v[d], &bits, 4);
    bits += 0x10000u;  // the next bf16 up
    std::memcpy(&v[D + d], &bits, 4);
  }
  Args a{};
  std::vector<float> lse(1);
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = want.data(), a.lse = lse.data();
  a.sq_b = a.sq_h = a.sq_t = D, a.sk_b = a.sk_h = a.sv_b = a.sv_h = 2 * D;
  a.sk_t = a.sv_t = D, a.so_b = a.so_h = a.so_t = D;
  a.B = a.H = a.HKV = a.T = 1, a.S = 2, a.D = a.DV = D;
  a.scale = 0.25, a.band_lo = -NONE, a.band_hi = NONE, a.bq = 128, a.threads = 1;
  bool ok = attnkit_forward(&a) == 0;
  std::vector<uint16_t> out16(D);
  Args oa = a;
  oa.out = nullptr, oa.lse = nullptr, oa.out16 = out16.data();
  ok &= attnkit_forward(&oa) == 0;
  int ties = 0;
  for (int64_t d = 0; d < D; ++d) {
    uint32_t u;
    std::memcpy(&u, &want[d], 4);
    ties += (u & 0xFFFFu) == 0x8000u;
    ok &= out16[d] == nearest_bf16(want[d]);
  }
  ok &= ties == D;  // (every mean a tie: the rounding rule is what is checked)
  std::printf("  %-22s %d ties rounded to even: %s\n", "own bf16 output", ties, ok ? "ok" : "FAILED");
  return ok;
}

// A paged decode step (Args.pages): the keys and values of B rows scattered over a pool of
// shuffled pages, a page's kv heads side by side, (P, HKV, ps, D). Read on 1 and 2 threads
// (the heads of a row walked together, all or some: attention.cpp's "page walk"), each
// giving the bits of the same call on the contiguous keys, which meets float64; a page id
// outside the pool is refused before anything is read.
bool paged(const char *name, int64_t B, int64_t H, int64_t HKV, int64_t S, int64_t ps,
           int64_t D, std::mt19937 &rng) {
  std::normal_distribution<float> normal;
  auto randn = [&](int64_t count) {
    std::vector<float> x(count);
    for (auto &e : x) e = normal(rng);
    return x;
  };
  const int64_t n = (S + ps - 1) / ps, P = B * n + 2;
  const auto q = randn(B * H * D), k = randn(B * HKV * S * D), v = randn(B * HKV * S * D);
  std::vector<int64_t> ids(P), table(B * n);
  for (int64_t i = 0; i < P; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<float> kp(P * HKV * ps * D, NAN), vp(kp.size(), NAN);  // unread: NaN
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < S; ++j)
      for (int64_t hk = 0; hk < HKV; ++hk) {
        const int64_t page = table[b * n + j / ps] = ids[b * n + j / ps];
        const int64_t at = ((page * HKV + hk) * ps + j % ps) * D;
        std::memcpy(&kp[at], &k[((b * HKV + hk) * S + j) * D], D * sizeof(float));
        std::memcpy(&vp[at], &v[((b * HKV + hk) * S + j) * D], D * sizeof(float));
      }
  Args a{};
  std::vector<float> out(B * H * D), lse(B * H), want(out.size());
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = want.data(), a.lse = lse.data();
  a.sq_b = H * D, a.sq_h = D, a.sq_t = D;
  a.sk_b = a.sv_b = HKV * S * D, a.sk_h = a.sv_h = S * D, a.sk_t = a.sv_t = D;
  a.so_b = H * D, a.so_h = D, a.so_t = D;
  a.B = B, a.H = H, a.HKV = HKV, a.T = 1, a.S = S, a.D = a.DV = D;
  a.scale = 1.0 / std::sqrt(double(D)), a.band_lo = -NONE, a.band_hi = NONE, a.bq = 128;
  a.threads = 2;
  bool ok = attnkit_forward(&a) == 0;
  Args pa = a;
  pa.k = kp.data(), pa.v = vp.data(), pa.out = out.data();
  pa.sk_b = pa.sv_b = 0, pa.sk_h = pa.sv_h = ps * D;
  pa.sk_page = pa.sv_page = HKV * ps * D;
  pa.pages = table.data(), pa.pages_sb = n, pa.page_size = ps, pa.num_pages = P;
  for (int64_t apart : {0, 1})  // float32 pages walked whole, or a head at a time
    for (int64_t threads : {1, 2}) {
      pa.threads = threads, pa.page_heads_apart = apart;
      std::fill(out.begin(), out.end(), NAN);
      ok &= attnkit_forward(&pa) == 0 && std::memcmp(out.data(), want.data(), out.size() * 4) == 0;
    }
  // the kernel's own output: bf16 rounded to nearest (ties to even), no lse asked for
  std::vector<uint16_t> out16(out.size());
  Args oa = pa;
  oa.out = nullptr, oa.lse = nullptr, oa.out16 = out16.data();
  ok &= attnkit_forward(&oa) == 0;
  for (size_t i = 0; i < out.size(); ++i) ok &= out16[i] == nearest_bf16(want[i]);
  table[B * n - 1] = P;  // a page outside the pool
  ok &= attnkit_forward(&pa) == BAD_PAGE;
  std::printf("  %-22s same bits as contiguous, walked or not, 1 and 2 threads; bf16 out; bad id refused: %s\n",
              name, ok ? "ok" : "FAILED");
  const Case c{name, B, H, HKV, 1, S, D, D, -NONE, NONE, false};
  const std::vector<uint8_t> none;
  const std::vector<float> dout(B * H * D, 0.0f);
  const auto ref = plain<double>(c, q, k, v, none, dout, a.scale);
  const auto f32 = plain<float>(c, q, k, v, none, dout, a.scale);
  return ok & within(name, "out", max_err(want, ref.out), max_err(f32.out, ref.out));
}

// A packed variable-length batch (Args.nseq, feature "varlen"): sequences of their own
// lengths one after another along t (q, k, v, out as (total, heads, D)), causal aligned
// bottom-right in each, forward and backward, against plain attention over each sequence
// alone: a query sequence of none, one with more queries than keys (its first rows keep
// no key), lengths across key chunks and query blocks. The same bits on 1 and 2 threads;
// on a build without bf16 products its bf16 forward too (keys and values converted for
// the call, attention.cpp's "bf16 read").
bool varlen(const char *name, std::vector<int64_t> lens_q, std::vector<int64_t> lens_k,
            int64_t H, int64_t HKV, int64_t D, std::mt19937 &rng) {
  std::normal_distribution<float> normal;
  auto randn = [&](int64_t count) {
    std::vector<float> x(count);
    for (auto &e : x) e = normal(rng);
    return x;
  };
  const int64_t n = int64_t(lens_q.size());
  std::vector<int64_t> cu_q(n + 1, 0), cu_k(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) cu_q[i + 1] = cu_q[i] + lens_q[i], cu_k[i + 1] = cu_k[i] + lens_k[i];
  const int64_t tq = cu_q[n], tk = cu_k[n];
  const auto q = randn(tq * H * D), k = randn(tk * HKV * D), v = randn(tk * HKV * D),
             dout = randn(tq * H * D);  // dout: sequence by sequence, (H, len, D) blocks
  const double scale = 1.0 / std::sqrt(double(D));
  Args a{};
  std::vector<float> out(tq * H * D), lse(tq * H);
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out.data(), a.lse = lse.data();
  a.sq_h = D, a.sq_t = H * D, a.sk_h = a.sv_h = D, a.sk_t = a.sv_t = HKV * D;
  a.so_h = D, a.so_t = H * D;
  a.B = 1, a.H = H, a.HKV = HKV, a.T = tq, a.S = tk, a.D = a.DV = D;
  a.scale = scale, a.band_lo = -NONE, a.band_hi = 0, a.bq = 48;  // causal; blocks of 48
  a.cu_q = cu_q.data(), a.cu_k = cu_k.data(), a.nseq = n, a.varlen_align = 1, a.kv_splits = 1;
  a.threads = 2;
  bool ok = attnkit_forward(&a) == 0;
  // backward: lse +inf on dead rows, delta = rowsum(dO * O), both (H, len) per sequence
  std::vector<float> lse_b(lse), delta(tq * H, 0.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < lens_q[i]; ++t) {
        const int64_t row = H * cu_q[i] + h * lens_q[i] + t, tok = cu_q[i] + t;
        if (std::isinf(lse_b[row])) lse_b[row] = INFINITY;
        for (int64_t d = 0; d < D; ++d) delta[row] += dout[row * D + d] * out[(tok * H + h) * D + d];
      }
  std::vector<float> dq(tq * H * D), dk(tk * HKV * D), dv(tk * HKV * D);
  Args ab = a;
  ab.out = nullptr, ab.lse = lse_b.data();
  Grads g{dout.data(), delta.data(), dq.data(), dk.data(), dv.data()};
  ok &= attnkit_backward(&ab, &g) == 0;
  // one thread: the same bits
  std::vector<float> out1(out.size()), dq1(dq.size()), dk1(dk.size()), dv1(dv.size());
  Args a1 = a, ab1 = ab;
  a1.out = out1.data(), a1.threads = ab1.threads = 1;
  std::vector<float> lse1(lse.size());
  a1.lse = lse1.data();
  Grads g1{dout.data(), delta.data(), dq1.data(), dk1.data(), dv1.data()};
  ok &= attnkit_forward(&a1) == 0 && attnkit_backward(&ab1, &g1) == 0;
  auto same = [](const std::vector<float> &x, const std::vector<float> &y) {
    return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  ok &= same(out, out1) && same(lse, lse1) && same(dq, dq1) && same(dk, dk1) && same(dv, dv1);
  std::printf("  %-22s %lld sequences, same bits on 1 and 2 threads: %s\n", name,
              (long long)n, ok ? "ok" : "FAILED");
  // each sequence alone, (H, len, D) blocks, against float64 and float32
  double err[5] = {}, plain_err[5] = {};
  // a sequence's rows of a packed (total, heads, D) tensor as (heads, len, D), and a
  // block of the kernel's own sequence-by-sequence layout
  auto unpack = [&](const std::vector<float> &x, int64_t heads, int64_t tok0, int64_t len) {
    std::vector<float> r(heads * len * D);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < len; ++t)
        std::memcpy(&r[(h * len + t) * D], &x[((tok0 + t) * heads + h) * D], D * sizeof(float));
    return r;
  };
  auto block = [](const std::vector<float> &x, int64_t at, int64_t count) {
    return std::vector<float>(x.begin() + at, x.begin() + at + count);
  };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t T = lens_q[i], S = lens_k[i], q0 = cu_q[i], k0 = cu_k[i];
    const Case c{name, 1, H, HKV, T, S, D, D, -NONE, S - T, false};
    const auto qs = unpack(q, H, q0, T), os = unpack(out, H, q0, T), ks = unpack(k, HKV, k0, S),
               vs = unpack(v, HKV, k0, S), ls = block(lse, H * q0, H * T),
               dos = block(dout, H * q0 * D, H * T * D), dqs = block(dq, H * q0 * D, H * T * D),
               dks = block(dk, HKV * k0 * D, HKV * S * D), dvs = block(dv, HKV * k0 * D, HKV * S * D);
    const std::vector<uint8_t> none;
    const auto ref = plain<double>(c, qs, ks, vs, none, dos, scale);
    const auto f32 = plain<float>(c, qs, ks, vs, none, dos, scale);
    const std::vector<float> *got[5] = {&os, &ls, &dqs, &dks, &dvs};
    const std::vector<double> *want[5] = {&ref.out, &ref.lse, &ref.dq, &ref.dk, &ref.dv};
    const std::vector<float> *yard[5] = {&f32.out, &f32.lse, &f32.dq, &f32.dk, &f32.dv};
    for (int x = 0; x < 5; ++x) {
      err[x] = std::max(err[x], max_err(*got[x], *want[x]));
      plain_err[x] = std::max(plain_err[x], max_err(*yard[x], *want[x]));
    }
  }
  const char *what[5] = {"out", "lse", "dq", "dk", "dv"};
  for (int x = 0; x < 5; ++x) ok &= within(name, what[x], err[x], plain_err[x]);
  if (!attnkit_bf16()) {  // the bf16 forward: inputs rounded, against float64 of them
    std::vector<uint16_t> q16(q.size()), k16(k.size()), v16(v.size());
    std::vector<float> qr(q.size()), kr(k.size()), vr(v.size());
    round_to_bf16(q, q16, qr), round_to_bf16(k, k16, kr), round_to_bf16(v, v16, vr);
    Args b16 = a;
    b16.q = reinterpret_cast<const float *>(q16.data());
    b16.k = reinterpret_cast<const float *>(k16.data());
    b16.v = reinterpret_cast<const float *>(v16.data());
    b16.dtype = DT_BF16;
    std::vector<float> o(out.size()), l(lse.size());
    b16.out = o.data(), b16.lse = l.data();
    ok &= attnkit_forward(&b16) == 0;
    // against the float32 kernel on the rounded inputs: the conversion is exact
    Args f = a;
    std::vector<float> of(out.size()), lf(lse.size());
    f.q = qr.data(), f.k = kr.data(), f.v = vr.data(), f.out = of.data(), f.lse = lf.data();
    const bool bits = attnkit_forward(&f) == 0 && same(o, of) && same(l, lf);
    std::printf("  %-22s bf16 forward, the float32 bits of its rounded inputs: %s\n", name,
                bits ? "ok" : "FAILED");
    ok &= bits;
  }
  return ok;
}

// simd::exp2 (the forward's weights, every build) against double: within 2.5 ulp over
// the normal range (its documented 2.3), exact for whole x (2^0 = 1: a row whose bound
// did not move keeps alpha = 1; O's other rescales), -inf and x below the subnormals give
// +0, NaN stays NaN; and
// simd::exp2_bf16 within its documented 1.1e-4 relative.
bool exp2_accuracy() {
  double worst_ulp = 0.0, worst_bf16 = 0.0;
  bool ok = true;
  float xs[simd::W], got_n[simd::W];
  for (int64_t n = 0; n < 2000000; n += simd::W) {
    for (int l = 0; l < simd::W; ++l) xs[l] = -126.0f + 126.0f * float(n + l) / 2000000.0f;
    float y[simd::W], yb[simd::W];
    simd::store(y, simd::exp2(simd::load(xs)));
    simd::store(yb, simd::exp2_bf16(simd::load(xs)));
    for (int l = 0; l < simd::W; ++l) {
      const double want = std::exp2(double(xs[l]));
      const double ulp = std::nextafter(float(want), INFINITY) - float(want);
      worst_ulp = std::max(worst_ulp, std::fabs(y[l] - want) / ulp);
      worst_bf16 = std::max(worst_bf16, std::fabs(yb[l] - want) / want);
    }
  }
  for (int n = -126; n <= 127; ++n) {  // whole x: exactly 2^x (O's rescale by M_STEP)
    simd::store(got_n, simd::exp2(simd::splat(float(n))));
    ok &= got_n[0] == std::ldexp(1.0f, n);
  }
  const float special[] = {0.0f, -0.0f, -INFINITY, -150.0f, -1000.0f, NAN};
  float got[simd::W] = {};
  for (float x : special) {
    simd::store(got, simd::exp2(simd::splat(x)));
    const bool right = std::isnan(x)          ? std::isnan(got[0])
                       : x == 0.0f            ? got[0] == 1.0f
                                              : got[0] == 0.0f && !std::signbit(got[0]);
    ok &= right;
  }
  ok &= worst_ulp <= 2.5 && worst_bf16 <= 1.1e-4;
  std::printf("  %-22s %.2f ulp (<= 2.5), bf16 %.3g (<= 1.1e-4), special values: %s\n",
              "2^x", worst_ulp, worst_bf16, ok ? "ok" : "FAILED");
  return ok;
}

#if defined(ATTNKIT_BF16)
// Every bf16 product (gemm_bf16: AMX tiles on an avx512-amx build, vdpbf16ps on
// avx512-bf16) against float64 of the same bf16 operands: C = alpha C + A B and C = A B,
// over sizes that leave rows and pairs past the last whole tile (16 rows, 16 pairs) and
// strided A and B. Products of two bf16 are exact in float32, so the error is the float32
// sums' alone: within 2^-20 of sum |a b| (plus the rescaled C's own rounding).
bool bf16_products(std::mt19937 &rng) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const int64_t sizes[][3] = {{16, 16, 16}, {48, 64, 32}, {37, 32, 21}, {5, 16, 40},
                              {144, 64, 32}, {33, 48, 17}, {16, 16, 7}, {130, 128, 64}};
  double worst = 0.0;
  bool ok = true;
  for (const auto &sz : sizes) {
    const int64_t rows = sz[0], cols = sz[1], kp = sz[2];
    const int64_t ars = 2 * kp + 6, ldb = 2 * cols + 32, ldc = cols + 16;  // (strided)
    std::vector<uint16_t> a(rows * ars), b(kp * ldb);
    for (auto &x : a) x = to_bf16(u(rng));
    for (auto &x : b) x = to_bf16(u(rng));
    std::vector<float> c0(rows * ldc), alpha(rows);
    for (auto &x : c0) x = u(rng);
    for (int64_t r = 0; r < rows; ++r) alpha[r] = r % 3 ? 1.0f : 0.25f * float(r % 5);
    for (int acc = 0; acc < 2; ++acc) {
      std::vector<float> c = c0;
      if (acc)
        gemm_bf16<true>(c.data(), ldc, rows, cols, a.data(), ars, b.data(), ldb, kp,
                        alpha.data());
      else
        gemm_bf16<false>(c.data(), ldc, rows, cols, a.data(), ars, b.data(), ldb, kp, nullptr);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) {
          double want = acc ? double(alpha[r]) * c0[r * ldc + j] : 0.0;
          double mag = std::fabs(want);
          for (int64_t p = 0; p < 2 * kp; ++p) {
            const double x = double(as_f32(a[r * ars + p])) * as_f32(b[(p / 2) * ldb + 2 * j + p % 2]);
            want += x, mag += std::fabs(x);
          }
          const double err = std::fabs(c[r * ldc + j] - want) / (mag + 1e-30);
          worst = std::max(worst, err);
        }
      for (int64_t r = 0; r < rows; ++r)  // the padding between rows is left alone
        for (int64_t j = cols; j < ldc; ++j) ok &= c[r * ldc + j] == c0[r * ldc + j];
    }
  }
  ok &= worst <= std::ldexp(1.0, -20);
  const char *tiles = "";
#if defined(ATTNKIT_AMX)
  // The tiles' state as the products found it: another tile configuration loaded before
  // them is loaded again after their Scope, and where none was, none is.
  tiles = ", no tile state changed";
  if (amx::usable()) {
    std::vector<uint16_t> a(64 * 64, to_bf16(1.0f)), b(64 * 64, to_bf16(0.5f));
    std::vector<float> c(64 * 64);
    amx::Config theirs, after;
    theirs.palette = 1, theirs.rows[0] = 3, theirs.colsb[0] = 12;
    _tile_loadconfig(&theirs);
    {
      const TileScope scope;
      gemm_bf16<false>(c.data(), 64, 64, 64, a.data(), 64, b.data(), 128, 32, nullptr);
    }
    _tile_storeconfig(&after);
    ok &= std::memcmp(&after, &theirs, sizeof after) == 0 && c[0] == 32.0f;
    _tile_release();
    {
      const TileScope scope;
      gemm_bf16<false>(c.data(), 64, 64, 64, a.data(), 64, b.data(), 128, 32, nullptr);
    }
    _tile_storeconfig(&after);
    ok &= after.palette == 0;
  }
#endif
  std::printf("  %-22s worst %.3g of sum |a b| (<= 2^-20), padding untouched%s: %s\n",
              "bf16 products", worst, tiles, ok ? "ok" : "FAILED");
  return ok;
}
#endif

// The skinny linear (attnkit_linear, linear.h) against float64: y = x W^T + b over sizes
// that leave inputs past the last whole vector, outputs past the last group of rows of W
// and of a task, and more rows of x than one pass takes; rows of x, W and y strided; with
// and without a bias. flash-attn's rule against plain float32 sums; 1 and 3 threads give
// the same bits.
bool skinny_linear(std::mt19937 &rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t sizes[][3] = {{1, 7, 5},     {8, 768, 96},  {3, 50, 37},
                              {13, 129, 200}, {8, 3072, 17}, {5, 16, 1}};
  bool ok = true;
  double worst = 0.0, worst_plain = 0.0;
  for (const auto &sz : sizes)
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      const int64_t M = sz[0], K = sz[1], N = sz[2];
      const int64_t ldx = K + 3, ldw = K + 5, ldy = N + 2;
      std::vector<float> x(M * ldx), w(N * ldw), bias(N), y(M * ldy), y1(M * ldy);
      for (auto &v : x) v = u(rng);
      for (auto &v : w) v = u(rng);
      for (auto &v : bias) v = u(rng);
      const float *b = with_bias ? bias.data() : nullptr;
      ok &= attnkit_linear(x.data(), ldx, w.data(), ldw, b, y.data(), ldy, M, N, K, 3) == OK;
      ok &= attnkit_linear(x.data(), ldx, w.data(), ldw, b, y1.data(), ldy, M, N, K, 1) == OK;
      double err = 0.0, plain_err = 0.0;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double want = b ? b[n] : 0.0;
          float plain = 0.0f;
          for (int64_t k = 0; k < K; ++k) {
            want += double(x[m * ldx + k]) * double(w[n * ldw + k]);
            plain += x[m * ldx + k] * w[n * ldw + k];
          }
          plain += b ? b[n] : 0.0f;
          err = std::max(err, std::fabs(y[m * ldy + n] - want));
          plain_err = std::max(plain_err, std::fabs(plain - want));
          ok &= std::memcmp(&y[m * ldy + n], &y1[m * ldy + n], sizeof(float)) == 0;
        }
      ok &= err <= 2 * plain_err + 1e-6;
      worst = std::max(worst, err);
      worst_plain = std::max(worst_plain, plain_err);
    }
  // sizes it cannot take: a code, not a read past the rows
  float one = 1.0f;
  ok &= attnkit_linear(&one, 0, &one, 1, nullptr, &one, 1, 1, 1, 1, 1) == BAD_SHAPE;
  ok &= attnkit_linear(&one, 1, &one, 1, nullptr, &one, 1, 0, 1, 1, 1) == BAD_SHAPE;
  std::printf("  %-22s error %.3g (plain float32 %.3g), threads agree: %s\n", "skinny linear",
              worst, worst_plain, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

int main(int argc, char **argv) {
  std::printf("attnkit native self-test, %s build (%d floats a vector)\n", attnkit_isa(),
              simd::W);
  const Case cases[] = {
      // name                  B  H HKV   T    S   D  DV   lo     hi    mask
      {"dense", 1, 2, 2, 70, 70, 32, 32, -NONE, NONE, false},
      {"causal, GQA", 2, 4, 2, 200, 200, 16, 32, -NONE, 0, false},
      {"window 40", 1, 2, 1, 150, 150, 32, 16, -39, 0, false},
      {"bottom-right, T<S", 1, 2, 2, 65, 190, 48, 48, -NONE, 125, false},
      {"bool mask + causal", 1, 2, 2, 131, 131, 16, 16, -NONE, 0, true},
      {"dead rows", 1, 1, 1, 90, 90, 16, 16, 5, 7, false},  // rows past 82: no key
      // decode steps (keys and values read in place, split-KV), head sizes unrolled or not
      {"decode, GQA, split", 1, 8, 2, 1, 2500, 64, 64, -NONE, NONE, false},
      // GQA groups as rows of one block: causal (folded), a window cuts (not folded)
      {"decode, GQA rows, causal", 2, 6, 2, 1, 900, 64, 64, -NONE, 899, false},
      {"decode, GQA, window 300", 2, 6, 2, 1, 900, 64, 64, 600, 899, false},
      {"decode, 2 rows, D=48", 2, 2, 1, 2, 300, 48, 32, -NONE, 298, false},
      {"decode, D=128, mask", 1, 2, 2, 1, 700, 128, 128, -NONE, NONE, true},
      // a mask keeping keys 0-249 for every row: its first chunks run unmasked
      {"mask kept whole to 250", 1, 2, 2, 140, 300, 32, 32, -NONE, NONE, true, 250},
      {"... and causal, GQA", 1, 4, 2, 300, 300, 32, 32, -NONE, 0, true, 250},
      // the mask tensor over keys 100.. alone (a draft tree after its cache): mask_c0
      {"suffix mask from 100, GQA", 1, 4, 2, 70, 145, 32, 32, -NONE, NONE, true, 100, true},
      // a kv head's 16-32 rows packing their own keys: plain chunks scored transposed
      // (keys as rows), past 16 chunks, the last short one and the masked ones the rows' way
      {"16 rows, keys as rows", 1, 2, 2, 16, 1100, 32, 32, -NONE, NONE, false},
      {"32 rows, mask kept to 128", 1, 2, 2, 32, 300, 64, 64, -NONE, NONE, true, 128},
      // few rows over many keys: split-KV ranges of several rows each, merged by lse
      {"40 rows, split, causal", 1, 4, 2, 40, 2100, 32, 32, -NONE, 2060, false},
  };
  // Arguments, if any, pick the checks whose names contain one of them (the slow
  // emulated runs take a few); the random inputs of each check are the same either way.
  auto wanted = [&](const char *name) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; ++i)
      if (std::strstr(name, argv[i])) return true;
    return false;
  };
  std::mt19937 rng(1234);
  int passed = 0, failed = 0;
  auto check = [&](const char *name, auto &&fn) {  // fn(name, rng) -> passed
    std::mt19937 own(rng());  // (drawn whether the check runs or not)
    if (wanted(name)) (fn(name, own) ? passed : failed) += 1;
  };
  using Rng = std::mt19937;
  for (const Case &c : cases) check(c.name, [&](const char *, Rng &r) { return run(c, r); });
  // shared-prefix cascades: decode steps (GQA rows folded), and suffix prefill
  check("cascade, decode", [](const char *n, Rng &r) { return cascade(n, 3, 8, 2, 1, 200, 70, 64, r); });
  check("cascade, prefill", [](const char *n, Rng &r) { return cascade(n, 2, 4, 1, 9, 130, 40, 32, r); });
  // paged decode steps: heads walked together (12 of them), GQA folded, odd page sizes
  check("paged, 12 heads", [](const char *n, Rng &r) { return paged(n, 2, 12, 12, 700, 16, 64, r); });
  check("paged, GQA, pages of 5", [](const char *n, Rng &r) { return paged(n, 3, 8, 2, 1300, 5, 32, r); });
  // packed varlen: no queries, fewer keys than queries, chunk and block edges crossed
  check("varlen, GQA", [](const char *n, Rng &r) {
    return varlen(n, {70, 0, 9, 130, 1}, {70, 40, 4, 200, 33}, 4, 2, 32, r);
  });
  check("own bf16 output", [](const char *, Rng &) { return own_out_ties(); });
  check("exp2", [](const char *, Rng &) { return exp2_accuracy(); });
  check("skinny linear", [](const char *, Rng &r) { return skinny_linear(r); });
#if defined(ATTNKIT_BF16)
  check("bf16 products", [](const char *, Rng &r) { return bf16_products(r); });
#endif
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
