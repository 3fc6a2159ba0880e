"""GPU benchmark of the triton backend: TFLOP/s and ratios against peers timed in one run.

``python -m attnkit.bench.gpu [--quick] [--out docs/benchmarks/gpu] [--reps 10]``

Two groups, bf16, every peer of a case timed round-robin (CUDA events, median):

* **dense**: full and causal attention at head dims 64 and 128, T = 1k ... 16k, forward
  and forward+backward: ``attnkit triton`` against torch SDPA restricted to
  ``SDPBackend.FLASH_ATTENTION`` and SDPA's default choice (cuDNN where torch picks it).
  Targets: forward >= 0.8x and forward+backward >= 0.65x of SDPA-flash.
* **mods**: sliding window, ALiBi (causal), packed documents (causal) and softcap
  (causal) at head dim 128: ``attnkit triton`` against compiled FlexAttention with the
  same mods and block masks (both masks built once, outside the timing). Target: >= 1.0x.

FLOPs follow flash-attn's convention, generalised to sparse masks: ``4 * d`` per kept
(query, key) pair per head for the forward (so full = ``4 b h T^2 d``, causal half of
that), and 3.5x the forward for forward+backward. Writes ``results.json``,
``results.md`` and one PNG per (group, head dim, pass) to ``--out``.

Without CUDA it prints one line and exits with status 2: nothing is measured or guessed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from attnkit.bench.report import check_output

Runner = Callable[[], Any]

DENSE_PEERS = ["attnkit-triton", "sdpa-flash", "sdpa-default"]
MOD_PEERS = ["attnkit-triton", "flex-compiled"]
MODS = ["window", "alibi", "documents", "softcap"]
WINDOW = 256
SOFTCAP = 50.0
#: (what, ours / peer ratio goal) per group and pass
GOALS = {
    ("dense", False): ("sdpa-flash", 0.8),
    ("dense", True): ("sdpa-flash", 0.65),
    ("mods", False): ("flex-compiled", 1.0),
    ("mods", True): ("flex-compiled", 1.0),
}


def flops(b: int, h: int, d: int, kept_pairs: int, backward: bool) -> float:
    """flash-attn's FLOP count: ``4 d`` per kept (query, key) pair and head, x3.5 with backward."""
    fwd = 4.0 * b * h * d * kept_pairs
    return fwd * 3.5 if backward else fwd


