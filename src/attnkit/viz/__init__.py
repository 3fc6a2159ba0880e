"""``attnkit.viz``: attention maps as PNG/SVG pictures and offline HTML views.

matplotlib is imported only when a PNG/SVG is drawn (``pip install attnkit[viz]``);
the HTML views need nothing beyond attnkit. :func:`record_hf` / :func:`record_gpt` record a
model's attention (and, when asked, its queries and keys and a next-token tree) for
:class:`ModelView`: the model, head, neuron and next-token views in one page.
"""

from __future__ import annotations

from pathlib import Path

from attnkit.viz.html import AttentionView
from attnkit.viz.maps import AttentionMaps, from_explanation, from_hf, load_attentions
from attnkit.viz.page import ModelView
from attnkit.viz.record import ModelRecording, neuron, record_gpt, record_hf
from attnkit.viz.static import plot_attention
from attnkit.viz.static_views import plot_view

__all__ = [
    "AttentionMaps",
    "AttentionView",
    "ModelRecording",
    "ModelView",
    "from_explanation",
    "from_hf",
    "load_attentions",
    "neuron",
    "plot_attention",
    "plot_view",
    "record_gpt",
    "record_hf",
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
