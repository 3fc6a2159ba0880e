"""Ring attention: K/V blocks travel round the ranks, partial results merge by log-sum-exp.

Rank ``r`` keeps its query shard. At step ``s`` it holds the K/V block of rank
``o = r - s`` (mod W); before computing on it, it posts the block onward to ``r + 1``
and the receive of the next one from ``r - 1`` (``batch_isend_irecv``), so the
transfer overlaps the compute. Each (query chunk, key chunk) pair whose positions a
causal mask or window leaves non-empty is one call of the kernel layer's
``segment_forward``; the partials merge through ``merge_partials`` (the blockwise
kernel's one merge)::

    step 0      step 1      step 2          W = 3, one K/V block per rank and step
    r0: KV0     r0: KV2     r0: KV1
    r1: KV1     r1: KV0     r1: KV2
    r2: KV2     r2: KV1     r2: KV0

A block is sent on only while a rank further round the ring needs it, so a causal
contiguous layout never sends the last rank's block back to rank 0, and with a window
a block goes only as far as the ranks whose queries can see it. The backward runs the
same ring; each rank's share of a block's dK/dV goes straight back to its owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from attnkit.distributed import _kernel
from attnkit.distributed.comm import Group, exchange
from attnkit.distributed.layout import Chunk, Layout
from attnkit.masks import MaskMod, ScoreMod

__all__ = ["RingPlan", "ring_attention"]


def pair_empty(qc: Chunk, kc: Chunk, causal: bool, window: int | None) -> bool:
    """Whether causal/window rules leave no (query, key) pair of two chunks.

    Keeps ``k <= q`` (causal) and ``q - window < k`` (window; ``k < q + window`` too
    when not causal), as :func:`attnkit.masks.position_keep`.
    """
    q_first, q_last = qc.start, qc.stop - 1
    k_first, k_last = kc.start, kc.stop - 1
    if causal and k_first > q_last:
        return True
    if window is not None:
        if k_last <= q_first - window:
            return True
        if not causal and k_first >= q_last + window:
            return True
    return False


@dataclass(frozen=True)
class RingPlan:
    """What one ring call computes and sends, built once per call (no communication)."""

    layout: Layout
    rank: int
    causal: bool
    window: int | None
    mask_mod: MaskMod | None
    score_mod: ScoreMod | None
    scale: float

    @property
    def world(self) -> int:
        return self.layout.world_size

    def pairs(self, dest: int, origin: int) -> list[tuple[int, Chunk, int, Chunk]]:
        """Non-empty ``(q_index, q_chunk, k_index, k_chunk)`` pairs of ``dest``'s queries
        against ``origin``'s keys; indices count chunks in the shards' order."""
        out = []
        for qi, qc in enumerate(self.layout.chunks(dest)):
            for ki, kc in enumerate(self.layout.chunks(origin)):
                if not pair_empty(qc, kc, self.causal, self.window):
                    out.append((qi, qc, ki, kc))
        return out

    @cached_property
    def needed(self) -> list[list[bool]]:
        """``needed[dest][origin]``: whether ``dest``'s queries see any of ``origin``'s keys."""
        w = self.world
        return [[bool(self.pairs(d, o)) for o in range(w)] for d in range(w)]

    def travels(self, origin: int, step: int) -> bool:
        """Whether ``origin``'s block, held at ``step`` by rank ``origin + step``, goes on:
        some rank further round the ring needs it. Sender and receiver agree on it."""
        w = self.world
        return any(self.needed[(origin + j) % w][origin] for j in range(step + 1, w))

    def segment(self, qc: Chunk, kc: Chunk) -> _kernel.SegmentMask:
        return _kernel.SegmentMask(
            q_offset=qc.start,
            k_offset=kc.start,
            causal=self.causal,
            window=self.window,
            mask_mod=self.mask_mod,
            score_mod=self.score_mod,
        )


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as one flat buffer: one message per block."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    nk = k_shape.numel()
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


def _block_shapes(k: torch.Tensor, v: torch.Tensor, length: int):
    b, hk = k.shape[0], k.shape[1]
    return torch.Size((b, hk, length, k.shape[-1])), torch.Size((b, hk, length, v.shape[-1]))


def _ring_steps(plan: RingPlan, k, v, group: Group, phase: str):
    """Yield ``(step, origin, k_block, v_block)`` for every step, moving the blocks round
    the ring; the blocks are None where this rank does not compute (its queries see
    none of ``origin``'s keys). The next transfer is in flight during each yield."""
    r, w = plan.rank, plan.world
    block: torch.Tensor | None = _pack(k, v)
    for s in range(w):
        origin = (r - s) % w
        nxt, works = None, []
        if s + 1 < w:
            # travels(origin, s) implies the block arrived: a rank further on needs it.
            sends = [(block, (r + 1) % w, "kv")] if plan.travels(origin, s) else []
            src = (r - s - 1) % w
            recvs = []
            if plan.travels(src, s):
                ks, vs = _block_shapes(k, v, plan.layout.local_len(src))
                nxt = k.new_empty(ks.numel() + vs.numel())
                recvs.append((nxt, (r - 1) % w, "kv"))
            works = exchange(sends, recvs, group=group, phase=phase, step=s)  # type: ignore[arg-type]
        if block is not None and plan.needed[r][origin]:
            ks, vs = _block_shapes(k, v, plan.layout.local_len(origin))
            kb, vb = _unpack(block, ks, vs)
            yield s, origin, kb, vb
        else:
            yield s, origin, None, None
        for work in works:
            work.wait()
        block = nxt


def _chunks(x: torch.Tensor, chunks: list[Chunk]) -> list[torch.Tensor]:
    return list(torch.split(x, [c.length for c in chunks], dim=2))


def ring_forward(plan: RingPlan, q, k, v, sinks, group: Group):
    """``(out (b, h, t, d_v), lse (b, h, t))`` of this rank's queries over the whole ring."""
    r = plan.rank
    q_parts = _chunks(q, plan.layout.chunks(r))
    outs: list[torch.Tensor | None] = [None] * len(q_parts)
    lses: list[torch.Tensor | None] = [None] * len(q_parts)
    for _, origin, kb, vb in _ring_steps(plan, k, v, group, "forward"):
        if kb is None:
            continue
        k_parts = _chunks(kb, plan.layout.chunks(origin))
        v_parts = _chunks(vb, plan.layout.chunks(origin))
        for qi, qc, ki, kc in plan.pairs(r, origin):
            o, lse = _kernel.segment_forward(
                q_parts[qi], k_parts[ki], v_parts[ki], plan.segment(qc, kc), scale=plan.scale
            )
            if outs[qi] is None:  # half precision merges in float32, as the lse
                outs[qi], lses[qi] = o.to(lse.dtype), lse
            else:
                outs[qi], lses[qi] = _kernel.merge_partials(outs[qi], lses[qi], o, lse)
    b, h, t = q.shape[0], q.shape[1], q.shape[2]
    out_parts, lse_parts = [], []
    for qi, qp in enumerate(q_parts):
        o, lse = outs[qi], lses[qi]
        if o is None:  # a chunk no key reaches (only a mask could do this; kept general)
            o = q.new_zeros(b, h, qp.shape[2], v.shape[-1])
            lse = q.new_full((b, h, qp.shape[2]), float("-inf"))
        out_parts.append(o)
        lse_parts.append(lse)
    out, lse = torch.cat(out_parts, 2), torch.cat(lse_parts, 2)  # (b, h, t, d_v), (b, h, t)
    if sinks is not None:  # a sink is a partial with output 0 and log-sum-exp = its logit
        sink_lse = sinks.to(lse.dtype).view(1, h, 1).expand(b, h, t)
        out, lse = _kernel.merge_partials(out, lse, torch.zeros_like(out), sink_lse)
    return out.to(q.dtype), lse


def ring_backward(plan: RingPlan, q, k, v, out, lse, grad_out, grad_lse, group: Group):
    """``(dq, dk, dv)`` of this rank's shards; ``out``/``lse`` are the merged totals and
    ``grad_lse`` the gradient of the merged log-sum-exp (or None)."""
    r, w = plan.rank, plan.world
    q_parts = _chunks(q, plan.layout.chunks(r))
    o_parts, g_parts = _chunks(out, plan.layout.chunks(r)), _chunks(grad_out, plan.layout.chunks(r))
    lens = [c.length for c in plan.layout.chunks(r)]
    l_parts = list(torch.split(lse, lens, dim=2))
    gl_parts = [None] * len(lens) if grad_lse is None else list(torch.split(grad_lse, lens, dim=2))
    dq_parts = [torch.zeros_like(p) for p in q_parts]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    pending: list[tuple[list, torch.Tensor | None]] = []  # (works, buffer to add on arrival)

    def settle(upto: int) -> None:
        while len(pending) > upto:
            works, buf = pending.pop(0)
            for work in works:
                work.wait()
            if buf is not None:
                g_k, g_v = _unpack(buf, k.shape, v.shape)
                dk.add_(g_k)
                dv.add_(g_v)

    for s, origin, kb, vb in _ring_steps(plan, k, v, group, "backward"):
        sends = []
        if kb is not None and vb is not None:
            dk_block, dv_block = _block_grads(
                plan, origin, (q_parts, o_parts, l_parts, g_parts, gl_parts), kb, vb, dq_parts
            )
            if origin == r:
                dk.add_(dk_block)
                dv.add_(dv_block)
            else:  # this rank's share of origin's dK/dV goes straight back to it
                sends.append((_pack(dk_block, dv_block), origin, "dkv"))
        # ... and the share of this rank's block from the rank holding it at this step.
        holder = (r + s) % w
        recvs, buf = [], None
        if holder != r and plan.needed[holder][r]:
            buf = k.new_empty(k.numel() + v.numel())
            recvs.append((buf, holder, "dkv"))
        pending.append((exchange(sends, recvs, group=group, phase="backward", step=s), buf))
        settle(1)  # the previous step's dK/dV have had this step's compute to arrive
    settle(0)
    return torch.cat(dq_parts, 2), dk, dv


def _block_grads(plan: RingPlan, origin: int, rows, kb, vb, dq_parts):
    """dK/dV of ``origin``'s block from this rank's queries (dQ added into ``dq_parts``).

    ``rows``: this rank's chunks of q, the merged out and lse, and their gradients."""
    q_parts, o_parts, l_parts, g_parts, gl_parts = rows
    k_parts = _chunks(kb, plan.layout.chunks(origin))
    v_parts = _chunks(vb, plan.layout.chunks(origin))
    dk_parts = [torch.zeros_like(p) for p in k_parts]
    dv_parts = [torch.zeros_like(p) for p in v_parts]
    for qi, qc, ki, kc in plan.pairs(plan.rank, origin):
        g_q, g_k, g_v = _kernel.segment_backward(
            q_parts[qi],
            k_parts[ki],
            v_parts[ki],
            o_parts[qi],
            l_parts[qi],
            g_parts[qi],
            plan.segment(qc, kc),
            scale=plan.scale,
            grad_lse=gl_parts[qi],
        )
        dq_parts[qi] += g_q
        dk_parts[ki] += g_k
        dv_parts[ki] += g_v
    return torch.cat(dk_parts, 2), torch.cat(dv_parts, 2)


class _RingAttention(torch.autograd.Function):
    """``apply(plan, group, q, k, v, sinks) -> (out, lse)`` with the ring backward."""

    @staticmethod
    def forward(ctx, plan: RingPlan, group, q, k, v, sinks):  # type: ignore[override]
        with torch.no_grad():
            out, lse = ring_forward(plan, q, k, v, sinks, group)
        ctx.plan, ctx.group = plan, group
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        with torch.no_grad():
            dq, dk, dv = ring_backward(ctx.plan, q, k, v, out, lse, grad_out, grad_lse, ctx.group)
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            # lse = log(sum exp(s) + exp(sink)): d lse / d sink = p_sink, d out / d sink =
            # -p_sink * out. This rank's rows only: all-reduce it like any parameter.
            delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (b, h, t)
            p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)  # (b, h, t)
            coeff = -delta if grad_lse is None else grad_lse - delta
            d_sinks = (p_sink * coeff).sum((0, 2)).to(sinks.dtype)
        return None, None, dq, dk, dv, d_sinks


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    *,
    group: Group,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(out (b, h, t, d_v), lse (b, h, t))``; autograd runs the ring backward.

    Shared parameters (``sinks``) get this rank's share of their gradient.
    """
    return _RingAttention.apply(plan, group, q, k, v, sinks)
