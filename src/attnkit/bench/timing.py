"""What every benchmark table is made of: a :class:`Case`, and timing cases round-robin.

Shared by :mod:`attnkit.bench.suite` and :mod:`attnkit.bench.kernel_layer`; a bench module
says how to turn a case into something to run (its ``build``), this module times it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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


def time_cases(cases: list[Case], reps: int, build: Build) -> list[Case]:
    """Fill ``seconds`` of each case with the median of ``reps`` runs after one warm-up.

    The cases are timed round-robin (one run of each per round): when the load of a
    shared machine changes, every case of a comparison sees the change alike, so
    their ratio holds better than when each case's runs come in one stretch.

    Args:
        cases: the cases to time (a case that cannot run keeps ``seconds=None`` and a note).
        reps: timed runs of each case.
        build: how to turn a case into a function that runs it once.
    """
    runs = [(case, run) for case in cases if (run := prepare(case, build)) is not None]
    for _ in range(reps):
        for case, run in runs:
            start = time.perf_counter()
            run()
            case.times.append(time.perf_counter() - start)
    for case, _ in runs:
        case.seconds = statistics.median(case.times)
    return cases


def time_case(case: Case, reps: int, build: Build) -> Case:
    """Fill ``case.seconds`` with the median of ``reps`` runs after one warm-up."""
    return time_cases([case], reps, build)[0]
