"""The blockwise plan run on torch's fused CPU flash kernel, segment by segment.

torch's CPU flash-attention kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``)
returns the log-sum-exp beside the output, and its backward takes the output and
log-sum-exp as arguments. That is all a blockwise kernel needs from a tile, so this
engine cuts each query block's keys into *segments*, runs the fused kernel on each,
and merges the segments through their log-sum-exps::

    O = sum_j exp(lse_j - lse) O_j,   lse = log(sum_j exp(lse_j))

The backward calls the fused backward once per segment with the *merged* ``O`` and
``lse``: it then recomputes exactly that segment's weights ``exp(S_j - lse)``, so the
per-segment ``dQ``, ``dK``, ``dV`` add up to the full gradient. Nothing ``t × s`` is saved.
(With a ``score_mod`` the backward runs on the PyTorch-op engine instead: see
``BlockwiseAttention.backward``.)

Segments of one query block (aligned positions ``first .. last``)::

    keys:  lo ........ first-w+1 .... last-w+1 ........ first ...... last+1 = hi
           [ left edge: window ][ interior: every query keeps ][ causal square ]
             explicit mask           no mask at all              is_causal=True

With a ``mask``, ``mask_mod`` or additive ``score_mod`` the keys before the square are
also cut at a grid (``block_k``, or less so that a tile holds at most
:data:`MASK_TILE_ELEMENTS`) and each piece gets an explicit float mask (``-inf`` where
masked, plus the bias); the square takes its mask together with ``is_causal``. Pieces
the masks leave empty are skipped, as in the pure-PyTorch engine. A query row that
keeps no key of a segment gets ``lse_j = -inf`` (the kernel itself would report 0).
"""

from __future__ import annotations

import itertools
import math

import torch

from attnkit.backends import AttentionCall
from attnkit.backends._tiles import TilePlan, _slice, acc_dtype

_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

#: One segment: keys ``[k0, k1)``, whether it is top-left causal inside, and an explicit
#: float mask ``(b|1, h|1, bq, bk)`` (or None) with the rows that keep a key ``(b|1, h|1, bq)``.
Segment = tuple[int, int, bool, "torch.Tensor | None", "torch.Tensor | None"]


def usable(call: AttentionCall, extra: tuple[torch.Tensor, ...]) -> bool:
    """Whether the fused engine can run this call exactly.

    It needs the CPU kernel (any torch from 2.2), CPU tensors of a supported dtype, at
    least one query and key, and a ``score_mod`` that is additive with no tensor
    wanting a gradient (its bias becomes a mask tile).
    """
    q = call.query
    if _FORWARD is None or _BACKWARD is None or q.device.type != "cpu" or q.dtype not in _DTYPES:
        return False
    if call.k_len == 0 or call.q_len == 0 or extra:
        return False
    return call.score_mod is None or getattr(call.score_mod, "additive", False)


def _as_4d(plan: TilePlan, q, k, v):
    """``(b, h, t, d)`` views, half precision upcast to float32 (one ``O(t d)`` copy each):
    the kernel's own bf16 backward is measurably less accurate than plain bf16 math."""
    acc = acc_dtype(q.dtype)
    return (
        q.reshape(plan.b, plan.h, plan.t, q.shape[-1]).to(acc),
        k.reshape(plan.b, plan.h_kv, plan.s, k.shape[-1]).to(acc),
        v.reshape(plan.b, plan.h_kv, plan.s, v.shape[-1]).to(acc),
    )


def _materialises(plan: TilePlan) -> bool:
    """Whether some segments need an explicit mask tile (beyond causal/window bounds)."""
    return plan.mask is not None or plan.mask_mod is not None or plan.score_mod is not None


