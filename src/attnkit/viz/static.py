"""PNG and SVG attention maps with matplotlib (imported only when a picture is drawn)."""

from __future__ import annotations

import math
from pathlib import Path

from attnkit.viz.maps import AttentionMaps

__all__ = ["plot_attention"]

FORMATS = (".png", ".svg")


def plot_attention(
    maps: AttentionMaps,
    path: str | Path,
    *,
    layer: int = 0,
    max_cols: int = 4,
    cmap: str = "viridis",
) -> Path:
    """Draw every head of one layer as a grid of heatmaps with a shared colour bar.

    Token labels run along both axes (keys across, queries down); the title
    names the layer (or stage) and the panel titles the heads.

    Args:
        maps: the attention maps.
        path: where to write; ``.png`` or ``.svg`` picks the format.
        layer: which layer (or stage) to draw.
        max_cols: panels per row.
        cmap: a matplotlib colour map name.

    Returns:
        The written path.

    Raises:
        ValueError: unsupported suffix or layer out of range.
    """
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"picture format {path.suffix!r} not supported; use {', '.join(FORMATS)}")
    if not 0 <= layer < len(maps.weights):
        raise ValueError(f"layer {layer} out of range: the maps have {len(maps.weights)} layers")
    from matplotlib.figure import Figure  # lazy: `import attnkit` never imports matplotlib

    w = maps.weights[layer].numpy()  # (heads, q, k)
    heads, q, k = w.shape
    cols = min(heads, max_cols)
    rows = math.ceil(heads / cols)
    q_tokens, k_tokens = maps.query_tokens(layer), maps.tokens
    cell = 0.32 + 0.02 * max(len(t) for t in maps.tokens)
    side = max(2.2, 0.38 * max(q, k) + cell * 2)
    fig = Figure(figsize=(cols * side + 1.2, rows * side + 0.8), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = max(float(w.max()), 1e-12)
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= heads:
            ax.set_axis_off()
            continue
        image = ax.imshow(w[i], cmap=cmap, vmin=0.0, vmax=vmax, aspect="equal")
        ax.set_title(f"head {i}", fontsize=9)
        ax.set_xticks(range(k), k_tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(q), q_tokens, fontsize=8)
        ax.set_xlabel("key", fontsize=8)
        if i % cols == 0:
            ax.set_ylabel("query", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    fig.suptitle(f"{maps.label(layer)} · {heads} head{'s' * (heads > 1)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
