"""The native kernel reading keys and values through page tables (paged_attention), once
per vector width this CPU runs: against an independent float64 reference on the
contiguous keys, by flash-attn's rule, for decode steps (keys read in place) and chunked
prefill (keys packed through the table), GQA, window, sinks, padding masks, relative
biases, block masks and mask mods; random page orders and odd page sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attnkit import attention, create_block_mask
from attnkit import masks as M
from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import calibrate
from attnkit.paged_attention import native_reason, paged_attention, paged_decode
from tests.reference import plain_attention, ref_attention_lse, ref_band_keep
from tests.test_paged_kv_cache import _table, _to_pages

pytestmark = pytest.mark.usefixtures("one_thread", "isa")


@pytest.fixture
def paged_calls(monkeypatch) -> list[tuple]:
    """Record the calls the native kernel runs through page tables."""
    seen: list[tuple] = []
    original = native.forward_paged

    def spy(plan, q, *args, **kwargs):
        seen.append((plan.t, plan.s))
        return original(plan, q, *args, **kwargs)

    monkeypatch.setattr(native, "forward_paged", spy)
    return seen


def _case(b, h_kv, groups, t, length, d, page_size, seed, dtype=torch.float32, num_pages=None):
    gen = torch.Generator().manual_seed(seed)
    h = h_kv * groups
    q = torch.randn(b, h, t, d, generator=gen)
    k = torch.randn(b, h_kv, length, d, generator=gen)
    v = torch.randn(b, h_kv, length, d, generator=gen)
    num_pages = num_pages or b * -(-length // page_size) + 3
    table = _table(b, length, page_size, num_pages, gen)
    k_pages = _to_pages(k, table, num_pages, page_size, gen).to(dtype)
    v_pages = _to_pages(v, table, num_pages, page_size, gen).to(dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype), k_pages, v_pages, table


def _check(out, q, k, v, keep, bias=None, sinks=None):
    """flash-attn's rule: error <= 2x plain math's in the same dtype, plus a tiny epsilon."""
    want, _ = ref_attention_lse(q, k, v, keep=keep, bias=bias, sinks=sinks)
    plain = plain_attention(q, k, v, keep, bias, sinks)
    err_plain = (plain.double() - want).abs().max().item()
    eps = 2e-6 if q.dtype == torch.float32 else 2e-2
    err = (out.double() - want).abs().max().item()
    assert err <= 2 * err_plain + eps, (err, err_plain)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    b=st.integers(1, 2),
    h_kv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    t=st.sampled_from([1, 2, 3, 37, 130]),
    past=st.integers(0, 200),
    page_size=st.sampled_from([1, 5, 16, 64, 100]),
    window=st.one_of(st.none(), st.integers(1, 80)),
    sinks=st.booleans(),
    d=st.sampled_from([16, 24, 64]),
    seed=st.integers(0, 2**16),
)
# (a wider random run: with a sink, the yardstick was 0 and the allowance the 2e-6 epsilon
# alone, which 130 keys' sums in float32 exceed; plain math now runs with the sink too)
@example(b=1, h_kv=2, groups=4, t=130, past=0, page_size=1, window=None, sinks=True, d=64, seed=0)
def test_paged_kernel_equals_the_reference(
    paged_calls, b, h_kv, groups, t, past, page_size, window, sinks, d, seed
):
    q, k, v, k_pages, v_pages, table = _case(b, h_kv, groups, t, past + t, d, page_size, seed)
    s = torch.randn(h_kv * groups) if sinks else None
    with torch.no_grad():
        out = paged_attention(q, k_pages, v_pages, table, past + t, window=window, sinks=s)
    # the kernel read the pages in place (value heads of 24: it declines, the pages are gathered)
    assert paged_calls == ([(t, past + t)] if d % 16 == 0 else [])
    paged_calls.clear()
    _check(out, q, k, v, ref_band_keep(t, past + t, "bottom_right", window), sinks=s)


def test_a_repeated_call_is_planned_once_and_a_changed_one_anew(paged_calls, monkeypatch):
    """Every layer of a decode step makes the same call: its plan is kept (plan_cache);
    a call differing in key_len, scale, causal or window is planned again, and every answer
    meets the reference."""
    import sys

    from attnkit.backends.blockwise import plan_cache

    module = sys.modules["attnkit.paged_attention"]
    planned: list[int] = []
    original = module._plan

    def counting(query, k_pages, key_len, **kwargs):
        planned.append(key_len)
        return original(query, k_pages, key_len, **kwargs)

    monkeypatch.setattr(module, "_plan", counting)
    plan_cache.clear()
    q, k, v, k_pages, v_pages, table = _case(1, 2, 4, 1, 90, 32, 16, seed=3)
    calls = [  # (key_len, options): the first one three times
        (90, {}), (90, {}), (90, {}), (77, {}), (90, {"scale": 0.3}),
        (90, {"window": 20}), (90, {"causal": "top_left"}), (77, {}),
    ]  # fmt: skip
    with torch.no_grad():
        for length, options in calls:
            out = paged_attention(q, k_pages, v_pages, table, length, **options)
            causal = options.get("causal", "bottom_right")
            keep = ref_band_keep(1, length, causal, options.get("window"))
            want, _ = ref_attention_lse(
                q, k[:, :, :length], v[:, :, :length], keep=keep, scale=options.get("scale")
            )
            assert (out.double() - want).abs().max().item() < 1e-5
    assert planned == [90, 77, 90, 90, 90]  # each new call once; repeats kept
    assert len(paged_calls) == len(calls)  # and every call ran on the kernel


@pytest.mark.parametrize("t", [1, 19])
def test_padding_masks_relative_bias_block_masks_and_mods(paged_calls, t):
    length, ps = 150, 16
    q, k, v, k_pages, v_pages, table = _case(2, 2, 2, t, length, 32, ps, seed=t)
    keep = ref_band_keep(t, length, "bottom_right", None)
    real = torch.ones(2, 1, 1, length, dtype=torch.bool)
    real[0, ..., :37] = False  # row 0 left-padded
    with torch.no_grad():
        out = paged_attention(q, k_pages, v_pages, table, length, mask=real, causal=False)
    _check(out, q, k, v, real & ref_band_keep(t, length, None, None))
    slopes = M.alibi_slopes(4)
    # ALiBi as a mod sees the call (query i at q_idx i, as on a contiguous cache)
    bias = (
        -slopes.view(1, 4, 1, 1).double()
        * (torch.arange(t).view(-1, 1) - torch.arange(length)).abs().double()
    )
    with torch.no_grad():
        out = paged_attention(q, k_pages, v_pages, table, length, score_mod=M.alibi(4))
    _check(out, q, k, v, keep, bias=bias)

    def odd(b, h, qi, ki):
        return (ki % 3 != 1) | (ki == qi + length - t)

    bm = create_block_mask(odd, 2, 4, t, length, block_size=16)
    with torch.no_grad():
        out_bm = paged_attention(q, k_pages, v_pages, table, length, causal=False, block_mask=bm)
        out_mod = paged_attention(q, k_pages, v_pages, table, length, causal=False, mask_mod=odd)
    ki, qi = torch.arange(length).view(1, -1), torch.arange(t).view(-1, 1)
    _check(out_bm, q, k, v, odd(0, 0, qi, ki))
    _check(out_mod, q, k, v, odd(0, 0, qi, ki))
    assert len(paged_calls) == 4


def test_bf16_pages(paged_calls):
    """A bf16 decode step reads its pages in the kernel on every build (converted as read;
    an AVX2 build used to gather every page into a copy first: 12.5 ms a GPT-2-small step
    against 4096 keys on a Zen 3, 1.0 ms now). A bf16 prefill reads its pages in the
    kernel too: with bf16 products, or converted to float32 once through the page table."""
    q, k, v, k_pages, v_pages, table = _case(1, 2, 2, 1, 300, 64, 16, 5, dtype=torch.bfloat16)
    with torch.no_grad():
        out = paged_attention(q, k_pages, v_pages, table, 300)
    assert paged_calls == [(1, 300)]
    _check(out, q, k, v, ref_band_keep(1, 300, "bottom_right", None))
    paged_calls.clear()
    q, k, v, k_pages, v_pages, table = _case(1, 2, 2, 40, 300, 64, 16, 6, dtype=torch.bfloat16)
    with torch.no_grad():
        out = paged_attention(q, k_pages, v_pages, table, 300)
    assert paged_calls == [(40, 300)]
    _check(out, q, k, v, ref_band_keep(40, 300, "bottom_right", None))


def test_a_gradient_takes_the_gathered_path(paged_calls):
    q, k, v, k_pages, v_pages, table = _case(1, 1, 2, 3, 40, 16, 8, seed=9)
    q.requires_grad_(True)
    out = paged_attention(q, k_pages, v_pages, table, 40)
    assert paged_calls == []  # the kernel reads pages in its forward only
    assert "gradient" in (
        native_reason(
            q,
            k_pages,
            v_pages,
            40,
            "auto",
            mask=None,
            causal=True,
            scale=0.25,
            window=None,
            mask_mod=None,
            score_mod=None,
            block_mask=None,
            sinks=None,
            return_lse=False,
        )
        or ""
    )
    (dq,) = torch.autograd.grad(out.sum(), q)
    qd = q.detach().double().requires_grad_(True)
    want, _ = ref_attention_lse(qd, k, v, keep=ref_band_keep(3, 40, "bottom_right", None))
    (want_dq,) = torch.autograd.grad(want.sum(), qd)
    torch.testing.assert_close(dq.double(), want_dq, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "groups, dtype",
    [(1, torch.float32), (6, torch.float32), (8, torch.bfloat16), (9, torch.float32)],
)
def test_a_decode_step_of_sequences_of_different_lengths(paged_calls, groups, dtype):
    """paged_decode: one call, each row to its own number of keys; the pool's other rows
    and pages hold NaN, which no row may read (up to native.DIRECT_ROWS query heads a kv
    head, float32 or bf16, in the kernel; 9: it declines, the gathered path runs)."""
    lens = [1, 70, 16, 33]
    gen = torch.Generator().manual_seed(groups)
    b, h_kv, d, ps = len(lens), 2, 32, 16
    q = torch.randn(b, h_kv * groups, 1, d, generator=gen)
    k_pages = torch.full((30, h_kv, ps, d), float("nan"))
    v_pages = torch.full((30, h_kv, ps, d), float("nan"))
    table = torch.randperm(30, generator=gen)[: b * 5].view(b, 5)
    keys = []
    for i, n in enumerate(lens):
        k = torch.randn(1, h_kv, n, d, generator=gen)
        v = torch.randn(1, h_kv, n, d, generator=gen)
        for j in range(n):
            k_pages[table[i, j // ps], :, j % ps] = k[0, :, j]
            v_pages[table[i, j // ps], :, j % ps] = v[0, :, j]
        keys.append((k, v))
    q, k_pages, v_pages = q.to(dtype), k_pages.to(dtype), v_pages.to(dtype)
    with torch.no_grad():
        out = paged_decode(q, k_pages, v_pages, table, lens)
    assert paged_calls == ([(1, 70)] if groups <= native.DIRECT_ROWS else [])
    for i, (k, v) in enumerate(keys):
        k, v = k.to(dtype), v.to(dtype)
        _check(out[i : i + 1], q[i : i + 1], k, v, torch.ones(1, lens[i], dtype=torch.bool))
    with pytest.raises(ValueError, match="key_lens has 3 lengths for a batch of 4"):
        paged_decode(q, k_pages, v_pages, table, lens[:3])
    with pytest.raises(ValueError, match="one query a row"):
        paged_decode(q.expand(-1, -1, 2, -1), k_pages, v_pages, table, lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "h_kv, groups, padded", [(12, 1, False), (6, 2, True), (4, 1, False), (3, 1, True)]
)
def test_heads_walked_together_give_the_bits_of_one_head_at_a_time(
    paged_calls, monkeypatch, dtype, h_kv, groups, padded
):
    """A paged decode step walks several kv heads of a row per work item, page by page
    (attention.cpp, "page walk"); how many depends on the thread count (1 thread: every
    head; 5 threads on 12 heads: one at a time, the layout of every other call). Each
    head's sums are its own, so every thread count gives the same bits, and so does a
    float32 step that reads a head at a time (``calibrate.heads_apart``); they meet the
    float64 reference: with split-KV ranges (2100 keys), GQA heads sharing kv heads (a mask
    keeps them apart: no folding), and a padding mask."""
    length, ps, d = 2100, 16, 32
    q, k, v, k_pages, v_pages, table = _case(
        1, h_kv, groups, 1, length, d, ps, seed=h_kv, dtype=dtype
    )
    keep = torch.ones(1, 1, 1, length, dtype=torch.bool)
    if padded:
        keep[..., torch.randperm(length, generator=torch.Generator().manual_seed(1))[:700]] = False
    mask = keep if padded else None
    outs = []
    try:
        for apart in (False, True):  # (float32: each page walked whole, or a head at a time)
            monkeypatch.setattr(calibrate, "heads_apart", lambda apart=apart: apart)
            for threads in (1, 2, 3, 5):
                torch.set_num_threads(threads)
                with torch.no_grad():
                    outs.append(paged_attention(q, k_pages, v_pages, table, length, mask=mask))
    finally:
        torch.set_num_threads(1)
    assert paged_calls == [(1, length)] * 8  # the kernel read the pages each time
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    _check(outs[0], q, k, v, keep[0, 0].expand(1, length))


def test_the_kernel_checks_the_page_ids_each_row_reads(paged_calls):
    """The native path checks page ids in the kernel, before reading (no Python pass over
    the table a call): an id outside the pool is a ValueError naming the ids; the columns
    past a row's own pages are never read, whatever they hold (paged_decode: per row)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 16, generator=gen)
    k_pages, v_pages = torch.randn(4, 2, 4, 16, generator=gen), torch.randn(4, 2, 4, 16)
    with torch.no_grad():
        for bad in (7, -1):
            with pytest.raises(
                ValueError, match=rf"page ids {min(0, bad)}\.\.{max(3, bad)}; .* \[0, 4\)"
            ):
                paged_attention(q[:1], k_pages, v_pages, torch.tensor([[0, bad, 3]]), 12)
        assert paged_calls == [(1, 12)] * 2  # refused by the kernel
        paged_calls.clear()
        with pytest.raises(ValueError, match=r"page ids 0\.\.9; they must be in \[0, 4\)"):
            paged_decode(q, k_pages, v_pages, torch.tensor([[1, -5], [0, 9]]), [3, 8])
        # row 0 reads page 1 alone (3 keys); its -5 is padding, never read
        table = torch.tensor([[1, -5], [0, 2]])
        out = paged_decode(q, k_pages, v_pages, table, [3, 8])
        gathered = paged_decode(q, k_pages, v_pages, table, [3, 8], backend="reference")
    assert paged_calls == [(1, 8)] * 2
    for i, (n, pages) in enumerate([(3, [1]), (8, [0, 2])]):
        k = k_pages[pages].transpose(0, 1).reshape(1, 2, -1, 16)[:, :, :n]
        v = v_pages[pages].transpose(0, 1).reshape(1, 2, -1, 16)[:, :, :n]
        _check(out[i : i + 1], q[i : i + 1], k, v, torch.ones(1, n, dtype=torch.bool))
        _check(gathered[i : i + 1], q[i : i + 1], k, v, torch.ones(1, n, dtype=torch.bool))


