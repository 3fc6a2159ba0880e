"""Two versions of the native kernel's forward, timed against each other in one process.

A change to ``attention.cpp`` or ``simd.h`` is worth keeping only if it is faster on the
machine at hand, and a shared machine's noise is larger than most such changes. This
module builds the kernel from each source directory given (each holding
``attention.cpp`` and its headers, ``simd.h``, ``amx.h`` and ``linear.h``; the default
second one is this checkout's), loads them side by side, and times the same causal call (B=1, H=4, d=64) on each round-robin,
straight through the C ABI (no Python planning in the timing). With one thread it times
the calling thread's CPU time, which other processes on the machine do not inflate; with
more, every build runs its parallel calls on torch's OpenMP threads, as the package's own
build does (builds on pools of their own spin against each other).
Every row also gives the FLOP rate as a share of the build's own FMA probe.

Example (main's kernel against this checkout's, AVX2 build, one thread)::

    mkdir -p /tmp/main-native && for f in attention.cpp simd.h amx.h linear.h; do
      git show main:src/attnkit/backends/blockwise/native/$f > /tmp/main-native/$f; done
    python -m attnkit.bench.native_ab /tmp/main-native --isa avx2 --t 4096
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import abi, build, threads

SHAPE = (1, 4, 64)  # (b, h, d)


def load(source_dir: Path, isa: str, out_dir: Path) -> ctypes.CDLL:
    """The kernel built from ``source_dir`` for ``isa`` as the package builds its own
    (compiler, flags, hash, ABI check), loaded."""
    names = ["attention.cpp", *(h.name for h in build.HEADERS)]
    text = b"".join((source_dir / name).read_bytes() for name in names)
    target = out_dir / f"{isa}-{hashlib.sha256(text).hexdigest()[:12]}.so"
    compiler = build._compiler()
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    if not target.exists():
        failed = build._compile(compiler[0], isa, target, source=source_dir / "attention.cpp")
        if failed:
            raise RuntimeError(f"{source_dir}: {failed}")
    lib, why = build._load(target)
    if lib is None:
        raise ValueError(f"{source_dir}: {why}")
    # as the package's own build: its parallel calls on torch's OpenMP threads. (Left on
    # pools of their own, two builds' threads spun against each other on 2 cores and the
    # second build timed 0.5-0.6x the first at T=128 on 2 threads, the same code either way.)
    threads.attach(lib)
    return lib


def _args(q, k, v, out, lse, window: int | None, threads: int) -> abi.Args:
    """A causal call (``window``: keys at most window - 1 back) over ``(b, h, t, d)``, in
    blocks of the package's forward rows (``native.BLOCK_Q``)."""
    b, h, t, d = q.shape
    band_lo = -(2 * t + 1) if window is None else -(window - 1)
    args = abi.Args(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        b, h, h, t, t, d, d, d**-0.5, band_lo, 0, native.BLOCK_Q,
    )  # fmt: skip
    args.threads = threads
    args.dtype = abi.DT_BF16 if q.dtype == torch.bfloat16 else abi.DT_F32
    return args


