"""attnkit.PagedKVCache: page bookkeeping (allocate, reserve, fork with copy-on-write,
free, reuse, out-of-pages errors) against a shadow of contiguous tensors, and
paged_attention's gathered path (float64) against an independent reference on the
contiguous keys, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import PagedKVCache
from attnkit.paged_attention import paged_attention
from attnkit.paged_kv_cache import gather_pages
from tests.reference import ref_attention_lse, ref_band_keep


def test_allocate_reserve_free_and_refcounts():
    cache = PagedKVCache(6, 4, num_kv_heads=2, head_dim=8)
    a = cache.allocate(5)  # two pages
    assert len(cache.pages_of(a)) == 2 and cache.num_free_pages == 4
    cache.reserve(a, 5, 9)  # a third page
    assert len(cache.pages_of(a)) == 3 and cache.capacity(a) == 12
    b = cache.fork(a)
    assert cache.pages_of(b) == cache.pages_of(a)
    assert all(cache.refcount(p) == 2 for p in cache.pages_of(a))
    cache.reserve(b, 9, 10)  # writes into the shared last page: b gets its own copy
    assert cache.pages_of(b)[:2] == cache.pages_of(a)[:2]
    assert cache.pages_of(b)[2] != cache.pages_of(a)[2]
    assert cache.refcount(cache.pages_of(a)[2]) == 1 and cache.num_free_pages == 2
    cache.free(a)
    assert [cache.refcount(p) for p in cache.pages_of(b)] == [1, 1, 1]
    cache.free(b)
    assert cache.num_free_pages == 6 and cache.sequences == ()


def test_out_of_pages_is_a_clear_error_and_changes_nothing():
    cache = PagedKVCache(3, 4, num_kv_heads=1, head_dim=4)
    a = cache.allocate(8)
    with pytest.raises(MemoryError, match=r"out of pages.*needs 2 more page.*1 of 3 free"):
        cache.reserve(a, 8, 16)
    assert len(cache.pages_of(a)) == 2 and cache.num_free_pages == 1
    with pytest.raises(MemoryError, match="out of pages"):
        cache.allocate(9)
    assert cache.sequences == (a,)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="num_pages"):
        PagedKVCache(True, 4, num_kv_heads=1, head_dim=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(4, 0, num_kv_heads=1, head_dim=4)
    cache = PagedKVCache(4, 4, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="seq 7 is not a sequence"):
        cache.free(7)
    a = cache.allocate()
    cache.free(a)
    with pytest.raises(ValueError, match="freed, or never allocated"):
        cache.fork(a)
    with pytest.raises(ValueError, match="end must be >= 3"):
        cache.reserve(cache.allocate(), 3, 2)


def _pages(cache, seq):
    return torch.tensor([cache.pages_of(seq)])


@settings(max_examples=25, deadline=None)
@given(
    page_size=st.integers(1, 5),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 9), st.integers(1, 7)
        ),
        min_size=1,
        max_size=14,
    ),
)
def test_pages_hold_what_each_sequence_wrote(page_size, ops):
    """A shadow of contiguous float64 tensors: after every allocate / write / fork (then
    copy-on-write) / free, each live sequence gathers exactly what it wrote, whatever
    pages it was given (freed pages come back, in any order)."""
    cache = PagedKVCache(
        40, page_size, num_kv_heads=2, head_dim=3, num_layers=2, dtype=torch.float64
    )
    shadow: dict[int, list[torch.Tensor]] = {}  # seq -> [k (2 layers, h, n, d), v]
    gen = torch.Generator().manual_seed(0)

    def write(seq, n):
        start = shadow[seq][0].shape[2]
        try:
            cache.reserve(seq, start, start + n)
        except MemoryError:
            return
        k = torch.randn(2, 1, 2, n, 3, generator=gen, dtype=torch.float64)
        v = torch.randn(2, 1, 2, n, 3, generator=gen, dtype=torch.float64)
        for layer in range(2):
            cache.write(
                layer, _pages(cache, seq), torch.arange(start, start + n), k[layer], v[layer]
            )
        shadow[seq] = [
            torch.cat((shadow[seq][0], k[:, 0]), 2),
            torch.cat((shadow[seq][1], v[:, 0]), 2),
        ]

    for op, pick, n in ops:
        live = sorted(shadow)
        if op == "new" or not live:
            seq = cache.allocate()
            shadow[seq] = [torch.zeros(2, 2, 0, 3, dtype=torch.float64)] * 2
            write(seq, n)
            continue
        seq = live[pick % len(live)]
        if op == "grow":
            write(seq, n)
        elif op == "fork":
            child = cache.fork(seq)
            shadow[child] = [x.clone() for x in shadow[seq]]
            write(child, n)  # copy-on-write of a shared last page, if partly filled
        else:
            cache.free(seq)
            del shadow[seq]
        for s, (k, v) in shadow.items():
            length = k.shape[2]
            if length == 0:
                continue
            for layer in range(2):
                gk, gv = cache.gather(layer, _pages(cache, s), length)
                assert torch.equal(gk[0], k[layer]) and torch.equal(gv[0], v[layer])
    held = sum(len(cache.pages_of(s)) for s in shadow)
    shared = held - len({p for s in shadow for p in cache.pages_of(s)})
    assert cache.num_free_pages == 40 - held + shared


def _table(b, length, page_size, num_pages, gen):
    """A random page table: ``b`` rows of distinct pages in shuffled order."""
    n = -(-length // page_size)
    return torch.randperm(num_pages, generator=gen)[: b * n].view(b, n)


def _to_pages(x, table, num_pages, page_size, gen):
    """Contiguous ``(b, h, L, d)`` written to the pages ``table`` names (junk elsewhere)."""
    b, h, length, d = x.shape
    n = table.shape[1]
    pages = torch.randn(num_pages, h, page_size, d, generator=gen, dtype=x.dtype)
    padded = torch.nn.functional.pad(x.detach(), (0, 0, 0, n * page_size - length))
    pages[table.flatten()] = padded.view(b, h, n, page_size, d).transpose(1, 2).flatten(0, 1)
    return pages


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 2),
    h_kv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    t=st.integers(1, 9),
    past=st.integers(0, 40),
    page_size=st.sampled_from([1, 3, 8, 16]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gathered_paged_attention_equals_the_contiguous_reference(
    b, h_kv, groups, t, past, page_size, window, sinks, seed
):
    gen = torch.Generator().manual_seed(seed)
    h, d, length = h_kv * groups, 5, past + t
    f64 = dict(dtype=torch.float64)
    q = torch.randn(b, h, t, d, generator=gen, **f64)
    k = torch.randn(b, h_kv, length, d, generator=gen, **f64)
    v = torch.randn(b, h_kv, length, d, generator=gen, **f64)
    s = torch.randn(h, generator=gen, **f64) if sinks else None
    num_pages = b * -(-length // page_size) + 7  # every sequence's pages, and some unused
    table = _table(b, length, page_size, num_pages, gen)
    k_pages = _to_pages(k, table, num_pages, page_size, gen)
    v_pages = _to_pages(v, table, num_pages, page_size, gen)
    assert torch.equal(gather_pages(k_pages, v_pages, table, length)[1], v)
    keep = ref_band_keep(t, length, "bottom_right", window)
    want, want_lse = ref_attention_lse(q, k, v, keep=keep, sinks=s)
    out, lse = paged_attention(
        q, k_pages, v_pages, table, length, window=window, sinks=s, return_lse=True
    )
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse.to(lse.dtype), rtol=1e-10, atol=1e-10)


def test_gradients_through_the_pages_equal_the_contiguous_ones():
    """A gradient request takes the gathered path: d(query) and d(pages) equal the
    reference's d(query), d(keys), d(values) scattered to the pages the table names."""
    gen = torch.Generator().manual_seed(3)
    f64 = dict(dtype=torch.float64)
    b, h, t, length, d, ps = 2, 2, 5, 23, 4, 4
    q = torch.randn(b, h, t, d, generator=gen, **f64, requires_grad=True)
    k = torch.randn(b, h, length, d, generator=gen, **f64, requires_grad=True)
    v = torch.randn(b, h, length, d, generator=gen, **f64, requires_grad=True)
    table = _table(b, length, ps, 16, gen)
    k_pages, v_pages = _to_pages(k, table, 16, ps, gen), _to_pages(v, table, 16, ps, gen)
    k_pages.requires_grad_(True)
    v_pages.requires_grad_(True)
    grad = torch.randn(b, h, t, d, generator=gen, **f64)
    want, _ = ref_attention_lse(q, k, v, keep=ref_band_keep(t, length, "bottom_right", None))
    dq, dk, dv = torch.autograd.grad(want, (q, k, v), grad)
    out = paged_attention(q, k_pages, v_pages, table, length)
    got_dq, dkp, dvp = torch.autograd.grad(out, (q, k_pages, v_pages), grad)
    torch.testing.assert_close(got_dq, dq)
    got_dk, got_dv = gather_pages(dkp, dvp, table, length)
    torch.testing.assert_close(got_dk, dk)
    torch.testing.assert_close(got_dv, dv)
    unused = torch.ones(16, dtype=torch.bool)
    unused[table.flatten()] = False
    assert not dkp[unused].any() and not dvp[unused].any()  # no gradient leaks elsewhere


