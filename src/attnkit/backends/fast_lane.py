"""The fast lane of plain calls: a call ``auto`` sent to SDPA, or one that ``auto`` or
``backend="blockwise"`` ran on the native kernel's forward, goes straight there the next
time.

A small attention call costs torch's kernel a few microseconds, and :func:`attnkit.attention`
spends about as long again validating it, building the call, asking every backend in
``auto``'s order whether it takes it and translating it for SDPA (at T=32, 4 heads, d=64
on the Xeon of session 27: SDPA alone 14.0 µs, ``auto`` 27.8). A decode step on the native
kernel paid more: at 64 bf16 keys its kernel takes 1.7 µs and ``auto`` 59 µs, where SDPA
takes 5 (session 28).

For the plainest calls (no mask, mod, block mask, window, sinks, dropout, weights or
LSE; the default scale; ``causal`` a bool; 4-D tensors of exact type ``torch.Tensor``;
``backend`` ``"auto"`` or ``"blockwise"``), the outcome of the first call is remembered
under everything it depended on: the backend asked for, the tensors' shapes, dtypes,
devices and ``requires_grad``, grad mode, ``causal``, the registry's backends and the
process state the blockwise plans are keyed by
(:func:`attnkit.backends.blockwise.plan_cache.process_key`: threads, the native build and
its calibration, ``ATTNKIT_NATIVE*``). The lane takes two outcomes:

* SDPA ran the tensors as they came (no mask drawn, nothing copied or rescaled): a call
  of the key runs ``scaled_dot_product_attention`` with the same arguments;
* blockwise ran them on the native kernel's forward with nothing to record for autograd
  (no gradient wanted): a call of the key runs the same plan's forward
  (:func:`attnkit.backends.blockwise.autograd.forward`, what blockwise itself calls) and
  casts to the query's dtype as blockwise does.

Either way the numbers are the ones the full path gives, since the first call's
validation and choice hold for every call of its key. Not taken: ``torch.compile``
tracing, ``attnkit.trace`` recording (``auto`` then runs the reference backend), any
other backend, outcome or call. At most :data:`MAX_KEYS` keys are kept.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

from attnkit import trace
from attnkit.backends import registry
from attnkit.backends.blockwise import blockwise_attention, native, plan_cache, planned
from attnkit.backends.blockwise.autograd import forward as blockwise_forward
from attnkit.backends.blockwise.flash_cpu import native_views
from attnkit.backends.blockwise.plan import NATIVE_CPU, TilePlan
from attnkit.masks import is_top_left_triangle

__all__ = ["MAX_KEYS", "clear", "key", "known", "put", "remember", "run", "signature"]

#: The most call keys remembered (the oldest forgotten first).
MAX_KEYS = 256


@dataclass(frozen=True)
class _Sdpa:
    """SDPA with the arguments the sdpa backend gave it."""

    is_causal: bool
    scale: float
    enable_gqa: bool

    def __call__(self, query: torch.Tensor, key_: torch.Tensor, value: torch.Tensor):
        return F.scaled_dot_product_attention(
            query, key_, value, is_causal=self.is_causal, scale=self.scale,
            enable_gqa=self.enable_gqa,
        )  # fmt: skip  # (b, h, l_q, d_v)


@dataclass(frozen=True)
class _Native:
    """The blockwise forward of ``plan`` (its forward engine the native kernel), cast to
    the query's dtype: what the blockwise backend runs for a call wanting no gradient.

    Where the engine reads the tensors as they come (no copy, cast or reshape), the
    kernel's arguments are kept for their strides (``kept``: one entry ``(strides,
    reuse)``, :func:`attnkit.backends.blockwise.native.forward`'s ``reuse``, replaced
    whole, read once) and a call of the same strides only points a copy of them at its
    own tensors: the same kernel call."""

    plan: TilePlan
    kept: list = field(default_factory=list, compare=False)

    def __call__(self, query: torch.Tensor, key_: torch.Tensor, value: torch.Tensor):
        plan = self.plan
        strides = (query.stride(), key_.stride(), value.stride(), native.KV_SPLITS)
        kept = self.kept[0] if self.kept else None  # (one read: another thread may replace it)
        if kept is not None and kept[0] == strides:
            out, _ = native.forward(plan, query, key_, value, reuse=kept[1], with_lse=False)
        else:
            views = native_views(plan, query, key_, value)
            if views[0] is query and views[1] is key_ and views[2] is value:
                reuse: list = []
                out, _ = native.forward(plan, query, key_, value, reuse=reuse, with_lse=False)
                if reuse:
                    self.kept[:] = [(strides, reuse)]
            else:
                out, _ = blockwise_forward(plan, query, key_, value, None)  # (b, h, l_q, d_v)
        return out if out.dtype == query.dtype else out.to(query.dtype)


#: The backends whose plain calls the lane takes (``backend=`` as given).
BACKENDS = ("auto", "blockwise")

_NO = None  # a key whose call the lane does not take (asked once, then known)
_kept: dict[tuple, _Sdpa | _Native | None] = {}  # (read without the lock: one dict lookup)
_lock = threading.Lock()


def signature(*tensors: object, strides: bool = False) -> tuple | None:
    """Each tensor's shape, dtype and device (and strides, with ``strides``), flat: the
    part of a lane's key that names its tensors (``paged_attention``'s and the cascade's,
    :mod:`attnkit.cascade`; :func:`key` writes the same checks out); None where one is not
    exactly a ``torch.Tensor`` (a subclass may run anything: the full path) or
    ``torch.compile`` is tracing."""
    for x in tensors:
        if type(x) is not torch.Tensor:
            return None
    if torch.compiler.is_compiling():
        return None
    named: list = []  # (flat: a key of nested tuples took longer to hash)
    for x in cast(tuple[torch.Tensor, ...], tensors):
        named += (
            (x.shape, x.stride(), x.dtype, x.device) if strides else (x.shape, x.dtype, x.device)
        )
    return tuple(named)


def key(
    query: object, key_: object, value: object, causal: object, backend: str, *, plain: bool
) -> tuple | None:
    """The lane's key of a call, or None where the lane does not take it (``plain``: the
    caller found every argument but ``backend`` at its default)."""
    if not plain or type(causal) is not bool or backend not in BACKENDS:
        return None
    # (signature()'s checks written out: this key is made on every plain attention() call,
    # and the generic one cost about 1 us more a call on the Xeon of session 29)
    if type(query) is not torch.Tensor or type(key_) is not torch.Tensor:
        return None
    if type(value) is not torch.Tensor or query.dim() != 4:
        return None
    if trace.is_recording() or torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled()
    return (
        query.shape, key_.shape, value.shape, query.dtype, key_.dtype, value.dtype,
        query.device, key_.device, value.device, causal, backend, grad,
        grad and (query.requires_grad or key_.requires_grad or value.requires_grad),
        registry.generation(), plan_cache.process_key(),
    )  # fmt: skip


def run(lane_key: tuple, query: torch.Tensor, key_: torch.Tensor, value: torch.Tensor):
    """The output of a call whose key the lane takes, or None (not taken, or not known
    yet)."""
    kept = _kept.get(lane_key)
    return None if kept is None else kept(query, key_, value)


def remember(
    lane_key: tuple,
    call: registry.AttentionCall,
    backend: registry.Backend,
    query: torch.Tensor,
    key_: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Keep under ``lane_key`` whether the lane takes such calls (``backend`` ran
    ``call``, built from these tensors), and how to run them: the module docs' two
    outcomes."""
    kept: _Sdpa | _Native | None = _NO
    # (not rescaled, no keys dropped or broadcast: the full path's work)
    as_given = call.query is query and call.key is key_ and call.value is value
    if as_given and backend.name == "sdpa" and backend.fn is _sdpa_fn():
        is_causal = call.causal is not None and is_top_left_triangle(
            call.q_len, call.k_len, call.causal
        )
        if call.causal is None or is_causal:  # (a bottom-right triangle: a mask)
            kept = _Sdpa(is_causal, call.scale, call.gqa_groups > 1)
    elif as_given and backend.name == "blockwise" and backend.fn is blockwise_attention:
        plan = planned(call)
        engines = None if plan is None else plan.engines
        wants_grad = torch.is_grad_enabled() and (
            query.requires_grad or key_.requires_grad or value.requires_grad
        )
        if plan is not None and engines is not None and engines.forward == NATIVE_CPU:
            kept = None if wants_grad else _Native(plan)
    put(_kept, lane_key, kept)


def put(store: dict, lane_key: tuple, outcome: object) -> None:
    """``store[lane_key] = outcome`` under the lanes' lock, at most :data:`MAX_KEYS` keys
    kept, the oldest forgotten first (this lane's store, ``paged_attention``'s and the
    cascade's)."""
    with _lock:
        while len(store) >= MAX_KEYS:
            store.pop(next(iter(store)))
        store[lane_key] = outcome


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
