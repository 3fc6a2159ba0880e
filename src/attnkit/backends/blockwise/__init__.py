"""The ``blockwise`` backend: FlashAttention-style tiles with skipping, mods and an O(t) backward.

It walks tiles of queries against tiles of keys, merges them through their
log-sum-exps and keeps only the output and the log-sum-exp (``O(t)`` per head);
its backward recomputes each tile's weights from the log-sum-exp, so no ``t × s``
tensor is ever saved. Tiles that causal, a sliding window, a block mask, a bool mask
or a ``mask_mod`` leave empty are skipped. Read top-down:

* :mod:`.plan`: the tile plan (all tile sizing, ``tiles()`` with skipping);
* :mod:`.flash_cpu` and :mod:`.torch_tiles`: the two engines behind one interface
  (``forward(plan, q, k, v) -> (out, lse)`` and a backward from the total ``lse``);
  the plan names the engine: the fused CPU engine where it can run the call exactly
  (attnkit's own kernel, :mod:`.native`, forward and backward, where that is built and
  takes the plan, else torch's fused flash kernel), else PyTorch ops (every request,
  any device);
* :mod:`.plan_cache`: plans of repeated calls (decode steps) kept, keyed by all they
  depend on;
* :mod:`.merge`: the one log-sum-exp merge;
* :mod:`.autograd`: the autograd function (sinks merged in, LSE gradients);
* :mod:`.segment`: one segment's forward/backward for context parallelism.

Three backend names: ``"blockwise"`` (the plan picks the engine), ``"blockwise-flash"``
(the fused engine without the native kernel: what a machine without a compiler runs) and
``"blockwise-tiles"`` (always the PyTorch-op engine: what every non-CPU device runs);
the last two are reachable for tests and comparisons.

It hands off (``supports`` returns a reason) rather than drop a request: dropout, a
float mask that requires grad, and weights while gradients are being recorded
(weights, recomputed from the scores and their own log-sum-exp, carry no gradient).
"""

from __future__ import annotations

import dataclasses
import math

import torch

try:  # torch.compiler.disable that imports dynamo on first call, not at attnkit's import
    from torch._compile import _disable_dynamo  # (dynamo's import: 1.6 s, and triton)
except ImportError:  # pragma: no cover - a torch without it: the public form
    _disable_dynamo = torch.compiler.disable

from attnkit.backends.blockwise import native, plan_cache
from attnkit.backends.blockwise.autograd import BlockwiseAttention
from attnkit.backends.blockwise.autograd import forward as blockwise_forward
from attnkit.backends.blockwise.engines import plan_call
from attnkit.backends.blockwise.merge import merge_partials
from attnkit.backends.blockwise.plan import (
    FLASH_CPU,
    NATIVE_CPU,
    TORCH_TILES,
    TilePlan,
)
from attnkit.backends.blockwise.segment import SegmentMask, segment_backward, segment_forward
from attnkit.backends.blockwise.torch_tiles import attention_weights
from attnkit.backends.registry import AttentionCall, BackendResult, is_sparse, register_backend
from attnkit.masks import ScoreMod, is_top_left_triangle
from attnkit.mods import grad_leaves

__all__ = [
    "SegmentMask",
    "blockwise_attention",
    "explain_call",
    "merge_partials",
    "planned",
    "score_mod_tensors",
    "segment_backward",
    "segment_forward",
]


def score_mod_tensors(
    score_mod: ScoreMod | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """The tensors requiring grad that ``score_mod`` depends on, however it reaches them
    (found by probing the mod and walking its autograd graph: :func:`attnkit.mods.grad_leaves`);
    empty when gradients are off."""
    if score_mod is None or not torch.is_grad_enabled():
        return ()
    return grad_leaves(score_mod, dtype, torch.device(device))


def _extra(call: AttentionCall) -> tuple[torch.Tensor, ...]:
    """:func:`score_mod_tensors` of the call, probed once per call (``call.memo``)."""
    if "blockwise-extra" not in call.memo:
        dtype, device = call.query.dtype, call.query.device
        call.memo["blockwise-extra"] = score_mod_tensors(call.score_mod, dtype, device)
    return call.memo["blockwise-extra"]


def _wants_grad(call: AttentionCall) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in (call.query, call.key, call.value)):
        return True
    if call.sinks is not None and call.sinks.requires_grad:
        return True
    return bool(_extra(call))


