"""Hypothesis fuzz of the triton kernels (under the interpreter without a GPU) against float64.

Random layouts (batch, GQA groups, odd lengths, Lq != Lk, head dims, d_v != d, (b, t, h, d)
strides), masking (causal in both alignments, windows with and without causal, bool and
float masks, block masks of several tile sizes), the in-tile score mods and sinks; the
output, the lse and the gradients of q, k, v (and the lse's own gradient) must keep
flash-attn's 2x rule against plain float32 math. Derandomized; a few cases in CI (the
interpreter is slow), many more under ``-m slow``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import attention, create_block_mask
from attnkit import masks as M
from tests.test_triton import DEVICE, EPS, plain  # sets TRITON_INTERPRET without a GPU

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([8, 16, 24]))
    return {
        "b": draw(st.integers(1, 2)),
        "hkv": hkv,
        "hq": hkv * draw(st.sampled_from([1, 2, 3])),
        "lq": draw(st.integers(1, 50)),
        "lk": draw(st.integers(1, 50)),
        "d": d,
        "dv": draw(st.sampled_from([d, 16])),
        "causal": draw(st.sampled_from([None, "top_left", "bottom_right"])),
        "window": draw(st.one_of(st.none(), st.integers(1, 20))),
        "mask": draw(st.sampled_from([None, "bool", "float"])),
        "block_mask": draw(st.sampled_from([None, 16, 32, (16, 32)])),
        "score_mod": draw(st.sampled_from([None, "alibi", "softcap"])),
        "sinks": draw(st.booleans()),
        "strided": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _check(case):
    gen = torch.Generator().manual_seed(case["seed"])
    b, hq, hkv, lq, lk = case["b"], case["hq"], case["hkv"], case["lq"], case["lk"]
    q = torch.randn(b, hq, lq, case["d"], generator=gen)
    k = torch.randn(b, hkv, lk, case["d"], generator=gen)
    v = torch.randn(b, hkv, lk, case["dv"], generator=gen)
    sinks = torch.randn(hq, generator=gen) if case["sinks"] else None
    i, j = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    bias = torch.zeros(1, hq, lq, lk, dtype=torch.float64)
    kwargs: dict = {}
    if case["causal"] is not None or case["window"] is not None:
        p = i + (0 if case["causal"] == "top_left" else lk - lq)
        if case["causal"] is not None:
            kwargs["causal"] = case["causal"]
            keep = keep & (j <= p)
        if case["window"] is not None:
            w = kwargs["window"] = case["window"]
            keep = keep & (j > p - w)
            if case["causal"] is None:
                keep = keep & (j < p + w)
    if case["mask"] == "bool":
        kwargs["mask"] = torch.rand(lq, lk, generator=gen) > 0.3
        keep = keep & kwargs["mask"]
    elif case["mask"] == "float":
        m = torch.randn(lq, lk, generator=gen)
        m[torch.rand(lq, lk, generator=gen) > 0.7] = float("-inf")
        kwargs["mask"] = m
        keep = keep & torch.isfinite(m)
        bias = bias + m.masked_fill(~torch.isfinite(m), 0.0).double()
    if case["block_mask"] is not None:
        docs = torch.cumsum(torch.rand(max(lq, lk), generator=gen) > 0.9, 0)
        on = docs.to(DEVICE)  # what the mod captures lives on the call's device

        def doc_mod(bb, hh, qi, ki):
            return on[qi] == on[ki]

        kwargs["block_mask"] = create_block_mask(
            doc_mod, None, None, lq, lk, block_size=case["block_mask"], device=DEVICE
        )
        keep = keep & (docs[:lq].view(-1, 1) == docs[:lk].view(1, -1))
    cap = None
    if case["score_mod"] == "alibi":
        slopes = M.alibi_slopes(hq)
        kwargs["score_mod"] = M.alibi(hq, slopes.to(DEVICE))
        bias = bias - slopes.double().view(1, -1, 1, 1) * (i - j).abs()
    elif case["score_mod"] == "softcap":
        cap = 3.0
        kwargs["score_mod"] = M.softcap(cap)
    if "mask" in kwargs:
        kwargs["mask"] = kwargs["mask"].to(DEVICE)
    keep4 = keep.expand(b, hq, lq, lk)
    g_out = torch.randn(b, hq, lq, case["dv"], generator=gen)
    g_lse = torch.randn(b, hq, lq, generator=gen)

    def run(fn, dtype, device):
        xs = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
        out, lse = fn(xs)
        lse_g = g_lse.to(device).masked_fill(torch.isinf(lse.detach()), 0.0)
        loss = (out * g_out.to(device, dtype)).sum() + (
            lse.masked_fill(torch.isinf(lse), 0) * lse_g
        ).sum()
        return [out, lse, *torch.autograd.grad(loss, xs)]

    def reference(xs):
        s = sinks.to(xs[0]) if sinks is not None else None
        return plain(*xs, keep=keep4, bias=bias.to(xs[0]), cap=cap, sinks=s)

    def ours(xs):
        if case["strided"]:  # (b, t, h, d) memory, seen as (b, h, t, d)
            xs = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs]
        s = sinks.to(DEVICE) if sinks is not None else None
        return attention(*xs, backend="triton", sinks=s, return_lse=True, **kwargs)

    ref = run(reference, torch.float64, "cpu")
    base = run(reference, torch.float32, "cpu")
    got = run(ours, torch.float32, DEVICE)
    for name, r, p, o in zip(["out", "lse", "dq", "dk", "dv"], ref, base, got, strict=True):
        o = o.detach().cpu()
        assert not torch.isnan(o).any(), f"{name} has NaN ({case})"
        if name == "lse":
            assert torch.equal(torch.isneginf(o), torch.isneginf(r)), case
            live = torch.isfinite(r)
            o, r, p = o[live], r[live], p[live]
            if not live.any():  # every row masked: nothing more to compare
                continue
        err, err_plain = (o.double() - r).abs().max(), (p.double() - r).abs().max()
        assert err <= 2 * err_plain + EPS[torch.float32], (
            f"{name}: {err:.3g} vs {err_plain:.3g} ({case})"
        )


_BASE = settings(
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(_BASE, max_examples=5)
@given(cases())
def test_fuzz_triton_against_float64(case):
    _check(case)


@pytest.mark.slow
@settings(_BASE, max_examples=150)
@given(cases())
def test_fuzz_triton_against_float64_many(case):
    _check(case)
