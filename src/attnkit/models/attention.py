"""The LLM attention layer: everything positional is handed in by the model.

:class:`CausalSelfAttention` is the decoder layer of :class:`~attnkit.models.GPT`
(GQA/MQA, RoPE, sliding window, learned sinks). It computes nothing about positions
itself: the model passes, once per forward, an :class:`AttentionInputs` holding the
RoPE cos/sin of the new tokens (from the one table the model owns), the mask (or the
causal/window flags when no mask is needed), the time indices of the new tokens, and
the layer's KV cache. Nothing is read back from below::

    GPT.forward ── positions, RoPE cos/sin, mask, input_pos ──> AttentionInputs
        │                                                            │
        └─ per layer: att(x, inputs, cache) ── q, k, v ─ rotate ─ cache.update ─ attention()

Shapes: b batch, t new tokens, s keys, h query heads, h_kv key/value heads, d head_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attnkit import trace
from attnkit._validate import (
    check_backend,
    check_bool,
    check_int,
    check_positions,
    check_probability,
    check_window,
)
from attnkit.attention import attention
from attnkit.kv_cache import KVCache
from attnkit.models.linear import Linear
from attnkit.paged_kv_cache import PagedBatch, PagedLayer
from attnkit.rope import apply_rope

__all__ = ["AttentionInputs", "CausalSelfAttention"]


@dataclass(frozen=True)
class AttentionInputs:
    """What the model hands every attention layer of one kind, once per forward.

    Attributes:
        input_pos: ``(t,)`` time indices of the new tokens (where a cache writes them).
        rope: ``(cos, sin)``, each ``(b|1, 1, t, rope_dim)``, rotating the new queries
            (and the new keys before they are cached); None without RoPE.
        key_rope: ``(cos, sin)`` ``(b|1, 1, s, rope_dim)`` rotating the keys *after* the
            cache (StreamingLLM re-positions cached keys each step); None = keys are
            rotated with ``rope`` before caching.
        mask: bool ``(b|1, 1, t, s)`` (True = may attend) or None.
        causal: with no mask, whether :func:`attnkit.attention` applies causality
            (bottom-right aligned: the keys are exactly the times ``0 .. end - 1``).
        window: with no mask, the window :func:`attnkit.attention` applies.
        attend: the attention function, called like :func:`attnkit.attention` with
            ``(q, k, v, mask=, causal=, window=, dropout_p=, sinks=, backend=)``; None =
            :func:`attnkit.attention`. Context parallelism hands in one that attends
            over the whole sequence split across processes
            (:mod:`attnkit.train.context_parallel`).
        paged: with a paged cache (:class:`~attnkit.paged_kv_cache.PagedLayer`), the
            forward's sequences and their page tables; None otherwise.
    """

    input_pos: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    key_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    mask: torch.Tensor | None = None
    causal: bool = True
    window: int | None = None
    attend: Callable[..., torch.Tensor] | None = None
    paged: PagedBatch | None = None

    def __post_init__(self) -> None:
        check_positions(self.input_pos, "input_pos")


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Apply RoPE values ``(cos, sin)`` to ``x`` ``(b, h, t, d)``; identity for None."""
    return x if rope is None else apply_rope(x, rope[0], rope[1])