def _supports(call: AttentionCall) -> str | None:
    if call.dropout_p > 0.0:
        return "blockwise does not implement dropout (use backend='sdpa' or 'reference')"
    if call.mask is not None and call.mask.is_floating_point() and call.mask.requires_grad:
        return "blockwise gives no gradient to a float mask (use backend='reference')"
    try:
        _extra(call)
    except (TypeError, ValueError) as err:
        return str(err)
    if call.need_weights and _wants_grad(call):
        return (
            "weights recomputed from the log-sum-exp carry no gradient; "
            "use backend='reference' or torch.no_grad()"
        )
    return None


def _plan(call: AttentionCall, engine: str) -> TilePlan:
    """The call's plan from ``engine`` down the priority list, built once per call (kept in
    ``call.memo``: ``auto_first`` and the run read the same) and once per repeated call
    (:mod:`.plan_cache`: a decode step's plan is reused token after token)."""
    key = _memo_key(engine)
    if key not in call.memo:
        cache_key = plan_cache.key(call, engine)
        plan = None if cache_key is None else plan_cache.get(cache_key, call)
        if plan is None:
            plan = _new_plan(call, engine)
            if cache_key is not None:
                plan_cache.put(cache_key, plan)
        call.memo[key] = plan
    return call.memo[key]


def planned(call: AttentionCall) -> TilePlan | None:
    """The plan the ``blockwise`` backend made for ``call`` (its run, or ``auto``'s asking),
    or None where it made none."""
    return call.memo.get(_memo_key(NATIVE_CPU))


def _memo_key(engine: str) -> tuple[str, str]:
    return ("blockwise", engine)  # (where call.memo keeps the plan from ``engine`` down)


def _new_plan(call: AttentionCall, engine: str) -> TilePlan:
    return plan_call(
        call.query,
        call.key,
        call.value,
        requested=engine,
        extra=_extra(call),
        scale=call.scale,
        causal=call.causal,
        window=call.window,
        mask=call.mask,
        mask_mod=call.mask_mod,
        score_mod=call.score_mod,
        block_mask=call.block_mask,
    )


def _run(call: AttentionCall, engine: str) -> BackendResult:
    if torch.compiler.is_compiling() and (call.block_mask is not None or call.mask_mod is not None):
        return _run_eagerly(call, engine)
    return _run_plan(call, engine)


def _run_plan(call: AttentionCall, engine: str) -> BackendResult:
    plan = _plan(call, engine)
    if _wants_grad(call):
        out, lse = BlockwiseAttention.apply(
            plan, call.query, call.key, call.value, call.sinks, *_extra(call)
        )
    else:  # nothing to record: the same forward without autograd's own cost
        out, lse = blockwise_forward(plan, call.query, call.key, call.value, call.sinks)
    lead = call.query.shape[:-1]  # (..., h, t)
    if out.dim() != len(lead) + 1:
        out = out.reshape(*lead, call.value.shape[-1])  # (..., h, t, d_v)
    if out.dtype != call.query.dtype:
        out = out.to(call.query.dtype)
    weights = None
    if call.need_weights:
        tiles_plan = dataclasses.replace(plan, engine=TORCH_TILES)
        w = attention_weights(tiles_plan, call.query, call.key, call.sinks)
        weights = w.reshape(*lead, call.k_len)
    lse_out = None
    if call.return_lse:
        lse_out = lse.reshape(lead)
    return out, weights, lse_out


#: A block mask's tiles are data: traced, every branch on them broke the graph and left
#: inductor small fragments of mask code, two of which it failed to compile (torch 2.13:
#: an IndexError in its reduction codegen, a C++ error mixing VecMask<int> and
#: VecMask<float>). Under torch.compile such a call runs eagerly instead, on the native
#: kernel: one graph break.
_run_eagerly = _disable_dynamo(_run_plan)

_ENGINE_OF = {"blockwise": NATIVE_CPU, "blockwise-flash": FLASH_CPU, "blockwise-tiles": TORCH_TILES}


