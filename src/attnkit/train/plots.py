"""PNG pictures of a training run: the loss curve and learned attention maps.

matplotlib is imported lazily (the ``[viz]`` extra); attnkit's core never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from attnkit import trace
from attnkit.models import GPT

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
def attention_maps(model: GPT, idx: torch.Tensor) -> dict[int, torch.Tensor]:
    """Return ``layer -> weights (heads, t, t)`` for one sequence ``idx`` ``(t,)``."""
    model.eval()
    with trace.record() as rec:
        model(idx.unsqueeze(0))
    return {i: rec[f"blocks.{i}.weights"][0] for i in range(model.cfg.n_layers)}  # (h, t, t) each


def plot_attention_maps(
    model: GPT, idx: torch.Tensor, labels: Sequence[str], out_dir: str | Path
) -> list[Path]:
    """Write one PNG per layer (a panel per head) for sequence ``idx``; return the paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for layer, weights in attention_maps(model, idx).items():
        h = weights.shape[0]
        fig, axes = plt.subplots(1, h, figsize=(3.2 * h, 3.4), squeeze=False)
        for head, ax in enumerate(axes[0]):
            ax.imshow(weights[head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {layer} head {head}", fontsize=9)
            ax.set_xticks(range(len(labels)), labels, fontsize=7)
            ax.set_yticks(range(len(labels)), labels, fontsize=7)
            ax.set_xlabel("key", fontsize=8)
        axes[0][0].set_ylabel("query", fontsize=8)
        fig.tight_layout()
        path = out / f"layer{layer}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
