"""Argument checks shared by the whole package: one home per rule.

Every function takes the value and the argument's ``name`` (used in the message) and
returns the value, normalised, or raises ``TypeError`` (wrong type) / ``ValueError``
(right type, bad value). ``bool`` is never accepted where a number is meant.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any, Literal, TypeVar, cast, overload

import torch

__all__ = [
    "ALIGNMENTS",
    "Alignment",
    "broadcasts_to",
    "check_alignment",
    "check_backend",
    "check_bool",
    "check_choice",
    "check_cu_seqlens",
    "check_float",
    "check_float_dtype",
    "check_int",
    "check_max_seqlen",
    "check_optional_int",
    "check_packed_qkv",
    "check_parents",
    "check_positions",
    "check_probability",
    "check_window",
]

#: How a causal (or windowed) mask lines up when the query and key lengths differ.
Alignment = Literal["top_left", "bottom_right"]
ALIGNMENTS: tuple[Alignment, ...] = ("top_left", "bottom_right")

T = TypeVar("T")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(value: Any, name: str, *, minimum: int | None = 1, maximum: int | None = None) -> int:
    """An ``int`` (not ``bool``) in ``[minimum, maximum]``; ``minimum=1`` by default (positive)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_optional_int(
    value: Any, name: str, *, minimum: int | None = 1, maximum: int | None = None
) -> int | None:
    """None, or what :func:`check_int` accepts."""
    return None if value is None else check_int(value, name, minimum=minimum, maximum=maximum)


def check_float(
    value: Any,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
) -> float:
    """A finite real number (int or float, not ``bool``) within the given bounds."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and (value < minimum or (not min_inclusive and value == minimum)):
        bound = ">=" if min_inclusive else ">"
        raise ValueError(f"{name} must be {bound} {minimum}, got {value}")
    if maximum is not None and (value > maximum or (not max_inclusive and value == maximum)):
        bound = "<=" if max_inclusive else "<"
        raise ValueError(f"{name} must be {bound} {maximum}, got {value}")
    return value


def check_float_dtype(value: Any, name: str = "dtype") -> torch.dtype:
    """A floating ``torch.dtype`` (buffers that hold keys, values or weights).

    Raises:
        TypeError: not a ``torch.dtype``, or an integer/bool/complex one.
    """
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype, got {value!r}")
    return value


def check_positions(value: Any, name: str = "input_pos") -> torch.Tensor:
    """Time indices: a non-empty 1-D integer tensor (its values are not read here, so the
    check costs no device sync).

    Raises:
        TypeError: not a tensor, or not of an integer dtype.
        ValueError: not 1-D, or empty.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch.Tensor, got {type(value).__name__}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer time indices, got dtype {value.dtype}")
    if value.dim() != 1 or value.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(value.shape)}")
    return value


