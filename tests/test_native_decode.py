"""Decode steps in the native kernel (attention.cpp's feature "decode"), once per vector
width this CPU runs: one routine reads the keys and values where they are, contiguous or
through a page table, float32 or bf16, so a paged decode step gives the contiguous one's
bits (for any page size and thread count); and one rule for a weight of exactly 0: it is
skipped, so a key the mask removes never reaches the row, NaN or not (masked means
removed, also where attnkit cannot zero the key first: in a page), and keys no row of a
block keeps by the band are never read."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import attention
from attnkit.backends.blockwise import native
from attnkit.paged_attention import paged_attention
from tests.reference import plain_attention, ref_attention_lse, ref_band_keep
from tests.test_paged_kv_cache import _table, _to_pages

pytestmark = pytest.mark.usefixtures("one_thread", "isa")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """Record which native entry point each call ran (contiguous or paged)."""
    seen: list[str] = []
    forward, forward_paged = native.forward, native.forward_paged

    def spy(plan, *args, **kwargs):
        seen.append("contiguous")
        return forward(plan, *args, **kwargs)

    def spy_paged(plan, *args, **kwargs):
        seen.append("paged")
        return forward_paged(plan, *args, **kwargs)

    monkeypatch.setattr(native, "forward", spy)
    monkeypatch.setattr(native, "forward_paged", spy_paged)
    return seen


def _need(dtype: torch.dtype) -> None:
    """Every build reads a bf16 decode step as it is (native.reads_bf16)."""
    assert native.reads_bf16() == native.available()


def _case(h_kv, groups, t, length, d, page_size, dtype, seed=0):
    """q, k, v (contiguous) and the same keys and values in shuffled pages of one row."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h_kv * groups, t, d, generator=gen).to(dtype)
    k = torch.randn(1, h_kv, length, d, generator=gen).to(dtype)
    v = torch.randn(1, h_kv, length, d, generator=gen).to(dtype)
    num_pages = -(-length // page_size) + 3
    table = _table(1, length, page_size, num_pages, gen)
    k_pages = _to_pages(k, table, num_pages, page_size, gen)
    v_pages = _to_pages(v, table, num_pages, page_size, gen)
    return q, k, v, k_pages, v_pages, table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "groups, page_size, length",
    [
        (1, 16, 3000),  # MHA, pages of 16 (split-KV: 3 ranges)
        (3, 5, 1234),  # GQA, pages that end inside the runs of 4 keys
        (8, 64, 777),  # the most query rows a decode step takes (native.DIRECT_ROWS)
    ],
)
def test_a_paged_decode_step_gives_the_contiguous_bits(
    kernel_calls, dtype, groups, page_size, length
):
    _need(dtype)
    assert groups <= native.DIRECT_ROWS
    q, k, v, k_pages, v_pages, table = _case(2, groups, 1, length, 64, page_size, dtype)
    results = []
    with torch.no_grad():
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out, lse = attention(q, k, v, backend="blockwise", return_lse=True)
            paged = paged_attention(
                q, k_pages, v_pages, table, length, causal=False, return_lse=True
            )
            assert torch.equal(paged[0], out) and torch.equal(paged[1], lse)
            results.append((out, lse))
    torch.set_num_threads(1)
    assert kernel_calls == ["contiguous", "paged"] * 3
    for out, lse in results[1:]:  # the ranges depend on the shapes alone
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    # flash-attn's rule against float64
    keep = torch.ones(1, length, dtype=torch.bool)
    want, want_lse = ref_attention_lse(q, k, v, keep)
    plain = plain_attention(q, k, v, keep)
    eps = 2e-6 if dtype == torch.float32 else 2e-2
    err_plain = (plain.double() - want).abs().max().item()
    assert (results[0][0].double() - want).abs().max().item() <= 2 * err_plain + eps
    torch.testing.assert_close(results[0][1].double(), want_lse, atol=1e-4, rtol=1e-4)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(DTYPES),
    h_kv=st.sampled_from([1, 2]),
    groups=st.integers(1, 8),
    length=st.integers(1, 2600),
    page_size=st.sampled_from([1, 3, 16, 17, 64]),
    d=st.sampled_from([16, 48, 64, 128]),
    splits=st.sampled_from([0, 1, 5]),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_contiguous_fuzzed(
    monkeypatch, kernel_calls, dtype, h_kv, groups, length, page_size, d, splits, seed
):
    """Any decode step (head sizes the loops unroll and others, pages that cut the runs of
    4 keys anywhere, split or not): paged gives the contiguous bits, both within flash-attn's
    rule of float64."""
    if dtype == torch.bfloat16 and not native.bf16():
        return
    monkeypatch.setattr(native, "KV_SPLITS", splits)
    q, k, v, k_pages, v_pages, table = _case(h_kv, groups, 1, length, d, page_size, dtype, seed)
    with torch.no_grad():
        out = attention(q, k, v, backend="blockwise")
        paged = paged_attention(q, k_pages, v_pages, table, length, causal=False)
    assert kernel_calls == ["contiguous", "paged"]
    kernel_calls.clear()
    assert torch.equal(paged, out)
    keep = torch.ones(1, length, dtype=torch.bool)
    want, _ = ref_attention_lse(q, k, v, keep)
    plain = plain_attention(q, k, v, keep)
    eps = 2e-6 if dtype == torch.float32 else 2e-2
    err_plain = (plain.double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= 2 * err_plain + eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_zero_weight_is_skipped(kernel_calls, dtype, paged):
    """The rule of every decode step: a key the mask removes contributes nothing, NaN key
    and NaN value included (masked means removed), row by row: two query heads of one kv
    head share the kernel's register tile, one removes the NaN key, the other keeps it
    (and is NaN)."""
    _need(dtype)
    length, bad = 300, 100
    q, k, v, k_pages, v_pages, table = _case(1, 2, 1, length, 32, 16, dtype, seed=3)
    clean_k, clean_v = k.clone(), v.clone()
    k[0, 0, bad] = v[0, 0, bad] = float("nan")
    page, row = table[0, bad // 16], bad % 16
    k_pages[page, 0, row] = v_pages[page, 0, row] = float("nan")
    mask = torch.ones(1, 2, 1, length, dtype=torch.bool)
    mask[0, 0, 0, bad] = False  # head 0 removes the NaN key, head 1 keeps it
    with torch.no_grad():
        if paged:
            out = paged_attention(q, k_pages, v_pages, table, length, mask=mask, causal=False)
        else:
            out = attention(q, k, v, mask=mask, backend="blockwise")
    assert kernel_calls == ["paged" if paged else "contiguous"]
    assert torch.isnan(out[0, 1]).all()
    keep = mask[0, 0]  # (1, length)
    want, _ = ref_attention_lse(q[:, :1], clean_k, clean_v, keep)
    plain = plain_attention(q[:, :1], clean_k, clean_v, keep)
    eps = 2e-6 if dtype == torch.float32 else 2e-2
    err_plain = (plain.double() - want).abs().max().item()
    assert (out[:, :1].double() - want).abs().max().item() <= 2 * err_plain + eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_keys_outside_the_band_are_never_read(kernel_calls, dtype, paged):
    """A decode step with a window never reads the keys before it: a NaN value there does
    not reach the row (the tile is skipped, as flash-attn skips it)."""
    _need(dtype)
    length, window = 300, 150
    q, k, v, k_pages, v_pages, table = _case(1, 2, 1, length, 32, 16, dtype, seed=7)
    clean = v.clone()
    v[0, 0, 10] = float("nan")
    v_pages[table[0, 0], 0, 10] = float("nan")
    with torch.no_grad():
        if paged:
            out = paged_attention(q, k_pages, v_pages, table, length, window=window)
        else:
            out = attention(q, k, v, causal=True, window=window, backend="blockwise")
    assert kernel_calls == ["paged" if paged else "contiguous"]
    keep = ref_band_keep(1, length, "bottom_right", window)
    assert not keep[0, 10]
    want, _ = ref_attention_lse(q, k, clean, keep)
    plain = plain_attention(q, k, clean, keep)
    eps = 2e-6 if dtype == torch.float32 else 2e-2
    err_plain = (plain.double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= 2 * err_plain + eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("band", ["none", "causal", "window", "alibi"])
def test_a_gqa_group_read_as_rows_of_one_block(kernel_calls, dtype, band):
    """A GQA decode step whose rows nothing tells apart but their head reads each key once
    for the whole group (attention.cpp's group_rows: the group's heads as rows of one
    block, the query strided between them); a window (rows at different offsets of the
    band) or a per-head bias is not folded. Either way every head gets its own float64
    answer within flash-attn's rule, and the same bits on 1 and 2 threads."""
    _need(dtype)
    from attnkit.masks import alibi, alibi_slopes

    h_kv, groups, length, d = 2, 4, 1500, 64
    gen = torch.Generator().manual_seed(11)
    # (b, t, h, d) transposed: the heads of a step are not adjacent in memory
    q = torch.randn(2, 1, h_kv * groups, d, generator=gen).to(dtype).transpose(1, 2)
    k, v = (torch.randn(2, h_kv, length, d, generator=gen).to(dtype) for _ in range(2))
    kwargs: dict = {"causal": band in ("causal", "window")}
    window = 300 if band == "window" else None
    bias = None
    if band == "window":
        kwargs["window"] = window
    if band == "alibi":
        kwargs["score_mod"] = alibi(h_kv * groups)
        slopes = alibi_slopes(h_kv * groups).double().view(1, -1, 1, 1)
        bias = -slopes * torch.arange(length).double().view(1, 1, 1, -1)  # -|q_idx - kv_idx|
    results = []
    with torch.no_grad():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(attention(q, k, v, backend="blockwise", **kwargs))
    torch.set_num_threads(1)
    assert kernel_calls == ["contiguous"] * 2
    assert torch.equal(results[0], results[1])
    keep = ref_band_keep(1, length, "bottom_right" if kwargs["causal"] else None, window)
    want, _ = ref_attention_lse(q, k, v, keep, bias)
    plain = plain_attention(q, k, v, keep, bias)
    eps = 2e-6 if dtype == torch.float32 else 2e-2
    err_plain = (plain.double() - want).abs().max().item()
    assert (results[0].double() - want).abs().max().item() <= 2 * err_plain + eps
