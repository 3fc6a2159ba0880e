"""The backend registry (``attnkit.backends.registry``) and its re-export by the package."""

from __future__ import annotations

import torch

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
