"""Block masks: built once against a brute-force loop, sliced, and honoured by every backend."""

from __future__ import annotations

import pytest
import torch

from attnkit import BlockMask, attention, create_block_mask
from attnkit import masks as M
from attnkit.backends.blockwise import plan as blockwise_plan
from attnkit.backends.blockwise import torch_tiles
from attnkit.block_mask import EMPTY, FULL, PARTIAL
from tests.conftest import TOL
from tests.reference import ref_attention_lse

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ["reference", "sdpa", "blockwise", "blockwise-flash", "blockwise-tiles", "auto"]


def _loop_dense(mod, b, h, q_len, kv_len):
    return torch.tensor(
        [
            [
                [[bool(mod(bi, hi, i, j)) for j in range(kv_len)] for i in range(q_len)]
                for hi in range(h)
            ]
            for bi in range(b)
        ]
    )


def window_mod(b, h, q, kv):
    return (kv <= q) & (q - kv < 7)


def per_head_mod(b, h, q, kv):
    return (kv <= q) | (h == 1)


def padding_mod(b, h, q, kv):  # depends on neither q nor h
    return kv < torch.tensor([12, 5])[b]


@pytest.mark.parametrize("block_size", [4, (5, 3), 128])
@pytest.mark.parametrize(
    ("mod", "B", "H"),
    [(window_mod, None, None), (per_head_mod, None, 3), (padding_mod, 2, 3)],
    ids=["window", "per-head", "padding"],
)
def test_kinds_and_dense_match_a_loop(mod, B, H, block_size):
    q_len, kv_len = 23, 17
    bm = create_block_mask(mod, B, H, q_len, kv_len, block_size=block_size)
    dense = _loop_dense(mod, B or 1, H or 1, q_len, kv_len)
    assert torch.equal(bm.to_dense().expand_as(dense), dense)
    dense = dense[:, :1] if mod is padding_mod else dense
    qb, kb = bm.Q_BLOCK_SIZE, bm.KV_BLOCK_SIZE
    lead = (B or 1, 1) if mod is padding_mod else (1, H or 1)
    assert bm.block_kind.shape == (*lead, -(-q_len // qb), -(-kv_len // kb))
    for i in range(bm.block_kind.shape[2]):
        for j in range(bm.block_kind.shape[3]):
            tile = dense[:, :, i * qb : (i + 1) * qb, j * kb : (j + 1) * kb]
            want = torch.where(
                tile.all((2, 3)), FULL, torch.where(tile.any((2, 3)), PARTIAL, EMPTY)
            )
            assert torch.equal(bm.block_kind[:, :, i, j].long(), want.long()), (i, j)
    assert 0.0 <= bm.sparsity() <= 100.0
    assert "BlockMask" in repr(bm) and "sparsity" in repr(bm)


def test_flexattention_style_mod_with_chained_indexing():
    """bias[q][kv] and ids[b][q] indexing, as FlexAttention users write (scalar indices)."""
    allowed = torch.rand(20, 20, generator=torch.Generator().manual_seed(0)) > 0.5
    ids = torch.tensor([[0] * 10 + [1] * 10, [0] * 5 + [1] * 15])
    bm = create_block_mask(lambda b, h, q, kv: allowed[q][kv], None, None, 20, 20, block_size=8)
    assert torch.equal(bm.to_dense()[0, 0], allowed)
    bm = create_block_mask(
        lambda b, h, q, kv: ids[b][q] == ids[b][kv], 2, None, 20, 20, block_size=8
    )
    assert torch.equal(bm.to_dense()[:, 0], ids[:, :, None] == ids[:, None, :])


@pytest.mark.parametrize(("start", "stop"), [(8, 16), (5, 6), (0, 23), (13, 23)])
def test_query_row_slicing(start, stop):
    bm = create_block_mask(window_mod, None, None, 23, 17, block_size=4)
    sliced = bm[:, :, start:stop]
    assert isinstance(sliced, BlockMask) and stop - start == sliced.Q_LEN
    assert torch.equal(sliced.to_dense(), bm.to_dense()[:, :, start:stop])
    assert torch.equal(bm.slice_queries(start, stop).to_dense(), sliced.to_dense())


def _qkv(b=2, hq=4, hkv=2, lq=45, lk=45, d=8):
    gen = torch.Generator().manual_seed(3)
    return [
        torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
        for h, n in ((hq, lq), (hkv, lk), (hkv, lk))
    ]


@pytest.mark.parametrize(
    "extra",
    [{}, {"causal": True}, {"window": 5}, {"mask": "bool"}, {"mask": "float"}],
    ids=["alone", "causal", "window", "bool-mask", "float-mask"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_with_block_mask_matches_reference(monkeypatch, backend, extra):
    """Forward and dq/dk/dv with a block mask (combined with causal, window, mask)."""
    monkeypatch.setattr(blockwise_plan, "BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "FUSED_BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 24)
    ids = torch.arange(45) // 12  # documents of 12, with causal inside
    mod = lambda b, h, q, kv: (ids[q] == ids[kv]) & (kv <= q)  # noqa: E731
    bm = create_block_mask(mod, None, None, 45, 45, block_size=8)
    q, k, v = _qkv()
    keep = _loop_dense(mod, 1, 1, 45, 45)
    i, j = torch.arange(45).view(-1, 1), torch.arange(45).view(1, -1)
    kwargs = dict(extra)
    bias = None
    if extra.get("causal"):
        keep = keep & (j <= i)
    if "window" in extra:
        keep = keep & ((i - j).abs() < 5)
    if extra.get("mask") == "bool":
        kwargs["mask"] = torch.rand(45, 45, generator=torch.Generator().manual_seed(4)) > 0.3
        keep = keep & kwargs["mask"]
    if extra.get("mask") == "float":
        bias = torch.randn(45, 45, dtype=torch.float64)
        bias[torch.rand(45, 45) > 0.7] = float("-inf")
        kwargs["mask"] = bias
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = ref_attention_lse(*xs, keep=keep, bias=bias)
    g = torch.randn_like(ref_out)
    ref = [ref_out, *torch.autograd.grad((ref_out * g).sum(), xs)]
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attention(*xs, block_mask=bm, backend=backend, **kwargs)
    ours = [out, *torch.autograd.grad((out * g).sum(), xs)]
    for a, b in zip(ours, ref, strict=True):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def test_empty_tiles_of_a_block_mask_are_skipped(monkeypatch):
    """Two documents of 64 with tiles of 32: the tile engine computes 2 x 2 x 2 tiles."""
    seen = []
    original = torch_tiles._scores

    def spy(plan, q5, k5, q0, q1, tile, acc):
        seen.append((q0, tile.k0))
        return original(plan, q5, k5, q0, q1, tile, acc)

    monkeypatch.setattr(torch_tiles, "_scores", spy)
    monkeypatch.setattr(blockwise_plan, "BLOCK_Q", 32)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 32)
    ids = torch.arange(128) // 64
    bm = create_block_mask(M.document(ids), None, None, 128, 128, block_size=32)
    assert bm.sparsity() == 50.0
    q, k, v = _qkv(lq=128, lk=128)
    attention(q, k, v, block_mask=bm, backend="blockwise-tiles")
    assert len(seen) == 8


def test_block_mask_that_does_not_fit_is_refused():
    bm = create_block_mask(window_mod, None, None, 30, 30, block_size=8)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="Q_LEN=30"):
        attention(q, k, v, block_mask=bm)
    with pytest.raises(ValueError, match="B=3"):
        attention(q, k, v, block_mask=create_block_mask(window_mod, 3, None, 45, 45))
    with pytest.raises(TypeError, match="BlockMask"):
        attention(q, k, v, block_mask=torch.ones(45, 45, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask_mod"):
        create_block_mask(lambda b, h, q, kv: torch.ones(3), None, None, 8, 8)


IDS = torch.zeros(60, dtype=torch.long)


def _global_ids_mod(b, h, q, kv):
    return IDS[q] == IDS[kv]


def test_plan_cache_sees_reassigned_globals_and_mutated_containers():
    """The cached plan of a plain mask_mod is keyed on what the mod captures: a global
    rebound to a new tensor, or a list mutated in place, gives a fresh plan (no stale mask)."""
    global IDS
    q, k, v = _qkv(lq=60, lk=60)
    outs = []
    for n in (60, 20, 7):
        IDS = torch.arange(60) // n  # a new tensor each time (its id may be reused)
        out = attention(q, k, v, mask_mod=_global_ids_mod, backend="blockwise")
        keep = IDS.view(-1, 1) == IDS.view(1, -1)
        torch.testing.assert_close(out, ref_attention_lse(q, k, v, keep=keep)[0])
        outs.append(out)
    limits = [30]

    def mod(b, h, qi, ki):
        return ki < limits[0]

    first = attention(q, k, v, mask_mod=mod, backend="blockwise")
    limits[0] = 10
    second = attention(q, k, v, mask_mod=mod, backend="blockwise")
    keep = torch.arange(60).view(1, -1).expand(60, 60) < 10
    torch.testing.assert_close(second, ref_attention_lse(q, k, v, keep=keep)[0])
    assert not torch.allclose(first, second)
