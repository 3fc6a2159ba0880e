"""Stage 4 of the seeds: multi-head attention, as a wrapper of heads and fused."""

from __future__ import annotations

import torch
from torch import nn

from attnkit import trace
from attnkit._validate import check_backend, check_bool
from attnkit.attention import attention, check_dropout
from attnkit.modules._common import (
    active_dropout,
    check_dims,
    check_input,
)
from attnkit.modules.causal import CausalAttention

__all__ = ["MultiHeadAttention", "MultiHeadAttentionWrapper"]


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent :class:`CausalAttention` heads, outputs concatenated.

    The output has ``d_out * num_heads`` features: each head produces ``d_out``.

    Args:
        d_in: input embedding size.
        d_out: output size of *each* head.
        context_length: the most tokens a sequence may have.
        dropout: attention-weight dropout in training mode.
        num_heads: number of heads.
        qkv_bias: give the projections a bias.
        backend: attention backend name (``"auto"``).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_dims(num_heads=num_heads)
        self.heads = nn.ModuleList(
            CausalAttention(d_in, d_out, context_length, dropout, qkv_bias, backend=backend)
            for _ in range(num_heads)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(b, t, d_in)`` or ``(t, d_in)`` to ``(..., t, d_out * num_heads)``."""
        outputs = []
        for i, head in enumerate(self.heads):
            with trace.scope(f"heads.{i}"):
                outputs.append(head(x))
        out = torch.cat(outputs, dim=-1)  # (b, t, num_heads * d_out)
        trace.emit("concat", out)
        return out


class MultiHeadAttention(nn.Module):
    """Fused multi-head attention: one projection per Q/K/V, split into heads, ``out_proj``.

    ``head_dim = d_out // num_heads``. Parameters are created in the seeds' order
    (W_query, W_key, W_value, out_proj), so a seeded construction reproduces the
    tutorial's numbers::

        x (b, t, d_in) ─ W_query ─> (b, t, h, head_dim) ─> (b, h, t, head_dim) ─┐
                       ─ W_key   ─> ...                                            ├─ attention
                       ─ W_value ─> ...                                            ┘
        context (b, h, t, head_dim) ─> (b, t, d_out) ─ out_proj ─> (b, t, d_out)

    This is the book's class (plus GQA and cross-attention). The LLM concerns (RoPE,
    sliding windows, KV caches, padded batches, sinks, MLA) live in
    :mod:`attnkit.models`, where the model hands every layer its positions and mask
    (:class:`attnkit.models.CausalSelfAttention`).

    Mask polarity: a boolean ``mask`` here means True = *may attend* (attnkit's
    convention, as in SDPA), the opposite of ``nn.MultiheadAttention``'s
    ``attn_mask``/``key_padding_mask`` where True = *masked out*.

    Args:
        d_in: input embedding size.
        d_out: model size; must be divisible by ``num_heads``.
        context_length: the most query tokens a call may have.
        dropout: attention-weight dropout in training mode.
        num_heads: number of heads.
        qkv_bias: give W_query, W_key, W_value a bias (``out_proj`` always has one).
        backend: attention backend name (``"auto"``).
        num_kv_heads: key/value heads; ``num_heads`` (default) is plain MHA, fewer is
            grouped-query attention (GQA: query head ``i`` reads key/value head
            ``i // (num_heads // num_kv_heads)``), 1 is multi-query attention (MQA).
            W_key and W_value then project to ``num_kv_heads * head_dim``::

                MHA  q: h h h h   GQA  q: h h h h   MQA  q: h h h h
                     k: h h h h        k:  h   h         k:    h
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        backend: str = "auto",
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        check_dims(d_in=d_in, d_out=d_out, context_length=context_length, num_heads=num_heads)
        if d_out % num_heads != 0:
            raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_dims(num_kv_heads=num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
            )
        self.d_in, self.d_out, self.context_length = d_in, d_out, context_length
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_out // num_heads
        self.backend = check_backend(backend)
        kv_out = num_kv_heads * self.head_dim
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, kv_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, kv_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(check_dropout(dropout, "dropout"))

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        causal: bool | str | None = None,
        mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to itself, or to ``context`` (cross-attention).

        Args:
            x: queries' source, ``(b, t, d_in)`` or ``(t, d_in)``.
            context: encoder states ``(b, s, d_in)`` (or ``(s, d_in)``) for
                cross-attention; keys and values then come from it.
            causal: None (default) = causal for self-attention, not for
                cross-attention; or any value :func:`attnkit.attention` takes.
            mask: extra mask broadcastable to ``(b, num_heads, t, s)``, attnkit's
                convention (bool True = may attend; float added).
            need_weights: also return the weights ``(b, num_heads, t, s)``.

        Returns:
            ``(b, t, d_out)`` (or ``(t, d_out)``), plus the weights if asked.
        """
        xb, unbatched = check_input(x, self.d_in, self.context_length)
        if context is None:
            source = xb
            causal = True if causal is None else causal
        else:
            source, ctx_unbatched = check_input(context, self.d_in, name="context")
            if ctx_unbatched != unbatched or source.shape[0] != xb.shape[0]:
                raise ValueError(
                    f"context batch {tuple(context.shape[:-2])} does not match x batch "
                    f"{tuple(x.shape[:-2])}"
                )
            causal = False if causal is None else causal
        trace.emit("inputs", xb)
        b, t, _ = xb.shape
        # (b, t, d_out) -> (b, t, h, head_dim) -> (b, h, t, head_dim)
        queries = self.W_query(xb).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys, values = self._project_kv(source)  # (b, h_kv, s, head_dim)
        trace.emit("queries", queries)
        trace.emit("keys", keys)
        trace.emit("values", values)
        result = attention(
            queries,
            keys,
            values,
            mask=mask,
            causal=causal,
            dropout_p=active_dropout(self.dropout, self.training),
            need_weights=need_weights,
            backend=self.backend,
        )
        heads, weights = result if isinstance(result, tuple) else (result, None)  # (b, h, t, d)
        concat = heads.transpose(1, 2).reshape(b, t, self.d_out)  # (b, t, d_out)
        trace.emit("concat", concat)
        out = self.out_proj(concat)  # (b, t, d_out)
        trace.emit("output", out)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return (out, weights) if weights is not None else out

    def _project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = source.shape
        # (b, s, h_kv * head_dim) -> (b, s, h_kv, head_dim) -> (b, h_kv, s, head_dim)
        keys = self.W_key(source).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(source).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return keys, values

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, context_length={self.context_length}, "
            f"backend={self.backend!r}"
        )
