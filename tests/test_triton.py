"""The triton backend against an independent float64 reference, forward and backward.

Without a GPU the kernels run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set here before the kernels are first imported); with one,
the same tests run the compiled kernels on CUDA. The rule is flash-attn's: our error
against float64 is at most twice that of plain PyTorch math in the same dtype (plus a
small epsilon), for the output, dQ, dK, dV, the log-sum-exp and the sink / ALiBi-slope
gradients. The interpreter is slow: CI runs a handful of cases that between them cover
every axis; the full cross product is ``-m slow``.
"""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from attnkit import attention, backends, create_block_mask
from attnkit import masks as M
from attnkit.backends.triton import backend as TB
from attnkit.backends.triton import plan as P

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SRC = Path(__file__).resolve().parents[1] / "src"
SEED = int(os.environ.get("ATTNKIT_TEST_SEED", "0"))
EPS = {torch.float32: 5e-6, torch.float16: 2e-4, torch.bfloat16: 1e-3}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}

pytestmark = pytest.mark.usefixtures("one_thread")


def plain(q, k, v, *, keep, bias=None, cap=None, sinks=None, scale=None):
    """Attention written out in q's dtype: ``(out, lse)``; rows with no key give zeros, -inf."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:  # one more "key" per head, whose share is dropped
        sink = sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink], -1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    w = e / torch.where(den > 0, den, torch.ones_like(den))
    lse = (torch.log(den) + m).squeeze(-1)
    if sinks is not None:
        w = w[..., :-1]
    return w @ v, lse


def make_case(case, b, h, lq, lk, gen):
    """``(attention kwargs, keep (b|1, h|1, lq, lk), bias(slopes) or None, cap, alibi)``."""
    i = torch.arange(lq).view(-1, 1)
    j = torch.arange(lk).view(1, -1)
    keep = torch.ones(1, 1, lq, lk, dtype=torch.bool)
    shift = lk - lq
    if case == "causal_tl":
        return {"causal": "top_left"}, keep & (j <= i), None
    if case == "causal_br":
        return {"causal": True}, keep & (j <= i + shift), None
    if case == "window":
        p = i + shift
        return {"causal": True, "window": 9}, keep & (j <= p) & (j > p - 9), None
    if case == "window_sym":
        p = i + shift
        return {"window": 6}, keep & (j < p + 6) & (j > p - 6), None
    if case == "bool":
        m = torch.rand(b, 1, lq, lk, generator=gen) > 0.4
        m[..., 0] = True
        return {"mask": m}, m, None
    if case == "dead_rows":
        m = torch.rand(b, 1, lq, lk, generator=gen) > 0.4
        m[:, :, ::5] = False  # every fifth query keeps no key
        return {"mask": m}, m, None
    if case == "float":
        m = torch.randn(1, h, lq, lk, generator=gen)
        m[..., 1::7] = float("-inf")
        return {"mask": m}, keep & ~torch.isinf(m), ("float", m)
    if case == "padding":
        lengths = torch.tensor([lk, lk // 3])[:b]
        keep = (j < lengths.view(-1, 1, 1, 1)).expand(b, 1, lq, lk)
        return {"mask_mod": M.padding(lengths)}, keep, None
    if case == "document":
        ids = (torch.arange(max(lq, lk)) * 3 // max(lq, lk))[: max(lq, lk)]
        keep = (ids[:lq].view(-1, 1) == ids[:lk].view(1, -1)) & (j <= i)
        if lq == lk:
            mod = M.and_masks(M.document(ids), M.causal("top_left"))
        else:  # masks.document() is for self-attention: a user's own mod indexes the ids
            on = ids.to(DEVICE)  # captured tensors live on the call's device

            def mod(b, h, q, kv):
                return (on[q] == on[kv]) & (kv <= q)

        return {"mask_mod": mod}, keep.view(1, 1, lq, lk), None
    if case in ("block_mask", "block_mask16"):
        # per batch element and head: batch 1 pads its keys, odd heads are causal
        def mod(b, h, q, kv):
            return (kv < lk - 7 * b) & ((kv <= q + shift) | (h % 2 == 0))

        size = (32, 64) if case == "block_mask" else 16
        bm = create_block_mask(mod, b, h, lq, lk, block_size=size, device=DEVICE)
        hh = torch.arange(h).view(1, -1, 1, 1)
        bb = torch.arange(b).view(-1, 1, 1, 1)
        keep = (j < lk - 7 * bb) & ((j <= i + shift) | (hh % 2 == 0))
        return {"block_mask": bm}, keep, None
    if case == "alibi":
        slopes = M.alibi_slopes(h).requires_grad_(True)
        return (
            {"score_mod": M.alibi(h, slopes), "causal": True},
            keep & (j <= i + shift),
            (
                "alibi",
                slopes,
            ),
        )
    if case == "softcap":
        return {"score_mod": M.softcap(2.0)}, keep, ("softcap", 2.0)
    return {}, keep, None


CASES = [
    "none", "causal_tl", "causal_br", "window", "window_sym", "bool", "dead_rows", "float",
    "padding", "document", "block_mask", "block_mask16", "alibi", "softcap",
]  # fmt: skip


def run_case(dtype, case, lq, lk, heads, *, b=2, d=16, dv=None, sinks=False, lse_grad=False):
    """Check out, dq, dk, dv (and lse, sink and slope gradients) against float64."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(f"{case}-{lq}-{lk}-{d}".encode()))
    hq, hkv = heads
    dv = d if dv is None else dv
    q = torch.randn(b, hq, lq, d, generator=gen)
    k = torch.randn(b, hkv, lk, d, generator=gen)
    v = torch.randn(b, hkv, lk, dv, generator=gen)
    d_out = torch.randn(b, hq, lq, dv, generator=gen)
    d_lse = torch.randn(b, hq, lq, generator=gen) if lse_grad else None
    sink = torch.randn(hq, generator=gen) if sinks else None
    kwargs, keep, extra = make_case(case, b, hq, lq, lk, gen)
    keep = keep.expand(b, hq, lq, lk)
    slopes = extra[1] if extra is not None and extra[0] == "alibi" else None
    cap = extra[1] if extra is not None and extra[0] == "softcap" else None
    i, j = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)

    def grads(fn, dt, device):
        xs = [t.to(device, dt).requires_grad_(True) for t in (q, k, v)]
        ps = []
        if sink is not None:
            ps.append(sink.to(device, dt if dt == torch.float64 else torch.float32))
            ps[-1].requires_grad_(True)
        if slopes is not None:
            ps.append(slopes.detach().to(device, torch.float64 if dt == torch.float64 else dt))
            ps[-1].requires_grad_(True)
        out, lse = fn(xs, ps)
        loss_out = [out] + ([lse] if d_lse is not None else [])
        loss_grad = [d_out.to(device, dt)] + (
            [d_lse.to(device, lse.dtype)] if d_lse is not None else []
        )
        gs = torch.autograd.grad(loss_out, xs + ps, loss_grad)
        return [out, lse, *gs]

    def reference(xs, ps):
        ps = list(ps)
        s_ = ps.pop(0) if sink is not None else None
        bias = None
        if slopes is not None:
            sl = ps.pop(0)
            bias = -sl.view(1, -1, 1, 1) * (i - j).abs().to(sl)
        if extra is not None and extra[0] == "float":
            bias = extra[1].to(xs[0])
        return plain(*xs, keep=keep.to(xs[0].device), bias=bias, cap=cap, sinks=s_)

    def ours(xs, ps):
        ps = list(ps)
        kw = dict(kwargs)
        if sink is not None:
            kw["sinks"] = ps.pop(0)
        if slopes is not None:
            kw["score_mod"] = M.alibi(hq, ps.pop(0))
        if "mask" in kw:
            kw["mask"] = kw["mask"].to(xs[0].device)
        return attention(*xs, backend="triton", return_lse=True, **kw)

    ref = grads(reference, torch.float64, "cpu")
    base = grads(reference, dtype, "cpu")
    got = grads(ours, dtype, DEVICE)
    names = (
        ["out", "lse", "dq", "dk", "dv"]
        + ["dsinks"] * bool(sinks)
        + ["dslopes"] * (slopes is not None)
    )
    dead = ~keep.any(-1)  # (b, h, lq)
    for name, r, p, o in zip(names, ref, base, got, strict=True):
        o = o.cpu()
        assert o.shape == r.shape, name
        if name == "lse":
            assert o.dtype == torch.float32
            if not sinks:
                assert torch.isneginf(o[dead]).all(), "a row with no key has lse -inf"
            live = ~dead if not sinks else torch.ones_like(dead)
            o, r, p = o[live], r[live], p[live]
        else:
            assert o.dtype == p.dtype, name
        assert not torch.isnan(o).any(), f"{name} has NaN"
        err, err_plain = (o.double() - r).abs().max(), (p.double() - r).abs().max()
        eps = EPS[dtype]
        if name in ("dsinks", "dslopes"):
            # one number per head, summed over b * lq * lk terms whose rounding differs
            # from plain autograd's: over 10 seeds the worst fp32 dslopes error was 1.3e-6
            # of its largest entry (plain: 3.5e-7), so these get 2e-6 of it on top.
            eps += 2e-6 * r.abs().max().item()
        assert err <= 2 * err_plain + eps, f"{name}: {err:.3g} vs plain {err_plain:.3g}"
    if dead.any() and not sinks:
        assert got[0].cpu()[dead].abs().max() == 0 and got[2].cpu()[dead].abs().max() == 0


