"""PNG, SVG and PDF attention maps with matplotlib (imported only when a picture is drawn)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from attnkit._validate import check_int
from attnkit.viz.maps import AttentionMaps

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ANNOTATE_MAX", "draw_attention", "masked_weights", "plot_attention"]

FORMATS = (".png", ".svg", ".pdf")
#: The largest panel side (inches) and picture (pixels): 64 tokens x 12 heads once made 94 Mpx.
MAX_PANEL_INCHES = 6.0
MAX_PIXELS = 16_000_000
_DPI = 110
#: Maps with at most this many queries and keys print each cell's weight.
ANNOTATE_MAX = 12


def masked_weights(weights: np.ndarray) -> np.ma.MaskedArray:
    """``weights`` with every cell of weight exactly 0 masked: a masked-out key (causal,
    window, padding) gets exactly 0 after the softmax, a kept one never does in practice.
    The same rule as the HTML view's hatched cells."""
    return np.ma.masked_equal(weights, 0.0, copy=True)


def plot_attention(
    maps: AttentionMaps,
    path: str | Path,
    *,
    layer: int = 0,
    heads: Sequence[int] | None = None,
    max_cols: int = 4,
    cmap: str = "viridis",
) -> Path:
    """Draw every head of one layer as a grid of heatmaps with a shared colour bar.

    Token labels run along both axes (keys across, queries down); the title
    names the layer (or stage) and the panel titles the heads. Masked cells (weight
    exactly 0) are hatched grey, not coloured as a tiny weight; on maps of at most
    ``ANNOTATE_MAX`` tokens a side every other cell prints its weight.

    Args:
        maps: the attention maps.
        path: where to write; ``.png``, ``.svg`` or ``.pdf`` picks the format.
        layer: which layer (or stage) to draw.
        heads: which heads to draw (default every head).
        max_cols: panels per row.
        cmap: a matplotlib colour map name.

    Returns:
        The written path.

    Raises:
        TypeError: ``layer``, ``max_cols`` or a head not an int.
        ValueError: unsupported suffix, layer or head out of range.

    The picture is capped (panels of at most ``MAX_PANEL_INCHES``, ``MAX_PIXELS`` in all):
    long sequences get smaller labels, and only every n-th label past ~48 tokens.
    """
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"picture format {path.suffix!r} not supported; use {', '.join(FORMATS)}")
    fig = draw_attention(maps, layer=layer, heads=heads, max_cols=max_cols, cmap=cmap)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=fig.dpi)
    return path


def draw_attention(
    maps: AttentionMaps,
    *,
    layer: int = 0,
    heads: Sequence[int] | None = None,
    max_cols: int = 4,
    cmap: str = "viridis",
) -> Figure:
    """The figure :func:`plot_attention` writes (same arguments, no path).

    Each panel holds one image of :func:`masked_weights` (masked cells transparent over
    a hatched grey patch) and, on small maps, one text per unmasked cell.
    """
    check_int(layer, "layer", minimum=0)
    check_int(max_cols, "max_cols")
    if layer >= len(maps.weights):
        raise ValueError(f"layer {layer} out of range: the maps have {len(maps.weights)} layers")
    from matplotlib import colormaps  # lazy: `import attnkit` never imports matplotlib
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    w_all = maps.weights[layer].numpy()  # (heads, q, k)
    picked = list(range(w_all.shape[0])) if heads is None else list(heads)
    for h in picked:
        check_int(h, "heads", minimum=None)
    if not picked or any(not 0 <= h < w_all.shape[0] for h in picked):
        raise ValueError(f"heads {picked} out of range: layer {layer} has {w_all.shape[0]} heads")
    w = w_all[picked]
    n, q, k = w.shape
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    q_tokens, k_tokens = maps.query_tokens(layer), maps.tokens
    longest = max(len(t) for t in maps.tokens)
    side = min(MAX_PANEL_INCHES, max(2.2, 0.38 * max(q, k) + (0.32 + 0.02 * longest) * 2))
    fontsize = max(3.0, min(8.0, side * 72 / max(q, k) * 0.7))
    every = max(1, math.ceil(max(q, k) / 48))  # at most ~48 labels per axis
    width, height = cols * side + 1.2, rows * side + 0.8
    dpi = min(_DPI, math.sqrt(MAX_PIXELS / (width * height)))
    fig = Figure(figsize=(width, height), layout="constrained", dpi=dpi)
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = max(float(w.max()), 1e-12)
    colours = colormaps[cmap].with_extremes(bad=(0.0, 0.0, 0.0, 0.0))  # masked: see-through
    annotate = max(q, k) <= ANNOTATE_MAX
    any_masked = False
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.set_axis_off()
            continue
        cells = masked_weights(w[i])  # (q, k)
        any_masked |= bool(np.ma.count_masked(cells))
        ax.add_patch(  # shows through the masked cells
            Rectangle(
                (-0.5, -0.5),
                k,
                q,
                facecolor="#e4e4e4",
                edgecolor="#9a9a9a",
                hatch="///",
                linewidth=0,
                zorder=0,
            )
        )
        image = ax.imshow(cells, cmap=colours, vmin=0.0, vmax=vmax, aspect="equal", zorder=1)
        if annotate:
            _print_values(ax, cells, image, fontsize=min(8.0, side * 72 / max(q, k) * 0.28))
        ax.set_title(f"head {picked[i]}", fontsize=9)
        ax.set_xticks(range(0, k, every), k_tokens[::every], rotation=90, fontsize=fontsize)
        ax.set_yticks(range(0, q, every), q_tokens[::every], fontsize=fontsize)
        ax.set_xlabel("key", fontsize=8)
        if i % cols == 0:
            ax.set_ylabel("query", fontsize=8)
    assert image is not None  # n >= 1 panels were drawn
    label = "attention weight" + ("\n(hatched grey: masked, weight 0)" if any_masked else "")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label=label)
    total = w_all.shape[0]
    shown = f"{total} head{'s' * (total > 1)}" if n == total else f"{n} of {total} heads"
    fig.suptitle(f"{maps.label(layer)} · {shown}")
    return fig


def _print_values(ax: Any, cells: np.ma.MaskedArray, image: Any, *, fontsize: float) -> None:
    """Write each unmasked cell's weight in it, dark on light colours and light on dark."""
    rgba = image.to_rgba(cells.filled(0.0))  # (q, k, 4)
    luminance = rgba[..., 0] * 0.299 + rgba[..., 1] * 0.587 + rgba[..., 2] * 0.114
    masked = np.ma.getmaskarray(cells)
    for (qi, ki), value in np.ndenumerate(cells.data):
        if masked[qi, ki]:
            continue
        colour = "black" if luminance[qi, ki] > 0.5 else "white"
        ax.text(
            ki,
            qi,
            f"{value:.2f}",
            ha="center",
            va="center",
            fontsize=fontsize,
            color=colour,
            zorder=2,
        )
