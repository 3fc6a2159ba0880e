"""A bounded cache of blockwise plans: a call repeated with the same sizes and options (a
decode step, layer after layer and token after token) is planned once.

Planning a call (:func:`.engines.plan_call`: the tiles, then each engine asked whether it
takes the call, every refusal kept) costs about 12 us of Python, as much as the native
kernel spends on a short decode step. The plan is a pure function of what :func:`key`
collects, so a call whose key was seen before reuses that plan, engines and reasons
included (``plan.engines.explain()`` reads the same).

What the key holds (a plan from another key is never handed out):

* the call: the engine asked for; the query's, key's and value's shapes, dtype and
  device; ``scale``, ``causal`` and ``window``; the ``mask``'s shape and dtype (its values
  are this call's own: a cached plan is handed out with this call's mask); grad mode and
  which inputs require grad;
* the process: torch's thread count; ``ATTNKIT_NATIVE``, ``ATTNKIT_NATIVE_SPEED`` and the
  selected ``ATTNKIT_NATIVE_ISA`` build; that build's loaded library and status; the
  native kernel's speed calibration (its cache and the function that reads it); the tile
  sizes of :mod:`.plan`, the native kernel's row bounds and the engines' own checks
  (:func:`_knobs`: every module-level value that planning reads, so that a test or a
  user changing one is seen at once).

Not cached: a call with a ``score_mod``, ``mask_mod`` or ``block_mask`` (its plan depends
on what the mod captures, which :mod:`attnkit.block_mask_cache` and
:mod:`attnkit.mod_graph` already key by value), a call under ``torch.compile``, and the
native kernel's own calibration runs. At most :data:`MAX_PLANS` keys are kept, the least
recently used dropped first; :func:`clear` empties the cache.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

import torch

from attnkit import _env
from attnkit.backends.blockwise import flash_cpu, native
from attnkit.backends.blockwise import plan as plan_module
from attnkit.backends.blockwise.native import build, calibrate
from attnkit.backends.blockwise.plan import TilePlan
from attnkit.backends.registry import AttentionCall

__all__ = ["MAX_PLANS", "clear", "get", "key", "process_key", "put", "size", "with_mask"]

#: The most plans kept (each a few hundred bytes: no tensor is kept with one).
MAX_PLANS = 256

_lock = threading.Lock()
# key -> (plan, the calibration cache it was planned under: held so its id stays unique)
_plans: OrderedDict[tuple, tuple[TilePlan, object]] = OrderedDict()


def _knobs() -> tuple:
    """The module-level values planning reads (tile sizes, row bounds, the engines' checks
    and the torch kernel they wrap); a change to any of them is a new key."""
    p, n, f = plan_module, native, flash_cpu
    return (
        p.BLOCK_Q, p.BLOCK_K, p.FUSED_BLOCK_Q, p.MOD_BLOCK, p.MASK_TILE_ELEMENTS,
        n.DIRECT_ROWS, tuple(n.FEW_ROWS.items()), n.why_not, n.why_not_backward,
        f.why_not, f._FORWARD, f._BACKWARD, calibrate.speed,
        calibrate.TIE, calibrate.CASE, calibrate.LONG_TOKENS,  # tie margin, measured lengths
    )  # fmt: skip


def key(call: AttentionCall, engine: str) -> tuple | None:
    """The cache key of ``call`` planned from ``engine`` down the priority list, or None
    when such a call is not cached (see the module docs)."""
    if call.score_mod is not None or call.mask_mod is not None or call.block_mask is not None:
        return None
    if torch.compiler.is_compiling() or calibrate.measuring():
        return None
    q, k, v, mask = call.query, call.key, call.value, call.mask
    return (
        engine, q.shape, k.shape, v.shape, q.dtype, q.device,
        call.scale, call.causal, call.window,
        None if mask is None else (mask.shape, mask.dtype),
        torch.is_grad_enabled(), q.requires_grad, k.requires_grad, v.requires_grad,
        *process_key(),
    )  # fmt: skip


def process_key() -> tuple:
    """What a key holds of the process (the module docs' second list): a caller keying a
    call of its own (:mod:`attnkit.paged_attention`) adds the call's sizes and options."""
    isa = build.selected_isa()
    return (
        torch.get_num_threads(),
        _env.get("ATTNKIT_NATIVE"), _env.get("ATTNKIT_NATIVE_SPEED"), isa,
        build._state.get(isa or ""),  # (library, status) of that build, None before it
        id(calibrate._cache), len(calibrate._cache),  # a new measurement, or a new cache
        _knobs(),
    )  # fmt: skip


def get(cache_key: tuple, call: AttentionCall | None) -> TilePlan | None:
    """The plan kept under ``cache_key``, carrying ``call``'s own mask (None: a call of no
    mask); None if none."""
    with _lock:
        entry = _plans.get(cache_key)
        if entry is None or entry[1] is not calibrate._cache:
            return None
        _plans.move_to_end(cache_key)
    plan = entry[0]
    return plan if call is None else with_mask(plan, call.mask, call.query.shape)


def with_mask(plan: TilePlan, mask: torch.Tensor | None, q_shape: torch.Size) -> TilePlan:
    """A kept ``plan`` carrying a call's own ``mask`` (kept plans hold none), for a query
    of ``q_shape``; the plan itself where there is no mask."""
    if mask is None:
        return plan
    plan = copy.copy(plan)  # (shares the plan's memo: nothing in it reads mask values)
    plan.mask = plan_module._mask_4d(mask, q_shape, plan.b)
    return plan


def put(cache_key: tuple, plan: TilePlan) -> None:
    """Keep ``plan`` under ``cache_key`` (without its mask tensor: a hit brings its own)."""
    if plan.mask is not None:
        plan = copy.copy(plan)
        plan.mask = None
    with _lock:
        _plans[cache_key] = (plan, calibrate._cache)
        _plans.move_to_end(cache_key)
        while len(_plans) > MAX_PLANS:
            _plans.popitem(last=False)


def clear() -> None:
    """Forget every kept plan."""
    with _lock:
        _plans.clear()


def size() -> int:
    """How many plans are kept."""
    return len(_plans)
