"""The attention benchmark suite: attnkit's backends and modules against their peers.

Run it as ``attnkit bench`` or ``python -m attnkit.bench.suite``. Every ratio it reports
is measured within one run (same machine, same load). Outputs, under ``--out``:
``results.json`` (every measurement plus the machine), ``results.md`` (tables and the
targets) and ``*.png`` plots (when matplotlib is installed).

Peak memory is measured in a fresh subprocess per case: peak RSS
(``ru_maxrss``) after the run minus the RSS once the inputs exist.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from attnkit.backends.blockwise import native
from attnkit.bench import cascade_tree, kernel_layer, peers, varlen
from attnkit.bench.report import check_output
from attnkit.bench.timing import DTYPES, Case, case_ratio, time_case, time_cases


def _build(case: Case) -> Callable[[], object]:
    """The runner of ``case``: a kernel, a module, or a kernel-layer case."""
    dt = DTYPES[case.dtype]
    if case.group == "layer":  # the kernel layer's targets (attnkit.bench.kernel_layer)
        return kernel_layer.build(case)
    if case.group == "serving":  # cascades and tree verification (attnkit.bench.cascade_tree)
        return cascade_tree.build(case)
    if case.group == "module":
        return peers.module_runner(
            case.impl, t=case.t, dtype=dt, backward=case.backward, **case.shape
        )
    return peers.kernel_runner(
        case.impl, t=case.t, dtype=dt, pattern=case.pattern, backward=case.backward, **case.shape
    )


def memory_case(case: Case) -> Case:
    """Fill ``case.peak_mb`` by running the case once in a fresh subprocess."""
    spec = json.dumps({k: v for k, v in asdict(case).items() if k in _SPEC_KEYS})
    proc = subprocess.run(
        [sys.executable, "-m", "attnkit.bench.suite", "--memory-case", spec],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        case.note = f"memory run failed: {proc.stderr.strip().splitlines()[-1][:160] if proc.stderr.strip() else proc.returncode}"
    else:
        case.peak_mb = float(proc.stdout.strip().splitlines()[-1])
    return case


_SPEC_KEYS = ("group", "impl", "pattern", "t", "dtype", "backward", "shape")


def _rss_mb() -> float:
    """Peak RSS of this process in MB: VmHWM (reset by exec, unlike ``ru_maxrss``,
    which a child inherits from a parent that has already grown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _memory_child(spec: str) -> None:
    case = Case(**json.loads(spec))
    run = _build(case)
    base = _rss_mb()
    run()
    print(_rss_mb() - base)


def target_cases(quick: bool) -> dict[str, list[Case]]:
    """The cases behind the issue's targets a-e (shrunk in quick mode)."""
    k = {"b": 1, "h": 12, "d": 64}
    t_a, t_b, t_c, t_d, t_e = (
        (64, 128, 512, 512, 128) if quick else (1024, 4096, 16384, 16384, 4096)
    )
    mha = {"b": 2 if quick else 4, "d_model": 96 if quick else 768, "num_heads": 12}
    cases: dict[str, list[Case]] = {"a": [], "b": [], "c": [], "d": [], "e": []}
    for bw in (False, True):
        for impl in ("attnkit-mha", "nn.MHA(need_weights=False)", "sdpa-mha"):
            cases["a"].append(Case("module", impl, "causal", t_a, "fp32", bw, mha))
        for impl in ("attnkit-blockwise", "sdpa"):
            cases["b"].append(Case("kernel", impl, "causal", t_b, "fp32", bw, k))
        for impl in ("attnkit-auto", "sdpa"):
            cases["c"].append(Case("kernel", impl, "window256", t_c, "fp32", bw, {**k, "h": 4}))
        for impl in ("attnkit-auto", "attnkit-reference", "flex-eager"):
            cases["e"].append(Case("kernel", impl, "alibi", t_e, "fp32", bw, k))
    small = {"b": 1, "h": 4, "d": 64}
    t_ref = t_d if quick else t_d // 2  # the reference needs ~17 GB at 16384: measured at 8192, x4
    cases["d"] = [
        Case("kernel", "attnkit-blockwise", "causal", t_d, "fp32", True, small),
        Case("kernel", "attnkit-reference", "causal", t_ref, "fp32", True, small),
    ]
    return cases


def grid_cases(quick: bool) -> list[Case]:
    """The comparison grid: every kernel over sequence lengths, dtypes and directions."""
    lengths = [128, 256] if quick else [256, 1024, 4096, 16384]
    out = []
    for dtype in ("fp32", "bf16"):
        for bw in (False, True):
            for t in lengths:
                for pattern in ("causal", "window256", "alibi"):
                    for impl in peers.KERNELS:
                        if impl == "attnkit-reference" and t > 4096:
                            continue  # O(t^2) memory: 17 GB at 16384
                        shape = {"b": 1, "h": 4, "d": 64}
                        out.append(Case("kernel", impl, pattern, t, dtype, bw, shape))
            for impl in peers.MODULES:
                shape = {"b": 4, "d_model": 96 if quick else 768, "num_heads": 12}
                out.append(Case("module", impl, "causal", 64 if quick else 1024, dtype, bw, shape))
    return out


def ratios(cases: dict[str, list[Case]]) -> list[dict]:
    """The targets a-e as ratios of cases measured in this run: of times, the median of the
    per-round ratios (:func:`.timing.case_ratio`, with quartiles and the ratio of medians);
    of peak memory (d), the plain ratio."""

    def found(group, impl, bw) -> Case | None:
        return next((c for c in cases[group] if c.impl == impl and c.backward == bw), None)

    ratio = case_ratio

    rows = []
    for bw in (False, True):
        direction = "fwd+bwd" if bw else "fwd"
        ours = found("a", "attnkit-mha", bw)
        rows.append(
            {
                "target": "a",
                "what": f"attnkit MHA / nn.MHA(nw=False), {direction}",
                **ratio(ours, found("a", "nn.MHA(need_weights=False)", bw)),
                "goal": "<= 1.0",
            }
        )
        rows.append(
            {
                "target": "a",
                "what": f"attnkit MHA / SDPA-MHA, {direction}",
                **ratio(ours, found("a", "sdpa-mha", bw)),
                "goal": "<= 1.05",
            }
        )
        rows.append(
            {
                "target": "b",
                "what": f"blockwise causal / SDPA, {direction}",
                **ratio(found("b", "attnkit-blockwise", bw), found("b", "sdpa", bw)),
                "goal": "<= 1.5" if not bw else "<= 2.0",
            }
        )
        rows.append(
            {
                "target": "c",
                "what": f"SDPA dense mask / attnkit window, {direction}",
                **ratio(found("c", "sdpa", bw), found("c", "attnkit-auto", bw)),
                "goal": ">= 8",
            }
        )
        rows.append(
            {
                "target": "e",
                "what": f"reference+bias / attnkit ALiBi, {direction}",
                **ratio(found("e", "attnkit-reference", bw), found("e", "attnkit-auto", bw)),
                "goal": ">= 3",
            }
        )
    d_ours, d_ref = cases["d"]
    scale = (d_ours.t / d_ref.t) ** 2
    ref_mb = None if d_ref.peak_mb is None else d_ref.peak_mb * scale
    rows.append(
        {
            "target": "d",
            "what": f"blockwise / reference peak memory (reference x{scale:g} from t={d_ref.t})",
            "ratio": None if d_ours.peak_mb is None or not ref_mb else d_ours.peak_mb / ref_mb,
            "goal": "<= 0.1",
        }
    )
    return rows


def machine(peaks: bool = True) -> dict:
    """The machine the numbers come from; ``peaks``: with its measured fp32 FMA peak and
    copy bandwidth (the kernel bench measures them per build instead)."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:  # pragma: no cover
        pass
    return {
        "cpu": model,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "native_kernel": native.status(),
        "native_isa": native.isa(),
        "peak": _peaks() if peaks else None,
    }


def _peaks() -> dict:
    """fp32 FMA peak and copy bandwidth on 1 thread and on all (the rows' yardstick)."""
    from attnkit.bench.native_kernel import machine_peak

    threads = torch.get_num_threads()
    return {f"{n} thread{'s' * (n > 1)}": machine_peak(n) for n in sorted({1, threads})}


def run_suite(
    out: Path, *, quick: bool, grid: bool, reps: int, note: str = "", quiet: bool = False
) -> dict:
    """Measure the targets (and the grid if asked); write JSON, Markdown and plots to ``out``."""
    from tqdm.auto import tqdm

    targets = target_cases(quick)
    todo = [c for group in "abce" for c in targets[group]]
    grid_list = grid_cases(quick) if grid else []
    bar = tqdm(
        total=len(todo) + len(grid_list) + 7,
        desc="attnkit bench" + (" (smoke run)" if quick else ""),
        unit="case",
        disable=quiet,
    )
    for case in targets["d"]:  # first, while nothing else holds memory
        bar.set_postfix_str(f"peak memory {case.impl} t={case.t}")
        memory_case(case)
        bar.update()
    for group in "abce":  # the cases of one target ratio are timed together, round-robin
        for backward in (False, True):
            cases = [c for c in targets[group] if c.backward == backward]
            bar.set_postfix_str(f"target {group}{' fwd+bwd' if backward else ' fwd'}")
            time_cases(cases, reps, _build)
            bar.update(len(cases))
    layer = kernel_layer.target_cases(quick)
    bar.set_postfix_str("kernel layer targets f-j")
    layer_rows = kernel_layer.time_targets(layer, reps)
    bar.update(2)
    serving = cascade_tree.target_cases(quick)
    bar.set_postfix_str("cascade and tree verification targets")
    layer_rows += cascade_tree.time_targets(serving, reps)
    bar.update(2)
    packed = varlen.target_cases(quick)  # packed batches, split-KV decoding, document masks
    bar.set_postfix_str("packed batches, split-KV decoding, document masks")
    layer_rows += varlen.time_targets(packed, reps, quick)
    bar.update()
    for case in grid_list:
        bar.set_postfix_str(f"{case.impl} t={case.t}{' bwd' if case.backward else ''}")
        time_case(case, 1 if case.t >= 8192 else reps, _build)
        bar.update()
    bar.close()
    result = {
        "machine": machine(),
        "note": note,
        "quick": quick,
        "targets": ratios(targets) + layer_rows,
        "target_cases": {
            g: [asdict(c) for c in cs]
            for g, cs in {**targets, **layer, **serving, **packed}.items()
        },
        "grid": [asdict(c) for c in grid_list],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    from attnkit.bench.report import markdown, plots

    (out / "results.md").write_text(markdown(result))
    result["plots"] = [str(p) for p in plots(result, out)]
    return result


def build_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the suite's options to ``parser`` (shared by the CLI and ``python -m``)."""
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="toy sizes: a smoke test in seconds (its ratios are not graded against the targets)",
    )
    parser.add_argument(
        "--grid", action="store_true", help="also run the full comparison grid (slow)"
    )
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per case (median)")
    parser.add_argument("--note", default="", help="free text stored with the results")
    parser.add_argument(
        "--kernel",
        action="store_true",
        help="also benchmark the native kernel once per build this CPU runs "
        "(peak, causal rows, auto against the fastest backend): native.md",
    )
    parser.add_argument(
        "--mods",
        action="store_true",
        help="also benchmark compiled score_mods (softcap, a learned table, a lambda) over "
        "plain causal, once per build this CPU runs: mods.md",
    )
    parser.add_argument(
        "--serving",
        action="store_true",
        help="also benchmark the paged decode step and continuous batching against "
        "transformers' generate_batch (that race needs the [hf] extra): serving.md",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--memory-case"]:
        _memory_child(argv[1])
        return 0
    parser = build_arg_parser(argparse.ArgumentParser(prog="python -m attnkit.bench.suite"))
    args = parser.parse_args(argv)
    check_output(parser, "--out", args.out, folder=True)
    result = run_suite(args.out, quick=args.quick, grid=args.grid, reps=args.reps, note=args.note)
    print((args.out / "results.md").read_text() if result else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
