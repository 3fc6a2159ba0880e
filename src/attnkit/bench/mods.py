"""Benchmark of compiled score_mods: a mod's cost over plain causal attention, per build.

For every instruction-set build of the native kernel this CPU runs (:func:`attnkit.backends
.blockwise.native.build.host_isas`), causal attention (T=4096, B=1, H=4, d=64, fp32 and,
on builds with bf16 products, bf16) with three score_mods the kernel runs compiled
(:mod:`attnkit.backends.blockwise.native.codegen`), forward and forward+backward, each
over plain causal attention on the same build:

* ``softcap``: ``30 * tanh(s / 30)``;
* ``table``: a learned T5-style bias ``s + table[h][kv - q + T - 1]`` (its gradient taken);
* ``lambda``: ``s * 0.5 + (h + 1) * 0.01 * (q - kv)``.

Every call goes through ``backend="auto"`` (what a user gets: plain causal may run on
torch's kernel where the build's calibration finds it faster). Targets (issue 21): forward
<= 1.2x plain, forward+backward <= 1.5x plain. Timings are round-robin medians (:func:`attnkit.bench.native_kernel._best`). A build narrower than torch's
own kernels (the AVX2 build on an AVX-512 CPU) runs in a child process with torch, oneDNN,
MKL and so inductor's FlexAttention held to that instruction set too
(:mod:`attnkit.bench.isa_env`), so its row is what an AVX2 machine sees. Run with
``python -m attnkit.bench.mods`` (``--quick``: toy sizes, not graded; ``--isa``: one
build) or ``attnkit bench --mods``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from attnkit import attention, explain_dispatch
from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import build
from attnkit.bench import report
from attnkit.bench.auto_grid import env
from attnkit.bench.isa_env import CHILD, held_env, in_held_child, torch_capability
from attnkit.bench.native_kernel import _best

SHAPE = (1, 4, 64)  # (b, h, d)
#: Goals of issue 21: mod / plain causal.
GOALS = {"fwd": 1.2, "fwd+bwd": 1.5}


def mods(t: int, h: int) -> tuple[dict[str, Callable], torch.Tensor]:
    """The benchmarked score_mods, and the learned table one of them reads."""
    table = (torch.randn(h, 2 * t - 1) * 0.1).requires_grad_(True)
    return {
        "softcap": lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0),
        "table": lambda s, b, h, q, kv: s + table[h][kv - q + t - 1],
        "lambda": lambda s, b, h, q, kv: s * 0.5 + (h + 1) * 0.01 * (q - kv),
    }, table


def _flex_forward(q, k, v, mod: Callable) -> Callable[[], object]:
    """The forward of torch's compiled FlexAttention (inductor's CPU template) with the
    same mod and a causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t = q.shape[-2]
    block = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, t, t, device="cpu")
    flex = torch.compile(flex_attention)

    def run() -> object:
        with torch.no_grad():
            return flex(q, k, v, score_mod=mod, block_mask=block)

    return run


def rows(t: int, dtype: torch.dtype, reps: int, flex: bool = False) -> dict[str, dict]:
    """``{mod: {"fwd": ratio, "fwd+bwd": ratio, "engines": ...}}`` plus plain's seconds;
    with ``flex``, also ``"fwd / flex"``: our forward over compiled FlexAttention's."""
    b, h, d = SHAPE
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(b, h, t, d, generator=g).to(dtype).requires_grad_(True) for _ in range(3)
    )
    score_mods, table = mods(t, h)

    def step(mod: Callable | None, backward: bool) -> Callable[[], object]:
        def run() -> object:  # backend="auto": what a user gets, plain or modded
            if not backward:
                with torch.no_grad():
                    return attention(q, k, v, causal=True, score_mod=mod)
            return attention(q, k, v, causal=True, score_mod=mod).sum().backward()

        return run

    fns = {}
    for direction, backward in (("fwd", False), ("fwd+bwd", True)):
        fns[("plain", direction)] = step(None, backward)
        for name, mod in score_mods.items():
            fns[(name, direction)] = step(mod, backward)
    if flex:
        for name, mod in score_mods.items():
            fns[(name, "flex")] = _flex_forward(q.detach(), k.detach(), v.detach(), mod)
    times = _best({f"{n}|{d_}": fn for (n, d_), fn in fns.items()}, reps)
    out: dict[str, dict] = {
        "plain": {d_: times[f"plain|{d_}"] for d_ in GOALS},
    }
    for name, mod in score_mods.items():
        out[name] = {d_: times[f"{name}|{d_}"] / times[f"plain|{d_}"] for d_ in GOALS}
        if flex:
            out[name]["fwd / flex"] = times[f"{name}|fwd"] / times[f"{name}|flex"]
        out[name]["engines"] = explain_dispatch(q, k, v, causal=True, score_mod=mod)
    del table
    return out


