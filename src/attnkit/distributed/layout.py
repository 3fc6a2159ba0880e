"""Which positions of a sequence each rank holds: the zigzag and contiguous layouts.

The sequence of ``T`` positions is cut into ``n`` chunks (``n = 2W`` for zigzag, ``W``
for contiguous) of ``T // n`` positions, the first ``T % n`` chunks one longer (as
``torch.tensor_split``). Rank ``r`` holds::

    contiguous:  chunk r                          W=2, T=8:  r0: 0 1 2 3 | r1: 4 5 6 7
    zigzag:      chunks r and 2W-1-r, in order    W=2, T=8:  r0: 0 1 6 7 | r1: 2 3 4 5

Zigzag gives every rank one early and one late chunk, so under a causal mask every
rank has the same number of (query, key) pairs to compute. ``shard(torch.arange(T), 0)``
gives a rank its positions, so RoPE, ALiBi and document ids follow the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from attnkit._validate import check_choice, check_int
from attnkit.distributed.comm import Group, rank_and_size

__all__ = ["LAYOUTS", "Chunk", "Layout", "shard", "unshard"]

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Chunk:
    """Positions ``start .. start + length - 1`` of the sequence."""

    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Layout:
    """A layout of ``seq_len`` positions over ``world_size`` ranks (no communication).

    Raises:
        ValueError: an unknown layout, or fewer positions than chunks (``2W`` / ``W``).
    """

    name: str
    world_size: int
    seq_len: int

    def __post_init__(self) -> None:
        check_choice(self.name, "layout", LAYOUTS)
        check_int(self.world_size, "world_size")
        check_int(self.seq_len, "seq_len")
        if self.seq_len < self.num_chunks:
            raise ValueError(
                f"a sequence of {self.seq_len} positions cannot be split over "
                f"{self.world_size} ranks with layout={self.name!r}: it needs at least "
                f"{self.num_chunks} positions (one per chunk)"
            )

    @property
    def num_chunks(self) -> int:
        return 2 * self.world_size if self.name == "zigzag" else self.world_size

    @cached_property
    def _all_chunks(self) -> list[Chunk]:
        n = self.num_chunks
        base, extra = divmod(self.seq_len, n)
        chunks, start = [], 0
        for i in range(n):
            length = base + (1 if i < extra else 0)
            chunks.append(Chunk(start, length))
            start += length
        return chunks

    def chunks(self, rank: int) -> list[Chunk]:
        """The chunks rank ``rank`` holds, in the order its shard stores them."""
        c = self._all_chunks
        if self.name == "contiguous":
            return [c[rank]]
        return [c[rank], c[2 * self.world_size - 1 - rank]]

    def local_len(self, rank: int) -> int:
        """Positions rank ``rank`` holds."""
        return sum(c.length for c in self.chunks(rank))

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of rank ``rank``'s shard, ``(local_len,)`` long."""
        return torch.cat([torch.arange(c.start, c.stop, device=device) for c in self.chunks(rank)])

    def order(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(T,)``: the global position at each index of the ranks' shards concatenated."""
        return torch.cat([self.positions(r, device) for r in range(self.world_size)])


def _dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_int(dim, "dim", minimum=None)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(
    x: torch.Tensor, dim: int, *, group: Group = None, layout: str = "zigzag"
) -> torch.Tensor:
    """This rank's part of the full tensor ``x`` along ``dim`` (no communication).

    Differentiable (slices and a concatenation). Every rank must pass the same ``x``.

    Raises:
        ValueError: an unknown layout, or ``x.shape[dim]`` smaller than the number of
            chunks (``2W`` for zigzag, ``W`` for contiguous).
    """
    dim = _dim(x, dim)
    rank, world = rank_and_size(group)
    lay = Layout(layout, world, x.shape[dim]) if x.shape[dim] > 0 else None
    if lay is None:
        raise ValueError(f"cannot shard an empty dim {dim} of shape {tuple(x.shape)}")
    parts = [x.narrow(dim, c.start, c.length) for c in lay.chunks(rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def local_lengths(x_local: torch.Tensor, dim: int, group: Group) -> list[int]:
    """Every rank's ``x_local.shape[dim]`` (one small all-gather)."""
    _, world = rank_and_size(group)
    mine = torch.tensor([x_local.shape[dim]], dtype=torch.long, device=x_local.device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]


def seq_len_of(lengths: list[int], layout: str) -> Layout:
    """The :class:`Layout` whose ranks hold ``lengths`` positions; a ValueError if none does."""
    lay = Layout(layout, len(lengths), sum(lengths))
    expected = [lay.local_len(r) for r in range(len(lengths))]
    if expected != lengths:
        raise ValueError(
            f"the ranks hold {lengths} positions, but layout={layout!r} over "
            f"{len(lengths)} ranks gives {expected} for {sum(lengths)} positions: "
            "were the shards made with attnkit.distributed.shard and this layout?"
        )
    return lay


class _Unshard(torch.autograd.Function):
    """All-gather along ``dim`` in sequence order; backward: sum over ranks, then shard."""

    @staticmethod
    def forward(ctx, x_local, dim: int, lay: Layout, rank: int, group):  # type: ignore[override]
        ctx.dim, ctx.lay, ctx.rank, ctx.group = dim, lay, rank, group
        width = max(lay.local_len(r) for r in range(lay.world_size))
        pad = width - x_local.shape[dim]
        xp = x_local.contiguous()
        if pad:
            shape = list(x_local.shape)
            shape[dim] = pad
            xp = torch.cat([xp, xp.new_zeros(shape)], dim)
        gathered = [torch.empty_like(xp) for _ in range(lay.world_size)]
        dist.all_gather(gathered, xp, group=group)
        pieces: dict[int, torch.Tensor] = {}
        for r, g in enumerate(gathered):
            offset = 0
            for c in lay.chunks(r):
                pieces[c.start] = g.narrow(dim, offset, c.length)
                offset += c.length
        return torch.cat([pieces[s] for s in sorted(pieces)], dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        parts = [grad.narrow(ctx.dim, c.start, c.length) for c in ctx.lay.chunks(ctx.rank)]
        return torch.cat(parts, ctx.dim), None, None, None, None


def unshard(
    x_local: torch.Tensor, dim: int, *, group: Group = None, layout: str = "zigzag"
) -> torch.Tensor:
    """The full tensor on every rank, in sequence order, from every rank's shard.

    Differentiable: it is a gather, so the gradient reaching ``x_local`` is the *sum*
    over ranks of their gradients for its positions (a loss computed identically on
    every rank therefore gives ``W`` times the single-process gradient).

    Raises:
        ValueError: the ranks' lengths are not a shard of one sequence in ``layout``.
    """
    dim = _dim(x_local, dim)
    check_choice(layout, "layout", LAYOUTS)
    rank, _ = rank_and_size(group)
    lay = seq_len_of(local_lengths(x_local, dim, group), layout)
    return _Unshard.apply(x_local, dim, lay, rank, group)
