"""Stage 2 of the seeds: self-attention with trainable W_query, W_key, W_value."""

from __future__ import annotations

import torch
from torch import nn

from attnkit import trace
from attnkit._validate import check_backend, check_bool
from attnkit.attention import attention
from attnkit.modules._common import check_dims, check_input

__all__ = ["SelfAttentionV1", "SelfAttentionV2"]


class SelfAttentionV1(nn.Module):
    """Self-attention with raw weight matrices, ``W_* = nn.Parameter(torch.rand(d_in, d_out))``.

    Parameters are created in the seeds' order (query, key, value) with their
    ``torch.rand`` init, so the same ``torch.manual_seed`` gives the same numbers.

    Args:
        d_in: input embedding size.
        d_out: size of queries, keys, values and the context vectors.
        backend: attention backend name (``"auto"`` by default).
    """

    def __init__(self, d_in: int, d_out: int, *, backend: str = "auto") -> None:
        super().__init__()
        check_dims(d_in=d_in, d_out=d_out)
        self.d_in, self.d_out = d_in, d_out
        self.backend = check_backend(backend)
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(b, t, d_in)`` or ``(t, d_in)`` to context vectors ``(..., t, d_out)``."""
        xb, unbatched = check_input(x, self.d_in)
        trace.emit("inputs", xb)
        queries = xb @ self.W_query  # (b, t, d_out)
        keys = xb @ self.W_key  # (b, t, d_out)
        values = xb @ self.W_value  # (b, t, d_out)
        context = _attend(queries, keys, values, self.backend)
        return context.squeeze(0) if unbatched else context


class SelfAttentionV2(nn.Module):
    """Self-attention with ``nn.Linear`` projections named ``W_query``, ``W_key``, ``W_value``.

    Args:
        d_in: input embedding size.
        d_out: size of queries, keys, values and the context vectors.
        qkv_bias: give the three projections a bias.
        backend: attention backend name (``"auto"`` by default).
    """

    def __init__(
        self, d_in: int, d_out: int, qkv_bias: bool = False, *, backend: str = "auto"
    ) -> None:
        super().__init__()
        check_dims(d_in=d_in, d_out=d_out)
        self.d_in, self.d_out = d_in, d_out
        self.backend = check_backend(backend)
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(b, t, d_in)`` or ``(t, d_in)`` to context vectors ``(..., t, d_out)``."""
        xb, unbatched = check_input(x, self.d_in)
        trace.emit("inputs", xb)
        context = _attend(self.W_query(xb), self.W_key(xb), self.W_value(xb), self.backend)
        return context.squeeze(0) if unbatched else context


def _attend(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, backend: str
) -> torch.Tensor:
    """Emit the projections and attend with the default ``1/sqrt(d_out)`` scale."""
    trace.emit("queries", queries)
    trace.emit("keys", keys)
    trace.emit("values", values)
    return attention(queries, keys, values, backend=backend)  # (b, t, d_out)
