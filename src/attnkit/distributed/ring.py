"""Ring attention: K/V pieces travel round the ranks, partial results merge by log-sum-exp.

Rank ``r`` keeps its query shard. Each chunk of its shard (zigzag: an early and a late
one; contiguous: one) is cut into tiles of at most
:data:`~attnkit.distributed.ring_plan.TILE` positions (:class:`RingPlan`), and its
*piece* ``p`` is tile ``p`` of each chunk. Piece ``p`` of every rank circulates on its
own *sub-ring* ``p``: at step ``s`` rank ``r`` holds piece ``p`` of rank ``o = r - s``
(mod W). Before computing on it, it posts it onward to ``r + 1`` and the receive of
the next one (piece ``p`` of ``r - s - 1``) from ``r - 1`` (``batch_isend_irecv``), so
the transfer overlaps the compute. The sub-rings run one after another, so a rank
holds at most two pieces of K/V at a time (the one it computes on and the one
arriving), never another rank's whole block::

    sub-ring 0            sub-ring 1            ...   W = 3; "2.1" = piece 1 of rank 2
    step 0    1    2      step 0    1    2
    r0:  0.0  2.0  1.0    r0:  0.1  2.1  1.1
    r1:  1.0  0.0  2.0    r1:  1.1  0.1  2.1
    r2:  2.0  1.0  0.0    r2:  2.1  1.1  0.1

Why a tile of *each* chunk: under a causal mask a rank sees an early tile of another
rank whole with both its chunks, or with its late chunk only; a late tile, with its
late chunk or not at all. Together the two always make the same work, so at every step
every rank has as much to compute (the zigzag balance, step by step); with pieces of
one tile the ranks took turns waiting for each other (about a sixth of the step time
at W = 2).

Each (query tile, key tile) pair whose positions a causal mask or window leaves
non-empty is one call of the kernel layer's ``segment_forward``, so a call's
temporaries stay tile-sized; the partials merge through ``merge_partials`` (the
blockwise kernel's one merge) straight into the preallocated output.

A tile of a piece is sent on only while a rank further round the ring sees one of its
keys (:meth:`RingPlan.carried`; a rank with no piece ``p``, its chunks being shorter,
sends nothing on sub-ring ``p``): a causal contiguous layout never sends the last
rank's pieces back to rank 0, under zigzag rank 0's late tiles stay home, and with a
window only the tiles near a chunk's end travel, as far as the ranks whose queries see
them. Every tile goes at most ``W - 1`` hops, so the bytes are at most the whole-block
ring's: ``(W-1)/W`` of ``|K| + |V|`` per rank and pass without a mask. The backward
runs the same sub-rings; each rank's dK/dV share of the tiles it computed on goes
straight back to the piece's owner.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from attnkit.distributed import _kernel
from attnkit.distributed.comm import Group, exchange
from attnkit.distributed.layout import Chunk
from attnkit.distributed.ring_plan import RingPlan

__all__ = ["RingPlan", "ring_attention"]


Piece = tuple[torch.Tensor, torch.Tensor]  # (k, v) of one piece: (b, h_kv, len, d), (.., d_v)
#: One key tile of a piece: (offset in its owner's shard, positions,
#: k (b, h_kv, len, d), v (b, h_kv, len, d_v)).
KeyTile = tuple[int, Chunk, torch.Tensor, torch.Tensor]


def _empty_piece(k: torch.Tensor, v: torch.Tensor, length: int) -> Piece:
    """A dense ``(k, v)`` buffer of ``length`` positions (what the wire takes)."""
    b, hk = k.shape[0], k.shape[1]
    return k.new_empty(b, hk, length, k.shape[-1]), v.new_empty(b, hk, length, v.shape[-1])


def _circulate(
    plan: RingPlan, k: torch.Tensor, v: torch.Tensor, group: Group, phase: str
) -> Iterator[tuple[int, int, int, list[KeyTile] | None]]:
    """Run the sub-rings; yield ``(p, step, origin, key tiles)`` at every step: the
    tiles of ``origin``'s piece ``p`` this rank's queries see, or None (views of this
    rank's own ``k``/``v`` at step 0, of the received message after).

    The transfer of the next step is posted before the yield and waited after it, so
    it overlaps the caller's compute. The caller must drop its tiles before asking for
    the next step: then at most two pieces (this one and the next) are alive.
    """
    r, w = plan.rank, plan.world
    for p in range(plan.num_pieces):
        held: Piece | None = None  # the message received for this step
        held_tiles: list[int] = []  # which tiles of the piece it packs
        for s in range(w):
            origin = (r - s) % w
            # where each tile of the piece is here: in the own shard, or in the message
            if s == 0:
                here = {i: (so, so, kc) for i, (so, kc) in enumerate(plan.piece(origin, p))}
                source: Piece | None = (k, v)
            else:
                tiles = plan.packed(origin, p, held_tiles)
                here = dict(zip(held_tiles, tiles, strict=True))
                source = held
            sends, recvs, incoming, incoming_tiles = [], [], None, []
            if s + 1 < w:
                onward = plan.carried(origin, p, s)
                if onward:
                    if source is None or not set(onward) <= set(here):  # arrived first
                        raise RuntimeError(f"ring schedule: piece {p} of rank {origin} missing")
                    wire: tuple[torch.Tensor, ...]
                    if s > 0 and onward == held_tiles:
                        wire = source  # the message as it came
                    else:  # pack the tiles that go on (own piece: always one copy)
                        wire = tuple(
                            torch.cat(
                                [x.narrow(2, here[i][1], here[i][2].length) for i in onward], 2
                            )
                            for x in source
                        )
                    sends.append((wire, (r + 1) % w, "kv"))
                    del wire
                src = (r - s - 1) % w
                incoming_tiles = plan.carried(src, p, s)
                if incoming_tiles:
                    length = sum(kc.length for _, _, kc in plan.packed(src, p, incoming_tiles))
                    incoming = _empty_piece(k, v, length)
                    recvs.append((incoming, (r - 1) % w, "kv"))
            works = exchange(sends, recvs, group=group, phase=phase, step=s, piece=p)  # type: ignore[arg-type]
            keys: list[KeyTile] | None = None
            mine = plan.seen(r, origin, p)
            if mine:
                if source is None or not set(mine) <= set(here):
                    raise RuntimeError(f"ring schedule: piece {p} of rank {origin} missing")
                keys = []
                for i in mine:
                    so, at, kc = here[i]
                    kt, vt = (x.narrow(2, at, kc.length) for x in source)
                    keys.append((so, kc, kt, vt))
            del source
            yield p, s, origin, keys
            keys = held = None
            for work in works:
                work.wait()
            del sends, recvs, works
            held, held_tiles, incoming = incoming, incoming_tiles, None


def _merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o) -> None:
    """Merge the partial ``(o, lse_o)`` into the running ``(out, lse)`` views in place."""
    merged_out, merged_lse = _kernel.merge_partials(out, lse, o, lse_o)
    out.copy_(merged_out)
    lse.copy_(merged_lse)


def ring_forward(plan: RingPlan, q, k, v, sinks, group: Group):
    """``(out (b, h, t, d_v), lse (b, h, t))`` of this rank's queries over the whole ring.

    The partials merge into one preallocated ``out`` (float32 for half inputs, whose
    result is cast once at the end); rows no key reaches stay 0 with ``lse = -inf``.
    """
    r = plan.rank
    b, h, t = q.shape[0], q.shape[1], q.shape[2]
    acc = _kernel.acc_dtype(q.dtype)
    out = q.new_zeros(b, h, t, v.shape[-1], dtype=acc)  # (b, h, t, d_v)
    lse = q.new_full((b, h, t), float("-inf"), dtype=acc)  # (b, h, t)
    for _p, _s, _origin, keys in _circulate(plan, k, v, group, "forward"):
        for _so, kc, kt, vt in keys or ():
            for qo, qc in plan.queries(r, kc):
                n = qc.length
                o, lse_o = _kernel.segment_forward(
                    q.narrow(2, qo, n), kt, vt, plan.segment(qc, kc), scale=plan.scale
                )
                _merge_into(out.narrow(2, qo, n), lse.narrow(2, qo, n), o, lse_o)
                del o, lse_o
        del keys
    if sinks is not None:  # a sink is a partial with output 0 and lse = its logit
        zero = torch.zeros((), dtype=acc, device=q.device)
        for qo, qc in plan.tiles(r):
            lse_t = lse.narrow(2, qo, qc.length)
            sink_lse = sinks.to(acc).view(1, h, 1).expand_as(lse_t)
            _merge_into(out.narrow(2, qo, qc.length), lse_t, zero, sink_lse)
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse


def ring_backward(plan: RingPlan, q, k, v, out, lse, grad_out, grad_lse, group: Group):
    """``(dq, dk, dv)`` of this rank's shards; ``out``/``lse`` are the merged totals and
    ``grad_lse`` the gradient of the merged log-sum-exp (or None).

    Memory: besides the shards and their gradients, at most the piece being computed
    on, the next one arriving, the dK/dV share of another rank's piece (sent straight
    back to its owner) and a buffer receiving this rank's own piece's share from the
    rank that holds it, each at most a piece (one tile per chunk; a rank passing on
    part of a message packs one more); plus one kernel call's temporaries.
    """
    r, w = plan.rank, plan.world
    rows = (q, out, lse, grad_out, grad_lse)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for p, s, origin, keys in _circulate(plan, k, v, group, "backward"):
        sends = []
        if keys is not None:
            if origin == r:  # this rank's own piece accumulates in place
                _piece_grads(plan, rows, keys, [(dk, dv, so) for so, _, _, _ in keys], dq)
            else:  # another's in a share (the tiles computed on) sent back to its owner
                share = _empty_piece(k, v, sum(kc.length for _, kc, _, _ in keys))
                for x in share:
                    x.zero_()
                offsets = [0]
                for _, kc, _, _ in keys[:-1]:
                    offsets.append(offsets[-1] + kc.length)
                _piece_grads(plan, rows, keys, [(*share, a) for a in offsets], dq)
                sends.append((share, origin, "dkv"))
                del share
        del keys
        # ... and this rank's own piece's share from the rank holding it at this step.
        holder = (r + s) % w
        recvs, buf, theirs = [], None, []
        if holder != r:
            theirs = plan.packed(r, p, plan.seen(holder, r, p))
        if theirs:
            buf = _empty_piece(k, v, sum(kc.length for _, _, kc in theirs))
            recvs.append((buf, holder, "dkv"))
        works = exchange(sends, recvs, group=group, phase="backward", step=s, piece=p)  # type: ignore[arg-type]
        for work in works:
            work.wait()
        del sends, recvs, works
        if buf is not None:
            for so, at, kc in theirs:
                dk.narrow(2, so, kc.length).add_(buf[0].narrow(2, at, kc.length))
                dv.narrow(2, so, kc.length).add_(buf[1].narrow(2, at, kc.length))
            del buf
    return dq, dk, dv


def _piece_grads(plan: RingPlan, rows, keys: list[KeyTile], targets, dq) -> None:
    """Add the gradients of this rank's queries against a piece's key tiles: dQ into
    ``dq``, each tile's dK/dV into ``targets`` ``(dk, dv, offset)`` (the same length).

    ``rows``: this rank's q, the merged out and lse, and their gradients (or None)."""
    q, out, lse, grad_out, grad_lse = rows
    for (_so, kc, kt, vt), (dk, dv, at) in zip(keys, targets, strict=True):
        m = kc.length
        for qo, qc in plan.queries(plan.rank, kc):
            n = qc.length
            g_q, g_k, g_v = _kernel.segment_backward(
                q.narrow(2, qo, n),
                kt,
                vt,
                out.narrow(2, qo, n),
                lse.narrow(2, qo, n),
                grad_out.narrow(2, qo, n),
                plan.segment(qc, kc),
                scale=plan.scale,
                grad_lse=None if grad_lse is None else grad_lse.narrow(2, qo, n),
            )
            dq.narrow(2, qo, n).add_(g_q)
            dk.narrow(2, at, m).add_(g_k)
            dv.narrow(2, at, m).add_(g_v)
            del g_q, g_k, g_v


def _sinks_grad(plan: RingPlan, out, lse, grad_out, grad_lse, sinks) -> torch.Tensor:
    """This rank's share of d loss / d sinks, tile by tile (no full-size temporary).

    lse = log(sum exp(s) + exp(sink)): d lse / d sink = p_sink, d out / d sink =
    -p_sink * out. This rank's rows only: all-reduce it like any parameter."""
    total = torch.zeros(sinks.shape, dtype=lse.dtype, device=lse.device)
    logit = sinks.to(lse.dtype).view(1, -1, 1)
    for qo, qc in plan.tiles(plan.rank):
        n = qc.length
        g_o, o_t, lse_t = (x.narrow(2, qo, n) for x in (grad_out, out, lse))
        delta = (g_o.to(lse.dtype) * o_t.to(lse.dtype)).sum(-1)  # (b, h, n)
        coeff = -delta if grad_lse is None else grad_lse.narrow(2, qo, n) - delta
        total += (torch.exp(logit - lse_t) * coeff).sum((0, 2))  # p_sink * coeff
    return total.to(sinks.dtype)


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
                d_sinks = _sinks_grad(ctx.plan, out, lse, grad_out, grad_lse, sinks)
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
