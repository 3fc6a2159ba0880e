"""Attention over one segment of keys, for context parallelism (ring attention).

A ring step attends a block of queries to a block of keys held elsewhere; the steps'
results are combined with :func:`merge_partials`. :func:`segment_forward` returns one
step's ``(out, lse)``; :func:`segment_backward` takes the *merged* ``out`` and ``lse``
of all steps (so each step recomputes its own share of the weights) and returns that
step's ``dq, dk, dv``: summed over the steps they are the exact gradients.
Positions are global: query row ``i`` sits at ``q_offset + i``, key ``j`` at
``k_offset + j``, for causal, window and the mods alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit._validate import check_int, check_window
from attnkit.backends.blockwise.autograd import engine_backward, engine_forward
from attnkit.backends.blockwise.engines import plan_call
from attnkit.backends.blockwise.plan import NATIVE_CPU, TilePlan
from attnkit.masks import MaskMod, ScoreMod

__all__ = ["SegmentMask", "segment_backward", "segment_forward"]


@dataclass(frozen=True)
class SegmentMask:
    """What masks one (query block, key block) pair, in global positions.

    Attributes:
        q_offset: global position of the first query row.
        k_offset: global position of the first key.
        causal: keep ``k_pos <= q_pos``.
        window: keep ``q_pos - window < k_pos`` (with causal; ``|q_pos - k_pos| < window``
            without), or None.
        mask_mod: ``mask_mod(b, h, q_pos, k_pos)``, or None.
        score_mod: ``score_mod(score, b, h, q_pos, k_pos)``, or None (its tensors get no
            gradient from :func:`segment_backward`).
    """

    q_offset: int
    k_offset: int
    causal: bool = False
    window: int | None = None
    mask_mod: MaskMod | None = None
    score_mod: ScoreMod | None = None


def _plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: SegmentMask, scale: float
) -> TilePlan:
    if not isinstance(seg, SegmentMask):
        raise TypeError(f"seg must be a SegmentMask, got {type(seg).__name__}")
    check_int(seg.q_offset, "q_offset", minimum=None)
    check_int(seg.k_offset, "k_offset", minimum=None)
    check_window(seg.window)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (b, h, len, d) tensor")
    plan = plan_call(
        q,
        k,
        v,
        requested=NATIVE_CPU,
        extra=(),
        scale=float(scale),
        causal="top_left" if seg.causal else None,
        window=seg.window,
        mask=None,
        mask_mod=seg.mask_mod,
        score_mod=seg.score_mod,
        block_mask=None,
        mod_offsets=(seg.q_offset, seg.k_offset),
        # causal/window compare key position j + k_offset with query position i + q_offset
        position_offset=seg.q_offset - seg.k_offset,
    )
    return plan


def segment_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: SegmentMask, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment's attention, no autograd.

    Args:
        q: ``(b, h_q, t, d)``; k, v: ``(b, h_kv, s, d)`` / ``(b, h_kv, s, d_v)`` (GQA
            without copies).
        seg: the segment's positions and masks.
        scale: the factor on ``q @ k^T``.

    Returns:
        ``(out (b, h_q, t, d_v) in q's dtype, lse (b, h_q, t))`` with ``out`` normalised
        over this segment's keys, ``lse`` float32 for half inputs (else q's dtype) and
        ``-inf`` (with zeros in ``out``) on rows the segment masks entirely.
    """
    plan = _plan(q, k, v, seg, scale)
    with torch.no_grad():
        out, lse = engine_forward(plan, q, k, v)
    return out.to(q.dtype), lse


def segment_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    seg: SegmentMask,
    *,
    scale: float,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This segment's ``(dq, dk, dv)`` given the MERGED ``out`` and ``lse`` of all segments.

    Args:
        q, k, v, seg, scale: as in :func:`segment_forward`.
        out: ``(b, h_q, t, d_v)`` the merged output (sinks included if any).
        lse: ``(b, h_q, t)`` the merged log-sum-exp.
        grad_out: the gradient of the loss with respect to ``out``.
        grad_lse: the gradient with respect to the merged ``lse``, if it is used.

    Returns:
        ``dq (b, h_q, t, d)``, ``dk (b, h_kv, s, d)``, ``dv (b, h_kv, s, d_v)`` in the
        inputs' dtypes; summed over every segment they give the full gradients.
    """
    plan = _plan(q, k, v, seg, scale)
    with torch.no_grad():
        dq, dk, dv, _ = engine_backward(plan, q, k, v, out, lse, grad_out, grad_lse)
    return dq, dk, dv
