"""Benchmarks of the portable native kernel, once per build this CPU executes.

A speed measured on one CPU is not a speed we have: this module measures, for every
instruction-set build of :mod:`attnkit.backends.blockwise.native` the machine can run
(an AVX-512 machine runs its AVX-512 and its AVX2 build), in one process:

* the machine: fp32 FMA peak (the kernel's own probe: independent FMA chains at the
  build's vector width) and memory bandwidth (a large copy), on 1 thread and on all;
* the kernel: causal forward and forward+backward against SDPA (T=8192, B=1, H=4, d=64,
  fp32), the forward's FLOP rate as a share of the measured peak, the backward's FLOP
  rate over the forward's (flash-attn's convention: the backward does 2.5x the forward's
  FLOPs), and on avx512-bf16 builds the bf16 forward over the float32 one;
* ``auto`` against the fastest backend on a grid (causal, window 256, 8 documents, ALiBi
  x T x fwd / fwd+bwd), with the build's own calibration deciding what ``auto`` runs.

Timings are interleaved round-robin (:func:`attnkit.bench.timing.time_cases`' rule, shuffled) and
every row names its build and CPU. Run with ``python -m attnkit.bench.native_kernel``
(``--quick``: toy sizes, seconds, not graded); ``attnkit bench --kernel`` runs the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from attnkit import attention, create_block_mask
from attnkit import masks as M
from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import build

SHAPE = (1, 4, 64)  # (b, h, d)
WINDOW = 256
BACKENDS = ("sdpa", "blockwise", "blockwise-flash", "auto")


@contextlib.contextmanager
def _env(**values: str | None) -> Iterator[None]:
    old = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _best(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each closure, timed round-robin after one warm-up each; each round
    runs them in another (seeded) order, so none always runs right after the same
    neighbour (a large free before a call made it page-fault its fresh buffers: 1.3x)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def machine_peak(threads: int) -> dict[str, float]:
    """fp32 FMA GFLOP/s of the loaded build's probe and copy bandwidth GB/s on ``threads``."""
    lib = build.library()
    gflops = float("nan")
    if lib is not None:
        iters = 20_000_000 // max(1, threads)
        lib.attnkit_fma_probe(iters // 10, threads)  # warm up (clocks, the pool)
        best = float("inf")
        flops = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            flops = lib.attnkit_fma_probe(iters, threads)
            best = min(best, time.perf_counter() - t0)
        gflops = flops / best / 1e9
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(1 << 26)  # 256 MB
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    finally:
        torch.set_num_threads(before)
    return {"fp32_gflops": gflops, "copy_gbps": 2 * src.numel() * 4 / best / 1e9}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _inputs(
    t: int, backward: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, d = SHAPE
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g).requires_grad_(backward) for _ in range(3))
    return q, k, v


def _step(fn: Callable[[], torch.Tensor], backward: bool) -> Callable[[], object]:
    if backward:
        return lambda: fn().sum().backward()

    def forward() -> object:
        with torch.no_grad():
            return fn()

    return forward


def causal_rows(t: int, reps: int, peak_all: float) -> dict[str, float]:
    """Native causal fwd and fwd+bwd against SDPA, % of peak, backward/forward FLOP rate."""
    out: dict[str, float] = {}
    fwd_flops = 4 * SHAPE[0] * SHAPE[1] * t * t * SHAPE[2] / 2  # QK^T and PV, half (causal)
    seconds: dict[str, float] = {}
    for backward in (False, True):
        fns = _causal_fns(*_inputs(t, backward), backward)
        with _env(ATTNKIT_NATIVE_SPEED="fast"):  # the kernel itself, whatever calibration says
            med = _best(fns, reps)
        key = "fwd+bwd" if backward else "fwd"
        out[f"native/sdpa {key}"] = med["native"] / med["sdpa"]
        seconds[key] = med["native"]
    for backward in (False, True) if native.bf16() else ():  # bf16 products against fp32
        q, k, v = _inputs(t, backward)
        qb, kb, vb = (x.detach().to(torch.bfloat16).requires_grad_(backward) for x in (q, k, v))
        fns = {"fp32": _native(q, k, v, backward), "bf16": _native(qb, kb, vb, backward)}
        with _env(ATTNKIT_NATIVE_SPEED="fast"):
            med = _best(fns, reps)
        key = "fwd+bwd" if backward else "fwd"
        out[f"bf16 {key} / fp32 {key}"] = med["bf16"] / med["fp32"]
    fwd_rate = fwd_flops / seconds["fwd"]
    bwd_rate = 2.5 * fwd_flops / max(seconds["fwd+bwd"] - seconds["fwd"], 1e-9)
    out["fwd GFLOP/s"] = fwd_rate / 1e9
    out["fwd % of peak"] = 100 * fwd_rate / 1e9 / peak_all
    out["bwd/fwd FLOP rate"] = bwd_rate / fwd_rate
    return out


def _native(q, k, v, backward: bool) -> Callable[[], object]:
    """Causal attention on blockwise (the native kernel, whatever calibration says)."""
    return _step(lambda: attention(q, k, v, causal=True, backend="blockwise"), backward)


def _causal_fns(q, k, v, backward: bool) -> dict[str, Callable[[], object]]:
    return {
        "native": _native(q, k, v, backward),
        "sdpa": _step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), backward),
    }


def _grid_fns(q, k, v, kwargs: dict, sdpa_mask, backward: bool) -> dict[str, Callable[[], object]]:
    """One closure per backend of :data:`BACKENDS` (sdpa with the pattern's dense mask)."""

    def sdpa() -> torch.Tensor:
        if sdpa_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)

    def ours(name: str) -> Callable[[], torch.Tensor]:
        return lambda: attention(q, k, v, backend=name, **kwargs)

    return {n: _step(sdpa if n == "sdpa" else ours(n), backward) for n in BACKENDS}


