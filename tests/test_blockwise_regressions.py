"""Regression tests, one per bug of issue 10, each named after it, on every backend it hit."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import attention, block_mask_cache
from attnkit import masks as M
from attnkit.backends.blockwise import plan as blockwise_plan
from attnkit.backends.blockwise import torch_tiles
from tests.conftest import TOL
from tests.reference import ref_attention_lse

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = ["reference", "blockwise", "blockwise-flash", "blockwise-tiles", "auto"]
NEG_INF = float("-inf")


def _qkv(b=1, hq=2, hkv=2, lq=40, lk=40, d=8, dv=None, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, lk, dv or d, generator=gen, dtype=dtype)
    return q, k, v


def _fwd_bwd(fn, q, k, v):
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*xs)
    g = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin()
    return [out, *torch.autograd.grad((out * g).sum(), xs)]


def _assert_all_close(ours, ref, tol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        assert not torch.isnan(a).any(), f"{name} has NaN"
        torch.testing.assert_close(a.double(), b.double(), **tol, msg=name)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("which", ["first-row", "causal-score-mod"])
def test_score_mod_minus_inf_row_gives_zeros_not_nan(monkeypatch, backend, which):
    """A score_mod setting a whole query row to -inf (FlexAttention's masking idiom) gave
    NaN on blockwise, auto and reference; a causal score_mod over more than one key tile
    (a row is -inf in a whole tile) too. Now: zeros, and finite gradients."""
    monkeypatch.setattr(blockwise_plan, "BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "FUSED_BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 16)
    q, k, v = _qkv()
    if which == "first-row":

        def mod(s, b, h, q_idx, kv_idx):
            return torch.where(q_idx > 0, s, NEG_INF)

        keep = (torch.arange(40) > 0).view(-1, 1).expand(40, 40)
    else:

        def mod(s, b, h, q_idx, kv_idx):
            return torch.where(kv_idx <= q_idx, s, NEG_INF)

        keep = torch.ones(40, 40, dtype=torch.bool).tril()
    ours = _fwd_bwd(lambda *x: attention(*x, score_mod=mod, backend=backend), q, k, v)
    ref = _fwd_bwd(lambda *x: ref_attention_lse(*x, keep=keep)[0], q, k, v)
    _assert_all_close(ours, ref, TOL[torch.float64])
    if which == "first-row":
        assert ours[0][:, :, 0].abs().max() == 0 and ours[1][:, :, 0].abs().max() == 0


@pytest.mark.parametrize("cap", [math.inf, -math.inf, math.nan, 0.0, -1.0, True, "2"])
def test_softcap_validates_its_cap(cap):
    """softcap(inf) was accepted and gave NaN (inf / inf); bools and non-numbers too."""
    with pytest.raises((TypeError, ValueError), match="cap"):
        M.softcap(cap)


@pytest.mark.parametrize(
    ("backend", "kwargs", "lk"),
    [
        ("blockwise", {"causal": True}, 50),
        ("blockwise-tiles", {"causal": True}, 50),
        ("auto", {"causal": True, "window": 64}, 1100),
        ("auto", {"mask_mod": M.sliding_window(64, alignment="top_left")}, 1100),
    ],
    ids=["blockwise", "tiles", "auto-window", "auto-mask-mod"],
)
def test_value_head_size_differs_from_query(backend, kwargs, lk):
    """d_v != d raised torch's "Q/K/V should have the same head size" on blockwise, and on
    auto as soon as a window or mask_mod had >= 1024 keys (the fused kernel's rule)."""
    q, k, v = _qkv(lq=lk, lk=lk, d=8, dv=12, dtype=torch.float32)
    i, j = torch.arange(lk).view(-1, 1), torch.arange(lk).view(1, -1)
    keep = j <= i
    if "window" in kwargs or "mask_mod" in kwargs:
        keep = keep & (j > i - 64)
    ours = _fwd_bwd(lambda *x: attention(*x, backend=backend, **kwargs), q, k, v)
    ref = _fwd_bwd(lambda *x: ref_attention_lse(*x, keep=keep)[0], q, k, v)
    assert ours[0].shape == (1, 2, lk, 12)
    _assert_all_close(ours, ref, TOL[torch.float32])


@pytest.mark.parametrize("backend", ["blockwise", "auto"])
@pytest.mark.parametrize("layout", ["strided-last-dim", "transposed-k"])
def test_non_contiguous_inputs(backend, layout):
    """The fused CPU engine passed views to torch's private flash kernel, silently wrong
    when the last dim's stride is not 1 (k = kv[..., ::2]: max error 1.9; the same through
    auto with an ALiBi score_mod). Gradients were wrong too."""
    q, k, v = _qkv(lq=70, lk=70, dtype=torch.float32)
    if layout == "strided-last-dim":
        kv = torch.randn(1, 2, 70, 16)
        k = kv[..., ::2]
    else:
        k = k.transpose(-2, -1).contiguous().transpose(-2, -1)
    assert k.stride(-1) != 1
    kwargs = {"causal": True, "score_mod": M.alibi(2)} if backend == "auto" else {"causal": True}
    slopes = M.alibi_slopes(2).double().view(2, 1, 1)
    i, j = torch.arange(70).view(-1, 1), torch.arange(70).view(1, -1)
    bias = -slopes * (i - j).abs() if backend == "auto" else None
    ours = _fwd_bwd(lambda *x: attention(*x, backend=backend, **kwargs), q, k, v)
    ref = _fwd_bwd(lambda *x: ref_attention_lse(*x, keep=j <= i, bias=bias)[0], q, k, v)
    _assert_all_close(ours, ref, TOL[torch.float32])


@pytest.mark.parametrize(("backend", "length"), [("blockwise", 300), ("auto", 1100)])
@pytest.mark.parametrize("extra", [{"causal": True}, {"causal": True, "window": 40}])
def test_float_mask_minus_inf_with_causal_row_liveness(monkeypatch, backend, length, extra):
    """A float mask with -inf combined with causal/window: a row counted as alive when SOME
    key survived causal/window and SOME key was finite in the mask, instead of ONE key
    surviving both (error 0.1 at L=300, 1.55 through auto at L=1100)."""
    monkeypatch.setattr(blockwise_plan, "FUSED_BLOCK_Q", 64)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 128)
    q, k, v = _qkv(lq=length, lk=length, dtype=torch.float32)
    i, j = torch.arange(length).view(-1, 1), torch.arange(length).view(1, -1)
    # each query's only finite key is AFTER it: causal leaves nothing
    mask = torch.full((length, length), NEG_INF)
    mask[:, -1] = 0.0
    mask[::3] = torch.where(j <= i, 0.0, NEG_INF)[::3]  # every third row: ordinary causal
    keep = j <= i
    if "window" in extra:
        keep = keep & (j > i - 40)
    ours = _fwd_bwd(lambda *x: attention(*x, mask=mask, backend=backend, **extra), q, k, v)
    ref = _fwd_bwd(lambda *x: ref_attention_lse(*x, keep=keep, bias=mask)[0], q, k, v)
    _assert_all_close(ours, ref, TOL[torch.float32])
    assert ours[0][0, 0, 1].abs().max() == 0  # row 1 keeps no key: zeros


@pytest.mark.parametrize("backend", ["reference", "sdpa", "blockwise", "blockwise-tiles", "auto"])
def test_batch1_key_value_broadcast(backend):
    """Key/value with batch 1 against a query batch B (FlexAttention accepts it) was refused."""
    q, _, _ = _qkv(b=3, hq=4, lq=30, lk=30)
    _, k, v = _qkv(b=1, hq=4, hkv=2, lq=30, lk=30, seed=1)
    ours = _fwd_bwd(lambda *x: attention(*x, causal=True, backend=backend), q, k, v)
    keep = torch.ones(30, 30, dtype=torch.bool).tril()
    ref = _fwd_bwd(
        lambda q_, k_, v_: ref_attention_lse(
            q_, k_.expand(3, -1, -1, -1), v_.expand(3, -1, -1, -1), keep=keep
        )[0],
        q,
        k,
        v,
    )
    assert ours[2].shape == (1, 2, 30, 8)  # dk summed over the query batch
    _assert_all_close(ours, ref, TOL[torch.float64])
    with pytest.raises(ValueError, match="batch"):
        attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))


