"""Masks: the one convention attnkit uses, and the causal mask in both alignments.

Mask convention (the only one in attnkit)
-----------------------------------------
* A **boolean** mask says where a query *may attend*: ``True`` = attend,
  ``False`` = masked out. (Same as ``torch.nn.functional.scaled_dot_product_attention``;
  the *opposite* of ``torch.nn.MultiheadAttention``'s ``attn_mask``, where True = masked.)
* A **float** mask is *added* to the scaled scores: ``0`` keeps a position,
  ``-inf`` removes it, anything else biases it.
* A mask broadcasts to the scores' shape ``(..., heads, Lq, Lk)``.
* A query row whose keys are all masked gets weights of zero and a context
  vector of zeros (never NaN), in the forward and the backward pass.

Causal alignment when ``Lq != Lk``
---------------------------------
``causal=True`` means ``"bottom_right"``: the *last* query lines up with the
*last* key, as when new queries follow the keys already in a KV cache.
``"top_left"`` lines the first query up with the first key, as
``scaled_dot_product_attention(is_causal=True)`` does. For ``Lq == Lk`` both
are the usual lower triangle. With Lq = 2, Lk = 5 (``1`` = may attend)::

    bottom_right (default)      top_left
        k0 k1 k2 k3 k4            k0 k1 k2 k3 k4
    q0   1  1  1  1  0        q0   1  0  0  0  0
    q1   1  1  1  1  1        q1   1  1  0  0  0

With Lq > Lk, ``bottom_right`` leaves the first ``Lq - Lk`` queries with no
key at all: their outputs are zeros.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["CausalAlignment", "causal_mask", "normalize_causal"]

CausalAlignment = Literal["top_left", "bottom_right"]
_ALIGNMENTS = ("top_left", "bottom_right")


def normalize_causal(causal: bool | str | None) -> CausalAlignment | None:
    """Turn a user's ``causal`` argument into an alignment name, or None.

    Raises:
        ValueError: for a string that names no alignment.
        TypeError: for anything that is not a bool, a string or None.
    """
    if causal is None or causal is False:
        return None
    if causal is True:
        return "bottom_right"
    if isinstance(causal, str):
        if causal not in _ALIGNMENTS:
            raise ValueError(
                f"causal must be True, False, 'top_left' or 'bottom_right', got {causal!r}"
            )
        return causal  # type: ignore[return-value]
    raise TypeError(f"causal must be a bool or an alignment name, got {type(causal).__name__}")


def causal_mask(
    q_len: int,
    k_len: int,
    alignment: CausalAlignment = "bottom_right",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Return the ``(q_len, k_len)`` boolean causal mask (True = may attend).

    Args:
        q_len: number of queries.
        k_len: number of keys.
        alignment: ``"bottom_right"`` (default) or ``"top_left"``; see the module docs.
        device: where to build the mask.
    """
    offset = k_len - q_len if alignment == "bottom_right" else 0
    q_idx = torch.arange(q_len, device=device).unsqueeze(-1)  # (q, 1)
    k_idx = torch.arange(k_len, device=device)  # (k,)
    return k_idx <= q_idx + offset  # (q, k)


def merge_causal(
    mask: torch.Tensor | None,
    causal: CausalAlignment | None,
    q_len: int,
    k_len: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Fold a causal alignment into ``mask`` (bool stays bool, float stays float)."""
    if causal is None:
        return mask
    tri = causal_mask(q_len, k_len, causal, device=device)  # (q, k)
    if mask is None:
        return tri
    if mask.dtype == torch.bool:
        return mask & tri
    return mask.masked_fill(~tri, float("-inf"))


def dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """Return a ``(..., Lq, 1)`` bool tensor: True where a query row keeps no key."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)