def test_paged_attention_rejects_bad_tables_with_their_values():
    q = torch.randn(1, 2, 1, 8)
    pages = torch.randn(4, 2, 4, 8)
    with pytest.raises(ValueError, match=r"page ids 0\.\.7; they must be in \[0, 4\)"):
        paged_attention(q, pages, pages, torch.tensor([[0, 7]]), 8)
    with pytest.raises(ValueError, match="key_len=9 needs 3 of page_size 4"):
        paged_attention(q, pages, pages, torch.tensor([[0, 1]]), 9)
    with pytest.raises(TypeError, match="page_table must be an int64"):
        paged_attention(q, pages, pages, torch.tensor([[0.0, 1.0]]), 8)
    with pytest.raises(ValueError, match=r"page_table must be \(batch=1, pages\)"):
        paged_attention(q, pages, pages, torch.tensor([0, 1]), 8)
    with pytest.raises(TypeError, match="k_pages is torch.float64"):
        paged_attention(q, pages.double(), pages, torch.tensor([[0, 1]]), 8)
    with pytest.raises(ValueError, match="query heads \\(2\\) must be a multiple"):
        paged_attention(q, torch.randn(4, 3, 4, 8), torch.randn(4, 3, 4, 8), torch.tensor([[0]]), 4)
    with pytest.raises(TypeError, match="key_len must be an int"):
        paged_attention(q, pages, pages, torch.tensor([[0, 1]]), True)  # type: ignore[arg-type]
    # the untouched tail of a table is never read (a pad id there is fine)
    out = paged_attention(q, pages, pages, torch.tensor([[2, 99]]), 3)
    assert math.isfinite(float(out.sum()))