#: CI: a handful of cases that between them cross every axis (mask kind, dtype,
#: MHA/GQA/MQA, Lq <, =, > Lk, odd lengths, tile edges, sinks, the lse gradient).
CI_CASES = [
    ("causal_br", torch.float32, 45, 45, "gqa", {}),
    ("window", torch.bfloat16, 37, 53, "mqa", {}),
    ("dead_rows", torch.float16, 53, 37, "mha", {}),
    ("alibi", torch.float32, 40, 40, "gqa", {"sinks": True, "lse_grad": True}),
    ("document", torch.float32, 50, 50, "gqa", {}),
    ("block_mask", torch.float32, 45, 70, "gqa", {"sinks": True}),
    ("softcap", torch.bfloat16, 33, 33, "mha", {"sinks": True}),
    ("float", torch.float32, 29, 47, "mqa", {"lse_grad": True}),
    ("causal_tl", torch.float32, 47, 29, "gqa", {"d": 40, "dv": 24}),
]


@pytest.mark.parametrize(
    ("case", "dtype", "lq", "lk", "heads", "extra"),
    CI_CASES,
    ids=[f"{c[0]}-{str(c[1])[6:]}-{c[2]}x{c[3]}-{c[4]}" for c in CI_CASES],
)
def test_matrix_ci(case, dtype, lq, lk, heads, extra):
    run_case(dtype, case, lq, lk, HEADS[heads], **extra)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(45, 45, "mha"), (29, 61, "gqa"), (61, 29, "mqa")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_matrix_full(case, dtype, shape):
    """Every mask kind x dtype x (Lq, Lk, heads), with sinks and the lse gradient on MQA."""
    lq, lk, heads = shape
    extra = {"sinks": True, "lse_grad": True} if heads == "mqa" else {}
    run_case(dtype, case, lq, lk, HEADS[heads], **extra)


