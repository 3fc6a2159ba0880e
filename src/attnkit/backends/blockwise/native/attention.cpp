// attnkit's native CPU attention: FlashAttention tiles, skipping and masks in one kernel,
// forward and backward, for every instruction set simd.h targets (AVX-512, AVX2+FMA,
// aarch64 NEON) from this one source.
//
// Built on first use by native/build.py (one compiler call, no torch headers) and called
// through ctypes; see native/__init__.py for when it runs and what it returns. float32.
//
// Forward. The keys are first transposed, chunk by chunk, into one packed copy (read by
// every query block; where one work item alone reads a chunk, it transposes the chunk
// itself just before its product, feature "pack in item"). For a block of query rows
// [i0, i1) of one (batch, head), the kernel walks the chunks of KC keys the block may
// see (the rows of a chunk that the band leaves nothing in are not computed): scores
// S = Q K^T, scale, relative bias, masks (a diagonal band keep iff lo <= j - i <= hi, a
// block mask's stored bool tile, a bool or float mask tensor), online softmax, then
// O += P V. Every row keeps its running max m and sum l; at the end out = O / l,
// lse = m + log(l), and a row that kept no key gets out = 0, lse = -inf (a NaN in the
// inputs stays NaN). Sums over keys are blocked (each chunk's sum is formed on its own,
// and chunk sums are gathered SUPER chunks at a time before they join the row's total),
// so rounding grows with log-like depth, not with the row length.
//
// Backward (FlashAttention-2's, in one pass): P = exp(x - lse), dP = dO V^T,
// dS = scale P (dP - delta) with delta = rowsum(dO O) - dlse; a task owns a (batch, kv
// head, key group) and, for each of its key chunks in order, sums dV += P^T dO and
// dK += dS^T Q over the query heads of its kv head and their blocks, and adds dS K to its
// group's own dQ partial (group 0's is dQ itself); the partials are then summed in group
// order. Groups depend only on the shapes, so every bit of the result is the same for any
// number of threads.
//
// A shared-prefix cascade (attnkit_cascade) is two forward calls, n requests' stacked rows
// against their shared keys and each request against its own, merged row by row. A paged
// decode step walks several heads of a row in one work item, page by page ("page walk").
//
// Every product is simd::gemm, one register-tiled micro-kernel (gemm_bf16 for bf16
// inputs on builds with bf16 products: simd::gemm_bf16's vdpbf16ps on avx512-bf16, AMX
// tiles on avx512-amx, amx.h; operands packed in pairs, P and dS rounded to bf16,
// float32 softmax and sums; other builds convert a bf16 forward to float32 once, its keys
// as they are packed, feature "bf16 read", or a chunk at a time by the one block that
// reads it, "bf16 in item"). Threads come from one persistent pool
// (rebuilt in a forked child), a call's large buffers from a per-thread cache (feature
// "reuse"). A caller that wants its output in bf16, or no log-sum-exps, has the kernel
// write into buffers of its own and round the output itself (feature "own out"). Errors
// inside (out of memory, no thread) become return codes, never an abort.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <pthread.h>
#include <sys/mman.h>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include "amx.h"  // (includes simd.h)
#include "linear.h"

namespace {

using simd::vf;
using simd::vi;
using simd::W;

constexpr int KC = 64;        // keys per chunk
constexpr int NV = KC / W;    // vectors per chunk row
constexpr int SUPER = 16;     // chunks whose sums are gathered before joining a row's total
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int8_t EMPTY = 0, PARTIAL = 1, FULL = 2;  // attnkit.block_mask's kinds

#if defined(ATTNKIT_BF16)
// Every bf16 product (simd::gemm_bf16's arguments): on AMX tiles on the avx512-amx build
// (amx.h), else with vdpbf16ps.
template <bool ACC>
inline bool gemm_bf16(float *c, int64_t ldc, int64_t rows, int64_t cols, const uint16_t *a,
                      int64_t ars, const uint16_t *b, int64_t ldb, int64_t kp,
                      const float *alpha, float *row_max = nullptr) {
#if defined(ATTNKIT_AMX)
  return amx::gemm_bf16<ACC>(c, ldc, rows, cols, a, ars, b, ldb, kp, alpha, row_max);
#else
  return simd::gemm_bf16<ACC>(c, ldc, rows, cols, a, ars, b, ldb, kp, alpha, row_max);
#endif
}
#endif

// Ends this thread's use of the AMX tiles (amx::Scope) where the build has them.
#if defined(ATTNKIT_AMX)
using TileScope = amx::Scope;
#else
struct TileScope {};
#endif

// Bumped whenever Args, Grads or the exported functions change; native/__init__.py checks
// it and the sizes at load.
constexpr int64_t ABI_VERSION = 15;

enum Code : int {
  OK = 0,
  BAD_SHAPE = 1,        // head sizes, block rows or heads the kernel cannot take
  BAD_BLOCK_ROWS = 2,   // a block mask's rows differ from the block's
  BAD_HEAD_DIM = 3,     // backward: query heads not a multiple of 16 wide
  NO_MEMORY = 4,
  NO_THREAD = 5,
  INTERNAL = 6,
  BAD_DTYPE = 7,        // bf16 inputs to a build without bf16 products
  PAGED_BACKWARD = 8,   // paged keys/values: the kernel runs their forward only
  BAD_PAGE = 9,         // a page id a row reads outside [0, num_pages)
};

constexpr int64_t DT_F32 = 0, DT_BF16 = 1;  // Args.dtype: what q, k, v point to

// The call, as native/__init__.py fills it (a ctypes.Structure of 8-byte fields).
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
  int64_t mask_c0;           // the key the mask's column 0 is: keys before it are all kept
  int64_t threads;
  int64_t dtype;             // DT_F32, or DT_BF16 (q, k, v and Grads.dout are then bf16)
  // -- compiled score_mods (native/codegen.py) --------------------------------------------
  // A score_mod traced into attnkit.mod_graph is generated as row functions of a small
  // library of its own; the kernel calls them once per chunk row of KC scores (null: none).
  // mod_forward(ctx, b, h, i, c0, x, y): y[0..KC) = the modded scores of x[0..KC), the
  // row's scaled scores of keys c0.. . mod_backward(ctx, b, h, i, c0, x, g, dgrad): x the scaled
  // scores again, g = d(modded) in, d(scaled) out, and d(captured tensors) added into
  // dgrad (mod_ngrad doubles): each backward task (batch, kv head, key group) has its own
  // partial, summed in task order into mod_dgrad, so every bit is the same for any number
  // of threads.
  void (*mod_forward)(const void *, int64_t, int64_t, int64_t, int64_t, const float *, float *);
  void (*mod_backward)(const void *, int64_t, int64_t, int64_t, int64_t, const float *,
                       float *, double *);
  const void *mod_ctx;
  int64_t mod_ngrad;
  double *mod_dgrad;
  // -- packed variable-length batches and split-KV decoding (feature "varlen") --
  // nseq > 0: q, k, v, out hold nseq sequences packed along t (B = 1): sequence n has the
  // queries cu_q[n] .. cu_q[n + 1] and the keys cu_k[n] .. cu_k[n + 1], attends only to its
  // own keys, and sees the band shifted by len_k - len_q when varlen_align is 1 (causal
  // aligned bottom-right per sequence). lse, Grads.dout, delta and dq are laid out
  // sequence by sequence, each (H, len_q[, D]) block at H * cu_q[n] rows; dk, dv likewise
  // (HKV, len_k, D) at HKV * cu_k[n]. Work items are (sequence, head, query block).
  const int64_t *cu_q, *cu_k;
  int64_t nseq, varlen_align;
  // Split-KV (flash-decoding): the forward's keys cut into kv_splits ranges computed as
  // separate work items and merged by their log-sum-exps in a fixed order (0: chosen from
  // the shapes alone, so every thread count gives the same bits; 1: no split).
  int64_t kv_splits;
  // Paged keys and values (attnkit.PagedKVCache): with `pages` set, key j of batch row b
  // is row j % page_size of page pages[b * pages_sb + j / page_size], i.e. at
  // k + page * sk_page + h * sk_h + (j % page_size) * sk_t (values: sv_page, sv_h, sv_t);
  // sk_b, sv_b are unused. Read where keys are packed and where P V reads the values.
  // Every id a row reads (its first ceil(keys / page_size)) is checked against the pool's
  // num_pages before anything is read (check()).
  const int64_t *pages;
  int64_t pages_sb, page_size, sk_page, sv_page, num_pages;
  // With pages, in a decode step (direct_keys): row b attends to its first key_lens[b]
  // keys (sequences of different lengths in one call); null: every row to S.
  const int64_t *key_lens;
  // -- generated mask tests (feature "compiled mask_mods", native/codegen.py) --
  // With mask_row set, a block mask's PARTIAL tiles have no stored bool tile (bm_index and
  // bm_masks unused): mask_row(mask_ctx, b, h, i, c0, keep) writes keep[0..KC) = whether
  // query i of (b, h) may attend to keys c0 .. c0 + KC (the traced mask_mod, generated).
  void (*mask_row)(const void *, int64_t, int64_t, int64_t, int64_t, uint8_t *);
  const void *mask_ctx;
  // -- the output as the caller keeps it (attnkit_forward, feature "own out") --
  // out16 set: the output is written there in bf16 (at so_b, so_h, so_t; `out` is not
  // used), rounded as torch rounds. lse null: not written.
  uint16_t *out16;
  // A float32 paged decode step's work item reads a head at a time (1) instead of walking
  // each page whole (0; feature "page walk": which is faster depends on the machine,
  // native/calibrate.py measures it).
  int64_t page_heads_apart;
};

// The gradients' tensors (contiguous: (B, H, T, DV), (B, H, T), (B, H, T, D),
// (B, HKV, S, D), (B, HKV, S, DV)).
struct Grads {
  const float *dout, *delta;
  float *dq, *dk, *dv;
};

constexpr int64_t MASK_BOOL = 1, MASK_FLOAT = 2;

// ---------------------------------------------------------------------------------------
// Threads: parallel(a, n, f) calls f(state, item) for items [0, n) on up to `threads`
// threads, the calling one included, each taking the next item as it is free (so the
// bits never depend on the threads). Two ways to have the threads:
//
// * (feature "openmp pool") torch's own OpenMP runtime, where torch runs its ops on one:
//   the loader hands it libgomp's GOMP_parallel (attnkit_use_gomp; Intel's and LLVM's
//   runtimes export it too). torch's threads spin a while after each of its ops waiting
//   for the next parallel region, and take ours at once; beside a second pool, both sets
//   of threads spin for the same cores (on a 2-core machine a causal forward+backward at
//   T=1024 took 1.6x as long, a 12-layer decode step 1.35x);
// * else one persistent pool of our own (Pool), whose workers spin briefly between calls.
//
// A forked child uses a new pool of its own: neither set of threads survives fork, and
// libgomp's are not restarted in the child.
// ---------------------------------------------------------------------------------------

class Pool {
 public:
  // Runs body() on `extra` pool threads and the caller; returns when all have returned.
  void run(int64_t extra, const std::function<void()> &body) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || extra <= 0) {  // another call holds the pool: run alone
      body();
      return;
    }
    while (int64_t(workers_.size()) < extra) workers_.emplace_back([this] { loop(); });
    body_ = &body;
    running_.store(extra, std::memory_order_relaxed);
    slots_.store(extra, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mu_);  // (a worker about to sleep sees it, or is woken)
      generation_.fetch_add(1, std::memory_order_acq_rel);
    }
    wake_.notify_all();
    body();
    // (varlen) slots no worker has taken yet are withdrawn: the work is done, so a worker
    // the OS has not scheduled (a busy machine) is not waited for
    running_.fetch_sub(slots_.exchange(0, std::memory_order_acq_rel), std::memory_order_acq_rel);
    // (decode) a worker still running is on its last item: wait for it spinning a little
    // before sleeping, so that a short call does not pay this thread's wake-up after it
    spin_until<false>(SPIN_US, [this] { return running_.load(std::memory_order_acquire) == 0; });
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return running_.load(std::memory_order_acquire) == 0; });
    body_ = nullptr;
  }

 private:
  void loop() {
    int64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      // (feature "warm pool") a worker that has just finished spins a while for the next
      // call before it sleeps, yielding its core to any other thread that wants it: calls
      // a few tens of microseconds apart (a decode step's layers, a cascade's two passes)
      // then skip waking a sleeping thread, which on a virtual machine cost about 30 us.
      auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until<true>(WORKER_SPIN_US, fresh)) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, fresh);
      }
      seen = generation_.load(std::memory_order_acquire);
      int64_t free = slots_.load(std::memory_order_acquire);
      while (free > 0 && !slots_.compare_exchange_weak(free, free - 1, std::memory_order_acq_rel))
        ;
      if (free <= 0) continue;  // every slot taken, or withdrawn: wait for the next call
      (*body_)();
      if (running_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu_);  // (the caller may be about to wait)
        done_.notify_all();
      }
    }
  }

  // Spins until done() or `us` microseconds have passed (YIELD: letting other threads of
  // this core run between checks); returns done().
  template <bool YIELD, class F>
  static bool spin_until(int64_t us, F done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
    while (!done()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      for (int i = 0; i < 16; ++i) relax();
      if (YIELD) std::this_thread::yield();
    }
    return true;
  }

  static constexpr int64_t SPIN_US = 50;          // the longest the caller spins for a last item
  static constexpr int64_t WORKER_SPIN_US = 200;  // the longest a worker spins for a next call
  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  std::mutex run_mu_, mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void()> *body_ = nullptr;
  std::atomic<int64_t> slots_{0}, generation_{0};
  std::atomic<int64_t> running_{0};  // workers holding a slot (read by the caller's spin)
};

Pool *g_pool = nullptr;
using GompParallel = void (*)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
std::atomic<GompParallel> g_gomp{nullptr};  // the OpenMP runtime's entry, or null: Pool
std::once_flag g_atfork;

void on_fork() {
  std::call_once(g_atfork, [] {
    // The child of a fork has none of the parent's threads: it starts a pool of its own
    // (the parent's is left as it was, never destroyed).
    pthread_atfork(nullptr, nullptr, [] {
      g_pool = nullptr;
      g_gomp.store(nullptr, std::memory_order_relaxed);
    });
  });
}

Pool &pool() {
  on_fork();
  if (!g_pool) g_pool = new Pool();
  return *g_pool;
}

template <class Body>
void call_body(void *body) {
  (*static_cast<Body *>(body))();
}

// f(state, item) for items [0, n), each thread with its own State(a). The first error
// (an exception in any thread) stops the others and is returned as a Code.
template <class State, class F>
Code parallel(const Args &a, int64_t n, F f) {
  std::atomic<int64_t> next{0};
  std::atomic<int> error{OK};
  auto body = [&]() {
    const TileScope tiles;  // (amx.h: this thread's tile state put back as it was)
    try {
      State state(a);
      for (int64_t it = next++; it < n && error.load() == OK; it = next++) f(state, it);
    } catch (const std::bad_alloc &) {
      error = NO_MEMORY;
    } catch (...) {
      error = INTERNAL;
    }
  };
  const int64_t extra = std::min(a.threads, n) - 1;
  if (GompParallel gomp = g_gomp.load(std::memory_order_acquire); gomp && extra > 0) {
    gomp(call_body<decltype(body)>, &body, unsigned(extra + 1), 0);  // (openmp pool)
    return Code(error.load());
  }
  try {
    pool().run(extra, body);
  } catch (const std::system_error &) {  // no thread could be made: what is left, alone
    body();
  }
  return Code(error.load());
}

struct NoState {
  NoState(const Args &) {}
};

// ---------------------------------------------------------------------------------------
// (feature "reuse") The buffers of one call (packed keys and values, split-KV partials,
// dQ partials) come from a small cache of the allocating thread's recent buffers instead
// of fresh memory: glibc hands large blocks out as new mappings and returns them on free,
// so every call paid a page fault per 4 KB it wrote (on the Zen 3 of session 11, a bf16
// cascade decode timed beside float32 ones spent about 340 faults a call, 43% of them
// writing packed keys). A thread keeps at most KEEP bytes in SLOTS blocks; a larger
// buffer is freed as before. Each thread touches only its own cache (a buffer released on
// another thread than the one that took it joins that thread's cache). A reused buffer
// holds an earlier call's values: every user writes each element before reading it.
// ---------------------------------------------------------------------------------------
namespace reuse {

// KEEP holds a training step's backward at T = 8192 x 4 heads (d = 64): its 7 dQ
// partials (56 MB) and packed keys and values (8 MB each), which the next step's forward
// and backward then take again. At 32 MB (and group 0's partial apart from dQ) they were
// faulted in afresh every call: causal forward+backward there took 386-408 ms a call,
// 345-374 with both changes (session 27, the Xeon, 2 threads, three interleaved runs of 5).
constexpr size_t KEEP = size_t(80) << 20;  // bytes a thread keeps between calls
constexpr int SLOTS = 4;

// A block of memory (freed with std::free).
struct Free {
  void operator()(char *p) const { std::free(p); }
};
using Mem = std::unique_ptr<char, Free>;

// From HUGE bytes on, a fresh block is aligned to 2 MB pages and the kernel asked to back
// it with them (transparent huge pages in "madvise" mode, the usual default): a block no
// thread keeps (a backward's dQ partials at T=32768 x 4 heads, 224 MB) is faulted in 2 MB
// at a time instead of 4 KB, which took the causal backward there from 572-587 ms to
// 537-562 (session 13, Zen 3, minimum of 7 runs, interleaved).
constexpr size_t PAGE = size_t(2) << 20, HUGE = 2 * PAGE;
inline Mem allocate(size_t &bytes) {
  if (bytes < HUGE) {
    char *p = static_cast<char *>(std::malloc(bytes));
    if (!p) throw std::bad_alloc();
    return Mem(p);
  }
  bytes = (bytes + PAGE - 1) / PAGE * PAGE;  // (aligned_alloc: a multiple of the alignment)
  char *p = static_cast<char *>(std::aligned_alloc(PAGE, bytes));
  if (!p) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
  madvise(p, bytes, MADV_HUGEPAGE);  // (advice only: a failure leaves 4 KB pages)
#endif
  return Mem(p);
}

struct Cache {
  Mem block[SLOTS];
  size_t size[SLOTS] = {};
  size_t held = 0;
  void drop(int s) {
    held -= size[s];
    block[s].reset();
    size[s] = 0;
  }
};

inline Cache &cache() {
  thread_local Cache c;
  return c;
}

// n elements of T (uninitialised), from this thread's cache where a block is large enough.
template <class T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t n) { reset(n); }
  Buffer(const Buffer &) = delete;
  Buffer &operator=(const Buffer &) = delete;
  Buffer(Buffer &&o) noexcept : mem_(std::move(o.mem_)), cap_(o.cap_) { o.cap_ = 0; }
  ~Buffer() { release(); }
  void reset(size_t n) {
    release();
    const size_t bytes = std::max<size_t>(1, n * sizeof(T));
    Cache &c = cache();
    int best = -1;  // the smallest cached block that fits
    for (int s = 0; s < SLOTS; ++s)
      if (c.block[s] && c.size[s] >= bytes && (best < 0 || c.size[s] < c.size[best])) best = s;
    if (best >= 0) {
      cap_ = c.size[best];
      c.held -= cap_;
      mem_ = std::move(c.block[best]);
      c.size[best] = 0;
      return;
    }
    size_t size = bytes;
    mem_ = allocate(size);  // (std::bad_alloc: guarded() makes it NO_MEMORY)
    cap_ = size;
  }
  T *get() const { return reinterpret_cast<T *>(mem_.get()); }
  T &operator[](size_t i) const { return get()[i]; }

 private:
  Mem mem_;
  size_t cap_ = 0;
  void release() {
    if (!mem_) return;
    Cache &c = cache();
    if (cap_ <= KEEP) {
      auto smallest = [&]() {
        int at = -1;
        for (int s = 0; s < SLOTS; ++s)
          if (c.block[s] && (at < 0 || c.size[s] < c.size[at])) at = s;
        return at;
      };
      while (c.held + cap_ > KEEP) c.drop(smallest());  // (held > 0 here: a block exists)
      int slot = -1;
      for (int s = 0; s < SLOTS && slot < 0; ++s)
        if (!c.block[s]) slot = s;
      if (slot < 0 && c.size[smallest()] < cap_) c.drop(slot = smallest());
      if (slot >= 0) {
        c.block[slot] = std::move(mem_);
        c.size[slot] = cap_;
        c.held += cap_;
      }
    }
    mem_.reset();
    cap_ = 0;
  }
};

}  // namespace reuse

