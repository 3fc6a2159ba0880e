"""Markdown tables and PNG plots for the attention benchmark's results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnkit.bench.timing import ratio_text


def write_pair(out: Path, stem: str, result: dict, text: str) -> None:
    """``{stem}.json`` (``result``) and ``{stem}.md`` (``text``, its Markdown) in ``out``
    (made where missing): what a benchmark module's ``write`` leaves."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(text)


def check_output(
    parser: argparse.ArgumentParser, flag: str, path: Path | str | None, *, folder: bool = False
) -> None:
    """Before a run that takes minutes, make sure its result can be written
    (:func:`attnkit.cli.writable_output`: refused as the CLI refuses an output folder or
    file, its folder made and kept, a file written there); a refusal is the parser's
    error now (exit 2, naming ``flag``), not a traceback that loses the run at its end
    (session 37: a 17-minute ``native_kernel`` run whose ``--json`` folder did not exist
    yet)."""
    if path is None:
        return
    from attnkit.cli import CliError, writable_output  # (the CLI imports benches)

    try:
        writable_output(path, flag, folder=folder, keep=True)
    except CliError as err:
        parser.error(str(err))


def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}g}"


def markdown(result: dict) -> str:
    """The targets table, then every measured case."""
    m = result["machine"]
    lines = [
        "# attnkit attention benchmark",
        "",
        f"Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}, Python {m['python']}"
        + (f", CUDA {m['cuda']}" if m.get("cuda") else ""),
        "",
    ]
    if m.get("native_kernel"):
        lines += [f"attnkit's native CPU kernel: {m['native_kernel']}", ""]
    for threads, p in (m.get("peak") or {}).items():
        lines.append(
            f"Measured on {threads}: fp32 FMA peak {p['fp32_gflops']:.1f} GFLOP/s "
            f"({m.get('native_isa') or 'no native'} build's probe), copy {p['copy_gbps']:.1f} GB/s"
        )
    if m.get("peak"):
        lines.append("")
    if result.get("note"):
        lines += [result["note"], ""]
    quick = bool(result.get("quick"))
    if quick:
        lines += [
            "**Smoke run (`--quick`)**: toy sizes, to check that every case runs. Its ratios "
            "are not comparable with the targets (set for T = 1024-16384), so none is graded; "
            "run `attnkit bench` without `--quick` to measure them.",
            "",
        ]
    lines += [
        "## Targets (ratios measured in this run)",
        "",
        "| target | ratio | goal | met |",
        "| --- | --- | --- | --- |",
    ]
    for row in result["targets"]:
        r, goal = row["ratio"], row["goal"]
        met = "—" if r is None else ("smoke run" if quick else ("yes" if _meets(r, goal) else "NO"))
        shown = ratio_text(row) if row.get("quartiles") else _fmt(r)
        lines.append(f"| {row['target']}: {row['what']} | {shown} | {goal} | {met} |")
    lines += [
        "",
        "## Cases",
        "",
        "| group | impl | pattern | T | dtype | pass | seconds | peak MB | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    cases = [c for cs in result["target_cases"].values() for c in cs] + result["grid"]
    for c in cases:
        lines.append(
            f"| {c['group']} | {c['impl']} | {c['pattern']} | {c['t']} | {c['dtype']} | "
            f"{'fwd+bwd' if c['backward'] else 'fwd'} | {_fmt(c['seconds'])} | {_fmt(c['peak_mb'])} | {c['note']} |"
        )
    return "\n".join(lines) + "\n"


def _meets(ratio: float, goal: str) -> bool:
    op, value = goal.split()
    return ratio <= float(value) if op == "<=" else ratio >= float(value)


def plots(result: dict, out: Path) -> list[Path]:
    """``targets.png`` (each target's ratio against its goal), and one PNG per
    (pattern, dtype, direction) of the grid: seconds against T, log-log.

    Returns no paths when matplotlib (the ``[viz]`` extra) is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = [_targets_plot(plt, result, out / "targets.png")]
    groups: dict[tuple, dict[str, list[tuple[int, float]]]] = {}
    for c in result["grid"]:
        if c["group"] != "kernel" or c["seconds"] is None:
            continue
        key = (c["pattern"], c["dtype"], "fwd+bwd" if c["backward"] else "fwd")
        groups.setdefault(key, {}).setdefault(c["impl"], []).append((c["t"], c["seconds"]))
    for (pattern, dtype, direction), series in groups.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for impl, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="T",
            ylabel="seconds",
            title=f"{pattern}, {dtype}, {direction}",
        )
        ax.legend(fontsize=7)
        path = out / f"{pattern}_{dtype}_{direction.replace('+', '_')}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def _targets_plot(plt, result: dict, path: Path) -> Path:
    rows = [r for r in result["targets"] if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5), layout="constrained")
    labels = [f"{r['target']}: {r['what']}"[:60] for r in rows]
    ratios = [r["ratio"] for r in rows]
    # the quartiles of the per-round ratios where the row has them (a time ratio)
    quart = [r.get("quartiles") or [r["ratio"], r["ratio"]] for r in rows]
    spans = [[max(0.0, x - q[0]) for x, q in zip(ratios, quart, strict=True)],
             [max(0.0, q[1] - x) for x, q in zip(ratios, quart, strict=True)]]  # fmt: skip
    ax.barh(range(len(rows)), ratios, xerr=spans, color="#3b528b", ecolor="#222222", capsize=2)
    for i, r in enumerate(rows):
        goal = float(r["goal"].split()[1])
        ax.plot([goal, goal], [i - 0.4, i + 0.4], color="#e4572e", lw=2)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    smoke = "\nsmoke run (--quick): toy sizes, not graded" if result.get("quick") else ""
    label = "ratio: median of the per-round ratios, whiskers its quartiles (red: the goal)"
    ax.set(xlabel=label, title=f"benchmark targets{smoke}")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
