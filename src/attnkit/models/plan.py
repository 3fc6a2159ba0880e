"""Once per forward: each row's positions, the RoPE values and the masks of the GPT's layers.

:func:`plan_forward` is the model's half of "data flows down": it checks ``idx``,
``attention_mask`` and ``input_pos`` (:func:`check_inputs`), then computes
(:func:`build_plan`, which trusts its inputs) every row's positions (a left-padded
row counts from its first real token), looks the RoPE values up in the model's one
table, and builds one :class:`~attnkit.models.attention.AttentionInputs` per kind of
layer (global; local with its window), each with its mask built from the time indices
of the keys the layer's cache will return (:meth:`attnkit.kv_cache.KVCache.key_positions`).

Where no mask is needed (no padding, keys exactly the times ``0 .. end - 1``) the
layers get ``causal``/``window`` flags instead, so :func:`attnkit.attention` takes its
fast paths (SDPA's ``is_causal``, the blockwise tiles).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnkit.kv_cache import KVCache
from attnkit.masks import position_keep
from attnkit.models.attention import AttentionInputs
from attnkit.rope import rope_values

if TYPE_CHECKING:
    from collections.abc import Sequence

    from attnkit.paged_kv_cache import PagedBatch
    from attnkit.rope import RotaryEmbedding

__all__ = [
    "Layout",
    "Plan",
    "build_packed_plan",
    "build_plan",
    "check_context",
    "check_idx",
    "check_inputs",
    "keep_mask",
    "plan_forward",
]


@dataclass(frozen=True)
class Layout:
    """What planning a forward reads of the model, and nothing else (the model hands it
    down: :meth:`attnkit.models.GPT.layout`).

    Attributes:
        vocab_size: token ids must be in ``[0, vocab_size)``.
        context_length: the most time indices a forward may reach.
        caches: one :class:`~attnkit.kv_cache.KVCache` per layer, or None.
        streaming: StreamingLLM's ``(sink_tokens, window)``, or None.
        rope: the model's one RoPE table, or None (learned positions).
        windows: each layer's sliding window (None = global).
    """

    vocab_size: int
    context_length: int
    caches: Sequence[KVCache] | None
    streaming: tuple[int, int] | None
    rope: RotaryEmbedding | None
    windows: Sequence[int | None]


@dataclass(frozen=True)
class Plan:
    """What one forward hands down: positions ``(b|1, t)`` and one input per layer."""

    positions: torch.Tensor
    inputs: list[AttentionInputs]


def keep_mask(
    q_time: torch.Tensor,
    k_time: torch.Tensor,
    *,
    window: int | None,
    sink_tokens: int = 0,
    key_real: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder's boolean mask ``(b|1, 1, t, s)`` (True = may attend) from time indices.

    Causal and window follow :func:`attnkit.masks.position_keep` (the one home of the
    rule); ``k_time < 0`` marks an empty cache slot; the first ``sink_tokens`` times stay
    visible past the window (StreamingLLM); ``key_real`` ``(b, L)`` drops padding keys.
    """
    q, k = q_time[:, None], k_time[None, :]  # (t, 1), (1, s)
    keep = position_keep(q, k, causal=True, window=window) & (k >= 0)  # (t, s)
    if sink_tokens and window is not None:
        keep = keep | ((k >= 0) & (k < sink_tokens) & (k <= q))
    if key_real is None:
        return keep[None, None]  # (1, 1, t, s)
    real = key_real.gather(1, k_time.clamp(min=0).expand(key_real.shape[0], -1))  # (b, s)
    return keep[None, None] & real[:, None, None, :]  # (b, 1, t, s)


def check_idx(layout: Layout, idx: torch.Tensor) -> None:
    """Check that ``idx`` is a ``(batch, tokens)`` integer tensor of ids in the vocabulary.

    Raises:
        TypeError: not an integer tensor.
        ValueError: a wrong rank, no tokens, or an id outside ``[0, vocab_size)``.
    """
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.long, torch.int):
        raise TypeError("idx must be an integer (long) tensor of token ids")
    if idx.dim() != 2:
        raise ValueError(f"idx must be (batch, tokens), got shape {tuple(idx.shape)}")
    if idx.shape[1] == 0:
        raise ValueError("idx has no tokens")
    if not torch.compiler.is_compiling():
        v = layout.vocab_size
        low, high = torch.aminmax(idx)
        if int(low) < 0 or int(high) >= v:
            raise ValueError(f"token ids must be in [0, {v})")


