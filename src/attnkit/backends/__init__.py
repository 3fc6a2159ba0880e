"""Attention backends: one registry, one signature.

A backend is a function ``fn(call: AttentionCall) -> (context, weights | None, lse | None)``
(a 2-tuple ``(context, weights)`` is accepted too and read as ``lse = None``)
plus a ``supports(call) -> str | None`` check that returns *why* it cannot honour
a call (or None when it can). :func:`dispatch` never lets a backend drop part
of a request: an explicitly named backend that cannot honour it raises, and
``"auto"`` picks the first backend in :data:`AUTO_ORDER` that can.

The registry itself lives in :mod:`attnkit.backends.registry`; this package re-exports it
and imports the built-in backends, which register themselves.
"""

from __future__ import annotations

from attnkit.backends.registry import (
    AUTO_ORDER,
    CUDA_KERNEL,
    AttentionCall,
    Backend,
    BackendResult,
    auto_order,
    available_backends,
    dispatch,
    generation,
    get_backend,
    is_sparse,
    register_backend,
    run,
    select,
)

__all__ = [
    "AUTO_ORDER",
    "CUDA_KERNEL",
    "AttentionCall",
    "Backend",
    "BackendResult",
    "auto_order",
    "available_backends",
    "dispatch",
    "generation",
    "get_backend",
    "is_sparse",
    "register_backend",
    "run",
    "select",
]

# Built-in backends register themselves on import (after the registry is complete).
from attnkit.backends import blockwise as _blockwise  # noqa: F401
from attnkit.backends import reference as _reference  # noqa: F401
from attnkit.backends import sdpa as _sdpa  # noqa: F401
from attnkit.backends import triton as _triton  # noqa: F401


def __getattr__(name: str):
    """``explain_dispatch``: :func:`attnkit.attention.explain_dispatch`, reachable here too
    (the functional core builds the call it explains, so it lives there)."""
    if name == "explain_dispatch":
        from attnkit.attention import explain_dispatch

        return explain_dispatch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
