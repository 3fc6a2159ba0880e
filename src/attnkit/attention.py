"""The functional core: :func:`attention`, through which every attnkit module computes.

Notation used for tensor shapes:
    - b: batch size (any number of leading dims, or none)
    - h / h_q: query heads; h_kv: key/value heads (h_q must be a multiple of h_kv)
    - t / l_q: query length; s / l_k: key length
    - d: head dimension

Masking follows the one convention documented in :mod:`attnkit.masks`.
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch

from attnkit import backends, trace
from attnkit._validate import (
    broadcasts_to,
    check_bool,
    check_float,
    check_probability,
    check_window,
)
from attnkit.backends import fast_lane
from attnkit.backends.blockwise import explain_call
from attnkit.block_mask import BlockMask
from attnkit.masks import (
    MaskMod,
    ScoreMod,
    causal_keeps_every_key,
    check_mod_sizes,
    keeps_every_key,
    normalize_causal,
    reachable_keys,
    removed_keys,
)
from attnkit.varlen import varlen_attention

__all__ = ["attention", "explain_dispatch"]


# The return type follows need_weights / return_lse (so `attention(q, k, v).shape` type-checks).
@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None = ...,
    causal: bool | str = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    need_weights: Literal[False] = ...,
    window: int | None = ...,
    mask_mod: MaskMod | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
    cu_seqlens_q: torch.Tensor | None = ...,
    cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ...,
    max_seqlen_k: int | None = ...,
) -> torch.Tensor: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None = ...,
    causal: bool | str = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    need_weights: Literal[True],
    window: int | None = ...,
    mask_mod: MaskMod | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
    cu_seqlens_q: torch.Tensor | None = ...,
    cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ...,
    max_seqlen_k: int | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None = ...,
    causal: bool | str = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    need_weights: Literal[False] = ...,
    window: int | None = ...,
    mask_mod: MaskMod | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
    cu_seqlens_q: torch.Tensor | None = ...,
    cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ...,
    max_seqlen_k: int | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None = ...,
    causal: bool | str = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    need_weights: Literal[True],
    window: int | None = ...,
    mask_mod: MaskMod | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
    cu_seqlens_q: torch.Tensor | None = ...,
    cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ...,
    max_seqlen_k: int | None = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None = ...,
    causal: bool | str = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    need_weights: bool = ...,
    window: int | None = ...,
    mask_mod: MaskMod | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: bool = ...,
    backend: str = ...,
    cu_seqlens_q: torch.Tensor | None = ...,
    cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ...,
    max_seqlen_k: int | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool | str = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    window: int | None = None,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention: ``softmax(query @ key^T * scale + mask) @ value``.

    Args:
        query: ``(..., h_q, l_q, d)``; a tensor of rank 2 ``(l_q, d)`` is allowed too.
        key: ``(..., h_kv, l_k, d)``, ``h_kv`` dividing ``h_q`` (GQA; 1 = MQA).
        value: ``(..., h_kv, l_k, d_v)``.
        mask: boolean (True = may attend) or float (added to the scaled scores),
            broadcastable to ``(..., h_q, l_q, l_k)``. See :mod:`attnkit.masks`. A float
            mask is cast to the query's dtype with finite values clamped to its range
            (only ``-inf`` removes a key). Keys it (or causal/window alone) removes for
            every query are zeroed first: a NaN there reaches nothing.
        causal: False, True (= ``"bottom_right"``), ``"bottom_right"`` or ``"top_left"``:
            how the causal triangle lines up when ``l_q != l_k`` (:mod:`attnkit.masks`
            draws both). Combined with ``mask`` when both are given.
        scale: factor applied to the scores; ``1 / sqrt(d)`` by default. Any finite
            number: ``0`` gives uniform weights over the kept keys, a negative one flips
            the scores (honoured exactly on every backend).
        dropout_p: probability of zeroing an attention weight (after softmax), the
            kept ones scaled by ``1 / (1 - dropout_p)``. Modules pass their ``p``
            only in training mode.
        need_weights: also return the attention weights ``(..., h_q, l_q, l_k)``
            (after dropout, i.e. exactly the weights applied to ``value``).
        window: sliding window: each query keeps itself and the ``window - 1`` keys
            before it (aligned as ``causal``; symmetric when not causal).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend), written
            for scalar indices as for FlexAttention (:mod:`attnkit.mods`); needs a 4-D
            ``(b, h, l, d)`` query.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to the
            scaled scores before masking; gradients flow into its tensors.
        block_mask: a :class:`attnkit.BlockMask` built for this call's lengths (see
            :func:`attnkit.create_block_mask`); combined with every other mask.
        sinks: ``(h_q,)`` learned per-head sink logits: each row's softmax normalises
            over its keys plus the sink, whose share is dropped. Gradients flow to it.
        return_lse: also return the natural-log log-sum-exp of the scaled, modded,
            masked scores ``(..., h_q, l_q)`` (sinks included; ``-inf`` on a row with
            no key and no sink), float32 for half inputs; differentiable.
        backend: ``"auto"`` or a name from :func:`attnkit.backends.available_backends`.
        cu_seqlens_q: a packed batch of variable-length sequences (flash-attn's
            ``flash_attn_varlen_func``): int32/int64 ``(n + 1,)`` offsets of each
            sequence's queries in a packed ``query (total_q, h_q, d)`` (``key``/``value``
            then ``(total_k, h_kv, d)``). Each sequence attends to its own keys only, as a
            call of its own (causal aligned per sequence; mods see per-sequence positions
            and ``b`` = the sequence index); ``mask``, ``block_mask`` and ``need_weights``
            are not taken. See :mod:`attnkit.varlen`.
        cu_seqlens_k: the same for the keys (given together with ``cu_seqlens_q``).
        max_seqlen_q, max_seqlen_k: the longest query / key sequence (checked against
            the offsets; computed when None).

    Returns:
        The context tensor ``(..., h_q, l_q, d_v)``; with ``need_weights`` and/or
        ``return_lse`` a tuple ``(context, [weights], [lse])`` in that order. A query
        row whose keys are all masked gets zeros.

    Raises:
        TypeError: non-tensor or non-float inputs, a key or value whose dtype is not the
            query's, a mask neither bool nor float.
        ValueError: mismatched shapes, a key, value, mask or sinks on another device than
            the query (the meta device included; checked before any backend runs), a mask
            that does not broadcast, a bad ``dropout_p``, ``scale`` or backend name, or a
            backend that cannot honour the request.
    """
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _packed(
            query, key, value, mask=mask, need_weights=need_weights, block_mask=block_mask,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, causal=causal, scale=scale, dropout_p=dropout_p,
            window=window, mask_mod=mask_mod, score_mod=score_mod, sinks=sinks,
            return_lse=return_lse, backend=backend,
        )  # fmt: skip
    plain = (
        mask is None and scale is None and window is None
        and mask_mod is None and score_mod is None and block_mask is None and sinks is None
        and need_weights is False and return_lse is False
        and type(dropout_p) in (float, int) and dropout_p == 0
    )  # fmt: skip
    lane = fast_lane.key(query, key, value, causal, backend, plain=plain)
    if lane is not None:  # a plain call run before on SDPA or the native kernel: straight there
        out = fast_lane.run(lane, query, key, value)
        if out is not None:
            return out
    call, name = _make_call(
        query, key, value, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p,
        need_weights=need_weights, window=window, mask_mod=mask_mod, score_mod=score_mod,
        block_mask=block_mask, sinks=sinks, return_lse=return_lse, backend=backend,
    )  # fmt: skip
    chosen = backends.select(name, call)
    out, weights, lse = backends.run(chosen, call)
    if lane is not None and not fast_lane.known(lane):
        fast_lane.remember(lane, call, chosen, query, key, value)
    if not (call.need_weights or call.return_lse):
        return out
    extra: list[torch.Tensor] = []
    if call.need_weights:
        extra.append(weights)  # type: ignore[arg-type]
    if call.return_lse:
        extra.append(lse)  # type: ignore[arg-type]
    return (out, *extra)