def _check_input_pos(input_pos: torch.Tensor, t: int) -> None:
    if not isinstance(input_pos, torch.Tensor) or input_pos.is_floating_point():
        raise TypeError("input_pos must be an integer tensor of time indices")
    if input_pos.shape != (t,):
        raise ValueError(
            f"input_pos must have shape ({t},) like idx's tokens, got {tuple(input_pos.shape)}"
        )
    if not torch.compiler.is_compiling() and (
        int(input_pos[0]) < 0 or (t > 1 and not bool((input_pos.diff() == 1).all()))
    ):
        raise ValueError(
            f"input_pos must be consecutive non-negative time indices, got {input_pos.tolist()}"
        )


def _check_mask(mask: torch.Tensor, b: int, end: int | None) -> torch.Tensor:
    """Return ``attention_mask`` as bool ``(b, L)`` after checking it (eager checks only)."""
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point() or mask.is_complex():
        raise TypeError("attention_mask must be a bool or integer tensor (1 = token, 0 = padding)")
    if mask.dim() != 2 or mask.shape[0] != b:
        raise ValueError(f"attention_mask must be (batch={b}, length), got {tuple(mask.shape)}")
    if end is None:  # compiling: no data-dependent checks
        return mask.bool()
    if mask.shape[1] < end:
        raise ValueError(
            f"attention_mask covers {mask.shape[1]} time indices; it must cover all {end} "
            "(the cached tokens and the new ones)"
        )
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    real = mask[:, :end].bool()
    first = real.int().argmax(1, keepdim=True)  # (b, 1)
    count = real.sum(1, keepdim=True)
    times = torch.arange(end, device=mask.device)
    if not bool((real == ((times >= first) & (times < first + count))).all()):
        raise ValueError(
            "attention_mask: each row's tokens must be contiguous (left or right padding)"
        )
    return mask.bool()


def _stream_positions(
    times: torch.Tensor, end: torch.Tensor, stream: tuple[int, int]
) -> torch.Tensor:
    """StreamingLLM positions: sinks keep theirs, later tokens shift so the newest sits
    at ``sink_tokens + window - 1`` (relative distances among them unchanged)."""
    n, w = stream
    shift = (end - n - w).clamp(min=0)
    return torch.where(times < n, times, times - shift)