def _pattern_call(pattern: str, t: int) -> tuple[dict, torch.Tensor | None]:
    """attnkit keyword arguments of a grid pattern, and SDPA's equivalent mask (None:
    ``is_causal``)."""
    i, j = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    if pattern == "causal":
        return {"causal": True}, None
    if pattern == "window256":
        return {"causal": True, "window": WINDOW}, (j <= i) & (i - j < WINDOW)
    if pattern == "documents":
        ids = torch.arange(t) // max(1, t // 8)
        bm = create_block_mask(M.document(ids), None, None, t, t)
        keep = (ids.view(-1, 1) == ids.view(1, -1)) & (j <= i)
        return {"causal": True, "block_mask": bm}, keep
    if pattern == "alibi":
        h = SHAPE[1]
        slopes = M.alibi_slopes(h).view(h, 1, 1)
        bias = -(slopes * (i - j).abs()).float()
        return {"causal": True, "score_mod": M.alibi(h)}, bias.masked_fill(j > i, float("-inf"))
    raise ValueError(f"unknown pattern {pattern!r}")


def auto_grid(sizes: tuple[int, ...], reps: int, peak_gflops: float) -> list[dict]:
    """``auto`` against the fastest backend, every pattern x size x direction, and the
    blockwise row's useful FLOP rate as a share of ``peak_gflops`` (the kept (query, key)
    pairs only: 4 d FLOPs each forward, 2.5x that more backward)."""
    rows = []
    b, h, d = SHAPE
    for pattern in ("causal", "window256", "documents", "alibi"):
        for t in sizes:
            kwargs, sdpa_mask = _pattern_call(pattern, t)
            keep = torch.ones(t, t).tril().bool() if sdpa_mask is None else sdpa_mask
            keep = keep if keep.dtype == torch.bool else ~keep.isneginf()
            pairs = int(keep.reshape(-1, t, t)[0].sum())  # of one head (a bias has h)
            for backward in (False, True):
                fns = _grid_fns(*_inputs(t, backward, seed=t), kwargs, sdpa_mask, backward)
                med = _best(fns, reps)
                fastest = min((s, n) for n, s in med.items() if n != "auto")
                flops = 4 * b * h * pairs * d * (3.5 if backward else 1.0)
                rows.append({
                    "pattern": pattern, "t": t, "direction": "fwd+bwd" if backward else "fwd",
                    "seconds": med, "fastest": fastest[1], "auto/fastest": med["auto"] / fastest[0],
                    "blockwise % of peak": 100 * flops / med["blockwise"] / 1e9 / peak_gflops,
                })  # fmt: skip
    return rows


def run(quick: bool, reps: int) -> dict:
    """Every build this CPU executes: its machine peak, causal rows and the auto grid."""
    from attnkit.bench.suite import machine

    result: dict = {"machine": machine(peaks=False), "builds": {}}  # peaks: per build
    t = 1024 if quick else 8192
    sizes = (256, 512) if quick else (1024, 4096)
    threads = torch.get_num_threads()
    for isa in build.host_isas():
        with _env(ATTNKIT_NATIVE_ISA=isa, ATTNKIT_NATIVE_SPEED=None):
            status = build.status()
            if build.library() is None:
                result["builds"][isa] = {"status": status}
                continue
            peak = {
                "1 thread": machine_peak(1),
                f"{threads} threads": machine_peak(threads),
            }
            rows = causal_rows(t, reps, peak[f"{threads} threads"]["fp32_gflops"])
            grid = auto_grid(sizes, reps, peak[f"{threads} threads"]["fp32_gflops"])
            result["builds"][isa] = {"status": status, "peak": peak, "causal": rows, "grid": grid}
    result["t"] = t
    return result


def markdown(result: dict) -> str:
    """The result as Markdown tables, one section per build."""
    m = result["machine"]
    lines = [f"# Native kernel, per build ({m['cpu']}, {m['threads']} threads, torch {m['torch']})",
             ""]  # fmt: skip
    for isa, b in result["builds"].items():
        lines += [f"## {isa}", "", f"`{b['status']}`", ""]
        if "peak" not in b:
            continue
        lines += ["| threads | fp32 FMA peak (GFLOP/s) | copy bandwidth (GB/s) |", "|---|---|---|"]
        for name, p in b["peak"].items():
            lines.append(f"| {name} | {p['fp32_gflops']:.1f} | {p['copy_gbps']:.1f} |")
        lines += ["", f"| causal, T={result['t']} | value |", "|---|---|"]
        for name, x in b["causal"].items():
            lines.append(f"| {name} | {x:.2f} |")
        lines += ["", "| pattern | T | direction | fastest | auto / fastest | blockwise % of peak |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in b["grid"]:
            lines.append(
                f"| {r['pattern']} | {r['t']} | {r['direction']} | {r['fastest']} "
                f"| {r['auto/fastest']:.2f} | {r.get('blockwise % of peak', float('nan')):.0f} |"
            )
        worst = max(r["auto/fastest"] for r in b["grid"])
        lines += ["", f"worst auto / fastest: {worst:.2f}", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes: seconds, not graded")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--out", type=Path, default=None, help="write results.json/.md here")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    result = run(args.quick, args.reps)
    if args.out is not None:
        write(result, args.out)
    print(markdown(result))
    return 0


def write(result: dict, out: Path) -> None:
    """``native.json`` and ``native.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "native.json").write_text(json.dumps(result, indent=2))
    (out / "native.md").write_text(markdown(result))


if __name__ == "__main__":
    raise SystemExit(main())
