"""Benchmarks of the kernel layer (issue 10): block masks, cached mod plans, documents,
sinks, and compiled FlexAttention on CPU as a peer.

Targets (ratios measured in one run, cases timed round-robin; see :mod:`attnkit.bench.timing`):

* f: a sliding window (w=256) given as a ``mask_mod`` through a block mask, against
  SDPA with the dense mask (>= 8x) and against ``window=256`` (<= 1.25x), T = 8192, 16384;
* g: the same window as a *plain* ``mask_mod=`` called again and again (its plan cached)
  against SDPA with the dense mask (>= 6x);
* h: 8 packed causal documents of 1024 through a block mask against SDPA dense (>= 4x);
* i: causal attention with learned sinks against the same without (<= 1.1x);
* j: attnkit against ``torch.compile(flex_attention)`` on CPU for causal, window, ALiBi and
  documents, forward (<= 0.8x on every build); FlexAttention has no CPU backward, so
  attnkit's fwd+bwd is reported alone.

Run alone with ``python -m attnkit.bench.kernel_layer [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.nn.functional as F

from attnkit import attention, create_block_mask
from attnkit import masks as M
from attnkit.bench.peers import Runner, _with_backward
from attnkit.bench.timing import DTYPES, Case, Unsupported, case_ratio, ratio_text, time_cases

WINDOW = 256
DOC_LEN = 1024
SHAPE = {"b": 1, "h": 4, "d": 64}


def _window_mod(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


def _documents(t: int) -> torch.Tensor:
    return torch.arange(t) // min(DOC_LEN, max(1, t // 8))  # 8 documents


def _dense(pattern: str, t: int, h: int) -> torch.Tensor:
    i, j = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    if pattern == "window256":
        return (j <= i) & (j > i - WINDOW)  # (t, t) bool, True = attend
    if pattern == "documents":
        ids = _documents(t)
        return (ids.view(-1, 1) == ids.view(1, -1)) & (j <= i)
    raise ValueError(pattern)


def runner(
    impl: str, *, pattern: str, t: int, b: int, h: int, d: int, dtype: torch.dtype, backward: bool
) -> Runner:
    """A closure running one case of this module's targets (see the module docs)."""
    q, k, v = (torch.randn(b, h, t, d, dtype=dtype, requires_grad=backward) for _ in range(3))
    fn: Runner
    if impl == "sdpa-dense":
        dense = _dense(pattern, t, h)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
    elif impl == "attnkit-window":
        fn = lambda: attention(q, k, v, causal=True, window=WINDOW)  # noqa: E731
    elif impl == "attnkit-block_mask":
        if pattern == "window256":
            bm = create_block_mask(_window_mod, None, None, t, t)
        else:
            bm = create_block_mask(M.document(_documents(t)), None, None, t, t)
        causal = pattern == "documents"
        fn = lambda: attention(q, k, v, block_mask=bm, causal=causal)  # noqa: E731
    elif impl == "attnkit-mask_mod":  # a plain mask_mod, called repeatedly
        fn = lambda: attention(q, k, v, mask_mod=_window_mod)  # noqa: E731
    elif impl in ("attnkit-causal", "attnkit-causal+sinks"):
        sinks = torch.randn(h, requires_grad=backward) if impl.endswith("sinks") else None
        fn = lambda: attention(q, k, v, causal=True, sinks=sinks, backend="blockwise")  # noqa: E731
    elif impl == "attnkit":
        fn = _attnkit_pattern(q, k, v, pattern)
    elif impl == "flex-compiled":
        fn = _flex_compiled(q, k, v, pattern, backward)
    else:
        raise ValueError(f"unknown implementation {impl!r}")
    return _with_backward(fn, backward)


def build(case: Case) -> Runner:
    """The runner of one of this module's cases (``case.shape`` holds ``group`` beside the sizes)."""
    shape = {k: v for k, v in case.shape.items() if k != "group"}
    return runner(
        case.impl,
        pattern=case.pattern,
        t=case.t,
        dtype=DTYPES[case.dtype],
        backward=case.backward,
        **shape,
    )


def _attnkit_pattern(q, k, v, pattern: str) -> Runner:
    t, h = q.shape[-2], q.shape[1]
    if pattern == "causal":
        return lambda: attention(q, k, v, causal=True)
    if pattern == "window256":
        return lambda: attention(q, k, v, causal=True, window=WINDOW)
    if pattern == "alibi":
        return lambda: attention(q, k, v, causal=True, score_mod=M.alibi(h))
    bm = create_block_mask(M.document(_documents(t)), None, None, t, t)
    return lambda: attention(q, k, v, causal=True, block_mask=bm)


def _flex_compiled(q, k, v, pattern: str, backward: bool) -> Runner:
    try:
        from torch.nn.attention.flex_attention import create_block_mask as flex_mask
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as err:  # pragma: no cover
        raise Unsupported(f"FlexAttention unavailable: {err}") from err
    if backward and q.device.type == "cpu":
        raise Unsupported("FlexAttention has no backward on CPU")
    t, h = q.shape[-2], q.shape[1]
    ids = _documents(t)
    slopes = M.alibi_slopes(h)

    def causal(b, hh, qi, ki):
        return ki <= qi

    def documents(b, hh, qi, ki):
        return (ids[qi] == ids[ki]) & (ki <= qi)

    def alibi(score, b, hh, qi, ki):
        return score - slopes[hh] * (qi - ki).abs()

    mods = {"causal": causal, "window256": _window_mod, "alibi": causal, "documents": documents}
    block = flex_mask(mods[pattern], None, None, t, t, device="cpu")
    compiled = torch.compile(flex_attention)
    score_mod = alibi if pattern == "alibi" else None

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return compiled(q, k, v, score_mod=score_mod, block_mask=block)

    return run


