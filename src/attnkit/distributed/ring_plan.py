"""The ring's plan: tiles, pieces, which rank needs which piece (no communication).

Built once per :func:`~attnkit.distributed.ring.ring_attention` call from the layout,
the same on every rank, so a sender and its receiver always agree on every message.
Causal and window rules are checked on intervals (:func:`pair_empty`); a ``mask_mod``
is left to the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from attnkit.distributed import _kernel
from attnkit.distributed.layout import Chunk, Layout
from attnkit.masks import MaskMod, ScoreMod

__all__ = ["TILE", "RingPlan", "pair_empty"]


#: Positions per tile: query rows and keys of one kernel call; a piece on the wire is
#: at most one tile per chunk. A rank's extra memory is about four pieces plus one call's
#: temporaries, both proportional to TILE (``attnkit.bench.context_parallel``: peak per
#: rank 0.49 of one process's at 512); smaller tiles mean more calls and messages.
TILE = 512


def pair_empty(qc: Chunk, kc: Chunk, causal: bool, window: int | None) -> bool:
    """Whether causal/window rules leave no (query, key) pair of two chunks.

    Keeps ``k <= q`` (causal) and ``q - window < k`` (window; ``k < q + window`` too
    when not causal), as :func:`attnkit.masks.position_keep`. Exact for intervals: a
    chunk pair is non-empty iff some pair of their tiles is.
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

    @cached_property
    def _chunk_tiles(self) -> list[list[list[tuple[int, Chunk]]]]:
        """``[rank][chunk]``: the chunk's tiles ``(offset in the shard, positions)``."""
        out = []
        for rank in range(self.world):
            chunks, offset = [], 0
            for c in self.layout.chunks(rank):
                tiles = []
                for start in range(c.start, c.stop, TILE):
                    tile = Chunk(start, min(TILE, c.stop - start))
                    tiles.append((offset, tile))
                    offset += tile.length
                chunks.append(tiles)
            out.append(chunks)
        return out

    def tiles(self, rank: int) -> list[tuple[int, Chunk]]:
        """``rank``'s shard cut into tiles of at most :data:`TILE` positions:
        ``(offset in the shard, global positions)``, in shard order; a tile never
        straddles two chunks. Its query tiles, and the key tiles of its pieces."""
        return [t for chunk in self._chunk_tiles[rank] for t in chunk]

    @property
    def num_pieces(self) -> int:
        """The number of sub-rings: the most tiles any rank has in one chunk."""
        return max(len(c) for chunks in self._chunk_tiles for c in chunks)

    def piece(self, origin: int, p: int) -> list[tuple[int, Chunk]]:
        """``origin``'s piece ``p``: tile ``p`` of each of its chunks (zigzag: one early,
        one late, so every rank has as much to compute at each step), as ``(offset in
        the shard, positions)``; empty where it has no such tile."""
        return [chunk[p] for chunk in self._chunk_tiles[origin] if p < len(chunk)]

    def queries(self, dest: int, kc: Chunk) -> list[tuple[int, Chunk]]:
        """``dest``'s query tiles ``(q_offset, q_tile)`` that see some key of tile ``kc``."""
        return [
            (qo, qc)
            for qo, qc in self.tiles(dest)
            if not pair_empty(qc, kc, self.causal, self.window)
        ]

    @cached_property
    def _seen(self) -> list[list[list[list[int]]]]:
        w, n = self.world, self.num_pieces
        return [
            [
                [
                    [
                        i
                        for i, (_, kc) in enumerate(self.piece(o, p))
                        if any(
                            not pair_empty(qc, kc, self.causal, self.window)
                            for qc in self.layout.chunks(d)
                        )
                    ]
                    for p in range(n)
                ]
                for o in range(w)
            ]
            for d in range(w)
        ]

    def seen(self, dest: int, origin: int, p: int) -> list[int]:
        """The tiles of ``origin``'s piece ``p`` (indices into :meth:`piece`) some query of
        ``dest`` sees (checked chunk by chunk: cheap and exact)."""
        return self._seen[dest][origin][p]

    def needed(self, dest: int, origin: int, p: int) -> bool:
        """Whether ``dest``'s queries see any key of ``origin``'s piece ``p``."""
        return bool(self._seen[dest][origin][p])

    def carried(self, origin: int, p: int, step: int) -> list[int]:
        """The tiles of ``origin``'s piece ``p`` that go on from rank ``origin + step``
        after ``step``: those some rank further round the ring sees (none past the
        last rank that needs one). A message packs them in order; sender and receiver
        agree. Shrinks as the step grows, so what goes on has always arrived."""
        w = self.world
        further = [self._seen[(origin + j) % w][origin][p] for j in range(step + 1, w)]
        return sorted({i for seen in further for i in seen})

    def packed(self, origin: int, p: int, tiles: list[int]) -> list[tuple[int, int, Chunk]]:
        """``(offset in the shard, offset in the message, positions)`` of the given tiles
        of ``origin``'s piece ``p`` packed in order."""
        out, at = [], 0
        piece = self.piece(origin, p)
        for i in tiles:
            offset, kc = piece[i]
            out.append((offset, at, kc))
            at += kc.length
        return out

    def segment(self, qc: Chunk, kc: Chunk) -> _kernel.SegmentMask:
        return _kernel.SegmentMask(
            q_offset=qc.start,
            k_offset=kc.start,
            causal=self.causal,
            window=self.window,
            mask_mod=self.mask_mod,
            score_mod=self.score_mod,
        )