def explain_call(call: AttentionCall, backend: str) -> list[str]:
    """For a blockwise backend, its engines of the call, each direction with why the
    faster engines stood aside (``Engines.explain``); empty for other backends."""
    engine = _ENGINE_OF.get(backend)
    if engine is None:
        return []
    plan = _plan(call, engine)
    engines = plan.engines
    if engines is None:
        return []
    lines = engines.explain().splitlines()
    if plan.block_mask is not None and NATIVE_CPU in (engines.forward, engines.backward):
        lines.append(native.explain_block_mask(plan))
    return lines


def blockwise_attention(call: AttentionCall) -> BackendResult:
    """Compute ``call`` tile by tile (see the module docs); weights recomputed if asked."""
    return _run(call, NATIVE_CPU)


def blockwise_flash_attention(call: AttentionCall) -> BackendResult:
    """:func:`blockwise_attention` on torch's fused kernel, forward and backward (no native
    kernel): the path of a machine without a compiler."""
    return _run(call, FLASH_CPU)


def blockwise_tiles_attention(call: AttentionCall) -> BackendResult:
    """:func:`blockwise_attention` always on the PyTorch-op engine."""
    return _run(call, TORCH_TILES)


#: From this many keys on, a sliding window, a ``mask_mod`` or a block mask sends
#: ``"auto"`` to blockwise first: it skips the empty tiles where sdpa computes a dense mask.
SPARSE_MIN_KEYS = 1024
#: From this many queries and keys on, a CPU call that the native kernel runs goes to
#: blockwise first too, when the native kernel is faster than torch's on this machine
#: (:mod:`.native.calibrate` measures that once per build; a gradient call needs its
#: backward to be faster as well): below these sizes its fixed costs lost to sdpa
#: (1.05-2.4x on a 2-core AMD EPYC).
NATIVE_MIN_QUERIES = 128
NATIVE_MIN_KEYS = 256
NATIVE_MIN_KEYS_MASKED = 512


#: A decode step (at most this many query rows per key/value head) goes to blockwise first
#: where the native kernel runs it: it reads the cache in place and splits it across the
#: threads (split-KV decoding). Where that pays is the kernel's own rule
#: (native.decode_pays: measured against SDPA on this machine, by the step's work).
DECODE_MAX_ROWS = native.DIRECT_ROWS


def _decode_step(call: AttentionCall) -> bool:
    q, k = call.query, call.key
    heads, kv_heads = (q.shape[-3], k.shape[-3]) if q.dim() >= 3 else (1, 1)
    batch = math.prod(q.shape[:-3])  # (the leading dims; 1 for none)
    # (a few queries under a causal triangle SDPA's is_causal cannot draw: a dense mask)
    sdpa_masked = (
        call.causal is not None
        and 1 < call.q_len < call.k_len
        and not is_top_left_triangle(call.q_len, call.k_len, call.causal)
    )
    return (  # (the measured rule last: a call it cannot be never measures)
        call.q_len * (heads // kv_heads) <= DECODE_MAX_ROWS
        and call.query.device.type == "cpu"
        and not call.need_weights
        and not _wants_grad(call)
        and native.decode_pays(
            q.dtype, batch, heads, kv_heads, call.k_len, q.shape[-1], sdpa_masked=sdpa_masked
        )
    )


def _auto_first(call: AttentionCall) -> bool:
    if is_sparse(call) and call.k_len >= SPARSE_MIN_KEYS:
        return True
    if _decode_step(call):  # split-KV decoding on the native kernel, where it runs the call
        engines = _plan(call, NATIVE_CPU).engines
        return engines is not None and engines.forward == NATIVE_CPU
    # (what blockwise cannot run at all, auto_supports refuses after this)
    if (
        call.q_len < NATIVE_MIN_QUERIES
        or call.k_len < (NATIVE_MIN_KEYS if call.mask is None else NATIVE_MIN_KEYS_MASKED)
        or call.query.device.type != "cpu"
        or call.need_weights
    ):
        return False
    engines = _plan(call, NATIVE_CPU).engines
    if engines is None or engines.forward != NATIVE_CPU:
        return False
    return engines.backward == NATIVE_CPU or not _wants_grad(call)


register_backend("blockwise", blockwise_attention, supports=_supports, auto_first=_auto_first)
register_backend("blockwise-flash", blockwise_flash_attention, supports=_supports)
register_backend("blockwise-tiles", blockwise_tiles_attention, supports=_supports)