class CausalSelfAttention(nn.Module):
    """Causal self-attention for decoder LLMs; the model supplies positions and masks.

    Parameters carry the book's names (``W_query``, ``W_key``, ``W_value``,
    ``out_proj``), so state dicts match :class:`~attnkit.MultiHeadAttention`'s and
    GPT-2 weights map one to one.

    Args:
        d_in: input embedding size.
        d_out: model size; divisible by ``num_heads``.
        num_heads: query heads.
        num_kv_heads: key/value heads (None = ``num_heads``; fewer = GQA; 1 = MQA).
        qkv_bias: biases in W_query, W_key, W_value (``out_proj`` always has one).
        dropout: attention-weight dropout in training mode.
        window: this layer's sliding window (None = global); the model uses it to build
            the mask and size the cache.
        sinks: learn one attention-sink logit per head (gpt-oss): each softmax row also
            normalises over ``exp(sink)``, whose share is dropped.
        backend: attention backend name.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        num_heads: int,
        num_kv_heads: int | None = None,
        qkv_bias: bool = False,
        dropout: float = 0.0,
        window: int | None = None,
        sinks: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_int(d_in, "d_in")
        check_int(d_out, "d_out")
        check_int(num_heads, "num_heads")
        num_kv_heads = (
            num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads")
        )
        if d_out % num_heads:
            raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
            )
        self.d_in, self.d_out = d_in, d_out
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_out // num_heads
        self.window = check_window(window)
        self.backend = check_backend(backend)
        kv_out = num_kv_heads * self.head_dim
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        self.W_query = Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = Linear(d_in, kv_out, bias=qkv_bias)
        self.W_value = Linear(d_in, kv_out, bias=qkv_bias)
        self.out_proj = Linear(d_out, d_out)
        self.dropout_p = check_probability(dropout, "dropout")
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if check_bool(sinks, "sinks") else None

    def cache_shape(self) -> tuple[int, int, int]:
        """``(num_kv_heads, head_dim, value_dim)`` of this layer's KV cache."""
        return self.num_kv_heads, self.head_dim, self.head_dim

    def forward(
        self, x: torch.Tensor, inputs: AttentionInputs, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Map ``x`` ``(b, t, d_in)`` to ``(b, t, d_out)``.

        Args:
            x: the new tokens' states.
            inputs: positions, RoPE values and the mask from the model.
            cache: this layer's KV cache (the model owns it), or None.
        """
        if not isinstance(inputs, AttentionInputs):
            raise TypeError(f"inputs must be an AttentionInputs, got {type(inputs).__name__}")
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_in:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be (batch, tokens, d_in={self.d_in}), got {shape}")
        b, t, _ = x.shape
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # (b, t, h * d) -> (b, t, h, d) -> (b, h, t, d)
        q = self.W_query(x).view(b, t, h, d).transpose(1, 2)
        k = self.W_key(x).view(b, t, h_kv, d).transpose(1, 2)  # (b, h_kv, t, d)
        v = self.W_value(x).view(b, t, h_kv, d).transpose(1, 2)
        q = rotate(q, inputs.rope)
        if inputs.key_rope is None:
            k = rotate(k, inputs.rope)
        if isinstance(cache, PagedLayer):  # keys and values live in pages
            return self._paged(x, inputs, cache, q, k, v)
        if cache is not None:
            k, v_cached = cache.update(inputs.input_pos, k, v)  # (b, h_kv, s, d)
            v = v if v_cached is None else v_cached
        k = rotate(k, inputs.key_rope)
        trace.emit("queries", q)
        trace.emit("keys", k)
        trace.emit("values", v)
        ctx = (inputs.attend or attention)(
            q,
            k,
            v,
            mask=inputs.mask,
            causal=inputs.causal if inputs.mask is None else False,
            window=inputs.window if inputs.mask is None else None,
            dropout_p=self.dropout_p if self.training else 0.0,
            sinks=self.sinks,
            backend=self.backend,
        )  # (b, h, t, d)
        assert isinstance(ctx, torch.Tensor)  # no weights were asked for
        out = self.out_proj(ctx.transpose(1, 2).reshape(b, t, self.d_out))  # (b, t, d_out)
        trace.emit("output", out)
        return out

    def _paged(
        self,
        x: torch.Tensor,
        inputs: AttentionInputs,
        cache: PagedLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """The rest of :meth:`forward` on a paged cache: the new keys/values are written
        to the sequences' pages and attention reads them there."""
        if inputs.paged is None:
            raise ValueError(
                "this layer's cache is paged (GPT.setup_paged_cache): run the forward with "
                "GPT.step(..., paged=cache.batch(...)), which hands down its PagedBatch"
            )
        b, t, _ = x.shape
        ctx = cache.attend(
            inputs.paged,
            q,
            k,
            v,
            mask=inputs.mask,
            causal=inputs.causal if inputs.mask is None else False,
            window=inputs.window if inputs.mask is None else None,
            sinks=self.sinks,
            backend=self.backend,
        )  # (b, h, t, d)
        out = self.out_proj(ctx.transpose(1, 2).reshape(b, t, self.d_out))  # (b, t, d_out)
        trace.emit("output", out)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, window={self.window}, "
            f"sinks={self.sinks is not None}, backend={self.backend!r}"
        )
