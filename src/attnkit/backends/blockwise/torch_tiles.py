"""The PyTorch-op engine: tiles computed with torch ops, any device, every request.

Forward, per query block, over the key tiles of :meth:`TilePlan.tiles`::

    S_j = scale * Q_i K_j^T            (score_mod, then masks)
    O_j = softmax(S_j) V_j,  lse_j = logsumexp(S_j)
    (O, lse) = merge_partials((O, lse), (O_j, lse_j))

Only ``O`` and ``lse`` (``O(t)`` per head) are kept; the backward recomputes
``P = exp(S - lse)`` tile by tile::

    dV_j += P^T dO_i;  dP = dO_i V_j^T;  dS = P * (dP - rowsum(dO * O) + dlse)
    dQ_i += scale * dS K_j;  dK_j += scale * dS^T Q_i

With a ``score_mod``, ``dS`` is pulled back through the mod with ``torch.autograd.grad``
on the tile, which also yields the gradients of the tensors the mod reads.
"""

from __future__ import annotations

import torch

from attnkit.backends.blockwise.merge import merge_partials
from attnkit.backends.blockwise.plan import Tile, TilePlan, acc_dtype


def _upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Half-precision inputs are computed in float32 (one ``O(t d)`` copy each): more
    accurate than half-precision tile products, and faster on CPUs without bf16 units."""
    return tuple(t.to(acc_dtype(t.dtype)) for t in tensors)


def _views(plan: TilePlan, q, k, v):
    """GQA views without copies; a full-precision query is pre-scaled."""
    # (..., h, t, d) -> (b, h_kv, g, t, d); (..., h_kv, s, d) -> (b, h_kv, 1, s, d)
    q5 = q.reshape(plan.b, plan.h_kv, plan.groups, plan.t, q.shape[-1])
    if q.dtype == acc_dtype(q.dtype):
        q5 = q5 * plan.scale
    k5 = k.reshape(plan.b, plan.h_kv, 1, plan.s, k.shape[-1])
    v5 = v.reshape(plan.b, plan.h_kv, 1, plan.s, v.shape[-1])
    return q5, k5, v5


def _scores(plan: TilePlan, q5, k5, q0: int, q1: int, tile: Tile, acc: torch.dtype):
    """Scaled raw scores of one tile, ``(b, h, bq, bk)`` in ``acc`` dtype."""
    s = torch.matmul(q5[..., q0:q1, :], k5[..., tile.k0 : tile.k1, :].transpose(-2, -1))
    s = s.view(plan.b, plan.h, q1 - q0, tile.k1 - tile.k0)
    return s if s.dtype == acc else s.to(acc).mul_(plan.scale)


def _masked(plan: TilePlan, s: torch.Tensor, q0: int, q1: int, tile: Tile) -> torch.Tensor:
    """Add the tile's bias and set what it masks to ``-inf``."""
    if tile.bias is not None:
        s = s + tile.bias
    keep = plan.full_keep(q0, q1, tile, s.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _flush_tiny(plan: TilePlan, p: torch.Tensor) -> torch.Tensor:
    """Zero the subnormal weights a score mod's wide score range produces (ALiBi: far
    keys get exp(-100)); subnormal operands make CPU matmuls several times slower.
    The change is below the dtype's smallest normal number. In place."""
    if plan.score_mod is None and (plan.mask is None or plan.mask.dtype == torch.bool):
        return p
    return torch.nn.functional.threshold_(p, torch.finfo(p.dtype).tiny, 0.0)  # type: ignore[attr-defined]


def forward(plan: TilePlan, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out (b, h, t, d_v), lse (b, h, t))`` in the accumulation dtype (float32
    for half inputs); ``lse = -inf`` and zeros on rows that keep no key."""
    acc = acc_dtype(q.dtype)
    q, k, v = _upcast(q, k, v)
    q5, k5, v5 = _views(plan, q, k, v)
    b, h, hk, g, dv = plan.b, plan.h, plan.h_kv, plan.groups, v.shape[-1]
    out = torch.zeros(b, h, plan.t, dv, dtype=acc, device=q.device)
    lse = torch.full((b, h, plan.t), float("-inf"), dtype=acc, device=q.device)
    for q0, q1 in plan.q_blocks():
        bq = q1 - q0
        o: torch.Tensor | None = None
        m: torch.Tensor | None = None
        for tile in plan.tiles(q0, q1, acc, q.device):
            s = plan.mod_scores(_scores(plan, q5, k5, q0, q1, tile, acc), q0, tile.k0)
            s = _masked(plan, s, q0, q1, tile)  # (b, h, bq, bk)
            # lse of the tile from its softmax: p[argmax] = exp(max - lse), so
            # lse = max - log(p[argmax]); p[argmax] >= 1 / bk keeps the log well conditioned.
            s_max, arg = s.max(-1, keepdim=True)  # (b, h, bq, 1)
            dead = torch.isneginf(s_max)  # rows keeping no key of this tile
            p = torch.softmax(s.masked_fill(dead, 0.0), -1)
            p = _flush_tiny(plan, p.masked_fill_(dead, 0.0))
            lse_t = (s_max - torch.log(p.gather(-1, arg))).masked_fill_(dead, float("-inf"))
            pv = torch.matmul(p.to(v.dtype).view(b, hk, g, bq, -1), v5[..., tile.k0 : tile.k1, :])
            pv = pv.view(b, h, bq, dv)
            if o is None or m is None:
                o, m = pv, lse_t.squeeze(-1)
            else:
                o, m = merge_partials(o, m, pv, lse_t.squeeze(-1))
        if o is not None and m is not None:
            out[:, :, q0:q1] = o.to(acc)
            lse[:, :, q0:q1] = m
    return out, lse


def backward(
    plan: TilePlan,
    q,
    k,
    v,
    out,
    lse,
    grad_out,
    grad_lse: torch.Tensor | None,
    extra: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """Return ``(dq, dk, dv, d_extra)``, recomputing each tile's weights from ``lse``.

    ``out``/``lse`` are the totals (over every key, sinks included); ``grad_lse`` the
    gradient reaching the returned log-sum-exp, or None.
    """
    acc = acc_dtype(q.dtype)
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v, out, grad_out = _upcast(q, k, v, out, grad_out)
    q5, k5, v5 = _views(plan, q, k, v)
    b, h, hk, g = plan.b, plan.h, plan.h_kv, plan.groups
    do5 = grad_out.reshape(b, hk, g, plan.t, grad_out.shape[-1])  # (b, h_kv, g, t, d_v)
    delta = (grad_out * out).sum(-1).view(b, h, plan.t, 1)
    if grad_lse is not None:
        delta = delta - grad_lse.reshape(b, h, plan.t, 1).to(acc)
    dq = torch.zeros(b, hk, g, plan.t, q.shape[-1], dtype=acc, device=q.device)
    dk = torch.zeros(b, hk, 1, plan.s, k.shape[-1], dtype=acc, device=q.device)
    dv = torch.zeros(b, hk, 1, plan.s, v.shape[-1], dtype=acc, device=q.device)
    d_extra: list[torch.Tensor | None] = [None] * len(extra)
    # rows keeping no key: +inf makes every weight exp(s - inf) = 0
    lse4 = lse.reshape(b, h, plan.t, 1).to(acc)
    lse4 = lse4.masked_fill(torch.isneginf(lse4), float("inf"))
    additive = (
        plan.score_mod is not None and not extra and getattr(plan.score_mod, "additive", False)
    )
    for q0, q1 in plan.q_blocks():
        bq = q1 - q0
        qt, dot = q5[..., q0:q1, :], do5[..., q0:q1, :]  # (b, h_kv, g, bq, d)
        for tile in plan.tiles(q0, q1, acc, q.device):
            k0, k1 = tile.k0, tile.k1
            bk = k1 - k0
            raw = _scores(plan, q5, k5, q0, q1, tile, acc)
            if plan.score_mod is None or additive:  # d mod / d score = 1: no autograd
                s = plan.mod_scores(raw, q0, k0)
            else:
                raw = raw.detach().requires_grad_(True)
                with torch.enable_grad():
                    modded = plan.mod_scores(raw, q0, k0)
                s = modded.detach()
            s = _masked(plan, s, q0, q1, tile)
            p = _flush_tiny(plan, (s - lse4[:, :, q0:q1]).exp_())  # (b, h, bq, bk); 0 if masked
            p5 = p.view(b, hk, g, bq, bk)
            vt, kt = v5[..., k0:k1, :], k5[..., k0:k1, :]
            # dV_j += sum over the g heads sharing it of P^T dO
            dv[..., k0:k1, :] += torch.einsum("bkgqs,bkgqd->bksd", p5, dot).unsqueeze(2)
            dp = torch.matmul(dot, vt.transpose(-2, -1))  # (b, h_kv, g, bq, bk)
            ds = dp.view(b, h, bq, bk).sub_(delta[:, :, q0:q1]).mul_(p)  # (b, h, bq, bk)
            if plan.score_mod is not None and not additive:
                # retain_graph: a captured non-leaf (w = p * 2) is reached through its
                # graph, which every tile walks again
                grads = torch.autograd.grad(
                    modded, [raw, *extra], ds, allow_unused=True, retain_graph=bool(extra)
                )
                ds = grads[0]
                for i, gr in enumerate(grads[1:]):
                    if gr is not None:
                        prev = d_extra[i]
                        d_extra[i] = gr if prev is None else prev + gr
            ds5 = ds.reshape(b, hk, g, bq, bk)
            dq[..., q0:q1, :] += torch.matmul(ds5, kt)  # times scale at the end
            dk[..., k0:k1, :] += torch.einsum("bkgqs,bkgqd->bksd", ds5, qt).unsqueeze(2)
    dq *= plan.scale  # (dk is already scaled: the query was pre-scaled in _views)
    return (
        dq.to(dtypes[0]).reshape(q.shape),
        dk.to(dtypes[1]).reshape(k.shape),
        dv.to(dtypes[2]).reshape(v.shape),
        d_extra,
    )


def attention_weights(plan: TilePlan, q, k, sinks: torch.Tensor | None) -> torch.Tensor:
    """The ``(b, h, t, s)`` attention weights ``exp(S - lse)``, the ``lse`` taken over these
    very scores (plus the ``(h,)`` sink logits, whose share is dropped).

    Not the engine's ``lse``: computed by another kernel, it differs from these scores in
    the last bits, and a row's weights would miss 1 by ~1e-5 (one kept key: ``1 - 1e-5``).
    Here a single kept key's weight is exactly 1; a row with no key (and no sink) is 0.
    """
    acc, out_dtype = acc_dtype(q.dtype), q.dtype
    q, k = _upcast(q, k)
    q5, k5, _ = _views(plan, q, k, k)
    scores = torch.full((plan.b, plan.h, plan.t, plan.s), float("-inf"), dtype=acc, device=q.device)
    with torch.no_grad():
        for q0, q1 in plan.q_blocks():
            for tile in plan.tiles(q0, q1, acc, q.device):
                s = plan.mod_scores(_scores(plan, q5, k5, q0, q1, tile, acc), q0, tile.k0)
                scores[:, :, q0:q1, tile.k0 : tile.k1] = _masked(plan, s, q0, q1, tile)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (b, h, t, 1); -inf: no key
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.detach().to(acc).view(1, plan.h, 1, 1))
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # no key, no sink: weights 0
        return torch.exp(scores - lse).to(out_dtype)
