"""Hypothesis fuzz of the blockwise kernel (both engines) against the float64 reference.

Random layouts (batch, GQA groups, odd lengths, Lq != Lk, d_v != d), masking (causal in
both alignments, windows, bool and float masks with -inf, block masks), score mods,
sinks and tile sizes; forward, lse and the gradients of q, k, v and the sinks. A fixed
seed (derandomize) and a few dozen cases in CI; many more under ``-m slow``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import attention, create_block_mask
from attnkit import masks as M
from attnkit.backends.blockwise import plan as blockwise_plan
from tests.reference import ref_from_scores

pytestmark = pytest.mark.usefixtures("one_thread")

NEG_INF = float("-inf")


@st.composite
def cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([4, 8]))
    return {
        "b": draw(st.integers(1, 2)),
        "hkv": hkv,
        "hq": hkv * draw(st.sampled_from([1, 2, 3])),
        "lq": draw(st.integers(1, 45)),
        "lk": draw(st.integers(1, 45)),
        "d": d,
        "dv": draw(st.sampled_from([d, d + 3])),
        "causal": draw(st.sampled_from([None, "top_left", "bottom_right"])),
        "window": draw(st.one_of(st.none(), st.integers(1, 20))),
        "mask": draw(st.sampled_from([None, "bool", "float"])),
        "block_mask": draw(st.booleans()),
        "block_size": draw(st.sampled_from([4, 8, (4, 12)])),
        "score_mod": draw(st.sampled_from([None, "alibi", "softcap", "where"])),
        "sinks": draw(st.booleans()),
        "tiles": (draw(st.sampled_from([8, 16, 32])), draw(st.sampled_from([8, 16, 24]))),
        "backend": draw(st.sampled_from(["blockwise", "blockwise-tiles"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _check(case):
    gen = torch.Generator().manual_seed(case["seed"])
    b, hq, hkv, lq, lk = case["b"], case["hq"], case["hkv"], case["lq"], case["lk"]
    f64 = torch.float64

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64)

    q, k, v = rand(b, hq, lq, case["d"]), rand(b, hkv, lk, case["d"]), rand(b, hkv, lk, case["dv"])
    sinks = rand(hq) if case["sinks"] else None
    i, j = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)
    keep = torch.ones(lq, lk, dtype=torch.bool)
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
    bias = torch.zeros(lq, lk, dtype=f64)
    if case["mask"] == "bool":
        kwargs["mask"] = torch.rand(lq, lk, generator=gen) > 0.3
        keep = keep & kwargs["mask"]
    elif case["mask"] == "float":
        m = rand(lq, lk)
        m[torch.rand(lq, lk, generator=gen) > 0.7] = NEG_INF
        kwargs["mask"] = bias = m
    if case["block_mask"]:
        docs = torch.cumsum(torch.rand(max(lq, lk), generator=gen) > 0.8, 0)

        def doc_mod(bb, hh, qi, ki):
            return docs[qi] == docs[ki]

        kwargs["block_mask"] = create_block_mask(
            doc_mod, None, None, lq, lk, block_size=case["block_size"]
        )
        keep = keep & (docs[:lq].view(-1, 1) == docs[:lk].view(1, -1))
    g = hq // hkv
    scale = 1.0 / math.sqrt(case["d"])
    slopes = torch.tensor([2.0 ** (-(n + 1)) for n in range(hq)], dtype=f64)

    def scores(qx, kx):
        s = qx @ kx.transpose(-2, -1) * scale
        if case["score_mod"] == "alibi":
            s = s - slopes.view(1, -1, 1, 1) * (i - j).abs()
        elif case["score_mod"] == "softcap":
            s = 3.0 * torch.tanh(s / 3.0)
        elif case["score_mod"] == "where":
            s = torch.where((i + j) % 5 != 0, s, NEG_INF)
        return (s + bias).masked_fill(~keep, NEG_INF)

    if case["score_mod"] == "alibi":
        kwargs["score_mod"] = M.alibi(hq, slopes)
    elif case["score_mod"] == "softcap":
        kwargs["score_mod"] = lambda s, bb, hh, qi, ki: 3.0 * torch.tanh(s / 3.0)
    elif case["score_mod"] == "where":
        kwargs["score_mod"] = lambda s, bb, hh, qi, ki: torch.where((qi + ki) % 5 != 0, s, NEG_INF)

    g_out = rand(b, hq, lq, case["dv"])
    g_lse = rand(b, hq, lq)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])

    def loss(out, lse):
        return (out * g_out).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * g_lse).sum()

    xs = [t.clone().requires_grad_(True) for t in inputs]
    ref_out, ref_lse = ref_from_scores(
        scores(xs[0], xs[1].repeat_interleave(g, 1)),
        xs[2].repeat_interleave(g, 1),
        xs[3] if sinks is not None else None,
    )
    ref = [ref_out, ref_lse, *torch.autograd.grad(loss(ref_out, ref_lse), xs)]
    ys = [t.clone().requires_grad_(True) for t in inputs]
    bq, bk = case["tiles"]
    with pytest.MonkeyPatch.context() as mp:
        for name, val in (("BLOCK_Q", bq), ("FUSED_BLOCK_Q", bq), ("BLOCK_K", bk)):
            mp.setattr(blockwise_plan, name, val)
        out, lse = attention(
            ys[0],
            ys[1],
            ys[2],
            sinks=ys[3] if sinks is not None else None,
            return_lse=True,
            backend=case["backend"],
            **kwargs,
        )
        ours = [out, lse, *torch.autograd.grad(loss(out, lse), ys)]
    for name, a, r in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], ours, ref, strict=False):
        assert not torch.isnan(a).any(), name
        if name == "lse":
            assert torch.equal(torch.isneginf(a), torch.isneginf(r)), name
        torch.testing.assert_close(a, r, atol=1e-9, rtol=1e-9, msg=f"{name} ({case})")


_SETTINGS = dict(
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(max_examples=40, **_SETTINGS)
@given(cases())
def test_fuzz_blockwise_against_float64(case):
    _check(case)


@pytest.mark.slow
@settings(max_examples=600, **_SETTINGS)
@given(cases())
def test_fuzz_blockwise_against_float64_many(case):
    _check(case)