def test_a_plain_call_repeated_takes_the_lane(paged_calls, monkeypatch):
    """A plain call the kernel ran is remembered with its plan (feature "paged lane"): the
    next call of its key skips the checks and the route and gives the same bits; page ids
    are still checked by the kernel, pages with a strided last dim still take the full
    path (gathered), and a call wanting a gradient is never remembered."""
    import sys

    module = sys.modules["attnkit.paged_attention"]
    monkeypatch.setattr(module, "_lane", {})
    q, k, v, k_pages, v_pages, table = _case(1, 2, 2, 1, 70, 32, 16, seed=5)
    with torch.no_grad():
        first = paged_attention(q, k_pages, v_pages, table, 70)
        assert len(module._lane) == 1
        with monkeypatch.context() as m:

            def refuse(*args, **kwargs):
                raise AssertionError("the full path ran")

            m.setattr(module, "_route", refuse)
            m.setattr(module, "_check_pages", refuse)
            second = paged_attention(q, k_pages, v_pages, table, 70)
            bad = table.clone()
            bad[0, 1] = k_pages.shape[0] + 2  # (the same key: the kernel checks the ids)
            with pytest.raises(ValueError, match="page ids"):
                paged_attention(q, k_pages, v_pages, bad, 70)
        assert torch.equal(first, second) and len(paged_calls) == 3
        _check(second, q, k, v, torch.ones(1, 70, dtype=torch.bool))
        wide = torch.stack([k_pages, k_pages], -1)[..., 0]  # (strided last dim, same values)
        paged_calls.clear()
        third = paged_attention(q, wide, v_pages, table, 70)
        assert paged_calls == [] and torch.allclose(third, first, atol=1e-6)
    qg = q.clone().requires_grad_()
    paged_attention(qg, k_pages, v_pages, table, 70).sum().backward()  # (gathered, autograd)
    assert len(module._lane) == 1 and qg.grad is not None


