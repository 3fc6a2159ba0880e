"""Attention over keys and values held in pages (:class:`attnkit.PagedKVCache`).

Notation: b batch, h query heads, h_kv key/value heads, t queries, s keys (``key_len``),
P pages, p page_size, n pages per row of the page table, d head_dim, d_v value_dim.

:func:`paged_attention` computes exactly what :func:`attnkit.attention` computes on the
contiguous keys ``K[b] = concat(k_pages[page_table[b, 0]], k_pages[page_table[b, 1]], ...)
[:, :key_len]``, with the same ``mask``, ``causal`` (bottom-right by default: the new
queries are the last ``t`` of the ``key_len`` time indices), ``window``, ``sinks`` and
mods. Two ways, one answer:

* attnkit's native kernel reads the pages in place (where the kernel is built, on CPU
  float32 and bf16, with no gradient wanted; a bf16 call on a build without bf16 products
  converts the keys and values as it reads them): its key packing and its ``P V`` product
  follow the page table, nothing is copied first; a decode step (at most
  ``native.DIRECT_ROWS`` query rows per kv head) gives the bits of the same call on a
  contiguous cache, and never uses the value of a key the mask removes for a row (masked
  means removed: :func:`attnkit.attention` zeroes such keys first, which shared pages
  cannot be; a longer block multiplies its weights, 0 included);
* anywhere else (a gradient, float64, another device, a request the kernel refuses) the
  pages are gathered into contiguous tensors (:func:`~attnkit.paged_kv_cache.gather_pages`,
  differentiable in the pools) and :func:`attnkit.attention` runs on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, overload

import torch

from attnkit._validate import check_backend, check_bool, check_float, check_int, check_window
from attnkit.attention import (
    _check_block_mask,
    _check_mask,
    _check_mods,
    attention,
    check_sinks,
)
from attnkit.backends import fast_lane
from attnkit.backends.blockwise import native, plan_cache
from attnkit.block_mask import BlockMask
from attnkit.masks import MaskMod, ScoreMod, normalize_causal
from attnkit.paged_kv_cache import check_page_ids, gather_pages

if TYPE_CHECKING:
    from attnkit.backends.blockwise.plan import TilePlan

__all__ = ["native_reason", "paged_attention", "paged_decode"]


@overload
def paged_attention(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_len: int,
    *,
    mask: torch.Tensor | None = ...,
    causal: bool | str = ...,
    scale: float | None = ...,
    window: int | None = ...,
    mask_mod: MaskMod | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
) -> torch.Tensor: ...


@overload
def paged_attention(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_len: int,
    *,
    mask: torch.Tensor | None = ...,
    causal: bool | str = ...,
    scale: float | None = ...,
    window: int | None = ...,
    mask_mod: MaskMod | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def paged_attention(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_len: int,
    *,
    mask: torch.Tensor | None = None,
    causal: bool | str = True,
    scale: float | None = None,
    window: int | None = None,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` to the first ``key_len`` keys of each row's pages.

    Args:
        query: ``(b, h, t, d)``.
        k_pages: ``(P, h_kv, p, d)`` key pages (one layer of a
            :class:`~attnkit.PagedKVCache`: ``cache.k_pages[layer]``).
        v_pages: ``(P, h_kv, p, d_v)`` value pages.
        page_table: integer ``(b, n)``: row ``i`` the pages of batch row ``i`` in time
            order; ``n * p >= key_len`` and the first ``ceil(key_len / p)`` ids in
            ``[0, P)`` (later columns are not read).
        key_len: the keys each row attends to (time indices ``0 .. key_len - 1``).
        mask, causal, scale, window, mask_mod, score_mod, block_mask, sinks, return_lse,
            backend: as :func:`attnkit.attention`, on the ``(b, h, t, key_len)`` scores
            (``causal`` defaults to True here: bottom-right, the queries are the last
            ``t`` time indices). ``backend`` names the backend of the gathered path;
            ``"auto"`` and ``"blockwise"`` also allow the native kernel.

    Returns:
        ``(b, h, t, d_v)`` (and the log-sum-exp ``(b, h, t)`` with ``return_lse``).

    Raises:
        TypeError / ValueError: naming the bad argument (a page id out of range, a page
            table too short for ``key_len``, shapes that do not fit).
    """
    plain = (
        mask is None and window is None and mask_mod is None and score_mod is None
        and block_mask is None and sinks is None and scale is None and return_lse is False
    )  # fmt: skip
    lane = (
        _lane_key(query, k_pages, v_pages, page_table, key_len, causal, backend) if plain else None
    )
    if lane is not None:
        kept = _lane.get(lane)
        if kept is not None and k_pages.stride(-1) == 1 and v_pages.stride(-1) == 1:
            return _lane_call(kept, query, k_pages, v_pages, page_table)
    _check_pages(query, k_pages, v_pages)
    key_len = check_int(key_len, "key_len")
    _check_page_table(page_table, query.shape[0], k_pages.shape[2], key_len)
    backend = check_backend(backend)
    return_lse = check_bool(return_lse, "return_lse")
    window = check_window(window)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else check_float(scale, "scale")
    check_sinks(sinks, query)
    kwargs = dict(
        mask=mask,
        causal=causal,
        scale=scale,
        window=window,
        mask_mod=mask_mod,
        score_mod=score_mod,
        block_mask=block_mask,
        sinks=sinks,
        return_lse=return_lse,
    )
    plan, _ = _route(query, k_pages, v_pages, key_len, backend, **kwargs)
    if plan is not None:  # (the kernel checks the page ids it reads)
        if lane is not None:
            kept = (plan, [])
            fast_lane.put(_lane, lane, kept)
            return _lane_call(kept, query, k_pages, v_pages, page_table)
        return _native(plan, query, k_pages, v_pages, page_table, None, **kwargs)
    check_page_ids(page_table, key_len, k_pages.shape[2], k_pages.shape[0])
    k, v = gather_pages(k_pages, v_pages, page_table, key_len)  # (b, h_kv, s, d)
    return attention(query, k, v, backend=backend, **kwargs)  # type: ignore[call-overload]


