"""The blockwise backend: tile skipping, O(t) saved state, GQA without copies,
weights from the log-sum-exp, score_mod gradients, hand-offs and auto selection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import attention, backends
from attnkit import masks as M
from attnkit.backends.blockwise import flash_cpu, score_mod_tensors, toeplitz, torch_tiles
from attnkit.backends.blockwise import plan as _tiles
from tests import reference
from tests.conftest import TOL
from tests.reference import ref_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(b=1, hq=4, hkv=4, lq=64, lk=64, d=8, dtype=torch.float64, grad=True):
    return [
        torch.randn(b, h, n, d, dtype=dtype).requires_grad_(grad)
        for h, n in ((hq, lq), (hkv, lk), (hkv, lk))
    ]


def _count_tiles(monkeypatch) -> list[tuple[int, int, int, int]]:
    """Record the tiles the pure-PyTorch engine ("blockwise-tiles") computes."""
    seen: list[tuple[int, int, int, int]] = []
    original = torch_tiles._scores

    def spy(plan, q5, k5, q0, q1, tile, acc):
        seen.append((q0, q1, tile.k0, tile.k1))
        return original(plan, q5, k5, q0, q1, tile, acc)

    monkeypatch.setattr(torch_tiles, "_scores", spy)
    return seen


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({"causal": True}, 36), ({"causal": True, "window": 32}, 15), ({}, 64)],
    ids=["causal", "window", "dense"],
)
def test_empty_tiles_are_skipped(monkeypatch, kwargs, expected):
    """8x8 tiles of 32: causal keeps the 36 on or below the diagonal, a 32-window 15."""
    monkeypatch.setattr(_tiles, "BLOCK_Q", 32)
    monkeypatch.setattr(_tiles, "FUSED_BLOCK_Q", 32)
    monkeypatch.setattr(_tiles, "BLOCK_K", 32)
    seen = _count_tiles(monkeypatch)
    q, k, v = _qkv(lq=256, lk=256, grad=False)
    out = attention(q, k, v, backend="blockwise-tiles", **kwargs)
    assert len(seen) == expected
    ref = attention(q, k, v, backend="reference", **kwargs)
    torch.testing.assert_close(out, ref, **TOL[torch.float64])


def test_mask_mod_tiles_are_skipped(monkeypatch):
    """A block-diagonal document mask: only the tiles inside a document are computed."""
    monkeypatch.setattr(_tiles, "BLOCK_Q", 32)
    monkeypatch.setattr(_tiles, "FUSED_BLOCK_Q", 32)
    monkeypatch.setattr(_tiles, "BLOCK_K", 32)
    seen = _count_tiles(monkeypatch)
    ids = torch.arange(128).div(64, rounding_mode="floor")  # two documents of 64
    q, k, v = _qkv(lq=128, lk=128, grad=False)
    attention(q, k, v, backend="blockwise-tiles", mask_mod=M.document(ids))
    assert len(seen) == 8  # 2 documents x (2 x 2) tiles, of 16


needs_fused_kernel = pytest.mark.skipif(
    flash_cpu._FORWARD is None, reason="this torch has no fused CPU flash kernel"
)


def _count_fused_calls(monkeypatch) -> list[tuple[int, int, bool, bool]]:
    """Record (query tile length, key segment length, is_causal, has mask) per fused call."""
    seen: list[tuple[int, int, bool, bool]] = []
    original = flash_cpu._FORWARD

    def spy(q, k, v, dropout_p, is_causal, *, attn_mask=None, scale=None):
        seen.append((q.shape[-2], k.shape[-2], is_causal, attn_mask is not None))
        return original(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(flash_cpu, "_FORWARD", spy)
    return seen


@needs_fused_kernel
def test_fused_engine_segments(monkeypatch):
    """On CPU the tiles run on torch's fused kernel: per causal query tile, one unmasked
    segment for the keys before it and one causal square; a window adds a masked edge;
    a document mask skips the other document's keys."""
    monkeypatch.setattr(_tiles, "BLOCK_Q", 32)
    monkeypatch.setattr(_tiles, "FUSED_BLOCK_Q", 32)
    monkeypatch.setattr(_tiles, "BLOCK_K", 32)
    monkeypatch.setattr(flash_cpu, "_gather_plan", lambda *a: None)  # tile by tile
    seen = _count_fused_calls(monkeypatch)
    q, k, v = _qkv(lq=256, lk=256, grad=False)
    out = attention(q, k, v, causal=True, backend="blockwise")
    assert seen == [(256, 256, True, False)]  # top-left causal: the kernel's own, one call
    torch.testing.assert_close(out, ref_attention(q, k, v, causal="bottom_right")[0])
    seen.clear()
    q, k, v = _qkv(lq=224, lk=256, grad=False)  # bottom-right: 32 keys before the square
    out = attention(q, k, v, causal=True, backend="blockwise")
    assert seen[:3] == [(32, 32, False, False), (32, 32, True, False), (32, 64, False, False)]
    assert len(seen) == 14  # 7 query tiles: the keys before each, and its causal square
    torch.testing.assert_close(out, ref_attention(q, k, v, causal="bottom_right")[0])
    seen.clear()
    q, k, v = _qkv(lq=256, lk=256, grad=False)
    with monkeypatch.context() as mp:  # the tile path (not the band layout)
        mp.setattr(toeplitz, "layout", lambda plan: None)
        attention(q, k, v, causal=True, window=32, backend="blockwise")
    assert [s for s in seen if s[3]] and all(s[1] <= 32 for s in seen)  # no key beyond the band
    seen.clear()
    # the band layout: every block of BAND_BLOCK_Q rows sees its bq + w - 1 keys, interior
    # blocks in one call, the first blocks (keys before 0) in another
    out = attention(q, k, v, causal=True, window=32, backend="blockwise")
    bq = _tiles.BAND_BLOCK_Q
    assert len(seen) == 2 and all(s[:2] == (bq, bq + 31) and s[3] for s in seen)
    i, j = torch.arange(256).view(-1, 1), torch.arange(256)
    band = (j <= i) & (j > i - 32)
    torch.testing.assert_close(out, ref_attention(q, k, v, band)[0].to(out.dtype))
    seen.clear()
    ids = torch.arange(256).div(128, rounding_mode="floor")  # two documents of 128
    out = attention(q, k, v, mask_mod=M.document(ids), backend="blockwise")
    # each query tile: its own document's 128 keys, all FULL tiles: one call, no mask
    assert seen == [(32, 128, False, False)] * 8
    mask = ids[:, None] == ids[None, :]
    torch.testing.assert_close(out, ref_attention(q, k, v, mask=mask)[0])


