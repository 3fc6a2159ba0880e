"""Benchmarks of shared-prefix cascades and draft-tree verification (issue 20, items 4-5).

Targets (ratios of cases timed round-robin in one run, fp32 and bf16; see
:mod:`attnkit.bench.timing`):

* cascade: 8 requests decoding one token each over 2048 shared + 128 own keys, through
  :func:`attnkit.cascade_attention` (the prefix read once) / 8 independent
  :func:`attnkit.attention` calls over each request's whole 2176 keys (goal <= 0.35);
  the suffixes' prefill (128 queries per request) is timed beside it (a case, no goal:
  the same arithmetic either way, so only the prefix's memory traffic is saved);
* tree: a 32-node draft tree verified against a 2048-key cache with
  :func:`attnkit.tree_attention` / 32 sequential decode steps (1 query over 2048 + i
  keys each; goal <= 0.25).

Heads: 8 query heads, 2 key/value heads (GQA), head_dim 64. Run alone with
``python -m attnkit.bench.cascade_tree [--quick] [--reps N]``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from attnkit import attention, build_tree, cascade_attention, tree_attention
from attnkit.bench.peers import Runner
from attnkit.bench.timing import DTYPES, Case, case_ratio, ratio_text, time_cases

SHAPE = {"h": 8, "h_kv": 2, "d": 64}
#: Seconds a timed sample lasts at least (a decode call, ~0.1-1 ms, repeated).
MIN_SAMPLE = 0.02
REQUESTS, OWN, NODES = 8, 128, 32


def runner(impl: str, *, pattern: str, t: int, dtype: torch.dtype, **shape: int) -> Runner:
    """A closure running one case (``t``: shared prefix or cache length; ``shape``: heads,
    head_dim and, for cascades, ``n`` requests with ``own`` keys each)."""
    h, h_kv, d = shape["h"], shape["h_kv"], shape["d"]
    gen = torch.Generator().manual_seed(0)

    def r(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    if impl in ("cascade", "independent"):
        n, own = shape["n"], shape["own"]
        rows = 1 if pattern == "decode" else own  # queries per request
        q = r(n, h, rows, d)
        pk, pv = r(h_kv, t, d), r(h_kv, t, d)
        sk, sv = r(n, h_kv, own, d), r(n, h_kv, own, d)
        if impl == "cascade":
            return lambda: cascade_attention(q, pk, pv, sk, sv)
        # each request's whole sequence, stored as it would be without sharing
        whole = [
            (torch.cat((pk, sk[i]), 1)[None], torch.cat((pv, sv[i]), 1)[None]) for i in range(n)
        ]

        def independent() -> list[torch.Tensor]:
            return [
                attention(q[i : i + 1], k, v, causal=True)  # type: ignore[misc]
                for i, (k, v) in enumerate(whole)
            ]

        return independent
    n = shape["nodes"]
    tree = build_tree([-1] + [(i - 1) // 2 for i in range(1, n)])  # a binary draft tree
    q = r(1, h, n, d)
    k, v = r(1, h_kv, t + n, d), r(1, h_kv, t + n, d)
    if impl == "tree":
        kc, vc, kt, vt = k[:, :, :t], v[:, :, :t], k[:, :, t:], v[:, :, t:]
        return lambda: tree_attention(q, kc, vc, kt, vt, tree)
    if impl == "sequential":

        def sequential() -> list[torch.Tensor]:
            # one decode step per node: 1 query over the cache and the i keys before it
            return [
                attention(q[:, :, i : i + 1], k[:, :, : t + i + 1], v[:, :, : t + i + 1])  # type: ignore[misc]
                for i in range(n)
            ]

        return sequential
    raise ValueError(f"unknown implementation {impl!r}")


def build(case: Case) -> Runner:
    """The runner of one of this module's cases."""
    shape = {k: v for k, v in case.shape.items() if k != "group"}
    return runner(case.impl, pattern=case.pattern, t=case.t, dtype=DTYPES[case.dtype], **shape)


