"""Multi-head latent attention (MLA, DeepSeek-V2/V3): a low-rank compressed KV cache.

Keys and values are not projected per head from ``x``; a small latent is::

    c_kv   = RMSNorm(W_dkv x)[:kv_rank]            (b, t, kv_rank)    <- cached
    k_rope = RoPE(W_dkv x)[kv_rank:]               (b, t, rope_dim)   <- cached, shared by heads
    k_nope, v = W_ukv c_kv                         (b, h, t, d) each, expanded per head
    q = W_query x = (q_nope, q_rope)               (b, h, t, d + rope_dim)
    score = (q_nope . k_nope + RoPE(q_rope) . k_rope) / sqrt(d + rope_dim)

so a token costs ``kv_rank + rope_dim`` cached numbers per layer instead of
``2 * h_kv * d``. RoPE lives on a separate ("decoupled") part of the key, because a
rotation between ``W_uk`` and the query would stop the up-projection from being
absorbed. **Absorbed** form, used with a cache: ``q_nope . (W_uk c) = (W_uk^T q_nope) . c``
and ``sum_j w_j W_uv c_j = W_uv sum_j w_j c_j``, so attention runs directly on the
cached latents as multi-query attention (one key/value "head" of size ``kv_rank``):

    query = [W_uk^T q_nope, RoPE(q_rope)]  (b, h, t, kv_rank + rope_dim)
    key   = [c_kv, k_rope]                 (b, 1, s, kv_rank + rope_dim)   (the cache itself)
    value = c_kv                           (b, 1, s, kv_rank)               (a view of it)
    out   = W_uv (attention(query, key, value))

The **expanded** form (no cache, training) materialises ``k`` and ``v`` per head; both
compute the same function (tests compare them with a float64 expanded reference).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from attnkit import trace
from attnkit._validate import check_backend, check_bool, check_int, check_probability, check_window
from attnkit.attention import attention
from attnkit.kv_cache import KVCache
from attnkit.models.attention import AttentionInputs, rotate
from attnkit.models.linear import Linear

__all__ = ["MultiHeadLatentAttention"]


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-style MLA; the model supplies positions, RoPE values and masks.

    Args:
        d_in: input embedding size.
        d_out: model size; ``head_dim = d_out // num_heads`` is the non-rotary query/key
            part and the value size of each head.
        num_heads: heads.
        kv_rank: size of the cached latent ``c_kv``.
        rope_dim: size of the decoupled rotary query/key part (even).
        qkv_bias: a bias in ``W_query`` and ``W_dkv``.
        dropout: attention-weight dropout in training mode.
        window: this layer's sliding window (None = global).
        sinks: learned per-head attention sinks.
        backend: attention backend name.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        num_heads: int,
        kv_rank: int,
        rope_dim: int,
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
        self.kv_rank = check_int(kv_rank, "kv_rank")
        self.rope_dim = check_int(rope_dim, "rope_dim")
        if d_out % num_heads:
            raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even, got {rope_dim}")
        self.d_in, self.d_out, self.num_heads = d_in, d_out, num_heads
        self.head_dim = d_out // num_heads
        self.window = check_window(window)
        self.backend = check_backend(backend)
        h, d = num_heads, self.head_dim
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        self.W_query = Linear(d_in, h * (d + rope_dim), bias=qkv_bias)
        self.W_dkv = Linear(d_in, kv_rank + rope_dim, bias=qkv_bias)
        self.kv_norm = nn.RMSNorm(kv_rank, eps=1e-6)
        self.W_ukv = Linear(kv_rank, h * 2 * d, bias=False)  # per head: (k_nope, v)
        self.out_proj = Linear(d_out, d_out)
        self.dropout_p = check_probability(dropout, "dropout")
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if check_bool(sinks, "sinks") else None
        self.scale = 1.0 / math.sqrt(d + rope_dim)

    def cache_shape(self) -> tuple[int, int, int]:
        """``(1, kv_rank + rope_dim, 0)``: one latent per token, no separate value."""
        return 1, self.kv_rank + self.rope_dim, 0

    def _latent(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``[c_kv, k_rope]`` of the new tokens, ``(b, 1, t, kv_rank + rope_dim)``."""
        lat = self.W_dkv(x).unsqueeze(1)  # (b, 1, t, r + rope)
        c, k_rope = lat.split((self.kv_rank, self.rope_dim), dim=-1)
        if inputs.key_rope is None:
            k_rope = rotate(k_rope, inputs.rope)
        return torch.cat((self.kv_norm(c), k_rope), dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        inputs: AttentionInputs,
        cache: KVCache | None = None,
        *,
        absorb: bool | None = None,
    ) -> torch.Tensor:
        """Map ``x`` ``(b, t, d_in)`` to ``(b, t, d_out)``.

        Args:
            x: the new tokens' states.
            inputs: positions, RoPE values and the mask from the model.
            cache: this layer's latent cache, or None.
            absorb: attend over the latents (True) or expanded per-head keys/values
                (False); None = absorbed with a cache, expanded without.
        """
        b, t, _ = x.shape
        h, d, r = self.num_heads, self.head_dim, self.kv_rank
        q = self.W_query(x).view(b, t, h, d + self.rope_dim).transpose(1, 2)  # (b, h, t, d + rope)
        q_nope, q_rope = q.split((d, self.rope_dim), dim=-1)
        q_rope = rotate(q_rope, inputs.rope)
        lat = self._latent(x, inputs)  # (b, 1, t, r + rope)
        if cache is not None:
            lat, _ = cache.update(inputs.input_pos, lat)  # (b, 1, s, r + rope)
        if inputs.key_rope is not None:
            c, k_rope = lat.split((r, self.rope_dim), dim=-1)
            lat = torch.cat((c, rotate(k_rope, inputs.key_rope)), dim=-1)
        trace.emit("latents", lat)
        w_ukv = self.W_ukv.weight.view(h, 2, d, r)  # (h, [k, v], d, r)
        common: dict[str, Any] = dict(
            mask=inputs.mask,
            causal=inputs.causal if inputs.mask is None else False,
            window=inputs.window if inputs.mask is None else None,
            scale=self.scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            sinks=self.sinks,
            backend=self.backend,
        )
        if absorb if absorb is not None else cache is not None:
            q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w_ukv[:, 0])  # (b, h, t, r)
            query = torch.cat((q_lat, q_rope), dim=-1)  # (b, h, t, r + rope)
            ctx_lat = attention(query, lat, lat[..., :r], **common)  # (b, h, t, r), MQA
            assert isinstance(ctx_lat, torch.Tensor)  # no weights were asked for
            ctx = torch.einsum("bhtr,hdr->bhtd", ctx_lat, w_ukv[:, 1])  # (b, h, t, d)
        else:
            c, k_rope = lat.split((r, self.rope_dim), dim=-1)
            kv = self.W_ukv(c.squeeze(1)).view(b, -1, h, 2, d)  # (b, s, h, 2, d)
            k_nope, v = kv.unbind(3)
            k_nope, v = k_nope.transpose(1, 2), v.transpose(1, 2)  # (b, h, s, d)
            k = torch.cat((k_nope, k_rope.expand(-1, h, -1, -1)), dim=-1)  # (b, h, s, d + rope)
            query = torch.cat((q_nope, q_rope), dim=-1)
            expanded = attention(query, k, v, **common)  # (b, h, t, d)
            assert isinstance(expanded, torch.Tensor)
            ctx = expanded
        out = self.out_proj(ctx.transpose(1, 2).reshape(b, t, self.d_out))  # (b, t, d_out)
        trace.emit("output", out)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, kv_rank={self.kv_rank}, "
            f"rope_dim={self.rope_dim}, window={self.window}, backend={self.backend!r}"
        )