def test_the_lane_reuses_its_arguments_for_other_tables_and_only_the_same_strides(
    paged_calls, monkeypatch
):
    """The paged lane keeps the kernel's arguments for the strides of the call that filled
    it: a call with another page table (the same shape) and other pages only repoints a copy
    (no `_args`), one whose pages have other strides builds them anew; each matches the
    float64 reference of the keys its own table names."""
    import sys

    module = sys.modules["attnkit.paged_attention"]
    monkeypatch.setattr(module, "_lane", {})
    q, _, _, k_pages, v_pages, table = _case(1, 2, 2, 1, 70, 32, 16, seed=8)
    q2, k2, v2, k_pages2, v_pages2, table2 = _case(1, 2, 2, 1, 70, 32, 16, seed=9)
    # the second pool laid out (pages, page_size, h_kv, d): the same shape, other strides
    k_pages3 = k_pages2.transpose(1, 2).contiguous().transpose(1, 2)
    v_pages3 = v_pages2.transpose(1, 2).contiguous().transpose(1, 2)
    keep = torch.ones(1, 70, dtype=torch.bool)
    with torch.no_grad():
        paged_attention(q, k_pages, v_pages, table, 70)  # the full path, kept
        with monkeypatch.context() as m:
            m.setattr(native, "_args", _refuse)  # the kept arguments, repointed
            same = paged_attention(q2, k_pages2, v_pages2, table2, 70)
        other = paged_attention(q2, k_pages3, v_pages3, table2, 70)  # built anew
        with monkeypatch.context() as m:
            m.setattr(native, "_args", _refuse)
            again = paged_attention(q2, k_pages3, v_pages3, table2, 70)
    assert len(module._lane) == 1 and len(paged_calls) == 4
    for out in (same, other, again):
        _check(out, q2, k2, v2, keep)
    assert torch.equal(same, other) and torch.equal(other, again)