def _make_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool | str,
    scale: float | None,
    dropout_p: float,
    need_weights: bool,
    window: int | None,
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
    block_mask: BlockMask | None,
    sinks: torch.Tensor | None,
    return_lse: bool,
    backend: str,
) -> tuple[backends.AttentionCall, str]:
    """The validated call of :func:`attention`'s arguments and the backend name to
    dispatch it to."""
    _check_qkv(query, key, value)
    key, value = _broadcast_kv(query, key, value)
    causal_mode = normalize_causal(causal)
    mask = _check_mask(mask, query, key)
    dropout_p = check_dropout(dropout_p)
    need_weights = check_bool(need_weights, "need_weights")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else check_float(scale, "scale")
    window = check_window(window)
    _check_mods(mask_mod, score_mod, query, key)
    _check_block_mask(block_mask, query, key)
    check_sinks(sinks, query)
    return_lse = check_bool(return_lse, "return_lse")
    if scale <= 0.0:
        # torch's fused kernels return NaN for scale <= 0 with is_causal: fold the scale
        # into the query (the same scores) and hand every backend a positive one.
        query, scale = query * scale, 1.0
    if window is None and causal_keeps_every_key(query.shape[-2], key.shape[-2], causal_mode):
        causal_mode = None  # (a decode step's causal=True: nothing to mask)
    lo, hi = reachable_keys(query.shape[-2], key.shape[-2], causal_mode, window)
    if mask is not None or lo > 0 or hi < key.shape[-2]:
        key, value = _drop_removed_keys(mask, lo, hi, key, value)
    call = backends.AttentionCall(
        query,
        key,
        value,
        mask,
        causal_mode,
        scale,
        dropout_p,
        need_weights,
        window=window,
        mask_mod=mask_mod,
        score_mod=score_mod,
        block_mask=block_mask,
        sinks=sinks,
        return_lse=return_lse,
    )
    name = "reference" if backend == "auto" and trace.is_recording() else backend
    return call, name


