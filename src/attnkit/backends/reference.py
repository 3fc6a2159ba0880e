"""The reference backend: the explicit math, step by step, in any float dtype.

It is the source of the weights that ``explain`` shows and the only backend
that emits every intermediate to :mod:`attnkit.trace`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit import trace
from attnkit.backends import AttentionCall, BackendResult, register_backend
from attnkit.masks import dead_rows, index_grids

__all__ = ["reference_attention"]


def expand_kv(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat each key/value head for the query heads that share it (GQA/MQA)."""
    g = call.gqa_groups
    if g == 1:
        return call.key, call.value
    # (b, h_kv, s, d) -> (b, h_kv * g, s, d); query head i reads kv head i // g
    return call.key.repeat_interleave(g, dim=-3), call.value.repeat_interleave(g, dim=-3)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim after masking; fully masked rows give zeros, not NaN.

    Half-precision scores are normalised in float32 and cast back.
    """
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
        dead = dead_rows(mask) | torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., t, 1)
        # Give dead rows finite scores so softmax (and its backward) stays NaN-free,
        # then zero them: masked_fill's backward sends them no gradient.
        scores = scores.masked_fill(dead, 0.0)
    trace.emit("masked_scores", scores)
    weights = torch.softmax(scores, dim=-1, dtype=_softmax_dtype(scores)).to(scores.dtype)
    if mask is not None:
        weights = weights.masked_fill(dead, 0.0)
    return weights


def _softmax_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def reference_attention(call: AttentionCall) -> BackendResult:
    """Compute attention with explicit tensors for every step (see :func:`attnkit.attention`)."""
    key, value = expand_kv(call)
    scores = call.query @ key.transpose(-2, -1)  # (b, h, t, s)
    trace.emit("scores", scores)
    scores = scores * call.scale
    trace.emit("scaled_scores", scores)
    if call.score_mod is not None:
        b, h, _, _ = scores.shape
        scores = call.score_mod(scores, *index_grids(b, h, call.q_len, call.k_len, scores.device))
        trace.emit("modded_scores", scores)
    mask = call.dense_mask()
    weights = masked_softmax(scores, mask)  # (b, h, t, s)
    trace.emit("weights", weights)
    if call.dropout_p > 0.0:
        weights = F.dropout(weights, call.dropout_p, training=True)
        trace.emit("dropped_weights", weights)
    context = weights @ value  # (b, h, t, d_v)
    trace.emit("context", context)
    return context, (weights if call.need_weights else None)


register_backend("reference", reference_attention)
