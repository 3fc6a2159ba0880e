"""The Python cost of one small attention call: what a decode step pays besides its kernel.

A decode step's kernel takes 0.01-0.3 ms, so the Python around it (validation, the plan,
the engine choice, the kernel's arguments) matters. Each row is the median of many calls
of one decode-sized case (q ``(1, 8, 1, 64)`` against k/v ``(1, 2, L, 64)``, float32,
no grad), in microseconds:

* ``sdpa``: :func:`torch.nn.functional.scaled_dot_product_attention` (``enable_gqa``),
  the floor a plain torch call pays;
* ``auto`` and ``blockwise``: :func:`attnkit.attention` with that backend;
* ``blockwise, no kernel``: the same with the native kernel's entry point replaced by a
  function that returns at once: everything the call costs but the kernel itself.

Run with ``python -m attnkit.bench.call_overhead [--keys L] [--calls N]`` (timings on a
busy machine are noisy: compare rows of one run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from attnkit import attention, explain_dispatch
from attnkit.backends.blockwise import native

__all__ = ["measure"]


def _median_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(max(10, calls // 20)):  # warm up (plans, caches, the kernel's threads)
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def measure(keys: int = 4096, calls: int = 2000) -> dict[str, float]:
    """Median microseconds per call of each row of the module docs, for ``keys`` keys."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1, 64, generator=gen)
    k, v = (torch.randn(1, 2, keys, 64, generator=gen) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows: dict[str, float] = {}
    with torch.no_grad():
        rows["sdpa"] = _median_us(lambda: sdpa(q, k, v, enable_gqa=True), calls)
        rows["auto"] = _median_us(lambda: attention(q, k, v), calls)
        rows["blockwise"] = _median_us(lambda: attention(q, k, v, backend="blockwise"), calls)
        real = native._kernel
        native._kernel = lambda name: lambda *args: 0  # type: ignore[assignment]
        try:
            rows["blockwise, no kernel"] = _median_us(
                lambda: attention(q, k, v, backend="blockwise"), calls
            )
        finally:
            native._kernel = real  # type: ignore[assignment]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.call_overhead")
    parser.add_argument("--keys", type=int, default=4096, help="keys of the decode step")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per row")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(
        f"decode step q (1, 8, 1, 64), k/v (1, 2, {args.keys}, 64), fp32, no grad; "
        f"threads: {torch.get_num_threads()}; native: {native.status()}"
    )
    q, kv = torch.zeros(1, 8, 1, 64), torch.zeros(1, 2, args.keys, 64)
    print("  " + explain_dispatch(q, kv, kv, backend="blockwise").replace("\n", "; "))
    for name, us in measure(args.keys, args.calls).items():
        print(f"  {name:22s} {us:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