def target_cases(quick: bool) -> dict[str, list[Case]]:
    """The cases behind the cascade and tree targets (shorter prefixes in quick mode)."""
    prefix = 256 if quick else 2048
    cascade = {**SHAPE, "group": "cascade", "n": REQUESTS, "own": 16 if quick else OWN}
    tree = {**SHAPE, "group": "tree", "nodes": 8 if quick else NODES}
    cases: dict[str, list[Case]] = {"cascade": [], "tree": []}
    for dtype in ("fp32", "bf16"):
        for pattern in ("decode", "prefill") if dtype == "fp32" else ("decode",):
            for impl in ("cascade", "independent"):
                cases["cascade"].append(
                    Case("serving", impl, pattern, prefix, dtype, False, cascade)
                )
        for impl in ("tree", "sequential"):
            cases["tree"].append(Case("serving", impl, "tree", prefix, dtype, False, tree))
    return cases


def ratios(cases: dict[str, list[Case]]) -> list[dict]:
    """The targets as ratios of cases measured in this run (:func:`.timing.case_ratio`:
    the median of the per-round ratios, with quartiles and the ratio of medians)."""

    def case(group: str, impl: str, pattern: str, dtype: str) -> Case | None:
        return next(
            (
                c
                for c in cases[group]
                if c.impl == impl and c.pattern == pattern and c.dtype == dtype
            ),
            None,
        )

    rows = []
    for dtype in ("fp32", "bf16"):
        c = next((c for c in cases["cascade"] if c.dtype == dtype), None)
        if c is not None:
            n, own, p = c.shape["n"], c.shape["own"], c.t
            rows.append(
                {
                    "target": "cascade",
                    "what": f"cascade / {n} independent calls, {n} x ({p} shared + {own} own), "
                    f"decode, {dtype}, fwd",
                    **case_ratio(
                        case("cascade", "cascade", "decode", dtype),
                        case("cascade", "independent", "decode", dtype),
                    ),
                    "goal": "<= 0.35",
                }
            )
        tr = next((c for c in cases["tree"] if c.dtype == dtype), None)
        if tr is not None:
            nodes = tr.shape["nodes"]
            rows.append(
                {
                    "target": "tree",
                    "what": f"{nodes}-node tree verification / {nodes} sequential decode "
                    f"steps, L={tr.t}, {dtype}, fwd",
                    **case_ratio(
                        case("tree", "tree", "tree", dtype),
                        case("tree", "sequential", "tree", dtype),
                    ),
                    "goal": "<= 0.25",
                }
            )
    return rows


def time_targets(cases: dict[str, list[Case]], reps: int) -> list[dict]:
    """Time the cases (those of one ratio round-robin); return the ratios."""
    for group in ("cascade", "tree"):
        for key in sorted({(c.pattern, c.dtype) for c in cases[group]}):
            todo = [c for c in cases[group] if (c.pattern, c.dtype) == key]
            time_cases(todo, reps, build, min_sample=MIN_SAMPLE)
    return ratios(cases)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.cascade_tree")
    parser.add_argument("--quick", action="store_true", help="toy sizes (not graded)")
    parser.add_argument(
        "--reps", type=int, default=10, help="timed rounds (the ratio: their median)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cases = target_cases(args.quick)
    rows = time_targets(cases, args.reps)
    print(f"threads: {torch.get_num_threads()}, torch {torch.__version__}")
    for cs in cases.values():
        for c in cs:
            secs = "-" if c.seconds is None else f"{c.seconds * 1e3:.3f} ms"
            print(
                f"  {c.shape['group']:8s} {c.impl:12s} {c.pattern:8s} {c.dtype} t={c.t} "
                f"{secs} {c.note}"
            )
    for row in rows:
        print(f"{row['target']}: {row['what']}: {ratio_text(row)} (goal {row['goal']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
