"""An independent float64 reference for attention, written for the tests only.

It shares no code with attnkit: masks are built from explicit index comparisons
(index by index with Python loops where small) and the softmax is written out
(max-subtracted exp over the kept keys). :func:`plain_attention` is the yardstick of
flash-attn's rule: the same math in the inputs' own dtype.
"""

from __future__ import annotations

import math

import torch


def ref_causal_keep(q_len: int, k_len: int, alignment: str) -> torch.Tensor:
    """(q_len, k_len) bool, True = may attend, built with explicit loops."""
    keep = torch.zeros(q_len, k_len, dtype=torch.bool)
    shift = k_len - q_len if alignment == "bottom_right" else 0
    for i in range(q_len):
        for j in range(k_len):
            keep[i, j] = j <= i + shift
    return keep


def ref_band_keep(lq: int, lk: int, causal: str | None, window: int | None) -> torch.Tensor:
    """``(lq, lk)`` bool of causal and window, written out: query ``i`` sits at key position
    ``i`` (``causal="top_left"``) or ``i + lk - lq`` (``"bottom_right"`` and no causal);
    the window keeps ``q_pos - window < k_pos`` (and ``k_pos - q_pos < window`` without
    causal)."""
    shift = 0 if causal == "top_left" else lk - lq
    qp = torch.arange(lq).view(-1, 1) + shift
    kp = torch.arange(lk).view(1, -1)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal is not None:
        keep &= kp <= qp
    if window is not None:
        keep &= qp - kp < window
        if causal is None:
            keep &= kp - qp < window
    return keep


def plain_attention(
    q, k, v, keep: torch.Tensor, bias: torch.Tensor | None = None, sinks: torch.Tensor | None = None
):
    """Softmax attention in the inputs' dtype, ``(b, h, t, d)`` (GQA expanded): the error
    flash-attn's rule allows twice of. ``sinks`` ``(h,)``: one more logit a row, no value."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias.to(s.dtype)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        return torch.softmax(torch.cat((s, sink), -1), -1)[..., :-1] @ v
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: str | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (context, weights) in float64; rows with no key give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # GQA: query head i reads kv head i // g
        g = q.shape[-3] // k.shape[-3]
        idx = torch.tensor([i // g for i in range(q.shape[-3])])
        k, v = k.index_select(-3, idx), v.index_select(-3, idx)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("...td,...sd->...ts", q, k) * scale
    bias = torch.zeros_like(scores)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            bias = bias + mask.double()
    if causal is not None:
        keep = keep & ref_causal_keep(q.shape[-2], k.shape[-2], causal)
    scores = scores + bias
    keep = keep & torch.isfinite(scores)
    neg = torch.full_like(scores, -math.inf)
    s = torch.where(keep, scores, neg)
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.where(keep, torch.exp(s - row_max), torch.zeros_like(s))
    denom = e.sum(-1, keepdim=True)
    w = torch.where(denom > 0, e / torch.where(denom > 0, denom, torch.ones_like(denom)), e)
    return w @ v, w


def ref_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, lse) in float64, differentiable; 4-D ``(b, h, t, d)`` inputs.

    ``keep`` bool and ``bias`` float broadcast to ``(b, h, t, s)``; ``sinks`` ``(h,)``
    logits join every row's normaliser and their weight is dropped. A row with no key
    (and no sink) gets zeros and ``lse = -inf``. Written out: max, exp, sum, log.
    """
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[1] != q.shape[1]:  # GQA: query head i reads kv head i // g
        g = q.shape[1] // k.shape[1]
        idx = torch.tensor([i // g for i in range(q.shape[1])])
        k, v = k.index_select(1, idx), v.index_select(1, idx)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhtd,bhsd->bhts", q, k) * scale
    if bias is not None:
        s = s + bias.double()
    if keep is not None:
        s = torch.where(keep, s, torch.full_like(s, -math.inf))
    return ref_from_scores(s, v, sinks)


def ref_from_scores(
    s: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, lse) in float64 from final scores ``(b, h, t, s)`` (``-inf`` = masked)
    and values ``(b, h, s, d_v)`` already expanded to the query heads."""
    s, v = s.double(), v.double()
    kept = torch.isfinite(s)
    cols = [s]
    kept_cols = [kept]
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        cols.append(sink)
        kept_cols.append(torch.isfinite(sink))
    s_all, k_all = torch.cat(cols, -1), torch.cat(kept_cols, -1)
    neg = torch.full_like(s_all, -math.inf)
    s_all = torch.where(k_all, s_all, neg)
    m = s_all.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(k_all, torch.exp(s_all - m), torch.zeros_like(s_all))
    den = e.sum(-1, keepdim=True)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    w = torch.where(den > 0, e / safe, torch.zeros_like(e))[..., : s.shape[-1]]
    lse = torch.where(den > 0, m + torch.log(safe), torch.full_like(den, -math.inf))
    return w @ v, lse.squeeze(-1)
