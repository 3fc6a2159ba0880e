"""attnkit.document_block_mask: block masks of packed documents built from cu_seqlens or ids
on block boundaries, equal to the block mask that create_block_mask evaluates from the
equivalent mask_mod (kinds and every element), for any lengths (0 and 1 included), block
sizes that do not divide them, batches of ids, unsorted ids; and as a call's mask, equal to
the packed variable-length call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import attention, create_block_mask, document_block_mask
from attnkit import masks as M
from attnkit.block_mask import _tril_flags


def offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])


def evaluated(ids: torch.Tensor, causal: bool, size: int, batch: int | None):
    """The block mask the mask_mod way: every element evaluated."""
    mod = M.document(ids)
    if causal:
        mod = M.and_masks(mod, M.causal("top_left"))
    n = ids.shape[-1]
    return create_block_mask(mod, batch, None, n, n, block_size=size)


def assert_same(a, b):
    assert a.shape == b.shape
    assert torch.equal(a.block_kind, b.block_kind.expand_as(a.block_kind))
    assert torch.equal(a.to_dense(), b.to_dense())
    if a.stored:  # its causal-triangle flags (computed from spans) are its masks'
        assert (a._tril == _tril_flags(a.partial_masks)).all()


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=6).filter(lambda x: sum(x) > 0),
    causal=st.booleans(),
    size=st.sampled_from([3, 7, 16, 32]),
)
def test_from_cu_seqlens_equals_the_mask_mod(lengths, causal, size):
    bm = document_block_mask(offsets(lengths), causal=causal, block_size=size)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert_same(bm, evaluated(ids, causal, size, None))
    assert bm.mask_mod is not None


@pytest.mark.parametrize("causal", [False, True])
def test_from_ids_batched_negative_and_unsorted(causal):
    g = torch.Generator().manual_seed(3)
    ids = torch.sort(torch.randint(-3, 4, (3, 77), generator=g), dim=1).values
    assert_same(document_block_mask(ids=ids, causal=causal, block_size=16),
                evaluated(ids, causal, 16, 3))  # fmt: skip
    one = ids[0]
    assert_same(document_block_mask(ids=one, causal=causal, block_size=8),
                evaluated(one, causal, 8, None))  # fmt: skip
    pieces = torch.randint(0, 3, (50,), generator=g)  # a document in pieces: evaluated
    assert_same(document_block_mask(ids=pieces, causal=causal, block_size=16),
                evaluated(pieces, causal, 16, None))  # fmt: skip


def test_equal_documents_share_their_partial_tiles():
    """64 causal documents of 8 blocks: the 512 diagonal tiles share one stored mask."""
    bm = document_block_mask(torch.arange(0, 64 * 1024 + 1, 1024), causal=True)
    assert bm.partial_masks.shape[0] == 1
    assert torch.equal(bm.partial_masks[0], torch.ones(128, 128, dtype=torch.bool).tril())


def test_as_a_call_mask_equals_the_packed_call():
    lengths = [70, 1, 129, 60]
    cu = offsets(lengths)
    q, k, v = (torch.randn(260, 2, 32) for _ in range(3))
    bm = document_block_mask(cu, causal=True, block_size=64)
    four = [x.transpose(0, 1)[None] for x in (q, k, v)]  # (1, h, 260, d)
    out = attention(*four, block_mask=bm)[0].transpose(0, 1)
    packed = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    torch.testing.assert_close(out, packed, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(), ValueError, "exactly one of cu_seqlens and ids"),
        (
            dict(cu_seqlens=offsets([2]), ids=torch.zeros(2, dtype=torch.int64)),
            ValueError,
            "exactly one",
        ),
        (dict(cu_seqlens=torch.tensor([0, 5, 3])), ValueError, "non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0.0, 2.0])), TypeError, "int32 or int64"),
        (dict(ids=torch.zeros(4)), TypeError, "integer tensor"),
        (dict(ids=torch.zeros(2, 2, 2, dtype=torch.int64)), TypeError, "integer tensor"),
        (dict(cu_seqlens=offsets([3]), block_size=0), ValueError, "block_size must be >= 1"),
        (dict(cu_seqlens=offsets([3]), causal=1), TypeError, "causal"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        document_block_mask(**kwargs)


def test_unique_rows_checks_its_hash(monkeypatch):
    """Partial tiles are deduplicated by a hash of their spans, checked against the spans:
    a collision (forced here: every hash 0) falls back to the exact unique."""
    from attnkit import document_mask

    rows = torch.tensor([[1, 2], [3, 4], [1, 2], [0, 0]])
    unique, which = document_mask._unique_rows(rows)
    assert torch.equal(unique[which], rows) and unique.shape[0] == 3
    monkeypatch.setattr(torch, "randint", lambda *a, **k: torch.zeros(2, dtype=torch.int64))
    unique, which = document_mask._unique_rows(rows)
    assert torch.equal(unique[which], rows) and unique.shape[0] == 3


@pytest.mark.parametrize("bound", [1, 17, 129**2, (1 << 22) + 1])
def test_unique_small_is_torch_unique(bound):
    """The counted unique (and the sorted one past its bound) agrees with torch.unique."""
    from attnkit import document_mask

    x = torch.randint(0, bound, (500,), generator=torch.Generator().manual_seed(bound))
    values, inverse = document_mask._unique_small(x, bound)
    ref_values, ref_inverse = torch.unique(x, return_inverse=True)
    assert torch.equal(values, ref_values) and torch.equal(inverse, ref_inverse)


@pytest.mark.parametrize("width", [7, 16, 128])
def test_gather_rows_is_indexing(width):
    """Bool rows gathered as int64 words (widths a multiple of 8) or as they are."""
    from attnkit import document_mask

    g = torch.Generator().manual_seed(width)
    rows = torch.rand(9, width, generator=g) > 0.5
    index = torch.randint(0, 9, (23,), generator=g)
    assert torch.equal(document_mask._gather_rows(rows, index), rows[index])