def _doc_ids(t: int, seed: int = 0) -> torch.Tensor:
    """Packed documents of random lengths (256 ... t/4) filling ``t`` positions."""
    gen = torch.Generator().manual_seed(seed)
    ids, pos, doc = torch.empty(t, dtype=torch.long), 0, 0
    while pos < t:
        n = int(torch.randint(256, max(257, t // 4), (1,), generator=gen))
        ids[pos : pos + n] = doc
        pos, doc = pos + n, doc + 1
    return ids


def _keep(pattern: str, t: int, ids: torch.Tensor | None) -> int:
    """Number of kept (query, key) pairs of one head."""
    if pattern == "full":
        return t * t
    if pattern in ("causal", "alibi", "softcap"):
        return t * (t + 1) // 2
    if pattern == "window":
        return sum(min(i + 1, WINDOW) for i in range(t))
    assert ids is not None
    counts = torch.bincount(ids).tolist()
    return sum(n * (n + 1) // 2 for n in counts)


def _runner(name: str, pattern: str, q, k, v, ids, backward: bool) -> Runner:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from attnkit import attention, create_block_mask
    from attnkit import masks as M

    h, t = q.shape[1], q.shape[2]
    causal = pattern != "full"
    if name == "attnkit-triton":
        kw: dict[str, Any] = {"causal": causal}
        if pattern == "window":
            kw["window"] = WINDOW
        elif pattern == "alibi":
            kw["score_mod"] = M.alibi(h, M.alibi_slopes(h).to(q.device))
        elif pattern == "softcap":
            kw["score_mod"] = M.softcap(SOFTCAP)
        elif pattern == "documents":
            mod = M.and_masks(M.document(ids.to(q.device)), M.causal("top_left"))
            kw = {"block_mask": create_block_mask(mod, None, None, t, t, device=q.device)}
        fn = lambda: attention(q, k, v, backend="triton", **kw)  # noqa: E731
    elif name in ("sdpa-flash", "sdpa-default"):

        def fn():
            if name == "sdpa-flash":
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return sdpa(q, k, v, is_causal=causal)
            return sdpa(q, k, v, is_causal=causal)

    elif name == "flex-compiled":
        fn = _flex(pattern, q, k, v, ids)
    else:
        raise ValueError(f"unknown peer {name!r}")
    if not backward:

        def run():
            with torch.no_grad():
                return fn()

        return run
    grad = torch.randn_like(q)

    def run_bwd():
        out = fn()
        return torch.autograd.grad(out, (q, k, v), grad)

    return run_bwd


def _flex(pattern: str, q, k, v, ids) -> Runner:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from attnkit import masks as M

    t = q.shape[2]
    slopes = M.alibi_slopes(q.shape[1]).to(q.device)
    doc = ids.to(q.device) if ids is not None else None

    def causal(b, h, qi, ki):
        return ki <= qi

    def window(b, h, qi, ki):
        return (ki <= qi) & (ki > qi - WINDOW)

    def documents(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    def alibi(score, b, h, qi, ki):
        return score - slopes[h] * (qi - ki).abs()

    def softcap(score, b, h, qi, ki):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    mask_mod = {"window": window, "documents": documents}.get(pattern, causal)
    block = create_block_mask(mask_mod, None, None, t, t, device=q.device)
    score_mod = {"alibi": alibi, "softcap": softcap}.get(pattern)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda: flex(q, k, v, score_mod=score_mod, block_mask=block)


def _warm(fns: dict[str, Runner]) -> dict[str, str]:
    """Run every runner twice (compile, autotune, allocate); a peer that fails is taken out
    of ``fns`` and returned with its error's first line, so one broken peer (torch 2.11's
    compiled FlexAttention did not compile ALiBi under triton 3.6) costs only its row."""
    failed = {}
    for name, fn in list(fns.items()):
        try:
            fn()
            fn()
        except Exception as err:  # any failure of a peer is its result
            if name == "attnkit-triton":
                raise
            failed[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
            del fns[name]
            print(f"  {name} failed: {failed[name]}", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    return failed


def _median_ms(fns: dict[str, Runner], reps: int) -> dict[str, float]:
    """Time every (warmed) runner ``reps`` times, round-robin, with CUDA events: median ms each."""
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return {n: sorted(ts)[len(ts) // 2] for n, ts in times.items()}


def _check(pattern: str, q, k, v, ids) -> float:
    """Max |triton - reference backend| on a slice, so a wrong kernel cannot post a number."""
    from attnkit import attention, create_block_mask
    from attnkit import masks as M

    n = min(q.shape[2], 1024)
    qs, ks, vs = (x[:1, :2, :n].detach() for x in (q, k, v))
    h = q.shape[1]
    kw: dict[str, Any] = {"causal": pattern != "full"}
    if pattern == "window":
        kw["window"] = WINDOW
    elif pattern == "alibi":
        kw["score_mod"] = M.alibi(2, M.alibi_slopes(h)[:2].to(q.device))
    elif pattern == "softcap":
        kw["score_mod"] = M.softcap(SOFTCAP)
    elif pattern == "documents":
        mod = M.and_masks(M.document(ids[:n].to(q.device)), M.causal("top_left"))
        kw = {"block_mask": create_block_mask(mod, None, None, n, n, device=q.device)}
    with torch.no_grad():
        ours = cast(torch.Tensor, attention(qs, ks, vs, backend="triton", **kw))
        ref = attention(qs.float(), ks.float(), vs.float(), backend="reference", **kw)
        ref = cast(torch.Tensor, ref)
    return float((ours.float() - ref).abs().max())


def cases(quick: bool) -> list[dict[str, Any]]:
    """Every (group, pattern, d, T, pass) measured; batch x T = 16k tokens, h x d = 2048."""
    lengths = [1024, 2048] if quick else [1024, 2048, 4096, 8192, 16384]
    out = []
    for backward in (False, True):
        for d in (64, 128):
            for pattern in ("full", "causal"):
                out += [
                    dict(group="dense", pattern=pattern, d=d, t=t, backward=backward)
                    for t in lengths
                ]
        for pattern in MODS:
            out += [
                dict(group="mods", pattern=pattern, d=128, t=t, backward=backward) for t in lengths
            ]
    return out


def run(out: Path, *, quick: bool, reps: int) -> dict[str, Any]:
    """Measure every case (see :func:`cases`); write JSON, Markdown and plots to ``out``."""
    rows: list[dict[str, Any]] = []
    result = {"machine": _machine(), "reps": reps, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    for case in cases(quick):
        d, t = case["d"], case["t"]
        b, h = max(1, 16384 // t), 2048 // d
        q, k, v = (
            torch.randn(
                b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=case["backward"]
            )
            for _ in range(3)
        )
        ids = _doc_ids(t) if case["pattern"] == "documents" else None
        peers = DENSE_PEERS if case["group"] == "dense" else MOD_PEERS
        err = _check(case["pattern"], q, k, v, ids)
        fns = {p: _runner(p, case["pattern"], q, k, v, ids, case["backward"]) for p in peers}
        failed = _warm(fns)
        ms = _median_ms(fns, reps)
        work = flops(b, h, d, _keep(case["pattern"], t, ids), case["backward"])
        tflops = {p: work / (m * 1e-3) / 1e12 for p, m in ms.items()}
        rows.append({**case, "b": b, "h": h, "ms": ms, "tflops": tflops, "failed": failed,
                     "max_err_vs_fp32": err})  # fmt: skip
        print(f"{case['group']} {case['pattern']} d={d} T={t} {'fwd+bwd' if case['backward'] else 'fwd'}: "
              + ", ".join(f"{p} {tf:.0f} TF/s" for p, tf in tflops.items()), flush=True)  # fmt: skip
        # after every row, so a run cut short by a time limit keeps what it measured
        (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(markdown(result))
    plots(result, out)
    return result


def _machine() -> dict[str, str]:
    props = torch.cuda.get_device_properties(0)
    import triton

    return {
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
    }


def markdown(result: dict[str, Any]) -> str:
    """The results table: TFLOP/s of every peer and ours / peer ratios, goals marked."""
    m = result["machine"]
    lines = [
        "# attnkit triton backend: GPU benchmark",
        "",
        f"{m['gpu']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; bf16, "
        f"median of {result['reps']} round-robin runs; TFLOP/s by flash-attn's FLOP convention.",
        "",
        "| group | pattern | d | T | pass | attnkit-triton TF/s | peer | peer TF/s | ratio | goal | met | max err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        goal_peer, goal = GOALS[(r["group"], r["backward"])]
        ours = r["tflops"]["attnkit-triton"]
        for peer, why in r.get("failed", {}).items():
            lines.append(
                f"| {r['group']} | {r['pattern']} | {r['d']} | {r['t']} | "
                f"{'fwd+bwd' if r['backward'] else 'fwd'} | {ours:.1f} | {peer} | failed: "
                f"{why.replace('|', '/')} | — | — | — | {r['max_err_vs_fp32']:.2g} |"
            )
        for peer, tf in r["tflops"].items():
            if peer == "attnkit-triton":
                continue
            ratio = ours / tf
            target = f">= {goal}" if peer == goal_peer else "—"
            met = ("yes" if ratio >= goal else "NO") if peer == goal_peer else "—"
            lines.append(
                f"| {r['group']} | {r['pattern']} | {r['d']} | {r['t']} | "
                f"{'fwd+bwd' if r['backward'] else 'fwd'} | {ours:.1f} | {peer} | {tf:.1f} | "
                f"{ratio:.2f} | {target} | {met} | {r['max_err_vs_fp32']:.2g} |"
            )
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    """One PNG per (group, pattern set, d, pass): TFLOP/s against T for every peer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install attnkit[viz]): no plots", file=sys.stderr)
        return []
    groups: dict[tuple, list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["group"], r["d"], r["backward"]), []).append(r)
    paths = []
    for (group, d, backward), rows in groups.items():
        patterns = sorted({r["pattern"] for r in rows})
        fig, axes = plt.subplots(
            1, len(patterns), figsize=(4.5 * len(patterns), 3.6), squeeze=False
        )
        for ax, pattern in zip(axes[0], patterns, strict=True):
            sel = sorted((r for r in rows if r["pattern"] == pattern), key=lambda r: r["t"])
            for peer in sel[0]["tflops"]:
                ax.plot(
                    [r["t"] for r in sel], [r["tflops"][peer] for r in sel], marker="o", label=peer
                )
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pattern}, d={d}, {'fwd+bwd' if backward else 'fwd'}")
            ax.set_xlabel("T")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{group}-d{d}-{'fwd_bwd' if backward else 'fwd'}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnkit.bench.gpu", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=Path("docs/benchmarks/gpu"), help="output folder"
    )
    parser.add_argument("--quick", action="store_true", help="T = 1k, 2k only")
    parser.add_argument("--reps", type=int, default=10, help="timed runs per peer (median)")
    args = parser.parse_args(argv)
    check_output(parser, "--out", args.out, folder=True)
    if not torch.cuda.is_available():
        print(
            "attnkit.bench.gpu needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured",
            file=sys.stderr,
        )
        return 2
    from attnkit.backends import available_backends

    if "triton" not in available_backends():
        print(
            "attnkit.bench.gpu needs triton (pip install attnkit[gpu]); nothing measured",
            file=sys.stderr,
        )
        return 2
    if args.reps < 1:
        print(f"--reps must be >= 1, got {args.reps}", file=sys.stderr)
        return 2
    run(args.out, quick=args.quick, reps=args.reps)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