def paged_decode(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_lens: Sequence[int],
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step of sequences of different lengths in one call: row ``i``'s query
    ``(h, 1, d)`` attends to the first ``key_lens[i]`` keys of its pages (its newest token
    and every one before it). What :func:`paged_attention` gives row by row, but one
    kernel call for the whole batch (continuous batching's decode tokens).

    Args:
        query: ``(b, h, 1, d)``.
        k_pages, v_pages, page_table, scale, sinks, backend: as :func:`paged_attention`.
        key_lens: ``b`` ints >= 1, each within its row of the page table.

    Returns:
        ``(b, h, 1, d_v)``.
    """
    _check_pages(query, k_pages, v_pages)
    if query.shape[2] != 1:
        raise ValueError(f"paged_decode takes one query a row, got query {tuple(query.shape)}")
    lens = [check_int(n, "key_lens[i]") for n in key_lens]
    if len(lens) != query.shape[0]:
        raise ValueError(f"key_lens has {len(lens)} lengths for a batch of {query.shape[0]}")
    longest = max(lens)
    _check_page_table(page_table, query.shape[0], k_pages.shape[2], longest)
    backend = check_backend(backend)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else check_float(scale, "scale")
    check_sinks(sinks, query)
    kwargs = dict(
        mask=None,
        causal=False,
        scale=scale,
        window=None,
        mask_mod=None,
        score_mod=None,
        block_mask=None,
        sinks=sinks,
        return_lse=False,
    )
    lengths = torch.tensor(lens, dtype=torch.int64, device=query.device)
    # rows of different lengths: only a decode step (the kernel reads keys and values in
    # place for up to native.DIRECT_ROWS query rows a kv head, float32 or bf16)
    direct = query.shape[1] // k_pages.shape[1] <= native.DIRECT_ROWS
    plan, _ = _route(query, k_pages, v_pages, longest, backend, **kwargs)
    if plan is not None and direct:
        out = _native(plan, query, k_pages, v_pages, page_table, key_lens=lengths, **kwargs)
        return out  # type: ignore[return-value]
    ps = k_pages.shape[2]
    check_page_ids(page_table, lengths, ps, k_pages.shape[0])  # (what each row reads, as
    # the kernel checks; the columns past a row's own pages are gathered as page 0)
    columns = torch.arange(page_table.shape[1], device=page_table.device)
    unread = columns >= (lengths[:, None].to(page_table.device) + ps - 1) // ps  # (b, n)
    k, v = gather_pages(k_pages, v_pages, page_table.masked_fill(unread, 0), longest)
    real = torch.arange(longest, device=query.device) < lengths[:, None]  # (b, s)
    return attention(
        query, k, v, mask=real[:, None, None], scale=scale, sinks=sinks, backend=backend
    )


# (feature "paged lane") A plain call (no mask, mod, block mask, window or sinks; the
# default scale; no LSE; ``causal`` a bool; exact torch.Tensor arguments and an int
# key_len) that the native kernel ran is remembered with its plan under everything its
# checks and route read: the shapes, dtypes and devices of the query, pages and page
# table, key_len, causal, the backend, whether a gradient is wanted and the process state
# the plans are keyed by (plan_cache.process_key). The next call of its key goes straight
# to the kernel: the same plan, so the same bits; the pages' strides are checked each call
# and the page ids by the kernel. On the Xeon of session 28 the checks and the route cost
# about 15 us a call (more after a long step has pushed the interpreter's data out of the
# caches), and at L=4096 they had become most of what a paged step costs over a contiguous
# one, whose attention() call has a lane of its own (backends/fast_lane.py, whose bound
# this lane's keys share: fast_lane.put).
# A key keeps its plan and, for the strides of the call that filled it, the kernel's
# arguments (native.forward_paged's reuse: a later call of those strides only points a
# copy at its tensors).
_lane: dict[tuple, tuple[TilePlan, list]] = {}  # (read without a lock: one dict lookup)


def _lane_call(
    kept: tuple[TilePlan, list],
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
) -> torch.Tensor:
    """A plain call of the lane (``kept``: its key's plan and a list of one ``(strides,
    reuse)``, replaced whole): the same kernel call as :func:`_native`'s, its arguments
    reused where the strides (and ``native.KV_SPLITS``) match."""
    plan, entries = kept
    if query.stride(-1) != 1:
        query = query.contiguous()
    # (and the split of the keys the kept arguments hold, a module setting)
    strides = (query.stride(), k_pages.stride(), v_pages.stride(), native.KV_SPLITS)
    entry = entries[0] if entries else None  # (one read: another thread may replace it)
    if entry is None or entry[0] != strides:
        entry = (strides, [])
        entries[:] = [entry]
    out, _ = native.forward_paged(
        plan, query, k_pages, v_pages, page_table, reuse=entry[1], with_lse=False
    )
    return out if out.dtype == query.dtype else out.to(query.dtype)


def _lane_key(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_len: object,
    causal: object,
    backend: object,
) -> tuple | None:
    """The paged lane's key of a plain call, or None where the lane does not take it (a
    tensor not exactly a ``torch.Tensor``, or not on the CPU: only the native kernel's
    calls are kept; under ``torch.compile``). (``fast_lane.signature``'s checks written
    out for the four tensors, with ``is_cpu`` for their devices: made on every paged step,
    after the kernel's reads have pushed the interpreter's data out of the caches, it took
    about 22 us on the Xeon of session 30.)"""
    if type(key_len) is not int or type(causal) is not bool or type(backend) is not str:
        return None
    q, kp, vp, table = query, k_pages, v_pages, page_table
    if type(q) is not torch.Tensor or type(kp) is not torch.Tensor:
        return None
    if type(vp) is not torch.Tensor or type(table) is not torch.Tensor:
        return None
    if not (q.is_cpu and kp.is_cpu and vp.is_cpu and table.is_cpu):
        return None
    if torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or kp.requires_grad or vp.requires_grad)
    return (
        q.shape, kp.shape, vp.shape, table.shape, q.dtype, kp.dtype, vp.dtype, table.dtype,
        key_len, causal, backend, grad, *plan_cache.process_key(),
    )  # fmt: skip


def _check_pages(query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    for name, x in (("query", query), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {x!r:.60}")
        if x.dim() != 4:
            want = "(b, h, t, d)" if name == "query" else "(num_pages, h_kv, page_size, d)"
            raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")
        if x.dtype != query.dtype or x.device != query.device:
            raise TypeError(
                f"{name} is {x.dtype} on {x.device} but query is {query.dtype} on "
                f"{query.device}: they must match"
            )
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(
            f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must agree in "
            "(num_pages, h_kv, page_size)"
        )
    if k_pages.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"query head_dim ({query.shape[-1]}) must equal the key pages' ({k_pages.shape[-1]})"
        )
    h, h_kv = query.shape[1], k_pages.shape[1]
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")


def _check_page_table(page_table: torch.Tensor, b: int, page_size: int, key_len: int) -> None:
    """The table's type and shape (its ids: :func:`check_page_ids` where the pages are
    gathered, the kernel itself where it reads them in place)."""
    if not isinstance(page_table, torch.Tensor) or page_table.dtype not in (
        torch.int64,
        torch.int32,
    ):
        raise TypeError(f"page_table must be an int64 (or int32) tensor, got {page_table!r:.60}")
    if page_table.dim() != 2 or page_table.shape[0] != b:
        raise ValueError(
            f"page_table must be (batch={b}, pages), got shape {tuple(page_table.shape)}"
        )
    need = -(-key_len // page_size)
    if page_table.shape[1] < need:
        raise ValueError(
            f"page_table has {page_table.shape[1]} pages a row; key_len={key_len} needs "
            f"{need} of page_size {page_size}"
        )


def native_reason(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    key_len: int,
    backend: str,
    **kwargs,
) -> str | None:
    """Why the native kernel does not read these pages in place (None when it does);
    ``kwargs`` are :func:`paged_attention`'s keyword arguments, all of them."""
    return _route(query, k_pages, v_pages, key_len, backend, **kwargs)[1]


