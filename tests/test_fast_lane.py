"""The fast lane (``backends/fast_lane.py``): a plain call ``auto`` sent to SDPA, or one
``auto`` or ``backend="blockwise"`` ran on the native kernel's forward, goes straight there
the next time, with the same numbers, and nothing else does."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention, backends, trace
from attnkit.backends import fast_lane, registry
from attnkit.backends.blockwise import native
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


def _lane(q, k, v, causal, backend="auto"):
    return fast_lane.key(q, k, v, causal, backend, plain=True), q, k, v


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
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "slow")  # (SDPA's lane: no decode on the kernel)
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
    # (one key: the bottom-right call's, never SDPA's lane (SDPA draws it as a mask;
    # auto runs it on the native kernel where there is one); nothing else was asked)
    [kept] = fast_lane._kept.values()
    assert kept is None or type(kept).__name__ == "_Native"
    fast_lane.clear()
    q, k, v = _qkv(t=12, s=32)  # (more rows than a decode step: auto sends it to SDPA)
    with torch.no_grad():
        attention(q, k, v, causal=True)
        assert list(fast_lane._kept.values()) == [None]
        assert fast_lane.run(*_lane(q, k, v, True)) is None


def test_a_new_registration_grad_or_native_setting_is_a_new_key(monkeypatch):
    q, k, v = _qkv()

    def lane_key():
        with torch.no_grad():
            return fast_lane.key(q, k, v, True, "auto", plain=True)

    with torch.no_grad():
        attention(q, k, v, causal=True)
    remembered = lane_key()
    assert remembered is not None and remembered in fast_lane._kept
    q.requires_grad_(True)
    assert fast_lane.key(q, k, v, True, "auto", plain=True) != remembered  # a gradient is wanted
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


needs_native = pytest.mark.skipif(not native.available(), reason="no native kernel")


@needs_native
@pytest.mark.parametrize(
    "backend, dtype, shape",
    [
        ("auto", torch.bfloat16, dict(h=4, h_kv=2, t=1, s=300)),  # auto: native at a bf16 step
        ("blockwise", torch.float32, dict(t=1, s=77)),
        ("blockwise", torch.float32, dict(t=37, s=37)),  # (not a decode step: any forward)
        ("blockwise", torch.bfloat16, dict(h=2, h_kv=2, t=3, s=200, d=32)),
    ],
)
def test_the_native_lane_gives_the_full_paths_numbers(monkeypatch, backend, dtype, shape):
    q, k, v = (x.to(dtype) for x in _qkv(seed=3, **shape))
    with torch.no_grad():
        first = attention(q, k, v, causal=True, backend=backend)  # the full path
        kept = list(fast_lane._kept.values())
        assert len(kept) == 1 and type(kept[0]).__name__ == "_Native"
        with monkeypatch.context() as m:
            _full_path_refused(m)
            second = attention(q, k, v, causal=True, backend=backend)  # the lane
            strided = attention(  # (strides are not in the key: the same plan reads them)
                q.transpose(-2, -1).contiguous().transpose(-2, -1), k, v, causal=True,
                backend=backend,
            )  # fmt: skip
    assert second.dtype == dtype and torch.equal(first, second) and torch.equal(first, strided)
    # expanded keys and values (stride 0 over the batch and the heads): the same key, so
    # the lane; its numbers those of the full path and of float64
    k1, v1 = k[:1, :1].expand_as(k), v[:1, :1].expand_as(v)
    with torch.no_grad():
        with monkeypatch.context() as m:
            _full_path_refused(m)
            expanded = attention(q, k1, v1, causal=True, backend=backend)
        fast_lane.clear()
        full = attention(q, k1, v1, causal=True, backend=backend)
    assert torch.equal(expanded, full)
    ref1 = ref_attention(q.double(), k1.double(), v1.double(), causal="bottom_right")[0]
    plain1 = attention(q, k1, v1, causal=True, backend="reference")
    err1 = (expanded.double() - ref1).abs().max().item()
    assert err1 <= 2 * (plain1.double() - ref1).abs().max().item() + 1e-6
    ref = ref_attention(q.double(), k.double(), v.double(), causal="bottom_right")[0]
    plain = attention(q, k, v, causal=True, backend="reference")
    err = (second.double() - ref).abs().max().item()
    assert err <= 2 * (plain.double() - ref).abs().max().item() + 1e-6


@needs_native
def test_the_native_lane_takes_no_call_wanting_a_gradient():
    q, k, v = _qkv(t=1, s=64, requires_grad=True)
    for _ in range(2):
        out = attention(q, k, v, causal=True, backend="blockwise")
    assert list(fast_lane._kept.values()) == [None]  # remembered as not taken
    out.sum().backward()  # (the second call recorded its graph: the full path)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_attention(qd, kd, vd, causal="bottom_right")[0].sum().backward()
    qf, kf, vf = (x.detach().clone().requires_grad_() for x in (q, k, v))
    attention(qf, kf, vf, causal=True, backend="reference").sum().backward()
    for ours, plain, ref in ((q, qf, qd), (k, kf, kd), (v, vf, vd)):
        err = (ours.grad.double() - ref.grad).abs().max().item()
        assert err <= 2 * (plain.grad.double() - ref.grad).abs().max().item() + 1e-6
    with torch.no_grad():  # a new key (grad mode): now taken
        attention(q, k, v, causal=True, backend="blockwise")
    assert sum(type(x).__name__ == "_Native" for x in fast_lane._kept.values()) == 1


@needs_native
def test_blockwise_calls_the_lane_does_not_take():
    q, k, v = _qkv(t=1, s=64)
    with torch.no_grad():
        attention(q, k, v, mask=torch.ones(1, 64, dtype=torch.bool), backend="blockwise")
        attention(q, k, v, window=8, backend="blockwise")
        attention(q, k, v, backend="blockwise-flash")  # (another blockwise backend)
        attention(q, k, v, return_lse=True, backend="blockwise")
    assert fast_lane._kept == {}


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_lane_reuses_its_arguments_only_for_the_same_strides(monkeypatch, dtype):
    """A kept native call keeps the kernel's arguments for the strides it ran with; a call
    of the same key and strides only repoints a copy at its tensors (no `_args`), one of
    other strides (keys laid out (b, s, h, d), the same shape) builds them anew: each the
    full path's bits and float64's numbers by flash-attn's rule."""
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "fast")
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 1, 64, generator=gen).to(dtype)
    k = torch.randn(1, 4, 300, 64, generator=gen).to(dtype)
    v = torch.randn(1, 4, 300, 64, generator=gen).to(dtype)
    k_t = torch.randn(1, 300, 4, 64, generator=gen).to(dtype).transpose(1, 2)  # other strides
    v_t = torch.randn(1, 300, 4, 64, generator=gen).to(dtype).transpose(1, 2)
    with torch.no_grad():
        attention(q, k, v, backend="blockwise")  # the full path, remembered
        [kept] = fast_lane._kept.values()
        outs = {}
        for name, (kk, vv) in {"first": (k, v), "other": (k_t, v_t), "again": (k_t, v_t)}.items():
            with monkeypatch.context() as m:
                _full_path_refused(m)
                if name == "again":  # the strides just kept: no arguments built
                    m.setattr(native, "_args", _refuse)
                outs[name] = attention(q, kk, vv, backend="blockwise")
            assert kept.kept[0][0][:3] == (q.stride(), kk.stride(), vv.stride())
        fast_lane.clear()
        full = {"first": attention(q, k, v, backend="blockwise")}
        fast_lane.clear()
        full["other"] = full["again"] = attention(q, k_t, v_t, backend="blockwise")
    for name, out in outs.items():
        kk, vv = (k, v) if name == "first" else (k_t, v_t)
        assert torch.equal(out, full[name]), name
        ref = ref_attention(q.double(), kk.double(), vv.double())[0]
        plain = attention(q, kk, vv, backend="reference")
        err = (out.double() - ref).abs().max().item()
        assert err <= 2 * (plain.double() - ref).abs().max().item() + 1e-6, name