// ---------------------------------------------------------------------------------------
// Chunks and masks
// ---------------------------------------------------------------------------------------

// Keys or values laid out chunk by chunk for the products, zero past the last key, packed
// once per call and read by every query block: float32 keys transposed, (D, KC) a chunk;
// bf16 keys in pairs of dims (D / 2, KC, 2) and values in pairs of keys (KC / 2, DV, 2),
// as simd::tile_bf16 reads them.
template <class T>
struct Packed {
  int64_t chunks = 0, depth = 0;
  reuse::Buffer<T> t;  // (B, HKV, chunks, depth * KC), every element written
  const T *chunk(const Args &a, int64_t b, int64_t hk, int64_t c) const {
    return t.get() + ((b * a.HKV + hk) * chunks + c) * depth * KC;
  }
};

// Element (key j, dim d) of a chunk goes to dst[at(j, d)].
inline int64_t transposed(int64_t j, int64_t d, int64_t) { return d * KC + j; }
inline int64_t dim_pairs(int64_t j, int64_t d, int64_t) { return (d / 2) * KC * 2 + j * 2 + d % 2; }
inline int64_t key_pairs(int64_t j, int64_t d, int64_t depth) {
  return (j / 2) * depth * 2 + d * 2 + j % 2;
}

// One chunk's KC keys (rows `row(j)`, null past the last key) into dst, the layout AT
// known at compile time so that the element loop is inlined and vectorisable.
// (feature "pack8") A whole chunk of KC keys, `words` 32-bit words each (float32 dims, or
// pairs of bf16 dims), transposed into (words, KC) by 8 x 8 register transposes: a
// decode-sized call packs every key for few products, element by element 4x slower.
// Takes full chunks (row(KC - 1) not null) of a multiple of 8 words; returns whether it did.
template <class Row>
bool pack_words8(int64_t words, Row row, float *dst) {
  if (words % 8 != 0 || !row(KC - 1)) return false;
  for (int64_t j0 = 0; j0 < KC; j0 += 8) {
    const float *rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = reinterpret_cast<const float *>(row(j0 + j));
    for (int64_t w0 = 0; w0 < words; w0 += 8) simd::transpose8(rows, w0, dst + w0 * KC + j0, KC);
  }
  return true;
}

template <class T, int64_t (*AT)(int64_t, int64_t, int64_t), class Row>
void pack_chunk(int64_t depth, Row row, T *dst) {
  if constexpr (std::is_same_v<T, float> && AT == transposed)
    if (pack_words8(depth, row, dst)) return;
  for (int64_t j = 0; j < KC; ++j) {
    const T *r = row(j);
    if (!r) {
      for (int64_t d = 0; d < depth; ++d) dst[AT(j, d, depth)] = T(0);
      continue;
    }
    for (int64_t d = 0; d < depth; ++d) dst[AT(j, d, depth)] = r[d];
  }
}

// (feature "kfwd2": cheaper bf16 packing) The bf16 layouts moved as 32-bit words, which
// the compiler vectorises: dim_pairs is a transpose of each key's pairs of dims (one word
// each), key_pairs interleaves two keys' rows (a word = key 2p's element, key 2p + 1's in
// the high half). Rows past the last key read as zeros.
template <class Row>
void pack_dim_pairs(int64_t depth, Row row, uint16_t *dst) {
  uint32_t *out = reinterpret_cast<uint32_t *>(dst);  // (depth / 2, KC) words
  if (depth % 2 == 0 && pack_words8(depth / 2, row, reinterpret_cast<float *>(out))) return;
  for (int64_t j = 0; j < KC; ++j) {
    const uint16_t *r = row(j);
    if (!r) {
      for (int64_t dp = 0; dp < depth / 2; ++dp) out[dp * KC + j] = 0;
      continue;
    }
    for (int64_t dp = 0; dp < depth / 2; ++dp) std::memcpy(out + dp * KC + j, r + 2 * dp, 4);
  }
}

template <class Row>
void pack_key_pairs(int64_t depth, Row row, uint16_t *dst) {
  static const uint16_t zeros[64] = {};
  uint32_t *out = reinterpret_cast<uint32_t *>(dst);  // (KC / 2, depth) words
  for (int64_t jp = 0; jp < KC / 2; ++jp, out += depth) {
    const uint16_t *r0 = row(2 * jp), *r1 = row(2 * jp + 1);
    for (int64_t d0 = 0; d0 < depth; d0 += 64) {  // (a row of zeros is 64 long)
      const int64_t n = std::min<int64_t>(64, depth - d0);
      const uint16_t *x0 = r0 ? r0 + d0 : zeros, *x1 = r1 ? r1 + d0 : zeros;
      for (int64_t d = 0; d < n; ++d) out[d0 + d] = uint32_t(x0[d]) | uint32_t(x1[d]) << 16;
    }
  }
}

// Chunk ci of batch row b's kv head hk of x (the keys or the values: a.k or a.v, with
// their strides) into dst, laid out by `at`: its KC keys, zeros past the last.
template <class T>
void pack_one(const Args &a, const T *x, int64_t sb, int64_t sh, int64_t st, int64_t depth,
              int64_t (*at)(int64_t, int64_t, int64_t), int64_t b, int64_t hk, int64_t ci,
              T *dst) {
  const int64_t sp = static_cast<const void *>(x) == a.v ? a.sv_page : a.sk_page;  // paged
  const T *src = x + (a.pages ? 0 : b * sb) + hk * sh;
  auto row = [&](int64_t j) -> const T * {
    const int64_t key = ci * KC + j;
    if (key >= a.S) return nullptr;
    if (!a.pages) return src + key * st;
    return src + a.pages[b * a.pages_sb + key / a.page_size] * sp +
           (key % a.page_size) * st;  // through the page table
  };
  if constexpr (std::is_same_v<T, uint16_t>) {  // (kfwd2) as words, where they fit
    if (at == dim_pairs && depth % 2 == 0) return pack_dim_pairs(depth, row, dst);
    if (at == key_pairs) return pack_key_pairs(depth, row, dst);
  }
  if (at == transposed)
    pack_chunk<T, transposed>(depth, row, dst);
  else if (at == dim_pairs)
    pack_chunk<T, dim_pairs>(depth, row, dst);
  else
    pack_chunk<T, key_pairs>(depth, row, dst);
}

// Every chunk of x (pack_one), in parallel, into pk.
template <class T>
Code pack(const Args &a, const void *x_, int64_t sb, int64_t sh, int64_t st, int64_t depth,
          int64_t (*at)(int64_t, int64_t, int64_t), Packed<T> &pk) {
  const T *x = static_cast<const T *>(x_);
  pk.chunks = (a.S + KC - 1) / KC;
  pk.depth = depth;
  pk.t.reset(size_t(a.B * a.HKV * pk.chunks * depth * KC));
  return parallel<NoState>(a, a.B * a.HKV * pk.chunks, [&](NoState &, int64_t it) {
    const int64_t ci = it % pk.chunks, bh = it / pk.chunks;
    pack_one(a, x, sb, sh, st, depth, at, bh / a.HKV, bh % a.HKV, ci,
             pk.t.get() + it * depth * KC);
  });
}

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
  bool gen = false;     // a PARTIAL tile of a generated mask: Args.mask_row gives the rows
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
  const int64_t keys = a.key_lens ? a.key_lens[b] : a.S;  // paged: this row's keys
  const int64_t hi = std::min({keys, i1 - 1 + a.band_hi + 1, (cmax + 1) * KC});
  if (lo >= hi) return;
  // keys [k0, k1), masked by `keep` (rows `width` long, key k0 at column keep_col0) or not
  auto run = [&](int64_t k0, int64_t k1, const uint8_t *keep, int64_t width, int64_t keep_col0,
                 bool gen) {
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
      c.gen = gen;
      f(c);
    }
  };
  if (!a.bm_kind) {
    run(lo, hi, nullptr, 0, 0, false);
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
      if (kind[bj] == PARTIAL && a.mask_row) {  // generated: rows made in the Masker
        run(k0, k1, nullptr, 0, 0, true);
        continue;
      }
      run(k0, k1, kind[bj] == FULL ? nullptr : tile(bj), kb, k0 - bj * kb, false);
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
      run(k0, k1, nullptr, 0, 0, false);
      continue;
    }
    uint8_t gen_row[KC];  // a generated mask's row over the chunk (made at most once a row)
    for (int64_t r = 0; r < rows; ++r) {  // the chunk's row r: key c0 + n at column n
      uint8_t *row = buf + r * KC;
      bool made = false;
      for (int64_t bj = k0 / kb; bj * kb < k1; ++bj) {
        const int64_t from = std::max(k0, bj * kb), to = std::min(k1, (bj + 1) * kb);
        if (kind[bj] == EMPTY || kind[bj] == FULL) {
          std::fill(row + (from - c0), row + (to - c0), uint8_t(kind[bj] == FULL));
        } else if (a.mask_row) {
          if (!made) a.mask_row(a.mask_ctx, b, h, i0 + r, c0, gen_row);
          made = true;
          std::copy(gen_row + (from - c0), gen_row + (to - c0), row + (from - c0));
        } else {
          const uint8_t *src = tile(bj) + r * kb - bj * kb;  // key k at src[k]
          std::copy(src + from, src + to, row + (from - c0));
        }
      }
    }
    run(k0, k1, buf, KC, k0 - c0, false);
  }
}

// Row i's scores over the chunk as the softmax sees them: scaled, biased, and -inf where
// any mask drops the key (x[0..NV)); `s` the row's raw dot products.
struct Masker {
  const Args &a;
  const Chunk &c;
  int64_t b, h;
  const float *rel;
  bool keep_direct, plain;
  bool mod_plain;  // a compiled score_mod on a chunk with nothing else to mask: its output is x
  vi lane;
  uint8_t kbuf[KC], mbuf[KC];
  float fbuf[KC];
  float mod_in[KC], mod_out[KC];  // a compiled score_mod's row: scaled scores, modded

  Masker(const Args &a_, const Chunk &c_, int64_t b_, int64_t h_) : a(a_), c(c_), b(b_), h(h_) {
    rel = a.rel ? a.rel + h * a.rel_sh : nullptr;
    keep_direct = c.keep && c.keep_col >= 0 && c.keep_col + KC <= c.keep_width;
    const bool nothing = !c.band && !c.keep && !c.gen && !rel && !a.mask && c.lo == 0 && c.hi == KC;
    plain = nothing && !a.mod_forward;
    mod_plain = nothing && a.mod_forward;
    lane = simd::lanes();
  }

  // Row i of the mask tensor over the chunk: a pointer to read W at a time (`buf` filled
  // with the columns [lo, hi) where the row is broadcast or runs past the last key).
  template <class T>
  const T *mask_row(int64_t i, T *buf) const {
    const T *row = static_cast<const T *>(a.mask) + b * a.sm_b + h * a.sm_h + i * a.sm_t;
    const int64_t m0 = c.c0 - a.mask_c0;  // the chunk's first key as a mask column
    const T kept = std::is_same_v<T, uint8_t> ? T(1) : T(0);  // a key before mask_c0
    if (a.sm_s == 1 && m0 >= 0 && c.c0 + KC <= a.S) return row + m0;
    if (a.sm_s == 1) {  // the last chunk, or one mask_c0 cuts: [lo, hi) filled, 0 past
      const int64_t from = std::clamp<int64_t>(-m0, c.lo, c.hi);  // the first masked column
      std::memset(buf, 0, sizeof(T) * KC);
      std::fill(buf + c.lo, buf + from, kept);
      if (c.hi > from) std::memcpy(buf + from, row + m0 + from, sizeof(T) * (c.hi - from));
      return buf;
    }
    for (int64_t j = 0; j < KC; ++j)
      buf[j] = (j < c.lo || j >= c.hi) ? T(0) : m0 + j < 0 ? kept : row[(m0 + j) * a.sm_s];
    return buf;
  }

  // (feature "kept chunks") Whether the mask tensor keeps every column [lo, hi) of the
  // chunk for each of its rows (bool: all nonzero; float: all exactly 0): such a chunk's
  // softmax is the unmasked one (a padding mask's kept keys, a draft tree's cache).
  bool mask_keeps_all(int64_t i0) const {
    if (!a.mask) return false;
    const int64_t lo = std::max<int64_t>(c.lo, a.mask_c0 - c.c0);  // the masked columns
    if (lo >= c.hi) return true;  // every column before mask_c0: kept, the mask not read
    if (a.sm_s != 1) return false;
    const int64_t r1 = a.sm_t == 0 ? c.r0 + 1 : c.r1;  // a broadcast row: checked once
    const int64_t base = b * a.sm_b + h * a.sm_h + c.c0 - a.mask_c0;
    for (int64_t r = c.r0; r < r1; ++r) {
      const int64_t at = base + (i0 + r) * a.sm_t;
      // (branch-free reductions the compiler vectorises: one test a row, not a column)
      if (a.mask_kind == MASK_BOOL) {  // a bool mask's bytes are 0 or 1: their AND
        const uint8_t *row = static_cast<const uint8_t *>(a.mask) + at;
        uint8_t all = 1;
        for (int64_t j = lo; j < c.hi; ++j) all &= row[j];
        if (!all) return false;
      } else {  // 0.0 and -0.0 alike: every bit but the sign clear
        const float *row = static_cast<const float *>(a.mask) + at;
        uint32_t any = 0;
        for (int64_t j = lo; j < c.hi; ++j) {
          uint32_t bits;
          std::memcpy(&bits, row + j, sizeof bits);
          any |= bits << 1;
        }
        if (any) return false;
      }
    }
    return true;
  }

  void row(int64_t r, int64_t i, const float *s, vf *x) {
    vf scale = simd::splat(float(a.scale));
    if (plain) {
#pragma GCC unroll 16
      for (int vv = 0; vv < NV; ++vv) x[vv] = simd::load(s + W * vv) * scale;
      return;
    }
    if (mod_plain) {  // the mod's row is the row (mod_in kept for backward)
      for (int vv = 0; vv < NV; ++vv) simd::store(mod_in + W * vv, simd::load(s + W * vv) * scale);
      a.mod_forward(a.mod_ctx, b, h, i, c.c0, mod_in, mod_out);
#pragma GCC unroll 16
      for (int vv = 0; vv < NV; ++vv) x[vv] = simd::load(mod_out + W * vv);
      return;
    }
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
    if (c.gen) {  // a generated mask's tile: the row made here (compiled mask_mods)
      a.mask_row(a.mask_ctx, b, h, i, c.c0, kbuf);
      keep = kbuf;
    }
    const uint8_t *mkeep = a.mask_kind == MASK_BOOL ? mask_row<uint8_t>(i, mbuf) : nullptr;
    const float *madd = a.mask_kind == MASK_FLOAT ? mask_row<float>(i, fbuf) : nullptr;
    if (a.mod_forward) {  // a compiled score_mod on the scaled row (mod_in kept for backward)
      for (int vv = 0; vv < NV; ++vv) simd::store(mod_in + W * vv, simd::load(s + W * vv) * scale);
      a.mod_forward(a.mod_ctx, b, h, i, c.c0, mod_in, mod_out);
      s = mod_out;
      scale = simd::splat(1.0f);
    }
#pragma GCC unroll 16
    for (int vv = 0; vv < NV; ++vv) {
      vf sv = simd::load(s + W * vv) * scale;
      if (rel) sv += simd::load(rel + (c.c0 + W * vv - i - a.rel_lo));  // bias of j - i
      if (madd) sv += simd::load(madd + W * vv);
      const vi col = lane + int32_t(W * vv);
      vi drop = (col < int32_t(lo)) | (col >= int32_t(hi));
      if (keep) drop |= ~simd::nonzero(keep + W * vv);
      if (mkeep) drop |= ~simd::nonzero(mkeep + W * vv);
      x[vv] = simd::select(drop, simd::splat(NEG_INF), sv);
    }
  }
};

// ---------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------

// Per thread: a block's scores, its output sums (o: gathered, o_blk: the current SUPER
// chunks'), per row the running max, its sums of weights lane by lane (l, l_blk: W floats
// a row) and O's rescale for this chunk.
struct Scratch {
  std::vector<float> s, o, o_blk, m, l, l_blk, alpha;
  std::vector<float> s2, alpha2;  // (pv2) a held chunk's weights and O's rescale
  std::vector<uint8_t> keep;  // a chunk's assembled block-mask rows
  std::vector<uint16_t> p16;  // bf16 calls: the chunk's weights rounded to bf16
  std::vector<float> mx;      // (kfwd) each row's max raw score in the chunk
  bool mx_set = false;        // (kfwd3) ... already set by the scores' product
  std::vector<float> smod;    // a compiled score_mod's rows (the softmax's input), KC a row
  std::vector<float> kt;      // (pack in item) the chunk's keys, transposed (sized on use)
  std::vector<uint16_t> kp16, vp16;  // ... bf16: its keys and values in pairs (sized on use)
  std::vector<float> kf, vf, vf2;  // (bf16 in item) its keys and values as float32 rows;
                                   // vf2: a held chunk's values (pv2)
  std::vector<float> st, qt;  // (keys as rows) a chunk's scores transposed, the block's Q^T
  std::vector<float> lt;      // ... and l_blk transposed, for its lt_rows rows (0: l_blk holds it)
  int64_t lt_rows = 0;
  Scratch(const Args &a) : Scratch(a, a.nseq > 0 ? a.bq : std::min(a.bq, a.T)) {}
  // (rows: the most a block has; a decode step's one row, not bq, is allocated and zeroed
  // per thread and call. m, alpha and mx have W more floats: softmax_plain reads and
  // writes W rows at a time)
  Scratch(const Args &a, int64_t rows)
      : s(rows * KC), o(rows * a.DV), o_blk(rows * a.DV), m(rows + W), l(rows * W),
        l_blk(rows * W), alpha(rows + W), s2(rows * KC), alpha2(rows + W), keep(rows * KC),
        p16(a.dtype == DT_BF16 ? rows * KC : 0), mx(rows + W),
        smod(a.mod_forward ? rows * KC : 0) {}
};

// (feature "bf16 read", builds without bf16 products) bf16 keys a float32 forward packs
// as they are read: read_as_float32 leaves them in place and hands their strides here.
// With `values`, the values stay in place too (Args.v, bf16): where one block alone reads
// a kv head's keys and values (one query block a head, no GQA), which converts each
// chunk's keys and values itself (pack_forward's "bf16 in item"). Any other call converts
// its values once: widening them as P V loads them, in every register tile of rows of
// every block that reads them, took a GQA prefill (4 heads a kv head, 128 x 2048) 17%
// more than float32 on AVX2, 3% when converted once (session 36).
struct Bf16InPlace {
  const uint16_t *k;
  int64_t sb, sh, st;
  bool values;
};

