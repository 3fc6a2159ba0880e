"""Shared-prefix cascades: many requests attend to a common prefix once.

``n`` requests share a prefix of ``p`` tokens (a system prompt) and each has its own
suffix of ``s`` tokens, of which its last ``t`` are the new queries (``t = 1`` when
decoding, ``t = s`` when prefilling the suffixes). Attention over ``prefix ++ suffix``
splits into two partial results merged by their log-sum-exps
(:func:`attnkit.backends.blockwise.merge.merge_partials`, the one merge)::

    prefix keys (h_kv, p, d), read ONCE         own suffix keys (n, h_kv, s, d)
    ┌──────────────────────────┐                ┌────────┐
    │ every query of every     │  out_p, lse_p  │ causal │  out_s, lse_s
    │ request, stacked as rows │ ─────────────┐ │ per    │ ─────────────┐
    │ (h_kv, n·g·t, d): one    │              │ │ request│              │
    │ call, no mask            │              ▼ └────────┘              ▼
    └──────────────────────────┘           merge_partials(out_p, lse_p, out_s, lse_s)

The prefix pass stacks every request's query rows (and a GQA group's heads) against the
shared prefix keys in one :func:`attnkit.attention` call, so the prefix K/V is stored
once and read once for all requests instead of once per request. The result equals
attention over each request's whole sequence (prefix fully visible, causal inside the
suffix), forward and backward.

Where attnkit's native kernel runs both passes (CPU float32 or bf16, no gradient wanted,
``backend`` ``"auto"`` or ``"blockwise"``), both passes and the merge are **one** kernel
call (:func:`attnkit.backends.blockwise.native.cascade`): no second dispatch, no merge
of tensor ops. A decode step of 8 requests over 2048 shared + 128 own keys went from
0.90 to 0.63 ms that way on a 2-core Zen 3 (fp32; one request: 0.43 to 0.25 ms); a
suffix prefill of 128 tokens each, which its products dominate, is unchanged.

Shapes: n requests, h_q query heads, h_kv key/value heads (g = h_q / h_kv), t queries
per request, p prefix keys, s suffix keys (padded to the longest when
``suffix_lengths`` is given), d head_dim, d_v value head_dim.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, cast, overload

import torch

from attnkit._validate import check_bool, check_float
from attnkit.attention import attention, check_sinks
from attnkit.backends import fast_lane
from attnkit.backends.blockwise import native, plan_cache
from attnkit.backends.blockwise.merge import add_sinks, merge_partials

if TYPE_CHECKING:
    from attnkit.backends.blockwise.plan import TilePlan

__all__ = ["cascade_attention"]


@overload
def cascade_attention(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    *,
    suffix_lengths: torch.Tensor | None = ...,
    scale: float | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
) -> torch.Tensor: ...


@overload
def cascade_attention(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    *,
    suffix_lengths: torch.Tensor | None = ...,
    scale: float | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def cascade_attention(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    *,
    suffix_lengths: torch.Tensor | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``n`` requests over a shared prefix and their own suffixes.

    Query row ``i`` of a request sits at suffix position ``len - t + i`` (``len`` = its
    suffix length, ``s`` or ``suffix_lengths[r]``): it sees every prefix key and its own
    suffix keys up to that position (bottom-right causal). With ``t <= len`` this is
    exactly causal attention over the request's whole sequence ``prefix ++ suffix``;
    a row at a negative position (padding) sees the prefix alone.

    A plain call (no ``suffix_lengths``, ``scale`` or ``sinks``) that the native kernel
    ran is remembered by its tensors' shapes, strides, dtypes and devices: the next such
    call (every layer of every decode step) goes straight to the kernel, with the same
    result bits (the module's "cascade lane").

    Args:
        query: ``(n, h_q, t, d)``: the new tokens of every request.
        prefix_key: ``(h_kv, p, d)`` or ``(1, h_kv, p, d)``: the shared prefix, stored once
            (``p = 0`` allowed).
        prefix_value: ``(h_kv, p, d_v)`` or ``(1, h_kv, p, d_v)``.
        suffix_key: ``(n, h_kv, s, d)``: each request's own keys (``s = 0`` allowed).
        suffix_value: ``(n, h_kv, s, d_v)``.
        suffix_lengths: ``(n,)`` integer tensor: request ``r`` owns only the first
            ``suffix_lengths[r]`` of the ``s`` suffix slots (the rest is padding, never
            attended to). None = all ``s``.
        scale: score scale; ``1 / sqrt(d)`` by default.
        sinks: ``(h_q,)`` learned sink logits (as :func:`attnkit.attention`'s), merged once.
        return_lse: also return the log-sum-exp ``(n, h_q, t)`` (float32 for half inputs).
        backend: the :func:`attnkit.attention` backend of both passes.

    Returns:
        The context ``(n, h_q, t, d_v)``, and the lse when ``return_lse``.

    Raises:
        TypeError: non-tensor or non-float inputs, mixed dtypes, non-integer lengths.
        ValueError: shapes that do not fit together (naming the argument), tensors on
            another device than the query, lengths out of ``[0, s]``.

    Example:
        >>> q = torch.randn(8, 4, 1, 16)                       # 8 requests decoding
        >>> pk, pv = torch.randn(2, 100, 16), torch.randn(2, 100, 16)  # shared prefix
        >>> sk, sv = torch.randn(8, 2, 5, 16), torch.randn(8, 2, 5, 16)
        >>> cascade_attention(q, pk, pv, sk, sv).shape
        torch.Size([8, 4, 1, 16])
    """
    lane = (
        _lane_key(query, prefix_key, prefix_value, suffix_key, suffix_value, return_lse, backend)
        if suffix_lengths is None and scale is None and sinks is None
        else None
    )
    if lane is not None and (kept := _lane.get(lane)) is not None:
        pk = prefix_key if prefix_key.dim() == 4 else prefix_key[None]
        pv = prefix_value if prefix_value.dim() == 4 else prefix_value[None]
        ran = run_lane(kept, query, pk, pv, suffix_key, suffix_value, with_lse=return_lse)  # type: ignore[arg-type]
        if ran is not None:
            out, lse = ran
            if out.dtype != query.dtype:
                out = out.to(query.dtype)
            return (out, cast(torch.Tensor, lse)) if return_lse else out
    prefix_key, prefix_value = _check(query, prefix_key, prefix_value, suffix_key, suffix_value)
    return_lse = check_bool(return_lse, "return_lse")
    check_sinks(sinks, query)
    n, h_q, t, _ = query.shape
    s = suffix_key.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scale = check_float(scale, "scale")
    mask = _suffix_mask(suffix_lengths, n, t, s, query.device)
    fused = fused_native(
        query, prefix_key, prefix_value, suffix_key, suffix_value, mask, scale, backend,
        lane=lane,
    )  # fmt: skip
    if fused is not None:  # both passes and their merge in one kernel call
        out, lse = fused
    else:
        out, lse = _two_passes(
            query, prefix_key, prefix_value, suffix_key, suffix_value, mask, scale, backend
        )
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks, h_q)
    if out.dtype != query.dtype:  # (the kernel's float32 out rounded once, after the sink)
        out = out.to(query.dtype)
    return (out, lse) if return_lse else out


