"""Stage 1 of the seeds: simplified self-attention, with no trainable weights."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from attnkit import trace
from attnkit.attention import attention
from attnkit.modules._common import check_input

__all__ = ["SimplifiedSelfAttention"]


class SimplifiedSelfAttention(nn.Module):
    """Self-attention on the raw embeddings: the seeds' first, hand-computed example.

    Each token's embedding is its own query, key and value. Scores are plain dot
    products (no scaling); ``normalize="softmax"`` turns them into weights with a
    softmax, ``normalize="sum"`` divides by their sum (the naive normalisation the
    seeds show first, which is not guaranteed positive). Context vectors are the
    weighted sums of the embeddings. ``"sum"`` refuses a row whose scores sum to 0
    (an all-zero embedding, say): there is no weight to give, and dividing would
    give NaN.

    Args:
        normalize: ``"softmax"`` (default) or ``"sum"``.

    Example:
        >>> import torch
        >>> x = torch.tensor([[0.34, 0.22, 0.54], [0.53, 0.34, 0.98], [0.29, 0.54, 0.93]])
        >>> SimplifiedSelfAttention()(x)[1]  # "shiny" in "Hello shiny sun!"
        tensor([0.3990, 0.3854, 0.8610])
    """

    def __init__(self, normalize: Literal["softmax", "sum"] = "softmax") -> None:
        super().__init__()
        if normalize not in ("softmax", "sum"):
            raise ValueError(f"normalize must be 'softmax' or 'sum', got {normalize!r}")
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the context vectors, same shape as ``x``: ``(b, t, d)`` or ``(t, d)``."""
        xb, unbatched = check_input(x, None)
        trace.emit("inputs", xb)
        if self.normalize == "softmax":
            context = attention(xb, xb, xb, scale=1.0)  # (b, t, d)
        else:
            scores = xb @ xb.transpose(-2, -1)  # (b, t, t)
            trace.emit("scores", scores)
            total = scores.sum(dim=-1, keepdim=True)  # (b, t, 1)
            zero = (total == 0).nonzero()
            if zero.numel():
                b, t = zero[0, 0].item(), zero[0, 1].item()
                raise ValueError(
                    f"normalize='sum' divides each row of scores by its sum, but the scores of "
                    f"token {t} (batch element {b}) sum to 0 (e.g. an all-zero embedding); "
                    "use normalize='softmax'"
                )
            weights = scores / total
            trace.emit("weights", weights)
            context = weights @ xb  # (b, t, d)
            trace.emit("context", context)
        return context.squeeze(0) if unbatched else context

    def extra_repr(self) -> str:
        return f"normalize={self.normalize!r}"