def explain_dispatch(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> str:
    """Which backend and engines :func:`attention` would run for these arguments (the same
    keywords), and why the faster ones stood aside: for ``backend="auto"`` every backend
    tried before the chosen one with its reason, and for the blockwise backends the engine
    of each direction with the reasons of the engines passed over (e.g. a ``score_mod``
    that did not compile into the native kernel, and what in it did not). Computes nothing
    but the plan.

    Raises:
        ValueError, TypeError: as :func:`attention` for the same arguments.
    """
    defaults: dict[str, Any] = {
        "mask": None, "causal": False, "scale": None, "dropout_p": 0.0, "need_weights": False,
        "window": None, "mask_mod": None, "score_mod": None, "block_mask": None,
        "sinks": None, "return_lse": False, "backend": "auto",
    }  # fmt: skip
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"explain_dispatch got unexpected keyword(s) {sorted(unknown)}")
    call, name = _make_call(query, key, value, **{**defaults, **kwargs})
    lines = []
    if name == "auto":
        for candidate in backends.auto_order(call):
            try:
                backend = backends.get_backend(candidate)
            except ValueError:
                continue
            reason = backend.auto_supports(call)
            if reason is None:
                break
            lines.append(f"{candidate}: passed over ({reason})")
    chosen = backends.select(name, call)
    lines.append(f"backend: {chosen.name}")
    lines += explain_call(call, chosen.name)
    return "\n".join(lines)


def _packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    need_weights: bool,
    block_mask: BlockMask | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A packed variable-length call (:mod:`attnkit.varlen`): what it does not take refused."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
        raise ValueError(f"{missing} is None: cu_seqlens_q and cu_seqlens_k go together")
    for name, given in (("mask", mask), ("block_mask", block_mask)):
        if given is not None:
            raise ValueError(
                f"{name} is not taken with cu_seqlens (a packed batch): write it as a "
                "mask_mod, which sees each sequence's own positions"
            )
    if check_bool(need_weights, "need_weights"):
        raise ValueError("need_weights=True is not taken with cu_seqlens (a packed batch)")
    return varlen_attention(
        query, key, value, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **kwargs
    )


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have at least 2 dims (seq, dim), got shape {tuple(t.shape)}"
            )
    # Runs on every call (once per layer per decoded token): shapes are read once.
    qs, ks, vs = query.shape, key.shape, value.shape
    rank = len(qs)
    # Checked before any backend runs: a kernel handed a key/value on another device (the
    # meta device above all) may read memory that is not there.
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but query has {query.dtype}: query, key and value "
                "must share a dtype"
            )
        if t.device != query.device:
            raise ValueError(
                f"{name} is on {t.device} but query is on {query.device}: key and value must "
                "be on the query's device"
            )
    if not (rank == len(ks) == len(vs)):
        raise ValueError(
            "query, key and value must have the same rank, got shapes "
            f"{tuple(qs)}, {tuple(ks)}, {tuple(vs)}"
        )
    if qs[-1] != ks[-1]:
        raise ValueError(f"query head_dim ({qs[-1]}) must equal key head_dim ({ks[-1]})")
    if qs[-1] == 0 or vs[-1] == 0:
        raise ValueError(
            f"head_dim must be >= 1, got query/key head_dim {qs[-1]} and value head_dim {vs[-1]}"
        )
    if ks[:-1] != vs[:-1]:
        raise ValueError(
            f"key and value must agree in every dim but the last, got {tuple(ks)} and {tuple(vs)}"
        )
    if rank >= 3:
        if qs[:-3] != ks[:-3] and any(n != 1 for n in ks[:-3]):
            raise ValueError(
                f"query and key batch dims differ: {tuple(qs[:-3])} vs {tuple(ks[:-3])}"
            )
        h_q, h_kv = qs[-3], ks[-3]
        if h_kv == 0 or h_q % h_kv != 0:
            raise ValueError(f"query heads ({h_q}) must be a multiple of key/value heads ({h_kv})")


