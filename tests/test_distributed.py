"""attnkit.distributed on real gloo process groups of 2 and 3 ranks (spawned once each).

Each case runs on every rank; rank 0 reports the largest differences from a
single-process ``attnkit.attention`` on the whole float64 sequence, asserted here.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import attnkit
from attnkit.distributed import Layout, context_parallel_attention, shard
from tests import distributed_cases as cases
from tests.distributed_harness import run_suite

WORLDS = (2, 3)
TOL = 1e-10
HAS_SINKS = "sinks" in inspect.signature(attnkit.attention).parameters


@pytest.fixture(scope="module")
def results():
    return {w: run_suite("tests.distributed_cases:attention_suite", w) for w in WORLDS}


def _ok(res: dict) -> dict:
    assert "error" not in res, res.get("tb", res.get("error"))
    return res


ATTENTION_CASES = [
    (w, s, lay, kind, ln)
    for w in WORLDS
    for s in ("ring", "all_to_all")
    for lay in ("zigzag", "contiguous")
    for kind in cases.MASKS
    for ln in cases.lengths_for(w)
]


@pytest.mark.parametrize(("world", "strategy", "layout", "kind", "length"), ATTENTION_CASES)
def test_matches_single_process(results, world, strategy, layout, kind, length):
    res = _ok(results[world][f"{strategy}-{layout}-{kind}-{length}"])
    for name in ("out", "dq", "dk", "dv"):
        assert res[name] < TOL, (name, res)
    if strategy == "ring" or cases.HAS_LSE:
        assert res["lse"] < TOL, res


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["causal_gqa", "window", "documents"])
def test_ring_small_tiles(results, world, kind):
    """Chunk pairs cut into tiles of 2 positions (odd chunk lengths, partial tiles)."""
    res = _ok(results[world][f"tiles-{kind}"])
    for name in ("out", "dq", "dk", "dv", "lse"):
        assert res[name] < TOL, (name, res)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_lse_gradient(results, world, strategy, layout):
    if strategy == "all_to_all" and not cases.HAS_LSE:
        pytest.skip("attnkit.attention has no return_lse yet (kernel layer)")
    res = _ok(results[world][f"lse_grad-{strategy}-{layout}"])
    assert max(res.values()) < TOL, res


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_sinks(results, world, strategy):
    if strategy == "all_to_all" and not HAS_SINKS:
        pytest.skip("attnkit.attention has no sinks yet (kernel layer)")
    res = _ok(results[world][f"sinks-{strategy}"])
    assert max(res.values()) < TOL, res


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_error_at_most_twice_plain_math(results, strategy, dtype):
    """Against float64, the split computation's error in float32/bfloat16 is at most
    2x that of plain math in the same dtype (plus a tiny epsilon), outputs and grads."""
    res = _ok(results[2][f"dtype-{strategy}-{dtype}"])
    eps = {torch.float32: 1e-6, torch.bfloat16: 1e-3}[dtype]
    for name, (ours, plain) in res.items():
        assert ours <= 2 * plain + eps, (name, ours, plain)


@pytest.mark.parametrize("world", WORLDS)
def test_full_ring_sends_one_block_per_step(results, world):
    """Without a mask every rank sends its neighbour one K/V block at each of the W-1
    steps that have a next block, forward and backward, and its dK/dV shares back."""
    for layout in ("zigzag", "contiguous"):
        ranks = _ok(results[world][f"traffic-{layout}-full"])["ranks"]
        for info in ranks:
            r, block = info["rank"], info["block_bytes"]
            expect = [(s, (r + 1) % world) for s in range(world - 1)]
            assert [(s, p) for s, p, _ in info["kv_forward"]] == expect
            assert [(s, p) for s, p, _ in info["kv_backward"]] == expect
            # each message is one whole K/V block: the block that arrived, of its origin's size
            sizes = [n for _, _, n in info["kv_forward"]]
            assert sizes[0] == block
            # dK/dV of the block held at step s go back to its owner r - s
            assert [(s, p) for s, p, _ in info["dkv"]] == [
                (s, (r - s) % world) for s in range(1, world)
            ]


@pytest.mark.parametrize("world", WORLDS)
def test_causal_contiguous_skips_blocks(results, world):
    """Causal, contiguous: rank r's block is needed by ranks r..W-1 only, so it travels
    W-1-r hops and never wraps round to rank 0; the last rank sends no K/V at all."""
    ranks = _ok(results[world]["traffic-contiguous-causal"])["ranks"]
    for info in ranks:
        r = info["rank"]
        # at step s rank r relays the block of rank r - s; it goes on while r + 1 < W
        expect = [(s, r + 1) for s in range(r + 1)] if r < world - 1 else []
        assert [(s, p) for s, p, _ in info["kv_forward"]] == expect
        assert [(s, p) for s, p, _ in info["kv_backward"]] == expect
        # dK/dV come back from the ranks that computed on the block: r+1 .. W-1
        assert [(s, p) for s, p, _ in info["dkv"]] == [(s, r - s) for s in range(1, r + 1)]
    total = sum(len(i["kv_forward"]) for i in ranks)
    assert total == world * (world - 1) // 2  # half the full ring's W(W-1)
    # zigzag balances causal work: every rank needs every block
    for info in _ok(results[world]["traffic-zigzag-causal"])["ranks"]:
        assert len(info["kv_forward"]) == world - 1


@pytest.mark.parametrize("world", WORLDS)
def test_window_fetches_only_neighbours(results, world):
    """A window of 2 inside chunks of 8: only the previous rank's block is ever needed."""
    ranks = _ok(results[world]["traffic-contiguous-window"])["ranks"]
    for info in ranks:
        r = info["rank"]
        assert [(s, p) for s, p, _ in info["kv_forward"]] == ([(0, r + 1)] if r < world - 1 else [])
        assert [(s, p) for s, p, _ in info["dkv"]] == ([(1, r - 1)] if r > 0 else [])


