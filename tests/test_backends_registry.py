"""The backend registry (``attnkit.backends.registry``) and its re-export by the package."""

from __future__ import annotations

import pytest
import torch

import attnkit
import attnkit.backends as backends
from attnkit.backends import registry


def test_package_reexports_the_registry():
    for name in registry.__all__:
        assert getattr(backends, name) is getattr(registry, name), name
    assert set(registry.__all__) <= set(backends.__all__)


def test_builtin_backends_register_into_the_registry():
    assert {"reference", "sdpa", "blockwise"} <= set(registry.available_backends())


def test_attention_call_memo_is_per_call_and_not_compared():
    q = torch.randn(1, 2, 3, 4)
    a = registry.AttentionCall(q, q, q, None, None, 0.5, 0.0, False)
    b = registry.AttentionCall(q, q, q, None, None, 0.5, 0.0, False)
    a.memo["plan"] = 1
    assert b.memo == {} and a == b


def test_auto_without_a_backend_names_every_backend_and_its_reason(monkeypatch):
    """Regression: ``auto`` used to raise a bare "no registered attention backend supports
    this call", hiding why each backend refused."""

    def refuse(why):
        return lambda call: why

    table: dict[str, registry.Backend] = {}
    monkeypatch.setattr(registry, "_REGISTRY", table)
    monkeypatch.setattr(registry, "AUTO_ORDER", ["first", "second", "gone"])
    registry.register_backend("first", lambda call: (call.query, None), supports=refuse("no A"))
    registry.register_backend(
        "second", lambda call: (call.query, None), auto_supports=refuse("slower than B")
    )
    q = torch.randn(1, 2, 3, 4)
    call = registry.AttentionCall(q, q, q, None, None, 0.5, 0.0, False)
    with pytest.raises(ValueError) as info:
        registry.select("auto", call)
    msg = str(info.value)
    assert "first: no A" in msg and "second: slower than B" in msg and "gone: not registered" in msg
    assert registry.select("second", call).name == "second"  # its strict check passes


def test_auto_error_reaches_the_caller_of_attention(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"tried sdpa: not registered; blockwise: not registered"):
        attnkit.attention(q, q, q)


@pytest.mark.parametrize("arg", ["fn", "supports", "auto_supports", "auto_first"])
def test_register_backend_refuses_what_is_not_callable(arg):
    from attnkit.backends import available_backends, register_backend

    kwargs = {arg: 3} if arg != "fn" else {}
    fn = 3 if arg == "fn" else (lambda call: None)
    with pytest.raises(TypeError, match=f"register_backend's {arg} must be callable, got 3"):
        register_backend("probe-backend", fn, **kwargs)
    assert "probe-backend" not in available_backends()


def test_a_replaced_call_does_not_inherit_the_memo():
    """AttentionCall.memo holds per-call work (blockwise's plan): a call derived with
    dataclasses.replace (another mask, scale, ...) must start with an empty one, never
    reuse a plan made for other arguments."""
    import dataclasses

    from attnkit.backends import AttentionCall

    q = torch.zeros(1, 1, 2, 4)
    call = AttentionCall(q, q, q, None, None, 1.0, 0.0, False)
    call.memo["plan"] = object()
    other = dataclasses.replace(call, scale=2.0)
    assert other.memo == {} and "plan" in call.memo
    assert call == dataclasses.replace(call)  # the memo is not part of the request
