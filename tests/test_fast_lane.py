"""``auto``'s fast lane (``backends/fast_lane.py``): a plain call ``auto`` sent to SDPA
goes straight there the next time, with the same numbers, and nothing else does."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention, backends, trace
from attnkit.backends import fast_lane, registry
from attnkit.backends.sdpa import sdpa_attention

from .reference import ref_attention


@pytest.fixture(autouse=True)
def _empty_lane():
    fast_lane.clear()
    yield
    fast_lane.clear()


def _qkv(b=1, h=4, h_kv=4, t=32, s=32, d=64, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=gen, **kw)
    k = torch.randn(b, h_kv, s, d, generator=gen, **kw)
    v = torch.randn(b, h_kv, s, d, generator=gen, **kw)
    return q, k, v


def _lane(q, k, v, causal):
    return fast_lane.key(q, k, v, causal, plain=True), q, k, v


def _full_path_refused(monkeypatch):
    """Make the full path raise: a call that still succeeds ran on the lane."""

    def refuse(*args, **kwargs):
        raise AssertionError("the full path ran")

    monkeypatch.setattr(backends, "select", refuse)


@pytest.mark.parametrize(
    "shape, causal",
    [
        (dict(t=32, s=32), True),  # causal self-attention: SDPA's is_causal
        (dict(t=32, s=32), False),
        (dict(t=1, s=40), True),  # a decode step: causal keeps every key
        (dict(h=8, h_kv=2, t=16, s=16), True),  # GQA
        (dict(t=9, s=30), False),
    ],
)
def test_the_lane_gives_the_full_paths_numbers(monkeypatch, shape, causal):
    q, k, v = _qkv(**shape)
    with torch.no_grad():
        first = attention(q, k, v, causal=causal)  # the full path, remembered
        assert len(fast_lane._kept) == 1 and fast_lane.run(*_lane(q, k, v, causal)) is not None
        with monkeypatch.context() as m:
            _full_path_refused(m)
            second = attention(q, k, v, causal=causal)  # the lane
        sdpa = attention(q, k, v, causal=causal, backend="sdpa")
    assert torch.equal(first, second) and torch.equal(second, sdpa)
    ref = ref_attention(q, k, v, causal="bottom_right" if causal else None)[0]
    plain = attention(q, k, v, causal=causal, backend="reference")
    err = (second.double() - ref).abs().max().item()
    assert err <= 2 * (plain.double() - ref).abs().max().item() + 1e-6


def test_gradients_through_the_lane():
    q, k, v = _qkv(t=24, s=24, requires_grad=True)
    attention(q, k, v, causal=True).sum().backward()  # remembered (grad wanted)
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    attention(q, k, v, causal=True).sum().backward()
    assert all(torch.equal(g, x.grad) for g, x in zip(grads, (q, k, v), strict=True))


def test_calls_the_lane_does_not_take(monkeypatch):
    q, k, v = _qkv(t=8, s=32)
    with torch.no_grad():
        # bottom-right causal with fewer queries than keys: SDPA gets a mask
        attention(q, k, v, causal=True)
        mask = torch.ones(8, 32, dtype=torch.bool)
        attention(q, k, v, mask=mask)
        attention(q, k, v, causal="top_left")  # (causal not a bool)
        attention(q, k, v, window=4, causal=True)
        attention(q, k, v, scale=0.5)
        attention(q[0], k[0], v[0])  # 3-D
        attention(torch.nn.Parameter(q), k, v)  # a tensor subclass
        attention(q, k, v, backend="sdpa")
        with trace.record():
            attention(q, k, v)
    # (one key: the bottom-right call's, kept as not taken; nothing else was asked)
    assert list(fast_lane._kept.values()) == [None]
    with torch.no_grad():
        assert fast_lane.run(*_lane(q, k, v, True)) is None


def test_a_new_registration_grad_or_native_setting_is_a_new_key(monkeypatch):
    q, k, v = _qkv()

    def lane_key():
        with torch.no_grad():
            return fast_lane.key(q, k, v, True, plain=True)

    with torch.no_grad():
        attention(q, k, v, causal=True)
    remembered = lane_key()
    assert remembered is not None and remembered in fast_lane._kept
    q.requires_grad_(True)
    assert fast_lane.key(q, k, v, True, plain=True) != remembered  # a gradient is wanted
    q.requires_grad_(False)
    with monkeypatch.context() as m:
        m.setenv("ATTNKIT_NATIVE_SPEED", "slow")  # (the tests run with "fast")
        assert lane_key() != remembered
    assert lane_key() == remembered
    generation = backends.generation()
    backends.register_backend("lane-test", sdpa_attention)  # any registration
    try:
        assert backends.generation() == generation + 1 and lane_key() != remembered
    finally:
        registry._REGISTRY.pop("lane-test")


def test_bad_input_still_raises_on_the_lane():
    q, k, v = _qkv()
    with torch.no_grad():
        attention(q, k, v, causal=True)
        with pytest.raises(ValueError, match="head_dim|d"):
            attention(q, k[..., :32], v, causal=True)  # a new key: the full path's checks
        with pytest.raises(TypeError):
            attention(q, k.double(), v, causal=True)


def test_the_lane_keeps_at_most_max_keys(monkeypatch):
    monkeypatch.setattr(fast_lane, "MAX_KEYS", 3)
    with torch.no_grad():
        for t in range(1, 6):
            q, k, v = _qkv(t=t, s=t, d=16)
            attention(q, k, v)
    assert len(fast_lane._kept) == 3