def test_document_mask_is_a_block_mask_skipping_cross_document_tiles(monkeypatch):
    """masks.document(ids) (with causal too) runs through a block mask: the tiles across
    documents are never computed, and a repeated call reuses the plan."""
    monkeypatch.setattr(blockwise_plan, "BLOCK_Q", 32)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 32)
    seen = []
    original = torch_tiles._scores

    def spy(plan, q5, k5, q0, q1, tile, acc):
        seen.append((q0, tile.k0, tile.k1))
        return original(plan, q5, k5, q0, q1, tile, acc)

    monkeypatch.setattr(torch_tiles, "_scores", spy)
    ids = torch.arange(256) // 64  # four documents of 64
    q, k, v = _qkv(lq=256, lk=256)
    mod = M.document(ids)
    for causal in (False, True):
        seen.clear()
        out = attention(q, k, v, mask_mod=mod, causal=causal, backend="blockwise-tiles")
        assert all(q0 // 64 == k0 // 64 for q0, k0, _ in seen)  # never across documents
        assert len(seen) == (12 if causal else 16)
        keep = ids.view(-1, 1) == ids.view(1, -1)
        if causal:
            keep = keep & torch.ones(256, 256, dtype=torch.bool).tril()
        torch.testing.assert_close(out, ref_attention_lse(q, k, v, keep=keep)[0])


def test_repeated_plain_mask_mod_builds_its_plan_once(monkeypatch):
    """A plain mask_mod= evaluated the mod on every tile of every call; now its block plan
    is cached on the mod, shapes and captured state, and a mutation of that state is seen."""
    calls = []
    original = block_mask_cache.create_block_mask
    monkeypatch.setattr(
        block_mask_cache,
        "create_block_mask",
        lambda *a, **kw: calls.append(1) or original(*a, **kw),
    )
    window = torch.tensor(9)

    def mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    q, k, v = _qkv(lq=200, lk=200)
    first = attention(q, k, v, mask_mod=mod, backend="blockwise")
    built = len(calls)
    assert built == 1
    again = attention(q, k, v, mask_mod=mod, backend="blockwise")
    assert len(calls) == built and torch.equal(first, again)
    window.fill_(5)  # in place: the captured tensor's version changes, the plan is rebuilt
    changed = attention(q, k, v, mask_mod=mod, backend="blockwise")
    assert len(calls) > built
    i, j = torch.arange(200).view(-1, 1), torch.arange(200).view(1, -1)
    ref = ref_attention_lse(q, k, v, keep=(j <= i) & (i - j < 5))[0]
    torch.testing.assert_close(changed, ref, **TOL[torch.float64])


@pytest.mark.parametrize("backend", ["blockwise", "blockwise-flash", "blockwise-tiles"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_window_wider_than_any_distance_costs_nothing(backend, causal):
    """Without the native kernel the fallback layouts grew with ``window``, not the
    sequence: window=16384 at 1024 tokens took 4.6 s and 1.5 GB, window=2**31 asked for
    34 GB. A window past every query-key distance is no window."""
    q, k, v = _qkv(lq=300, lk=300, d=16, dtype=torch.float32, seed=41)
    want = attention(q, k, v, causal=causal, backend=backend)
    for window in (601, 2**31, 2**62):
        got = attention(q, k, v, causal=causal, window=window, backend=backend)
        assert torch.equal(got, want), window
    narrower = attention(q, k, v, causal=causal, window=299, backend=backend)
    assert not torch.equal(narrower, want)  # a window that still cuts is kept
