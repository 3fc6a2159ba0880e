"""The one log-sum-exp merge: partial attention results combined exactly.

Attention over keys ``A ∪ B`` from attention over ``A`` and over ``B`` alone, each
normalised over its own keys with log-sum-exp ``lse_A``, ``lse_B``::

    lse = log(exp(lse_A) + exp(lse_B))
    out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B

Both CPU engines merge their tiles with it, sinks are merged with it (a sink is a
partial with ``out = 0`` and ``lse`` = its logit), and ring attention merges its
steps with it. A partial with ``lse = -inf`` (no key) contributes nothing; two of
them give zeros and ``-inf``, never NaN.
"""

from __future__ import annotations

import torch

__all__ = ["add_sinks", "merge_partials"]


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results (see the module docs).

    Args:
        out_a: ``(..., t, d)``, normalised over its own keys (zeros where ``lse_a = -inf``).
        lse_a: ``(..., t)`` natural-log log-sum-exp of its scores.
        out_b: like ``out_a`` (or anything broadcasting to it, e.g. a 0-d zero for a sink).
        lse_b: like ``lse_a``.

    Returns:
        ``(out, lse)``: ``out`` in ``out_a``'s dtype, ``lse`` in the wider of the two lse
        dtypes. Differentiable in every argument.
    """
    m = torch.maximum(lse_a, lse_b)
    m = m.masked_fill(torch.isneginf(m), 0.0)  # both empty: weights exp(-inf) = 0
    w_a = torch.exp(lse_a - m)  # (..., t)
    w_b = torch.exp(lse_b - m)
    den = w_a + w_b  # >= 1 where either has a key (the larger weight is 1), 0 where none
    lse = m + torch.log(den)  # log(0) = -inf where both are empty
    share_b = w_b / den.clamp_min(1.0)  # b's share of the weight; 0 where both are empty
    acc = torch.promote_types(out_a.dtype, lse.dtype)
    out = torch.lerp(out_a.to(acc), out_b.to(acc), share_b.unsqueeze(-1))  # (..., t, d)
    return out.to(out_a.dtype), lse


def add_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, h: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-head sink logits ``(h,)`` into ``out (b, h, t, d)``, ``lse (b, h, t)``: a
    sink is a partial with no value and ``lse`` = its logit. ``out`` keeps its dtype: merge
    into the unrounded (float32) output and round once after."""
    sink_lse = sinks.to(lse.dtype).view(1, h, 1).expand_as(lse)
    return merge_partials(out, lse, torch.zeros((), dtype=out.dtype, device=out.device), sink_lse)
