"""The block mask of a plain ``mask_mod=``: built once per mod, shapes and captured state.

A call with ``mask_mod=`` (no block mask of its own) is planned through a
:class:`~attnkit.block_mask.BlockMask` built from the mod; :func:`cached_block_mask`
keeps it, keyed weakly on the mod object and on everything its result may depend on
(what the mod captures, at its current version), so a repeated call does no
``O(Q_LEN x KV_LEN)`` mask work and a mutated capture never reuses a stale mask.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnkit.block_mask import BlockMask, create_block_mask

__all__ = ["cached_block_mask"]


_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, BlockMask]] = weakref.WeakKeyDictionary()
_PER_MOD = 8  # block masks kept per mod (shapes, offsets)


class _OffsetMod:
    """``mod`` seen at global positions: query row ``i`` is ``q_offset + i``, key ``j`` is
    ``k_offset + j`` (a context-parallel segment's mask)."""

    def __init__(self, mod: Callable[..., Any], q_offset: int, k_offset: int) -> None:
        self.mod, self.q_offset, self.k_offset = mod, q_offset, k_offset
        self.grid = getattr(mod, "grid", False)
        self.__name__ = getattr(mod, "__name__", repr(mod))

    def __call__(self, b, h, q, kv):
        return self.mod(b, h, q + self.q_offset, kv + self.k_offset)


class _Uncacheable(Exception):
    """A mod captures something whose state cannot be keyed: it is not cached."""


class _TensorRef:
    """A cache-key part for a captured tensor: equal only to the *same* live tensor at the
    same version (an id alone could be reused by a new tensor after the old one died)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.ref, self.version, self.id = weakref.ref(t), t._version, id(t)

    def __hash__(self) -> int:
        return hash((self.id, self.version))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _TensorRef):
            return NotImplemented
        mine = self.ref()
        return mine is not None and mine is other.ref() and self.version == other.version


def _state(obj: Any, depth: int = 0, seen: set[int] | None = None) -> tuple:
    """What a mod's result may depend on besides its indices: the values and versions of
    what it captures (closure cells, globals it names, partial arguments, a bound
    method's object, attributes, containers), so that mutating any of them misses the
    cache instead of reusing a stale mask.

    Raises:
        _Uncacheable: for a captured object it cannot describe (e.g. a large array).
    """
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return ("T", _TensorRef(obj))
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return ("V", obj)
    if isinstance(obj, np.ndarray):
        if obj.size > 1 << 16:
            raise _Uncacheable
        return ("A", obj.dtype.str, obj.shape, obj.tobytes())
    if id(obj) in seen or depth > 6:
        raise _Uncacheable  # a cycle or a deep structure: not keyed, rebuilt every call
    seen.add(id(obj))  # the objects on the current path: a cycle is not keyed
    try:
        return _walk(obj, depth, seen)
    finally:
        seen.discard(id(obj))


def _walk(obj: Any, depth: int, seen: set[int]) -> tuple:
    container = isinstance(obj, (list, tuple, set, frozenset, dict))
    # containers are compared by content (some are built here); anything else also by
    # identity, which is stable while the mod (the cache's weak key) keeps it alive
    parts: list[Any] = [type(obj).__qualname__] if container else [type(obj).__qualname__, id(obj)]
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        parts += [_state(x, depth + 1, seen) for x in items]
    elif isinstance(obj, dict):
        parts += [(repr(k), _state(v, depth + 1, seen)) for k, v in obj.items()]
    elif isinstance(obj, functools.partial):
        parts += [
            _state(obj.func, depth + 1, seen),
            _state(obj.args, depth + 1, seen),
            _state(obj.keywords, depth + 1, seen),
        ]
    elif isinstance(obj, types.MethodType):
        parts += [_state(obj.__func__, depth + 1, seen), _state(obj.__self__, depth + 1, seen)]
    elif isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        names = {n: obj.__globals__[n] for n in obj.__code__.co_names if n in obj.__globals__}
        names = {n: v for n, v in names.items() if not isinstance(v, types.ModuleType)}
        parts += [_state(cells, depth + 1, seen), _state(names, depth + 1, seen)]
        parts += [_state(obj.__defaults__, depth + 1, seen)]
    elif isinstance(obj, (type, types.ModuleType, types.BuiltinFunctionType)):
        pass
    elif hasattr(obj, "__dict__"):
        parts += [_state(vars(obj), depth + 1, seen)]
    else:
        raise _Uncacheable
    return tuple(parts)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def cached_block_mask(
    mask_mod: Callable[..., Any],
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int,
    *,
    device: torch.device,
    block_size: int = 128,
    q_offset: int = 0,
    k_offset: int = 0,
) -> BlockMask:
    """The block mask of a plain ``mask_mod=`` call, built once and then reused.

    Keyed on the mod object (weakly: it goes when the mod goes), the shapes, the device,
    the offsets, and the state the mod captures (see :func:`_state`): a repeated call does
    no ``O(Q_LEN x KV_LEN)`` mask work. A mod that cannot be weakly referenced is
    rebuilt every call.
    """
    mod = mask_mod if not (q_offset or k_offset) else _OffsetMod(mask_mod, q_offset, k_offset)
    try:
        state = _state(mask_mod)
        per_mod = _CACHE.setdefault(mask_mod, {})
    except (_Uncacheable, TypeError):  # state not describable, or no weak reference
        return create_block_mask(mod, B, H, Q_LEN, KV_LEN, block_size=block_size, device=device)
    key = (B, H, Q_LEN, KV_LEN, str(device), block_size, q_offset, k_offset, state)
    hit = per_mod.get(key)
    if hit is not None:
        return hit
    bm = create_block_mask(mod, B, H, Q_LEN, KV_LEN, block_size=block_size, device=device)
    if len(per_mod) >= _PER_MOD:
        per_mod.pop(next(iter(per_mod)))
    per_mod[key] = bm
    return bm
