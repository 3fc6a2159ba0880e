"""return_lse and learned sinks on every backend, against the independent float64 reference:
forward, dq/dk/dv, the sinks' gradient and gradients through the returned lse."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention, backends
from attnkit.backends.blockwise import plan as blockwise_plan
from tests.conftest import TOL
from tests.reference import ref_attention_lse

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ["reference", "blockwise", "blockwise-flash", "blockwise-tiles", "auto"]


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles small enough that every case crosses tile edges."""
    monkeypatch.setattr(blockwise_plan, "BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "FUSED_BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 24)


def _inputs(b=2, hq=6, hkv=2, lq=61, lk=75, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64)
    return q, k, v, sinks


def _keep(case: str, lq: int, lk: int) -> tuple[dict, torch.Tensor | None]:
    i = torch.arange(lq).view(-1, 1) + (lk - lq)
    j = torch.arange(lk).view(1, -1)
    if case == "causal":
        return {"causal": True}, j <= i
    if case == "window":
        return {"causal": True, "window": 9}, (j <= i) & (j > i - 9)
    if case == "dead_rows":  # every fourth query keeps no key
        keep = torch.rand(lq, lk, generator=torch.Generator().manual_seed(1)) > 0.5
        keep[::4] = False
        return {"mask": keep}, keep
    return {}, None


@pytest.mark.parametrize("case", ["none", "causal", "window", "dead_rows"])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_and_sinks_match_reference(backend, use_sinks, case):
    """out, lse and the gradients of q, k, v, sinks (loss through out AND lse), GQA, Lq != Lk."""
    q, k, v, sinks = _inputs()
    kwargs, keep = _keep(case, q.shape[2], k.shape[2])
    gen = torch.Generator().manual_seed(2)
    g_out = torch.randn(2, 6, 61, 8, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(2, 6, 61, generator=gen, dtype=torch.float64)

    def loss_and_grads(fn):
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        out, lse = fn(*xs)
        finite = torch.isfinite(lse)
        loss = (out * g_out).sum() + (lse.masked_fill(~finite, 0.0) * g_lse).sum()
        grads = torch.autograd.grad(loss, xs if use_sinks else xs[:3], allow_unused=True)
        return out, lse, grads

    ref = loss_and_grads(
        lambda q_, k_, v_, s_: ref_attention_lse(
            q_, k_, v_, keep=keep, sinks=s_ if use_sinks else None
        )
    )
    ours = loss_and_grads(
        lambda q_, k_, v_, s_: attention(
            q_, k_, v_, return_lse=True, sinks=s_ if use_sinks else None, backend=backend, **kwargs
        )
    )
    torch.testing.assert_close(ours[0], ref[0], **TOL[torch.float64])
    assert torch.equal(torch.isneginf(ours[1]), torch.isneginf(ref[1]))
    torch.testing.assert_close(ours[1], ref[1], **TOL[torch.float64])
    for name, a, b in zip("qkvs", ours[2], ref[2], strict=False):
        assert a is not None and not torch.isnan(a).any(), name
        torch.testing.assert_close(a, b, **TOL[torch.float64], msg=f"d{name}")
    if use_sinks:
        assert ours[2][3].abs().sum() > 0


def test_fully_masked_row_gives_minus_inf_lse_and_zeros():
    q, k, v, sinks = _inputs(b=1, hq=2, hkv=2, lq=5, lk=7)
    keep = torch.ones(5, 7, dtype=torch.bool)
    keep[2] = False
    for backend in ("reference", "blockwise", "blockwise-tiles"):
        out, lse = attention(q, k, v, mask=keep, return_lse=True, backend=backend)
        assert torch.isneginf(lse[:, :, 2]).all() and torch.isfinite(lse[:, :, [0, 1, 3, 4]]).all()
        assert out[:, :, 2].abs().max() == 0
        # with a sink, the empty row's lse is the sink's logit and its output still zero
        out, lse = attention(q, k, v, mask=keep, sinks=sinks[:2], return_lse=True, backend=backend)
        torch.testing.assert_close(lse[0, :, 2], sinks[:2])
        assert out[:, :, 2].abs().max() == 0


def test_return_order_and_dtype():
    q, k, v, _ = _inputs(b=1, hq=2, hkv=2, lq=9, lk=9)
    with torch.no_grad():
        out, w, lse = attention(q, k, v, need_weights=True, return_lse=True, backend="blockwise")
    assert out.shape == (1, 2, 9, 8) and w.shape == (1, 2, 9, 9) and lse.shape == (1, 2, 9)
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    for backend in ("reference", "blockwise"):
        _, lse = attention(*bf, return_lse=True, backend=backend)
        assert lse.dtype == torch.float32
    _, ref_lse = ref_attention_lse(q, k, v)
    torch.testing.assert_close(lse.double(), ref_lse, atol=5e-2, rtol=5e-2)


def test_sdpa_says_why_and_auto_falls_through():
    q, k, v, sinks = _inputs(b=1, hq=2, hkv=2, lq=9, lk=9)
    with pytest.raises(ValueError, match="sinks"):
        attention(q, k, v, sinks=sinks[:2], backend="sdpa")
    with pytest.raises(ValueError, match="log-sum-exp"):
        attention(q, k, v, return_lse=True, backend="sdpa")
    call = backends.AttentionCall(q, k, v, None, None, 0.3, 0.0, False, sinks=sinks[:2])
    assert backends.select("auto", call).name == "blockwise"


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"sinks": torch.zeros(3)}, ValueError),
        ({"sinks": torch.zeros(2, dtype=torch.long)}, TypeError),
        ({"sinks": [0.0, 0.0]}, TypeError),
        ({"return_lse": 1}, TypeError),
    ],
    ids=["sinks-shape", "sinks-int", "sinks-list", "lse-int"],
)
def test_bad_arguments(kwargs, error):
    q, k, v, _ = _inputs(b=1, hq=2, hkv=2, lq=4, lk=4)
    with pytest.raises(error):
        attention(q, k, v, **kwargs)
