"""Rotary position embedding (RoPE): positions enter attention as rotations of q and k.

Each head vector of size ``head_dim`` is split into two halves ``(x1, x2)``; the pair
``(x1[i], x2[i])`` is rotated by the angle ``pos * theta ** (-2 i / head_dim)``
(the "rotate half" layout of GPT-NeoX and Llama). Because a rotation by ``m`` then
a dot product with a rotation by ``n`` depends only on ``m - n``, attention scores
see *relative* positions. Keys are rotated before they enter a KV cache, so a cached
decoding step only needs the absolute position of its new tokens.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rope", "rope_tables", "rope_values"]


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float = 10000.0,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the ``(cos, sin)`` tables, each ``(max_seq_len, head_dim)``, in float32.

    Raises:
        ValueError: an odd ``head_dim``, a non-positive length or ``theta``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"RoPE needs an even, positive head_dim, got {head_dim}")
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    if not theta > 0:
        raise ValueError(f"rope_theta must be positive, got {theta}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = theta**-exponent  # (head_dim / 2,)
    pos = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(pos, inv_freq)  # (max_seq_len, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (max_seq_len, head_dim)
    return angles.cos().float(), angles.sin().float()


def rope_values(
    positions: torch.Tensor,
    head_dim: int,
    theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(*positions.shape, head_dim)`` in ``dtype``, for any integer
    positions (negative or past a table's end), computed in float64 like the tables."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = theta ** -(exponent / head_dim)  # (head_dim / 2,)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(..., t, head_dim)`` by ``cos``/``sin`` broadcastable to it
    (``(t, head_dim)``, or ``(b, 1, t, head_dim)`` for per-row positions)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)  # (..., t, head_dim)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables for positions ``0 .. max_seq_len - 1``.

    The tables are non-persistent buffers: they follow ``.to()`` but stay out of
    ``state_dict`` (they are a function of the arguments).

    Args:
        head_dim: size of each head vector (even).
        max_seq_len: the most positions that will be asked for.
        theta: the base of the frequencies (10000 in the RoPE paper, 500000 in Llama 3).
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        cos, sin = rope_tables(head_dim, max_seq_len, theta)
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, float(theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``(b, h, t, head_dim)`` for the absolute ``positions`` ``(t,)``."""
        return apply_rope(x, self.cos[positions], self.sin[positions])  # (t, head_dim) each

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"