def run(quick: bool, reps: int, flex: bool = False, isas: list[str] | None = None) -> dict:
    """Every build this CPU executes (or those of ``isas``): the mod rows in fp32 (and
    bf16 where it has bf16 products); ``flex``: fp32 forwards against compiled
    FlexAttention too (slow: one inductor compile per mod). A build narrower than torch's
    kernels runs in a child process with torch held to it (:func:`_in_child`)."""
    from attnkit.bench.suite import machine

    t = 512 if quick else 4096
    result: dict = {"machine": machine(peaks=False), "t": t, "builds": {}}
    for isa in isas or build.host_isas():
        # (a child already runs held: it never starts another, whatever torch reports)
        held = None if os.environ.get(CHILD) else held_env(isa)
        if held is not None:
            result["builds"][isa] = _in_child(isa, held, quick, reps, flex)
            continue
        with env(ATTNKIT_NATIVE_ISA=isa, ATTNKIT_NATIVE_SPEED=None):
            if build.library() is None:
                result["builds"][isa] = {"status": build.status()}
                continue
            entry = {
                "status": build.status(),
                "torch": torch_capability(),  # the vector code of torch's kernels (and Flex)
                "fp32": rows(t, torch.float32, reps, flex),
            }
            if native.bf16():  # (bf16 products: avx512-bf16 and avx512-amx builds)
                entry["bf16"] = rows(t, torch.bfloat16, reps)
            result["builds"][isa] = entry
    return result


def _in_child(isa: str, held: dict[str, str], quick: bool, reps: int, flex: bool) -> dict:
    """``isa``'s rows from ``python -m attnkit.bench.mods --isa ISA`` run with ``held`` in
    its environment (torch reads it when it loads: its kernels, oneDNN, MKL and the C++
    inductor generates for FlexAttention then use ``isa`` too; :func:`.isa_env.in_held_child`)."""
    args = ["--reps", str(reps)] + (["--quick"] if quick else []) + (["--flex"] if flex else [])
    return in_held_child("attnkit.bench.mods", isa, held, args)


def markdown(result: dict) -> str:
    """The result as one Markdown table per build and dtype."""
    m = result["machine"]
    lines = [f"# Compiled score_mods over plain causal, T={result['t']} ({m['cpu']}, "
             f"{m['threads']} threads)", ""]  # fmt: skip
    for isa, b in result["builds"].items():
        lines += [f"## {isa}", "", f"`{b['status']}`", ""]
        if "torch" in b:
            lines += [f"torch's kernels (and compiled FlexAttention) beside it: {b['torch']}", ""]
        for dtype in ("fp32", "bf16"):
            if dtype not in b:
                continue
            r = b[dtype]
            plain = r["plain"]
            lines += [
                f"{dtype}: plain causal fwd {plain['fwd'] * 1e3:.0f} ms, "
                f"fwd+bwd {plain['fwd+bwd'] * 1e3:.0f} ms",
                "",
                "| score_mod | fwd / plain (goal <= 1.2) | fwd+bwd / plain (goal <= 1.5) |",
                "|---|---|---|",
            ]
            for name, x in r.items():
                if name == "plain":
                    continue
                line = f"| {name} | {x['fwd']:.2f} | {x['fwd+bwd']:.2f} |"
                if "fwd / flex" in x:
                    line += (
                        f" (fwd / compiled FlexAttention fwd: {x['fwd / flex']:.2f}, goal <= 0.8)"
                    )
                lines.append(line)
            lines.append("")
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path) -> None:
    """``mods.json`` and ``mods.md`` in ``out``."""
    report.write_pair(out, "mods", result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes: seconds, not graded")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--out", type=Path, default=None, help="write mods.json/.md here")
    parser.add_argument(
        "--flex", action="store_true", help="also time compiled FlexAttention's forward (slow)"
    )
    parser.add_argument("--isa", default=None, help="only this build (e.g. avx2)")
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    report.check_output(parser, "--out", args.out, folder=True)
    report.check_output(parser, "--json", args.json)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.isa is not None and args.isa not in build.host_isas():
        parser.error(f"--isa {args.isa!r} is not a build this CPU runs ({build.host_isas()})")
    result = run(args.quick, args.reps, args.flex, [args.isa] if args.isa else None)
    if args.out is not None:
        write(result, args.out)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