def _route(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    key_len: int,
    backend: str,
    **kwargs,
) -> tuple[TilePlan | None, str | None]:
    """``(the native plan, None)``, or ``(None, why the kernel does not run the call)``."""
    why = _refusal(query, k_pages, v_pages, backend, **kwargs)
    if why is not None:
        return None, why
    cache_key = _cache_key(query, k_pages, v_pages, key_len, **kwargs)
    plan = None if cache_key is None else plan_cache.get(cache_key, None)
    if plan is not None:  # planned and accepted before: every layer of a decode step
        return plan, None
    why = _dtype_refusal(query.dtype)
    if why is not None:
        return None, why
    plan = _plan(query, k_pages, key_len, **kwargs)
    why = native.why_not(plan, query.dtype, query.shape[-1], v_pages.shape[-1], paged=True)
    if why is None and cache_key is not None:
        plan_cache.put(cache_key, plan)
    return (plan, None) if why is None else (None, why)


def _cache_key(
    query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, key_len: int, **kwargs
) -> tuple | None:
    """The :mod:`~attnkit.backends.blockwise.plan_cache` key of a call with no mask, mod or
    block mask, whose plan is a function of its sizes and options alone (None for any
    other: planned every time). (_refusal has passed: no gradient is wanted.)"""
    if any(kwargs[name] is not None for name in ("mask", "mask_mod", "score_mod", "block_mask")):
        return None
    if torch.compiler.is_compiling():
        return None
    return (
        "paged", query.shape, query.dtype, query.device, k_pages.shape[1], k_pages.shape[-1],
        v_pages.shape[-1], key_len, kwargs["scale"], kwargs["causal"], kwargs["window"],
        *plan_cache.process_key(),
    )  # fmt: skip


