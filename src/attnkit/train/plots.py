"""PNG pictures of a training run: the loss curve and learned attention maps.

Attention maps are drawn by :mod:`attnkit.viz`, like every other attention picture.

matplotlib is imported lazily (the ``[viz]`` extra); attnkit's core never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from attnkit import trace
from attnkit.models import GPT
from attnkit.viz import AttentionMaps, plot_attention

__all__ = ["attention_maps", "plot_attention_maps", "plot_loss"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the install
        raise RuntimeError("pictures need matplotlib: pip install 'attnkit[viz]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(losses: Sequence[float], path: str | Path) -> Path:
    """Write the loss curve (log scale) to ``path`` and return it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


@torch.no_grad()
def attention_maps(model: GPT, idx: torch.Tensor, labels: Sequence[str]) -> AttentionMaps:
    """Record the learned attention weights of every layer for one sequence.

    Args:
        model: the trained GPT (put in eval mode).
        idx: token ids ``(t,)``.
        labels: one label per token, drawn along both axes.

    Returns:
        :class:`attnkit.viz.AttentionMaps` with one ``(heads, t, t)`` map per layer.

    Raises:
        ValueError: ``labels`` does not have one entry per token.
    """
    if len(labels) != idx.shape[-1]:
        raise ValueError(f"{len(labels)} labels for {idx.shape[-1]} tokens")
    model.eval()
    with trace.record() as rec:
        model(idx.unsqueeze(0))  # (1, t) -> weights (1, h, t, t) per layer
    layers = range(model.cfg.n_layers)
    weights = [rec[f"blocks.{i}.weights"][0].float() for i in layers]  # (h, t, t) each
    return AttentionMaps([f"layer {i}" for i in layers], weights, list(labels))


def plot_attention_maps(
    model: GPT, idx: torch.Tensor, labels: Sequence[str], out_dir: str | Path
) -> list[Path]:
    """Write ``layer<i>.png`` per layer (a panel per head) for sequence ``idx``; return the paths.

    Drawn with :func:`attnkit.viz.plot_attention`, like every other attention map.
    """
    maps = attention_maps(model, idx, labels)
    out = Path(out_dir)
    return [plot_attention(maps, out / f"layer{i}.png", layer=i) for i in range(len(maps.weights))]