// What the forward's two products read: keys transposed (float32), or keys and values
// packed in bf16 pairs.
struct Operands {
  Packed<float> kt;
  bool direct = false;  // a decode step: keys read in place (direct_scores)
  bool in_item = false;  // (pack in item) keys (bf16: and values) packed by their one reader
  const Bf16InPlace *k16 = nullptr;  // (bf16 in item) ... from bf16, values converted too
#if defined(ATTNKIT_BF16)
  Packed<uint16_t> kp, vp;
#endif
  int64_t chunks() const {
#if defined(ATTNKIT_BF16)
    if (kp.chunks) return kp.chunks;
#endif
    return kt.chunks;
  }
};

// -- base-2 softmax (feature "kfwd": the forward at peak) --------------------------------
// The forward's softmax runs in base 2: scores are multiplied by scale * log2(e) once (a
// plain chunk row: in the same multiply as the scale; masked rows: after the masker), the
// running max m is kept in those units, weights are 2^(x - m) (simd::exp2, no range
// reduction multiply) and O's rescale 2^(m_old - m_new); lse = m ln 2 + log l at the end.
// (kfwd4) m is any bound >= the row's scores so far, not their max: their max rounded up
// to a multiple of M_STEP. A chunk whose scores stay under it then leaves the row's state
// alone (no rescale of O, and the branch that decides it goes the usual way), where one
// a little above the last max rescaled it; a rescale is by an exact power of 2; and the
// largest weight is in (2^-M_STEP, 1]. The forward with it took 0.988-0.994x the time on
// AVX-512; on AVX2, with its exp2 (kfwd4), 0.978-0.986x (native_ab, causal, T=4096 on 1
// thread and 8192 on 2; session 25). Steps of 1 and 2 gained less; 8 gained 0.5% more on
// AVX2 but took the self-test's worst error to 2.9x plain float32's (the near-max
// weights' x = s - m is rounded at |x| up to 8, not near 0), where 4 leaves it under 2x
// (1.9x; 2.2x before, in another case).
// Float32 weights only: a bf16 call's P V reads its weights rounded to bf16 while l sums
// them unrounded, so the largest weight must stay exactly 1 (a row with one key then
// gives that key's value exactly; with the step it came out up to 2^-9 off, and its dq
// 0.02 where float64's is 0). The step would have saved 1.2-1.8% of a bf16 forward.
constexpr double LOG2E = 1.4426950408889634, LN2 = 0.6931471805599453;
constexpr float M_STEP = 4.0f;

// The weights of row r (W at a time): into w.p16 rounded to bf16 on bf16 calls (BF16),
// else in place of the scores.
template <bool BF16>
struct Weights {
  float *s;
  uint16_t *p16 = nullptr;
  Weights(Scratch &w, int64_t r) : s(w.s.data() + r * KC) {
    if constexpr (BF16) p16 = w.p16.data() + r * KC;
  }
  void put(int vv, vf p) const {
#if defined(ATTNKIT_BF16)
    if constexpr (BF16) return simd::store_bf16(p16 + W * vv, p);
#endif
    simd::store(s + W * vv, p);
  }
};

// The softmax of a chunk that no mask touches (BAND: where the band or the keys' range
// drops some columns), with one branch a row (whether its max moved) instead of three:
// every row's max score, then W rows at a time their new max and O's rescale
// (simd::exp2; 1 where the max stayed), then the weights and sums. The scores are the
// rows of `x_rows` (KC a row: the raw dot products, or a compiled score_mod's output)
// times `sc` > 0 (scale log2 e, or log2 e). False, with nothing of the state changed,
// where a row's max is -inf or NaN (now or before): softmax() then takes the chunk row by
// row.
// (kfwd2) BF16: a bf16 call's weights, rounded to bf16 as they are stored, come from
// simd::exp2_bf16 (its error 1/40 of that rounding's; O's rescale stays simd::exp2).
// (kfwd3) max_set: w.mx already holds each row's max raw score (a whole chunk of scores,
// folded from the registers of the product's tiles: simd::gemm's or gemm_bf16's row_max;
// one tile wide on AVX-512, two on AVX2, four on NEON), so !BAND skips the pass that
// reads the scores back for it (the forward 0.974-0.987x in float32 on AVX-512,
// 0.974-0.976x in bf16, 0.98-1.00x on AVX2; session 23).
template <bool BAND, bool BF16 = false>
bool softmax_plain(const Args &a, const Chunk &c, int64_t i0, Scratch &w, const float *x_rows,
                   double sc, bool max_set = false) {
  float *mx = w.mx.data(), *m = w.m.data(), *alpha = w.alpha.data();
  const vf scale2 = simd::splat(float(sc)), ninf = simd::splat(NEG_INF);
  const vi lane = simd::lanes();
  auto kept = [&](int64_t r, int64_t &lo, int64_t &hi) {  // the row's columns [lo, hi)
    lo = c.lo, hi = c.hi;
    if (!c.band) return;
    const int64_t i = i0 + r;
    lo = std::min<int64_t>(KC, std::max<int64_t>(lo, i + a.band_lo - c.c0));
    hi = std::max<int64_t>(0, std::min<int64_t>(hi, i + a.band_hi - c.c0 + 1));
  };
  for (int64_t r = c.r0; r < c.r1 && (BAND || !max_set); ++r) {
    const float *s = x_rows + r * KC;
    int64_t lo = 0, hi = KC;
    if (BAND) kept(r, lo, hi);
    vf x = ninf;
#pragma GCC unroll 16
    for (int vv = 0; vv < NV; ++vv) {
      vf sv = simd::load(s + W * vv);
      if (BAND) {
        const vi col = lane + int32_t(W * vv);
        sv = simd::select((col < int32_t(lo)) | (col >= int32_t(hi)), ninf, sv);
      }
      x = simd::vmax(x, sv);
    }
    mx[r] = simd::hmax(x);
  }
  for (int64_t r = c.r0; r < c.r1; r += W) {  // check first: then change the state
    const vf m_old = simd::load(m + r), m_new = simd::vmax(m_old, simd::load(mx + r) * scale2);
    const vi odd = ~(m_new > ninf) | (m_old != m_old);  // -inf or NaN
    const vi active = (lane + int32_t(r)) < int32_t(c.r1);
    if (simd::any(odd & active)) return false;
  }
  for (int64_t r = c.r0; r < c.r1; r += W) {
    const vf m_old = simd::load(m + r);
    vf m_new = simd::vmax(m_old, simd::load(mx + r) * scale2);
    if constexpr (!BF16) m_new = simd::round_up(m_new, M_STEP);
    const vi active = (lane + int32_t(r)) < int32_t(c.r1);
    simd::store(m + r, simd::select(active, m_new, m_old));
    simd::store(alpha + r, simd::exp2(m_old - m_new));  // 2^0 = 1 exactly; 2^-inf = 0
  }
  for (int64_t r = c.r0; r < c.r1; ++r) {
    const Weights<BF16> out(w, r);
    int64_t lo = 0, hi = KC;
    if (BAND) kept(r, lo, hi);
    const vf mr = simd::splat(m[r]);
    vf sum = simd::splat(0.0f);
#pragma GCC unroll 16
    for (int vv = 0; vv < NV; ++vv) {
      vf x = simd::load(x_rows + r * KC + W * vv) * scale2 - mr;  // (one FMA)
      if (BAND) {
        const vi col = lane + int32_t(W * vv);
        x = simd::select((col < int32_t(lo)) | (col >= int32_t(hi)), ninf, x);
      }
      const vf p = BF16 ? simd::exp2_bf16(x) : simd::exp2(x);  // (0 where dropped)
      out.put(vv, p);
      sum += p;
    }
    float *l_blk = w.l_blk.data() + r * W;
    if (alpha[r] == 1.0f) {
      simd::store(l_blk, simd::load(l_blk) + sum);
      continue;
    }
    const vf al = simd::splat(alpha[r]);  // the max moved: rescale what was gathered
    float *o = w.o.data() + r * a.DV, *l = w.l.data() + r * W;
    for (int64_t d = 0; d < a.DV; d += W) simd::store(o + d, simd::load(o + d) * al);
    simd::store(l, simd::load(l) * al);
    simd::store(l_blk, simd::load(l_blk) * al + sum);
  }
  return true;
}

// Scores -> weights in place (bf16 calls: into w.p16, rounded to bf16), the online softmax
// state updated (alpha: O's rescale; m in base-2 units, see above).
void softmax(const Args &a, int64_t b, int64_t h, int64_t i0, const Chunk &c, Scratch &w) {
  const bool max_set = w.mx_set;  // (the raw scores' row max, by their product)
  w.mx_set = false;
  Masker masker(a, c, b, h);
  // only the band and the keys' range cut the chunk (no mask of any kind, no bias; a
  // mask tensor that keeps every column here counts as none)
  const bool band_only =
      !c.keep && !c.gen && !masker.rel && (!a.mask || masker.mask_keeps_all(i0));
  const bool cut = c.band || c.lo != 0 || c.hi != KC;
  auto plain = [&](const float *x, double sc) {
    const bool set = max_set && x == w.s.data();  // (w.mx is the raw scores' max)
#if defined(ATTNKIT_BF16)
    if (a.dtype == DT_BF16)
      return cut ? softmax_plain<true, true>(a, c, i0, w, x, sc)
                 : softmax_plain<false, true>(a, c, i0, w, x, sc, set);
#endif
    return cut ? softmax_plain<true>(a, c, i0, w, x, sc)
               : softmax_plain<false>(a, c, i0, w, x, sc, set);
  };
  if (band_only && a.mod_forward) {  // a compiled score_mod: its rows first (w.s kept)
    float *in = masker.mod_in;
    const vf scale = simd::splat(float(a.scale));
    for (int64_t r = c.r0; r < c.r1; ++r) {
      const float *s = w.s.data() + r * KC;
      for (int vv = 0; vv < NV; ++vv) simd::store(in + W * vv, simd::load(s + W * vv) * scale);
      a.mod_forward(a.mod_ctx, b, h, i0 + r, c.c0, in, w.smod.data() + r * KC);
    }
    if (plain(w.smod.data(), LOG2E)) return;
  } else if (band_only && a.scale > 0 && plain(w.s.data(), a.scale * LOG2E)) {
    return;
  }
  const vf to_base2 = simd::splat(float(LOG2E));
  const vf scale2 = simd::splat(float(a.scale * LOG2E));
  for (int64_t r = c.r0; r < c.r1; ++r) {
    float *s = w.s.data() + r * KC;
#if defined(ATTNKIT_BF16)
    uint16_t *p16 = a.dtype == DT_BF16 ? w.p16.data() + r * KC : nullptr;  // bf16 weights
    auto put = [&](int vv, vf p) {
      if (p16)
        simd::store_bf16(p16 + W * vv, p);
      else
        simd::store(s + W * vv, p);
    };
#else
    constexpr uint16_t *p16 = nullptr;
    auto put = [&](int vv, vf p) { simd::store(s + W * vv, p); };
#endif
    vf x[NV];
    if (masker.plain) {
#pragma GCC unroll 16
      for (int vv = 0; vv < NV; ++vv) x[vv] = simd::load(s + W * vv) * scale2;
    } else {
      masker.row(r, i0 + r, s, x);
#pragma GCC unroll 16
      for (int vv = 0; vv < NV; ++vv) x[vv] *= to_base2;
    }
    vf mx = x[0];
#pragma GCC unroll 16
    for (int vv = 1; vv < NV; ++vv) mx = simd::vmax(mx, x[vv]);
    const float m_old = w.m[r];
    float m_new = std::max(m_old, simd::hmax(mx));
    if (m_new == NEG_INF) {
      bool nan = false;
      for (int vv = 0; vv < NV; ++vv) nan |= simd::any_nan(x[vv]);
      if (!nan) {  // nothing kept yet: weights 0, O untouched
        for (int vv = 0; vv < NV; ++vv) put(vv, simd::splat(0.0f));
        w.alpha[r] = 1.0f;
        continue;
      }
      m_new = std::numeric_limits<float>::quiet_NaN();  // a NaN score: the row is NaN
    }
    if (!p16) m_new = simd::round_up(simd::splat(m_new), M_STEP)[0];  // float32 weights
    vf sum = simd::splat(0.0f);
    const vf m = simd::splat(m_new);
#pragma GCC unroll 16
    for (int vv = 0; vv < NV; ++vv) {
      const vf p = simd::exp2(x[vv] - m);
      put(vv, p);
      sum += p;
    }
    float *l_blk = w.l_blk.data() + r * W;
    if (m_new == m_old) {  // the usual case once a row has seen a few chunks
      w.alpha[r] = 1.0f;
      simd::store(l_blk, simd::load(l_blk) + sum);
      continue;
    }
    // the max moved: rescale what was gathered
    const float alpha = (m_old == NEG_INF) ? 0.0f : std::exp2(m_old - m_new);
    const vf al = simd::splat(alpha);
    float *o = w.o.data() + r * a.DV, *l = w.l.data() + r * W;
    for (int64_t d = 0; d < a.DV; d += W) simd::store(o + d, simd::load(o + d) * al);
    simd::store(l, simd::load(l) * al);
    simd::store(l_blk, simd::load(l_blk) * al + sum);
    w.alpha[r] = alpha;
    w.m[r] = m_new;
  }
}

// ---------------------------------------------------------------------------------------
// Decode steps (feature "decode"). A call with few query rows per kv head (DIRECT_ROWS:
// one query of MHA, or a GQA group, per decode step) reads each key and value once, so
// packing them first would cost as much as the products: its scores are dot products
// with the keys where they are (direct_scores) and O += P V reads the values where they
// are (decode_pv), contiguous or through the page table alike (kv_run), float32 or bf16
// (converted as read, products and sums in float32). Split-KV decoding cuts the keys of
// such a call into ranges across the threads (forward_split).
//
// The rule for a weight of exactly 0, one for every decode step (decode_pv, contiguous or
// paged, float32 or bf16 values): it is skipped, never multiplied, so a key the mask, the
// band or a row's key length removes contributes nothing even where its value is NaN or
// inf (attnkit's "masked means removed": padding in a page full of garbage is safe), and
// a row every key of which is removed keeps O = 0. Keys no row of the block keeps by the
// band are not even read. (Longer blocks multiply their packed weights with simd::gemm;
// there attnkit.attention zeroes the keys a mask removes for every query before the call.)
//
// While a run of keys' scores are summed, the same keys' values are asked for (prefetch),
// so that P V finds them in cache, and the keys AHEAD on (no hardware prefetcher follows
// a page table, and on a busy machine not even a contiguous cache is read far enough
// ahead).
// ---------------------------------------------------------------------------------------

// Query rows per kv head up to which a call is a decode step (paged too: rows of
// different key lengths, Args.key_lens, are only taken this way).
constexpr int64_t DIRECT_ROWS = 8;

bool direct_keys(const Args &a) { return a.T * (a.H / a.HKV) <= DIRECT_ROWS; }

// n rounded up to whole vectors.
inline int64_t whole_vectors(int64_t n) { return (n + W - 1) / W * W; }

inline float as_f32(float x) { return x; }
inline float as_f32(uint16_t x) {  // bf16: the high half of a float32
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <class T>
inline vf load_f32(const T *p) {
  if constexpr (std::is_same_v<T, float>) {
    return simd::load(p);
  } else {
    return simd::load_bf16(p);
  }
}

// n rows of `depth` bf16 values, st apart at src, as float32 rows at dst (depth apart).
inline void chunk_rows_f32(const uint16_t *src, int64_t st, int64_t n, int64_t depth,
                           float *dst) {
  const int64_t whole = depth / W * W;
  for (int64_t j = 0; j < n; ++j, src += st, dst += depth) {
    int64_t d = 0;
    for (; d < whole; d += W) simd::store(dst + d, simd::load_bf16(src + d));
    for (; d < depth; ++d) dst[d] = as_f32(src[d]);
  }
}

// (bf16 in item) ... and zeros after them up to KC rows.
void chunk_as_float32(const uint16_t *src, int64_t st, int64_t n, int64_t depth, float *dst) {
  chunk_rows_f32(src, st, n, depth, dst);
  std::fill(dst + n * depth, dst + KC * depth, 0.0f);
}

// A hint that the `bytes` at p are read soon (never faults, whatever p is).
inline void prefetch(const void *p, int64_t bytes) {
  const char *x = static_cast<const char *>(p);
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(x + at);
}

enum Side { KEYS, VALUES };

// Keys (or values) j .. j + n - 1 of (b, hk) lie at x0 + x * sk_t (sv_t): returns x0 and
// sets n, the run up to `end` (paged: up to the end of key j's page).
template <class T, Side SIDE = KEYS>
const T *kv_run(const Args &a, int64_t b, int64_t hk, int64_t j, int64_t end, int64_t &n) {
  const bool keys = SIDE == KEYS;
  const T *x = static_cast<const T *>(static_cast<const void *>(keys ? a.k : a.v));
  const int64_t sh = keys ? a.sk_h : a.sv_h, st = keys ? a.sk_t : a.sv_t;
  if (!a.pages) {
    n = end - j;
    return x + b * (keys ? a.sk_b : a.sv_b) + hk * sh + j * st;
  }
  const int64_t ps = a.page_size;
  int64_t page, off;
  if ((ps & (ps - 1)) == 0) {  // a power of two (the usual page sizes): no division
    page = j >> __builtin_ctzll(uint64_t(ps)), off = j & (ps - 1);
  } else {
    page = j / ps, off = j % ps;
  }
  n = std::min(end - j, ps - off);
  return x + a.pages[b * a.pages_sb + page] * (keys ? a.sk_page : a.sv_page) + hk * sh +
         off * st;
}

// Asks for the keys of (b, hk) AHEAD keys on from those whose scores are being summed,
// key by key, through the page table where there is one (one lookup a page).
constexpr int64_t AHEAD = 32;
template <class T>
struct Ahead {
  const Args &a;
  int64_t b, hk, j, keys, row_bytes, n = 0;  // the next key asked for; n: left in its run
  const T *p = nullptr;
  Ahead(const Args &a_, int64_t b_, int64_t hk_, int64_t j_, int64_t keys_, int64_t row_bytes_)
      : a(a_), b(b_), hk(hk_), j(j_), keys(keys_), row_bytes(row_bytes_) {}
  void next(int64_t count) {
    for (; count > 0 && j < keys; --count, ++j, --n, p += a.sk_t) {
      if (n == 0) p = kv_run<T>(a, b, hk, j, keys, n);
      prefetch(p, row_bytes);
    }
  }
};

// Each row's dots with u <= U keys: s[r KC + x] = q row r (stride sq) . key x (kj[x]; the
// pointers past u repeat the last key). T, DIM: as direct_scores.
constexpr int DIRECT_U = 4;  // keys at once: independent sums keep the FMA units busy
template <class T, int DIM>
inline void direct_dots(int64_t D, const T *const *kj, int u, const T *q, int64_t sq,
                        int64_t nr, float *s) {
  constexpr int U = DIRECT_U;
  static_assert(U == 4, "the sums are reduced four at a time (simd::hsum4)");
  for (int64_t r = 0; r < nr; ++r) {
    const T *qr = q + r * sq;
    vf acc[U];
    for (int x = 0; x < U; ++x) acc[x] = simd::splat(0.0f);
    int64_t d = 0;
#if defined(ATTNKIT_BF16)
    if constexpr (std::is_same_v<T, uint16_t>)  // bf16 pairs multiplied as they are
      for (; d + 2 * W <= D; d += 2 * W)
        for (int x = 0; x < U; ++x) acc[x] = simd::dot_bf16(acc[x], qr + d, kj[x] + d);
#endif
    for (; d + W <= D; d += W) {
      const vf qv = load_f32(qr + d);
      for (int x = 0; x < U; ++x) acc[x] += qv * load_f32(kj[x] + d);
    }
    float dots[U];
    simd::hsum4(acc, dots);
    for (int x = 0; x < u; ++x) {
      for (int64_t e = d; e < D; ++e) dots[x] += as_f32(qr[e]) * as_f32(kj[x][e]);
      s[r * KC + x] = dots[x];
    }
  }
}

// (feature "bf16 rows once", builds without bf16 products) A bf16 decode step of several
// rows widened each key vector once per row, and each query vector once per group of
// keys: its rows (at most DIRECT_ROWS) are converted to float32 once per run, and each
// group of keys once for all of them; the dots then run as float32's, the same bits.
// Heads up to this size (the scratch on the stack).
constexpr int64_t DIRECT16_MAX_D = 256;

// The scores of a run of n keys (at k0, stride sk_t) for the rows q (stride sq_t): s[r KC
// + x] for key x; ask(x, u) before keys x .. x + u - 1 are read (prefetches). T, DIM: as
// direct_scores.
template <class T, int DIM, class Ask>
inline void direct_run(const Args &a, const T *k0, int64_t n, const T *q, int64_t nr,
                       float *s, Ask ask) {
  constexpr int U = DIRECT_U;
  const int64_t D = DIM ? DIM : a.D;
#if !defined(ATTNKIT_BF16)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (nr > 1 && nr <= DIRECT_ROWS && D <= DIRECT16_MAX_D) {  // (bf16 rows once)
      alignas(64) float qf[DIRECT_ROWS * DIRECT16_MAX_D], kf[U * DIRECT16_MAX_D];
      chunk_rows_f32(q, a.sq_t, nr, D, qf);
      for (int64_t x0 = 0; x0 < n; x0 += U) {
        const int u = int(std::min<int64_t>(U, n - x0));
        ask(x0, u);
        chunk_rows_f32(k0 + x0 * a.sk_t, a.sk_t, u, D, kf);
        const float *kj[U];
        for (int x = 0; x < U; ++x) kj[x] = kf + std::min(x, u - 1) * D;
        direct_dots<float, DIM>(D, kj, u, qf, D, nr, s + x0);
      }
      return;
    }
  }
