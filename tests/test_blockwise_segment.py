"""The one merge and the context-parallel segment API: segments with global positions,
merged through their log-sum-exps, give full attention; their backwards add up exactly."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.backends.blockwise import (
    SegmentMask,
    merge_partials,
    segment_backward,
    segment_forward,
)
from attnkit.backends.blockwise import plan as blockwise_plan
from tests.conftest import TOL
from tests.reference import ref_attention_lse

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(blockwise_plan, "BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "FUSED_BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 24)


def _qkv(b=2, hq=4, hkv=2, t=50, s=70, d=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(b, h, n, d, generator=gen, dtype=dtype)
        for h, n in ((hq, t), (hkv, s), (hkv, s))
    ]


def test_merge_of_two_halves_is_the_whole():
    q, k, v = _qkv()
    out, lse = ref_attention_lse(q, k, v)
    a = ref_attention_lse(q, k[:, :, :31], v[:, :, :31])
    b = ref_attention_lse(q, k[:, :, 31:], v[:, :, 31:])
    m_out, m_lse = merge_partials(a[0], a[1], b[0], b[1])
    torch.testing.assert_close(m_out, out, **TOL[torch.float64])
    torch.testing.assert_close(m_lse, lse, **TOL[torch.float64])


def test_merge_of_empty_partials_is_zero_not_nan():
    lse = torch.full((3, 4), -math.inf)
    lse[0] = 1.0  # only the first row of a has keys; b has none
    out = torch.where(torch.isfinite(lse)[..., None], torch.randn(3, 4, 5), 0.0)
    empty = torch.full((3, 4), -math.inf)
    m_out, m_lse = merge_partials(out, lse, torch.zeros(3, 4, 5), empty)
    assert not torch.isnan(m_out).any() and m_out[1:].abs().max() == 0
    assert torch.isneginf(m_lse[1:]).all() and torch.equal(m_lse[0], lse[0])


def test_sink_is_a_partial_with_zero_output():
    q, k, v = _qkv(b=1, hq=2, hkv=2)
    sinks = torch.tensor([0.3, -1.2], dtype=torch.float64)
    out, lse = ref_attention_lse(q, k, v)
    m_out, m_lse = merge_partials(out, lse, torch.zeros(()), sinks.view(1, 2, 1).expand_as(lse))
    ref_out, ref_lse = ref_attention_lse(q, k, v, sinks=sinks)
    torch.testing.assert_close(m_out, ref_out, **TOL[torch.float64])
    torch.testing.assert_close(m_lse, ref_lse, **TOL[torch.float64])


def _global_keep(q_pos, k_pos, causal, window, mask_mod):
    i, j = q_pos.view(-1, 1), k_pos.view(1, -1)
    keep = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j > i - window) if causal else ((i - j).abs() < window)
    if mask_mod is not None:
        keep = keep & torch.tensor(
            [[bool(mask_mod(0, 0, int(a), int(c))) for c in k_pos] for a in q_pos]
        )
    return keep


@pytest.mark.parametrize(
    "masking",
    [
        {"causal": True},
        {"causal": True, "window": 13},
        {"window": 13},
        {"causal": True, "mask_mod": lambda b, h, qi, ki: (qi // 20) == (ki // 20)},
        {},
    ],
    ids=["causal", "causal-window", "window", "documents", "none"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_segments_merge_to_full_attention(masking, dtype):
    """A query block at global offset 40 against three key segments (offsets 0, 30, 65),
    including a segment fully after the queries; forward merged, backward summed."""
    q, k, v = _qkv(t=37, s=100, dtype=dtype)
    q_off, cuts = 40, [0, 30, 65, 100]
    scale = 0.4
    q_pos, k_pos = torch.arange(q_off, q_off + 37), torch.arange(100)
    keep = _global_keep(
        q_pos, k_pos, masking.get("causal", False), masking.get("window"), masking.get("mask_mod")
    )
    xs = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = ref_attention_lse(*xs, keep=keep, scale=scale)
    g_out = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad((ref_out * g_out).sum(), xs)

    segs = [SegmentMask(q_off, a, **masking) for a in cuts[:-1]]
    out = lse = None
    for seg, a, b in zip(segs, cuts[:-1], cuts[1:], strict=True):
        o, l = segment_forward(q, k[:, :, a:b], v[:, :, a:b], seg, scale=scale)
        out, lse = (o, l) if out is None else merge_partials(out, lse, o, l)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for seg, a, b in zip(segs, cuts[:-1], cuts[1:], strict=True):
        g = segment_backward(
            q, k[:, :, a:b], v[:, :, a:b], out, lse, g_out.to(dtype), seg, scale=scale
        )
        dq += g[0]
        dk[:, :, a:b] += g[1]
        dv[:, :, a:b] += g[2]
    for ours, ref in zip((dq, dk, dv), ref_grads, strict=True):
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours.double(), ref, **tol)


def test_segment_fully_masked_gives_minus_inf():
    q, k, v = _qkv(t=10, s=10)
    out, lse = segment_forward(q, k, v, SegmentMask(0, 50, causal=True), scale=0.3)
    assert torch.isneginf(lse).all() and out.abs().max() == 0
    with pytest.raises(TypeError):
        segment_forward(q, k, v, {"q_offset": 0}, scale=0.3)  # type: ignore[arg-type]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [500, 960, 1100, 10**9])
def test_far_segments_keep_their_window(causal, window):
    """A segment whose queries sit far past its keys (ring attention's late steps): the
    window is measured in global positions, so a window shorter than the distance drops
    every pair even when it is wider than the segment's own lengths (a window clamp that
    read the local alignment once turned it into no window at all)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    out, lse = segment_forward(q, k, v, SegmentMask(1000, 0, causal=causal, window=window),
                               scale=0.25)  # fmt: skip
    qp = torch.arange(64).view(-1, 1) + 1000
    kp = torch.arange(64).view(1, -1)
    keep = qp - kp < window
    if causal:
        keep &= kp <= qp
    else:
        keep &= kp - qp < window
    s = (q.double() @ k.double().transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    want = torch.softmax(s, -1).nan_to_num(0.0) @ v.double()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert bool(keep.any()) == bool(torch.isfinite(lse).any())
