"""``auto`` against the fastest backend on the grid of issue 19: patterns x sizes x dtypes
x forward / forward+backward, on the native build this process loaded.

Each case is timed in two phases, each sample repeated to last at least ``min_sample``
seconds (:func:`attnkit.bench.timing.interleaved`). First every backend of
:data:`BACKENDS`, in shuffled interleaved rounds: their median times, and which is the
fastest. Then ``auto`` and that fastest one alone, :data:`PAIR_ROUNDS` times as many
rounds, back to back: ``auto``'s time over the fastest one's is the median of these
per-round ratios, with its quartiles. (In a round of all four, a drift of the machine
between ``auto`` and the fastest one, a 4096-key window's dense SDPA mask timed between
them, fell on one side of the pair only: on a 2-core Zen 4, session 21, ``auto`` running
the very same kernel as ``blockwise`` measured 1.11 [1.00-1.13] in 5 rounds.)
It also records what each backend ran
(:func:`attnkit.explain_dispatch`): where ``auto`` ran the fastest backend's own engines,
its ratio is the noise of timing one thing twice, and the row says ``same``; only rows
where it ran something else are choices to judge.

``blockwise`` here is the native kernel itself (``ATTNKIT_NATIVE_SPEED=fast``), whatever
the calibration says, so the grid sees when the calibration keeps a faster kernel out;
``auto`` runs under this machine's own calibration.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from attnkit import attention, create_block_mask, explain_dispatch
from attnkit import masks as M
from attnkit.bench.timing import DTYPES, interleaved, paired_ratio, spread

__all__ = ["BACKENDS", "PATTERNS", "grid", "inputs", "markdown_rows", "step"]

SHAPE = (1, 4, 64)  # (b, h, d)
#: Rounds of the second phase (``auto`` and the fastest alone, back to back) per round of
#: the first.
PAIR_ROUNDS = 3
WINDOW = 256
BACKENDS = ("sdpa", "blockwise", "blockwise-flash", "auto")
PATTERNS = ("causal", "window256", "documents", "alibi")
#: The environment each backend runs in (``blockwise``: the native kernel, not its calibration).
BACKEND_ENV: dict[str, dict[str, str | None]] = {"blockwise": {"ATTNKIT_NATIVE_SPEED": "fast"}}


@contextlib.contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Environment variables set (None: removed) for the block, restored after."""
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