def _refuse(*args, **kwargs):
    raise AssertionError("the kernel's arguments were built anew")


def test_the_lanes_kept_arguments_follow_the_key_split(paged_calls, monkeypatch):
    """`native.KV_SPLITS` (a module setting the kernel's arguments hold) changed between two
    calls of one lane key: the kept arguments are not reused for the other split; each
    call has the bits of the same call made fresh with its own split."""
    import sys

    module = sys.modules["attnkit.paged_attention"]
    monkeypatch.setattr(module, "_lane", {})
    q, k, v, k_pages, v_pages, table = _case(1, 2, 1, 1, 2100, 32, 16, seed=11)
    fresh = {}
    with torch.no_grad():
        for splits in (1, 7):
            monkeypatch.setattr(native, "KV_SPLITS", splits)
            module._lane.clear()
            fresh[splits] = paged_attention(q, k_pages, v_pages, table, 2100)
        assert not torch.equal(fresh[1], fresh[7])  # (the split shows in the bits)
        module._lane.clear()
        for splits in (1, 1, 7, 7, 1):
            monkeypatch.setattr(native, "KV_SPLITS", splits)
            assert torch.equal(paged_attention(q, k_pages, v_pages, table, 2100), fresh[splits])
    _check(fresh[7], q, k, v, torch.ones(1, 2100, dtype=torch.bool))


