"""Packed batches, split-KV decoding and document block masks: their targets, measured in
one run (issue 20 items 1 and 3, issue 21 item 4).

* ``varlen``: 8 causal documents x 1024 packed (``cu_seqlens``), forward+backward, over
  the same through a document block mask (goal <= 1.1), fp32 and bf16;
* ``split-kv``: a decode step (B=1, H_kv=2, one query, L=16384 keys) on the native kernel,
  2 threads over 1 thread (goal <= 0.6; the kernel splits the keys into ranges), fp32 and
  bf16;
* ``doc-mask``: :func:`attnkit.document_block_mask` at T=65,536 with 64 documents, in ms
  (goal <= 5), equal and random lengths, causal.

Cases of one ratio are timed round-robin (:func:`attnkit.bench.timing.time_cases`), and a
ratio is the median of the per-round ratios (:func:`attnkit.bench.timing.case_ratio`). Run
``python -m attnkit.bench.varlen [--quick] [--reps N]``; ``attnkit bench`` runs it too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from attnkit.attention import attention
from attnkit.backends.blockwise import native
from attnkit.bench.timing import DTYPES, Case, Unsupported, case_ratio, ratio_text, time_cases
from attnkit.document_mask import document_block_mask

__all__ = ["doc_mask_ms", "main", "target_cases", "time_targets"]

#: Decode steps per timed sample of the split-KV cases (seconds are reported per step).
STEPS = 20


def target_cases(quick: bool) -> dict[str, list[Case]]:
    """The cases behind the ratios (toy sizes when ``quick``)."""
    docs, doc_len, length = (2, 128, 2048) if quick else (8, 1024, 16384)
    packed = {"docs": docs, "doc_len": doc_len, "h": 4, "d": 64}
    decode = {"h": 2, "h_kv": 2, "d": 64}
    cases: dict[str, list[Case]] = {"varlen": [], "split-kv": []}
    for dtype in ("fp32", "bf16"):
        for impl in ("packed", "block-mask"):
            cases["varlen"].append(
                Case("varlen", impl, "documents", docs * doc_len, dtype, True, packed)
            )
        for threads in (1, 2):
            cases["split-kv"].append(
                Case(
                    "split-kv",
                    f"{threads} thread",
                    "decode",
                    length,
                    dtype,
                    False,
                    {**decode, "threads": threads},
                )
            )
    return cases


def build(case: Case) -> Callable[[], object]:
    """A function running ``case`` once."""
    dt = DTYPES[case.dtype]
    g = torch.Generator().manual_seed(0)
    if case.group == "varlen":
        docs, doc_len, h, d = (case.shape[k] for k in ("docs", "doc_len", "h", "d"))
        cu = torch.arange(0, docs * doc_len + 1, doc_len)
        q, k, v = (torch.randn(docs * doc_len, h, d, generator=g).to(dt) for _ in range(3))
        grad = torch.randn(docs * doc_len, h, d, generator=g).to(dt)
        if case.impl == "packed":
            leaves = [x.requires_grad_() for x in (q, k, v)]

            def packed() -> object:
                out = attention(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
                out.backward(grad)
                return out

            return packed
        bm = document_block_mask(cu, causal=True)
        four = [x.transpose(0, 1).unsqueeze(0).requires_grad_() for x in (q, k, v)]
        grad4 = grad.transpose(0, 1).unsqueeze(0)

        def masked() -> object:
            out = attention(*four, block_mask=bm)
            out.backward(grad4)
            return out

        return masked
    if case.group == "split-kv":
        if not native.available():
            raise Unsupported(f"no native kernel: {native.status()}")
        h, h_kv, d, threads = (case.shape[k] for k in ("h", "h_kv", "d", "threads"))
        q = torch.randn(1, h, 1, d, generator=g).to(dt)
        k, v = (torch.randn(1, h_kv, case.t, d, generator=g).to(dt) for _ in range(2))

        def decode() -> object:
            # a sample is STEPS calls (a decode step lasts ~0.2 ms: one call is timer and
            # scheduler noise), the thread count set once around them; seconds per step
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                for _ in range(STEPS):
                    out = attention(q, k, v, backend="blockwise")
                return out
            finally:
                torch.set_num_threads(before)

        return decode
    raise ValueError(f"unknown group {case.group!r}")


def doc_mask_ms(total: int, docs: int, *, equal: bool, causal: bool, reps: int) -> float:
    """Median milliseconds of :func:`document_block_mask` (documents of equal or random
    lengths, seeded)."""
    if equal:
        cu = torch.arange(0, total + 1, total // docs)
    else:
        g = torch.Generator().manual_seed(0)
        cuts = torch.sort(torch.randperm(total - 1, generator=g)[: docs - 1] + 1).values
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])
    document_block_mask(cu, causal=causal)
    times = []
    for _ in range(max(reps, 5)):
        start = time.perf_counter()
        document_block_mask(cu, causal=causal)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_targets(cases: dict[str, list[Case]], reps: int, quick: bool = False) -> list[dict]:
    """Time the cases (each ratio's pair round-robin); the target rows."""
    rows = []
    for group in ("varlen", "split-kv"):
        for dtype in ("fp32", "bf16"):
            pair = [c for c in cases[group] if c.dtype == dtype]
            time_cases(pair, reps, build)
            if group == "split-kv":  # a sample is STEPS decode steps
                for c in pair:
                    c.seconds = None if c.seconds is None else c.seconds / STEPS
            if group == "varlen":
                what = f"packed varlen / document block mask, {pair[0].t} tokens, fwd+bwd, {dtype}"
                ratio, goal = case_ratio(pair[0], pair[1]), "<= 1.1"
            else:
                what = f"split-KV decode L={pair[0].t}: 2 threads / 1 thread, {dtype}"
                ratio, goal = case_ratio(pair[1], pair[0]), "<= 0.6"
            rows.append({"target": group, "what": what, **ratio, "goal": goal})
    total, docs = (8192, 8) if quick else (65536, 64)
    for equal in (True, False):
        ms = doc_mask_ms(total, docs, equal=equal, causal=True, reps=reps)
        lengths = "equal" if equal else "random"
        rows.append({
            "target": "doc-mask",
            "what": f"document_block_mask ms, T={total}, {docs} causal documents ({lengths})",
            "ratio": ms,
            "goal": "<= 5",
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.varlen")
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke run)")
    parser.add_argument(
        "--reps",
        type=int,
        default=5,
        help="timed rounds (a ratio: the median of its rounds' ratios)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cases = target_cases(args.quick)
    rows = time_targets(cases, args.reps, args.quick)
    print(
        f"threads: {torch.get_num_threads()}, torch {torch.__version__}, native: {native.status()}"
    )
    for cs in cases.values():
        for c in cs:
            secs = "-" if c.seconds is None else f"{c.seconds * 1e3:.2f} ms"
            print(f"  {c.group:8s} {c.impl:10s} {c.dtype} T={c.t} {secs} {c.note}")
    for row in rows:
        r = ratio_text(row) if "quartiles" in row else f"{row['ratio']:.3g}"
        print(f"{row['target']}: {row['what']}: {r} (goal {row['goal']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