def inputs(
    t: int, backward: bool, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)``, each ``(b, h, t, d)`` of :data:`SHAPE`, wanting gradients if ``backward``."""
    b, h, d = SHAPE
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, h, t, d, generator=g).to(dtype).requires_grad_(backward) for _ in range(3)
    )  # type: ignore[return-value]


def step(fn: Callable[[], torch.Tensor], backward: bool) -> Callable[[], object]:
    """One timed step: ``fn`` under ``no_grad``, or ``fn`` and the backward of its sum."""
    if backward:
        return lambda: fn().sum().backward()

    def forward() -> object:
        with torch.no_grad():
            return fn()

    return forward


def pattern_call(pattern: str, t: int, dtype: torch.dtype) -> tuple[dict, torch.Tensor | None]:
    """attnkit keyword arguments of a grid pattern, and SDPA's equivalent mask in ``dtype``
    (None: ``is_causal``)."""
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
        bias = bias.masked_fill(j > i, float("-inf"))  # (h, t, t)
        return {"causal": True, "score_mod": M.alibi(h)}, bias.to(dtype)
    raise ValueError(f"unknown pattern {pattern!r}")


def _call(name: str, q, k, v, kwargs: dict, sdpa_mask) -> Callable[[], torch.Tensor]:
    if name == "sdpa":
        if sdpa_mask is None:
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)
    over = BACKEND_ENV.get(name, {})

    def run() -> torch.Tensor:
        with env(**over):
            return attention(q, k, v, backend=name, **kwargs)

    return run


def ran(name: str, q, k, v, kwargs: dict, backward: bool) -> str:
    """What backend ``name`` runs for the call: ``sdpa``, or the blockwise engines of the
    direction(s) timed (``blockwise[native_cpu]``, ``blockwise[native_cpu/flash_cpu]``)."""
    if name == "sdpa":
        return "sdpa"
    with env(**BACKEND_ENV.get(name, {})):
        lines = explain_dispatch(q, k, v, backend=name, **kwargs).splitlines()
    of = {line.split(":", 1)[0]: line.split(":", 1)[1].split("(")[0].strip() for line in lines}
    backend = of.get("backend", name)
    if backend != "blockwise" and not backend.startswith("blockwise"):
        return backend
    engines = [of.get("forward", "?")]
    if backward and of.get("backward", "?") != engines[0]:
        engines.append(of.get("backward", "?"))
    return f"blockwise[{'/'.join(engines)}]"


def grid(
    sizes: tuple[int, ...],
    dtypes: tuple[str, ...],
    reps: int,
    min_sample: float,
    peak_gflops: float,
) -> list[dict]:
    """One row per pattern x size x dtype x direction: each backend's median seconds and
    what it ran, the fastest, ``auto``'s ratio to it (median and quartiles of the
    per-round ratios) and whether ``auto`` ran the same engines, and the native row's
    useful FLOP rate as a share of ``peak_gflops`` (fp32 rows; the kept (query, key) pairs
    only: 4 d FLOPs each forward, 2.5x that more backward)."""
    rows = []
    for pattern in PATTERNS:
        for t in sizes:
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                kwargs, sdpa_mask = pattern_call(pattern, t, dtype)
                keep = torch.ones(t, t).tril().bool() if sdpa_mask is None else sdpa_mask
                keep = keep if keep.dtype == torch.bool else ~keep.isneginf()
                pairs = int(keep.reshape(-1, t, t)[0].sum())  # of one head (a bias has h)
                for backward in (False, True):
                    q, k, v = inputs(t, backward, seed=t, dtype=dtype)
                    fns = {
                        n: step(_call(n, q, k, v, kwargs, sdpa_mask), backward) for n in BACKENDS
                    }
                    times = interleaved(fns, reps, min_sample, seed=t)
                    fastest = _fastest(times)
                    pair = {n: fns[n] for n in ("auto", fastest)}
                    duel = interleaved(pair, PAIR_ROUNDS * reps, min_sample, seed=t + 1)
                    rows.append(
                        _row(pattern, t, dtype_name, backward, times, fastest, duel, pairs,
                             peak_gflops)
                    )  # fmt: skip
                    what = {n: ran(n, q, k, v, kwargs, backward) for n in BACKENDS}
                    rows[-1]["ran"] = what
                    rows[-1]["same"] = what["auto"] == what[rows[-1]["fastest"]]
    return rows


def _fastest(times: dict[str, list[float]]) -> str:
    """The backend (not ``auto``) of the lowest median time."""
    return min((spread(ts)[0], n) for n, ts in times.items() if n != "auto")[1]


def _row(
    pattern: str,
    t: int,
    dtype: str,
    backward: bool,
    times: dict[str, list[float]],
    fastest: str,
    duel: dict[str, list[float]],
    pairs: int,
    peak_gflops: float,
) -> dict:
    med = {n: spread(ts)[0] for n, ts in times.items()}
    ratio = paired_ratio(duel["auto"], duel[fastest])
    b, h, d = SHAPE
    flops = 4 * b * h * pairs * d * (3.5 if backward else 1.0)
    share = 100 * flops / med["blockwise"] / 1e9 / peak_gflops if dtype == "fp32" else None
    return {
        "pattern": pattern, "t": t, "dtype": dtype,
        "direction": "fwd+bwd" if backward else "fwd",
        "seconds": med, "fastest": fastest, "auto/fastest": ratio[0],
        "auto/fastest quartiles": [ratio[1], ratio[2]],
        "blockwise % of peak": share,
    }  # fmt: skip


def markdown_rows(rows: list[dict]) -> list[str]:
    """The grid as a Markdown table, and its worst ratios (every row; rows where ``auto``
    ran other engines than the fastest)."""
    lines = [
        "| pattern | T | dtype | direction | fastest | auto ran | auto / fastest [quartiles] "
        "| blockwise % of peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q1, q3 = r.get("auto/fastest quartiles", [r["auto/fastest"]] * 2)
        ran_ = r.get("ran", {}).get("auto", "?")
        same = " (same)" if r.get("same") else ""
        share = r.get("blockwise % of peak")
        lines.append(
            f"| {r['pattern']} | {r['t']} | {r.get('dtype', 'fp32')} | {r['direction']} "
            f"| {r['fastest']} | {ran_}{same} | {r['auto/fastest']:.2f} [{q1:.2f}-{q3:.2f}] "
            f"| {'-' if share is None else f'{share:.0f}'} |"
        )
    worst = max(r["auto/fastest"] for r in rows)
    chosen = [r["auto/fastest"] for r in rows if not r.get("same")]
    lines += ["", f"worst auto / fastest: {worst:.2f}"]
    if chosen:
        lines.append(f"worst where auto ran other engines than the fastest: {max(chosen):.2f}")
    else:
        lines.append("auto ran the fastest backend's engines in every row")
    return lines
