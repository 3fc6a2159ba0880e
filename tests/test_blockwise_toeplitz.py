"""The fused engine's Toeplitz layouts (band, rows) and causal runs of block masks,
against an independent float64 reference: forward, log-sum-exp, gradients, edges."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import attention, create_block_mask
from attnkit import masks as M
from attnkit.backends.blockwise import flash_cpu, toeplitz
from attnkit.backends.blockwise import plan as blockwise_plan
from tests.reference import plain_attention, ref_attention_lse, ref_band_keep

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(flash_cpu._FORWARD is None, reason="no fused CPU flash kernel"),
]


def _alibi_bias(h: int, lq: int, lk: int) -> torch.Tensor:
    slopes = M.alibi_slopes(h).view(h, 1, 1)
    dist = (torch.arange(lq).view(-1, 1) - torch.arange(lk).view(1, -1)).abs()
    return -(slopes * dist).unsqueeze(0)  # (1, h, lq, lk), float64


def _qkv(b, h, h_kv, lq, lk, d, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:  # (b, t, h, d) storage seen as (b, h, t, d)
        q = torch.randn(b, lq, h, d, generator=g, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, lk, h_kv, d, generator=g, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, lk, h_kv, d, generator=g, dtype=dtype).transpose(1, 2)
        return q, k, v
    return tuple(
        torch.randn(b, n, length, d, generator=g, dtype=dtype)
        for n, length in ((h, lq), (h_kv, lk), (h_kv, lk))
    )


def _spy_layouts(monkeypatch) -> list[str | None]:
    seen: list[str | None] = []
    original = toeplitz.layout

    def spy(plan):
        kind = original(plan)
        seen.append(kind)
        return kind

    monkeypatch.setattr(toeplitz, "layout", spy)
    return seen


def _check(case: dict, monkeypatch, expect: str | None) -> None:
    b, h, h_kv, lq, lk, d = (case[x] for x in ("b", "h", "h_kv", "lq", "lk", "d"))
    causal, window, alibi, dtype = case["causal"], case["window"], case["alibi"], case["dtype"]
    seen = _spy_layouts(monkeypatch)
    q, k, v = _qkv(b, h, h_kv, lq, lk, d, dtype, case["seed"], case.get("strided", False))
    keep = ref_band_keep(lq, lk, causal, window)
    # attnkit's mods see query i at i and key j at j (no alignment shift), as FlexAttention
    bias = _alibi_bias(h, lq, lk) if alibi else None
    kwargs = dict(
        causal=causal or False,
        window=window,
        score_mod=M.alibi(h) if alibi else None,
        return_lse=True,
        backend="blockwise-flash",
    )
    grad = case.get("grad", False)
    xs = [x.detach().clone().requires_grad_(grad) for x in (q, k, v)]
    out, lse = attention(*xs, **kwargs)
    want, want_lse = ref_attention_lse(q, k, v, keep=keep, bias=bias)
    assert expect in seen, f"layout {expect} not taken: {seen}"
    err = (out.double() - want).abs().max().item()
    err_plain = (plain_attention(q, k, v, keep, bias).double() - want).abs().max().item()
    eps = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    assert err <= 2 * err_plain + eps, f"out error {err:.3g} vs plain {err_plain:.3g}"
    alive = keep.any(-1).expand_as(want_lse)
    assert (
        torch.isneginf(lse[~alive]).all() and (out[~alive.unsqueeze(-1).expand_as(out)] == 0).all()
    )
    torch.testing.assert_close(
        lse[alive].double(), want_lse[alive], atol=100 * eps + 1e-6, rtol=1e-4
    )
    if grad:
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        got = torch.autograd.grad((out * g).sum(), xs)
        ref_xs = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
        ref_out, _ = ref_attention_lse(*ref_xs, keep=keep, bias=bias)
        ref = torch.autograd.grad((ref_out * g.double()).sum(), ref_xs)
        for name, a, r in zip("qkv", got, ref, strict=True):
            torch.testing.assert_close(a.double(), r, atol=1e-4, rtol=1e-4, msg=f"d{name}")


BAND = dict(b=1, h=2, h_kv=2, lq=200, lk=200, d=16, causal="bottom_right", window=24)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"causal": None},  # a symmetric window: keys on both sides
        {"lq": 150, "lk": 211},  # bottom-right: offset 61
        {"lq": 211, "lk": 150},  # rows before the first key are dead
        {"lq": 150, "lk": 211, "causal": "top_left"},
        {"h": 4, "h_kv": 1, "b": 3},  # MQA, a batch
        {"lq": 129, "lk": 129, "window": 1},  # odd length, the narrowest band
        {"window": 300},  # wider than the sequence
        {"alibi": True},
        {"alibi": True, "causal": None, "lq": 170, "lk": 190},
        {"strided": True},
        {"grad": True},
        {"dtype": torch.bfloat16},
        {"dtype": torch.float64},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "base",
)
def test_band_layout_matches_float64(monkeypatch, change):
    case = {**BAND, "alibi": False, "dtype": torch.float32, "seed": 0, **change}
    _check(case, monkeypatch, "band")


ROWS = dict(b=2, h=3, h_kv=3, lq=300, lk=300, d=16, causal="bottom_right", window=None)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"causal": None},
        {"lq": 97, "lk": 520},  # a cached decode-like shape: offset 423
        {"lq": 520, "lk": 97},  # dead rows
        {"causal": "top_left", "lq": 97, "lk": 520},
        {"h": 4, "h_kv": 2},
        {"strided": True},
        {"grad": True},
        {"dtype": torch.bfloat16},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "base",
)
def test_rows_layout_with_alibi_matches_float64(monkeypatch, change):
    monkeypatch.setattr(blockwise_plan, "ROWS_BLOCK_Q", 64)  # blocks cross the square
    case = {**ROWS, "alibi": True, "dtype": torch.float32, "seed": 0, **change}
    _check(case, monkeypatch, "rows")


def test_relative_bias_table_takes_the_rows_layout(monkeypatch):
    seen = _spy_layouts(monkeypatch)
    h, t, m = 2, 90, 7
    table = torch.randn(h, 2 * m - 1, dtype=torch.float64)
    q, k, v = _qkv(1, h, h, t, t, 8, torch.float64, 3)
    out = attention(
        q, k, v, causal=True, score_mod=M.relative_bias(table), backend="blockwise-flash"
    )
    rel = (torch.arange(t).view(1, -1) - torch.arange(t).view(-1, 1)).clamp(-m + 1, m - 1)
    bias = table[:, rel + m - 1].unsqueeze(0)  # (1, h, t, t)
    want, _ = ref_attention_lse(q, k, v, keep=ref_band_keep(t, t, "bottom_right", None), bias=bias)
    assert "rows" in seen
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)


def test_mods_without_a_relative_form_and_learned_slopes_take_the_general_path(monkeypatch):
    seen = _spy_layouts(monkeypatch)
    q, k, v = _qkv(1, 2, 2, 64, 64, 8, torch.float32, 4)
    attention(q, k, v, causal=True, score_mod=M.softcap(5.0), backend="blockwise-flash")
    slopes = torch.rand(2, requires_grad=True)
    attention(q, k, v, causal=True, score_mod=M.alibi(2, slopes), backend="blockwise-flash")
    assert "rows" not in seen and "band" not in seen


@settings(max_examples=40, deadline=None)
@given(
    lq=st.integers(1, 160),
    lk=st.integers(1, 160),
    window=st.one_of(st.none(), st.integers(1, 70)),
    causal=st.sampled_from([None, "bottom_right", "top_left"]),
    alibi=st.booleans(),
    heads=st.sampled_from([(1, 1), (2, 1), (3, 3)]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_toeplitz_layouts(lq, lk, window, causal, alibi, heads, seed):
    """Any shape, alignment, window and ALiBi: the same answer as the reference, whichever
    layout (band, rows or the general path) the plan picks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blockwise_plan, "BAND_BLOCK_Q", 8)
        mp.setattr(blockwise_plan, "ROWS_BLOCK_Q", 24)
        case = dict(b=1, h=heads[0], h_kv=heads[1], lq=lq, lk=lk, d=8, causal=causal)
        case.update(window=window, alibi=alibi, dtype=torch.float32, seed=seed)
        expect = toeplitz_kind(case)
        _check(case, mp, expect)


