"""All-to-all (Ulysses) attention: re-shard sequence -> heads, attend locally, re-shard back.

Rank ``j`` of ``W`` trades its sequence shard of every head for the whole sequence of
heads ``j*h/W .. (j+1)*h/W - 1`` (``all_to_all_single``), puts the positions back in
sequence order, calls :func:`attnkit.attention` with every mask and mod unchanged
(positions are the global ones; head indices are shifted to the global head), and
trades back::

    (b, h, t_local, d) ─all_to_all─> (b, h/W, T, d) ─attention─> (b, h/W, T, d_v) ─all_to_all─> (b, h, t_local, d_v)

Query heads must divide by ``W``. Key/value heads are split the same way when they
divide by ``W``; otherwise each rank receives the key/value heads its query heads read
(one head, replicated, when fewer key/value heads than ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from attnkit.attention import attention
from attnkit.distributed.comm import Group, record_collective
from attnkit.distributed.layout import Layout
from attnkit.masks import MaskMod, ScoreMod

__all__ = ["all_to_all_attention", "kv_heads_per_rank"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on a flat tensor; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        _record(x, in_splits, group, "forward")
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        g = grad.new_empty(sum(in_splits))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        _record(grad, out_splits, ctx.group, "backward")
        return g, None, None, None


def _record(x: torch.Tensor, send_splits: list[int], group: Group, phase: str) -> None:
    """What this rank sent to the others (its own split stays home)."""
    rank = dist.get_rank(group)
    record_collective("a2a", phase, (sum(send_splits) - send_splits[rank]) * x.element_size())


def _seq_to_heads(
    x: torch.Tensor, lay: Layout, group: Group, inverse: torch.Tensor
) -> torch.Tensor:
    """``(b, W*p, t_local, e)`` shards -> ``(b, p, T, e)`` this rank's heads, sequence order."""
    w = lay.world_size
    b, hh, t, e = x.shape
    p = hh // w
    send = x.reshape(b, w, p, t, e).transpose(0, 1).reshape(-1)  # (W, b, p, t, e) flat
    lengths = [lay.local_len(r) for r in range(w)]
    recv = _AllToAll.apply(send, [b * p * n * e for n in lengths], [b * p * t * e] * w, group)
    parts = torch.split(recv, [b * p * n * e for n in lengths])
    full = torch.cat([part.view(b, p, n, e) for part, n in zip(parts, lengths, strict=True)], 2)
    return full.index_select(2, inverse)  # (b, p, T, e) in sequence order


def _heads_to_seq(y: torch.Tensor, lay: Layout, rank: int, group: Group, order: torch.Tensor):
    """``(b, p, T, e)`` this rank's heads in sequence order -> ``(b, W*p, t_local, e)``."""
    w = lay.world_size
    b, p, _, e = y.shape
    lengths = [lay.local_len(r) for r in range(w)]
    t = lengths[rank]
    by_rank = y.index_select(2, order)  # (b, p, T, e): the ranks' shards one after another
    send = torch.cat([part.reshape(-1) for part in torch.split(by_rank, lengths, dim=2)])
    recv = _AllToAll.apply(send, [b * p * t * e] * w, [b * p * n * e for n in lengths], group)
    return recv.view(w, b, p, t, e).transpose(0, 1).reshape(b, w * p, t, e)


def kv_heads_per_rank(h_q: int, h_kv: int, world: int) -> list[int] | None:
    """The key/value heads to send, in rank order (``W * m`` indices), or None when the
    key/value heads simply split ``h_kv / W`` per rank.

    Rank ``j`` holds query heads ``j*n .. j*n+n-1`` (``n = h_q / W``), which read key/value
    head ``i // g`` (``g = h_q / h_kv``). When ``g`` is a multiple of ``n`` they read one
    head, sent to that rank alone (replicated over ranks when ``h_kv < W``); otherwise
    each rank receives one key/value head per query head.
    """
    n, g = h_q // world, h_q // h_kv
    if h_kv % world == 0:
        return None
    if g % n == 0:
        return [(j * n) // g for j in range(world)]
    return [i // g for i in range(h_q)]


class _HeadShifted:
    """A mask/score mod seeing global head indices (local head + this rank's first head)."""

    def __init__(self, mod: Any, offset: int) -> None:
        self.mod, self.offset = mod, offset
        self.tensors = getattr(mod, "tensors", ())
        self.additive = getattr(mod, "additive", False)
        self.grid = getattr(mod, "grid", False)  # attnkit's own mods take index grids

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        *lead, b, h, q, kv = args
        return self.mod(*lead, b, h + self.offset, q, kv)

    def __repr__(self) -> str:
        return f"{self.mod!r} (heads from {self.offset})"


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lay: Layout,
    rank: int,
    *,
    group: Group,
    causal: bool,
    window: int | None,
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
    scale: float,
    sinks: torch.Tensor | None,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's ``(out (b, h, t, d_v), lse (b, h, t) or None)``; autograd flows through."""
    w = lay.world_size
    h_q, h_kv = q.shape[1], k.shape[1]
    if h_q % w:
        raise ValueError(
            f"strategy='all_to_all' needs the query heads ({h_q}) to divide by the group's "
            f"size ({w}); use strategy='ring'"
        )
    n = h_q // w
    order = lay.order(q.device)
    inverse = torch.argsort(order)
    idx = kv_heads_per_rank(h_q, h_kv, w)
    if idx is not None:
        sel = torch.tensor(idx, device=k.device)
        k, v = k.index_select(1, sel), v.index_select(1, sel)  # (b, W*m, t, d)
    qh = _seq_to_heads(q, lay, group, inverse)  # (b, n, T, d)
    kh, vh = _seq_to_heads(k, lay, group, inverse), _seq_to_heads(v, lay, group, inverse)
    extra: dict[str, Any] = {}
    if sinks is not None:
        extra["sinks"] = sinks[rank * n : (rank + 1) * n]
    if return_lse:
        extra["return_lse"] = True
    res = attention(
        qh,
        kh,
        vh,
        causal=causal,
        window=window,
        mask_mod=None if mask_mod is None else _HeadShifted(mask_mod, rank * n),  # type: ignore[arg-type]
        score_mod=None if score_mod is None else _HeadShifted(score_mod, rank * n),  # type: ignore[arg-type]
        scale=scale,
        **extra,
    )
    out_h: torch.Tensor = res[0] if return_lse else res  # type: ignore[assignment]
    lse_h: torch.Tensor | None = res[-1] if return_lse else None
    out = _heads_to_seq(out_h, lay, rank, group, order)  # (b, h, t, d_v)
    if lse_h is None:
        return out, None
    lse = _heads_to_seq(lse_h.unsqueeze(-1), lay, rank, group, order).squeeze(-1)
    return out, lse
