"""Benchmarks of the portable native kernel, once per build this CPU executes.

A speed measured on one CPU is not a speed we have: this module measures, for every
instruction-set build of :mod:`attnkit.backends.blockwise.native` the machine can run
(an AVX-512 machine runs its AVX-512 and its AVX2 build; a build narrower than torch's own
kernels runs in a child process with torch held to its instruction set, see
:mod:`attnkit.bench.isa_env`):

* the machine: fp32 FMA peak (the kernel's own probe: independent FMA chains at the
  build's vector width) and memory bandwidth (a large copy), on 1 thread and on all;
* the kernel: causal forward and forward+backward against SDPA (T=8192, B=1, H=4, d=64,
  fp32), the forward's FLOP rate as a share of the measured peak (and of the probe timed
  in the forward's own rounds: ``fwd % of peak, same rounds``), the backward's FLOP
  rate over the forward's (flash-attn's convention: the backward does 2.5x the forward's
  FLOPs), and on builds with bf16 products (avx512-bf16, avx512-amx) the bf16 forward
  over the float32 one;
* ``auto`` against the fastest backend on a grid (causal, window 256, 8 documents, ALiBi
  x T x fp32 / bf16 x fwd / fwd+bwd, :mod:`attnkit.bench.auto_grid`), with the build's
  own calibration deciding what ``auto`` runs, and what each backend ran.

Timings are interleaved in shuffled rounds, each sample repeated to last at least
:data:`MIN_SAMPLE` seconds (:func:`attnkit.bench.timing.interleaved`); a ratio is the median
of the per-round ratios (:func:`attnkit.bench.timing.paired_ratio`), and every row names
its build and CPU. Run with ``python -m attnkit.bench.native_kernel``
(``--quick``: toy sizes, seconds, not graded); ``attnkit bench --kernel`` runs the same.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from attnkit import attention
from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import build
from attnkit.bench import report
from attnkit.bench.auto_grid import SHAPE, env, grid, inputs, markdown_rows, step
from attnkit.bench.isa_env import CHILD, held_env, in_held_child, torch_capability, torch_libraries
from attnkit.bench.timing import interleaved, paired_ratio, spread

#: Set in a held child's environment.
#: Seconds each timed sample lasts at least (a call is repeated until it does); --quick: 0.
MIN_SAMPLE = 0.03


def _best(
    fns: dict[str, Callable[[], object]], reps: int, min_sample: float = 0.0
) -> dict[str, float]:
    """Median seconds per call of each closure (:func:`~attnkit.bench.timing.interleaved`)."""
    return {name: spread(ts)[0] for name, ts in interleaved(fns, reps, min_sample).items()}


def fma_probe(threads: int) -> tuple[Callable[[], float], float] | None:
    """The loaded build's FMA probe on ``threads`` (about 0.1 s a call) as a closure, and
    the FLOPs one call does; None without a build."""
    lib = build.library()
    if lib is None:
        return None
    iters = 20_000_000 // max(1, threads)
    flops = lib.attnkit_fma_probe(iters // 10, threads) * 10  # (and a warm-up: clocks, pool)
    return (lambda: lib.attnkit_fma_probe(iters, threads)), flops


def machine_peak(threads: int) -> dict[str, float]:
    """fp32 FMA GFLOP/s of the loaded build's probe and copy bandwidth GB/s on ``threads``."""
    gflops = float("nan")
    probe = fma_probe(threads)
    if probe is not None:
        call, flops = probe
        gflops = flops / min(_timed(call) for _ in range(3)) / 1e9
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


