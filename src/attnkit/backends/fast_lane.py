"""``backend="auto"``'s fast lane: a plain call that ``auto`` sent to SDPA before goes
straight to it.

A small attention call costs torch's kernel a few microseconds, and :func:`attnkit.attention`
spends about as long again validating it, building the call, asking every backend in
``auto``'s order whether it takes it and translating it for SDPA (at T=32, 4 heads, d=64
on the Xeon of session 27: SDPA alone 14.0 µs, ``auto`` 27.8). For the plainest calls
(no mask, mod, block mask, window, sinks, dropout, weights or LSE; the default scale;
``causal`` a bool; 4-D tensors of exact type ``torch.Tensor``), once ``auto`` has chosen
SDPA and SDPA ran them as they came (no mask drawn, nothing copied or rescaled), the
outcome is remembered under everything it depended on: the tensors' shapes, dtypes,
devices and ``requires_grad``, grad mode, ``causal``, the registry's backends and the
process state the blockwise plans are keyed by
(:func:`attnkit.backends.blockwise.plan_cache.process_key`: threads, the native build and
its calibration, ``ATTNKIT_NATIVE*``). A call with the same key then runs
``scaled_dot_product_attention`` with the same arguments, skipping the rest: the same
numbers, since the first call's validation holds for every call of its key.

Not taken: ``torch.compile`` tracing, ``attnkit.trace`` recording (``auto`` then runs the
reference backend), any other backend or call. At most :data:`MAX_KEYS` keys are kept.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnkit import trace
from attnkit.backends import registry
from attnkit.backends.blockwise import plan_cache
from attnkit.masks import is_top_left_triangle

__all__ = ["MAX_KEYS", "clear", "key", "known", "remember", "run"]

#: The most call keys remembered (the oldest forgotten first).
MAX_KEYS = 256


@dataclass(frozen=True)
class _Sdpa:
    is_causal: bool
    scale: float
    enable_gqa: bool


_NO = None  # a key whose call the lane does not take (asked once, then known)
_kept: dict[tuple, _Sdpa | None] = {}  # (read without the lock: one dict lookup)
_lock = threading.Lock()


def key(query: object, key_: object, value: object, causal: object, *, plain: bool) -> tuple | None:
    """The lane's key of a call, or None where the lane does not take it (``plain``: the
    caller found every other argument at its default)."""
    if not plain or type(causal) is not bool:
        return None
    if type(query) is not torch.Tensor or type(key_) is not torch.Tensor:
        return None
    if type(value) is not torch.Tensor or query.dim() != 4:
        return None
    if trace.is_recording() or torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled()
    return (
        query.shape, key_.shape, value.shape, query.dtype, key_.dtype, value.dtype,
        query.device, key_.device, value.device, causal, grad,
        grad and (query.requires_grad or key_.requires_grad or value.requires_grad),
        registry.generation(), plan_cache.process_key(),
    )  # fmt: skip


def run(lane_key: tuple, query: torch.Tensor, key_: torch.Tensor, value: torch.Tensor):
    """SDPA's output for a key the lane takes, or None (not taken, or not known yet)."""
    sdpa = _kept.get(lane_key)
    if sdpa is None:
        return None
    return F.scaled_dot_product_attention(
        query, key_, value, is_causal=sdpa.is_causal, scale=sdpa.scale, enable_gqa=sdpa.enable_gqa
    )  # (b, h, l_q, d_v)


def remember(
    lane_key: tuple,
    call: registry.AttentionCall,
    backend: registry.Backend,
    query: torch.Tensor,
    key_: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Keep under ``lane_key`` whether the lane takes such calls: where ``auto`` chose
    SDPA (``backend``) and SDPA runs the tensors as given with no mask (the sdpa backend's
    own translation), how to call it."""
    is_causal = call.causal is not None and is_top_left_triangle(
        call.q_len, call.k_len, call.causal
    )
    takes = (
        backend.name == "sdpa"
        and backend.fn is _sdpa_fn()
        # (not rescaled, no keys dropped or broadcast: the full path's work)
        and call.query is query and call.key is key_ and call.value is value
        and (call.causal is None or is_causal)  # (a bottom-right triangle: a mask)
    )  # fmt: skip
    with _lock:
        while len(_kept) >= MAX_KEYS:
            _kept.pop(next(iter(_kept)))
        _kept[lane_key] = _Sdpa(is_causal, call.scale, call.gqa_groups > 1) if takes else _NO


def known(lane_key: tuple) -> bool:
    """Whether :func:`remember` has kept ``lane_key``'s outcome (taken or not)."""
    return lane_key in _kept


def clear() -> None:
    """Forget every remembered call."""
    with _lock:
        _kept.clear()


def _sdpa_fn():
    from attnkit.backends.sdpa import sdpa_attention

    return sdpa_attention