@pytest.mark.slow
@pytest.mark.parametrize("d", [16, 24, 64, 80, 128, 256])
def test_head_dims(d):
    run_case(torch.float32, "causal_br", 33, 33, HEADS["gqa"], b=1, d=d)


_W2 = torch.ones(4, 3, device=DEVICE)


def _qkv(b=2, hq=4, hkv=2, lq=40, lk=40, d=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(SEED + 7)
    return [
        torch.randn(b, h, n, d, generator=gen, dtype=dtype).to(DEVICE)
        for h, n in ((hq, lq), (hkv, lk), (hkv, lk))
    ]


def test_strided_expanded_and_low_rank_inputs():
    """(b, t, h, d) views, a batch-1 key/value broadcast, and rank-3 / rank-2 inputs."""
    q, k, v = _qkv(b=2, hq=4, hkv=2, lq=37, lk=37)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # strides of a (b, t, h, d) layout
    kt = k[:1].expand(2, -1, -1, -1)  # stride 0 over the batch
    vt = v[:1].expand(2, -1, -1, -1)
    got = attention(qt, kt, vt, causal=True, backend="triton")
    want = attention(qt, kt, vt, causal=True, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    got3 = attention(q[0], k[0], v[0], window=5, backend="triton")  # (h, t, d)
    torch.testing.assert_close(got3, attention(q[0], k[0], v[0], window=5), atol=2e-6, rtol=2e-6)
    got2 = attention(q[0, 0], k[0, 0], v[0, 0], causal=True, backend="triton")  # (t, d)
    want2 = attention(q[0, 0], k[0, 0], v[0, 0], causal=True, backend="reference")
    torch.testing.assert_close(got2, want2, atol=2e-6, rtol=2e-6)


def test_gqa_reads_key_value_heads_in_place(monkeypatch):
    """No repeat_interleave / expand copy of K, V: dK, dV come back with the kv head count."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(hq=4, hkv=1, lq=33, lk=33))

    def boom(*args, **kwargs):
        raise AssertionError("K/V were copied per query head")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", boom)
    out = attention(q, k, v, causal=True, backend="triton")
    dk, dv = torch.autograd.grad(out.sum(), (k, v))
    assert dk.shape == k.shape and dv.shape == v.shape


def test_empty_tiles_are_never_read():
    """NaN keys/values in tiles no query may see leave out, dQ finite and dK, dV zero there:
    the kernels skip those tiles (a visited tile would spread 0 * NaN = NaN)."""
    q, k, v = _qkv(b=1, hq=2, hkv=2, lq=32, lk=96)
    k[:, :, 48:] = float("nan")
    v[:, :, 48:] = float("nan")
    for kwargs in (
        {"causal": "top_left"},  # key tiles past the last query's tile
        {"block_mask": create_block_mask(lambda b, h, q_, kv: kv < 40, None, None, 32, 96,
                                         block_size=16, device=DEVICE)},
    ):  # fmt: skip
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = attention(qq, kk, vv, backend="triton", **kwargs)
        dq, dk, dv = torch.autograd.grad(out.sum(), (qq, kk, vv))
        assert torch.isfinite(out).all() and torch.isfinite(dq).all()
        assert (dk[:, :, 48:] == 0).all() and (dv[:, :, 48:] == 0).all()
        ref = attention(q[..., :48, :].clone(), k[:, :, :48], v[:, :, :48], backend="reference",
                        **({"causal": "top_left"} if "causal" in kwargs else {
                            "mask_mod": lambda b, h, q_, kv: kv < 40}))  # fmt: skip
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def test_sparse_tables_list_only_non_empty_tiles():
    """Per query block: the non-empty key blocks in order, FULL ones marked -1; the
    transposed lists hold the same pairs."""
    ids = torch.tensor([0] * 40 + [1] * 24)
    bm = create_block_mask(M.document(ids), None, None, 64, 64, block_size=16)
    t = P.sparse_tables(bm, torch.device("cpu"))
    assert P.sparse_tables(bm, torch.device("cpu")) is t  # built once per mask and device
    kind = bm.block_kind[0, 0]
    pairs, tpairs = set(), set()
    for qb in range(t.n_qb):
        n = int(t.kv_num[qb])
        idx = t.kv_idx[qb * t.n_kb : qb * t.n_kb + n].tolist()
        part = t.kv_part[qb * t.n_kb : qb * t.n_kb + n].tolist()
        assert idx == sorted(idx)
        for kb, pid in zip(idx, part, strict=True):
            assert int(kind[qb, kb]) != P.EMPTY
            assert (pid == -1) == (int(kind[qb, kb]) == 2)
            pairs.add((qb, kb))
    for kb in range(t.n_kb):
        n = int(t.q_num[kb])
        tpairs |= {(qb, kb) for qb in t.q_idx[kb * t.n_qb : kb * t.n_qb + n].tolist()}
    assert pairs == tpairs == {tuple(x) for x in (kind != P.EMPTY).nonzero().tolist()}
    # document 0 (0-39) covers blocks 0-2, document 1 (40-63) blocks 2-3: 9 + 4 - 1 shared
    assert len(pairs) == 12
    assert int((t.kv_part == -1)[: t.n_qb * t.n_kb].sum()) - (t.n_qb * t.n_kb - 12) == 5  # FULL


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"dropout_p": 0.1}, "dropout"),
        ({"need_weights": True}, "weights"),
        # a reduction does not trace (any mod that traces is generated into the kernels)
        ({"score_mod": lambda s, b, h, q, kv: s + _W2[h].sum()}, "score_mod that traces"),
        ({"mask": torch.zeros(40, 40, requires_grad=True)}, "float mask"),
        ({"dtype": torch.float64}, "float64"),
        ({"d": 320}, "head dims"),
        ({"mask_mod": M.causal("top_left"), "block_mask": "bm"}, "not both"),
    ],
    ids=["dropout", "weights", "score_mod", "mask_grad", "float64", "head_dim", "mod+block"],
)
def test_refusals_say_why(kwargs, reason):
    """Named, triton raises with the reason; auto runs the call elsewhere."""
    kwargs = dict(kwargs)
    q, k, v = _qkv(dtype=kwargs.pop("dtype", torch.float32), d=kwargs.pop("d", 16))
    if kwargs.get("block_mask") == "bm":
        kwargs["block_mask"] = create_block_mask(
            M.causal("top_left"), None, None, 40, 40, block_size=16, device=DEVICE
        )
    if "mask" in kwargs:
        kwargs["mask"] = kwargs["mask"].to(DEVICE)
    with pytest.raises(ValueError, match=reason):
        attention(q, k, v, backend="triton", **kwargs)
    if "block_mask" not in kwargs:
        attention(q, k, v, **kwargs)  # auto finds a backend that can


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setattr(TB, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention(q.cpu(), k.cpu(), v.cpu(), backend="triton")


def test_auto_order_prefers_triton_on_cuda_for_kernel_calls():
    """On CUDA: triton first for mods, windows, sinks and block masks, else right after sdpa;
    on CPU auto never picks it."""
    from types import SimpleNamespace

    def call(cuda, **kw):
        fields = dict(window=None, mask_mod=None, block_mask=None, score_mod=None, sinks=None)
        fields.update(kw)
        return SimpleNamespace(query=SimpleNamespace(is_cuda=cuda), q_len=64, k_len=64, **fields)

    assert backends.auto_order(call(True, window=8))[0] == "triton"
    assert backends.auto_order(call(True, sinks=torch.zeros(2)))[0] == "triton"
    assert backends.auto_order(call(True, score_mod=M.softcap(5.0)))[0] == "triton"
    assert backends.auto_order(call(True))[:2] == ["sdpa", "triton"]
    q = torch.randn(1, 2, 64, 16)  # a real CPU call (blockwise's auto_first reads its tensors)
    assert "triton" not in backends.auto_order(_call_of(q, q, q, window=8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_auto_runs_triton_for_a_window():
    q, k, v = _qkv(lq=300, lk=300, dtype=torch.bfloat16)
    out = attention(q, k, v, causal=True, window=64)
    ref = attention(q, k, v, causal=True, window=64, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert backends.select("auto", _call_of(q, k, v, window=64)).name == "triton"


def _call_of(q, k, v, **kw):
    return backends.AttentionCall(q, k, v, None, "bottom_right", 0.25, 0.0, False, **kw)


@pytest.mark.parametrize(
    ("qshape", "kshape"),
    [((1, 2, 5, 8), (1, 2, 7, 8)), ((2, 3, 2, 5, 16), (2, 3, 1, 6, 16)), ((1, 2, 5, 16), (1, 2, 0, 16)),
     ((1, 2, 0, 16), (1, 2, 7, 16))],
    ids=["head_dim_8", "rank5_gqa", "no_keys", "no_queries"],
)  # fmt: skip
def test_edge_sizes(qshape, kshape):
    """Tiny head dims, extra batch dims, and empty key or query sets (zeros, lse -inf)."""
    q = torch.randn(qshape, device=DEVICE, requires_grad=True)
    k = torch.randn(kshape, device=DEVICE, requires_grad=True)
    out, lse = attention(q, k, k, causal=True, backend="triton", return_lse=True)
    ref, ref_lse = attention(q, k, k, causal=True, backend="reference", return_lse=True)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse, ref_lse, atol=2e-6, rtol=2e-6)
    got = torch.autograd.grad(out.sum(), (q, k))
    want = torch.autograd.grad(ref.sum(), (q, k))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=5e-6, rtol=5e-6)


def test_a_block_mask_that_does_not_cover_its_scores_is_refused():
    """The kernels follow the block tables unchecked: a plan of the wrong size is refused."""
    from attnkit.block_mask import BlockMask

    kind = torch.full((1, 1, 1, 2), 2, dtype=torch.int8)  # one tile row for 45 queries of 32
    bm = BlockMask(
        mask_mod=None, B=None, H=None, Q_LEN=45, KV_LEN=45, Q_BLOCK_SIZE=32, KV_BLOCK_SIZE=32,
        block_kind=kind, partial_index=torch.full(kind.shape, -1),
        partial_masks=torch.zeros(0, 32, 32, dtype=torch.bool),
    )  # fmt: skip
    call = backends.AttentionCall(*_qkv(lq=45, lk=45), None, None, 0.25, 0.0, False, block_mask=bm)
    assert "does not cover" in TB.supports(call)


def test_padding_mask_mod_gets_every_tile_row():
    """A grid mod that ignores q_idx (padding) still yields one tile row per query block."""
    q, k, v = _qkv(lq=45, lk=45)
    mod = M.padding(torch.tensor([45, 15]))
    got = attention(q, k, v, mask_mod=mod, backend="triton")
    torch.testing.assert_close(got, attention(q, k, v, mask_mod=mod, backend="reference"))
