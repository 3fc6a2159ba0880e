"""The blockwise kernels: tiled forward with an online softmax, and a recomputing backward.

Forward, per query tile, over the key tiles the masks leave non-empty::

    S = scale * Q_i K_j^T            (score_mod, then masks)
    m_new = max(m, rowmax(S));  P = exp(S - m_new)
    l = l * exp(m - m_new) + rowsum(P);  O = O * exp(m - m_new) + P V_j

and finally ``O / l`` and ``lse = m + log(l)``. Only ``O`` and ``lse`` (``O(t)`` per
head) are saved; the backward recomputes ``P = exp(S - lse)`` tile by tile::

    dV_j += P^T dO_i;  dP = dO_i V_j^T;  dS = P * (dP - rowsum(dO * O))
    dQ_i += scale * dS K_j;  dK_j += scale * dS^T Q_i

A query row that keeps no key has ``lse = +inf``: ``P = 0``, output and gradients 0.
With a ``score_mod``, ``dS`` is pulled back through the mod with ``torch.autograd.grad``
on the tile, which also yields the gradients of the mod's own tensors.
"""

from __future__ import annotations

import torch

from attnkit.backends import _fused_tiles
from attnkit.backends._tiles import TilePlan, acc_dtype, apply_tile_mask


def _modded(plan: TilePlan, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    if plan.score_mod is None:
        return s
    return plan.score_mod(s, *plan.grids(q0, q1, k0, k1, s.device))


def _flush_tiny(plan: TilePlan, p: torch.Tensor) -> torch.Tensor:
    """Zero the subnormal weights a score mod's wide score range produces (ALiBi: far
    keys get exp(-100)); subnormal operands make CPU matmuls several times slower.
    The change is below the dtype's smallest normal number. In place."""
    if plan.score_mod is None and (plan.mask is None or plan.mask.dtype == torch.bool):
        return p
    return torch.nn.functional.threshold_(p, torch.finfo(p.dtype).tiny, 0.0)


def _upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Half-precision inputs are computed in float32 (one ``O(t d)`` copy each): more
    accurate than half-precision tile products, and faster on CPUs without bf16 units."""
    return tuple(t.to(acc_dtype(t.dtype)) for t in tensors)


def _views(plan: TilePlan, q, k, v):
    """GQA views; a full-precision query is pre-scaled so no score tile needs a multiply."""
    # (..., h, t, d) -> (b, h_kv, g, t, d); (..., h_kv, s, d) -> (b, h_kv, 1, s, d)
    q5 = q.reshape(plan.b, plan.h_kv, plan.groups, plan.t, q.shape[-1])
    if q.dtype == acc_dtype(q.dtype):
        q5 = q5 * plan.scale
    k5 = k.reshape(plan.b, plan.h_kv, 1, plan.s, k.shape[-1])
    v5 = v.reshape(plan.b, plan.h_kv, 1, plan.s, v.shape[-1])
    return q5, k5, v5


def forward_tiles(plan: TilePlan, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out (b, h, t, d_v) in q's dtype, lse (b, h, t) in the accumulation dtype)``.

    Each tile is normalised on its own with torch's fused ``softmax`` (its
    log-sum-exp read back from the softmax at the row maximum), and tiles are merged
    through their log-sum-exps: ``O = sum_j exp(lse_j - lse) * softmax(S_j) V_j``.
    """
    acc = acc_dtype(q.dtype)
    out_dtype = q.dtype
    q, k, v = _upcast(q, k, v)
    q5, k5, v5 = _views(plan, q, k, v)
    b, h, hk, g, dv = plan.b, plan.h, plan.h_kv, plan.groups, v.shape[-1]
    out = torch.empty(b, h, plan.t, dv, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, h, plan.t, dtype=acc, device=q.device)
    for q0, q1 in plan.q_blocks():
        bq = q1 - q0
        o = m = den = None  # running output, max of tile lse's, sum of exp(lse_j - m)
        for k0, k1 in plan.k_blocks(q0, q1):
            skip, keep, bias = plan.tile_mask(q0, q1, k0, k1, q.device)
            if skip:
                continue
            s = _modded(plan, plan.scores(q5, k5, q0, q1, k0, k1, acc), q0, q1, k0, k1)
            if bias is not None:
                s = s + bias
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))  # (b, h, bq, bk)
            # lse of the tile from its softmax: p[argmax] = exp(max - lse), so
            # lse = max - log(p[argmax]); p[argmax] >= 1 / bk keeps the log well conditioned.
            s_max, arg = s.max(-1, keepdim=True)  # (b, h, bq, 1)
            p = _flush_tiny(plan, torch.softmax(s, -1))
            lse_t = s_max - torch.log(p.gather(-1, arg))
            if keep is not None or bias is not None:
                dead = torch.isneginf(s_max)  # rows with no key in this tile
                p = p.masked_fill_(dead, 0.0)
                lse_t = lse_t.masked_fill_(dead, float("-inf"))
            pv = torch.matmul(p.to(v.dtype).view(b, hk, g, bq, k1 - k0), v5[..., k0:k1, :])
            pv = pv.view(b, h, bq, dv).to(acc)  # (b, h, bq, d_v)
            if o is None:  # first tile: nothing to merge
                o, m = pv, lse_t
                continue
            if den is None:
                den = torch.isfinite(m).to(acc)
            m_new = torch.maximum(m, lse_t)
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)
            alpha, beta = torch.exp(m - m_safe), torch.exp(lse_t - m_safe)  # (b, h, bq, 1)
            den = den * alpha + beta
            o = o * alpha + pv * beta
            m = m_new
        if o is None:  # every tile skipped: no query here keeps a key
            out[:, :, q0:q1] = 0.0
            lse[:, :, q0:q1] = float("inf")
            continue
        if den is not None:
            alive = den > 0
            o = o / torch.where(alive, den, torch.ones_like(den))
            m = torch.where(alive, m + torch.log(den), float("-inf"))
        out[:, :, q0:q1] = o.to(out_dtype)
        lse[:, :, q0:q1] = m.masked_fill(torch.isneginf(m), float("inf")).squeeze(-1)
    return out, lse


