"""The kernel's own output buffers (attention.cpp's feature "own out";
``native.forward(with_lse=False)``), once per build this CPU runs: a bf16 call's output
rounded by the kernel has exactly the bits of its float32 output cast by torch
(``.to(torch.bfloat16)``: to nearest even, ties, denormals and infinities included; a NaN
stays NaN), wherever the call takes its rows (a decode step, split keys, query blocks),
and a call without lse gives the same output as one with."""

from __future__ import annotations

import pytest
import torch

from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.plan import NATIVE_CPU, build_plan
from attnkit.paged_attention import paged_attention
from tests.test_paged_kv_cache import _table, _to_pages

pytestmark = pytest.mark.usefixtures("one_thread", "isa")


def _plan(q, k):
    return build_plan(
        q, k, scale=q.shape[-1] ** -0.5, causal=None, window=None, mask=None, mask_mod=None,
        score_mod=None, block_mask=None, engine=NATIVE_CPU,
    )  # fmt: skip


@pytest.mark.parametrize(
    "b, h, h_kv, t, s, d",
    [
        (1, 4, 4, 1, 2, 64),  # a decode step: two keys of equal score, out their mean
        (2, 4, 2, 1, 3000, 32),  # keys split across ranges, merged by lse
        (1, 2, 2, 150, 2, 16),  # query blocks (a prefill)
    ],
)
def test_the_kernels_bf16_output_is_torchs_cast(b, h, h_kv, t, s, d):
    gen = torch.Generator().manual_seed(b * 1000 + t + s)
    q = torch.zeros(b, h, t, d).to(torch.bfloat16)  # equal scores: weights 1/s
    k = torch.randn(b, h_kv, s, d, generator=gen).to(torch.bfloat16)
    # values whose means fall between bf16 numbers: ties (1 and 1 + 2^-7 average to a tie),
    # denormals (the kernel flushes them, as the float32 output shows), huge and infinite values, and plain random ones
    v = torch.randn(b, h_kv, s, d, generator=gen)
    v[..., 0, :8] = torch.tensor([1.0, 1.0078125, 3e-39, -5e-39, 1e38, float("inf"), 1, -2])
    if s > 1:
        v[..., 1, :8] = torch.tensor(
            [1.0078125, 1.0, 1e-39, 7e-39, 1e38, 1.0, 1.0039062, -2.015625]
        )
    v = v.to(torch.bfloat16)
    plan = _plan(q, k)
    with torch.no_grad():
        full, lse = native.forward(plan, q, k, v)  # float32 out, lse
        own, none = native.forward(plan, q, k, v, with_lse=False)
    assert full.dtype == torch.float32 and lse is not None and none is None
    assert own.dtype == torch.bfloat16 and own.shape == full.shape
    want = full.to(torch.bfloat16)
    assert torch.equal(own.view(torch.int16), want.view(torch.int16))
    if s == 2:  # the edge values reached the output: a tie, a huge value, an infinity
        tie, huge, inf = own[..., 0], own[..., 4], own[..., 5]
        assert (tie == 1.0).all() and (full[..., 0] == 1.00390625).all()  # (to even)
        assert (huge.float() / 1e38 - 1).abs().max() < 1e-2 and inf.isinf().all()


def test_a_nan_stays_nan_and_float32_calls_keep_float32():
    q = torch.zeros(1, 2, 1, 16).to(torch.bfloat16)
    k = torch.randn(1, 2, 4, 16).to(torch.bfloat16)
    v = torch.randn(1, 2, 4, 16)
    v[0, 0, 2, 3] = float("nan")
    v = v.to(torch.bfloat16)
    with torch.no_grad():
        own, _ = native.forward(_plan(q, k), q, k, v, with_lse=False)
        full, _ = native.forward(_plan(q, k), q, k, v)
    assert own[0, 0, 0, 3].isnan() and not own.isnan().sum() > 1
    assert torch.equal(own[~own.isnan()], full.to(torch.bfloat16)[~own.isnan()])
    qf, kf, vf = q.float(), k.float(), v.float().nan_to_num()
    with torch.no_grad():
        out, none = native.forward(_plan(qf, kf), qf, kf, vf, with_lse=False)
        want, _ = native.forward(_plan(qf, kf), qf, kf, vf)
    assert out.dtype == torch.float32 and none is None and torch.equal(out, want)


def test_a_paged_bf16_step_rounded_by_the_kernel():
    """The paged lane's calls (``with_lse=False``) give the bits of the paged call with
    lse cast by torch."""
    gen = torch.Generator().manual_seed(4)
    b, h_kv, s, d, page = 2, 2, 70, 32, 16
    q = torch.randn(b, 4, 1, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(b, h_kv, s, d, generator=gen)
    v = torch.randn(b, h_kv, s, d, generator=gen)
    n = b * -(-s // page) + 3
    table = _table(b, s, page, n, gen)
    k_pages = _to_pages(k, table, n, page, gen).to(torch.bfloat16)
    v_pages = _to_pages(v, table, n, page, gen).to(torch.bfloat16)
    plan = _plan(q, k.to(torch.bfloat16))
    with torch.no_grad():
        full, _ = native.forward_paged(plan, q, k_pages, v_pages, table)
        own, none = native.forward_paged(plan, q, k_pages, v_pages, table, with_lse=False)
        via_lane = [paged_attention(q, k_pages, v_pages, table, s) for _ in range(2)]
    want = full.to(torch.bfloat16)
    assert none is None and torch.equal(own, want)
    assert all(torch.equal(x, want) for x in via_lane)
