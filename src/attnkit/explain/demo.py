"""The explain walkthrough and attention maps for ``attnkit demo``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from attnkit.examples import YOUR_JOURNEY
from attnkit.explain.core import explain
from attnkit.explain.render import render

__all__ = ["demo_section"]


def demo_section(out_dir: str | Path, *, stream: TextIO | None = None) -> list[Path]:
    """Print how "journey" gets its context vector, then write every stage's maps.

    Writes ``attention.html`` (every stage, offline), and with matplotlib
    installed ``<stage>.png`` per stage and ``multihead.svg``.

    Args:
        out_dir: the folder for the maps (created if needed).
        stream: where to print (``sys.stdout`` by default).

    Returns:
        The written files.
    """
    from attnkit import viz

    stream = sys.stdout if stream is None else stream
    out_dir = Path(out_dir)
    x = YOUR_JOURNEY.tensor()  # (6, 3)
    simple = explain(YOUR_JOURNEY.tokens, x, stages=["simplified"])
    stream.write("\n" + render(simple, query="journey"))
    maps = viz.from_explanation(explain(YOUR_JOURNEY.tokens, x))
    written = [
        viz.AttentionView(maps, title=" ".join(YOUR_JOURNEY.tokens)).save(
            out_dir / "attention.html"
        )
    ]
    try:
        for i, name in enumerate(maps.names):
            written.append(viz.plot_attention(maps, out_dir / f"{name}.png", layer=i))
        written.append(
            viz.plot_attention(maps, out_dir / "multihead.svg", layer=len(maps.names) - 1)
        )
    except ImportError:
        stream.write("(PNG/SVG maps need matplotlib: pip install 'attnkit[viz]')\n")
    stream.write(f"\nattention maps written to {out_dir}/: {', '.join(p.name for p in written)}\n")
    return written
