"""Ring attention: K/V blocks travel round the ranks, partial results merge by log-sum-exp.

Rank ``r`` keeps its query shard. At step ``s`` it holds the K/V block of rank
``o = r - s`` (mod W); before computing on it, it posts the block onward to ``r + 1``
and the receive of the next one from ``r - 1`` (``batch_isend_irecv``), so the
transfer overlaps the compute. Each (query chunk, key chunk) pair whose positions a
causal mask or window leaves non-empty is cut into tiles of at most :data:`TILE`
positions (so a call's temporaries stay small), one call of the kernel layer's
``segment_forward`` per tile pair; the partials merge through ``merge_partials`` (the blockwise
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


#: Positions per tile of a kernel call (query rows and keys alike).
TILE = 1024


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

    def tiles(self, rank: int) -> list[tuple[int, Chunk]]:
        """``rank``'s shard cut into tiles of at most :data:`TILE` positions:
        ``(offset in the shard, global positions)``. Each kernel call covers one tile
        pair, so its temporaries stay tile-sized whatever the shard's length."""
        out, offset = [], 0
        for c in self.layout.chunks(rank):
            for start in range(c.start, c.stop, TILE):
                piece = Chunk(start, min(TILE, c.stop - start))
                out.append((offset, piece))
                offset += piece.length
        return out

    def pairs(self, dest: int, origin: int) -> list[tuple[int, Chunk, int, Chunk]]:
        """Non-empty ``(q_offset, q_tile, k_offset, k_tile)`` pairs of ``dest``'s query
        tiles against ``origin``'s key tiles (offsets in the shards)."""
        out = []
        for qo, qc in self.tiles(dest):
            for ko, kc in self.tiles(origin):
                if not pair_empty(qc, kc, self.causal, self.window):
                    out.append((qo, qc, ko, kc))
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


Block = tuple[torch.Tensor, torch.Tensor]  # (k, v) of one rank's positions


def _block_shapes(k: torch.Tensor, v: torch.Tensor, length: int):
    b, hk = k.shape[0], k.shape[1]
    return torch.Size((b, hk, length, k.shape[-1])), torch.Size((b, hk, length, v.shape[-1]))


class _Ring:
    """Moves K/V blocks round the ring, one step at a time.

    ``begin(s)`` posts the transfer of step ``s + 1`` (this block onward, the next one
    in) and returns the block to compute on now (None where this rank's queries see
    none of it); ``end()`` waits for the transfer. Between the two the caller computes,
    so the transfer overlaps the compute; it drops its block before ``end()`` so that
    only two blocks (this one and the next) are ever held.
    """

    def __init__(self, plan: RingPlan, k, v, group: Group, phase: str) -> None:
        self.plan, self.group, self.phase = plan, group, phase
        self.k, self.v = k, v
        # the wire takes dense tensors (a no-op for zigzag shards, which are concatenated)
        self.block: Block | None = (k.contiguous(), v.contiguous())
        self.next: Block | None = None
        self.works: list = []

    def begin(self, s: int) -> tuple[int, Block | None]:
        plan, r, w = self.plan, self.plan.rank, self.plan.world
        origin = (r - s) % w
        if s + 1 < w:
            # travels(origin, s) implies the block arrived: a rank further on needs it.
            sends = [(self.block, (r + 1) % w, "kv")] if plan.travels(origin, s) else []
            src = (r - s - 1) % w
            recvs = []
            if plan.travels(src, s):
                ks, vs = _block_shapes(self.k, self.v, plan.layout.local_len(src))
                self.next = (self.k.new_empty(ks), self.v.new_empty(vs))
                recvs.append((self.next, (r - 1) % w, "kv"))
            self.works = exchange(
                sends,  # type: ignore[arg-type]
                recvs,
                group=self.group,
                phase=self.phase,
                step=s,
            )
        block = self.block if plan.needed[r][origin] else None
        return origin, block

    def drop(self) -> None:
        """This step's block is no longer needed here (it may still be on its way out)."""
        self.block = None

    def end(self) -> None:
        for work in self.works:
            work.wait()
        self.block, self.next, self.works = self.next, None, []