#endif
  for (int64_t x0 = 0; x0 < n; x0 += U) {
    const int u = int(std::min<int64_t>(U, n - x0));
    ask(x0, u);
    const T *kj[U];
    for (int x = 0; x < U; ++x) kj[x] = k0 + (x0 + std::min(x, u - 1)) * a.sk_t;
    direct_dots<T, DIM>(D, kj, u, q, a.sq_t, nr, s + x0);
  }
}

// A decode step's scores: s (nr rows of KC) = the rows q (stride sq_t) . the chunk's keys
// [c0 + lo, c0 + hi) read where they are; the other columns 0 (the softmax drops them).
// T: float, or uint16_t for bf16; DIM: the head size when known at compile time (the
// common ones: the loops over it unrolled), or 0.
template <class T, int DIM>
void direct_scores(const Args &a, int64_t b, int64_t hk, const T *q, int64_t nr,
                   const Chunk &c, float *s) {
  const int64_t D = DIM ? DIM : a.D;
  const int64_t krow = D * int64_t(sizeof(T)), vrow = a.DV * int64_t(sizeof(T));
  const int64_t keys = a.key_lens ? a.key_lens[b] : a.S;  // (paged: what the table reaches)
  Ahead<T> ahead(a, b, hk, c.c0 + c.lo + AHEAD, keys, krow);
  std::fill(s, s + nr * KC, 0.0f);
  for (int64_t j = c.c0 + c.lo, end = c.c0 + c.hi, n = 0; j < end; j += n) {
    const T *k0 = kv_run<T>(a, b, hk, j, end, n);
    int64_t n_v = 0;
    const T *v0 = kv_run<T, VALUES>(a, b, hk, j, end, n_v);  // this run's values
    direct_run<T, DIM>(a, k0, n, q, nr, s + (j - c.c0), [&](int64_t x0, int u) {
      for (int x = 0; x < u; ++x) prefetch(v0 + (x0 + x) * a.sv_t, vrow);
      ahead.next(u);
    });
  }
}

