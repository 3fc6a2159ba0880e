"""``context_parallel_attention``: one sequence's attention split over a process group."""

from __future__ import annotations

import math

import torch

from attnkit._validate import (
    check_bool,
    check_choice,
    check_float,
    check_window,
)
from attnkit.attention import check_sinks
from attnkit.distributed.all_to_all import all_to_all_attention
from attnkit.distributed.comm import Group, rank_and_size
from attnkit.distributed.layout import LAYOUTS, local_lengths, seq_len_of
from attnkit.distributed.ring import ring_attention
from attnkit.distributed.ring_plan import RingPlan
from attnkit.masks import MaskMod, ScoreMod

__all__ = ["STRATEGIES", "context_parallel_attention"]

STRATEGIES = ("ring", "all_to_all")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be a (batch, heads, t_local, head_dim) shard, got shape "
                f"{tuple(t.shape)}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree but in head_dim, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            "q and k must be shards of the same sequence (same batch and t_local), got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head_dim ({q.shape[-1]}) must equal k head_dim ({k.shape[-1]})")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group = None,
    layout: str = "zigzag",
    strategy: str = "ring",
    causal: bool = False,
    window: int | None = None,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Self-attention over a sequence split across ``group``: this rank's output shard.

    Every rank calls it with its shards (from :func:`attnkit.distributed.shard` with the
    same ``layout``); the result equals ``attnkit.attention`` on the whole sequence,
    sharded. Masks and mods see global positions (``q_idx``, ``kv_idx`` in ``[0, T)``)
    and global head indices.

    Args:
        q: ``(b, h_q, t_local, d)`` this rank's queries.
        k: ``(b, h_kv, t_local, d)``, ``h_kv`` dividing ``h_q`` (GQA without copies).
        v: ``(b, h_kv, t_local, d_v)``.
        group: the process group (None = the default world group).
        layout: ``"zigzag"`` or ``"contiguous"`` (:mod:`attnkit.distributed.layout`).
        strategy: ``"ring"`` (K/V pieces travel round the ranks) or ``"all_to_all"``
            (Ulysses: re-shard to heads; needs ``h_q`` divisible by the group size).
        causal: keys after the query's position are masked.
        window: sliding window (``q - window < k``; symmetric without ``causal``).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on global positions.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``; with the ring its tensors
            get no gradient (use ``"all_to_all"`` to learn them).
        scale: score factor, ``1 / sqrt(d)`` by default.
        sinks: ``(h_q,)`` attention-sink logits (normalised over, then dropped).
        return_lse: also return the ``(b, h_q, t_local)`` natural-log log-sum-exp.

    Returns:
        ``(b, h_q, t_local, d_v)``, and the log-sum-exp when ``return_lse``. Shared
        tensors (``sinks``, mod tensors) receive this rank's share of their gradient:
        all-reduce them over the group, as any replicated parameter.

    Raises:
        TypeError / ValueError: bad shapes or arguments; ``all_to_all`` with query heads
            not divisible by the group size; shards that are not ``layout``'s.
        RuntimeError: no initialised process group.
    """
    _check_inputs(q, k, v)
    check_choice(layout, "layout", LAYOUTS)
    check_choice(strategy, "strategy", STRATEGIES)
    check_bool(causal, "causal")
    check_bool(return_lse, "return_lse")
    window = check_window(window)
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    check_sinks(sinks, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_float(scale, "scale")
    rank, _ = rank_and_size(group)
    lay = seq_len_of(local_lengths(q, 2, group), layout)
    if strategy == "all_to_all":
        out, lse = all_to_all_attention(
            q, k, v, lay, rank, group=group, causal=causal, window=window, mask_mod=mask_mod,
            score_mod=score_mod, scale=scale, sinks=sinks, return_lse=return_lse,
        )  # fmt: skip
        return (out, lse) if return_lse else out  # type: ignore[return-value]
    if (
        score_mod is not None
        and torch.is_grad_enabled()
        and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in getattr(score_mod, "tensors", ())
        )
    ):
        raise ValueError(
            "strategy='ring' gives no gradient to a score_mod's tensors; "
            "use strategy='all_to_all' or detach them"
        )
    plan = RingPlan(lay, rank, causal, window, mask_mod, score_mod, scale)
    out, lse = ring_attention(q, k, v, plan, group=group, sinks=sinks)
    return (out, lse) if return_lse else out
