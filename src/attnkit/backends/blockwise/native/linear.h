// attnkit's skinny linear layer: y = x W^T + b for the few rows of x a decode step has
// (one token per running sequence), reading the weight W (out, in) once, as it is stored.
//
// At so few rows a linear layer is a pass over its weight: GPT-2 small's weights are
// 500 MB, read once per decode step, and the step's time is that read. One row at a time
// (torch's gemv) streamed them at 26 GB/s on the 2-core Xeon of session 27, but 8 rows
// through oneDNN (prepacked) at 17 GB/s and through MKL's GEMM at 10: the whole model's
// linears took 18-19.5 ms a step for one row and 29-30 ms for 8. Here each group of NR
// rows of W is read once, in place, and dotted with all the rows of x (held in L1):
// MR x NR running sums of W floats, summed across their lanes at the end. Every output
// is one dot product, the same sum whatever the split of the work or the thread count.
//
//   target          sums (MR rows of x x NR rows of W)   registers
//   AVX-512, NEON   8 x 3                                24 sums + 3 + 1 of 32
//   AVX2             4 x 2                                8 sums + 2 + 1 of 16
//
// (With more rows of x than MR, the NR rows of W just read are dotted with the next MR
// rows while they are still in L1.) Each step also prefetches the same inputs of the
// next NR rows of W: a step does MR x NR multiply-adds per vector of each row, too long
// for the out-of-order window to keep enough of the stream in flight on its own. The
// 12 layers' linears of GPT-2 small at 8 rows, on 1 thread: 40.1 ms without, 31.0 ms
// with (oneDNN prepacked: 37.6). Since session 36 it asks once per cache line (AVX2 read
// two vectors a line and asked twice), x's vectors are loaded once a step (in_register),
// and a second pass over rows of W already in L1 (more rows of x than MR: AVX2's 8)
// asks for the rows after the next ones: GPT-2 small's linears at 8 rows, 2 threads of
// the Xeon of sessions 26-36, alternating builds: AVX2 27.1-27.2 -> 26.3-26.8 ms a
// step, AVX-512 21.8-22.3 -> 21.3-21.6 (one row: 17-19 ms, the weights' read).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace linear {

using simd::vf;
constexpr int W = simd::W;
#if ATTNKIT_W == 8
constexpr int MR = 4, NR = 2;
#else
constexpr int MR = 8, NR = 3;
#endif

// Vectors of W floats a 64-byte cache line holds (AVX2 2, AVX-512 1, NEON 4).
constexpr int PER_LINE = 64 / int(sizeof(float)) / W > 0 ? 64 / int(sizeof(float)) / W : 1;

// xm held in a register: its load is not folded into each multiply-add that reads it
// (GCC folded AVX2's x loads into the FMAs, loading each vector of x NR times: 12 loads
// and prefetches for 8 FMAs, more than the load ports take).
inline void in_register(vf &x) {
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#elif defined(__AVX2__)
  asm("" : "+x"(x));
#elif defined(__aarch64__)
  asm("" : "+w"(x));
#endif
}

// y[m * ldy + r] = x[m] . w[r] (+ bias[r]) for m < M_, r < R_, over K inputs. AHEAD: also
// ask for the next R_ rows of W, a line at a time (the first pass over these rows of W;
// a later one, for more rows of x, finds them in L1).
template <int M_, int R_, int AHEAD = 1>
inline void dots(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t K,
                 const float *bias, float *y, int64_t ldy) {
  vf acc[M_][R_];
  for (int m = 0; m < M_; ++m)
    for (int r = 0; r < R_; ++r) acc[m][r] = simd::splat(0.0f);
  auto step = [&](int64_t k) {
    vf wr[R_];
    for (int r = 0; r < R_; ++r) wr[r] = simd::load(w + r * ldw + k);
    for (int m = 0; m < M_; ++m) {
      vf xm = simd::load(x + m * ldx + k);
      in_register(xm);
      for (int r = 0; r < R_; ++r) acc[m][r] += xm * wr[r];
    }
  };
  int64_t k = 0;
  for (; k + PER_LINE * W <= K; k += PER_LINE * W) {  // a cache line of each row at a time
    for (int r = 0; r < R_; ++r) __builtin_prefetch(w + (AHEAD * R_ + r) * ldw + k);
#pragma GCC unroll 4
    for (int u = 0; u < PER_LINE; ++u) step(k + u * W);
  }
  for (; k + W <= K; k += W) step(k);
  for (int m = 0; m < M_; ++m)
    for (int r = 0; r < R_; ++r) {
      float s = simd::hsum(acc[m][r]);
      for (int64_t j = k; j < K; ++j) s += x[m * ldx + j] * w[r * ldw + j];  // K % W inputs
      y[m * ldy + r] = bias ? s + bias[r] : s;
    }
}

// f(std::integral_constant<int, n>{}) for 1 <= n <= MAX.
template <int MAX, class F>
inline void sized(int n, F f) {
  if constexpr (MAX > 1) {
    if (n < MAX) return sized<MAX - 1>(n, f);
  }
  f(std::integral_constant<int, MAX>{});
}

// Outputs [n0, n1) of every row of y (M rows).
inline void columns(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias,
                    float *y, int64_t ldy, int64_t M, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += NR) {
    const int nr = int(std::min<int64_t>(NR, n1 - n));
    for (int64_t m = 0; m < M; m += MR) {
      const int mr = int(std::min<int64_t>(MR, M - m));
      sized<NR>(nr, [&](auto R) {
        sized<MR>(mr, [&](auto Mr) {
          constexpr int M_ = decltype(Mr)::value, R_ = decltype(R)::value;
          auto run = m == 0 ? dots<M_, R_, 1> : dots<M_, R_, 2>;
          run(x + m * ldx, ldx, w + n * ldw, ldw, K, bias ? bias + n : nullptr,
              y + m * ldy + n, ldy);
        });
      });
    }
  }
}

}  // namespace linear