// decode_pv's register tile: R rows x NA vectors of O (dims d0 ..), over the chunk's
// columns, values read in runs where they are.
template <class T, int R, int NA>
inline void decode_pv_tile(const Args &a, int64_t b, int64_t hk, const Chunk &c,
                           const float *p, const float *alpha, float *o, int64_t d0) {
  vf acc[R][NA];
  for (int r = 0; r < R; ++r) {
    for (int x = 0; x < NA; ++x) acc[r][x] = simd::load(o + r * a.DV + d0 + x * W);
    if (!alpha) continue;  // (a later run of the chunk: O already rescaled)
    const vf al = simd::splat(alpha[r]);
    for (int x = 0; x < NA; ++x) acc[r][x] *= al;
  }
  for (int64_t j = c.c0 + c.lo, end = c.c0 + c.hi, n = 0; j < end; j += n) {
    const T *v0 = kv_run<T, VALUES>(a, b, hk, j, end, n) + d0;
    const float *pj = p + (j - c.c0);
    for (int64_t x0 = 0; x0 < n; ++x0) {
      vf vv[NA];
      for (int x = 0; x < NA; ++x) vv[x] = load_f32(v0 + x0 * a.sv_t + x * W);
      for (int r = 0; r < R; ++r) {
        const float pw = pj[r * KC + x0];
        if (pw == 0.0f) continue;  // the rule above: a removed key's value is never used
        const vf w = simd::splat(pw);
        for (int x = 0; x < NA; ++x) acc[r][x] += w * vv[x];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NA; ++x) simd::store(o + r * a.DV + d0 + x * W, acc[r][x]);
}

// A decode step's O (nr rows x DV) = alpha (.) O + P V over the chunk's columns [lo, hi),
// p the float32 weights (rows of KC), the values read where they are (contiguous or
// paged, float32 or bf16): the one P V of every decode step (the rule above). alpha null:
// no rescale (O += P V).
template <class T>
void decode_pv(const Args &a, int64_t b, int64_t hk, const Chunk &c, int64_t nr,
               const float *p, const float *alpha, float *o) {
  constexpr int NA = 4;                   // vectors of O a tile keeps
  constexpr int RB = W == 8 ? 2 : 4;      // rows a tile keeps (AVX2: 16 registers)
  for (int64_t r0 = 0; r0 < nr; r0 += RB) {
    const int rn = int(std::min<int64_t>(RB, nr - r0));
    const float *pr = p + r0 * KC, *al = alpha ? alpha + r0 : nullptr;
    float *orow = o + r0 * a.DV;
    for (int64_t d0 = 0; d0 < a.DV; d0 += NA * W) {
      const int nv = int(std::min<int64_t>(NA, (a.DV - d0) / W));
#define ATTNKIT_PV(R, N) decode_pv_tile<T, R, N>(a, b, hk, c, pr, al, orow, d0)
#define ATTNKIT_PV_ROWS(R)          \
  switch (nv) {                     \
    case 4: ATTNKIT_PV(R, 4); break; \
    case 3: ATTNKIT_PV(R, 3); break; \
    case 2: ATTNKIT_PV(R, 2); break; \
    default: ATTNKIT_PV(R, 1);      \
  }
      switch (rn) {
        case 1: ATTNKIT_PV_ROWS(1) break;
        case 2: ATTNKIT_PV_ROWS(2) break;
        case 3: if constexpr (RB >= 3) ATTNKIT_PV_ROWS(3) break;
        default: if constexpr (RB >= 4) ATTNKIT_PV_ROWS(4)
      }
#undef ATTNKIT_PV_ROWS
#undef ATTNKIT_PV
    }
  }
}

// One chunk of a decode step (T: float, or uint16_t for bf16): scores, the softmax on
// float32 weights, P V; q the block's first row.
// (f32: `a` with dtype DT_F32, what the softmax reads.)
template <class T>
void decode_chunk(const Args &a, const Args &f32, int64_t b, int64_t h, int64_t hk, int64_t i0,
                  const Chunk &c, Scratch &w) {
  const int64_t nr = c.r1 - c.r0;
  const T *q = static_cast<const T *>(static_cast<const void *>(a.q)) + b * a.sq_b + h * a.sq_h;
  float *s = w.s.data() + c.r0 * KC;
  const T *qi = q + (i0 + c.r0) * a.sq_t;
  if (a.D == 64)
    direct_scores<T, 64>(a, b, hk, qi, nr, c, s);
  else if (a.D == 128)
    direct_scores<T, 128>(a, b, hk, qi, nr, c, s);
  else
    direct_scores<T, 0>(a, b, hk, qi, nr, c, s);
  softmax(f32, b, h, i0, c, w);  // (bf16 too: float32 weights in s)
  decode_pv<T>(a, b, hk, c, nr, s, w.alpha.data() + c.r0, w.o_blk.data() + c.r0 * a.DV);
}

// Paged values of a block of query rows that is no decode step (chunked prefill,
// float32: bf16 values are packed): O += P V per page's run of keys with simd::gemm (the
// first run applies O's rescale, the others add).
void paged_pv(const Args &a, int64_t b, int64_t hk, const Chunk &c, int64_t nr, const float *s,
              Scratch &w) {
  const float *alpha = w.alpha.data() + c.r0;
  for (int64_t j = c.c0 + c.lo, end = c.c0 + c.hi, n = 0; j < end; j += n) {
    const float *vp = kv_run<float, VALUES>(a, b, hk, j, end, n);
    simd::gemm<true>(w.o_blk.data() + c.r0 * a.DV, a.DV, nr, a.DV, s + (j - c.c0), KC, 1, vp,
                     a.sv_t, n, alpha);
    alpha = nullptr;
  }
}

// The score columns of chunk c a block computes: up to its last column in range, rounded up
// to whole vectors (the last chunk of a short call: 32 keys computed as 32, not 64). The
// columns past it hold stale values that every softmax path drops (col >= hi).
inline int64_t score_cols(const Chunk &c) { return std::min<int64_t>(KC, whole_vectors(c.hi)); }

// A block's running sums (Scratch rows [0, rows)): emptied, gathered SUPER chunks at a
// time (o += o_blk, l += l_blk), and at the end normalised into out and lse.
void block_begin(const Args &a, int64_t rows, Scratch &w) {
  std::fill(w.o.begin(), w.o.begin() + rows * a.DV, 0.0f);
  std::fill(w.o_blk.begin(), w.o_blk.begin() + rows * a.DV, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, NEG_INF);
  std::fill(w.l.begin(), w.l.begin() + rows * W, 0.0f);
  std::fill(w.l_blk.begin(), w.l_blk.begin() + rows * W, 0.0f);
}

void sums_from_lt(Scratch &w);

void block_gather(const Args &a, int64_t rows, Scratch &w) {
  sums_from_lt(w);  // (keys as rows: the sums back in l_blk's layout)
  for (int64_t n = 0; n < rows * a.DV; ++n) w.o[n] += w.o_blk[n];
  std::fill(w.o_blk.begin(), w.o_blk.begin() + rows * a.DV, 0.0f);
  for (int64_t n = 0; n < rows * W; ++n) w.l[n] += w.l_blk[n];
  std::fill(w.l_blk.begin(), w.l_blk.begin() + rows * W, 0.0f);
}

void block_end(const Args &a, int64_t b, int64_t h, int64_t i0, int64_t rows, Scratch &w) {
  block_gather(a, rows, w);
  float *out = a.out + b * a.so_b + h * a.so_h;
  float *lse = a.lse + (b * a.H + h) * a.T;
  for (int64_t r = 0; r < rows; ++r) {
    float *o = out + (i0 + r) * a.so_t;
    if (w.m[r] == NEG_INF) {
      std::fill(o, o + a.DV, 0.0f);
      lse[i0 + r] = NEG_INF;
      continue;
    }
    const float l = simd::hsum(simd::load(w.l.data() + r * W)), inv = 1.0f / l;
    for (int64_t d = 0; d < a.DV; ++d) o[d] = w.o[r * a.DV + d] * inv;
    lse[i0 + r] = float(double(w.m[r]) * LN2 + std::log(double(l)));  // (m: base 2)
  }
}

// A decode step's chunk c for the rows of (b, h) (keys and values read in place); `f32`:
// `a` as float32, what a bf16 step's softmax leaves.
void decode_step_chunk(const Args &a, const Args &f32, int64_t b, int64_t h, int64_t i0,
                       const Chunk &c, Scratch &w) {
  const int64_t hk = h / (a.H / a.HKV);
  if (a.dtype == DT_BF16)
    decode_chunk<uint16_t>(a, f32, b, h, hk, i0, c, w);
  else
    decode_chunk<float>(a, a, b, h, hk, i0, c, w);
}

// (feature "diag") The columns of a chunk's short rows (below): one register tile's (32
// on AVX2, 16 on NEON), or half the chunk where a tile spans all of it (AVX-512: tiles of
// 2 vectors instead of 4).
constexpr int64_t SHORT_COLS = simd::TILE_C * W < KC ? simd::TILE_C * W : KC / 2;

// Under the band's upper edge (causal, a window), the chunk's rows [c.r0, end) keep no
// column at or past SHORT_COLS: the end (c.r0 where there are none, and for a paged
// chunk). Both products skip those columns for those rows (the scores the softmax
// drops, the weights that are 0: the same bits). The forward on AVX2: causal 0.991-0.998x
// the time (T=4096 on 1 thread, 8192 on 2), window 256 0.977x (T=8192); on AVX-512:
// 0.996-1.000x and 0.972-0.986x, in bf16 0.992x and 0.986x (native_ab, session 25).
inline int64_t short_rows_end(const Args &a, const Chunk &c, int64_t i0) {
  if (!c.band || c.lo >= SHORT_COLS || a.pages) return c.r0;
  return std::clamp<int64_t>(c.c0 - i0 - a.band_hi + SHORT_COLS, c.r0, c.r1);
}

// The chunk's scores by product(r0, r1, cols, row_max): a product over the chunk's rows
// [r0, r1) and `cols` columns, returning whether it set row_max. The short rows take
// SHORT_COLS columns; w.mx_set says whether w.mx holds every row's max (never where there
// are short rows: a band chunk, whose softmax takes no max from the product). Returns
// their end, for chunk_pv.
template <class F>
int64_t chunk_scores(const Args &a, const Chunk &c, int64_t i0, Scratch &w, F product) {
  const int64_t split = short_rows_end(a, c, i0);
  if (split == c.r0) {
    w.mx_set = product(c.r0, c.r1, score_cols(c), w.mx.data() + c.r0);
    return split;
  }
  product(c.r0, split, std::min<int64_t>(SHORT_COLS, score_cols(c)), nullptr);
  if (split < c.r1) product(split, c.r1, score_cols(c), nullptr);
  w.mx_set = false;
  return split;
}

// The chunk's P V by pv(r0, r1, hi) over its columns [c.lo, hi): the short rows (those
// before `split`, chunk_scores) up to SHORT_COLS only.
template <class F>
void chunk_pv(const Chunk &c, int64_t split, F pv) {
  if (split > c.r0) pv(c.r0, split, std::min<int64_t>(c.hi, SHORT_COLS));
  if (split < c.r1) pv(split, c.r1, c.hi);
}

// ---------------------------------------------------------------------------------------
// (feature "keys as rows") Where a work item packs its own keys (pack in item: a cascade's
// prefix pass, a draft tree's cache, a short MHA prefill) and its block has few rows, the
// transposing of each chunk of keys costs a good part of the block's products (about a
// sixth of a cascade decode step's prefix pass at 32 rows: 64 8x8 transposes a chunk
// against 32 x 64 x 64 multiply-adds of each product). A plain chunk of such a block (no
// band, mask, bias or mod; a mask tensor that keeps every column counts as none) computes
// its scores transposed instead: St (KC x rows) = K Q^T, the keys as the product's rows read
// where they are, the block's queries transposed once (Q^T, D x rows rounded up to W). The
// softmax then runs down St's columns (a row's max and sum are vertical: no horizontal
// reductions), and P V reads P^T with its strides swapped. Every score and weight is the
// bits the rows' path computes (the same products in the same order, the same FMA); a
// row's chunk sum is added in another order, into lane 0 of its sums.
// ---------------------------------------------------------------------------------------

// Rows of a block for which a chunk goes this way: 16 up to one register tile's columns
// (64 on AVX-512, 32 on AVX2), where no more than a third of the rows' count is padding up
// to whole vectors. Times against the rows' path (2048 keys, d = 64, 1 thread, C ABI,
// session 29): AVX-512 at 16, 24, 32, 48, 64 rows 0.83-0.87, 0.95, 0.87, 0.91, 0.92x;
// AVX2 at 16, 24, 32 rows 0.93-0.95x. Padded more it lost (AVX-512 at 9 and 10 rows,
// 1.10 and 1.07x; AVX2 at 9 and 12, 1.26 and 1.11x), and past one tile it gained nothing
// (AVX-512 at 80, 96, 128 rows 0.99-1.00x).
constexpr int64_t KEYS_AS_ROWS_MIN = 16, KEYS_AS_ROWS_MAX = simd::TILE_C * W;

// Whether chunk c of the block (rows rows, first i0) of (b, h) goes this way.
bool keys_as_rows(const Args &a, const Operands &ops, const Chunk &c, int64_t b, int64_t h,
                  int64_t i0, int64_t rows) {
  if (a.dtype != DT_F32 || !ops.in_item || a.pages || a.mod_forward || a.rel)
    return false;
  if (rows < KEYS_AS_ROWS_MIN || rows > KEYS_AS_ROWS_MAX || !(a.scale > 0)) return false;
  if (3 * (whole_vectors(rows) - rows) > rows) return false;  // (padding)
  if (c.band || c.keep || c.gen || c.lo != 0 || c.hi != KC || c.r0 != 0 || c.r1 != rows)
    return false;
  return !a.mask || Masker(a, c, b, h).mask_keeps_all(i0);
}

// The block's nr query rows q (stride sq_t) as Q^T into qt (D x nr rounded up to whole
// vectors, the rows past nr zero).
void pack_query_t(const Args &a, const float *q, int64_t nr, std::vector<float> &qt) {
  const int64_t nrp = whole_vectors(nr);
  qt.assign(size_t(a.D * nrp), 0.0f);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t k = 0; k < a.D; ++k) qt[k * nrp + r] = q[r * a.sq_t + k];
}

// The block's sums of weights (l_blk: W lanes a row) held transposed while its chunks go
// this way (w.lt, W x nrp: lane k of row r at k nrp + r), so that each lane gets the
// column sums the rows' path adds, in its order: into lt (lt_rows: the block's rows) and
// back (before a chunk of the rows' path, and before the block's sums are gathered).
void sums_to_lt(const Args &a, int64_t nr, Scratch &w) {
  const int64_t nrp = whole_vectors(nr);
  w.lt.assign(size_t(W * nrp), 0.0f);
  for (int64_t r = 0; r < nr; ++r)
    for (int k = 0; k < W; ++k) w.lt[k * nrp + r] = w.l_blk[r * W + k];
  w.lt_rows = nr;
}

void sums_from_lt(Scratch &w) {
  if (!w.lt_rows) return;
  const int64_t nr = w.lt_rows, nrp = whole_vectors(nr);
  for (int64_t r = 0; r < nr; ++r)
    for (int k = 0; k < W; ++k) w.l_blk[r * W + k] = w.lt[k * nrp + r];
  w.lt_rows = 0;
}

// Chunk c of the block's nr rows (Q^T in w.qt) against its keys and values (the chunk's
// first key at kc, the next ks floats on; its values at vc, vs apart): scores, softmax and
// O's P V. False (the state untouched) where a row's max is not finite (a NaN or an
// infinite score): the rows' path then takes the chunk.
bool chunk_keys_as_rows(const Args &a, const Chunk &c, int64_t nr, const float *kc, int64_t ks,
                        const float *vc, int64_t vs, Scratch &w) {
  const int64_t nrp = whole_vectors(nr), nv = nrp / W;
  w.st.resize(size_t(KC * nrp));
  float *st = w.st.data(), *m = w.m.data(), *alpha = w.alpha.data();
  simd::gemm<false>(st, nrp, KC, nrp, kc, ks, 1, w.qt.data(), nrp, a.D,
                    nullptr);  // (KC, nrp): key j's scores in row j
  const vf scale2 = simd::splat(float(a.scale * LOG2E)), ninf = simd::splat(NEG_INF);
  const vi lane = simd::lanes();
  static_assert(KC % W == 0, "whole vectors of rows");
  alignas(64) float m_new[KEYS_AS_ROWS_MAX + W];
  for (int64_t v = 0; v < nv; ++v) {  // check first: then change the state
    constexpr int U = 4;  // rows of St at once: independent maxima
    vf x[U];
    for (int u = 0; u < U; ++u) x[u] = ninf;
    for (int64_t j = 0; j < KC; j += U)
      for (int u = 0; u < U; ++u) x[u] = simd::vmax(x[u], simd::load(st + (j + u) * nrp + W * v));
    const vf mx = simd::vmax(simd::vmax(x[0], x[1]), simd::vmax(x[2], x[3]));
    const vf m_old = simd::load(m + W * v), mn = simd::vmax(m_old, mx * scale2);
    simd::store(m_new + W * v, mn);
    const vi odd = ~(mn > ninf) | (m_old != m_old);  // -inf or NaN
    const vi active = (lane + int32_t(W * v)) < int32_t(nr);
    if (simd::any(odd & active)) return false;
  }
  if (w.lt_rows != nr) sums_to_lt(a, nr, w);
  float *lt = w.lt.data();
  for (int64_t v = 0; v < nv; ++v) {
    const vf m_old = simd::load(m + W * v);
    const vf mn = simd::round_up(simd::load(m_new + W * v), M_STEP);
    const vi active = (lane + int32_t(W * v)) < int32_t(nr);
    simd::store(m + W * v, simd::select(active, mn, m_old));
    const vf al = simd::exp2(m_old - mn);  // 2^0 = 1 exactly; 2^-inf = 0
    simd::store(alpha + W * v, al);
    // the weights, and each lane's sum as softmax_plain forms it: lane k of a row adds its
    // columns k, W + k, ... in order (keys j with j mod W = k)
    vf sum[W];
    for (int k = 0; k < W; ++k) sum[k] = simd::splat(0.0f);
    for (int64_t j0 = 0; j0 < KC; j0 += W)
#pragma GCC unroll 16
      for (int k = 0; k < W; ++k) {
        float *p = st + (j0 + k) * nrp + W * v;
        const vf wgt = simd::exp2(simd::load(p) * scale2 - mn);  // (one FMA, as the rows')
        simd::store(p, wgt);
        sum[k] += wgt;
      }
    // l_blk = alpha l_blk + sum (alpha 1: l_blk + sum, the same bits as the rows' add)
    for (int k = 0; k < W; ++k) {
      float *l = lt + k * nrp + W * v;
      simd::store(l, simd::load(l) * al + sum[k]);
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    if (alpha[r] == 1.0f) continue;
    const vf al = simd::splat(alpha[r]);  // the max moved: rescale what was gathered
    float *o = w.o.data() + r * a.DV, *l = w.l.data() + r * W;
    for (int64_t d = 0; d < a.DV; d += W) simd::store(o + d, simd::load(o + d) * al);
    simd::store(l, simd::load(l) * al);
  }
  // O = alpha (.) O + P V, P(r, j) = St(j, r)
  simd::gemm<true>(w.o_blk.data(), a.DV, nr, a.DV, st, 1, nrp, vc, vs, KC, alpha);
  return true;
}

// (feature "pv2") A float32 chunk's P V over all KC keys may be held back and run with the
// next chunk's in one pass over O (simd::gemm, PAIR), which loads and stores each register
// tile of O once for both: the first chunk's weights wait in w.s2, its O rescale in
// w.alpha2. The second chunk's rescale alpha' then applies to the first's weights and to
// O's: O = (alpha alpha') O + (alpha' P) V + P' V'. Each rescale is a power of 2 or 1 (m
// moves by M_STEP steps: see softmax_plain), so the scaled products round as the unscaled
// ones: the bits of running the two products one after the other (where nothing
// underflows to a subnormal). A chunk is held where the next one may pair with it: the
// rows' path without pages, every row taking every column (no short rows, lo = 0, hi = KC),
// and no gather of SUPER chunks due after it.
struct Held {
  bool on = false;
  int64_t r0 = 0, r1 = 0;
  const float *v = nullptr;  // the chunk's values
  int64_t ld = 0;            // ... and their rows' stride
};

void held_pv(const Args &a, Held &held, Scratch &w) {
  if (!held.on) return;
  held.on = false;
  simd::gemm<true>(w.o_blk.data() + held.r0 * a.DV, a.DV, held.r1 - held.r0, a.DV,
                   w.s2.data() + held.r0 * KC, KC, 1, held.v,
                   held.ld, KC, w.alpha2.data() + held.r0);
}

// One block of query rows [i0, i1) of batch b, head h.
// (Split-KV: only the key chunks [cmin, cmax], normalised over them.)
void forward_block(const Args &a, const Operands &ops, int64_t b, int64_t h, int64_t i0,
                   int64_t i1, Scratch &w, int64_t cmin, int64_t cmax) {
  const int64_t rows = i1 - i0;
  const int64_t hk = h / (a.H / a.HKV);
  const float *qh = a.q + b * a.sq_b + h * a.sq_h;
  const float *vh = a.v + b * a.sv_b + hk * a.sv_h;
  const uint16_t *vh16 = reinterpret_cast<const uint16_t *>(a.v) + b * a.sv_b + hk * a.sv_h;
  Held held;
  auto flush = [&] { held_pv(a, held, w); };  // (pv2) the held chunk's P V, alone
  block_begin(a, rows, w);
  w.qt.clear(), w.lt_rows = 0;  // (keys as rows: the block's Q^T, made on its first chunk)
  int64_t seen = 0;
  Args as_float32 = a;  // (a bf16 decode step: its softmax leaves float32 weights)
  as_float32.dtype = DT_F32;
  for_each_chunk(a, b, h, i0, i1, cmin, cmax, w.keep.data(), [&](const Chunk &c) {
    if (ops.direct) {  // a decode step: keys and values read in place
      decode_step_chunk(a, as_float32, b, h, i0, c, w);
      if (++seen % SUPER == 0) block_gather(a, rows, w);
      return;
    }
#if defined(ATTNKIT_BF16)
    if (a.dtype == DT_BF16) {
      const uint16_t *q16 = reinterpret_cast<const uint16_t *>(a.q) + b * a.sq_b + h * a.sq_h;
      const uint16_t *kp, *vp;
      if (ops.in_item) {
        const auto *k16 = reinterpret_cast<const uint16_t *>(a.k);
        const auto *v16 = reinterpret_cast<const uint16_t *>(a.v);
        w.kp16.resize(size_t(a.D * KC)), w.vp16.resize(size_t(a.DV * KC));
        pack_one(a, k16, a.sk_b, a.sk_h, a.sk_t, a.D, dim_pairs, b, hk, c.ci, w.kp16.data());
        pack_one(a, v16, a.sv_b, a.sv_h, a.sv_t, a.DV, key_pairs, b, hk, c.ci, w.vp16.data());
        kp = w.kp16.data(), vp = w.vp16.data();
      } else {
        kp = ops.kp.chunk(a, b, hk, c.ci), vp = ops.vp.chunk(a, b, hk, c.ci);
      }
      const int64_t split = chunk_scores(a, c, i0, w, [&](int64_t r0, int64_t r1, int64_t cols,
                                                          float *row_max) {
        return gemm_bf16<false>(w.s.data() + r0 * KC, KC, r1 - r0, cols,
                                q16 + (i0 + r0) * a.sq_t, a.sq_t, kp, 2 * KC, a.D / 2,
                                nullptr, row_max);
      });
      softmax(a, b, h, i0, c, w);
      // P V over whole pairs of keys: the weights outside [lo, hi) are 0
      chunk_pv(c, split, [&](int64_t r0, int64_t r1, int64_t hi) {
        const int64_t lo = c.lo & ~int64_t(1);
        hi = (hi + 1) & ~int64_t(1);
        const uint16_t *p16 = w.p16.data() + r0 * KC;  // the weights, as softmax left them
        gemm_bf16<true>(w.o_blk.data() + r0 * a.DV, a.DV, r1 - r0, a.DV, p16 + lo, KC,
                        vp + lo * a.DV, 2 * a.DV, (hi - lo) / 2, w.alpha.data() + r0);
      });
      if (++seen % SUPER == 0) block_gather(a, rows, w);
      return;
    }
#endif
    // the chunk's first key and value (float32) and their rows' strides: in place, or
    // (bf16 in item) converted here by the chunk's one reader
    const float *kc = a.k + b * a.sk_b + hk * a.sk_h + c.c0 * a.sk_t, *vf32 = vh + c.c0 * a.sv_t;
    int64_t ks = a.sk_t, vs = a.sv_t;
    if (ops.k16) {
      const Bf16InPlace &k16 = *ops.k16;
      const int64_t n = std::min<int64_t>(KC, a.S - c.c0);
      w.kf.resize(size_t(KC * a.D)), w.vf.resize(size_t(KC * a.DV));
      chunk_as_float32(k16.k + b * k16.sb + hk * k16.sh + c.c0 * k16.st, k16.st, n, a.D,
                      w.kf.data());
      chunk_as_float32(vh16 + c.c0 * a.sv_t, a.sv_t, n, a.DV, w.vf.data());
      kc = w.kf.data(), vf32 = w.vf.data(), ks = a.D, vs = a.DV;
    }
    if (keys_as_rows(a, ops, c, b, h, i0, rows)) {
      flush();
      if (w.qt.empty()) pack_query_t(a, qh + i0 * a.sq_t, rows, w.qt);  // (once a block)
      if (chunk_keys_as_rows(a, c, rows, kc, ks, vf32, vs, w)) {
        if (++seen % SUPER == 0) block_gather(a, rows, w);
        return;
      }
    }
    sums_from_lt(w);  // (a chunk of the rows' path after chunks of keys as rows)
    const float *kt;
    if (ops.k16) {  // (bf16 in item) its float32 rows, zero past the last key, transposed
      w.kt.resize(size_t(a.D * KC));
      pack_chunk<float, transposed>(a.D, [&](int64_t j) { return kc + j * ks; }, w.kt.data());
      kt = w.kt.data();
    } else if (ops.in_item) {
      w.kt.resize(size_t(a.D * KC));
      pack_one(a, a.k, a.sk_b, a.sk_h, a.sk_t, a.D, transposed, b, hk, c.ci, w.kt.data());
      kt = w.kt.data();
    } else {
      kt = ops.kt.chunk(a, b, hk, c.ci);
    }
    const int64_t split = chunk_scores(a, c, i0, w, [&](int64_t r0, int64_t r1, int64_t cols,
                                                        float *row_max) {
      return simd::gemm<false>(w.s.data() + r0 * KC, KC, r1 - r0, cols, qh + (i0 + r0) * a.sq_t,
                               a.sq_t, 1, kt, KC, a.D, nullptr, row_max);
    });
    softmax(a, b, h, i0, c, w);
    const bool whole = !a.pages && split == c.r0 && c.lo == 0 && c.hi == KC;
    if (whole && held.on && held.r0 == c.r0 && held.r1 == c.r1) {  // (pv2) the pair's P V
      float *al = w.alpha.data(), *al2 = w.alpha2.data();
      for (int64_t r = c.r0; r < c.r1; ++r) {
        if (al[r] == 1.0f) continue;
        const vf x = simd::splat(al[r]);  // the second chunk's rescale, on the first's weights
        float *p = w.s2.data() + r * KC;
        for (int vv = 0; vv < NV; ++vv) simd::store(p + W * vv, simd::load(p + W * vv) * x);
        al2[r] *= al[r];
      }
      held.on = false;
      float *o = w.o_blk.data() + c.r0 * a.DV;
      const float *p2 = w.s2.data() + c.r0 * KC, *p = w.s.data() + c.r0 * KC;
      simd::gemm<true, true>(o, a.DV, c.r1 - c.r0, a.DV, p2, KC, 1, held.v, held.ld, KC,
                             al2 + c.r0, nullptr, p, vf32);
    } else {
      flush();
      if (whole && (seen + 1) % SUPER != 0) {  // (pv2) held for the next chunk
        std::swap(w.s, w.s2), std::swap(w.alpha, w.alpha2);
        if (ops.k16) std::swap(w.vf, w.vf2);  // (its values stay where vf32 points)
        held = Held{true, c.r0, c.r1, vf32, vs};
      } else if (a.pages) {
        paged_pv(a, b, hk, c, c.r1 - c.r0, w.s.data() + c.r0 * KC, w);
      } else {
        chunk_pv(c, split, [&](int64_t r0, int64_t r1, int64_t hi) {
          float *o = w.o_blk.data() + r0 * a.DV, *alpha = w.alpha.data() + r0;
          const float *p = w.s.data() + r0 * KC + c.lo;
          simd::gemm<true>(o, a.DV, r1 - r0, a.DV, p, KC, 1, vf32 + c.lo * vs, vs, hi - c.lo,
                           alpha);
        });
      }
    }
    if (++seen % SUPER == 0) block_gather(a, rows, w);
  });
  flush();
  block_end(a, b, h, i0, rows, w);
}

// ---------------------------------------------------------------------------------------
// (feature "page walk") A paged decode step's work item holds several heads of a batch
// row, and walks their keys chunk by chunk, each head's rows in turn: the thread reads a
// page's heads one after the other (a page holds its kv heads side by side, (h_kv,
// page_size, d) each). A head at a time, each read of a page is one head's short run
// (2 KB of bf16 keys for 16 x 64), and past the run's end the hardware prefetcher fetches
// lines of the next head that are evicted before that head's turn: memory bandwidth spent
// for nothing. On the Zen 3 of session 16 (C ABI, 12 heads x 16384 keys, bf16, 2 threads)
// a paged step took 1.34-1.44x a contiguous cache's one head at a time, 1.04-1.23x walking
// the heads. Each head's sums are its own, chunk after chunk as forward_block's: the same
// bits for any grouping.
// A float32 step walks each page whole (decode_heads_chunk): every head's scores of a
// page's run of keys, the page's next run, ..., the softmaxes, then the values the same
// way, so the thread reads each page's keys and then its values from start to end (48 KB
// each for 12 heads x 16 x 64). Where the cache is read from memory this is what a
// contiguous cache's stream gets: on a 2-core Zen 4 (session 17, C ABI, 12 heads, fp32,
// interleaved A/B) paged / contiguous went 1.38 -> 1.03 on 1 thread at L=4096 and 1.18 ->
// 1.10, 1.26 -> 1.18 on 2 threads at L=4096 and 16384; from cache (L=1024, 1 thread)
// 1.01 -> 0.99. bf16 steps measured slower walked that way (1 thread, L=4096: 1.13-1.16 ->
// 1.24-1.26; 2 threads up to 1.70) and keep a head at a time. On the Xeon of session 30
// (its L3 holds such a cache) the walk was the slower one in float32 too (paged /
// contiguous, C ABI, L=4096 x 12 heads: 1.08-1.14 walked, 0.97-1.00 a head at a time),
// so Args.page_heads_apart lets the caller choose what this machine measured.
// ---------------------------------------------------------------------------------------

// Heads an item walks together (1: none), given the items `per_head` of each head (key
// ranges x batch rows x query blocks): as many as keep the threads as busy as one head an
// item would (items / (threads x rounds of items)), the most of those, a divisor of H.
// The bits do not depend on it, so the thread count may decide it.
int64_t walk_heads(const Args &a, int64_t per_head) {
  if (!a.pages || !direct_keys(a) || a.T > a.bq || a.bm_kind || a.H == 1) return 1;
  const int64_t threads = std::max<int64_t>(1, a.threads);
  auto busy = [&](int64_t hg) {
    const int64_t items = per_head * (a.H / hg);
    return double(items) / double(threads * ((items + threads - 1) / threads));
  };
  int64_t best = 1;
  for (int64_t hg = 2; hg <= a.H; ++hg)  // (divisors: items of one size)
    if (a.H % hg == 0 && busy(hg) >= busy(best) - 1e-9) best = hg;
  return best;
}

// One chunk of a paged decode step for the heads [h0, h1) of batch row b, a page's run of
// keys at a time for every head (its heads' keys lie side by side in the page: the thread
// reads each page's keys, then its values, from start to end; float32 steps, see the
// walk's note below). Each head's scores, softmax and P V are those decode_chunk computes,
// in the same order: the same bits.
template <class T>
void decode_heads_chunk(const Args &a, const Args &f32, int64_t b, int64_t h0, int64_t h1,
                        int64_t i0, const Chunk &c, std::vector<Scratch> &ws) {
  const int64_t nr = c.r1 - c.r0, g = a.H / a.HKV;
  const T *q = static_cast<const T *>(static_cast<const void *>(a.q)) + b * a.sq_b +
               (i0 + c.r0) * a.sq_t;
  const int64_t keys = a.key_lens ? a.key_lens[b] : a.S;
  const int64_t krow = a.D * int64_t(sizeof(T)), vrow = a.DV * int64_t(sizeof(T));
  for (int64_t h = h0; h < h1; ++h)
    std::fill(ws[h - h0].s.data() + c.r0 * KC, ws[h - h0].s.data() + c.r1 * KC, 0.0f);
  for (int64_t j = c.c0 + c.lo, end = c.c0 + c.hi, n = 0; j < end; j += n) {
    for (int64_t h = h0; h < h1; ++h) {
      const T *k0 = kv_run<T>(a, b, h / g, j, end, n);
      int64_t nv = 0, nk = 0;
      const T *v0 = kv_run<T, VALUES>(a, b, h / g, j, end, nv);
      const int64_t next = j + n;  // this head's next run of keys (the next chunk's too)
      const T *k1 = next < keys ? kv_run<T>(a, b, h / g, next, keys, nk) : nullptr;
      auto ask = [&](int64_t x0, int u) {  // its values now, the next run's keys
        for (int x = 0; x < u; ++x) prefetch(v0 + (x0 + x) * a.sv_t, vrow);
        for (int64_t x = x0; x < std::min<int64_t>(x0 + u, nk); ++x)
          prefetch(k1 + x * a.sk_t, krow);
      };
      float *s = ws[h - h0].s.data() + c.r0 * KC + (j - c.c0);
      if (a.D == 64)
        direct_run<T, 64>(a, k0, n, q + h * a.sq_h, nr, s, ask);
      else if (a.D == 128)
        direct_run<T, 128>(a, k0, n, q + h * a.sq_h, nr, s, ask);
      else
        direct_run<T, 0>(a, k0, n, q + h * a.sq_h, nr, s, ask);
    }
  }
  for (int64_t h = h0; h < h1; ++h) softmax(f32, b, h, i0, c, ws[h - h0]);
  bool first = true;
  for (int64_t j = c.c0 + c.lo, end = c.c0 + c.hi, n = 0; j < end; j += n, first = false) {
    kv_run<T, VALUES>(a, b, 0, j, end, n);  // (the run's length)
    Chunk run = c;
    run.lo = j - c.c0, run.hi = j + n - c.c0;
    for (int64_t h = h0; h < h1; ++h) {
      Scratch &w = ws[h - h0];
      decode_pv<T>(a, b, h / g, run, nr, w.s.data() + c.r0 * KC,
                   first ? w.alpha.data() + c.r0 : nullptr, w.o_blk.data() + c.r0 * a.DV);
    }
  }
}

struct HeadsScratch {
  const Args &a;
  std::vector<Scratch> w;  // one per head of an item, made as needed
  HeadsScratch(const Args &a_) : a(a_) {}
  Scratch &operator[](int64_t n) {
    while (int64_t(w.size()) <= n) w.emplace_back(a);
    return w[size_t(n)];
  }
};

// The rows [i0, i1) of heads [h0, h1) of batch row b (query heads; a folded GQA step's
// are its kv heads), walked together (see above); the chunks [cmin, cmax] as forward_block.
void forward_heads(const Args &a, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1,
                   HeadsScratch &ws, int64_t cmin, int64_t cmax) {
  const int64_t rows = i1 - i0;
  for (int64_t h = h0; h < h1; ++h) block_begin(a, rows, ws[h - h0]);
  int64_t seen = 0;
  Args as_float32 = a;
  as_float32.dtype = DT_F32;
  // (the chunks of every head are those of h0: no block mask, the one thing they depend on)
  ws[h1 - h0 - 1];  // (every head's scratch made)
  for_each_chunk(a, b, h0, i0, i1, cmin, cmax, nullptr, [&](const Chunk &c) {
    if (a.dtype == DT_BF16 || a.page_heads_apart) {  // a head at a time (see above)
      for (int64_t h = h0; h < h1; ++h) decode_step_chunk(a, as_float32, b, h, i0, c, ws[h - h0]);
    } else {
      decode_heads_chunk<float>(a, a, b, h0, h1, i0, c, ws.w);
    }
    if (++seen % SUPER == 0)
      for (int64_t h = h0; h < h1; ++h) block_gather(a, rows, ws[h - h0]);
  });
  for (int64_t h = h0; h < h1; ++h) block_end(a, b, h, i0, rows, ws[h - h0]);
}

// ---------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------

// bf16 rows (bq rows of KC), their transposes in pairs of rows (KC rows of `pairs` pairs:
// bq rounded up to even, halved, then up to a multiple of 8 for simd::transpose8) and Q,
// dO of a block in pairs of rows: what a bf16 backward's products read. `words`: a chunk's
// pairs of rows side by side, before their transpose.
struct BackPairs {
  int64_t pairs = 0;  // 32-bit words (pairs of rows) a row of pt16 and dst16 holds
  std::vector<uint16_t> p16, ds16, pt16, dst16, q2, do2;
  std::vector<float> words;
  BackPairs(const Args &a) {
    if (a.dtype != DT_BF16) return;
    const int64_t np = (a.bq + 1) & ~int64_t(1);
    pairs = (np / 2 + 7) & ~int64_t(7);
    p16.resize(a.bq * KC), ds16.resize(a.bq * KC), pt16.resize(KC * 2 * pairs);
    dst16.resize(KC * 2 * pairs), q2.resize(np * a.D), do2.resize(np * a.DV);
    words.resize(pairs * KC);
  }
};

struct BackScratch {
  std::vector<float> p, ds, dk, dv;
  std::vector<uint8_t> keep;  // a chunk's assembled block-mask rows
  BackPairs pairs;
  BackScratch(const Args &a)
      : p(a.bq * KC), ds(a.bq * KC), dk(KC * a.D), dv(KC * a.DV), keep(a.bq * KC), pairs(a) {}
};

// What the backward's products read: float32 keys and values transposed; bf16 keys and
// values in pairs of dims (for QK^T and dO V^T) and keys in pairs of keys (for dS K).
struct BackOperands {
  Packed<float> kt, vt;
#if defined(ATTNKIT_BF16)
  Packed<uint16_t> kp, vp, kj;
#endif
  int64_t chunks = 0;
};

// p = the chunk's weights, ds = scale * p * (dO V^T - delta), for rows [r0, r1).
void weights_and_ds(const Args &a, const Grads &g, const BackOperands &ops, int64_t b,
                    int64_t h, int64_t i0, const Chunk &c, BackScratch &w, double *dgrad) {
  const int64_t hk = h / (a.H / a.HKV), nr = c.r1 - c.r0;
  const float *lse = a.lse + (b * a.H + h) * a.T;
  const float *delta = g.delta + (b * a.H + h) * a.T;
#if defined(ATTNKIT_BF16)
  if (a.dtype == DT_BF16) {
    const uint16_t *q16 = reinterpret_cast<const uint16_t *>(a.q) + b * a.sq_b + h * a.sq_h;
    const uint16_t *do16 = reinterpret_cast<const uint16_t *>(g.dout) + (b * a.H + h) * a.T * a.DV;
    gemm_bf16<false>(w.p.data() + c.r0 * KC, KC, nr, KC, q16 + (i0 + c.r0) * a.sq_t, a.sq_t,
                     ops.kp.chunk(a, b, hk, c.ci), 2 * KC, a.D / 2, nullptr);
    gemm_bf16<false>(w.ds.data() + c.r0 * KC, KC, nr, KC, do16 + (i0 + c.r0) * a.DV, a.DV,
                     ops.vp.chunk(a, b, hk, c.ci), 2 * KC, a.DV / 2, nullptr);
  } else
#endif
  {
    const float *qh = a.q + b * a.sq_b + h * a.sq_h;
    const float *doh = g.dout + (b * a.H + h) * a.T * a.DV;
    simd::gemm<false>(w.p.data() + c.r0 * KC, KC, nr, KC, qh + (i0 + c.r0) * a.sq_t, a.sq_t, 1,
                      ops.kt.chunk(a, b, hk, c.ci), KC, a.D, nullptr);
    simd::gemm<false>(w.ds.data() + c.r0 * KC, KC, nr, KC, doh + (i0 + c.r0) * a.DV, a.DV, 1,
                      ops.vt.chunk(a, b, hk, c.ci), KC, a.DV, nullptr);
  }
  Masker masker(a, c, b, h);
  const vf scale = simd::splat(float(a.scale));
  // with a compiled score_mod: ds = d(modded) first, then through the mod, then scaled
  const vf ds_scale = a.mod_backward ? simd::splat(1.0f) : scale;
  // P = e^(x - lse) = 2^((x - lse) log2(e)) by simd::exp2 (feature "bexp2": a shorter
  // reduction and polynomial than exp()'s). x - lse first: near a row's largest weights
  // it is exact, where x log2(e) - lse log2(e) would carry both roundings (about |lse|
  // ulps of the exponent; the mods' fuzzer found one past its float64 rule)
  const vf log2e = simd::splat(float(M_LOG2E));
  for (int64_t r = c.r0; r < c.r1; ++r) {
    float *p = w.p.data() + r * KC, *ds = w.ds.data() + r * KC;
    vf x[NV];
    masker.row(r, i0 + r, p, x);
    const vf l = simd::splat(lse[i0 + r]), dl = simd::splat(delta[i0 + r]);  // dead: lse +inf
#pragma GCC unroll 16
    for (int vv = 0; vv < NV; ++vv) {
      const vf pv = simd::exp2((x[vv] - l) * log2e);
      simd::store(p + W * vv, pv);
      simd::store(ds + W * vv, ds_scale * pv * (simd::load(ds + W * vv) - dl));
    }
    if (a.mod_backward) {
      a.mod_backward(a.mod_ctx, b, h, i0 + r, c.c0, masker.mod_in, ds, dgrad);
      for (int vv = 0; vv < NV; ++vv) simd::store(ds + W * vv, simd::load(ds + W * vv) * scale);
    }
  }
}

// The key chunks of group g are g, g + G, g + 2G, ...; G depends only on the shapes.
// (At most 64 Mi floats of dQ partials, the first of them dQ itself: group_dq.)
int64_t key_groups(const Args &a, int64_t chunks) {
  const int64_t per_group = a.B * a.H * a.T * a.D;  // floats of one dQ partial
  int64_t groups = std::max<int64_t>(2, 32 / std::max<int64_t>(1, a.B * a.HKV));
  groups = std::min<int64_t>(groups, (int64_t(64) << 20) / std::max<int64_t>(1, per_group));
  return std::max<int64_t>(1, std::min(groups, chunks));
}

#if defined(ATTNKIT_BF16)
// dV, dK and dQ of one chunk from its weights and dS with bf16 products: P and dS rounded
// to bf16 (as rows, and transposed in pairs of rows), Q and dO of the block in pairs of rows.
void products_bf16(const Args &a, const Grads &g, const BackOperands &ops, int64_t b, int64_t h,
                   int64_t hk, int64_t i0, const Chunk &c, float *dqh, BackScratch &w) {
  BackPairs &x = w.pairs;
  const int64_t nr = c.r1 - c.r0, np = (nr + 1) & ~int64_t(1);
  const uint16_t *q16 = reinterpret_cast<const uint16_t *>(a.q) + b * a.sq_b + h * a.sq_h;
  const uint16_t *do16 = reinterpret_cast<const uint16_t *>(g.dout) + (b * a.H + h) * a.T * a.DV;
  for (int64_t r = 0; r < nr; ++r)
    for (int vv = 0; vv < NV; ++vv) {
      const int64_t at = (c.r0 + r) * KC + W * vv;
      simd::store_bf16(x.p16.data() + r * KC + W * vv, simd::load(w.p.data() + at));
      simd::store_bf16(x.ds16.data() + r * KC + W * vv, simd::load(w.ds.data() + at));
    }
  // (feature "pairs8") P and dS transposed in pairs of rows: x.words holds the chunk's
  // rows side by side (pair q = rows 2q, 2q + 1: a word for each key, 0 past nr; pairs past
  // the last all 0), and simd::transpose8 takes the words of keys [lo, hi) to key rows.
  // Element by element this took more time than all five products on AMX tiles.
  const int64_t half = np / 2, stride = x.pairs;
  float *words = x.words.data();
  auto transposed = [&](uint16_t *dst, const uint16_t *rows) {
    for (int64_t q = 0; q < half; ++q)
      simd::interleave_bf16(reinterpret_cast<uint16_t *>(words + q * KC), rows + 2 * q * KC,
                            2 * q + 1 < nr ? rows + (2 * q + 1) * KC : nullptr, KC);
    const float *from[8];
    for (int64_t q0 = 0; q0 < half; q0 += 8) {
      for (int i = 0; i < 8; ++i) from[i] = words + (q0 + i) * KC;
      for (int64_t j0 = c.lo & ~int64_t(7); j0 < c.hi; j0 += 8)
        simd::transpose8(from, j0, reinterpret_cast<float *>(dst) + j0 * stride + q0, stride);
    }
  };
  std::fill(words + half * KC, words + stride * KC, 0.0f);
  transposed(x.pt16.data(), x.p16.data());
  transposed(x.dst16.data(), x.ds16.data());
  auto row_pairs = [&](uint16_t *dst, const uint16_t *src, int64_t at, int64_t depth) {
    for (int64_t q = 0; q < half; ++q)
      simd::interleave_bf16(dst + 2 * q * depth, src + (2 * q) * at,
                            2 * q + 1 < nr ? src + (2 * q + 1) * at : nullptr, depth);
  };
  row_pairs(x.q2.data(), q16 + (i0 + c.r0) * a.sq_t, a.sq_t, a.D);
  row_pairs(x.do2.data(), do16 + (i0 + c.r0) * a.DV, a.DV, a.DV);
  const int64_t nk = c.hi - c.lo;
  // dV[j] += sum_r P[r][j] dO[r], dK[j] += sum_r dS[r][j] Q[r]
  gemm_bf16<true>(w.dv.data() + c.lo * a.DV, a.DV, nk, a.DV, x.pt16.data() + c.lo * 2 * stride,
                  2 * stride, x.do2.data(), 2 * a.DV, half, nullptr);
  gemm_bf16<true>(w.dk.data() + c.lo * a.D, a.D, nk, a.D, x.dst16.data() + c.lo * 2 * stride,
                  2 * stride, x.q2.data(), 2 * a.D, half, nullptr);
  // dQ[r] += sum_j dS[r][j] K[j], over whole pairs of keys (dS is 0 outside [lo, hi))
  const int64_t lo = c.lo & ~int64_t(1), hi = (c.hi + 1) & ~int64_t(1);
  gemm_bf16<true>(dqh + (i0 + c.r0) * a.D, a.D, nr, a.D, x.ds16.data() + lo, KC,
                  ops.kj.chunk(a, b, hk, c.ci) + lo * a.D, 2 * a.D, (hi - lo) / 2, nullptr);
}
#endif

// Group grp's dQ partial, (B, H, T, D) as dQ (`stride` floats): group 0's is dQ itself,
// the others' the (grp - 1)-th of `partials`.
inline float *group_dq(float *dq, float *partials, int64_t grp, int64_t stride) {
  return grp ? partials + (grp - 1) * stride : dq;
}

// dq[from, to) += the partials of groups 1 .. groups - 1, in group order.
inline void sum_partials(float *dq, const float *partials, int64_t groups, int64_t stride,
                         int64_t from, int64_t to) {
  for (int64_t grp = 1; grp < groups; ++grp) {
    const float *src = partials + (grp - 1) * stride;
    for (int64_t x = from; x < to; ++x) dq[x] += src[x];
  }
}

// dK, dV of the key chunks of group g of (b, hk), and group g's dQ partial of its heads
// (dq_group: the group's (B, H, T, D) partial, dQ's own layout).
void backward_group(const Args &a, const Grads &g, const BackOperands &ops, int64_t b,
                    int64_t hk, int64_t grp, int64_t groups, float *dq_group, BackScratch &w,
                    double *dgrad) {
  const int64_t heads = a.H / a.HKV;
  if (dgrad) std::fill(dgrad, dgrad + a.mod_ngrad, 0.0);  // this task's partial
  const float *kh = a.k + b * a.sk_b + hk * a.sk_h;
  float *dqs = dq_group + b * a.H * a.T * a.D;  // (H, T, D) of this group
  std::fill(dqs + hk * heads * a.T * a.D, dqs + (hk + 1) * heads * a.T * a.D, 0.0f);
  for (int64_t ci = grp; ci < ops.chunks; ci += groups) {
    const int64_t n = std::min<int64_t>(KC, a.S - ci * KC);  // keys of the chunk
    std::fill(w.dk.begin(), w.dk.end(), 0.0f);
    std::fill(w.dv.begin(), w.dv.end(), 0.0f);
    for (int64_t h = hk * heads; h < (hk + 1) * heads; ++h) {
      const float *qh = a.q + b * a.sq_b + h * a.sq_h;
      const float *doh = g.dout + (b * a.H + h) * a.T * a.DV;
      float *dqh = dqs + h * a.T * a.D;
      for (int64_t i0 = 0; i0 < a.T; i0 += a.bq) {
        const int64_t i1 = std::min(a.T, i0 + a.bq);
        for_each_chunk(a, b, h, i0, i1, ci, ci, w.keep.data(), [&](const Chunk &c) {
          weights_and_ds(a, g, ops, b, h, i0, c, w, dgrad);
#if defined(ATTNKIT_BF16)
          if (a.dtype == DT_BF16) {
            products_bf16(a, g, ops, b, h, hk, i0, c, dqh, w);
            return;
          }
#endif
          const int64_t nr = c.r1 - c.r0, nk = c.hi - c.lo;
          // dV[j] += sum_r P[r][j] dO[r], dK[j] += sum_r dS[r][j] Q[r]
          simd::gemm_t(w.dv.data() + c.lo * a.DV, a.DV, nk, a.DV, w.p.data() + c.r0 * KC + c.lo,
                       KC, doh + (i0 + c.r0) * a.DV, a.DV, nr);
          simd::gemm_t(w.dk.data() + c.lo * a.D, a.D, nk, a.D, w.ds.data() + c.r0 * KC + c.lo,
                       KC, qh + (i0 + c.r0) * a.sq_t, a.sq_t, nr);
          // dQ[r] += sum_j dS[r][j] K[j]
          simd::gemm<true>(dqh + (i0 + c.r0) * a.D, a.D, nr, a.D,
                           w.ds.data() + c.r0 * KC + c.lo, KC, 1, kh + (c.c0 + c.lo) * a.sk_t,
                           a.sk_t, nk, nullptr);
        });
      }
    }
    std::copy(w.dk.begin(), w.dk.begin() + n * a.D, g.dk + ((b * a.HKV + hk) * a.S + ci * KC) * a.D);
    std::copy(w.dv.begin(), w.dv.begin() + n * a.DV,
              g.dv + ((b * a.HKV + hk) * a.S + ci * KC) * a.DV);
  }
}

Code check(const Args &a) {
  if (a.D <= 0 || a.DV <= 0 || a.DV % 16 || a.bq <= 0 || a.HKV <= 0 || a.H % a.HKV ||
      a.B <= 0 || a.T <= 0 || a.S <= 0 || a.threads <= 0)
    return BAD_SHAPE;
  if (a.bm_kind && a.bq != a.bm_qb) return BAD_BLOCK_ROWS;
  if (a.dtype != DT_F32 && a.dtype != DT_BF16) return BAD_DTYPE;
  if (a.key_lens && (!a.pages || !direct_keys(a))) return BAD_SHAPE;
  if (a.mask_c0 < 0 || a.mask_c0 > a.S || (a.mask_c0 && !a.mask)) return BAD_SHAPE;
  if (!a.pages) return OK;
  if (a.page_size <= 0 || a.num_pages <= 0) return BAD_SHAPE;
  for (int64_t b = 0; b < a.B; ++b) {  // the pages row b reads: ids of the pool
    const int64_t keys = a.key_lens ? a.key_lens[b] : a.S;
    if (keys < 0 || keys > a.S) return BAD_SHAPE;
    for (int64_t n = 0; n * a.page_size < keys; ++n) {
      const int64_t id = a.pages[b * a.pages_sb + n];
      if (id < 0 || id >= a.num_pages) return BAD_PAGE;
    }
  }
  return OK;
}

// Exceptions thrown by the caller's own thread (allocations before the parallel part).
template <class F>
int guarded(F f) {
  const TileScope tiles;  // (the calling thread's products outside parallel calls)
  try {
    return f();
  } catch (const std::bad_alloc &) {
    return NO_MEMORY;
  } catch (const std::system_error &) {
    return NO_THREAD;
  } catch (...) {
    return INTERNAL;
  }
}

constexpr int64_t KEYS16_MAX_D = 256;  // head sizes whose 8 rows the packing's scratch holds

// The keys of a Bf16InPlace packed as float32 (transposed, as pack's): each chunk's rows
// converted 8 at a time into a scratch that stays in L1 and transposed from there, so
// the keys are read once, in bf16, instead of converted into a float32 copy first.
Code pack_keys16(const Args &a, const Bf16InPlace &k16, Packed<float> &pk) {
  pk.chunks = (a.S + KC - 1) / KC;
  pk.depth = a.D;
  pk.t.reset(size_t(a.B * a.HKV * pk.chunks * a.D * KC));
  return parallel<NoState>(a, a.B * a.HKV * pk.chunks, [&](NoState &, int64_t it) {
    const int64_t ci = it % pk.chunks, bh = it / pk.chunks;
    const uint16_t *src = k16.k + (bh / a.HKV) * k16.sb + (bh % a.HKV) * k16.sh;
    alignas(64) float scratch[8 * KEYS16_MAX_D];
    auto row = [&](int64_t j) -> const float * {  // (pack_chunk reads 8 rows at a time)
      const int64_t key = ci * KC + j;
      if (key >= a.S) return nullptr;
      const uint16_t *r = src + key * k16.st;
      float *dst = scratch + (j % 8) * a.D;
      chunk_rows_f32(r, 0, 1, a.D, dst);
      return dst;
    };
    pack_chunk<float, transposed>(a.D, row, pk.t.get() + it * a.D * KC);
  });
}

// Whether one query block per (batch, kv head) reads its keys and values: no GQA, and at
// most one block of rows (pack_forward's "pack in item", read_as_float32's values in place).
inline bool one_block_reads(const Args &a) { return a.H == a.HKV && a.T <= a.bq; }

// The keys and values a forward reads, packed (per call, or per sequence of a varlen call;
// k16: bf16 keys to convert as they are packed, see Bf16InPlace).
Code pack_forward(const Args &a, Operands &ops, const Bf16InPlace *k16 = nullptr) {
  // a decode step: keys and values read in place (contiguous or through the page table),
  // bf16 ones on every build (converted as read: direct_scores, decode_pv)
  if (direct_keys(a)) {
    ops.direct = true;
    ops.kt.chunks = (a.S + KC - 1) / KC;
    return OK;
  }
  // (feature "pack in item") where one query block per (batch, kv head) reads the keys (a
  // cascade's or a draft tree's stacked rows against the cache, a short MHA prefill, a
  // varlen call's short sequences), each chunk is read by one work item alone: that item
  // packs it into its scratch just before the product, where it stays in L1, instead of a
  // parallel pass writing every chunk out and the items reading it back (bf16: the keys
  // and the values). A cascade decode step (8 x 32 rows against 2048 keys, 2 threads of
  // a Zen 4 on torch's OpenMP threads, C ABI, interleaved A/B in both orders) took
  // 0.93-0.94x the time in bf16 and 0.98-1.00x in fp32, a 32-node draft tree's and a
  // 128-token MHA prefill's 0.99-1.00x; the bits are the same.
  const bool one_reader = one_block_reads(a);
  if (a.dtype == DT_BF16) {
#if defined(ATTNKIT_BF16)
    if (a.D % 2) return BAD_SHAPE;
    if (one_reader) {
      ops.in_item = true;
      ops.kp.chunks = (a.S + KC - 1) / KC;
      return OK;
    }
    if (Code err = pack(a, a.k, a.sk_b, a.sk_h, a.sk_t, a.D, dim_pairs, ops.kp)) return err;
    return pack(a, a.v, a.sv_b, a.sv_h, a.sv_t, a.DV, key_pairs, ops.vp);
#else
    return BAD_DTYPE;  // packing bf16 needs bf16 products
#endif
  }
  // (feature "bf16 in item", builds without bf16 products) bf16 keys and values read by
  // one block alone are converted to float32 rows by that block, a chunk at a time just
  // before its products (forward_block), where they stay in L1: the keys then go the
  // float32 way (transposed in item, or read as rows by keys as rows) and P V reads float32
  // values, instead of every key converted in a parallel pass first and each value vector
  // widened again by every register tile of rows. The same bits (bf16 to float32 is exact,
  // and the products run as on the packed copies). On the Xeon of sessions 26-36 (AVX2
  // build, 2 threads): a cascade decode step of 8 requests over 2048 shared keys 405 ->
  // 289 us (float32: 273), a 32-node draft tree over 2048 keys 996 -> 808 us (765).
  if (k16) {
    if (k16->values) {  // (left in place for their one reader: read_as_float32)
      ops.in_item = true, ops.k16 = k16;
      ops.kt.chunks = (a.S + KC - 1) / KC;
      return OK;
    }
    return pack_keys16(a, *k16, ops.kt);
  }
  if (one_reader) {
    ops.in_item = true;
    ops.kt.chunks = (a.S + KC - 1) / KC;
    return OK;
  }
  return pack(a, a.k, a.sk_b, a.sk_h, a.sk_t, a.D, transposed, ops.kt);
}

// ---------------------------------------------------------------------------------------
// Split-KV decoding (feature "varlen"). A call with few query blocks (a decode step: one
// or a few queries against a long cache) has fewer work items than cores: its key chunks
// are cut into `splits` ranges, each (batch, head, query block, range) is one work item
// normalised over its own keys, and the partial rows are merged by their log-sum-exps in
// range order (merge_parts: the merge of backends/blockwise/merge.py). The number
// of ranges depends on the shapes alone, never on the threads: every thread count gives
// the same bits.
// ---------------------------------------------------------------------------------------

constexpr int64_t SPLIT_ITEMS = 32;        // work items a split call aims at
constexpr int64_t SPLIT_MIN_CHUNKS = 16;   // key chunks per range at least (1024 keys)
constexpr int64_t SPLIT_MERGE_ALONE = 1 << 16;  // (cascade_call) floats its caller merges alone

int64_t kv_splits(const Args &a, int64_t work, int64_t chunks) {
  int64_t splits = a.kv_splits;
  if (splits <= 0)
    splits = work >= SPLIT_ITEMS ? 1 : std::min((SPLIT_ITEMS + work - 1) / work, chunks / SPLIT_MIN_CHUNKS);
  return std::max<int64_t>(1, std::min(splits, chunks));
}

// The kernel's one merge (backends/blockwise/merge.py's, for any number of partials): the
// row `o` (DV floats) and its log-sum-exp `*lse` from `parts` partial rows, part r's row
// part_out(r), normalised over its own keys, with log-sum-exp part_lse(r); the parts are
// read in their order (the order of their keys), so the bits do not depend on which thread
// merges. A part with lse -inf (no key) adds nothing; none with a key gives zeros and
// -inf; a NaN lse gives a NaN row. `o` may be one of the parts' rows: each element is
// read from every part before it is written. (Split-KV ranges, forward_split; a
// cascade's prefix and suffix passes, cascade_call.)
template <class PartOut, class PartLse>
void merge_parts(int64_t parts, PartOut part_out, PartLse part_lse, int64_t DV, float *o,
                 float *lse) {
  constexpr int64_t MOST = 32;  // parts weighed on the stack (more: Args.kv_splits asked so)
  float few[MOST];
  std::vector<float> many(parts > MOST ? size_t(parts) : 0);
  float *e = parts > MOST ? many.data() : few;
  float m = NEG_INF;
  bool nan = false;
  for (int64_t r = 0; r < parts; ++r) {
    const float x = part_lse(r);
    nan |= std::isnan(x);
    m = std::max(m, x);
  }
  if (nan || m == NEG_INF) {  // a NaN stays NaN; no key anywhere: zeros and -inf
    const float fill = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    std::fill(o, o + DV, fill);
    *lse = nan ? fill : NEG_INF;
    return;
  }
  float l = 0.0f;
  for (int64_t r = 0; r < parts; ++r) l += (e[r] = std::exp(part_lse(r) - m));  // 0: empty
  const float inv = 1.0f / l;
  constexpr int64_t SPAN = 64;  // elements summed at once (every part read, then o written)
  for (int64_t d0 = 0; d0 < DV; d0 += SPAN) {
    const int64_t n = std::min(SPAN, DV - d0);
    float sum[SPAN] = {};
    for (int64_t r = 0; r < parts; ++r) {
      if (e[r] == 0.0f) continue;
      const float *src = part_out(r) + d0, er = e[r];
      for (int64_t d = 0; d < n; ++d) sum[d] += er * src[d];
    }
    for (int64_t d = 0; d < n; ++d) o[d0 + d] = sum[d] * inv;
  }
  *lse = m + std::log(l);
}

// Row i of (b, h) merged from the ranges' partial rows (po: each range's (B, H, T, DV),
// pl: their lse (B, H, T)) into a.out and a.lse, in range order.
void merge_row(const Args &a, int64_t splits, const float *po, const float *pl, int64_t b,
               int64_t h, int64_t i) {
  const int64_t rows = a.B * a.H * a.T, row = (b * a.H + h) * a.T + i;
  merge_parts(
      splits, [&](int64_t r) { return po + (r * rows + row) * a.DV; },
      [&](int64_t r) { return pl[r * rows + row]; }, a.DV,
      a.out + b * a.so_b + h * a.so_h + i * a.so_t, a.lse + row);
}

// (feature "merge in item") Each unit of work (a batch row's heads and query block) is
// merged by the item that finishes its last range, on that item's thread, right after
// it: the units' merges run on every thread, beside other items, where one pass after
// them all ran on the caller alone while the other threads waited. A 32-node draft
// tree's call (2 x 128 stacked rows against 2080 keys, 2 ranges) took 0.99x the time on
// 2 threads (C ABI, four interleaved A/B runs, session 32's Xeon), 1.00x on 1; a decode
// step over 16384 keys 1.00x. Which thread merges a unit does not change its bits:
// merge_row reads the ranges in range order.
Code forward_split(const Args &a, const Operands &ops, int64_t nq, int64_t splits) {
  const int64_t hg = walk_heads(a, splits * a.B * nq), groups = a.H / hg;
  const int64_t chunks = ops.chunks(), work = a.B * groups * nq, rows = a.B * a.H * a.T;
  reuse::Buffer<float> po(size_t(splits * rows * a.DV)), pl(size_t(splits * rows));
  std::vector<Args> part(splits, a);  // range r writes its rows to po, pl (B, H, T[, DV])
  for (int64_t r = 0; r < splits; ++r) {
    part[r].out = po.get() + r * rows * a.DV;
    part[r].so_b = a.H * a.T * a.DV, part[r].so_h = a.T * a.DV, part[r].so_t = a.DV;
    part[r].lse = pl.get() + r * rows;
  }
  // ranges of each unit done so far (acq_rel: the unit's last item sees the others' rows)
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[size_t(work)]());
  auto finished = [&](int64_t u, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1) {
    if (done[u].fetch_add(1, std::memory_order_acq_rel) != splits - 1) return;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t i = i0; i < i1; ++i)
        merge_row(a, splits, po.get(), pl.get(), b, h, i);
  };
  if (hg > 1)
    return parallel<HeadsScratch>(a, splits * work, [&](HeadsScratch &w, int64_t it) {
      const int64_t r = it / work, bg = it % work, h0 = (bg % groups) * hg;
      forward_heads(part[r], bg / groups, h0, h0 + hg, 0, a.T, w, r * chunks / splits,
                    (r + 1) * chunks / splits - 1);
      finished(bg, bg / groups, h0, h0 + hg, 0, a.T);
    });
  return parallel<Scratch>(a, splits * work, [&](Scratch &w, int64_t it) {
    const int64_t r = it / work, qi = (it % work) % nq, bh = (it % work) / nq;
    const int64_t i0 = qi * a.bq, i1 = std::min(a.T, i0 + a.bq);
    forward_block(part[r], ops, bh / a.H, bh % a.H, i0, i1, w, r * chunks / splits,
                  (r + 1) * chunks / splits - 1);
    finished(it % work, bh / a.H, bh % a.H, bh % a.H + 1, i0, i1);
  });
}

