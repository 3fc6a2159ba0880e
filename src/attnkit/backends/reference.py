"""The reference backend: the explicit math, step by step, in any float dtype.

It is the source of the weights that ``explain`` shows and the only backend
that emits every intermediate to :mod:`attnkit.trace`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit import trace
from attnkit.backends.registry import AttentionCall, BackendResult, register_backend
from attnkit.masks import dead_rows
from attnkit.mods import eval_score_mod

__all__ = ["reference_attention"]


def expand_kv(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat each key/value head for the query heads that share it (GQA/MQA)."""
    g = call.gqa_groups
    if g == 1:
        return call.key, call.value
    # (b, h_kv, s, d) -> (b, h_kv * g, s, d); query head i reads kv head i // g
    return call.key.repeat_interleave(g, dim=-3), call.value.repeat_interleave(g, dim=-3)


def masked_softmax(
    scores: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    *,
    check_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim after masking, and the log-sum-exp of the masked scores.

    Fully masked rows give zeros (not NaN) and an lse of ``-inf``; ``check_rows`` also
    finds rows that a score_mod set to ``-inf`` entirely. ``sinks`` ``(h,)`` are extra
    per-head logits in each row's normaliser (their weight is dropped; the lse includes
    them). Half-precision scores are normalised in float32; the weights are cast back,
    the lse stays float32.
    """
    dead = None
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
        dead = dead_rows(mask)
    if mask is not None or check_rows:
        all_inf = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., t, 1)
        dead = all_inf if dead is None else dead | all_inf
        # Give dead rows finite scores so softmax (and its backward) stays NaN-free,
        # then zero them: masked_fill's backward sends them no gradient.
        scores = scores.masked_fill(dead, 0.0)
    trace.emit("masked_scores", scores)
    acc = _softmax_dtype(scores)
    if sinks is not None:  # one more column per row: the head's sink logit
        sink = sinks.to(acc).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        if dead is not None:  # a dead row keeps only its sink
            keys = scores.to(acc).masked_fill(dead, float("-inf"))
        else:
            keys = scores.to(acc)
        both = torch.cat([keys, sink], dim=-1)
        lse = torch.logsumexp(both, dim=-1)  # a -inf sink on a dead row: -inf
        safe = lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)
        weights = torch.exp(keys - safe).to(scores.dtype)
        return weights, lse
    weights = torch.softmax(scores, dim=-1, dtype=acc).to(scores.dtype)
    lse = torch.logsumexp(scores.to(acc), dim=-1)
    if dead is not None:
        weights = weights.masked_fill(dead, 0.0)
        lse = lse.masked_fill(dead.squeeze(-1), float("-inf"))
    return weights, lse


def _softmax_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def reference_attention(call: AttentionCall) -> BackendResult:
    """Compute attention with explicit tensors for every step (see :func:`attnkit.attention`)."""
    key, value = expand_kv(call)
    if trace.is_recording():  # the unscaled scores, computed only to be shown
        trace.emit("scores", call.query @ key.transpose(-2, -1))  # (b, h, t, s)
    # Scale the query first, as the fused kernels do: q @ k^T itself can overflow float16.
    scores = (call.query * call.scale) @ key.transpose(-2, -1)  # (b, h, t, s)
    trace.emit("scaled_scores", scores)
    if call.score_mod is not None:
        scores = eval_score_mod(call.score_mod, scores, 0, 0)
        trace.emit("modded_scores", scores)
    mask = call.dense_mask()
    weights, lse = masked_softmax(
        scores, mask, call.sinks, check_rows=call.score_mod is not None
    )  # (b, h, t, s), (b, h, t)
    trace.emit("weights", weights)
    if call.dropout_p > 0.0:
        weights = F.dropout(weights, call.dropout_p, training=True)
        trace.emit("dropped_weights", weights)
    context = weights @ value  # (b, h, t, d_v)
    trace.emit("context", context)
    return context, (weights if call.need_weights else None), (lse if call.return_lse else None)


register_backend("reference", reference_attention)