def _cuts(plan: TilePlan, q0: int, q1: int) -> list[tuple[int, int, bool]]:
    """``[k0, k1)`` pieces of the block's key range, with "is the causal square" flags."""
    lo, hi = plan.k_range(q0, q1)
    if lo >= hi:
        return []
    first, last = q0 + plan.offset, q1 - 1 + plan.offset
    points = {lo, hi}
    if plan.window is not None:
        points.add(min(max(last - plan.window + 1, lo), hi))  # left edge | interior
        if not plan.causal:  # symmetric window: interior | right edge
            points.add(min(max(first + plan.window, lo), hi))
    square = (
        plan.causal
        and lo <= first
        and last + 1 == hi
        and (plan.window is None or q1 - q0 <= plan.window)
    )
    if plan.causal:
        points.add(min(max(first, lo), hi))  # interior | causal square
    if _materialises(plan):  # bounded mask tiles; the square stays whole
        step = _mask_block_k(plan, q1 - q0)
        end = first if square else hi
        points.update(range(lo - lo % step + step, end, step))
    edges = sorted(points)
    return [(a, b, square and a == first) for a, b in itertools.pairwise(edges) if a < b]


#: The most elements of one materialised mask tile. Larger tiles cost more than their
#: size: each fresh allocation past glibc's mmap threshold (32 MB) is page-faulted in
#: anew (an ALiBi bias tile of 12 x 1024 x 1024 took 3x longer per element to build).
MASK_TILE_ELEMENTS = 1 << 22


def _mask_lead(plan: TilePlan) -> int:
    """The (batch x heads) extent of a materialised mask tile, at most."""
    lead = 1
    if plan.score_mod is not None or plan.mask_mod is not None:
        lead = plan.b * plan.h
    if plan.mask is not None:
        lead = max(lead, plan.mask.shape[0] * plan.mask.shape[1])
    return lead


def _mask_block_k(plan: TilePlan, bq: int) -> int:
    """Keys per masked segment: ``plan.block_k``, fewer when a tile would be too large."""
    fit = MASK_TILE_ELEMENTS // (_mask_lead(plan) * bq) // 64 * 64
    return min(plan.block_k, max(64, fit))


def query_block(plan: TilePlan) -> int:
    """Queries per tile when masks are materialised: a causal square tile (bq x bq) must
    fit :data:`MASK_TILE_ELEMENTS`; ``plan.block_q`` otherwise."""
    if not _materialises(plan):
        return plan.block_q
    fit = math.isqrt(MASK_TILE_ELEMENTS // _mask_lead(plan)) // 64 * 64
    return min(plan.block_q, max(64, fit))


def segments(
    plan: TilePlan, q0: int, q1: int, dtype: torch.dtype, device, *, alive: bool = True
) -> list[Segment]:
    """The fused-kernel calls of query block ``[q0, q1)``; adjacent unmasked pieces merged.

    ``alive=False`` (the backward) skips finding the rows a segment masks entirely.
    Only ``keep`` and a float ``mask`` can mask a score: an additive ``score_mod``
    (attnkit's ALiBi and relative bias) adds finite values.
    """
    out: list[Segment] = []
    for k0, k1, square in _cuts(plan, q0, q1):
        if square and not _materialises(plan):
            out.append((k0, k1, True, None, None))
            continue
        # A square with a mask: the kernel takes is_causal and the mask together.
        skip, keep, bias = plan.tile_mask(q0, q1, k0, k1, device)
        if skip:
            continue
        if plan.score_mod is not None:
            zero = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)
            mod_bias = plan.score_mod(zero, *plan.grids(q0, q1, k0, k1, device))
            bias = mod_bias if bias is None else bias + mod_bias
        if keep is None and bias is None:
            if out and out[-1][1] == k0 and not out[-1][2] and out[-1][3] is None:
                out[-1] = (out[-1][0], k1, False, None, None)  # extend the unmasked run
            else:
                out.append((k0, k1, False, None, None))
            continue
        rows = None  # (b|1, h|1, bq): the rows that keep a key of this segment
        if alive and keep is not None:
            rows = keep.any(-1)
        if alive and plan.mask is not None and plan.mask.is_floating_point():
            finite = ~torch.isneginf(_slice(plan.mask, q0, q1, k0, k1)).all(-1)
            rows = finite if rows is None else rows & finite
        mask = torch.zeros((), dtype=dtype, device=device) if bias is None else bias.to(dtype)
        if keep is not None:
            mask = mask.masked_fill(~keep, float("-inf"))
        mask = mask.expand(*mask.shape[:-2], q1 - q0, k1 - k0)  # the kernel wants (.., bq, bk)
        out.append((k0, k1, square, mask, rows))
    return out


