"""Stage 3 of the seeds: causal (masked) self-attention with dropout on the weights."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from attnkit import trace
from attnkit._validate import check_backend, check_bool
from attnkit.attention import attention, check_dropout
from attnkit.masks import causal_mask
from attnkit.modules._common import (
    active_dropout,
    check_dims,
    check_input,
)

__all__ = ["CausalAttention"]

Masking = Literal["before_softmax", "after_softmax"]


class CausalAttention(nn.Module):
    """Single-head causal self-attention: each token sees itself and earlier tokens.

    Args:
        d_in: input embedding size.
        d_out: size of queries, keys, values and the context vectors.
        context_length: the most tokens a sequence may have.
        dropout: probability of dropping an attention weight in training mode.
        qkv_bias: give the three projections a bias.
        masking: ``"before_softmax"`` (default; future scores set to -inf) or
            ``"after_softmax"``, the seeds' first variant: softmax over every
            score, zero the future weights, renormalise each row to sum to 1.
            Both give the same weights.
        backend: attention backend name for ``"before_softmax"`` (``"auto"``).

    Parameters are created in the seeds' order (W_query, W_key, W_value), so a
    seeded construction reproduces the tutorial's numbers.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
        *,
        masking: Masking = "before_softmax",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_dims(d_in=d_in, d_out=d_out, context_length=context_length)
        if masking not in ("before_softmax", "after_softmax"):
            raise ValueError(
                f"masking must be 'before_softmax' or 'after_softmax', got {masking!r}"
            )
        self.d_in, self.d_out, self.context_length = d_in, d_out, context_length
        self.masking = masking
        self.backend = check_backend(backend)
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(check_dropout(dropout, "dropout"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(b, t, d_in)`` or ``(t, d_in)`` to context vectors ``(..., t, d_out)``."""
        xb, unbatched = check_input(x, self.d_in, self.context_length)
        trace.emit("inputs", xb)
        queries = self.W_query(xb)  # (b, t, d_out)
        keys = self.W_key(xb)  # (b, t, d_out)
        values = self.W_value(xb)  # (b, t, d_out)
        trace.emit("queries", queries)
        trace.emit("keys", keys)
        trace.emit("values", values)
        p = active_dropout(self.dropout, self.training)
        if self.masking == "before_softmax":
            context = attention(
                queries, keys, values, causal=True, dropout_p=p, backend=self.backend
            )
        else:
            context = _mask_after_softmax(queries, keys, values, p)
        return context.squeeze(0) if unbatched else context


def _mask_after_softmax(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dropout_p: float
) -> torch.Tensor:
    """The seeds' first causal variant: mask the softmax output, then renormalise."""
    _, weights = attention(queries, keys, values, need_weights=True, backend="reference")
    t = queries.shape[-2]
    weights = weights * causal_mask(t, t, device=weights.device)  # (b, t, t), future zeroed
    trace.emit("zeroed_weights", weights)
    weights = weights / weights.sum(dim=-1, keepdim=True)  # rows sum to 1 again
    trace.emit("renormalized_weights", weights)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p, training=True)
        trace.emit("dropped_weights", weights)
    context = weights @ values  # (b, t, d_out)
    trace.emit("context", context)
    return context