def ring_forward(plan: RingPlan, q, k, v, sinks, group: Group):
    """``(out (b, h, t, d_v), lse (b, h, t))`` of this rank's queries over the whole ring."""
    r, w = plan.rank, plan.world
    acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # query tile offset -> (out, lse)
    ring = _Ring(plan, k, v, group, "forward")
    for s in range(w):
        origin, block = ring.begin(s)
        if block is not None:
            for qo, qc, ko, kc in plan.pairs(r, origin):
                o, lse = _kernel.segment_forward(
                    q.narrow(2, qo, qc.length),
                    block[0].narrow(2, ko, kc.length),
                    block[1].narrow(2, ko, kc.length),
                    plan.segment(qc, kc),
                    scale=plan.scale,
                )
                if qo not in acc:  # half precision merges in float32, as the lse
                    acc[qo] = (o.to(lse.dtype), lse)
                else:
                    acc[qo] = _kernel.merge_partials(*acc[qo], o, lse)
            del block
        ring.drop()
        ring.end()
    b, h, t = q.shape[0], q.shape[1], q.shape[2]
    lse_dtype = next((x[1].dtype for x in acc.values()), q.dtype)
    out = q.new_zeros(b, h, t, v.shape[-1])  # (b, h, t, d_v); rows no key reaches stay 0
    lse_all = q.new_full((b, h, t), float("-inf"), dtype=lse_dtype)  # (b, h, t)
    for qo, qc in plan.tiles(r):
        if qo in acc:
            o, lse = acc.pop(qo)
        elif sinks is not None:
            o = q.new_zeros(b, h, qc.length, v.shape[-1], dtype=lse_dtype)
            lse = lse_all.narrow(2, qo, qc.length)
        else:
            continue
        if sinks is not None:  # a sink is a partial with output 0 and lse = its logit
            sink_lse = sinks.to(lse.dtype).view(1, h, 1).expand_as(lse)
            o, lse = _kernel.merge_partials(o, lse, torch.zeros((), dtype=o.dtype), sink_lse)
        out.narrow(2, qo, qc.length).copy_(o)
        lse_all.narrow(2, qo, qc.length).copy_(lse)
    return out, lse_all


def ring_backward(plan: RingPlan, q, k, v, out, lse, grad_out, grad_lse, group: Group):
    """``(dq, dk, dv)`` of this rank's shards; ``out``/``lse`` are the merged totals and
    ``grad_lse`` the gradient of the merged log-sum-exp (or None).

    Memory: besides the shards, the block being computed on, the next one, and the
    dK/dV share of a block (sent straight back to its owner) or of this rank's own
    block (received from the rank that holds it).
    """
    r, w = plan.rank, plan.world
    rows = (q, out, lse, grad_out, grad_lse)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    ring = _Ring(plan, k, v, group, "backward")
    for s in range(w):
        origin, block = ring.begin(s)
        sends = []
        if block is not None:
            # this rank's own block accumulates in place; another's in a share to send
            share = (
                (dk, dv)
                if origin == r
                else (block[0].new_zeros(block[0].shape), block[1].new_zeros(block[1].shape))
            )
            _block_grads(plan, origin, rows, block, share, dq)
            if origin != r:
                sends.append((share, origin, "dkv"))
            del block, share
        ring.drop()
        # ... and this rank's own block's share from the rank holding it at this step.
        holder = (r + s) % w
        recvs, buf = [], None
        if holder != r and plan.needed[holder][r]:
            buf = (k.new_empty(k.shape), v.new_empty(v.shape))  # dense, for the wire
            recvs.append((buf, holder, "dkv"))
        works = exchange(sends, recvs, group=group, phase="backward", step=s)  # type: ignore[arg-type]
        del sends
        ring.end()
        for work in works:
            work.wait()
        if buf is not None:
            dk.add_(buf[0])
            dv.add_(buf[1])
            del buf
    return dq, dk, dv


def _block_grads(plan: RingPlan, origin: int, rows, block: Block, share: Block, dq) -> None:
    """Add the gradients of this rank's queries against ``origin``'s block: dQ into
    ``dq``, dK/dV into ``share``.

    ``rows``: this rank's q, the merged out and lse, and their gradients (or None)."""
    q, out, lse, grad_out, grad_lse = rows
    for qo, qc, ko, kc in plan.pairs(plan.rank, origin):
        n, m = qc.length, kc.length
        g_q, g_k, g_v = _kernel.segment_backward(
            q.narrow(2, qo, n),
            block[0].narrow(2, ko, m),
            block[1].narrow(2, ko, m),
            out.narrow(2, qo, n),
            lse.narrow(2, qo, n),
            grad_out.narrow(2, qo, n),
            plan.segment(qc, kc),
            scale=plan.scale,
            grad_lse=None if grad_lse is None else grad_lse.narrow(2, qo, n),
        )
        dq.narrow(2, qo, n).add_(g_q)
        share[0].narrow(2, ko, m).add_(g_k)
        share[1].narrow(2, ko, m).add_(g_v)


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