def causal_rows(t: int, reps: int, peak_all: float, min_sample: float = 0.0) -> dict[str, float]:
    """Native causal fwd and fwd+bwd against SDPA, % of peak, backward/forward FLOP rate.
    The forward's share of the peak is given twice: against the build's peak probed before
    (``peak_all``), and as the median of its per-round shares of the same probe timed in
    the forward's rounds (``same rounds``: a machine whose clock drifts between the probe
    and the forward, as this Xeon's did from 429 to 492 GFLOP/s from one session to the
    next, moves both alike). A ratio is the median of the per-round ratios
    (:func:`.timing.paired_ratio`), the backward/forward FLOP rate too (the forward timed
    again in the fwd+bwd rounds: from the two phases' medians a drift of the machine's
    speed between them read 0.46 and 1.93 on the Xeon of session 27); the forward's FLOP
    rate comes from its median time."""
    out: dict[str, float] = {}
    fwd_flops = 4 * SHAPE[0] * SHAPE[1] * t * t * SHAPE[2] / 2  # QK^T and PV, half (causal)
    seconds: dict[str, float] = {}
    probe = fma_probe(torch.get_num_threads())
    for backward in (False, True):
        fns = _causal_fns(*inputs(t, backward), backward)
        if backward:  # the forward alone, in the same rounds
            fns["native fwd"] = _native(*inputs(t, False), False)
        elif probe is not None:  # the peak, in the same rounds as the forward
            fns["fma probe"] = probe[0]
        with env(ATTNKIT_NATIVE_SPEED="fast"):  # the kernel itself, whatever calibration says
            times = interleaved(fns, reps, min_sample)
        key = "fwd+bwd" if backward else "fwd"
        out[f"native/sdpa {key}"] = paired_ratio(times["native"], times["sdpa"])[0]
        seconds[key] = spread(times["native"])[0]
        if not backward and probe is not None:  # rate / peak = (F / t) / (P / t_probe)
            share = paired_ratio(times["fma probe"], times["native"])[0] * fwd_flops / probe[1]
        if backward:  # rate ratio = 2.5 fwd / (fwd+bwd - fwd), round by round
            backward_only = [
                max(fb - f, 1e-9)
                for fb, f in zip(times["native"], times["native fwd"], strict=True)
            ]
            rate = paired_ratio([2.5 * f for f in times["native fwd"]], backward_only)[0]
    for backward in (False, True) if native.bf16() else ():  # bf16 products against fp32
        q, k, v = inputs(t, backward)
        qb, kb, vb = (x.detach().to(torch.bfloat16).requires_grad_(backward) for x in (q, k, v))
        fns = {"fp32": _native(q, k, v, backward), "bf16": _native(qb, kb, vb, backward)}
        with env(ATTNKIT_NATIVE_SPEED="fast"):
            times = interleaved(fns, reps, min_sample)
        key = "fwd+bwd" if backward else "fwd"
        out[f"bf16 {key} / fp32 {key}"] = paired_ratio(times["bf16"], times["fp32"])[0]
    fwd_rate = fwd_flops / seconds["fwd"]
    out["fwd GFLOP/s"] = fwd_rate / 1e9
    out["fwd % of peak"] = 100 * fwd_rate / 1e9 / peak_all
    if probe is not None:
        out["fwd % of peak, same rounds"] = 100 * share
    out["bwd/fwd FLOP rate"] = rate
    return out


def _native(q, k, v, backward: bool) -> Callable[[], object]:
    """Causal attention on blockwise (the native kernel, whatever calibration says)."""
    return step(lambda: attention(q, k, v, causal=True, backend="blockwise"), backward)


def _causal_fns(q, k, v, backward: bool) -> dict[str, Callable[[], object]]:
    return {
        "native": _native(q, k, v, backward),
        "sdpa": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), backward),
    }


def run(quick: bool, reps: int, isas: list[str] | None = None) -> dict:
    """Every build this CPU executes (or those of ``isas``): its machine peak, causal rows
    and the auto grid. A build torch's kernels would outrun in width (the AVX2 build on an
    AVX-512 CPU) runs in a child process with torch held to its instruction set too
    (:mod:`attnkit.bench.isa_env`), so its rows are what a CPU of that kind sees."""
    from attnkit.bench.suite import machine

    result: dict = {"machine": machine(peaks=False), "builds": {}}  # peaks: per build
    result["t"] = 1024 if quick else 8192
    for isa in isas or build.host_isas():
        # (a child already runs held: it never starts another, whatever torch reports)
        held = None if os.environ.get(CHILD) else held_env(isa)
        if held is not None:
            result["builds"][isa] = _in_child(isa, held, quick, reps)
            continue
        with env(ATTNKIT_NATIVE_ISA=isa, ATTNKIT_NATIVE_SPEED=None):
            result["builds"][isa] = _build_rows(quick, reps, result["t"])
    return result


