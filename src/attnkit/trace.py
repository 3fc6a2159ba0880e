"""Recording the intermediates of an attention computation.

attnkit's modules and its reference backend announce each intermediate tensor
(queries, raw scores, weights, context vectors, ...) with :func:`emit`. Nothing
happens unless a :func:`record` block is active: ``emit`` then returns after one
check of a module-level counter, so the hot path pays nothing and
``torch.compile`` sees no graph break.

Recording state is context-local (:mod:`contextvars`): a :func:`record` block sees
only the tensors emitted in its own thread (or asyncio task), a :func:`scope`
renames only its own context's names, and ``backend="auto"`` switches to the
reference backend only in the context that records.

Example:
    >>> import torch, attnkit
    >>> mha = attnkit.MultiHeadAttention(3, 4, context_length=6, dropout=0.0, num_heads=2)
    >>> with attnkit.trace.record() as rec:
    ...     out = mha(torch.rand(6, 3))
    >>> list(rec)[:3]
    ['inputs', 'queries', 'keys']
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

import torch

__all__ = ["Recording", "emit", "is_recording", "record", "scope"]

#: The recordings and the scope path of the current context (thread / asyncio task).
_RECORDINGS: contextvars.ContextVar[tuple[Recording, ...]] = contextvars.ContextVar(
    "attnkit_trace_recordings", default=()
)
_SCOPE: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "attnkit_trace_scope", default=()
)
#: How many record() blocks are open in the whole process, in any context: the
#: fast path. While it is 0, nothing reads a ContextVar (which torch.compile cannot trace).
_ACTIVE = 0
_ACTIVE_LOCK = threading.Lock()


class Recording(dict[str, torch.Tensor]):
    """An ordered mapping ``name -> tensor`` of everything emitted while recording.

    Names are dotted paths: ``"heads.1.weights"`` is the attention weights of the
    second head of a :class:`~attnkit.MultiHeadAttentionWrapper`. Tensors are
    detached copies, so later in-place changes do not alter the record.
    """

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Return ``name -> shape`` for every recorded tensor."""
        return {name: tuple(t.shape) for name, t in self.items()}


def is_recording() -> bool:
    """Return True inside a :func:`record` block of the current thread / context."""
    return bool(_ACTIVE) and bool(_RECORDINGS.get())


def emit(name: str, tensor: torch.Tensor) -> None:
    """Offer ``tensor`` under ``name`` to the active recordings (no-op otherwise)."""
    if not _ACTIVE:
        return
    recordings = _RECORDINGS.get()
    if not recordings:
        return
    key = ".".join([*_SCOPE.get(), name])
    value = tensor.detach().clone()
    for rec in recordings:
        if key in rec:  # a module called twice in one block: keep every call
            n = 1
            while f"{key}#{n}" in rec:
                n += 1
            rec[f"{key}#{n}"] = value
        else:
            rec[key] = value


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Prefix the names emitted inside the block with ``name.``."""
    if not is_recording():
        yield
        return
    token = _SCOPE.set((*_SCOPE.get(), name))
    try:
        yield
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def record() -> Iterator[Recording]:
    """Record every intermediate emitted inside the block.

    While recording, ``backend="auto"`` computes with the reference backend,
    the only one that materialises every step, in this thread (context) only:
    other threads keep their backends and their tensors out of this record. Works under ``torch.no_grad()``.

    Yields:
        A :class:`Recording`, filled as the block runs.
    """
    global _ACTIVE
    rec = Recording()
    token = _RECORDINGS.set((*_RECORDINGS.get(), rec))
    with _ACTIVE_LOCK:
        _ACTIVE += 1
    try:
        yield rec
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE -= 1
        _RECORDINGS.reset(token)
