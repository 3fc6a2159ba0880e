"""Markdown tables and PNG plots for the attention benchmark's results."""

from __future__ import annotations

from pathlib import Path


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
    if result.get("note"):
        lines += [result["note"], ""]
    lines += [
        "## Targets (ratios measured in this run)",
        "",
        "| target | ratio | goal | met |",
        "| --- | --- | --- | --- |",
    ]
    for row in result["targets"]:
        r, goal = row["ratio"], row["goal"]
        met = "—" if r is None else ("yes" if _meets(r, goal) else "NO")
        lines.append(f"| {row['target']}: {row['what']} | {_fmt(r)} | {goal} | {met} |")
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
    """One PNG per (pattern, dtype, direction) of the grid: seconds against T, log-log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
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
