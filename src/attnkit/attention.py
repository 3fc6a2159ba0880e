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

import torch

from attnkit import backends, trace
from attnkit._validate import check_bool
from attnkit.block_mask import BlockMask
from attnkit.masks import MaskMod, ScoreMod, normalize_causal

__all__ = ["attention"]


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
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention: ``softmax(query @ key^T * scale + mask) @ value``.

    Args:
        query: ``(..., h_q, l_q, d)``; a tensor of rank 2 ``(l_q, d)`` is allowed too.
        key: ``(..., h_kv, l_k, d)``, ``h_kv`` dividing ``h_q`` (GQA; 1 = MQA).
        value: ``(..., h_kv, l_k, d_v)``.
        mask: boolean (True = may attend) or float (added to the scaled scores),
            broadcastable to ``(..., h_q, l_q, l_k)``. See :mod:`attnkit.masks`.
        causal: False, True (= ``"bottom_right"``), ``"bottom_right"`` or ``"top_left"``:
            how the causal triangle lines up when ``l_q != l_k`` (:mod:`attnkit.masks`
            draws both). Combined with ``mask`` when both are given.
        scale: factor applied to the scores; ``1 / sqrt(d)`` by default.
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

    Returns:
        The context tensor ``(..., h_q, l_q, d_v)``; with ``need_weights`` and/or
        ``return_lse`` a tuple ``(context, [weights], [lse])`` in that order. A query
        row whose keys are all masked gets zeros.

    Raises:
        TypeError: non-tensor or non-float inputs, mixed dtypes, a mask neither bool nor float.
        ValueError: mismatched shapes, a mask that does not broadcast, a bad ``dropout_p``,
            ``scale`` or backend name, or a backend that cannot honour the request.
    """
    _check_qkv(query, key, value)
    key, value = _broadcast_kv(query, key, value)
    causal_mode = normalize_causal(causal)
    mask = _check_mask(mask, query, key)
    dropout_p = check_dropout(dropout_p)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else _check_scale(scale)
    _check_mods(window, mask_mod, score_mod, query)
    _check_block_mask(block_mask, query, key)
    _check_sinks(sinks, query)
    return_lse = check_bool(return_lse, "return_lse")
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
    out, weights, lse = backends.dispatch(name, call)
    if not (need_weights or return_lse):
        return out
    extra: list[torch.Tensor] = []
    if need_weights:
        extra.append(weights)  # type: ignore[arg-type]
    if return_lse:
        extra.append(lse)  # type: ignore[arg-type]
    return (out, *extra)


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
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (rank == len(ks) == len(vs)):
        raise ValueError(
            "query, key and value must have the same rank, got shapes "
            f"{tuple(qs)}, {tuple(ks)}, {tuple(vs)}"
        )
    if qs[-1] != ks[-1]:
        raise ValueError(f"query head_dim ({qs[-1]}) must equal key head_dim ({ks[-1]})")
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


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
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
    try:
        ok = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape {target}"
        )
    if mask.device != query.device:
        raise ValueError(f"mask is on {mask.device} but query is on {query.device}")
    if mask.is_floating_point() and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    return mask


def check_dropout(p: float, name: str = "dropout_p") -> float:
    """Validate a dropout probability: a float in ``[0, 1)``; ``name`` is used in errors."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return float(p)


def _check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _check_mods(
    window: int | None,
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
    query: torch.Tensor,
) -> None:
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window <= 0
    ):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
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