def target_cases(quick: bool, flex: bool | None = None) -> dict[str, list[Case]]:
    """The cases behind targets f-j (shrunk in quick mode, where compiling FlexAttention,
    a minute per pattern, is left out unless ``flex`` says otherwise)."""
    lengths = (512, 1024) if quick else (8192, 16384)
    t = lengths[0]
    flex = (not quick) if flex is None else flex

    def case(group, impl, pattern, t_, bw=False):
        return Case("layer", impl, pattern, t_, "fp32", bw, {**SHAPE, "group": group})

    cases: dict[str, list[Case]] = {g: [] for g in "fghij"}
    for t_ in lengths:
        for impl in ("attnkit-block_mask", "attnkit-window", "sdpa-dense"):
            cases["f"].append(case("f", impl, "window256", t_))
    for impl in ("attnkit-mask_mod", "sdpa-dense"):
        cases["g"].append(case("g", impl, "window256", t))
    for impl in ("attnkit-block_mask", "sdpa-dense"):
        cases["h"].append(case("h", impl, "documents", t))
    for bw in (False, True):
        for impl in ("attnkit-causal", "attnkit-causal+sinks"):
            cases["i"].append(case("i", impl, "causal", t, bw))
    for pattern in ("causal", "window256", "alibi", "documents"):
        for bw in (False, True):
            cases["j"].append(case("j", "attnkit", pattern, t, bw))
            if flex:
                cases["j"].append(case("j", "flex-compiled", pattern, t, bw))
    return cases


def ratios(cases: dict[str, list[Case]]) -> list[dict]:
    """Targets f-j as ratios of cases measured in this run (:func:`.timing.case_ratio`:
    the median of the per-round ratios, with quartiles and the ratio of medians)."""

    def found(group, impl, pattern=None, t=None, bw=False) -> Case | None:
        for c in cases[group]:
            if (
                c.impl == impl
                and c.backward == bw
                and pattern in (None, c.pattern)
                and t in (None, c.t)
            ):
                return c
        return None

    ratio = case_ratio

    rows = []
    for t in sorted({c.t for c in cases["f"]}):
        ours = found("f", "attnkit-block_mask", t=t)
        rows.append(
            {
                "target": "f",
                "what": f"SDPA dense / attnkit mask_mod window block mask, T={t}, fwd",
                **ratio(found("f", "sdpa-dense", t=t), ours),
                "goal": ">= 8",
            }
        )
        rows.append(
            {
                "target": "f",
                "what": f"attnkit block mask / attnkit window=256, T={t}, fwd",
                **ratio(ours, found("f", "attnkit-window", t=t)),
                "goal": "<= 1.25",
            }
        )
    rows.append(
        {
            "target": "g",
            "what": "SDPA dense / attnkit repeated plain mask_mod (window), fwd",
            **ratio(found("g", "sdpa-dense"), found("g", "attnkit-mask_mod")),
            "goal": ">= 6",
        }
    )
    rows.append(
        {
            "target": "h",
            "what": "SDPA dense / attnkit 8 causal documents (block mask), fwd",
            **ratio(found("h", "sdpa-dense"), found("h", "attnkit-block_mask")),
            "goal": ">= 4",
        }
    )
    for bw in (False, True):
        rows.append(
            {
                "target": "i",
                "what": f"blockwise causal with sinks / without, {'fwd+bwd' if bw else 'fwd'}",
                **ratio(
                    found("i", "attnkit-causal+sinks", bw=bw), found("i", "attnkit-causal", bw=bw)
                ),
                "goal": "<= 1.1",
            }
        )
    for pattern in ("causal", "window256", "alibi", "documents"):
        rows.append(
            {
                "target": "j",
                "what": f"attnkit / compiled FlexAttention (CPU), {pattern}, fwd",
                **ratio(found("j", "attnkit", pattern), found("j", "flex-compiled", pattern)),
                "goal": "<= 0.8",
            }
        )
    return rows


def time_targets(cases: dict[str, list[Case]], reps: int) -> list[dict]:
    """Time the cases (those of one target, direction and length round-robin); the ratios."""
    for group in "fghij":
        for bw in (False, True):
            for t in sorted({c.t for c in cases[group]}):
                todo = [c for c in cases[group] if c.backward == bw and c.t == t]
                if todo:
                    time_cases(todo, reps, build)
    return ratios(cases)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.kernel_layer")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-flex", action="store_true", help="leave compiled FlexAttention out")
    parser.add_argument("--only", default="fghij", help="target letters to run, e.g. 'fi'")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cases = target_cases(args.quick, False if args.no_flex else None)
    cases = {g: (cs if g in args.only else []) for g, cs in cases.items()}
    rows = time_targets(cases, args.reps)
    print(f"threads: {torch.get_num_threads()}, torch {torch.__version__}")
    for cs in cases.values():
        for c in cs:
            secs = "-" if c.seconds is None else f"{c.seconds:.4f}"
            bw = "fwd+bwd" if c.backward else "fwd"
            print(
                f"  {c.shape['group']} {c.impl:22s} {c.pattern:10s} T={c.t} {bw:8s} {secs} {c.note}"
            )
    for row in rows:
        print(f"{row['target']}: {row['what']}: {ratio_text(row)} (goal {row['goal']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