def _refusal(
    query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, backend: str, **kwargs
) -> str | None:
    """Why the kernel does not run the call, from what no plan or build decides."""
    if backend not in ("auto", "blockwise"):
        return f"backend={backend!r} (the native kernel is 'auto' or 'blockwise')"
    if query.device.type != "cpu":
        return "not a CPU tensor"
    if torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (query, k_pages, v_pages, kwargs["sinks"])
    ):
        return "a gradient is wanted (the kernel reads pages in its forward only)"
    if kwargs["score_mod"] is not None and getattr(kwargs["score_mod"], "relative", None) is None:
        return "a score_mod that is not a relative bias"
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        return "pages whose last dim is strided"
    if kwargs["scale"] <= 0.0:
        return "a scale <= 0"
    return None


def _dtype_refusal(dtype: torch.dtype) -> str | None:
    """Why the loaded build does not read ``dtype`` (asked where a call is planned: a kept
    plan's key holds the dtype and the build)."""
    if not (dtype == torch.float32 or (dtype == torch.bfloat16 and native.reads_bf16())):
        return f"{dtype} (the kernel reads float32 and bf16)"
    return None


def _plan(query: torch.Tensor, k_pages: torch.Tensor, key_len: int, **kwargs):
    """The blockwise plan of the call, as if the keys were ``(b, h_kv, key_len, d)``."""
    from attnkit.backends.blockwise.plan import NATIVE_CPU, build_plan

    b, h_kv, d = query.shape[0], k_pages.shape[1], k_pages.shape[-1]
    shape_only = k_pages.new_empty(()).expand(b, h_kv, key_len, d)  # no memory
    mask = _check_mask(kwargs["mask"], query, shape_only)
    if kwargs["mask_mod"] is not None or kwargs["score_mod"] is not None:
        _check_mods(kwargs["mask_mod"], kwargs["score_mod"], query, shape_only)
    _check_block_mask(kwargs["block_mask"], query, shape_only)
    return build_plan(
        query,
        shape_only,
        scale=kwargs["scale"],
        causal=normalize_causal(kwargs["causal"]),
        window=kwargs["window"],
        mask=mask,
        mask_mod=kwargs["mask_mod"],
        score_mod=kwargs["score_mod"],
        block_mask=kwargs["block_mask"],
        engine=NATIVE_CPU,
    )


def _native(
    plan: TilePlan,
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_lens: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from attnkit.backends.blockwise.merge import add_sinks

    q = query if query.stride(-1) == 1 else query.contiguous()
    out, lse = native.forward_paged(plan, q, k_pages, v_pages, page_table, key_lens)
    if kwargs["sinks"] is not None:
        out, lse = add_sinks(out, lse, kwargs["sinks"], plan.h)
    if out.dtype != query.dtype:
        out = out.to(query.dtype)
    return (out, lse) if kwargs["return_lse"] else out