@pytest.mark.parametrize("world", WORLDS)
def test_refusals(results, world):
    res = _ok(results[world]["refusals"])
    assert f"query heads ({world + 1})" in res["heads"] and "divide" in res["heads"]
    assert f"at least {2 * world} positions" in res["short"]
    assert "strategy" in res["strategy"] and "'ring'" in res["strategy"]
    assert "window must be an int" in res["window_bool"]
    assert "no gradient to a score_mod" in res["ring_mod_grad"]
    assert "layout='zigzag'" in res["layout_mismatch"]


@pytest.mark.parametrize("world", WORLDS)
def test_unshard_roundtrip_and_gradient(results, world):
    res = _ok(results[world]["unshard_grad"])
    assert res["roundtrip"] == 0.0
    assert res["grad"] == 0.0
    lay = Layout("zigzag", world, 5 * world)
    assert res["positions"] == lay.positions(0).tolist()


# -- no process group needed ----------------------------------------------------------


@pytest.mark.parametrize("name", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_len", [8, 13, 24, 31])
def test_layout_partitions_the_sequence(name, world, seq_len):
    n = 2 * world if name == "zigzag" else world
    if seq_len < n:
        with pytest.raises(ValueError, match=f"at least {n} positions"):
            Layout(name, world, seq_len)
        return
    lay = Layout(name, world, seq_len)
    order = lay.order()
    assert sorted(order.tolist()) == list(range(seq_len))
    lens = [lay.local_len(r) for r in range(world)]
    assert max(lens) - min(lens) <= 2  # balanced to within one position per chunk
    if name == "zigzag":
        for r in range(world):
            first, second = lay.chunks(r)
            # chunk r and chunk 2W-1-r: mirror images
            assert first.start == sum(c.length for c in lay._all_chunks[:r])
            assert second.stop == seq_len - sum(c.length for c in lay._all_chunks[2 * world - r :])


def test_zigzag_example():
    lay = Layout("zigzag", 2, 8)
    assert lay.positions(0).tolist() == [0, 1, 6, 7]
    assert lay.positions(1).tolist() == [2, 3, 4, 5]


def test_no_process_group_is_a_clear_error():
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="process group"):
        context_parallel_attention(q, q, q)
    with pytest.raises(RuntimeError, match="process group"):
        shard(q, 2)


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("variant", list(cases.GPT_VARIANTS))
def test_gpt_training_step_w2_equals_w1(results, strategy, layout, variant):
    res = _ok(results[2][f"gpt-{strategy}-{layout}-{variant}"])
    assert res["loss"] < 1e-12, res
    assert res["grad"] < 1e-12, res
    assert res["losses"] < 1e-12, res
    assert res["params"] < 1e-12, res
