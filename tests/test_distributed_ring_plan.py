"""attnkit.distributed.ring_plan (no process group): tiles, pieces, who needs what.

Checked against brute force over positions, for random layouts, lengths, world sizes,
tile sizes, causal masks and windows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.distributed import Layout, ring_plan
from attnkit.distributed.ring_plan import RingPlan


@contextlib.contextmanager
def _tile(size: int) -> Iterator[None]:
    saved, ring_plan.TILE = ring_plan.TILE, size
    try:
        yield
    finally:
        ring_plan.TILE = saved


def _keep(i: int, j: int, causal: bool, window: int | None) -> bool:
    """May query position i attend to key position j (written out here)."""
    if causal and j > i:
        return False
    if window is not None:
        if causal:
            return i - window < j
        return abs(i - j) < window
    return True


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(1, 4),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    extra=st.integers(0, 19),
    tile=st.integers(1, 7),
    causal=st.booleans(),
    window=st.none() | st.integers(1, 9),
)
def test_plan_matches_positions(world, layout, extra, tile, causal, window):
    chunks = 2 * world if layout == "zigzag" else world
    lay = Layout(layout, world, chunks + extra)
    with _tile(tile):
        plans = [RingPlan(lay, r, causal, window, None, None, 1.0) for r in range(world)]
        plan = plans[0]
        for r in range(world):
            # the tiles cut the shard in order, none longer than TILE
            tiles = plan.tiles(r)
            flat = [pos for _, c in tiles for pos in range(c.start, c.stop)]
            assert flat == lay.positions(r).tolist()
            assert [o for o, _ in tiles] == [
                sum(c.length for _, c in tiles[:i]) for i in range(len(tiles))
            ]
            assert all(1 <= c.length <= tile for _, c in tiles)
        pieces = plan.num_pieces
        for o in range(world):
            # piece p: tile p of each chunk, in order; every tile in exactly one piece
            cut = [
                [t for t in plan.tiles(o) if c.start <= t[1].start < c.stop] for c in lay.chunks(o)
            ]
            assert pieces >= max(len(c) for c in cut)
            got = [t for p in range(pieces) for t in plan.piece(o, p)]
            assert sorted(got, key=lambda x: x[0]) == plan.tiles(o)
            for p in range(pieces):
                assert plan.piece(o, p) == [c[p] for c in cut if p < len(c)]
        for d in range(world):
            queries = lay.positions(d).tolist()
            for o in range(world):
                for p in range(pieces):
                    want_seen = [
                        i
                        for i, (_, kc) in enumerate(plan.piece(o, p))
                        if any(
                            _keep(i_, j, causal, window)
                            for i_ in queries
                            for j in range(kc.start, kc.stop)
                        )
                    ]
                    assert plan.seen(d, o, p) == want_seen, (d, o, p)
                    assert plan.needed(d, o, p) == bool(want_seen)
                    # every rank's plan agrees (sender and receiver decide alike)
                    assert all(pl.seen(d, o, p) == want_seen for pl in plans)
                    for _, kc in plan.piece(o, p):
                        want = [
                            (qo, qc)
                            for qo, qc in plan.tiles(d)
                            if any(
                                _keep(i, j, causal, window)
                                for i in range(qc.start, qc.stop)
                                for j in range(kc.start, kc.stop)
                            )
                        ]
                        assert plan.queries(d, kc) == want
        # delivery: every tile reaches every rank that sees it, hop by hop; what goes on
        # has arrived; the last hop of a tile lands on a rank that sees it (none in vain)
        for o in range(world):
            for p in range(pieces):
                for i in range(len(plan.piece(o, p))):
                    hops = 0
                    while hops < world - 1 and i in plan.carried(o, p, hops):
                        hops += 1
                    for s in range(1, world):
                        if i in plan.seen((o + s) % world, o, p):
                            assert s <= hops, (o, p, i, s, hops)
                    if hops:
                        assert i in plan.seen((o + hops) % world, o, p)
                    assert all(i not in plan.carried(o, p, s) for s in range(hops, world))
                # a message packs its tiles in order, offsets cumulative
                every = list(range(len(plan.piece(o, p))))
                packed = plan.packed(o, p, every)
                assert [(so, kc) for so, _, kc in packed] == plan.piece(o, p)
                assert [at for _, at, _ in packed] == [
                    sum(kc.length for _, kc in plan.piece(o, p)[:i]) for i in every
                ]


def test_default_tile_keeps_pieces_small():
    """A zigzag shard of 16384 positions (chunks of 8192) travels as 16 pieces, each a
    tile of 512 from each chunk (the benchmark's shape); under a causal mask rank 1
    sees only the early tiles of rank 0, so only those go to it."""
    plan = RingPlan(Layout("zigzag", 2, 32768), 0, True, None, None, None, 1.0)
    assert ring_plan.TILE == 512
    assert plan.num_pieces == 16
    assert {sum(kc.length for _, kc in plan.piece(0, p)) for p in range(16)} == {1024}
    assert [kc.start for _, kc in plan.piece(0, 1)] == [512, 3 * 8192 + 512]
    assert plan.carried(0, 1, 0) == [0]  # rank 0's early tile only
    assert plan.carried(1, 1, 0) == [0, 1]  # rank 0's late chunk sees all of rank 1's
