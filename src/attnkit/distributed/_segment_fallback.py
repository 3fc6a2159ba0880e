"""TEMPORARY dense stand-in for the kernel layer's segment API (k10 contract, item 4).

Same names and signatures as ``attnkit.backends.blockwise``'s ``SegmentMask``,
``segment_forward``, ``segment_backward`` and ``merge_partials``; replaced by them once
the kernel layer lands. Dense per segment: fine for tests, not for long sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.masks import MaskMod, ScoreMod, index_grids, position_keep


@dataclass(frozen=True)
class SegmentMask:
    q_offset: int
    k_offset: int
    causal: bool = False
    window: int | None = None
    mask_mod: MaskMod | None = None
    score_mod: ScoreMod | None = None


def _scores(q, k, seg: SegmentMask, scale: float, *, want_raw: bool = False):
    b, hq, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    g = hq // hk
    raw = torch.einsum("bkgtd,bksd->bkgts", q.reshape(b, hk, g, t, d), k).reshape(b, hq, t, s)
    raw = raw * scale
    bi, hi, qi, ki = index_grids(b, hq, t, s, q.device)
    qi, ki = qi + seg.q_offset, ki + seg.k_offset
    if want_raw:
        raw = raw.detach().requires_grad_(True)
    with torch.enable_grad() if want_raw else torch.no_grad():
        modded = raw if seg.score_mod is None else seg.score_mod(raw, bi, hi, qi, ki)
    keep = None
    if seg.causal or seg.window is not None:
        keep = position_keep(qi, ki, causal=seg.causal, window=seg.window)
    if seg.mask_mod is not None:
        m = torch.as_tensor(seg.mask_mod(bi, hi, qi, ki), device=q.device).bool()
        keep = m if keep is None else keep & m
    sc = modded.detach()
    if keep is not None:
        sc = sc.masked_fill(~keep, float("-inf"))
    return sc, raw, modded


def segment_forward(q, k, v, seg: SegmentMask, *, scale: float):
    with torch.no_grad():
        s, _, _ = _scores(q, k, seg, scale)
        lse = torch.logsumexp(s, -1)  # (b, h, t)
        safe = lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)
        p = torch.exp(s - safe)
        b, hq, t, _ = q.shape
        hk = k.shape[1]
        out = torch.einsum("bkgts,bksd->bkgtd", p.reshape(b, hk, hq // hk, t, -1), v).reshape(
            b, hq, t, v.shape[-1]
        )
    return out, lse


def segment_backward(q, k, v, out, lse, grad_out, seg: SegmentMask, *, scale: float):
    b, hq, t, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    additive = seg.score_mod is None or getattr(seg.score_mod, "additive", False)
    s, raw, modded = _scores(q, k, seg, scale, want_raw=not additive)
    lse4 = lse.masked_fill(torch.isinf(lse), float("inf")).unsqueeze(-1)
    p = torch.exp(s - lse4).nan_to_num(0.0)  # (b, h, t, s)
    p5 = p.reshape(b, hk, g, t, -1)
    do5 = grad_out.reshape(b, hk, g, t, -1)
    dv = torch.einsum("bkgts,bkgtd->bksd", p5, do5)
    dp = torch.einsum("bkgtd,bksd->bkgts", do5, v).reshape(b, hq, t, -1)
    delta = (grad_out * out).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if not additive:
        ds = torch.autograd.grad(modded, raw, ds)[0]
    ds5 = ds.reshape(b, hk, g, t, -1)
    dq = torch.einsum("bkgts,bksd->bkgtd", ds5, k).reshape(q.shape) * scale
    dk = torch.einsum("bkgts,bkgtd->bksd", ds5, q.reshape(b, hk, g, t, d)) * scale
    return dq, dk, dv


def merge_partials(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse
