"""The head, model and neuron views as PNG/SVG/PDF pictures (matplotlib, the ``viz`` extra).

The same drawings as the page's (:mod:`attnkit.viz.page`), for files and papers:

* head view: query tokens (left) joined to key tokens (right) by lines whose opacity is
  the weight, one colour per head;
* model view: a grid of layers x heads heatmaps;
* neuron view: q, k and their element-wise products as bars, with the sum, the scale and
  the score in the title.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnkit._validate import check_int
from attnkit.viz.maps import AttentionMaps
from attnkit.viz.record import ModelRecording, neuron

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["VIEWS", "draw_view", "plot_view"]

VIEWS = ("head", "model", "neuron")
_FORMATS = (".png", ".svg", ".pdf")
_HEAD_COLOURS = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#ff7f0e", "#393b79", "#637939",
]  # fmt: skip
MIN_LINE = 0.005  # the page's threshold too


def plot_view(
    recording: ModelRecording | AttentionMaps,
    path: str | Path,
    *,
    view: str = "head",
    layer: int = 0,
    heads: Sequence[int] | None = None,
    query: int | None = None,
    key: int = 0,
) -> Path:
    """Write one view to ``path`` (``.png``, ``.svg`` or ``.pdf``).

    Args:
        recording: a recording (or plain maps, for the head and model views).
        path: the output file.
        view: ``"head"``, ``"model"`` or ``"neuron"``.
        layer: the layer of the head and neuron views.
        heads: head view: the heads drawn (default all); neuron view: the first is used
            (default head 0).
        query: head view: only this query's lines (default all); neuron view: the query
            (default the last token).
        key: neuron view: the key.

    Raises:
        ValueError: unknown view or format, an index out of range, a neuron view of a
            recording without queries and keys.
        ImportError: matplotlib is missing (``pip install 'attnkit[viz]'``).
    """
    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise ValueError(f"picture format {path.suffix!r} not supported; use {', '.join(_FORMATS)}")
    fig = draw_view(recording, view=view, layer=layer, heads=heads, query=query, key=key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def draw_view(
    recording: ModelRecording | AttentionMaps,
    *,
    view: str = "head",
    layer: int = 0,
    heads: Sequence[int] | None = None,
    query: int | None = None,
    key: int = 0,
) -> Figure:
    """The figure :func:`plot_view` writes (same arguments, no path)."""
    rec = recording if isinstance(recording, ModelRecording) else ModelRecording(recording)
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    check_int(layer, "layer", minimum=0)
    if layer >= rec.num_layers:
        raise ValueError(f"layer {layer} out of range: the recording has {rec.num_layers} layers")
    picked = list(range(rec.num_heads)) if heads is None else [int(h) for h in heads]
    for h in picked:
        check_int(h, "heads", minimum=0)
        if h >= rec.num_heads:
            raise ValueError(f"head {h} out of range: there are {rec.num_heads} heads")
    from matplotlib.figure import Figure  # lazy: the viz extra

    if view == "model":
        return _model(rec, Figure)
    if view == "neuron":
        t = len(rec.maps.tokens)
        return _neuron(
            rec, Figure, layer, picked[0] if heads else 0, t - 1 if query is None else query, key
        )
    return _head(rec, Figure, layer, picked, query)


def _head(
    rec: ModelRecording, Figure: type, layer: int, heads: list[int], query: int | None
) -> Figure:
    tokens = rec.maps.tokens
    t = len(tokens)
    w = rec.maps.weights[layer].numpy()  # (h, q, t)
    qn = w.shape[1]
    off = t - qn
    if query is not None:
        check_int(query, "query", minimum=0)
        if query >= qn:
            raise ValueError(f"query {query} out of range: there are {qn} queries")
    fig = Figure(figsize=(5.0, max(2.5, 0.22 * t + 1.0)), layout="constrained")
    ax = fig.subplots()
    queries = range(qn) if query is None else [query]
    for h in heads:
        colour = _HEAD_COLOURS[h % len(_HEAD_COLOURS)]
        for i in queries:
            for j in range(t):
                v = float(w[h, i, j])
                if v >= MIN_LINE:
                    ax.plot(
                        [0, 1], [i + off, j], color=colour, alpha=min(1.0, v), linewidth=1 + 3 * v
                    )
    for i, tok in enumerate(tokens):
        ax.text(-0.03, i, tok, ha="right", va="center", fontsize=9)
        ax.text(1.03, i, tok, ha="left", va="center", fontsize=9)
    ax.set_xlim(-0.5, 1.5)
    ax.set_ylim(t - 0.5, -0.5)
    ax.set_axis_off()
    ax.set_title(f"head view · layer {layer} · heads {', '.join(map(str, heads))}", fontsize=10)
    return fig


def _model(rec: ModelRecording, Figure: type) -> Figure:
    n_l, n_h = rec.num_layers, rec.num_heads
    side = min(1.3, 14.0 / max(n_l, n_h))
    fig = Figure(figsize=(n_h * side + 0.8, n_l * side + 0.6), layout="constrained")
    axes = fig.subplots(n_l, n_h, squeeze=False)
    for layer in range(n_l):
        w = rec.maps.weights[layer].numpy()  # (h, q, t)
        for h in range(n_h):
            ax = axes[layer, h]
            cells = np.ma.masked_equal(w[h], 0.0)
            ax.set_facecolor("#ececec")
            ax.imshow(cells, cmap="viridis", vmin=0.0, vmax=max(float(w[h].max()), 1e-12))
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {h}", fontsize=7)
            if h == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=7)
    fig.suptitle(f"model view · {n_l} layers × {n_h} heads", fontsize=10)
    return fig


def _neuron(
    rec: ModelRecording, Figure: type, layer: int, head: int, query: int, key: int
) -> Figure:
    n = neuron(rec, layer, head, query, key)
    d = n.q.shape[0]
    fig = Figure(figsize=(7.5, max(2.5, 0.16 * d + 1.4)), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    idx = np.arange(d)
    for ax, values, name, colour in (
        (axes[0], n.q.numpy(), "q" + (" (after RoPE)" if rec.rope else ""), "#1f77b4"),
        (axes[1], n.k.numpy(), "k" + (" (after RoPE)" if rec.rope else ""), "#d62728"),
        (axes[2], n.products.numpy(), "q · k element by element", "#2ca02c"),
    ):
        ax.barh(idx, values, color=colour)
        ax.axvline(0.0, color="#888", linewidth=0.8)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
    axes[0].set_ylim(d - 0.5, -0.5)
    axes[0].set_ylabel("element", fontsize=8)
    tokens = rec.maps.tokens
    fig.suptitle(
        f"layer {layer} head {head}: “{tokens[query]}” → “{tokens[key]}”   "
        f"Σ = {n.dot:.6f} × {n.scale:.6g} = score {n.score:.6f}   weight {n.weight:.4f}",
        fontsize=9,
    )
    return fig
