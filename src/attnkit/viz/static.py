"""PNG, SVG and PDF attention maps with matplotlib (imported only when a picture is drawn)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from attnkit.viz.maps import AttentionMaps

__all__ = ["plot_attention"]

FORMATS = (".png", ".svg", ".pdf")
#: The largest panel side (inches) and picture (pixels): 64 tokens x 12 heads once made 94 Mpx.
MAX_PANEL_INCHES = 6.0
MAX_PIXELS = 16_000_000
_DPI = 110


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
    names the layer (or stage) and the panel titles the heads.

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
        ValueError: unsupported suffix, layer or head out of range.

    The picture is capped (panels of at most ``MAX_PANEL_INCHES``, ``MAX_PIXELS`` in all):
    long sequences get smaller labels, and only every n-th label past ~48 tokens.
    """
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"picture format {path.suffix!r} not supported; use {', '.join(FORMATS)}")
    if not 0 <= layer < len(maps.weights):
        raise ValueError(f"layer {layer} out of range: the maps have {len(maps.weights)} layers")
    from matplotlib.figure import Figure  # lazy: `import attnkit` never imports matplotlib

    w_all = maps.weights[layer].numpy()  # (heads, q, k)
    picked = list(range(w_all.shape[0])) if heads is None else list(heads)
    if not picked or any(
        isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < w_all.shape[0] for h in picked
    ):
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
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = max(float(w.max()), 1e-12)
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.set_axis_off()
            continue
        image = ax.imshow(w[i], cmap=cmap, vmin=0.0, vmax=vmax, aspect="equal")
        ax.set_title(f"head {picked[i]}", fontsize=9)
        ax.set_xticks(range(0, k, every), k_tokens[::every], rotation=90, fontsize=fontsize)
        ax.set_yticks(range(0, q, every), q_tokens[::every], fontsize=fontsize)
        ax.set_xlabel("key", fontsize=8)
        if i % cols == 0:
            ax.set_ylabel("query", fontsize=8)
    assert image is not None  # n >= 1 panels were drawn
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    total = w_all.shape[0]
    shown = f"{total} head{'s' * (total > 1)}" if n == total else f"{n} of {total} heads"
    fig.suptitle(f"{maps.label(layer)} · {shown}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