def forward(plan: TilePlan, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out (b, h, t, d_v) in q's dtype, lse (b, h, t))``, as the pure engine."""
    acc, out_dtype = acc_dtype(q.dtype), q.dtype
    q, k, v = _as_4d(plan, q, k, v)
    b, h, dv = plan.b, plan.h, v.shape[-1]
    out = torch.empty(b, h, plan.t, dv, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, h, plan.t, dtype=acc, device=q.device)
    for q0, q1 in plan.q_blocks():
        qt = q[:, :, q0:q1]  # (b, h, bq, d)
        o = m = None  # merged output (acc dtype) and log-sum-exp of the segments so far
        for k0, k1, causal, mask, alive in segments(plan, q0, q1, q.dtype, q.device):
            o_j, l_j = _FORWARD(
                qt, k[:, :, k0:k1], v[:, :, k0:k1], 0.0, causal, attn_mask=mask, scale=plan.scale
            )
            l_j = l_j.unsqueeze(-1)  # (b, h, bq, 1)
            if alive is not None:  # rows keeping no key here: the kernel says lse 0
                l_j = l_j.masked_fill(~alive.unsqueeze(-1), float("-inf"))
                o_j = o_j.masked_fill(~alive.unsqueeze(-1), 0.0)
            if o is None:
                o, m = o_j, l_j
                continue
            m_new = torch.logaddexp(m, l_j)
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)
            o = o * torch.exp(m - m_safe) + o_j * torch.exp(l_j - m_safe)
            m = m_new
        if o is None:  # every segment skipped: no query here keeps a key
            out[:, :, q0:q1] = 0.0
            lse[:, :, q0:q1] = float("inf")
            continue
        out[:, :, q0:q1] = o.to(out.dtype)
        lse[:, :, q0:q1] = m.masked_fill(torch.isneginf(m), float("inf")).squeeze(-1)
    return out, lse


def backward(plan: TilePlan, q, k, v, out, lse, grad_out) -> tuple[torch.Tensor, ...]:
    """Return ``(dq, dk, dv)``: one fused backward per forward segment, summed."""
    acc = acc_dtype(q.dtype)
    shapes, dtypes = (q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype)
    q, k, v = _as_4d(plan, q, k, v)
    out = out.reshape(plan.b, plan.h, plan.t, v.shape[-1]).to(acc)
    grad_out = grad_out.reshape(out.shape).to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for q0, q1 in plan.q_blocks():
        qt, ot, gt, lt = q[:, :, q0:q1], out[:, :, q0:q1], grad_out[:, :, q0:q1], lse[:, :, q0:q1]
        for k0, k1, causal, mask, _ in segments(plan, q0, q1, q.dtype, q.device, alive=False):
            g_q, g_k, g_v = _BACKWARD(
                gt,
                qt,
                k[:, :, k0:k1],
                v[:, :, k0:k1],
                ot,
                lt,
                0.0,
                causal,
                attn_mask=mask,
                scale=plan.scale,
            )
            dq[:, :, q0:q1] += g_q
            dk[:, :, k0:k1] += g_k
            dv[:, :, k0:k1] += g_v
    return tuple(
        g.to(dt).reshape(shape) for g, dt, shape in zip((dq, dk, dv), dtypes, shapes, strict=True)
    )