def toeplitz_kind(case: dict) -> str | None:
    offset = 0 if case["causal"] == "top_left" else case["lk"] - case["lq"]
    if case["window"] is not None and case["window"] > case["lq"] + case["lk"] + abs(offset):
        return toeplitz_kind({**case, "window": None})  # wider than any distance: no window
    if case["window"] is not None:
        return "band" if case["lq"] >= 4 * 8 else None
    return "rows" if case["alibi"] else None


# -- causal runs of block masks (documents) ----------------------------------------------


@pytest.mark.parametrize("causal_in", ["flag", "mod"])
@pytest.mark.parametrize("lengths", [(64, 64, 128), (48, 80, 128), (256,)])
def test_document_runs_match_float64(monkeypatch, causal_in, lengths):
    """Documents of whole blocks become one is_causal square each (one gathered call);
    documents not aligned to blocks keep the general tiles. Gradients too."""
    monkeypatch.setattr(blockwise_plan, "FUSED_BLOCK_Q", 128)
    t = sum(lengths)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mod = M.document(ids)
    if causal_in == "mod":
        mod = M.and_masks(mod, M.causal(alignment="top_left"))
    bm = create_block_mask(mod, None, None, t, t, block_size=16)
    calls: list[bool] = []
    original = flash_cpu._FORWARD

    def spy(q, k, v, p, is_causal, **kw):
        calls.append(is_causal)
        return original(q, k, v, p, is_causal, **kw)

    monkeypatch.setattr(flash_cpu, "_FORWARD", spy)
    q, k, v = (x.requires_grad_(True) for x in _qkv(1, 2, 2, t, t, 8, torch.float32, 5))
    out = attention(q, k, v, block_mask=bm, causal=causal_in == "flag", backend="blockwise-flash")
    keep = (ids.view(-1, 1) == ids.view(1, -1)) & ref_band_keep(t, t, "top_left", None)
    want, _ = ref_attention_lse(q.detach(), k.detach(), v.detach(), keep=keep)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    if all(n % 16 == 0 for n in lengths) and max(lengths) <= 128:
        # every document one causal square (gathered into one call when there are many)
        assert calls and all(calls) and len(calls) <= len(lengths)
    g = torch.randn(out.shape)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    xs = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref = torch.autograd.grad((ref_attention_lse(*xs, keep=keep)[0] * g.double()).sum(), xs)
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double(), r, atol=1e-4, rtol=1e-4)


