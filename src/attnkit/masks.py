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

Windows and mods
----------------
``window=w`` keeps, for the query at aligned position ``p``, the keys
``p - w < kv_idx`` (itself and ``w - 1`` before; symmetric ``|p - kv_idx| < w``
without ``causal``). ``mask_mod(b, h, q_idx, kv_idx)`` returns True where a query
may attend; ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites the scaled scores
(its tensors receive gradients). Indices are plain ``0..L-1`` positions in the call.
Every piece is ANDed: causal, window, mask_mod and ``mask``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

__all__ = [
    "CausalAlignment",
    "MaskMod",
    "ScoreMod",
    "causal_mask",
    "dead_rows",
    "materialize",
    "normalize_causal",
    "window_mask",
]

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend), on broadcastable
#: index tensors, as in FlexAttention.
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled scores.
ScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]

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


def window_mask(
    q_len: int,
    k_len: int,
    window: int,
    alignment: CausalAlignment = "bottom_right",
    causal: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Return the ``(q_len, k_len)`` boolean sliding-window mask (True = may attend).

    A query at aligned position ``p`` (``q_idx + k_len - q_len`` for bottom-right,
    ``q_idx`` for top-left) keeps the keys ``p - window < kv_idx``: itself and the
    ``window - 1`` before it. Without ``causal`` the window is symmetric
    (``|p - kv_idx| < window``); with it, later keys are removed too.
    """
    offset = k_len - q_len if alignment == "bottom_right" else 0
    pos = torch.arange(q_len, device=device).unsqueeze(-1) + offset  # (q, 1)
    k_idx = torch.arange(k_len, device=device)  # (k,)
    keep = k_idx > pos - window
    return keep & (k_idx <= pos) if causal else keep & (k_idx < pos + window)


def index_grids(
    batch: int, heads: int, q_len: int, k_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Broadcastable ``(b, h, q_idx, kv_idx)`` index tensors for mask and score mods."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(k_len, device=device).view(1, 1, 1, -1)
    return b, h, q, kv


def materialize(
    mask: torch.Tensor | None,
    causal: CausalAlignment | None,
    window: int | None,
    mask_mod: MaskMod | None,
    query_shape: torch.Size,
    k_len: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Fold causal, window and ``mask_mod`` into one dense mask (bool stays bool, float stays float).

    Returns None when nothing masks the call.
    """
    q_len = query_shape[-2]
    keep = None
    if causal is not None:
        keep = causal_mask(q_len, k_len, causal, device=device)
    if window is not None:
        w = window_mask(q_len, k_len, window, causal or "bottom_right", causal is not None, device)
        keep = w if keep is None else keep & w
    if mask_mod is not None:
        grids = index_grids(query_shape[0], query_shape[1], q_len, k_len, device)
        m = torch.as_tensor(mask_mod(*grids), device=device).to(torch.bool)  # (b|1, h|1, q, k)
        keep = m if keep is None else keep & m
    if keep is None:
        return mask
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, float("-inf"))


def dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """Return a ``(..., Lq, 1)`` bool tensor: True where a query row keeps no key."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)
