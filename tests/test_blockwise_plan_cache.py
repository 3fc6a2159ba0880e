"""The blockwise plan cache (backends/blockwise/plan_cache.py): a repeated call reuses its
plan, and a call that differs in anything planning reads never gets another call's plan.

A stale plan is a silent wrong answer, so each test changes one thing the decision
depends on (sizes, options, the mask, grad mode, threads, environment variables, the
calibration, the tile-size and row-bound knobs) and checks that the cached path decides
exactly as a fresh plan does, and that the answer matches a float64 reference."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention, create_block_mask, explain_dispatch
from attnkit import masks as M
from attnkit.attention import _make_call
from attnkit.backends.blockwise import _plan, plan_cache
from attnkit.backends.blockwise import native as native_module
from attnkit.backends.blockwise import plan as plan_module
from attnkit.backends.blockwise.native import build, calibrate
from attnkit.backends.blockwise.plan import NATIVE_CPU
from tests.reference import ref_attention_lse

needs_native = pytest.mark.skipif(not native_module.available(), reason="no native kernel")

_CALL_DEFAULTS = {
    "mask": None, "causal": False, "scale": None, "dropout_p": 0.0, "need_weights": False,
    "window": None, "mask_mod": None, "score_mod": None, "block_mask": None, "sinks": None,
    "return_lse": False, "backend": "blockwise",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_cache():
    plan_cache.clear()
    yield
    plan_cache.clear()


def _decode(keys: int = 320, heads: int = 8, kv_heads: int = 2, dtype=torch.float32):
    """A decode step: q (1, heads, 1, 64), k/v (1, kv_heads, keys, 64)."""
    q = torch.randn(1, heads, 1, 64).to(dtype)
    k, v = (torch.randn(1, kv_heads, keys, 64).to(dtype) for _ in range(2))
    return q, k, v


def _call(q, k, v, **kwargs):
    call, _ = _make_call(q, k, v, **{**_CALL_DEFAULTS, **kwargs})
    return call


def _fresh_explain(q, k, v, **kwargs) -> str:
    """explain_dispatch with nothing cached (what the cache must agree with)."""
    plan_cache.clear()
    return explain_dispatch(q, k, v, **kwargs)


def _check_against_reference(q, k, v, out, keep=None):
    ref, _ = ref_attention_lse(q, k, v, keep=keep)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_a_repeated_call_is_planned_once():
    q, k, v = _decode()
    out = attention(q, k, v, backend="blockwise")
    assert plan_cache.size() == 1
    first = _plan(_call(q, k, v), NATIVE_CPU)
    # new tensors of the same sizes: the same plan object, and the right answer
    q2, k2, v2 = _decode()
    second = _plan(_call(q2, k2, v2), NATIVE_CPU)
    assert second is first
    assert plan_cache.size() == 1
    _check_against_reference(q, k, v, out)
    _check_against_reference(q2, k2, v2, attention(q2, k2, v2, backend="blockwise"))


def test_explain_reads_the_same_from_a_cached_plan():
    q, k, v = _decode()
    fresh = _fresh_explain(q, k, v, backend="blockwise")
    attention(q, k, v, backend="blockwise")  # cached now
    assert explain_dispatch(q, k, v, backend="blockwise") == fresh
    assert plan_cache.size() == 1


@pytest.mark.parametrize(
    "change",
    [
        {"keys": 321},
        {"heads": 4},
        {"kv_heads": 1},
        {"dtype": torch.bfloat16},
        {"causal": True},
        {"causal": "top_left"},
        {"window": 64},
        {"scale": 0.5},
        {"return_lse": True},
    ],
    ids=str,
)
def test_each_call_option_is_its_own_key(change):
    shape_keys = {"keys", "heads", "kv_heads", "dtype"}
    q, k, v = _decode()
    attention(q, k, v, backend="blockwise")
    q2, k2, v2 = _decode(**{n: x for n, x in change.items() if n in shape_keys})
    options = {n: x for n, x in change.items() if n not in shape_keys}
    before = plan_cache.key(_call(q, k, v), NATIVE_CPU)
    after = plan_cache.key(_call(q2, k2, v2, **options), NATIVE_CPU)
    if change == {"causal": True}:  # a decode step's causal=True masks nothing: dropped
        assert after == before
    elif change != {"return_lse": True}:  # (the LSE is not the plan's business)
        assert after != before
    cached = explain_dispatch(q2, k2, v2, backend="blockwise", **options)
    assert cached == _fresh_explain(q2, k2, v2, backend="blockwise", **options)


def test_a_mask_of_the_same_shape_brings_its_own_values():
    """The plan is shared between two masks of one shape; each call reads its own mask."""
    q, k, v = _decode(keys=96)
    masks = [torch.rand(1, 1, 1, 96) > p for p in (0.3, 0.7)]
    for mask in masks:
        out = attention(q, k, v, mask=mask, backend="blockwise")
        _check_against_reference(q, k, v, out, keep=mask)
    assert plan_cache.size() == 1
    # the kept plan holds no mask tensor (a hit carries the call's own)
    ((kept, _),) = plan_cache._plans.values()
    assert kept.mask is None
    # another shape of mask is another key
    mask = torch.rand(96) > 0.5
    out = attention(q, k, v, mask=mask, backend="blockwise")
    _check_against_reference(q, k, v, out, keep=mask)
    assert plan_cache.size() == 2


def test_grad_mode_and_requires_grad_are_keys():
    q, k, v = _decode()
    keys = set()
    with torch.no_grad():
        keys.add(plan_cache.key(_call(q, k, v), NATIVE_CPU))
    keys.add(plan_cache.key(_call(q, k, v), NATIVE_CPU))
    qg = q.clone().requires_grad_()
    keys.add(plan_cache.key(_call(qg, k, v), NATIVE_CPU))
    assert len(keys) == 3
    # and a gradient through a cached plan is right
    attention(qg, k, v, backend="blockwise")
    out = attention(qg, k, v, backend="blockwise")
    out.sum().backward()
    q64 = q.double().requires_grad_()
    ref, _ = ref_attention_lse(q64, k, v)
    ref.sum().backward()
    torch.testing.assert_close(qg.grad.double(), q64.grad, atol=2e-5, rtol=2e-5)


def test_thread_count_is_a_key():
    q, k, v = _decode()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = plan_cache.key(_call(q, k, v), NATIVE_CPU)
        torch.set_num_threads(2)
        two = plan_cache.key(_call(q, k, v), NATIVE_CPU)
    finally:
        torch.set_num_threads(before)
    assert one != two


@needs_native
def test_the_speed_variable_is_seen_at_once(monkeypatch):
    """ATTNKIT_NATIVE_SPEED=slow turns the native kernel away from a dense decode step;
    the plan cached under =fast must not answer for it."""
    q, k, v = _decode()
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "fast")
    fast = explain_dispatch(q, k, v, backend="blockwise")
    assert "forward: native_cpu" in fast.splitlines()
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "slow")
    slow = explain_dispatch(q, k, v, backend="blockwise")
    assert "forward: native_cpu" not in slow.splitlines()
    assert slow == _fresh_explain(q, k, v, backend="blockwise")
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "fast")
    assert explain_dispatch(q, k, v, backend="blockwise") == fast


@needs_native
def test_the_isa_variable_is_seen_at_once(monkeypatch):
    """A build that cannot be loaded (here: an unknown ATTNKIT_NATIVE_ISA) takes the
    native kernel out of the plan at once, with its reason."""
    q, k, v = _decode()
    attention(q, k, v, backend="blockwise")
    monkeypatch.setenv("ATTNKIT_NATIVE_ISA", "no-such-isa")
    monkeypatch.setattr(build, "_warned", set())  # (warned once per process and reason)
    with pytest.warns(RuntimeWarning):
        explained = explain_dispatch(q, k, v, backend="blockwise")
    assert "no-such-isa" in explained
    assert "forward: native_cpu" not in explained.splitlines()
    out = attention(q, k, v, backend="blockwise")
    _check_against_reference(q, k, v, out)


def test_the_native_variable_is_a_key(monkeypatch):
    q, k, v = _decode()
    on = plan_cache.key(_call(q, k, v), NATIVE_CPU)
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    assert plan_cache.key(_call(q, k, v), NATIVE_CPU) != on


@needs_native
def test_calibration_and_row_bounds_are_seen(monkeypatch):
    """A measured speed (not forced) keeps a short dense plan (up to native.few_rows() query
    rows per kv head) on torch's kernel: a new calibration, or a new bound, is a new
    decision."""
    rows = native_module.few_rows()  # this build's bound (12 at 16 floats, 48 at 8)
    assert rows > native_module.DIRECT_ROWS  # more than a decode step's rows
    q = torch.randn(1, 2, rows, 64)
    k, v = torch.randn(1, 2, 512, 64), torch.randn(1, 2, 512, 64)
    measured = calibrate.Speed(0.5, 0.5, "measured")
    monkeypatch.setattr(calibrate, "speed", lambda dtype=None, keys=None, bias=False: measured)
    short = explain_dispatch(q, k, v, backend="blockwise")
    assert "forward: flash_cpu" in short.splitlines()[1]
    lower = native_module.DIRECT_ROWS
    monkeypatch.setattr(native_module, "FEW_ROWS", {16: lower, 8: lower, 4: lower})
    assert explain_dispatch(q, k, v, backend="blockwise").splitlines()[1] == "forward: native_cpu"
    # the calibration read through its own cache: a slower measurement added to it
    monkeypatch.undo()
    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED")
    q, k, v = _decode(keys=4096)
    cache_key = calibrate.cache_key(torch.float32, 4096)
    monkeypatch.setattr(calibrate, "_cache", {cache_key: calibrate.Speed(0.5, 0.5, "cached")})
    assert explain_dispatch(q, k, v, backend="blockwise").splitlines()[1] == "forward: native_cpu"
    monkeypatch.setattr(calibrate, "_cache", {cache_key: calibrate.Speed(2.0, 2.0, "cached")})
    slower = explain_dispatch(q, k, v, backend="blockwise")
    assert "slower than torch's kernel" in slower
    assert slower == _fresh_explain(q, k, v, backend="blockwise")


def test_tile_sizes_are_seen(monkeypatch):
    q, k, v = _decode(keys=300)
    call = _call(q, k, v, causal=True)
    assert _plan(call, NATIVE_CPU).block_k == 300
    monkeypatch.setattr(plan_module, "BLOCK_K", 64)
    assert _plan(_call(q, k, v, causal=True), NATIVE_CPU).block_k == 64
    out = attention(q, k, v, causal=True, backend="blockwise-flash")
    _check_against_reference(q, k, v, out)


def test_calls_with_mods_or_block_masks_are_not_cached():
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    attention(q, k, v, score_mod=M.alibi(2), backend="blockwise")
    attention(q, k, v, mask_mod=M.causal("top_left"), backend="blockwise")
    attention(
        q,
        k,
        v,
        block_mask=create_block_mask(M.causal("top_left"), 1, 2, 40, 40, block_size=16),
        backend="blockwise",
    )
    assert plan_cache.size() == 0


def test_no_cache_while_calibrating(monkeypatch):
    q, k, v = _decode()
    monkeypatch.setattr(calibrate._measuring, "on", True, raising=False)
    assert plan_cache.key(_call(q, k, v), NATIVE_CPU) is None


def test_the_cache_is_bounded_and_keeps_the_latest(monkeypatch):
    monkeypatch.setattr(plan_cache, "MAX_PLANS", 4)
    for keys in range(100, 110):
        q, k, v = _decode(keys=keys)
        attention(q, k, v, backend="blockwise")
    assert plan_cache.size() == 4
    latest = plan_cache.key(_call(*_decode(keys=109)), NATIVE_CPU)
    oldest = plan_cache.key(_call(*_decode(keys=100)), NATIVE_CPU)
    assert latest in plan_cache._plans
    assert oldest not in plan_cache._plans