@pytest.mark.parametrize(("past", "window"), [(1500, None), (1090, None), (1500, 1301)])
def test_a_paged_prefill_has_the_bits_of_a_contiguous_one(past, window):
    """A float32 prefill over the same keys, through pages (each chunk's P V run alone) and
    contiguous (two chunks' P V in one pass, attention.cpp's "pv2"): the same bits, with
    scores rising along the keys so that most chunks move their rows' max (the held
    chunk's weights rescaled by the next one's), over more than 16 chunks (a gather
    of the sums after 16), 150 query rows (two blocks), both parities of chunk counts, and
    a window whose first chunk is cut (no pair for it: the pairs that follow end on the
    gather's chunk, which must then run alone)."""
    t = 150
    q, k, v, k_pages, v_pages, table = _case(1, 2, 2, t, past + t, 64, 16, seed=5)
    q = q.abs()
    ramp = 0.004 * torch.arange(past + t, dtype=torch.float32)[:, None]  # (s, 1)
    k, k_pages = k + ramp, _to_pages(k + ramp, table, k_pages.shape[0], 16, None)
    with torch.no_grad():
        paged = paged_attention(q, k_pages, v_pages, table, past + t, window=window)
        whole = attention(q, k, v, causal="bottom_right", window=window, backend="blockwise")
    assert torch.equal(paged, whole)
    _check(whole, q, k, v, ref_band_keep(t, past + t, "bottom_right", window))