def _stacked_rows(query: torch.Tensor, h_kv: int) -> torch.Tensor:
    """Every request's query rows (and each GQA group's heads) stacked per kv head, as the
    prefix pass sees them: (n, h_kv, g, t, d) -> (h_kv, n, g, t, d) -> (1, h_kv, n*g*t, d)."""
    n, h_q, t, d = query.shape
    if n == 1:  # (the permute moves a dim of size 1: one reshape, a view where it can be)
        return query.reshape(1, h_kv, -1, d)
    return query.reshape(n, h_kv, h_q // h_kv, t, d).permute(1, 0, 2, 3, 4).reshape(1, h_kv, -1, d)


def _two_passes(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix pass and the suffix pass as :func:`attnkit.attention` calls (any
    backend, differentiable), merged by their log-sum-exps; ``(out, lse)`` without sinks."""
    n, h_q, t, _ = query.shape
    h_kv, p = prefix_key.shape[1], prefix_key.shape[2]
    s = suffix_key.shape[2]
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    if p > 0:
        # every request's rows against the prefix in one call
        g = h_q // h_kv
        out, lse = attention(
            _stacked_rows(query, h_kv),
            prefix_key,
            prefix_value,
            scale=scale,
            return_lse=True,
            backend=backend,
        )  # (1, h_kv, n*g*t, d_v), (1, h_kv, n*g*t)
        out = out.reshape(h_kv, n, g, t, -1).permute(1, 0, 2, 3, 4).reshape(n, h_q, t, -1)
        lse = lse.reshape(h_kv, n, g, t).permute(1, 0, 2, 3).reshape(n, h_q, t)
        parts.append((out, lse))
    if s > 0 and t == 1:
        # Decoding: every row sits at the last position and sees all its own keys, so a
        # GQA group's heads stack as rows (a view): (n, h_kv, g, d) against (n, h_kv, s, d).
        out, lse = attention(
            query.reshape(n, h_kv, h_q // h_kv, -1),
            suffix_key,
            suffix_value,
            mask=mask,  # (n, 1, 1, s): the padding, the same for every row
            scale=scale,
            return_lse=True,
            backend=backend,
        )
        parts.append((out.reshape(n, h_q, 1, -1), lse.reshape(n, h_q, 1)))
    elif s > 0:
        out, lse = attention(
            query,
            suffix_key,
            suffix_value,
            mask=mask,
            causal=mask is None,
            scale=scale,
            return_lse=True,
            backend=backend,
        )  # (n, h_q, t, d_v), (n, h_q, t); bottom-right causal
        parts.append((out, lse))
    if not parts:  # no key at all: zeros and -inf, as attention() gives a keyless row
        d_v = prefix_value.shape[-1]
        lse_dtype = torch.promote_types(query.dtype, torch.float32)
        # Constant results, but a backward through them must still run (zero gradients).
        grad = torch.is_grad_enabled() and query.requires_grad
        parts.append(
            (
                query.new_zeros(n, h_q, t, d_v).requires_grad_(grad),
                torch.full((n, h_q, t), -math.inf, dtype=lse_dtype, device=query.device),
            )
        )
    out, lse = parts[0]
    for other in parts[1:]:
        out, lse = merge_partials(out, lse, *other)
    return out, lse


def fused_native(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    backend: str,
    *,
    stacked_mask: torch.Tensor | None = None,
    lane: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both passes and their merge in one call of attnkit's native kernel
    (:func:`attnkit.backends.blockwise.native.cascade`; a draft tree's two passes too,
    :func:`attnkit.tree_attention`), for inputs already checked: ``prefix_key`` ``(1,
    h_kv, p, d)``, ``mask`` a bool suffix mask ``(n|1, 1|h, t, s)`` or None;
    ``stacked_mask`` the same mask as the one pass reads it (:func:`_one_pass`), where
    the caller keeps it made (a :class:`~attnkit.tree.DraftTree` does), else None;
    ``lane`` the call's key in the cascade lane (:func:`_lane_key`), or None: a call of
    several requests that runs both passes on its tensors as they came is kept there.
    ``(out, lse)``,
    both float32 (the caller rounds ``out`` to the query's dtype once, after any sink is
    merged: two roundings of a bf16 output cost up to twice the error of one), or None
    where it does not run them: another backend, a
    gradient wanted, another device, no prefix or no suffix, a scale <= 0, or a pass the
    kernel refuses (``native.why_not``: dtype, head sizes, the speed this machine measured
    for dense plans). The few-rows bound of a lone dense call (torch's kernel for up to 48
    float32 rows per kv head on AVX2) does not apply to the prefix pass here: one call
    instead of two dispatches and a merge was faster in every case measured, 1 to 32
    requests decoding and 4-8 prefilling, fp32 and bf16 (0.56-1.01x of the two passes'
    time, 2-core Zen 3; docs/serving.md)."""
    from attnkit.backends.blockwise.native import calibrate
    from attnkit.backends.blockwise.plan import NATIVE_CPU, build_plan

    if backend not in ("auto", "blockwise") or query.device.type != "cpu":
        return None
    if torch.is_grad_enabled() and any(
        x.requires_grad for x in (query, prefix_key, prefix_value, suffix_key, suffix_value)
    ):
        return None
    if prefix_key.shape[2] == 0 or suffix_key.shape[2] == 0 or torch.compiler.is_compiling():
        return None
    if scale <= 0.0:  # (attention() folds such a scale into the query: the two passes)
        return None
    t, d, d_v = query.shape[2], query.shape[3], prefix_value.shape[-1]
    given = (prefix_key, prefix_value, query, suffix_key, suffix_value)
    # (the kernel reads rows of the last dim in place: each must be contiguous)
    pk, pv, query, sk, sv = (
        x if x.stride(-1) == 1 else x.contiguous()
        for x in (prefix_key, prefix_value, query, suffix_key, suffix_value)
    )
    h_kv = pk.shape[1]

    def plan(q: torch.Tensor, k: torch.Tensor, causal: str | None, mask: torch.Tensor | None):
        return build_plan(
            q, k, scale=scale, causal=causal, window=None, mask=mask, mask_mod=None,
            score_mod=None, block_mask=None, engine=NATIVE_CPU,
        )  # fmt: skip

    # a cascade's plans are a function of its sizes and options (and of the suffix mask's
    # shape and dtype: its values are the call's own): once accepted they are kept (every
    # layer of a decode step, every verified draft tree makes the same call)
    key = None if calibrate.measuring() else _cache_key(query, pv, sk, scale, mask)
    whole = _one_pass(query, pk, pv, sk, sv, mask, stacked_mask)
    if whole is not None:  # one request, its suffix after the prefix in memory: ONE pass
        k_all, v_all, suffix_mask = whole
        rows = _stacked_rows(query, h_kv)  # (1, h_kv, g*t, d): a view of the query
        one = None if key is None else plan_cache.get(("one pass", *key), None)
        if one is None:
            one = plan(rows, k_all, None, None)
            if native.why_not(one, query.dtype, d, d_v, one_of_two=True) is not None:
                return None
            if key is not None:
                plan_cache.put(("one pass", *key), one)
        out, lse = _run_one_pass(one, query, k_all, v_all, suffix_mask)
        if lane is not None and key is not None and _as_given(given, (pk, pv, query, sk, sv)):
            fast_lane.put(_lane, lane, ("one pass", one, []))
        return out, cast(torch.Tensor, lse)  # (made: with_lse)
    pre = None if key is None else plan_cache.get(("prefix", *key), None)
    suf = None if key is None else plan_cache.get(("suffix", *key), None)
    if pre is not None and suf is not None:
        suf = plan_cache.with_mask(suf, mask, query.shape)
    else:  # (the kernel gathers the stacked rows itself: here only their shape counts)
        pre = plan(_stacked_rows(query, h_kv), pk, None, None)
        suf = plan(query, sk, "bottom_right" if mask is None and t > 1 else None, mask)
        dtype = query.dtype
        if (
            native.why_not(pre, dtype, d, d_v, one_of_two=True) is not None
            or native.why_not(suf, dtype, d, d_v) is not None
        ):
            return None
        if key is not None:
            plan_cache.put(("prefix", *key), pre)
            plan_cache.put(("suffix", *key), suf)
    # (one request's two passes are kept only where its suffix may lie anywhere: with the
    # suffix after the prefix in memory the full path takes one pass)
    if (
        lane is None or key is None or mask is not None or query.shape[0] == 1
        or not _as_given(given, (pk, pv, query, sk, sv))
    ):  # fmt: skip
        return native.cascade(pre, suf, pk, pv, query, sk, sv)
    reuse: list = []  # (the kernel's arguments, made by this call for the next ones)
    out, lse = native.cascade(pre, suf, pk, pv, query, sk, sv, reuse=reuse)
    fast_lane.put(_lane, lane, ("two passes", pre, suf, reuse))
    return out, lse


def _as_given(given: tuple, used: tuple) -> bool:
    """Whether the kernel read the tensors as the caller gave them (none copied)."""
    return all(x is y for x, y in zip(given, used, strict=True))


def _one_pass(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    mask: torch.Tensor | None,
    stacked_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(keys, values, suffix mask)`` of ONE pass over ``prefix ++ suffix`` for the
    stacked rows (:func:`_stacked_rows`) of one request whose suffix keys and values follow the prefix's in
    memory (a model's cache buffer split in two: a draft tree's nodes after the cache,
    :func:`attnkit.tree_attention`): the mask ``(1, 1|h_kv, g*t, s)`` covers the suffix
    alone, every prefix key kept (:func:`~attnkit.backends.blockwise.native.forward`'s
    ``suffix_mask``; ``stacked_mask`` where the caller keeps it made), None for a decode
    step's one query and no mask. None where the two
    passes run: several requests, a suffix elsewhere in memory, or a causal suffix of
    several queries (its band differs row by row once a GQA group's heads are stacked)."""
    n, h_q, t, _ = query.shape
    if n != 1 or (mask is None and t > 1):
        return None
    k_all, v_all = joined_view(prefix_key, suffix_key), joined_view(prefix_value, suffix_value)
    if k_all is None or v_all is None:
        return None
    if mask is None or stacked_mask is not None:
        return k_all, v_all, stacked_mask
    h_kv, s = suffix_key.shape[1], suffix_key.shape[2]
    g = h_q // h_kv
    mask = mask.expand(1, h_q, t, s) if mask.shape[1] == h_q else mask.expand(1, g, t, s)
    return k_all, v_all, mask.reshape(1, -1, g * t, s)  # (1, h_kv|1, g*t, s)


def joined_view(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """``first ++ second`` along dim 2 of two 4-D tensors as one view where ``second``'s
    rows follow ``first``'s in memory (a cache buffer's first ``L + n`` rows split in two,
    as a model's cache hands them out); else None."""
    stride = first.stride()
    if second.stride() != stride or second.dtype != first.dtype or second.device != first.device:
        return None
    (b, h, length, d), (b2, h2, _, d2) = first.shape, second.shape
    if (b2, h2, d2) != (b, h, d):
        return None
    if second.data_ptr() != first.data_ptr() + length * stride[2] * first.element_size():
        return None
    # (the next address is not enough: it must be the same buffer's, to be viewed from it;
    # two views of one buffer share their base, else their storage is compared)
    if (first._base is None or first._base is not second._base) and (
        second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    ):
        return None
    return first.as_strided((b, h, length + second.shape[2], d), stride)


# (feature "cascade lane") A plain call (no suffix lengths, scale or sinks; a DraftTree's,
# tree.py) that the kernel ran on its tensors as they came (no copy) is kept under
# everything the full path's outcome depended on: the five tensors' shapes, strides,
# dtypes and devices, backend, the kernel arguments' constants, and the process state the
# plans are kept under (plan_cache.process_key: threads, build, calibration). What is kept
# is the route the first call took: several requests' two passes and their merge (with
# the kernel's arguments of that call, which the next ones point at their own tensors),
# or one request's one pass over prefix ++ suffix, which the lane takes again only where
# the suffix still follows the prefix in memory. The same bits, without the checks, the
# plans' lookup and the arguments' making (22-25 us of a decode step of 8 requests, Xeon
# of session 29). At most fast_lane.MAX_KEYS keys (fast_lane.put).
_lane: dict[tuple, tuple] = {}  # (read without a lock: one dict lookup)


def _lane_key(
    query: object,
    prefix_key: object,
    prefix_value: object,
    suffix_key: object,
    suffix_value: object,
    return_lse: object,
    backend: object,
) -> tuple | None:
    """The cascade lane's key of a call, or None where the lane does not take it."""
    if type(return_lse) is not bool or type(backend) is not str:
        return None
    given = (query, prefix_key, prefix_value, suffix_key, suffix_value)
    tensors = fast_lane.signature(*given, strides=True)
    if tensors is None:
        return None
    grad = torch.is_grad_enabled()
    if grad and any(x.requires_grad for x in cast(tuple[torch.Tensor, ...], given)):
        return None  # (a gradient wanted: the kernel runs none)
    return (
        *tensors, backend, native.KV_SPLITS, native.BLOCK_Q,  # (what kept arguments hold)
        *plan_cache.process_key(),
    )  # fmt: skip


def run_lane(
    kept: tuple,
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    stacked_mask: torch.Tensor | None = None,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(out, lse)`` (float32) of a call whose lane key holds ``kept`` (prefix ``(1,
    h_kv, p, d)``; ``stacked_mask`` as :func:`fused_native`'s), by the route its first
    call took; None where that route no longer applies (one pass, for a suffix that no
    longer follows the prefix in memory): the full path then runs it. ``with_lse=False``:
    the one pass makes no lse (None) and a bf16 call's output comes in bf16
    (:func:`attnkit.backends.blockwise.native.forward`'s)."""
    if kept[0] == "two passes":
        pre, suf, reuse = kept[1:]
        return native.cascade(
            pre, suf, prefix_key, prefix_value, query, suffix_key, suffix_value, reuse=reuse
        )
    k_all, v_all = joined_view(prefix_key, suffix_key), joined_view(prefix_value, suffix_value)
    if k_all is None or v_all is None:
        return None
    return _run_one_pass(
        kept[1], query, k_all, v_all, stacked_mask, reuse=kept[2], with_lse=with_lse
    )


def _run_one_pass(
    one: TilePlan,
    query: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    *,
    reuse: list | None = None,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out (1, h_q, t, d_v), lse (1, h_q, t))`` of one request's ONE pass ``one`` over
    ``prefix ++ suffix`` (``k_all``, ``v_all``: :func:`joined_view`), its rows stacked per
    kv head (:func:`_stacked_rows`, a view of the query); ``reuse`` and ``with_lse`` as
    :func:`attnkit.backends.blockwise.native.forward`'s (the lane's: its tensors' strides
    are in its key)."""
    n, h_q, t, _ = query.shape
    rows = _stacked_rows(query, k_all.shape[1])  # (1, h_kv, g*t, d)
    out, lse = native.forward(
        one, rows, k_all, v_all, suffix_mask=suffix_mask, reuse=reuse, with_lse=with_lse
    )
    # (the same memory as rows)
    return out.view(n, h_q, t, -1), None if lse is None else lse.view(n, h_q, t)


def _cache_key(
    query: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> tuple:
    """The :mod:`~attnkit.backends.blockwise.plan_cache` key of a cascade (the prefix's
    length and value size in ``prefix_value``'s shape, the suffix's in ``suffix_key``'s; the
    rest of the shapes :func:`_check` ties to these; the suffix mask's shape and dtype)."""
    return (
        "cascade", query.shape, query.dtype, query.device, prefix_value.shape,
        suffix_key.shape, scale, None if mask is None else (mask.shape, mask.dtype),
        *plan_cache.process_key(),
    )  # fmt: skip


def _suffix_mask(
    lengths: torch.Tensor | None, n: int, t: int, s: int, device: torch.device
) -> torch.Tensor | None:
    """``(n, 1, t, s)`` bool, True = may attend, for padded suffixes; None without lengths."""
    if lengths is None:
        return None
    if (
        not isinstance(lengths, torch.Tensor)
        or lengths.is_floating_point()
        or lengths.dtype == torch.bool
    ):
        raise TypeError(f"suffix_lengths must be an integer tensor, got {lengths!r}")
    if lengths.shape != (n,):
        raise ValueError(f"suffix_lengths must have shape ({n},), got {tuple(lengths.shape)}")
    if lengths.device != device:
        raise ValueError(f"suffix_lengths is on {lengths.device} but query is on {device}")
    if bool(((lengths < 0) | (lengths > s)).any()):
        raise ValueError(
            f"suffix_lengths must be in [0, {s}] (the suffix slots), got {lengths.tolist()}"
        )
    lengths = lengths.view(n, 1, 1)
    q_pos = lengths - t + torch.arange(t, device=device).view(1, t, 1)  # (n, t, 1)
    k_pos = torch.arange(s, device=device).view(1, 1, s)
    return ((k_pos <= q_pos) & (k_pos < lengths)).unsqueeze(1)  # (n, 1, t, s)


def _check(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the shapes, dtypes and devices; return the prefix as ``(1, h_kv, p, d)``."""
    named = (
        ("query", query),
        ("prefix_key", prefix_key),
        ("prefix_value", prefix_value),
        ("suffix_key", suffix_key),
        ("suffix_value", suffix_value),
    )
    for name, x in named:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name} must be a floating torch.Tensor, got {what}")
        if x.dtype != query.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but query has {query.dtype}")
        if x.device != query.device:
            raise ValueError(f"{name} is on {x.device} but query is on {query.device}")
    if query.dim() != 4:
        raise ValueError(f"query must be (n, h_q, t, d), got shape {tuple(query.shape)}")
    prefix = []
    for name, x in (("prefix_key", prefix_key), ("prefix_value", prefix_value)):
        if x.dim() == 3:
            x = x[None]
        if x.dim() != 4 or x.shape[0] != 1:
            raise ValueError(
                f"{name} must be (h_kv, p, d) or (1, h_kv, p, d), got {tuple(x.shape)}"
            )
        prefix.append(x)
    pk, pv = prefix  # (1, h_kv, p, d|d_v)
    for name, x in (("suffix_key", suffix_key), ("suffix_value", suffix_value)):
        if x.dim() != 4 or x.shape[0] != query.shape[0]:
            raise ValueError(
                f"{name} must be (n={query.shape[0]}, h_kv, s, d), got {tuple(x.shape)}"
            )
    n, h_q, t, d = query.shape
    if n == 0 or t == 0:
        raise ValueError(
            f"query needs at least one request and one token, got {tuple(query.shape)}"
        )
    h_kv = pk.shape[1]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of prefix_key heads ({h_kv})")
    if pk.shape[-1] != d or suffix_key.shape[-1] != d:
        raise ValueError(
            f"head_dim differs: query {d}, prefix_key {pk.shape[-1]}, suffix_key "
            f"{suffix_key.shape[-1]}"
        )
    if pv.shape[:-1] != pk.shape[:-1]:
        raise ValueError(
            f"prefix_value {tuple(pv.shape)} does not match prefix_key {tuple(pk.shape)}"
        )
    if suffix_key.shape[1] != h_kv or suffix_value.shape[:-1] != suffix_key.shape[:-1]:
        raise ValueError(
            f"suffix_key {tuple(suffix_key.shape)} / suffix_value {tuple(suffix_value.shape)} must "
            f"be (n, h_kv={h_kv}, s, d) and agree in every dim but the last"
        )
    if suffix_value.shape[-1] != pv.shape[-1]:
        raise ValueError(
            f"value head_dim differs: prefix_value {pv.shape[-1]}, suffix_value {suffix_value.shape[-1]}"
        )
    return pk, pv