// (feature "group rows") A GQA decode step of one query per head whose rows nothing tells
// apart but their head: the g query heads of each kv head become g rows of one block
// (rows head by head: row stride sq_h, out's so_h, lse's (B, H, 1) order unchanged), so
// each key and value is read once for its whole group, not once per query head. Taken
// only where no row-dependent rule could see the difference: no mask tensor, block mask,
// generated mask or score_mod, no relative bias, no varlen sequences, and a band that
// keeps every key for every folded row (row r of the group sits at offset r of the band).
Args group_rows(const Args &a) {
  const int64_t g = a.H / a.HKV;
  if (a.T != 1 || g == 1 || a.nseq > 0 || a.mask || a.bm_kind || a.mask_row || a.mod_forward ||
      a.rel || a.band_lo > -(g - 1) || a.band_hi < a.S - 1)
    return a;
  Args f = a;
  f.H = a.HKV, f.T = g;
  f.sq_t = a.sq_h, f.sq_h = g * a.sq_h;
  f.so_t = a.so_h, f.so_h = g * a.so_h;
  return f;
}

// One forward call (B, H, T) x (B, HKV, S): pack, then (batch, head, query block) items,
// or split-KV items where those are too few.
Code forward_call(const Args &a_, const Bf16InPlace *k16 = nullptr) {
  const Args a = group_rows(a_);
  Operands ops;
  if (Code err = pack_forward(a, ops, k16)) return err;
  const int64_t nq = (a.T + a.bq - 1) / a.bq;  // query blocks per (batch, head)
  const int64_t splits = kv_splits(a, a.B * a.H * nq, ops.chunks());
  if (splits > 1) return forward_split(a, ops, nq, splits);
  const int64_t hg = walk_heads(a, a.B * nq), groups = a.H / hg;  // (walked: nq 1)
  if (hg > 1)
    return parallel<HeadsScratch>(a, a.B * groups, [&](HeadsScratch &w, int64_t it) {
      const int64_t h0 = (it % groups) * hg;
      forward_heads(a, it / groups, h0, h0 + hg, 0, a.T, w, 0, ops.chunks() - 1);
    });
  // (kfwd) a head's last query blocks first: under a causal band they see the most keys,
  // so the threads end on the cheapest items, not one on the dearest
  return parallel<Scratch>(a, a.B * a.H * nq, [&](Scratch &w, int64_t it) {
    const int64_t qi = nq - 1 - it % nq, bh = it / nq;
    const int64_t i0 = qi * a.bq, i1 = std::min(a.T, i0 + a.bq);
    forward_block(a, ops, bh / a.H, bh % a.H, i0, i1, w, 0, ops.chunks() - 1);
  });
}