def backward_tiles(
    plan: TilePlan, q, k, v, out, lse, grad_out, extra: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """Return ``(dq, dk, dv, d_extra)`` by recomputing each tile's weights from ``lse``."""
    acc = acc_dtype(q.dtype)
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, out, grad_out = _upcast(q, k, v, out, grad_out)
    q5, k5, v5 = _views(plan, q, k, v)
    b, h, hk, g = plan.b, plan.h, plan.h_kv, plan.groups
    do5 = grad_out.reshape(b, hk, g, plan.t, grad_out.shape[-1])  # (b, h_kv, g, t, d_v)
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1, keepdim=True).view(b, h, plan.t, 1)
    dq = torch.zeros(b, hk, g, plan.t, q.shape[-1], dtype=acc, device=q.device)
    dk = torch.zeros(b, hk, 1, plan.s, k.shape[-1], dtype=acc, device=q.device)
    dv = torch.zeros(b, hk, 1, plan.s, v.shape[-1], dtype=acc, device=q.device)
    d_extra: list[torch.Tensor | None] = [None] * len(extra)
    lse4 = lse.view(b, h, plan.t, 1)
    for q0, q1 in plan.q_blocks():
        bq = q1 - q0
        qt, dot = q5[..., q0:q1, :], do5[..., q0:q1, :]  # (b, h_kv, g, bq, d)
        for k0, k1 in plan.k_blocks(q0, q1):
            skip, keep, bias = plan.tile_mask(q0, q1, k0, k1, q.device)
            if skip:
                continue
            bk = k1 - k0
            raw = plan.scores(q5, k5, q0, q1, k0, k1, acc)
            additive = (
                plan.score_mod is not None
                and not extra
                and getattr(plan.score_mod, "additive", False)
            )
            if additive:  # d mod / d score = 1 and no tensor wants a gradient: no autograd
                s = _modded(plan, raw, q0, q1, k0, k1)
            elif plan.score_mod is not None:
                raw = raw.detach().requires_grad_(True)
                with torch.enable_grad():
                    modded = _modded(plan, raw, q0, q1, k0, k1)
                s = modded.detach().clone()
            else:
                s = raw
            if bias is not None:
                s += bias
            if keep is not None:
                s.masked_fill_(~keep, float("-inf"))
            p = _flush_tiny(
                plan, s.sub_(lse4[:, :, q0:q1]).exp_()
            )  # (b, h, bq, bk); 0 where masked
            p5 = p.view(b, hk, g, bq, bk)
            vt, kt = v5[..., k0:k1, :], k5[..., k0:k1, :]
            # dV_j += sum over the g heads sharing it of P^T dO
            dv[..., k0:k1, :] += torch.einsum("bkgqs,bkgqd->bksd", p5, dot.to(acc)).unsqueeze(2)
            dp = torch.matmul(dot, vt.transpose(-2, -1)).to(acc)  # (b, h_kv, g, bq, bk)
            ds = dp.view(b, h, bq, bk).sub_(delta[:, :, q0:q1]).mul_(p)  # (b, h, bq, bk)
            if plan.score_mod is not None and not additive:
                grads = torch.autograd.grad(modded, [raw, *extra], ds, allow_unused=True)
                ds = grads[0]
                for i, gr in enumerate(grads[1:]):
                    if gr is not None:
                        d_extra[i] = gr if d_extra[i] is None else d_extra[i] + gr
            ds5 = ds.view(b, hk, g, bq, bk)
            dq[..., q0:q1, :] += torch.matmul(ds5, kt.to(acc))  # times scale at the end
            dk[..., k0:k1, :] += torch.einsum("bkgqs,bkgqd->bksd", ds5, qt.to(acc)).unsqueeze(2)
    dq *= plan.scale
    if q5.dtype != acc:  # a half-precision query was not pre-scaled
        dk *= plan.scale
    return (
        dq.to(dtypes[0]).reshape(q.shape),
        dk.to(dtypes[1]).reshape(k.shape),
        dv.to(dtypes[2]).reshape(v.shape),
        d_extra,
    )


