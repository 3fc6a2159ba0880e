"""Recording the intermediates of an attention computation.

attnkit's modules and its reference backend announce each intermediate tensor
(queries, raw scores, weights, context vectors, ...) with :func:`emit`. Nothing
happens unless a :func:`record` block is active: ``emit`` then returns after one
truthiness check of a module-level list, so the hot path pays nothing and
``torch.compile`` sees no graph break.

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
from collections.abc import Iterator

import torch

__all__ = ["Recording", "emit", "is_recording", "record", "scope"]

_RECORDINGS: list[Recording] = []
_SCOPE: list[str] = []


class Recording(dict):
    """An ordered mapping ``name -> tensor`` of everything emitted while recording.

    Names are dotted paths: ``"heads.1.weights"`` is the attention weights of the
    second head of a :class:`~attnkit.MultiHeadAttentionWrapper`. Tensors are
    detached copies, so later in-place changes do not alter the record.
    """

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Return ``name -> shape`` for every recorded tensor."""
        return {name: tuple(t.shape) for name, t in self.items()}


def is_recording() -> bool:
    """Return True inside a :func:`record` block."""
    return bool(_RECORDINGS)


def emit(name: str, tensor: torch.Tensor) -> None:
    """Offer ``tensor`` under ``name`` to the active recordings (no-op otherwise)."""
    if not _RECORDINGS:
        return
    key = ".".join([*_SCOPE, name])
    value = tensor.detach().clone()
    for rec in _RECORDINGS:
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
    if not _RECORDINGS:
        yield
        return
    _SCOPE.append(name)
    try:
        yield
    finally:
        _SCOPE.pop()


@contextlib.contextmanager
def record() -> Iterator[Recording]:
    """Record every intermediate emitted inside the block.

    While recording, ``backend="auto"`` computes with the reference backend,
    the only one that materialises every step. Works under ``torch.no_grad()``.

    Yields:
        A :class:`Recording`, filled as the block runs.
    """
    rec = Recording()
    _RECORDINGS.append(rec)
    try:
        yield rec
    finally:
        _RECORDINGS.remove(rec)