// The keys and values a backward reads, packed (per call, or per sequence of a varlen call).
Code pack_backward(const Args &a, BackOperands &ops) {
  if (a.dtype == DT_BF16) {
#if defined(ATTNKIT_BF16)
    if (Code err = pack(a, a.k, a.sk_b, a.sk_h, a.sk_t, a.D, dim_pairs, ops.kp)) return err;
    if (Code err = pack(a, a.v, a.sv_b, a.sv_h, a.sv_t, a.DV, dim_pairs, ops.vp)) return err;
    if (Code err = pack(a, a.k, a.sk_b, a.sk_h, a.sk_t, a.D, key_pairs, ops.kj)) return err;
    ops.chunks = ops.kp.chunks;
#else
    return BAD_DTYPE;
#endif
  } else {
    if (Code err = pack(a, a.k, a.sk_b, a.sk_h, a.sk_t, a.D, transposed, ops.kt)) return err;
    if (Code err = pack(a, a.v, a.sv_b, a.sv_h, a.sv_t, a.DV, transposed, ops.vt)) return err;
    ops.chunks = ops.kt.chunks;
  }
  return OK;
}

// The backward of one call (see the file's head).
Code backward_call(const Args &a, const Grads &g) {
  BackOperands ops;
  if (Code err = pack_backward(a, ops)) return err;
  const int64_t groups = key_groups(a, ops.chunks);
  const int64_t stride = a.B * a.H * a.T * a.D;  // floats of a group's partial
  reuse::Buffer<float> dq_part(size_t((groups - 1) * stride));  // groups 1.. (0: in dq)
  const int64_t tasks = a.B * a.HKV * groups;
  const int64_t ngrad = a.mod_backward && a.mod_dgrad ? a.mod_ngrad : 0;
  std::unique_ptr<double[]> dgrad_part(ngrad ? new double[tasks * ngrad] : nullptr);
  Code err = parallel<BackScratch>(a, tasks, [&](BackScratch &w, int64_t it) {
    const int64_t grp = it % groups, bh = it / groups;
    backward_group(a, g, ops, bh / a.HKV, bh % a.HKV, grp, groups,
                   group_dq(g.dq, dq_part.get(), grp, stride), w,
                   ngrad ? dgrad_part.get() + it * ngrad : nullptr);
  });
  if (err) return err;
  if (ngrad) {  // a compiled score_mod's captured-tensor gradients: tasks summed in order
    const int64_t per = 4096, n = (ngrad + per - 1) / per;
    err = parallel<NoState>(a, n, [&](NoState &, int64_t it) {
      const int64_t from = it * per, to = std::min(ngrad, from + per);
      for (int64_t x = from; x < to; ++x) {
        double total = 0.0;
        for (int64_t t = 0; t < tasks; ++t) total += dgrad_part[t * ngrad + x];
        a.mod_dgrad[x] = total;
      }
    });
    if (err) return err;
  }
  // dQ = the groups' partials summed in group order (group 0's is in dq), rows in parallel
  if (groups == 1) return OK;
  const int64_t rows = a.B * a.H * a.T, per = 256, n = (rows + per - 1) / per;
  return parallel<NoState>(a, n, [&](NoState &, int64_t it) {
    const int64_t from = it * per * a.D, to = std::min(rows, (it + 1) * per) * a.D;
    sum_partials(g.dq, dq_part.get(), groups, stride, from, to);
  });
}

// ---------------------------------------------------------------------------------------
// Packed variable-length batches (feature "varlen"; Args.nseq > 0). Sequence n is an
// ordinary call of its own (B = 1, T = len_q, S = len_k, pointers moved to its first token,
// the band shifted by its alignment): the kernel never reads another sequence's keys.
// ---------------------------------------------------------------------------------------

Code check_varlen(const Args &a) {
  if (a.D <= 0 || a.DV <= 0 || a.DV % 16 || a.bq <= 0 || a.HKV <= 0 || a.H % a.HKV ||
      a.B != 1 || a.threads <= 0 || !a.cu_q || !a.cu_k || a.bm_kind || a.mask)
    return BAD_SHAPE;
  if (a.dtype != DT_F32 && a.dtype != DT_BF16) return BAD_DTYPE;
  for (int64_t n = 0; n < a.nseq; ++n)
    if (a.cu_q[n + 1] < a.cu_q[n] || a.cu_k[n + 1] < a.cu_k[n]) return BAD_SHAPE;
  return OK;
}

template <class T>
T *moved(T *p, int64_t elements, int64_t elem_bytes) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T *>(reinterpret_cast<Byte *>(p) + elements * elem_bytes);
}

// Sequence n of a varlen call as a call of its own.
Args sequence(const Args &a, int64_t n) {
  Args s = a;
  const int64_t q0 = a.cu_q[n], k0 = a.cu_k[n], el = a.dtype == DT_BF16 ? 2 : 4;
  s.T = a.cu_q[n + 1] - q0;
  s.S = a.cu_k[n + 1] - k0;
  s.q = moved(a.q, q0 * a.sq_t, el);
  s.k = moved(a.k, k0 * a.sk_t, el);
  s.v = moved(a.v, k0 * a.sv_t, el);
  if (a.out) s.out = a.out + q0 * a.so_t;
  s.lse = a.lse + a.H * q0;
  const int64_t shift = a.varlen_align ? s.S - s.T : 0;
  s.band_lo += shift;
  s.band_hi += shift;
  s.nseq = 0;
  s.kv_splits = 1;
  return s;
}