def test_is_causal_tile_and_runs():
    t = 64
    ids = torch.arange(t) // 32  # two documents of 32
    causal_docs = create_block_mask(
        M.and_masks(M.document(ids), M.causal(alignment="top_left")), None, None, t, t,
        block_size=16,
    )  # fmt: skip
    assert causal_docs.is_causal_tile(0, 32, 0, 32)  # a whole document
    assert not causal_docs.is_causal_tile(0, 64, 0, 64)  # two: the corner is EMPTY
    assert not causal_docs.is_causal_tile(16, 48, 16, 48)  # straddles the boundary
    assert not causal_docs.is_causal_tile(0, 24, 0, 24)  # not whole blocks
    assert causal_docs.causal_runs(64) == [(0, 32), (32, 64)]
    assert causal_docs.causal_runs(16) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    docs = create_block_mask(M.document(ids), None, None, t, t, block_size=16)
    assert not docs.is_causal_tile(0, 32, 0, 32)  # FULL diagonal: not causal by itself
    assert docs.is_causal_tile(0, 32, 0, 32, causal=True)  # ... unless the call is
    assert docs.causal_runs(64, causal=True) == [(0, 32), (32, 64)]


# -- block masks that are a function of q_idx - kv_idx -------------------------------------


@pytest.mark.parametrize(
    "name, mod",
    [
        ("window", lambda b, h, q, kv: (kv <= q) & (q - kv < 40)),
        ("symmetric", lambda b, h, q, kv: (q - kv).abs() < 25),
        ("every-7th", lambda b, h, q, kv: ((q - kv) % 7 == 0) & ((q - kv).abs() < 60)),
        ("shifted", lambda b, h, q, kv: (q - kv >= 5) & (q - kv < 30)),  # dead first rows
    ],
)
@pytest.mark.parametrize("lq, lk", [(300, 300), (257, 311), (311, 257)])
def test_toeplitz_block_mask_takes_the_band(monkeypatch, name, mod, lq, lk):
    """A window written as a mod (FlexAttention style) runs as a band once its block mask
    is checked to be a function of q - kv; with the call's causal flag too."""
    seen = _spy_layouts(monkeypatch)
    bm = create_block_mask(mod, None, None, lq, lk, block_size=16)
    assert bm.toeplitz() is not None
    q, k, v = _qkv(2, 2, 1, lq, lk, 8, torch.float64, 6)
    qi, kj = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)
    keep = mod(0, 0, qi, kj)
    for causal in (False, "top_left"):
        want_keep = keep & (ref_band_keep(lq, lk, causal, None) if causal else True)
        out, lse = attention(q, k, v, block_mask=bm, causal=causal, return_lse=True,
                             backend="blockwise-flash")  # fmt: skip
        want, want_lse = ref_attention_lse(q, k, v, keep=want_keep)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse, want_lse.to(lse.dtype), atol=1e-10, rtol=1e-10)
    assert "band" in seen  # (a support wider than a quarter of the keys stays general)