def _refuse(*args, **kwargs):
    raise AssertionError("the kernel's arguments were built anew")


@needs_native
def test_a_kept_entry_is_read_once_so_another_threads_replacement_cannot_mix_in(monkeypatch):
    """Another thread may replace a lane's kept arguments between two reads of them (a
    call of the same key with other strides). Each call reads the entry once: here the
    entry is swapped for the other layout's right after the call's first read (as such a
    thread would), and the call still runs its own layout's arguments: its full path's
    bits. (Read twice, it would run the rows-layout tensors with the heads layout's
    strides.)"""
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "fast")
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, 4, 1, 64, generator=gen)
    rows = (torch.randn(1, 4, 200, 64, generator=gen), torch.randn(1, 4, 200, 64))
    heads = tuple(torch.randn(1, 200, 4, 64, generator=gen).transpose(1, 2) for _ in "kv")
    with torch.no_grad():
        want = attention(q, *rows, backend="blockwise")
        fast_lane.clear()
        attention(q, *heads, backend="blockwise")  # the full path: the key kept
        attention(q, *heads, backend="blockwise")  # the heads layout's arguments kept
        [native_call] = fast_lane._kept.values()
        heads_entry = native_call.kept[0]
        attention(q, *rows, backend="blockwise")  # the rows layout's, replacing them
        rows_entry = native_call.kept[0]

        class Swapped(list):  # its first read returns the rows entry, then holds the heads one
            def __getitem__(self, i):
                got = super().__getitem__(i)
                super().__setitem__(0, heads_entry)
                return got

        object.__setattr__(native_call, "kept", Swapped([rows_entry]))  # (a frozen dataclass)
        got = attention(q, *rows, backend="blockwise")
    assert torch.equal(got, want)
