"""Eager vs ``torch.compile`` speed of attnkit's MultiHeadAttention, per backend, in one run.

Usage::

    PYTHONPATH=src python benchmarks/bench_compile.py [--batch 4 --tokens 256 --d-out 256]

Prints one row per backend: eager and compiled milliseconds per forward (median of
``--repeats`` timed runs after warm-up, compile time excluded) and their ratio. Compare
ratios within one run only; absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import attnkit


def _median_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--d-out", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backends", nargs="+", default=["reference", "sdpa"])
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(args.batch, args.tokens, args.d_out)  # (b, t, d_in)
    print(
        f"MultiHeadAttention b={args.batch} t={args.tokens} d_out={args.d_out} "
        f"heads={args.num_heads}, causal, eval, {torch.get_num_threads()} threads"
    )
    print(f"{'backend':<10} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8} {'compile s':>10}")
    for backend in args.backends:
        torch._dynamo.reset()
        mha = attnkit.MultiHeadAttention(
            args.d_out, args.d_out, args.tokens, 0.0, num_heads=args.num_heads, backend=backend
        ).eval()
        compiled = torch.compile(mha, fullgraph=True)
        with torch.no_grad():
            start = time.perf_counter()
            expected = compiled(x)
            compile_s = time.perf_counter() - start
            torch.testing.assert_close(expected, mha(x), atol=1e-4, rtol=1e-4)
            for _ in range(3):
                mha(x), compiled(x)
            eager_ms = _median_ms(lambda m=mha: m(x), args.repeats)
            compiled_ms = _median_ms(lambda c=compiled: c(x), args.repeats)
        print(
            f"{backend:<10} {eager_ms:>9.2f} {compiled_ms:>12.2f} "
            f"{eager_ms / compiled_ms:>7.2f}x {compile_s:>10.1f}"
        )


if __name__ == "__main__":
    main()
