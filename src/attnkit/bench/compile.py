"""Eager vs ``torch.compile`` (inductor) speed of attnkit, measured in one run.

Three workloads, per attention backend:

* ``mha``: a :class:`~attnkit.MultiHeadAttention` forward ``(b, t, d_out)``, causal;
* ``gpt``: the ``tiny`` GPT's forward over ``(b, t)`` token ids;
* ``decode``: one token of a static-KV-cache GPT decode step (eager prefill first;
  the compiled step is compiled once and reused for every token).

Run: ``python -m attnkit.bench.compile --out bench-out [--quick]``. Writes
``compile.json`` and ``compile.md`` to ``--out``. Times are medians of
``--repeats`` runs after warm-up, compile time reported separately; compare the
eager/compiled ratios within one run only (absolute times depend on the machine
and its load). ``--quick`` uses trivial sizes: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import attnkit
from attnkit.bench.report import check_output
from attnkit.models import GPT, GPTConfig

__all__ = ["main", "run", "to_markdown"]

WORKLOADS = ("mha", "gpt", "decode")


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _measure(
    eager: Callable[[], torch.Tensor],
    compiled: Callable[[], torch.Tensor],
    repeats: int,
    warmup: int,
) -> dict[str, float]:
    """Time ``eager`` and ``compiled`` (first compiled call = compile time); check they agree."""
    start = time.perf_counter()
    got = compiled()
    compile_s = time.perf_counter() - start
    expected = eager()
    max_abs_diff = float((got - expected).abs().max())
    for _ in range(warmup):
        eager(), compiled()
    eager_ms = _median_ms(eager, repeats)
    compiled_ms = _median_ms(compiled, repeats)
    return {
        "eager_ms": eager_ms,
        "compiled_ms": compiled_ms,
        "speedup": eager_ms / compiled_ms,
        "compile_s": compile_s,
        "max_abs_diff": max_abs_diff,
    }


def _bench_mha(backend: str, sizes: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    b, t, d_out, num_heads = sizes["batch"], sizes["tokens"], sizes["d_out"], sizes["num_heads"]
    mha = attnkit.MultiHeadAttention(d_out, d_out, t, 0.0, num_heads=num_heads, backend=backend)
    mha.eval()
    x = torch.randn(b, t, d_out)  # (b, t, d_in)
    compiled = torch.compile(mha, fullgraph=True, backend=sizes["compiler"])
    shape = f"b={b} t={t} d_out={d_out} num_heads={num_heads}"
    return {"shape": shape, **_measure(lambda: mha(x), lambda: compiled(x), repeats, warmup)}


def _gpt(backend: str, sizes: dict[str, Any]) -> GPT:
    overrides = {k: sizes[k] for k in ("emb_dim", "n_layers", "context_length") if k in sizes}
    return GPT(GPTConfig.preset("tiny", attn_backend=backend, **overrides)).eval()


def _bench_gpt(backend: str, sizes: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    model = _gpt(backend, sizes)
    b, t = sizes["batch"], min(sizes["tokens"], model.cfg.context_length)
    idx = torch.randint(0, model.cfg.vocab_size, (b, t))  # (b, t)
    compiled = torch.compile(model, fullgraph=True, backend=sizes["compiler"])
    shape = f"tiny GPT b={b} t={t} emb_dim={model.cfg.emb_dim}"
    return {"shape": shape, **_measure(lambda: model(idx), lambda: compiled(idx), repeats, warmup)}


def _bench_decode(backend: str, sizes: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    """One decode step at a fixed time index: the same step is timed again and again
    (the cache keeps no position, so nothing needs rewinding)."""
    model = _gpt(backend, sizes)
    b, max_len = sizes["batch"], model.cfg.context_length
    prompt_len = max_len // 2
    prompt = torch.randint(0, model.cfg.vocab_size, (b, prompt_len))  # (b, t)
    token = torch.randint(0, model.cfg.vocab_size, (b, 1))  # (b, 1)
    model.setup_cache(b, max_len, static=True)
    model(prompt, input_pos=torch.arange(prompt_len))  # eager prefill
    pos = torch.tensor([prompt_len])
    compiled = torch.compile(model, fullgraph=True, backend=sizes["compiler"])

    def step(fn: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run_step() -> torch.Tensor:
            return fn(token, input_pos=pos)  # (b, 1, v)

        return run_step

    result = _measure(step(model), step(compiled), repeats, warmup)
    model.delete_cache()
    shape = f"tiny GPT b={b}, 1 token after {prompt_len}, static cache of {max_len}"
    return {"shape": shape, **result}


_BENCHES = {"mha": _bench_mha, "gpt": _bench_gpt, "decode": _bench_decode}


@torch.no_grad()
def run(
    backends: list[str] | None = None,
    *,
    quick: bool = False,
    repeats: int = 30,
    warmup: int = 5,
    seed: int = 0,
    compiler: str = "inductor",
) -> dict[str, Any]:
    """Measure eager vs compiled milliseconds for every workload and backend.

    Args:
        backends: attention backends (default ``["reference", "sdpa"]``).
        quick: trivial sizes and few repeats (a smoke test, not a measurement).
        repeats: timed runs per variant (median reported).
        warmup: untimed runs after compilation.
        seed: seed of weights and inputs.
        compiler: the ``torch.compile`` backend (``"inductor"``; ``"eager"`` only
            traces, for fast smoke tests).

    Returns:
        ``{"rows": [...], "threads": ..., "torch": ..., "quick": ...}``; each row has
        ``workload, backend, shape, eager_ms, compiled_ms, speedup, compile_s, max_abs_diff``.
    """
    backends = backends or ["reference", "sdpa"]
    sizes: dict[str, Any]
    if quick:
        sizes = dict(batch=1, tokens=8, d_out=16, num_heads=2)
        sizes.update(emb_dim=16, n_layers=1, context_length=16)
        repeats, warmup = min(repeats, 3), min(warmup, 1)
    else:
        sizes = dict(batch=4, tokens=64, d_out=256, num_heads=8)  # GPT: "tiny"
    sizes["compiler"] = compiler
    rows = []
    for workload in WORKLOADS:
        for backend in backends:
            torch._dynamo.reset()
            torch.manual_seed(seed)
            row = _BENCHES[workload](backend, sizes, repeats, warmup)
            rows.append({"workload": workload, "backend": backend, **row})
    torch._dynamo.reset()
    return {
        "rows": rows,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "quick": quick,
        "repeats": repeats,
        "compiler": compiler,
    }


def to_markdown(result: dict[str, Any]) -> str:
    """Render :func:`run`'s result as a Markdown table."""
    lines = [
        f"Eager vs torch.compile ({result['compiler']}), torch {result['torch']}, "
        f"{result['threads']} CPU threads, median of {result['repeats']} runs"
        + (" (--quick: not a measurement)" if result["quick"] else ""),
        "",
        "| workload | backend | shape | eager ms | compiled ms | speedup | compile s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['workload']} | {r['backend']} | {r['shape']} | {r['eager_ms']:.3f} "
            f"| {r['compiled_ms']:.3f} | {r['speedup']:.2f}x | {r['compile_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write ``compile.json`` and ``compile.md`` to ``--out``, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out", help="folder for compile.json/.md")
    parser.add_argument("--backends", nargs="+", default=["reference", "sdpa"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="trivial sizes (smoke test)")
    parser.add_argument("--compiler", default="inductor", help="torch.compile backend")
    args = parser.parse_args(argv)
    check_output(parser, "--out", args.out, folder=True)
    if args.repeats <= 0:
        parser.error(f"--repeats must be positive, got {args.repeats}")
    for name in args.backends:
        try:
            attnkit.backends.get_backend(name)
        except ValueError as err:
            parser.error(str(err))
    result = run(args.backends, quick=args.quick, repeats=args.repeats, compiler=args.compiler)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    table = to_markdown(result)
    (out / "compile.md").write_text(table, encoding="utf-8")
    print(table, end="")
    print(f"wrote {out / 'compile.json'} and {out / 'compile.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