def check_inputs(
    layout: Layout,
    idx: torch.Tensor,
    attention_mask: torch.Tensor | None,
    input_pos: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check one forward's inputs against the model's layout and its caches.

    Returns:
        ``(input_pos, key_real)``: the time indices (``0 .. t - 1`` when None was given
        without a cache) and ``attention_mask`` as bool ``(b, L)``, or None where no
        padding matters (no mask, or no zero up to the last time index).

    Raises:
        TypeError / ValueError: non-integer or out-of-vocabulary ids, a bad ``input_pos``
            or mask, more tokens than ``context_length`` or the cache holds.
    """
    check_idx(layout, idx)
    b, t = idx.shape
    caches = layout.caches
    eager = not torch.compiler.is_compiling()
    if input_pos is None:
        if caches is not None:
            raise ValueError(
                "with a KV cache, pass input_pos: the (t,) time indices of idx's tokens, "
                "e.g. torch.arange(start, start + t)"
            )
        input_pos = torch.arange(t, device=idx.device)
    else:
        _check_input_pos(input_pos, t)
    stream = layout.streaming
    end_i = int(input_pos[-1]) + 1 if eager else None
    if end_i is not None and stream is None:
        check_context(layout, end_i)
    key_real = None
    if attention_mask is not None:
        if stream is not None:
            raise ValueError("streaming decoding takes no attention_mask (rows of equal length)")
        key_real = _check_mask(attention_mask, b, end_i)
        if end_i is not None and bool(key_real[:, :end_i].all()):
            key_real = None  # no padding where it matters: the fast path
    return input_pos, key_real


def check_context(layout: Layout, end: int) -> None:
    """Check that ``end`` time indices fit ``context_length`` and the KV cache (if any).

    Raises:
        ValueError: naming the bound that ``end`` exceeds.
    """
    ctx = layout.context_length
    if end > ctx:
        raise ValueError(f"{end} tokens exceed context_length={ctx}")
    if layout.caches is not None:
        first = layout.caches[0]
        if first.max_seq_len is not None and end > first.max_seq_len:
            raise ValueError(
                f"{end} tokens exceed the KV cache's max_seq_len={first.max_seq_len} "
                "(set by setup_cache; context_length is "
                f"{ctx}): call setup_cache with a longer max_seq_len"
            )


def build_plan(
    layout: Layout,
    input_pos: torch.Tensor,
    key_real: torch.Tensor | None,
    paged: PagedBatch | None = None,
) -> Plan:
    """The positions, RoPE values and masks of one forward, from inputs already checked.

    Checks nothing: ``input_pos`` and ``key_real`` come from :func:`check_inputs`, or from
    a caller that checked its inputs once for many forwards (:func:`attnkit.models.generate`
    checks the prompt, its mask and the context bound once; its steps then trust them).

    Args:
        layout: what the plan reads of the model (caches, streaming, RoPE, windows).
        input_pos: ``(t,)`` consecutive time indices of the forward's tokens.
        key_real: bool ``(b, L)``, True = token, covering every time index up to
            ``input_pos[-1]``, with padding among them; None = no padding.
        paged: the rows' sequences on a paged cache (row ``i`` = sequence ``i``), handed
            to every layer; None without one.
    """
    caches = layout.caches
    eager = not torch.compiler.is_compiling()
    stream = layout.streaming
    end = input_pos[-1] + 1  # (): a tensor, so a compiled step does not specialise on it
    if key_real is None:
        positions = input_pos[None]  # (1, t)
        if stream is not None:
            positions = _stream_positions(positions, end, stream)
    else:
        real_pos = (key_real.long().cumsum(1) - 1).clamp(min=0)  # (b, L)
        positions = real_pos.index_select(1, input_pos)  # (b, t)
    rope = None
    table = layout.rope
    if table is not None:
        if stream is None:
            cos, sin = table.cos[positions], table.sin[positions]  # (b|1, t, d)
        else:
            cos, sin = rope_values(positions, table.head_dim, table.theta)
        rope = (cos[:, None], sin[:, None])  # (b|1, 1, t, d)
    kinds: dict[tuple, AttentionInputs] = {}
    inputs = []
    for i, w in enumerate(layout.windows):
        cache = None if caches is None else caches[i]
        key = (w,) if cache is None else (w, cache.window, cache.sink_tokens, cache.static)
        if key not in kinds:
            kinds[key] = _layer_inputs(layout, w, cache, input_pos, end, key_real, rope, eager)
        inputs.append(kinds[key])
    if paged is not None:
        inputs = [dataclasses.replace(x, paged=paged) for x in inputs]
    return Plan(positions, inputs)


def build_packed_plan(layout: Layout, batch: PagedBatch, device: torch.device) -> Plan:
    """The plan of a packed forward on a paged cache (continuous batching): ``idx`` is
    ``(1, sum(batch.counts))``, the new tokens of each sequence after the previous one's,
    each at its own time indices (``batch.starts``); no padding. Each layer attends
    sequence by sequence, bottom-right causal (and its window) over that sequence's keys
    (:meth:`attnkit.paged_kv_cache.PagedLayer.attend`)."""
    positions = batch.positions(device)[None]  # (1, N)
    rope = None
    if layout.rope is not None:
        cos, sin = layout.rope.cos[positions], layout.rope.sin[positions]  # (1, N, d)
        rope = (cos[:, None], sin[:, None])  # (1, 1, N, d)
    kinds: dict[int | None, AttentionInputs] = {}
    for w in layout.windows:
        if w not in kinds:
            kinds[w] = AttentionInputs(positions[0], rope, window=w, paged=batch)
    return Plan(positions, [kinds[w] for w in layout.windows])


def plan_forward(
    layout: Layout,
    idx: torch.Tensor,
    attention_mask: torch.Tensor | None,
    input_pos: torch.Tensor | None,
) -> Plan:
    """Check the inputs and compute the positions, RoPE values and masks of one forward."""
    input_pos, key_real = check_inputs(layout, idx, attention_mask, input_pos)
    return build_plan(layout, input_pos, key_real)


def _layer_inputs(
    layout: Layout,
    window: int | None,
    cache: KVCache | None,
    input_pos: torch.Tensor,
    end: torch.Tensor,
    key_real: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    eager: bool,
) -> AttentionInputs:
    t = input_pos.shape[0]
    if key_real is None and (
        cache is None or (cache.window is None and not cache.static and eager)
    ):
        # The keys are exactly the times 0 .. end - 1 (or the call's own tokens):
        # bottom-right causal (and window) is exact; one query sees every earlier key.
        return AttentionInputs(input_pos, rope, causal=t > 1 or cache is None, window=window)
    k_time = input_pos if cache is None else cache.key_positions(input_pos)  # (s,)
    if cache is not None and cache.window is not None:
        window = cache.window  # a ring (or StreamingLLM's window) bounds what is kept
    sinks = 0 if cache is None else cache.sink_tokens
    mask = keep_mask(input_pos, k_time, window=window, sink_tokens=sinks, key_real=key_real)
    key_rope = None
    if layout.streaming is not None and layout.rope is not None:
        k_pos = _stream_positions(k_time.clamp(min=0), end, layout.streaming)
        cos, sin = rope_values(k_pos, layout.rope.head_dim, layout.rope.theta)  # (s, d)
        key_rope = (cos[None, None], sin[None, None])  # (1, 1, s, d)
    return AttentionInputs(input_pos, rope, key_rope, mask, causal=False)