def broadcasts_to(shape: Iterable[int], target: Iterable[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to exactly ``target`` (every dim, aligned
    from the right, 1 or ``target``'s; no more dims than ``target``). Plain ints: this
    runs on every masked attention call, where :func:`torch.broadcast_shapes` costs
    about 15 us."""
    shape, target = tuple(shape), tuple(target)
    if len(shape) > len(target):
        return False
    return all(n in (1, m) for n, m in zip(reversed(shape), reversed(target), strict=False))


def check_probability(value: Any, name: str) -> float:
    """A dropout-style probability in ``[0, 1)``."""
    return check_float(value, name, minimum=0.0, maximum=1.0, max_inclusive=False)


def check_bool(value: Any, name: str) -> bool:
    """A real ``bool`` (``"no"`` or ``0`` are refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} ({value!r})")
    return value


def check_backend(name: str) -> str:
    """A backend name: ``"auto"`` or a registered backend, checked when a module is built
    so that a typo surfaces before the first forward.

    Raises:
        ValueError: naming the valid backends, when ``name`` is not one of them.
    """
    if name != "auto":
        # the registry sits above this module (its backends use these checks): import late
        from attnkit.backends.registry import get_backend

        get_backend(name)
    return name


def check_choice(value: T, name: str, choices: Iterable[T]) -> T:
    """One of ``choices``."""
    options = list(choices)
    if value not in options:
        valid = ", ".join(repr(c) for c in options)
        raise ValueError(f"{name} must be one of {valid}; got {value!r}")
    return value


def check_alignment(value: Any, name: str = "alignment") -> Alignment:
    """A causal alignment: ``"top_left"`` or ``"bottom_right"`` (a typo is refused, never
    read as the other one).

    Args:
        value: the alignment given.
        name: the argument's name, for the message.

    Returns:
        ``value``.

    Raises:
        TypeError: not a string.
        ValueError: a string that names no alignment.
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be 'top_left' or 'bottom_right', got {type(value).__name__} ({value!r})"
        )
    if value not in ALIGNMENTS:
        raise ValueError(f"{name} must be 'top_left' or 'bottom_right', got {value!r}")
    return cast(Alignment, value)


@overload
def check_window(value: Any, name: str = ..., *, optional: Literal[False]) -> int: ...


@overload
def check_window(value: Any, name: str = ..., *, optional: bool = ...) -> int | None: ...


def check_window(value: Any, name: str = "window", *, optional: bool = True) -> int | None:
    """A sliding-window size: an int >= 1 (the query itself and ``window - 1`` keys before
    it; 0 would keep nothing), or None (no window) when ``optional``.

    Args:
        value: the window given.
        name: the argument's name, for the message.
        optional: accept None.

    Returns:
        ``value``.

    Raises:
        TypeError: not an int (``bool`` included), or None where a window is required.
        ValueError: an int below 1.
    """
    if value is None and optional:
        return None
    return check_int(value, name, minimum=1)


def check_parents(value: Any, name: str = "parents") -> list[int]:
    """A draft tree's parent array: ``value[i]`` is node ``i``'s parent, ``-1`` for a root.

    Parents precede their children (``-1 <= value[i] < i``), so node 0 is always a root
    and the array describes a forest with no cycle.

    Args:
        value: a non-empty sequence of ints or a 1-D integer tensor.
        name: the argument's name, for the message.

    Returns:
        The parents as a list of ints.

    Raises:
        TypeError: not a sequence of ints / integer tensor (``bool`` is not an int).
        ValueError: empty, not 1-D, or a parent out of range (naming the node).
    """
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer node indices, got dtype {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        parents = [int(p) for p in value.tolist()]
    elif isinstance(value, (list, tuple)):
        if not all(_is_int(p) for p in value):
            bad = next(p for p in value if not _is_int(p))
            raise TypeError(f"{name} must hold ints, got {type(bad).__name__} ({bad!r})")
        parents = [int(p) for p in value]
    else:
        raise TypeError(
            f"{name} must be a list of ints or a 1-D integer tensor, got {type(value).__name__}"
        )
    if not parents:
        raise ValueError(f"{name} is empty: a draft tree needs at least one node")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(
                f"{name}[{i}] = {p}: a parent must come before its child (-1 <= parent < {i}; "
                "-1 marks a root)"
            )
    return parents


def check_cu_seqlens(value: Any, name: str, total: int) -> list[int]:
    """Cumulative sequence lengths of a packed batch (flash-attn's ``cu_seqlens``): a 1-D
    int32/int64 tensor ``[0, l_0, l_0 + l_1, ..., total]`` of at least two entries,
    non-decreasing, starting at 0 and ending at ``total`` (the packed tensor's first dim).
    Returns the offsets as Python ints (read once)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {value.dtype}")
    if value.dim() != 1 or value.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with at least 2 entries (batch + 1), got shape "
            f"{tuple(value.shape)}"
        )
    offsets = [int(x) for x in value.tolist()]
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        if b < a:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i}] = {a} > {name}[{i + 1}] = {b}"
            )
    if offsets[-1] != total:
        raise ValueError(
            f"{name}[-1] ({offsets[-1]}) must equal the packed tensor's total tokens ({total})"
        )
    return offsets


def check_max_seqlen(value: Any, name: str, offsets: list[int]) -> int:
    """``max_seqlen``: None (computed) or an int at least every length of ``offsets``."""
    longest = max((b - a for a, b in itertools.pairwise(offsets)), default=0)
    if value is None:
        return longest
    value = check_int(value, name, minimum=0)
    if value < longest:
        raise ValueError(f"{name} ({value}) is less than the longest sequence ({longest})")
    return value


def check_packed_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Packed ``(total, heads, head_dim)`` query, key and value of a variable-length call:
    float tensors of one dtype and device, key/value heads dividing the query heads."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(
                f"with cu_seqlens, {name} must be packed (total_tokens, heads, head_dim), got "
                f"shape {tuple(t.shape)}"
            )
        if t.dtype != query.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but query has {query.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    if query.shape[-1] != key.shape[-1] or query.shape[-1] == 0 or value.shape[-1] == 0:
        raise ValueError(
            f"query head_dim ({query.shape[-1]}) must equal key head_dim ({key.shape[-1]}) "
            f"and be >= 1, value head_dim >= 1 (got {value.shape[-1]})"
        )
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must agree in tokens and heads, got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    h_q, h_kv = query.shape[1], key.shape[1]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of key/value heads ({h_kv})")