def test_block_masks_that_are_not_toeplitz_are_refused():
    ids = torch.arange(256) // 64
    assert create_block_mask(M.document(ids), None, None, 256, 256).toeplitz() is None
    per_head = create_block_mask(lambda b, h, q, kv: q - kv < h + 3, None, 2, 64, 64)
    assert per_head.toeplitz() is None  # differs by head: not one function of q - kv
    # equal kinds along every diagonal but a different pattern inside one tile
    bad = create_block_mask(lambda b, h, q, kv: (q - kv < 20) | ((q == 70) & (kv == 3)),
                            None, None, 128, 128, block_size=16)  # fmt: skip
    assert bad.toeplitz() is None


@settings(max_examples=40, deadline=None)
@given(
    lq=st.integers(33, 140),
    lk=st.integers(1, 140),
    lo=st.integers(-40, 40),
    width=st.integers(1, 40),
    step=st.integers(1, 3),
    causal=st.sampled_from([False, "top_left", "bottom_right"]),
    block=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_toeplitz_block_masks(lq, lk, lo, width, step, causal, block, seed):
    def mod(b, h, q, kv):
        d = q - kv
        return (d >= lo) & (d < lo + width) & ((d - lo) % step == 0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blockwise_plan, "BAND_BLOCK_Q", 8)
        bm = create_block_mask(mod, None, None, lq, lk, block_size=block)
        q, k, v = _qkv(1, 2, 2, lq, lk, 8, torch.float64, seed)
        keep = mod(0, 0, torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1))
        if causal:
            keep = keep & ref_band_keep(lq, lk, causal, None)
        out, lse = attention(q, k, v, block_mask=bm, causal=causal, return_lse=True,
                             backend="blockwise-flash")  # fmt: skip
        want, want_lse = ref_attention_lse(q, k, v, keep=keep)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse, want_lse.to(lse.dtype), atol=1e-10, rtol=1e-10)