def _build_rows(quick: bool, reps: int, t: int) -> dict:
    """The loaded build's status, peaks, causal rows and grid."""
    status = build.status()
    if build.library() is None:
        return {"status": status}
    threads = torch.get_num_threads()
    peak = {"1 thread": machine_peak(1), f"{threads} threads": machine_peak(threads)}
    peak_all = peak[f"{threads} threads"]["fp32_gflops"]
    min_sample = 0.0 if quick else MIN_SAMPLE
    sizes = (256, 512) if quick else (1024, 4096)
    return {
        "status": status,
        "torch": torch_capability(),  # the vector code of torch's kernels beside this build
        "libraries": torch_libraries(),  # ... and how its oneDNN and MKL are held, if they are
        "peak": peak,
        "causal": causal_rows(t, reps, peak_all, min_sample),
        "grid": grid(sizes, ("fp32", "bf16"), reps, min_sample, peak_all),
    }


def _in_child(isa: str, held: dict[str, str], quick: bool, reps: int) -> dict:
    """``isa``'s rows from ``python -m attnkit.bench.native_kernel --isa ISA`` run with
    ``held`` in its environment (:func:`.isa_env.in_held_child`)."""
    args = ["--reps", str(reps)] + (["--quick"] if quick else [])
    return in_held_child("attnkit.bench.native_kernel", isa, held, args)


def markdown(result: dict) -> str:
    """The result as Markdown tables, one section per build."""
    m = result["machine"]
    lines = [f"# Native kernel, per build ({m['cpu']}, {m['threads']} threads, torch {m['torch']})",
             ""]  # fmt: skip
    for isa, b in result["builds"].items():
        lines += [f"## {isa}", "", f"`{b['status']}`", ""]
        if "peak" not in b:
            continue
        if "torch" in b:
            held = f" ({b['libraries']})" if b.get("libraries") else ""
            lines += [f"torch's kernels beside it: {b['torch']}{held}", ""]
        lines += ["| threads | fp32 FMA peak (GFLOP/s) | copy bandwidth (GB/s) |", "|---|---|---|"]
        for name, p in b["peak"].items():
            lines.append(f"| {name} | {p['fp32_gflops']:.1f} | {p['copy_gbps']:.1f} |")
        lines += ["", f"| causal, T={result['t']} | value |", "|---|---|"]
        for name, x in b["causal"].items():  # (ratios to 3 places: 0.754 is no 0.75)
            lines.append(f"| {name} | {x:.1f} |" if x >= 10 else f"| {name} | {x:.3f} |")
        lines += ["", *markdown_rows(b["grid"]), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes: seconds, not graded")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds per case")
    parser.add_argument("--out", type=Path, default=None, help="write native.json/.md here")
    parser.add_argument("--isa", action="append", default=None,
                        help="only this build (repeatable; default: every build the CPU runs)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write the raw result here")
    args = parser.parse_args(argv)
    report.check_output(parser, "--out", args.out, folder=True)
    report.check_output(parser, "--json", args.json)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    unknown = [isa for isa in args.isa or () if isa not in build.host_isas()]
    if unknown:
        parser.error(f"--isa {unknown[0]!r} is not a build this CPU runs ({build.host_isas()})")
    result = run(args.quick, args.reps, args.isa)
    if args.json is not None:
        args.json.write_text(json.dumps(result))
    if args.out is not None:
        write(result, args.out)
    print(markdown(result))
    return 0


def write(result: dict, out: Path) -> None:
    """``native.json`` and ``native.md`` in ``out``."""
    report.write_pair(out, "native", result, markdown(result))


if __name__ == "__main__":
    raise SystemExit(main())