def _broadcast_kv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value with batch 1 attend for every query batch element (no copy: ``expand``)."""
    if query.dim() < 4 or query.shape[:-3] == key.shape[:-3]:
        return key, value
    lead = query.shape[:-3]
    return key.expand(*lead, *key.shape[-3:]), value.expand(*lead, *value.shape[-3:])


def _check_block_mask(block_mask: BlockMask | None, query: torch.Tensor, key: torch.Tensor) -> None:
    if block_mask is None:
        return
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be an attnkit.BlockMask (attnkit.create_block_mask), got "
            f"{type(block_mask).__name__}"
        )
    if query.dim() != 4:
        raise ValueError(
            f"block_mask needs a 4-D (batch, heads, seq, head_dim) query, got shape "
            f"{tuple(query.shape)}"
        )
    reason = block_mask.check_call(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if reason is not None:
        raise ValueError(reason)
    if block_mask.device.type != query.device.type:
        raise ValueError(f"block_mask is on {block_mask.device} but query is on {query.device}")


def check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """Validate ``sinks``: None, or a float ``(h_q,)`` tensor on the query's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor of shape (h_q,), got {sinks!r}")
    heads = query.shape[-3] if query.dim() >= 3 else 1
    if query.dim() < 3 or sinks.shape != (heads,):
        raise ValueError(
            f"sinks must have shape (h_q,) = ({heads},) for a (..., h_q, l_q, d) query, got "
            f"{tuple(sinks.shape)} for query {tuple(query.shape)}"
        )
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {query.device}")


def _check_mask(
    mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor
) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = may attend) or float (added to scores), got {mask.dtype}"
        )
    target = (*query.shape[:-1], key.shape[-2])  # (..., h_q, l_q, l_k)
    if not broadcasts_to(mask.shape, target):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape {target}"
        )
    if mask.device != query.device:
        raise ValueError(f"mask is on {mask.device} but query is on {query.device}")
    if mask.is_floating_point() and mask.dtype != query.dtype:
        # Finite values stay finite (a bias, never a removal): clamp to the target's range.
        info = torch.finfo(query.dtype)
        if torch.finfo(mask.dtype).max > info.max:
            mask = torch.where(mask.isinf(), mask, mask.clamp(info.min, info.max))
        mask = mask.to(query.dtype)
    return mask


def _drop_removed_keys(
    mask: torch.Tensor | None, lo: int, hi: int, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the keys/values that ``mask``, or causal/window (outside ``[lo, hi)``), remove
    for every query: masked means removed, so a NaN there reaches no output and no
    gradient on any backend (a fused kernel would compute ``NaN - inf`` or ``0 * NaN``)."""
    gone = None
    bounded = lo > 0 or hi < key.shape[-2]
    # On CPU (where reading a value costs no device sync) the copies below are skipped
    # where they change nothing; elsewhere, and under torch.compile, they are always made.
    may_skip = key.device.type == "cpu" and not torch.compiler.is_compiling()
    if mask is not None:
        if may_skip and not bounded and keeps_every_key(mask):  # one reduction, usually
            return key, value
        gone = removed_keys(mask, key.shape[-3] if key.dim() >= 3 else 1)  # (..., s, 1)
    if bounded:
        idx = torch.arange(key.shape[-2], device=key.device).unsqueeze(-1)  # (s, 1)
        bounds = (idx < lo) | (idx >= hi)
        gone = bounds if gone is None else gone | bounds
    if gone is None:  # neither a mask nor a bound: nothing removed
        return key, value
    # Skipped unless a key is removed and something is not finite: a sum is a cheap test
    # (NaN/inf propagate; an overflow only costs the copies).
    if may_skip and (not bool(gone.any()) or bool(key.sum().isfinite() & value.sum().isfinite())):
        return key, value
    key = torch.where(gone, 0.0, key)  # (..., h_kv, s, d)
    value = torch.where(gone, 0.0, value)
    return key, value


def check_dropout(p: float, name: str = "dropout_p") -> float:
    """Validate a dropout probability: a float in ``[0, 1)``; ``name`` is used in errors."""
    return check_probability(p, name)


def _check_mods(
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
    query: torch.Tensor,
    key: torch.Tensor,
) -> None:
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is None:
            continue
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        if query.dim() != 4:
            raise ValueError(
                f"{name} needs a 4-D (batch, heads, seq, head_dim) query, got shape "
                f"{tuple(query.shape)}"
            )
        b, h, t, _ = query.shape
        check_mod_sizes(fn, name, b, h, t, key.shape[-2])
