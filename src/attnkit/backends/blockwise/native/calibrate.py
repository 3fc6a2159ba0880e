"""How the native kernel compares with torch's on this machine, measured once per build.

A kernel that is fast on one CPU can be slow on another (its AVX2 build ran 15x slower
than torch's on a Zen 3 before the kernel was made portable), so ``"auto"`` never trusts
a speed it has not seen here. On first use, each build times itself against
:func:`torch.nn.functional.scaled_dot_product_attention` on one dense causal case
(B=1, H=4, T=1024, d=64, float32, this process's thread count), forward and
forward+backward, medians of interleaved runs, and keeps the two ratios
(:class:`Speed`). They are cached as JSON beside the build (same private directory, keyed
by the library, torch's version and the thread count), so the decision is made once per
machine and is the same in every later process.

Where the ratio is above 1, the native kernel does not run dense plans (no mask or block
mask beyond causal): the fused engine takes torch's kernel there, and ``"auto"`` keeps
sdpa first; masked and sparse plans still run natively, where skipping tiles is what
makes it fast. ``ATTNKIT_NATIVE_SPEED=fast|slow`` skips the measurement (tests, or a
user who knows better).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attnkit.backends.blockwise.native import build

__all__ = ["Speed", "speed"]

#: The measured case: (batch, heads, tokens, head size), causal, float32.
CASE = (1, 4, 1024, 64)
REPS = 5

_lock = threading.Lock()
_cache: dict[tuple, Speed] = {}
_measuring = threading.local()


@dataclass(frozen=True)
class Speed:
    """Native time over torch's on the measured case (below 1: native is faster)."""

    forward: float
    backward: float  # forward + backward
    source: str  # "measured", "cached", "ATTNKIT_NATIVE_SPEED" or "measurement failed (...)"

    @property
    def forward_ok(self) -> bool:
        return self.forward <= 1.0

    @property
    def backward_ok(self) -> bool:
        return self.backward <= 1.0


#: ``Speed.source`` when ``ATTNKIT_NATIVE_SPEED`` decides instead of a measurement.
FORCED = "ATTNKIT_NATIVE_SPEED"


def measuring() -> bool:
    """True while this thread is calibrating (the native kernel then runs every plan)."""
    return getattr(_measuring, "on", False)


def speed() -> Speed:
    """This machine's :class:`Speed` for the loaded build (measured on first use)."""
    forced = os.environ.get("ATTNKIT_NATIVE_SPEED")
    if forced in ("fast", "slow"):
        ratio = 0.5 if forced == "fast" else 2.0
        return Speed(ratio, ratio, FORCED)
    key = (build.status(), torch.__version__, torch.get_num_threads())
    with _lock:
        if key not in _cache:
            _cache[key] = _load_or_measure(key)
    return _cache[key]


def _cache_file(key: tuple) -> Path | None:
    """Beside the loaded library in the (private) cache directory; None for a private
    temporary build, whose measurement is kept for this process only."""
    _, version, threads = key
    library = build.library_file()
    if library is None or build._private_dir(library.parent) is not None:
        return None
    return library.with_name(f"{library.stem}.speed-torch{version}-{threads}t.json")


def _load_or_measure(key: tuple) -> Speed:
    path = _cache_file(key)
    if path is not None:
        try:
            data = json.loads(path.read_text())
            return Speed(float(data["forward"]), float(data["backward"]), "cached")
        except (OSError, ValueError, KeyError, TypeError):
            pass
    measured = _measure()
    if path is not None and measured.source == "measured":  # a failure is not kept
        with contextlib.suppress(OSError):
            build._write_atomic(path, json.dumps(asdict(measured)))
    return measured


def _median_ratio(native, torch_fn) -> float:
    native(), torch_fn()  # warm up
    ratios = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        native()
        t1 = time.perf_counter()
        torch_fn()
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / max(t2 - t1, 1e-9))
    return statistics.median(ratios)


def _measure() -> Speed:
    """Time the case; a measurement that fails for any reason counts as "slower" (torch's
    kernel keeps dense plans), never as an error in the call that triggered it."""
    _measuring.on = True
    try:
        # The first dense call may come from inside no_grad() or inference_mode(): measure
        # in a context of our own, with gradients on for the backward.
        with torch.inference_mode(False), torch.enable_grad():
            forward, backward = _time_case()
    except Exception as err:  # any failure: the safe answer, and why
        return Speed(2.0, 2.0, f"measurement failed ({type(err).__name__}: {err})")
    finally:
        _measuring.on = False
    return Speed(round(forward, 3), round(backward, 3), "measured")


def _time_case() -> tuple[float, float]:
    from attnkit.attention import attention  # (the core imports the backends)

    b, h, t, d = CASE
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        forward = _median_ratio(
            lambda: attention(q, k, v, causal=True, backend="blockwise"),
            lambda: sdpa(q, k, v, is_causal=True),
        )
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def native_step():
        attention(qg, kg, vg, causal=True, backend="blockwise").sum().backward()

    def torch_step():
        sdpa(qg, kg, vg, is_causal=True).sum().backward()

    return forward, _median_ratio(native_step, torch_step)
