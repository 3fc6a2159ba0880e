"""``attnkit.viz``: attention maps as PNG/SVG pictures and an offline HTML view.

matplotlib is imported only when a PNG/SVG is drawn (``pip install attnkit[viz]``);
the HTML view needs nothing beyond attnkit.
"""

from __future__ import annotations

from pathlib import Path

from attnkit.viz.html import AttentionView
from attnkit.viz.maps import AttentionMaps, from_explanation, from_hf, load_attentions
from attnkit.viz.static import plot_attention

__all__ = [
    "AttentionMaps",
    "AttentionView",
    "from_explanation",
    "from_hf",
    "load_attentions",
    "plot_attention",
    "save",
]


def save(
    maps: AttentionMaps, path: str | Path, *, layer: int = 0, title: str = "attention"
) -> Path:
    """Write ``maps`` to ``path``: ``.html`` (every layer) or ``.png``/``.svg``/``.pdf`` (one layer)."""
    path = Path(path)
    if path.suffix.lower() in (".html", ".htm"):
        return AttentionView(maps, title=title).save(path)
    return plot_attention(maps, path, layer=layer)