class BlockwiseAttention(torch.autograd.Function):
    """``apply(plan, q, k, v, *extra) -> (out, lse)``; ``extra`` are the score_mod's tensors."""

    @staticmethod
    def forward(ctx, plan: TilePlan, q, k, v, *extra):  # type: ignore[override]
        engine = _fused_tiles.forward if plan.fused else forward_tiles
        out, lse = engine(plan, q, k, v)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, *extra)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse, *extra = ctx.saved_tensors
        grad_out = grad_out.reshape(out.shape)
        if ctx.plan.fused and ctx.plan.score_mod is None:
            dq, dk, dv = _fused_tiles.backward(ctx.plan, q, k, v, out, lse, grad_out)
            return (None, dq, dk, dv)
        # A score_mod's wide range (ALiBi's far keys) gives subnormal weights, which the
        # fused backward multiplies as they are, several times slower; the tile backward
        # zeroes them first (_flush_tiny) and, from the same LSE, gives the same gradients.
        dq, dk, dv, d_extra = backward_tiles(ctx.plan, q, k, v, out, lse, grad_out, tuple(extra))
        return (None, dq, dk, dv, *d_extra)


def weights_from_lse(plan: TilePlan, q, k, lse: torch.Tensor) -> torch.Tensor:
    """Recompute the ``(b, h, t, s)`` attention weights ``exp(S - lse)`` tile by tile."""
    acc = acc_dtype(q.dtype)
    out_dtype = q.dtype
    q, k = _upcast(q, k)
    q5, k5, _ = _views(plan, q, k, k)
    w = torch.zeros(plan.b, plan.h, plan.t, plan.s, dtype=out_dtype, device=q.device)
    lse4 = lse.view(plan.b, plan.h, plan.t, 1)
    with torch.no_grad():
        for q0, q1 in plan.q_blocks():
            for k0, k1 in plan.k_blocks(q0, q1):
                skip, keep, bias = plan.tile_mask(q0, q1, k0, k1, q.device)
                if skip:
                    continue
                s = _modded(plan, plan.scores(q5, k5, q0, q1, k0, k1, acc), q0, q1, k0, k1)
                s = apply_tile_mask(s, keep, bias)
                w[:, :, q0:q1, k0:k1] = torch.exp(s - lse4[:, :, q0:q1]).to(out_dtype)
    return w