Code forward_varlen(const Args &a) {
  std::vector<Args> seq(a.nseq);
  std::vector<Operands> ops(a.nseq);
  std::vector<int64_t> first(a.nseq + 1, 0);  // the first work item of each sequence
  for (int64_t n = 0; n < a.nseq; ++n) {
    seq[n] = sequence(a, n);
    first[n + 1] = first[n] + a.H * ((seq[n].T + a.bq - 1) / a.bq);
  }
  // the sequences' keys packed side by side, each on one thread (many short sequences
  // would otherwise cost a parallel call each)
  std::atomic<int> packed{OK};
  if (Code err = parallel<NoState>(a, a.nseq, [&](NoState &, int64_t n) {
        Args one = seq[n];
        one.threads = 1;
        if (Code e = pack_forward(one, ops[n])) packed = e;
      }))
    return err;
  if (packed.load() != OK) return Code(packed.load());
  return parallel<Scratch>(a, first[a.nseq], [&](Scratch &w, int64_t it) {
    const int64_t n = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
    const Args &s = seq[n];
    const int64_t nq = (s.T + a.bq - 1) / a.bq, at = it - first[n];
    const int64_t i0 = (at % nq) * a.bq, i1 = std::min(s.T, i0 + a.bq);
    forward_block(s, ops[n], 0, at / nq, i0, i1, w, 0, ops[n].chunks() - 1);
  });
}

// As forward_varlen: every sequence's keys packed in one parallel call, then one call over
// the (sequence, kv head, key group) items, then the dQ partials summed in group order;
// the groups of a sequence depend on its shapes alone.
Code backward_varlen(const Args &a, const Grads &g) {
  const int64_t n = a.nseq, el = a.dtype == DT_BF16 ? 2 : 4;
  std::vector<Args> seq(n);
  std::vector<Grads> grads(n);
  std::vector<BackOperands> ops(n);
  for (int64_t i = 0; i < n; ++i) {
    seq[i] = sequence(a, i);
    const int64_t q0 = a.cu_q[i], k0 = a.cu_k[i];
    grads[i] = Grads{moved(g.dout, a.H * q0 * a.DV, el), g.delta + a.H * q0,
                     g.dq + a.H * q0 * a.D, g.dk + a.HKV * k0 * a.D, g.dv + a.HKV * k0 * a.DV};
  }
  std::atomic<int> packed{OK};
  if (Code err = parallel<NoState>(a, n, [&](NoState &, int64_t i) {
        Args one = seq[i];
        one.threads = 1;
        if (Code e = pack_backward(one, ops[i])) packed = e;
      }))
    return err;
  if (packed.load() != OK) return Code(packed.load());
  // per sequence: its groups, its first work item, its dQ partials' offset and row blocks
  constexpr int64_t PER = 256;  // dQ rows summed per item
  std::vector<int64_t> groups(n), first(n + 1, 0), part(n + 1, 0), rows_first(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t rows = a.H * seq[i].T;
    groups[i] = key_groups(seq[i], ops[i].chunks);
    first[i + 1] = first[i] + a.HKV * groups[i];
    part[i + 1] = part[i] + (groups[i] - 1) * rows * a.D;  // (group 0's: in dq)
    rows_first[i + 1] = rows_first[i] + (rows + PER - 1) / PER;
  }
  reuse::Buffer<float> dq_part(size_t(part[n]));
  auto which = [](const std::vector<int64_t> &starts, int64_t it) {
    return int64_t(std::upper_bound(starts.begin(), starts.end(), it) - starts.begin() - 1);
  };
  Code err = parallel<BackScratch>(a, first[n], [&](BackScratch &w, int64_t it) {
    const int64_t i = which(first, it), at = it - first[i];
    const int64_t grp = at % groups[i], stride = a.H * seq[i].T * a.D;
    backward_group(seq[i], grads[i], ops[i], 0, at / groups[i], grp, groups[i],
                   group_dq(grads[i].dq, dq_part.get() + part[i], grp, stride), w, nullptr);
  });
  if (err) return err;
  return parallel<NoState>(a, rows_first[n], [&](NoState &, int64_t it) {
    const int64_t i = which(rows_first, it), block = it - rows_first[i];
    const int64_t rows = a.H * seq[i].T, stride = rows * a.D;
    const int64_t from = block * PER * a.D, to = std::min(rows, (block + 1) * PER) * a.D;
    sum_partials(grads[i].dq, dq_part.get() + part[i], groups[i], stride, from, to);
  });
}

// (feature "bf16 read") A bf16 forward on a build without bf16 products, other than a
// decode step (which reads bf16 where it lies): q is converted to float32 once, into the
// call's reused buffers; the keys as they are packed, or where one block reads them,
// keys and values a chunk at a time by that block ("bf16 in item"); other values here
// (Bf16InPlace; a varlen or paged call's keys and values, or heads over KEYS16_MAX_D,
// converted here, through the page table where there is one), and the float32 path runs
// on them. The same numbers as the caller's upcast before, without its three fresh
// tensors a call (and the page faults of their memory). Every conversion runs a vector at
// a time (chunk_rows_f32: a scalar loop here left a causal bf16 forward at T=4096 on AVX2
// 9% slower than float32, 1-3% now).
// The S bf16 keys (or values) of (b, hk), as float32 rows at dst, contiguous; read in runs
// (a page's, where they are paged).
template <Side SIDE>
void rows_as_float32(const Args &a, int64_t b, int64_t hk, float *dst) {
  const int64_t depth = SIDE == KEYS ? a.D : a.DV, st = SIDE == KEYS ? a.sk_t : a.sv_t;
  for (int64_t j = 0, n = 0; j < a.S; j += n) {
    const uint16_t *src = kv_run<uint16_t, SIDE>(a, b, hk, j, a.S, n);
    chunk_rows_f32(src, st, n, depth, dst + j * depth);
  }
}

template <class Run>
Code read_as_float32(const Args &a, Run run) {
#if defined(ATTNKIT_BF16)
  return run(a, nullptr);
#else
  if (a.dtype != DT_BF16 || (a.nseq == 0 && direct_keys(a))) return run(a, nullptr);
  // A plain call's keys are converted as they are packed (Bf16InPlace: read once, in bf16);
  // a varlen or paged call's here, with its queries and values.
  const bool keys_as_packed = a.nseq == 0 && !a.pages && a.D <= KEYS16_MAX_D;
  const bool values_in_place = keys_as_packed && one_block_reads(a);
  const Bf16InPlace k16{reinterpret_cast<const uint16_t *>(a.k), a.sk_b, a.sk_h, a.sk_t,
                   values_in_place};
  reuse::Buffer<float> q(size_t(a.B * a.H * a.T * a.D)),
      k(keys_as_packed ? 0 : size_t(a.B * a.HKV * a.S * a.D)),
      v(values_in_place ? 0 : size_t(a.B * a.HKV * a.S * a.DV));
  Args f = a;
  f.dtype = DT_F32;
  f.q = q.get(), f.sq_b = a.H * a.T * a.D, f.sq_h = a.T * a.D, f.sq_t = a.D;
  if (!keys_as_packed)
    f.k = k.get(), f.sk_b = a.HKV * a.S * a.D, f.sk_h = a.S * a.D, f.sk_t = a.D;
  if (!values_in_place)
    f.v = v.get(), f.sv_b = a.HKV * a.S * a.DV, f.sv_h = a.S * a.DV, f.sv_t = a.DV;
  f.pages = nullptr, f.pages_sb = f.page_size = f.sk_page = f.sv_page = 0;
  const uint16_t *q16 = reinterpret_cast<const uint16_t *>(a.q);
  Code err = parallel<NoState>(a, a.B * a.H, [&](NoState &, int64_t bh) {
    const uint16_t *src = q16 + (bh / a.H) * a.sq_b + (bh % a.H) * a.sq_h;
    float *dst = q.get() + bh * a.T * a.D;
    chunk_rows_f32(src, a.sq_t, a.T, a.D, dst);
  });
  if (err) return err;
  if (!values_in_place) {
    err = parallel<NoState>(a, a.B * a.HKV, [&](NoState &, int64_t bh) {
      const int64_t b = bh / a.HKV, hk = bh % a.HKV;
      if (!keys_as_packed) rows_as_float32<KEYS>(a, b, hk, k.get() + bh * a.S * a.D);
      rows_as_float32<VALUES>(a, b, hk, v.get() + bh * a.S * a.DV);
    });
    if (err) return err;
  }
  return run(f, keys_as_packed ? &k16 : nullptr);
#endif
}

// ---------------------------------------------------------------------------------------
// Shared-prefix cascades (feature "cascade"; attnkit.cascade_attention): n requests of t
// queries each over a prefix of keys they share and a suffix of their own, in one call.
// The prefix pass stacks every request's rows (and a GQA group's g heads) against the
// shared keys, `pre` = (1, HKV, n g t) x (1, HKV, p) (its rows gathered here from the
// suffix pass's queries: `pre.q` and its strides are not read), its partial rows kept here; the
// suffix pass is an ordinary call, `suf` = (n, H, t) x (n, HKV, s), writing the caller's
// out and lse; then each row of out is merged with its prefix partial by their
// log-sum-exps (merge_parts, split-KV's merge: the prefix's partial first, as its keys
// come first; until session 34 a two-way merge of its own). One call: no partial crosses
// the boundary, and the caller makes one call, not two dispatches and a merge of its own.
// ---------------------------------------------------------------------------------------

// Checks the two passes fit together: `suf` the (n, H, t) call, `pre` the stacked rows.
Code check_cascade(const Args &pre, const Args &suf) {
  if (Code bad = check(pre)) return bad;
  if (Code bad = check(suf)) return bad;
  if (pre.nseq || suf.nseq || pre.pages || suf.pages || pre.B != 1 || pre.H != pre.HKV ||
      pre.HKV != suf.HKV || pre.T != suf.B * (suf.H / suf.HKV) * suf.T || pre.DV != suf.DV ||
      pre.dtype != suf.dtype)
    return BAD_SHAPE;
  return OK;
}

Code cascade_call(const Args &pre_, const Args &suf) {
  const int64_t n = suf.B, H = suf.H, t = suf.T, g = H / suf.HKV, DV = suf.DV, D = suf.D;
  const int64_t rows = n * H * t;  // (= HKV x pre.T, the prefix pass's rows)
  // (feature "cascade rows") The prefix pass's rows are gathered here from the query
  // (suf.q, read with suf's strides; pre.q is not read): row (r g + j) t + i of kv head
  // hk is query row (r, hk g + j, i). One copy of n H t rows in C instead of the caller's
  // reshape, permute and reshape (14 us of a 300 us decode cascade of 8 requests, fp32).
  const int64_t elem = suf.dtype == DT_BF16 ? 2 : 4;
  reuse::Buffer<char> stacked{size_t(rows * D * elem)};
  const char *q = reinterpret_cast<const char *>(suf.q);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < t; ++i)
        std::memcpy(stacked.get() + ((h / g) * pre_.T + (r * g + h % g) * t + i) * D * elem,
                    q + (r * suf.sq_b + h * suf.sq_h + i * suf.sq_t) * elem, size_t(D * elem));
  reuse::Buffer<float> po{size_t(rows * DV)}, pl{size_t(rows)};
  Args pre = pre_;  // its rows gathered above; its partial rows here, (1, HKV, n g t, DV)
  pre.q = reinterpret_cast<const float *>(stacked.get());
  pre.sq_b = rows * D, pre.sq_h = pre.T * D, pre.sq_t = D;
  pre.out = po.get(), pre.so_b = rows * DV, pre.so_h = pre.T * DV, pre.so_t = DV;
  pre.lse = pl.get();
  if (Code err = read_as_float32(pre, forward_call)) return err;
  if (Code err = read_as_float32(suf, forward_call)) return err;
  Args merge = suf;  // few rows (a decode step): merged on this thread, no other woken
  if (rows * DV < SPLIT_MERGE_ALONE) merge.threads = 1;
  return parallel<NoState>(merge, rows, [&](NoState &, int64_t row) {
    const int64_t r = row / (H * t), h = (row / t) % H, i = row % t;  // suf's (b, h, i)
    const int64_t at = (h / g) * pre.T + (r * g + h % g) * t + i;     // its prefix row
    float *o = suf.out + r * suf.so_b + h * suf.so_h + i * suf.so_t;
    const float *op = po.get() + at * DV;  // the prefix's partial row, then the suffix's
    merge_parts(
        2, [&](int64_t part) -> const float * { return part == 0 ? op : o; },
        [&](int64_t part) { return part == 0 ? pl[at] : suf.lse[row]; }, DV, o, suf.lse + row);
  });
}

}  // namespace

// (feature "own out") A forward whose caller wants its output in bf16 (Args.out16) or no
// log-sum-exps (lse null) runs into buffers of its own (out contiguous (B, H, T, DV),
// lse (B, H, T)), and the output is then rounded into out16: what torch's `.to(bfloat16)`
// gives (to nearest even; NaN as 0x7FC0), without the caller's float32 output, its lse
// and the cast (three tensor ops of a decode step, each several microseconds after the
// kernel's reads have pushed the interpreter's data out of the caches).
inline uint16_t bf16_of(float x) {
  if (x != x) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

template <class Run>
int own_out(const Args &a, Run run) {
  if (!a.out16 && a.lse) return int(run(a));
  Args f = a;
  const int64_t rows = a.B * a.H * a.T;
  reuse::Mem out, lse;  // (the buffers the caller did not give)
  if (a.out16) {
    size_t bytes = std::max<size_t>(1, size_t(rows * a.DV) * sizeof(float));  // (malloc(0))
    out = reuse::allocate(bytes);
    f.out = reinterpret_cast<float *>(out.get());
    f.so_b = a.H * a.T * a.DV, f.so_h = a.T * a.DV, f.so_t = a.DV;
  }
  if (!a.lse) {
    size_t bytes = std::max<size_t>(1, size_t(rows) * sizeof(float));
    lse = reuse::allocate(bytes);
    f.lse = reinterpret_cast<float *>(lse.get());
  }
  const Code err = run(f);
  if (err || !a.out16) return int(err);
  for (int64_t r = 0; r < rows; ++r) {  // (b, h, t) of the call's rows
    const float *src = f.out + r * a.DV;
    uint16_t *dst = a.out16 + (r / (a.H * a.T)) * a.so_b + (r / a.T % a.H) * a.so_h +
                    (r % a.T) * a.so_t;
    for (int64_t d = 0; d < a.DV; ++d) dst[d] = bf16_of(src[d]);
  }
  return OK;
}

#define ATTNKIT_EXPORT __attribute__((visibility("default")))

extern "C" {

// The ABI this library was built for: its version, and sizeof(Args), sizeof(Grads).
ATTNKIT_EXPORT int64_t attnkit_abi(int64_t *sizes) {
  sizes[0] = sizeof(Args);
  sizes[1] = sizeof(Grads);
  return ABI_VERSION;
}

// (openmp pool) Run parallel calls on the OpenMP runtime whose GOMP_parallel this is, or
// on the kernel's own pool (null).
ATTNKIT_EXPORT void attnkit_use_gomp(void *gomp_parallel) {
  on_fork();
  g_gomp.store(reinterpret_cast<GompParallel>(gomp_parallel), std::memory_order_release);
}

// The instruction set the library was built for ("avx512-bf16", "avx512", "avx2", "neon").
ATTNKIT_EXPORT const char *attnkit_isa() { return ATTNKIT_ISA; }

// Whether bf16 inputs (Args.dtype = DT_BF16) are computed with bf16 products, forward and
// backward: 1 on avx512-bf16 builds. Other builds take a bf16 forward (read_as_float32).
ATTNKIT_EXPORT int attnkit_bf16() {
#if defined(ATTNKIT_BF16)
  return 1;
#else
  return 0;
#endif
}

ATTNKIT_EXPORT int attnkit_forward(const Args *args) {
  const Args &a = *args;
  if (a.nseq > 0) {
    if (Code bad = check_varlen(a)) return bad;
    auto varlen = [](const Args &f, const Bf16InPlace *) { return forward_varlen(f); };
    return guarded([&] { return own_out(a, [&](const Args &f) { return read_as_float32(f, varlen); }); });
  }
  if (Code bad = check(a)) return bad;
  return guarded([&] { return own_out(a, [](const Args &f) { return read_as_float32(f, forward_call); }); });
}

// A shared-prefix cascade (cascade_call): `suf`'s out and lse receive the whole result.
ATTNKIT_EXPORT int attnkit_cascade(const Args *pre, const Args *suf) {
  if (Code bad = check_cascade(*pre, *suf)) return bad;
  return guarded([&] { return int(cascade_call(*pre, *suf)); });
}

// dq, dk, dv from dout, delta and the forward's lse (Args.lse, +inf on dead rows).
ATTNKIT_EXPORT int attnkit_backward(const Args *args, const Grads *grads) {
  const Args &a = *args;
  const Grads &g = *grads;
  if (a.nseq > 0) {
    if (Code bad = check_varlen(a)) return bad;
    if (a.D % 16) return BAD_HEAD_DIM;
    return guarded([&] { return int(backward_varlen(a, g)); });
  }
  if (Code bad = check(a)) return bad;
  if (a.pages) return PAGED_BACKWARD;
  if (a.D % 16) return BAD_HEAD_DIM;
  return guarded([&] { return int(backward_call(a, g)); });
}

// (feature "skinny linear") y (M, N) = x (M, K) W^T + bias (null: none) for the few rows
// of a decode step, W (N, K) read once, in place (linear.h); rows of x, W and y at strides
// ldx, ldw and ldy floats. The outputs are cut into tasks of COLS; each output is one
// dot product, the same bits on any number of threads.
ATTNKIT_EXPORT int attnkit_linear(const float *x, int64_t ldx, const float *w, int64_t ldw,
                                  const float *bias, float *y, int64_t ldy, int64_t M,
                                  int64_t N, int64_t K, int64_t threads) {
  if (M <= 0 || N <= 0 || K <= 0 || ldx < K || ldw < K || ldy < N || threads <= 0)
    return BAD_SHAPE;
  constexpr int64_t COLS = 16 * linear::NR;  // outputs a task
  Args a{};
  a.threads = threads;
  return guarded([&] {
    return int(parallel<NoState>(a, (N + COLS - 1) / COLS, [&](NoState &, int64_t it) {
      const int64_t n0 = it * COLS;
      linear::columns(x, ldx, w, ldw, bias, y, ldy, M, K, n0, std::min(N, n0 + COLS));
    }));
  });
}

// Bytes the calling thread's cache of call buffers holds (feature "reuse"; for the tests).
ATTNKIT_EXPORT int64_t attnkit_reused_bytes() { return int64_t(reuse::cache().held); }

// Keeps `threads` threads on FMAs for `iters` rounds of CHAINS independent vectors (the
// machine's peak, for the benchmark): returns the flops done.
ATTNKIT_EXPORT double attnkit_fma_probe(int64_t iters, int64_t threads) {
  constexpr int CHAINS = simd::TILE_R * simd::TILE_C;  // as many as the register tile
  Args a{};
  a.threads = std::max<int64_t>(1, threads);
  std::atomic<int64_t> sink{0};
  parallel<NoState>(a, a.threads, [&](NoState &, int64_t) {
    vf acc[CHAINS];
    for (int c = 0; c < CHAINS; ++c) acc[c] = simd::splat(1.0f + c * 1e-3f);
    const vf x = simd::splat(0.999999f), y = simd::splat(1e-7f);
    for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 24
      for (int c = 0; c < CHAINS; ++c) acc[c] = acc[c] * x + y;
    vf total = acc[0];
    for (int c = 1; c < CHAINS; ++c) total += acc[c];
    sink += int64_t(simd::hsum(total));
  });
  return double(a.threads) * double(iters) * CHAINS * W * 2 + double(sink.load()) * 0.0;
}

}  // extern "C"
