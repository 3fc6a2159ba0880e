"""What every benchmark table is made of: a :class:`Case`, and timing cases round-robin.

Shared by :mod:`attnkit.bench.suite` and :mod:`attnkit.bench.kernel_layer`; a bench module
says how to turn a case into something to run (its ``build``), this module times it.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: The dtypes a case may name, by the name it stores.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Unsupported(Exception):
    """The implementation cannot run this case (e.g. FlexAttention backward on CPU)."""


@dataclass
class Case:
    """One measurement: what ran, and its median seconds (or why it did not run)."""

    group: str
    impl: str
    pattern: str
    t: int
    dtype: str
    backward: bool
    shape: dict
    seconds: float | None = None
    peak_mb: float | None = None
    note: str = ""
    times: list[float] = field(default_factory=list)


#: Turns a case into a function that runs it once (raises :class:`Unsupported` when it cannot).
Build = Callable[[Case], Callable[[], object]]


def prepare(case: Case, build: Build) -> Callable[[], object] | None:
    """Build and warm up ``case``'s runner; None (with ``case.note`` set) if it cannot run."""
    try:
        run = build(case)
        run()
    except Unsupported as err:
        case.note = f"unsupported: {err}"
        return None
    except Exception as err:  # a peer failing is a result, not a crash of the suite
        case.note = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        return None
    return run


def time_cases(cases: list[Case], reps: int, build: Build, min_sample: float = 0.0) -> list[Case]:
    """Fill ``seconds`` of each case with the median of ``reps`` runs after one warm-up.

    The cases are timed round-robin (one run of each per round): when the load of a
    shared machine changes, every case of a comparison sees the change alike, so
    their ratio holds better than when each case's runs come in one stretch.

    Args:
        cases: the cases to time (a case that cannot run keeps ``seconds=None`` and a note).
        reps: timed runs of each case.
        build: how to turn a case into a function that runs it once.
        min_sample: a run is the case repeated to last at least this many seconds
            (:func:`repeated`; times are per call): sub-millisecond calls timed one by one
            are mostly the clock's and the scheduler's noise.
    """
    runs = []
    for case in cases:
        run = prepare(case, build)
        if run is not None:
            runs.append((case, *(repeated(run, min_sample) if min_sample > 0 else (run, 1))))
    for _ in range(reps):
        for case, run, n in runs:
            start = time.perf_counter()
            run()
            case.times.append((time.perf_counter() - start) / n)
    for case, *_ in runs:
        case.seconds = statistics.median(case.times)
    return cases


def time_case(case: Case, reps: int, build: Build) -> Case:
    """Fill ``case.seconds`` with the median of ``reps`` runs after one warm-up."""
    return time_cases([case], reps, build)[0]


def repeated(fn: Callable[[], object], min_sample: float) -> tuple[Callable[[], object], int]:
    """``fn`` run ``n`` times in a row, ``n`` chosen (from one timed run, after a warm-up) so
    that one sample lasts at least ``min_sample`` seconds: a 2 ms call timed alone is
    mostly the noise of the clock, the scheduler and a neighbour's burst."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    n = max(1, math.ceil(min_sample / once))

    def run() -> None:
        for _ in range(n):
            fn()

    return run, n


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, min_sample: float = 0.0, seed: int = 0
) -> dict[str, list[float]]:
    """Seconds per call of each closure in each of ``reps`` rounds.

    Each closure is first made into a sample of at least ``min_sample`` seconds
    (:func:`repeated`); every round then runs each sample once, in another (seeded) order,
    so that none always runs right after the same neighbour (a large free before a call
    made it page-fault its fresh buffers: 1.3x) and a change of the machine's load falls
    on every closure of a round alike. Round ``i`` of two closures is a pair: the ratio
    of their round-``i`` times is a paired sample of their ratio.
    """
    samples = {name: repeated(fn, min_sample) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(samples.items())
    shuffle = random.Random(seed).shuffle
    for _ in range(reps):
        shuffle(order)
        for name, (run, n) in order:
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / n)
    return times


def paired_ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """``(median, lower quartile, upper quartile)`` of the per-round ratios ``num[i] /
    den[i]``: how every target ratio of the benches is read.

    Rounds come from :func:`interleaved` or :func:`time_cases`, so round ``i`` of the two
    sides ran back to back. On a shared machine whose speed drifts between rounds (the
    same call 0.85 ms in one round and 1.3 ms a few seconds later), a drift falls on both
    sides of a pair alike and divides out of its ratio; the ratio of the two medians
    instead mixes rounds of different speeds (its two medians may come from different
    rounds).

    Raises:
        ValueError: if the two lists differ in length or are empty, or a time is not
            positive.
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"paired_ratio needs two equal, non-empty lists: {len(num)}, {len(den)}")
    if min(den) <= 0 or min(num) <= 0:
        raise ValueError("paired_ratio needs positive times")
    return spread([a / b for a, b in zip(num, den, strict=True)])


def ratio_row(num: list[float], den: list[float]) -> dict[str, Any]:
    """A target row's numbers for the per-round times ``num`` over ``den``: ``ratio`` (the
    median of the per-round ratios, the target's reading, :func:`paired_ratio`), its
    ``quartiles``, and ``ratio of medians`` beside it."""
    mid, q1, q3 = paired_ratio(num, den)
    medians = statistics.median(num) / statistics.median(den)
    return {"ratio": mid, "quartiles": [q1, q3], "ratio of medians": medians}


def case_ratio(num: Case | None, den: Case | None) -> dict[str, Any]:
    """:func:`ratio_row` of two cases timed round-robin (:func:`time_cases`); every value
    None where a case did not run."""
    if num is None or den is None or not num.times or not den.times:
        return {"ratio": None, "quartiles": None, "ratio of medians": None}
    return ratio_row(num.times, den.times)


def ratio_text(row: dict[str, Any]) -> str:
    """A :func:`case_ratio` row as text: ``0.93 [0.91-0.95]`` (median of the per-round
    ratios [quartiles]), ``-`` where a case did not run."""
    if row.get("ratio") is None:
        return "-"
    q1, q3 = row.get("quartiles") or (row["ratio"], row["ratio"])
    return f"{row['ratio']:.3f} [{q1:.3f}-{q3:.3f}]"


def spread(values: list[float]) -> tuple[float, float, float]:
    """``(median, lower quartile, upper quartile)`` of ``values`` (all three the value of a
    single one)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q1, q3