@needs_fused_kernel
@pytest.mark.parametrize(
    ("lq", "lk", "causal", "whole"),
    [(300, 300, True, True), (40, 333, False, True), (1, 77, False, True), (60, 333, True, False)],
    ids=["causal", "rows-gqa", "decode", "bottom-right"],
)
@pytest.mark.parametrize("reads", [True, False], ids=["bf16-measured-faster", "copies-faster"])
def test_fused_engine_reads_bf16_in_one_whole_call(monkeypatch, lq, lk, causal, whole, reads):
    """Where the fused engine's forward is one kernel call over every query (no mask; every
    key, or the kernel's own top-left causal, however many query blocks), bf16 goes in as
    it is where this machine measured that faster than float32 copies
    (calibrate.flash_reads_bf16: 3.4x faster at causal T=4096 on the AMX Xeon of session
    37, 0.98-1.19x slower with torch held to AVX2): the kernel accumulates in float32 and
    rounds once, so its error stays within twice plain bf16 math's (float64 reference).
    Tiles merged by LSE (bottom-right causal) and every backward read float32."""
    from attnkit.backends.blockwise.native import calibrate

    monkeypatch.setattr(calibrate, "flash_reads_bf16", lambda: reads)
    monkeypatch.setattr(_tiles, "FUSED_BLOCK_Q", 32)  # (several query blocks)
    seen: list[tuple[torch.dtype, bool]] = []
    original = flash_cpu._FORWARD

    def spy(q, k, v, dropout_p, is_causal, *, attn_mask=None, scale=None):
        seen.append((q.dtype, is_causal))
        return original(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(flash_cpu, "_FORWARD", spy)
    q, k, v = _qkv(b=2, hq=4, hkv=2, lq=lq, lk=lk, d=32, dtype=torch.bfloat16, grad=False)
    with torch.no_grad():
        out, lse = attention(q, k, v, causal=causal, return_lse=True, backend="blockwise-flash")
    alignment = "bottom_right" if causal else None
    ref, _ = ref_attention(q, k, v, causal=alignment)
    keep = reference.ref_causal_keep(lq, lk, "bottom_right") if causal else torch.ones(lq, lk)
    plain = reference.plain_attention(q, k, v, keep.bool())
    assert (out.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max() + 1e-6
    scores = (q.double() @ k.double().repeat_interleave(2, 1).mT) * 32**-0.5  # (GQA: 2 a head)
    scores = scores.masked_fill(~keep.bool(), float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-4, rtol=0)
    if whole:
        assert seen == [(torch.bfloat16 if reads else torch.float32, causal)]
    else:
        assert len(seen) > 1 and {dtype for dtype, _ in seen} == {torch.float32}


@needs_fused_kernel
@pytest.mark.parametrize(
    "kwargs",
    [{"causal": True, "window": 40}, {"mask_mod": M.document(torch.arange(300) // 60)}],
    ids=["window", "documents"],
)
def test_fused_engine_gathers_query_tiles_into_few_calls(monkeypatch, kwargs):
    """Where query tiles see equally many keys (a window, documents), the fused engine runs
    many tiles per kernel call (tiles in the batch dim); output and gradients exact."""
    monkeypatch.setattr(_tiles, "BLOCK_Q", 20)
    monkeypatch.setattr(_tiles, "FUSED_BLOCK_Q", 20)
    monkeypatch.setattr(_tiles, "BLOCK_K", 20)
    monkeypatch.setattr(_tiles, "MOD_BLOCK", 20)
    seen = _count_fused_calls(monkeypatch)
    q, k, v = _qkv(b=2, hq=4, hkv=2, lq=300, lk=300)
    grads = {}
    for backend in ("reference", "blockwise"):
        out = attention(q, k, v, backend=backend, **kwargs)
        grads[backend] = [out, *torch.autograd.grad(out.square().sum(), [q, k, v])]
    assert 0 < len(seen) <= 4  # 15 query tiles in at most a few calls
    for ours, ref in zip(grads["blockwise"], grads["reference"], strict=True):
        torch.testing.assert_close(ours, ref, **TOL[torch.float64])


@needs_fused_kernel
@pytest.mark.parametrize(
    "kwargs",
    [
        {"causal": True},
        {"causal": "top_left", "window": 24},
        {"window": 24},
        {"causal": True, "score_mod": M.alibi(6)},
        {"mask_mod": M.padding(torch.tensor([70, 9]))},
    ],
    ids=["causal", "window-tl", "window-symmetric", "alibi", "padding"],
)
def test_fused_engine_gradients_match_reference(monkeypatch, kwargs):
    """Output, dQ, dK, dV of the fused engine (GQA, odd lengths, small tiles) in float64."""
    monkeypatch.setattr(_tiles, "BLOCK_Q", 16)
    monkeypatch.setattr(_tiles, "FUSED_BLOCK_Q", 16)
    monkeypatch.setattr(_tiles, "BLOCK_K", 24)
    seen = _count_fused_calls(monkeypatch)
    q, k, v = _qkv(b=2, hq=6, hkv=2, lq=61, lk=75)
    grads = {}
    for backend in ("reference", "blockwise"):
        out = attention(q, k, v, backend=backend, **kwargs)
        grads[backend] = [out, *torch.autograd.grad(out.square().sum(), [q, k, v])]
    assert seen, "the fused engine did not run"
    for ours, ref in zip(grads["blockwise"], grads["reference"], strict=True):
        torch.testing.assert_close(ours, ref, **TOL[torch.float64])


@needs_fused_kernel
def test_learned_score_mod_uses_the_tile_engine(monkeypatch):
    """The fused kernel has no gradient for a bias: learned ALiBi slopes stay on PyTorch ops."""
    seen = _count_fused_calls(monkeypatch)
    slopes = torch.nn.Parameter(torch.rand(4, dtype=torch.float64))
    q, k, v = _qkv(lq=20, lk=20)
    attention(q, k, v, causal=True, score_mod=M.alibi(4, slopes), backend="blockwise")
    assert seen == []
    attention(q, k, v, causal=True, score_mod=M.alibi(4), backend="blockwise")
    assert seen


def test_saves_no_t_by_s_tensor():
    """Only O(t) per head (inputs, output, log-sum-exp) is kept for the backward."""
    t = 512
    q, k, v = _qkv(lq=t, lk=t, dtype=torch.float32)
    sizes: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda x: sizes.append(x.numel()) or x, lambda x: x
    ):
        out = attention(q, k, v, causal=True, backend="blockwise")
    assert sizes and max(sizes) <= 4 * t * 8  # (b, h, t, d) at most, never (t, t)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_gqa_makes_no_repeat_interleave_copy(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("repeat_interleave called")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch, "repeat_interleave", forbidden)
    q, k, v = _qkv(hq=6, hkv=2, lq=40, lk=50)
    out = attention(q, k, v, causal=True, backend="blockwise")
    out.sum().backward()
    monkeypatch.undo()
    ref, _ = ref_attention(q, k, v, causal="bottom_right")
    torch.testing.assert_close(out, ref, **TOL[torch.float64])


def test_weights_recomputed_from_lse():
    q, k, v = _qkv(hq=4, hkv=2, lq=33, lk=47, grad=False)
    out, w = attention(q, k, v, causal=True, need_weights=True, backend="blockwise")
    ref_out, ref_w = ref_attention(q, k, v, causal="bottom_right")
    torch.testing.assert_close(w, ref_w, **TOL[torch.float64])
    torch.testing.assert_close(out, ref_out, **TOL[torch.float64])


@pytest.mark.parametrize("backend", ["blockwise", "blockwise-flash", "blockwise-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_single_kept_key_has_weight_exactly_one(backend, dtype):
    # the weights were exp(S - lse) with the lse of another kernel (the native one): one
    # key came out 1 - 1e-5. Now the lse is taken over the very scores the weights use.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, dtype=dtype) * 10 for n in (5, 1, 1))
    _, w = attention(q, k, v, need_weights=True, backend=backend)
    assert torch.equal(w, torch.ones_like(w))
    q, k, v = (torch.randn(1, 2, 300, 16, dtype=dtype) * 10 for _ in range(3))
    _, w = attention(q, k, v, causal=True, window=1, need_weights=True, backend=backend)
    assert torch.equal(w, torch.eye(300, dtype=dtype).expand_as(w))  # itself only
    _, w = attention(q, k, v, causal="top_left", need_weights=True, backend=backend)
    assert torch.equal(w[..., 0, :], torch.eye(1, 300, dtype=dtype).expand_as(w[..., 0, :]))
    # sinks: the key's share is its own exp(s - lse), the sink in the lse (as the reference)
    sinks = torch.tensor([0.5, -2.0])
    _, w = attention(
        q[..., :1, :], k[..., :1, :], v[..., :1, :], sinks=sinks, need_weights=True, backend=backend
    )
    _, ref = attention(
        q[..., :1, :],
        k[..., :1, :],
        v[..., :1, :],
        sinks=sinks,
        need_weights=True,
        backend="reference",
    )
    torch.testing.assert_close(w, ref)


def test_weights_with_grad_are_refused_or_handed_on():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="carry no gradient"):
        attention(q, k, v, need_weights=True, backend="blockwise")
    _, w = attention(q, k, v, need_weights=True)  # auto hands it to the reference
    assert (
        w.requires_grad
        and backends.select("auto", _call(q, k, v, need_weights=True)).name == "reference"
    )


def _call(q, k, v, **kw):
    fields = dict(
        mask=None, causal=None, scale=q.shape[-1] ** -0.5, dropout_p=0.0, need_weights=False
    )
    fields.update(kw)
    return backends.AttentionCall(q, k, v, **fields)


def test_dropout_is_handed_off():
    q, k, v = _qkv(grad=False)
    with pytest.raises(ValueError, match="dropout"):
        attention(q, k, v, dropout_p=0.1, backend="blockwise")
    assert backends.select("auto", _call(q, k, v, dropout_p=0.1)).name == "reference"


def test_auto_policy():
    short = _qkv(lq=64, lk=64, grad=False)
    long = _qkv(hq=1, hkv=1, lq=8, lk=2048, grad=False)
    assert backends.select("auto", _call(*short)).name == "sdpa"
    assert backends.select("auto", _call(*short, window=8)).name == "sdpa"
    assert backends.select("auto", _call(*long, window=8)).name == "blockwise"
    assert backends.select("auto", _call(*short, score_mod=M.softcap(3.0))).name == "blockwise"
    assert backends.select("auto", _call(*short, need_weights=True)).name == "blockwise"


@pytest.mark.parametrize("kind", ["alibi", "relative_bias", "closure"])
def test_score_mod_tensors_receive_gradients(kind):
    """Learned ALiBi slopes, a relative-position table, a lambda closing over a Parameter."""
    param = torch.nn.Parameter(torch.rand(4, dtype=torch.float64) * 0.5)
    table = torch.nn.Parameter(torch.randn(4, 15, dtype=torch.float64))
    mods = {
        "alibi": M.alibi(4, param),
        "relative_bias": M.relative_bias(table),
        "closure": lambda s, b, h, q, kv: s * param[h],
    }
    leaf = table if kind == "relative_bias" else param
    q, k, v = _qkv(lq=37, lk=45)
    grads = {}
    for backend in ("reference", "blockwise"):
        out = attention(q, k, v, causal=True, score_mod=mods[kind], backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), [q, k, v, leaf])
    for ours, ref in zip(grads["blockwise"], grads["reference"], strict=True):
        assert ours.abs().sum() > 0
        torch.testing.assert_close(ours, ref, **TOL[torch.float64])


def test_score_mod_tensor_behind_a_dict_gets_its_gradient():
    """Regression: a Parameter reached through a dict used to get no gradient (or an error);
    the mod is now probed and its autograd graph walked to the Parameter."""
    holder = {"p": torch.nn.Parameter(torch.rand(4, dtype=torch.float64) + 0.5)}
    q, k, v = _qkv(lq=21, lk=21)
    grads = {}
    for backend in ("reference", "blockwise", "auto"):
        out = attention(
            q, k, v, score_mod=lambda s, b, h, i, j: s * holder["p"][h], backend=backend
        )
        grads[backend] = torch.autograd.grad(out.square().sum(), [q, holder["p"]])
    for backend in ("blockwise", "auto"):
        for ours, ref in zip(grads[backend], grads["reference"], strict=True):
            torch.testing.assert_close(ours, ref, **TOL[torch.float64])
    assert score_mod_tensors(M.alibi(4)) == ()  # fixed slopes need no gradient


def test_float_mask_and_its_gradient_rule():
    q, k, v = _qkv(grad=False)
    bias = torch.randn(1, 4, 64, 64, dtype=torch.float64)
    out = attention(q, k, v, mask=bias, backend="blockwise")
    ref, _ = ref_attention(q, k, v, mask=bias)
    torch.testing.assert_close(out, ref, **TOL[torch.float64])
    with pytest.raises(ValueError, match="float mask"):
        attention(q, k, v, mask=bias.requires_grad_(), backend="blockwise")


@pytest.mark.parametrize(
    "shape", [(9, 8), (3, 9, 8), (2, 3, 2, 9, 8)], ids=["rank2", "rank3", "rank5"]
)
def test_any_rank(shape):
    q, k, v = (torch.randn(shape, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(shape[-2], shape[-2]) > 0.3
    out = attention(q, k, v, mask=mask, causal="top_left", backend="blockwise")
    ref, _ = ref_attention(q, k, v, mask=mask, causal="top_left")
    torch.testing.assert_close(out, ref, **TOL[torch.float64])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_reference():
    q, k, v = (t.cuda() for t in _qkv(hq=4, hkv=2, lq=70, lk=90, dtype=torch.float32))
    out = attention(q, k, v, causal=True, window=20, score_mod=M.alibi(4), backend="blockwise")
    ref = attention(q, k, v, causal=True, window=20, score_mod=M.alibi(4), backend="reference")
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@settings(max_examples=200, deadline=None)
@given(
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 40)),
    offset=st.integers(-30, 30),
    q0=st.integers(0, 30),
    rows=st.integers(1, 20),
    s=st.integers(1, 60),
)
def test_band_is_the_causal_window_rule(causal, window, offset, q0, rows, s):
    """plan.Band (the one derivation of causal + window + alignment as lo <= j - i <= hi)
    keeps exactly the pairs masks.position_keep keeps, and its key range is the tightest
    one covering them."""
    from attnkit.backends.blockwise.plan import Band
    from attnkit.masks import position_keep

    band = Band.of(causal, window, offset)
    i = torch.arange(q0, q0 + rows).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    if causal or window is not None:
        want = position_keep(i + offset, j, causal=causal, window=window)
    else:
        want = torch.ones(rows, s, dtype=torch.bool)
    got = torch.ones(rows, s, dtype=torch.bool)
    if band.lo is not None:
        got &= j - i >= band.lo
    if band.hi is not None:
        got &= j - i <= band.hi
    assert torch.equal(got, want)
    lo, hi = band.keys(q0, q0 + rows, s)
    cols = want.any(0).nonzero().flatten()
    if cols.numel():
        assert (lo, hi) == (int(cols[0]), int(cols[-1]) + 1)
    else:
        assert lo >= hi


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lq, lk, causal", [(1, 77, False), (4, 4, True), (33, 33, True), (5, 40, "top_left")]
)
def test_one_kernel_call_plans_match_reference(monkeypatch, dtype, lq, lk, causal):
    """A plan that is ONE unmasked call of torch's kernel (a decode step, a causal square)
    returns the kernel's output as it is (flash_cpu._one_call): the same answer as the
    general loop, in the accumulation dtype, with gradients."""
    calls: list[object] = []
    original = flash_cpu._one_call

    def spy(*args):
        calls.append(original(*args))
        return calls[-1]

    monkeypatch.setattr(flash_cpu, "_one_call", spy)
    q, k, v = _qkv(b=2, hq=4, hkv=2, lq=lq, lk=lk, d=16, dtype=dtype)
    out, lse = attention(q, k, v, causal=causal, return_lse=True, backend="blockwise-flash")
    assert calls and calls[0] is not None, "the one-call path did not run"
    assert out.dtype == dtype and lse.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    align = None if causal is False else ("bottom_right" if causal is True else causal)
    ref, _ = ref_attention(q, k, v, causal=align)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    out.double().sum().backward()
    q64 = q.detach().double().requires_grad_()
    ref, _ = ref_attention(q64, k.detach(), v.detach(), causal=align)
    ref.sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, **TOL[dtype])


def test_a_repeated_one_call_plan_asks_its_tiles_once(monkeypatch):
    """A cached plan without a mask keeps its one-call decision (``plan.memo``): its
    tiles are worked out on the first call only, and every call gives the reference; one
    without a mask over every key is one call by its band alone (no tiles worked out). A
    masked plan decides per call (its tiles read the mask it brings)."""
    from attnkit.backends.blockwise import plan_cache

    plan_cache.clear()
    asked: list[int] = []
    original = _tiles.TilePlan.tiles

    def spy(self, *args):
        asked.append(1)
        return original(self, *args)

    monkeypatch.setattr(_tiles.TilePlan, "tiles", spy)
    q, k, v = _qkv(b=1, hq=4, hkv=2, lq=3, lk=40, d=16, dtype=torch.float32)
    ref, _ = ref_attention(q, k, v)
    for _ in range(3):
        out = attention(q, k, v, return_lse=True, backend="blockwise-flash")[0]
        torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    assert asked == []
    # a window as wide as the keys: a band, so its one tile decides (then kept)
    for _ in range(3):
        out = attention(q, k, v, window=64, return_lse=True, backend="blockwise-flash")[0]
        torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    assert len(asked) == 1
    asked.clear()
    keep = torch.rand(3, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[:, 0] = True
    for _ in range(2):
        out = attention(q, k, v, mask=keep, return_lse=True, backend="blockwise-flash")[0]
        torch.testing.assert_close(
            out.double(), ref_attention(q, k, v, keep)[0], **TOL[torch.float32]
        )
    assert len(asked) >= 2