def compare(
    source_dirs: list[Path],
    isa: str,
    t: int,
    threads: int,
    reps: int,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    backward: bool = False,
) -> list[dict]:
    """One row per source directory: min and median seconds, GFLOP/s (useful pairs only),
    % of the first build's FMA probe, and min seconds over the first directory's.
    ``backward``: time the backward call instead (its FLOPs 2.5x the forward's, as
    flash-attn counts them), from the first build's forward; the bits compared are dQ's."""
    b, h, d = SHAPE
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(b, h, t, d, generator=g).to(dtype) for _ in range(4))
    clock = time.thread_time if threads == 1 else time.perf_counter
    with tempfile.TemporaryDirectory(prefix="attnkit-ab-") as tmp:
        libs = [load(Path(s), isa, Path(tmp)) for s in source_dirs]
        runs: list[tuple] = []
        for lib in libs:
            out, lse = torch.empty(b, h, t, d), torch.empty(b, h, t)
            args = _args(q, k, v, out, lse, window, threads)
            if lib.attnkit_forward(ctypes.byref(args)) != 0:  # (also the warm-up)
                raise RuntimeError(f"the kernel refused the call ({isa})")
            call = functools.partial(lib.attnkit_forward, ctypes.byref(args))
            kept: tuple = (out, lse)  # (the tensors args points into, alive)
            if backward:
                delta = (grad_out.float() * out).sum(-1).contiguous()  # (b, h, t)
                dq, dk, dv = (torch.empty(b, h, t, d) for _ in range(3))
                bargs = _args(q, k, v, out, lse, window, threads)
                bargs.bq = native.backward_block_q(q.dtype)
                grads = abi.Grads(*(x.data_ptr() for x in (grad_out, delta, dq, dk, dv)))
                call = functools.partial(
                    lib.attnkit_backward, ctypes.byref(bargs), ctypes.byref(grads)
                )
                if call() != 0:
                    raise RuntimeError(f"the kernel refused the backward ({isa})")
                kept = (dq, lse, delta, dk, dv, bargs, grads)
            runs.append((call, kept[0], kept))
        times: list[list[float]] = [[] for _ in libs]
        for _ in range(reps):
            for n, (call, *_) in enumerate(runs):
                t0 = clock()
                call()
                times[n].append(clock() - t0)
        probe_iters = 20_000_000 // threads
        best = float("inf")
        flops = 0.0
        for _ in range(3):
            t0 = clock()  # (the same clock as the kernel's)
            flops = libs[0].attnkit_fma_probe(probe_iters, threads)
            best = min(best, clock() - t0)
        peak = flops / best / 1e9
    span = t if window is None else min(t, window)
    pairs = sum(min(i + 1, span) for i in range(t))  # kept (query, key) pairs of a head
    useful = 4 * b * h * pairs * d * (2.5 if backward else 1.0)
    first = min(times[0])
    rows = []
    for source, ts, (_, out, _) in zip(source_dirs, times, runs, strict=True):
        same = bool(torch.equal(out, runs[0][1]))
        rows.append({
            "source": str(source), "min_s": min(ts), "median_s": statistics.median(ts),
            "gflops": useful / min(ts) / 1e9, "pct_peak": 100 * useful / min(ts) / 1e9 / peak,
            "vs_first": min(ts) / first, "same_bits_as_first": same, "peak_gflops": peak,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line: source directories, then the build, size and threads."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "sources",
        nargs="+",
        type=Path,
        help="directories with attention.cpp and its headers (build.HEADERS)",
    )
    parser.add_argument("--isa", default=build.selected_isa(), choices=sorted(build.ISA_FLAGS))
    parser.add_argument("--t", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 inputs (a build with bf16 products: avx512-bf16, avx512-amx)",
    )
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--backward", action="store_true", help="time the backward call")
    args = parser.parse_args(argv)
    if args.t < 1 or args.threads < 1 or args.reps < 1:
        parser.error(
            f"--t, --threads and --reps must be >= 1 (got {args.t}, {args.threads}, {args.reps})"
        )
    sources = list(args.sources)
    if len(sources) == 1:
        sources.append(build.SOURCE.parent)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    rows = compare(
        sources, args.isa, args.t, args.threads, args.reps, dtype, args.window, args.backward
    )
    what = "backward" if args.backward else "forward"
    print(f"{args.isa} {what}, T={args.t}, {args.threads} thread(s), {dtype}, window {args.window}, "
          f"probe {rows[0]['peak_gflops']:.0f} GFLOP/s (noisy on a shared machine)")  # fmt: skip
    for r in rows:
        print(f"{r['source']:40s} min {1e3 * r['min_s']:8.1f} ms  median {1e3 * r['median_s']:8.1f}"
              f"  {r['gflops']:6.1f} GFLOP/s  {r['pct_peak']:5.1f}% of peak  x{r['vs_first']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
