"""The fused-CPU engine: torch's flash kernel, called once per key tile, merged by LSE.

torch's CPU flash-attention kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``)
returns the log-sum-exp beside the output, and its backward takes the output and
log-sum-exp as arguments. That is all a blockwise kernel needs from a tile, so this
engine runs the kernel on each key tile of :meth:`TilePlan.tiles` and merges the tiles
with :func:`merge_partials`. Its backward calls the fused backward once per tile with
the *merged* ``O`` and ``lse``: that recomputes exactly the tile's weights
``exp(S_j - lse)``, so the per-tile ``dQ``, ``dK``, ``dV`` add up to the full gradient.

Tiles of one query block (key positions ``first .. last`` of its queries)::

    keys:  lo ........ first-w+1 .... last-w+1 ........ first ...... last+1 = hi
           [ left edge: window ][ interior: every query keeps ][ causal square ]
             explicit mask           no mask at all              is_causal=True

A masked tile gets an explicit float mask (``-inf`` where masked, plus any bias); the
square takes its mask together with ``is_causal``. A query row that keeps no key of a
tile gets ``lse_j = -inf`` (the kernel itself would report 0).
"""

from __future__ import annotations

from typing import Any

import torch

from attnkit.backends.blockwise import native, toeplitz
from attnkit.backends.blockwise.merge import merge_partials
from attnkit.backends.blockwise.native import calibrate
from attnkit.backends.blockwise.plan import NATIVE_CPU, Tile, TilePlan, acc_dtype

_FORWARD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD: Any = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether this torch has the fused CPU kernel (any torch from 2.2)."""
    return _FORWARD is not None and _BACKWARD is not None


def why_not(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod, extra: tuple
) -> str | None:
    """Why the fused engine cannot run a call exactly (None when it can).

    It needs the CPU kernel, CPU tensors of a supported dtype, at least one query and
    key, value heads as wide as the query's (the kernel's rule), and a ``score_mod`` that
    is additive with no tensor wanting a gradient (its bias becomes a mask tile).
    """
    if not available():
        return "this torch has no fused CPU flash kernel"
    if query.device.type != "cpu" or query.dtype not in _DTYPES:
        return "the fused kernel runs CPU tensors of float dtypes"
    if key.shape[-2] == 0 or query.shape[-2] == 0:
        return "no queries or no keys"
    if value.shape[-1] != query.shape[-1]:
        return "the fused kernel needs value heads as wide as the query's"
    if extra or (score_mod is not None and not getattr(score_mod, "additive", False)):
        return "a score_mod that is not a fixed additive bias"
    return None


def engine_views(
    plan: TilePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, upcast: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(b, h, t, d)`` views, half precision upcast to float32 (one ``O(t d)`` copy each;
    ``upcast=False`` keeps the dtype): the kernel's own bf16 backward is measurably less
    accurate than plain bf16 math. The kernel reads the last dim as contiguous: a strided
    one (``kv[..., ::2]``) is copied."""
    acc = acc_dtype(q.dtype) if upcast else q.dtype

    def fix(x: torch.Tensor, n: int, lead: int) -> torch.Tensor:
        if x.shape[:-1] != (plan.b, lead, n):  # (no reshape where it is one already)
            x = x.reshape(plan.b, lead, n, x.shape[-1])
        if x.dtype != acc:
            x = x.to(acc)
        return x if x.stride(-1) == 1 else x.contiguous()

    return fix(q, plan.t, plan.h), fix(k, plan.s, plan.h_kv), fix(v, plan.s, plan.h_kv)


def native_views(
    plan: TilePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`engine_views` as the native kernel reads them: bf16 inputs as they are where
    the plan's engines compute with bf16 products (``engines.bf16``), anything else
    upcast (its forward, its backward and the fast lane's kept calls alike)."""
    engines = plan.engines
    return engine_views(plan, q, k, v, upcast=engines is None or not engines.bf16)


def _kernel_mask(
    plan: TilePlan, q0: int, q1: int, tile: Tile, dtype: torch.dtype, device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The tile's float mask ``(b|1, h|1, bq, bk)`` for the kernel (None when unmasked) and
    the rows keeping at least one key ``(b|1, h|1, bq, 1)`` (None when all do)."""
    if not tile.masked:
        return None, None
    bq, bk = q1 - q0, tile.k1 - tile.k0
    mask = torch.zeros((), dtype=dtype, device=device)
    if tile.bias is not None:
        mask = tile.bias.to(dtype)
    if tile.keep is not None:
        mask = mask.masked_fill(~tile.keep, float("-inf"))
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    mask = mask.expand(*mask.shape[:2], bq, bk)  # the kernel wants (.., bq, bk)
    # a row is alive when ONE key survives every mask at once (the triangle included)
    finite = ~torch.isneginf(mask)
    keep = plan.full_keep(q0, q1, Tile(tile.k0, tile.k1, tile.square), device)
    if keep is not None:
        finite = finite & keep
    return mask, finite.any(-1, keepdim=True)


# ---------------------------------------------------------------------------------------
# Gathered calls: many query tiles in one kernel call
# ---------------------------------------------------------------------------------------
#
# Where most query tiles see as many keys (a sliding window, documents, a banded block
# mask: at most a third as many distinct counts as tiles), tiles are grouped by that count; each group's keys are
# gathered into a ``(tiles, keys)`` layout (one O(keys x d) copy) and the group runs as
# ONE kernel call with the tiles in the batch dimension and each tile's mask beside it.
# Every tile then sees all its keys in one call: no merge. Few large calls instead of
# hundreds of small ones also keep the kernel's threads in step on a busy machine.
# The backward does the same and scatter-adds the gathered key gradients back.

#: The most float mask elements of one gathered group (bounded memory).
GATHER_MASK_ELEMENTS = 1 << 24


class _Group:
    """Query tiles of one gathered call: their rows ``(n, bq)``, their keys ``(n, L)``
    and the float mask ``(n, b|1, h|1, bq, L)``, or None with ``causal``: every tile is
    one causal square (documents), run with the kernel's ``is_causal``."""

    def __init__(
        self, rows: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> None:
        self.rows, self.keys, self.mask, self.causal = rows, keys, mask, causal


def _gather_plan(plan: TilePlan, dtype: torch.dtype, device) -> list[_Group] | None:
    """The groups of a gathered run, or None when batching query tiles would not pay
    (few tiles, or tiles seeing very different numbers of keys, as plain causal)."""
    blocks = plan.q_blocks()
    if len(blocks) < 4:
        return None
    per_len: dict[tuple[int, int], list[tuple[int, int, list[Tile]]]] = {}
    for q0, q1 in blocks:
        tiles = plan.tiles(q0, q1, dtype, device)
        n_keys = sum(t.k1 - t.k0 for t in tiles)
        per_len.setdefault((q1 - q0, n_keys), []).append((q0, q1, tiles))
    if len(per_len) > len(blocks) // 3:
        return None
    lead = plan.mask_lead()
    groups = []
    for (bq, width), members in per_len.items():
        if width == 0:
            continue
        rows = torch.stack([torch.arange(q0, q1, device=device) for q0, q1, _ in members])
        if all(len(ts) == 1 and ts[0].square and not ts[0].masked for _, _, ts in members):
            keys = torch.stack([torch.arange(ts[0].k0, ts[0].k1) for _, _, ts in members])
            groups.append(_Group(rows, keys.to(device), None, causal=True))
            continue
        if len(members) * lead * bq * width > GATHER_MASK_ELEMENTS:
            return None
        keys = torch.zeros(len(members), width, dtype=torch.long, device=device)
        masks = []
        for n, (q0, q1, tiles) in enumerate(members):
            parts, at = [], 0
            for tile in tiles:
                bk = tile.k1 - tile.k0
                keys[n, at : at + bk] = torch.arange(tile.k0, tile.k1, device=device)
                m, _ = _kernel_mask(plan, q0, q1, tile, dtype, device)
                tri = plan.full_keep(q0, q1, tile, device) if tile.square else None
                if tri is not None:  # the square's triangle, explicit here
                    base = torch.zeros(bq, bk, dtype=dtype, device=device) if m is None else m
                    m = base.masked_fill(~tri, float("-inf"))
                if m is None:
                    m = torch.zeros(1, 1, bq, bk, dtype=dtype, device=device)
                parts.append(m)
                at += bk
            parts = [p.view(*([1] * (4 - p.dim())), *p.shape) for p in parts]
            shape = torch.broadcast_shapes(*(p.shape[:2] for p in parts))
            masks.append(torch.cat([p.expand(*shape, bq, p.shape[-1]) for p in parts], -1))
        shape = torch.broadcast_shapes(*(m.shape[:2] for m in masks))
        mask = torch.stack([m.expand(*shape, bq, width) for m in masks])  # (n, b|1, h|1, bq, L)
        groups.append(_Group(rows, keys, mask, causal=False))
    return groups


def _rows_of(plan: TilePlan, group: _Group, x: torch.Tensor) -> torch.Tensor:
    """``(b, heads, t, d)`` -> the group's query tiles ``(n*b, heads, bq, d)``."""
    n, bq = group.rows.shape
    g = x[:, :, group.rows.flatten()]
    g = g.view(plan.b, x.shape[1], n, bq, x.shape[-1]).permute(2, 0, 1, 3, 4)
    return g.reshape(n * plan.b, x.shape[1], bq, x.shape[-1])


def _keys_of(plan: TilePlan, group: _Group, x: torch.Tensor) -> torch.Tensor:
    """``(b, h_kv, s, d)`` -> the group's gathered keys ``(n*b, h_kv, L, d)``."""
    n, width = group.keys.shape
    g = x[:, :, group.keys.flatten()]
    g = g.view(plan.b, x.shape[1], n, width, x.shape[-1]).permute(2, 0, 1, 3, 4)
    return g.reshape(n * plan.b, x.shape[1], width, x.shape[-1])


def _group_mask(plan: TilePlan, group: _Group) -> torch.Tensor | None:
    n = group.rows.shape[0]
    mask = group.mask  # (n, b|1, h|1, bq, L)
    if mask is None:
        return None
    return mask.expand(n, plan.b, *mask.shape[2:]).reshape(n * plan.b, *mask.shape[2:])


def _to_rows(plan: TilePlan, group: _Group, x: torch.Tensor) -> torch.Tensor:
    """``(n*b, h, bq, ...)`` -> ``(b, h, n*bq, ...)`` in the order of ``group.rows``."""
    n, bq = group.rows.shape
    x = x.reshape(n, plan.b, plan.h, bq, -1).permute(1, 2, 0, 3, 4)
    return x.reshape(plan.b, plan.h, n * bq, -1)


def _gathered_forward(plan: TilePlan, groups: list[_Group], q, k, v, out, lse) -> None:
    for group in groups:
        mask = _group_mask(plan, group)
        o, l_ = _FORWARD(
            _rows_of(plan, group, q),
            _keys_of(plan, group, k),
            _keys_of(plan, group, v),
            0.0,
            group.causal,
            attn_mask=mask,
            scale=plan.scale,
        )[:2]
        if mask is not None:  # (a causal square keeps every row's diagonal key)
            alive = ~torch.isneginf(mask).all(-1)  # (n*b, h|1, bq)
            o = o.masked_fill(~alive.unsqueeze(-1), 0.0)
            l_ = l_.masked_fill(~alive, float("-inf"))
        rows = group.rows.flatten()
        out[:, :, rows] = _to_rows(plan, group, o).to(out.dtype)
        lse[:, :, rows] = _to_rows(plan, group, l_).squeeze(-1).to(lse.dtype)


def _gathered_backward(
    plan: TilePlan, groups: list[_Group], q, k, v, out, lse, grad_out, dq, dk, dv
) -> None:
    for group in groups:
        g_q, g_k, g_v = _BACKWARD(
            _rows_of(plan, group, grad_out),
            _rows_of(plan, group, q),
            _keys_of(plan, group, k),
            _keys_of(plan, group, v),
            _rows_of(plan, group, out),
            _rows_of(plan, group, lse.unsqueeze(-1)).squeeze(-1).contiguous(),
            0.0,
            group.causal,
            attn_mask=_group_mask(plan, group),
            scale=plan.scale,
        )
        dq[:, :, group.rows.flatten()] += _to_rows(plan, group, g_q)
        n, width = group.keys.shape
        keys = group.keys.flatten()
        for grad, acc in ((g_k, dk), (g_v, dv)):
            grad = grad.reshape(n, plan.b, plan.h_kv, width, -1).permute(1, 2, 0, 3, 4)
            acc.index_add_(2, keys, grad.reshape(plan.b, plan.h_kv, n * width, -1))


def forward(plan: TilePlan, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out (b, h, t, d_v), lse (b, h, t))`` in the accumulation dtype (float32
    for half inputs), as the tile engine."""
    acc = acc_dtype(q.dtype)
    engines = plan.engines
    if engines is not None and engines.forward == NATIVE_CPU:
        return native.forward(plan, *native_views(plan, q, k, v))
    layout = toeplitz.layout(plan)
    whole_keys = None if layout is not None else _whole_call(plan, acc, q.device)
    # One whole call may read bf16 as it is: the kernel accumulates in float32 and rounds
    # the output once, as plain bf16 math does; where torch runs its bf16 products on the
    # CPU's bf16 units that is faster than float32 copies (the Xeon of session 37, AMX:
    # causal T=4096 13 ms, 44 ms on copies), elsewhere slower (measured once:
    # calibrate.flash_reads_bf16). Tiles merged in bf16 would round once per tile: those,
    # and every backward, read float32.
    bf16 = whole_keys is not None and q.dtype == torch.bfloat16 and calibrate.flash_reads_bf16()
    q, k, v = engine_views(plan, q, k, v, upcast=not bf16)
    b, h, dv = plan.b, plan.h, v.shape[-1]
    if whole_keys is not None:
        whole = _one_call(plan, whole_keys, q, k, v)  # (contiguous, as the general path's)
        return whole[0].to(acc).contiguous(), whole[1].to(acc).contiguous()
    if layout == "band":  # writes every row: no need to clear them first
        out = torch.empty(b, h, plan.t, dv, dtype=acc, device=q.device)
        lse = torch.empty((b, h, plan.t), dtype=acc, device=q.device)
    else:
        out = torch.zeros(b, h, plan.t, dv, dtype=acc, device=q.device)
        lse = torch.full((b, h, plan.t), float("-inf"), dtype=acc, device=q.device)
    if layout is not None:
        toeplitz.forward(plan, layout, _FORWARD, q, k, v, out, lse)
        return out, lse
    groups = _gather_plan(plan, q.dtype, q.device)
    if groups is not None:
        _gathered_forward(plan, groups, q, k, v, out, lse)
        return out, lse
    for q0, q1 in plan.q_blocks():
        qt = q[:, :, q0:q1]  # (b, h, bq, d)
        o: torch.Tensor | None = None
        m: torch.Tensor | None = None
        for tile in plan.tiles(q0, q1, q.dtype, q.device):
            mask, alive = _kernel_mask(plan, q0, q1, tile, q.dtype, q.device)
            k0, k1 = tile.k0, tile.k1
            o_j, l_j = _FORWARD(
                qt,
                k[:, :, k0:k1],
                v[:, :, k0:k1],
                0.0,
                tile.square,
                attn_mask=mask,
                scale=plan.scale,
            )
            if alive is not None:  # rows keeping no key here: the kernel says lse 0
                o_j = o_j.masked_fill(~alive, 0.0)
                l_j = l_j.masked_fill(~alive.squeeze(-1), float("-inf"))
            if o is None or m is None:
                o, m = o_j, l_j
            else:
                o, m = merge_partials(o, m, o_j, l_j)
        if o is not None and m is not None:
            out[:, :, q0:q1] = o.to(acc)
            lse[:, :, q0:q1] = m
    return out, lse


def _whole_call(
    plan: TilePlan, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, bool] | None:
    """Where the plan is ONE unmasked kernel call over every query (a decode step, a short
    dense call: one query block, one tile; any call without a mask over every key or
    causal from key 0), that call's keys ``(k0, k1, is_causal)``; else None. The general
    loop computes the same, into buffers it clears and copies into (four more tensor ops:
    as much as the kernel of a short call).

    A plan without a mask of any kind decides from its shapes alone: the answer is kept in
    ``plan.memo`` (a cached plan's repeated calls, token after token, ask once)."""
    memo = plan.mask is None and not plan.materialises() and not torch.compiler.is_compiling()
    if memo and "flash-cpu-whole" in plan.memo:
        return plan.memo["flash-cpu-whole"]
    whole = None
    band = plan.band
    if not plan.materialises() and band.lo is None and band.hi in (None, 0):
        # no mask, every key or top-left causal (the kernel's own is_causal; every row
        # keeps key 0): one call over every query, however many blocks the plan has
        whole = (0, plan.s, band.hi == 0)
    elif len(blocks := plan.q_blocks()) == 1 and blocks[0] == (0, plan.t):
        tiles = plan.tiles(0, plan.t, dtype, device)
        if len(tiles) == 1 and not tiles[0].masked:  # every row keeps a key of it
            whole = (tiles[0].k0, tiles[0].k1, tiles[0].square)
    if memo:
        plan.memo["flash-cpu-whole"] = whole
    return whole


def _one_call(
    plan: TilePlan, keys: tuple[int, int, bool], q, k, v
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` straight from the kernel over ``keys`` (:func:`_whole_call`'s)."""
    k0, k1, square = keys
    if (k0, k1) != (0, plan.s):  # (a slice is a tensor op too: none for every key)
        k, v = k[:, :, k0:k1], v[:, :, k0:k1]
    return _FORWARD(q, k, v, 0.0, square, attn_mask=None, scale=plan.scale)


def backward(plan: TilePlan, q, k, v, out, lse, grad_out) -> tuple[torch.Tensor, ...]:
    """Return ``(dq, dk, dv)``: one fused backward per forward tile, summed. ``out`` and
    ``lse`` are the totals (sinks included)."""
    acc = acc_dtype(q.dtype)
    shapes, dtypes = (q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype)
    q, k, v = engine_views(plan, q, k, v)
    out = out.reshape(plan.b, plan.h, plan.t, v.shape[-1]).to(acc).contiguous()
    grad_out = grad_out.reshape(out.shape).to(acc).contiguous()
    lse = lse.reshape(plan.b, plan.h, plan.t).to(acc)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # dead rows: weights exp(-inf)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    groups = _gather_plan(plan, q.dtype, q.device)
    if groups is not None:
        _gathered_backward(plan, groups, q, k, v, out, lse, grad_out, dq, dk, dv)
    for q0, q1 in [] if groups is not None else plan.q_blocks():
        qt, ot, gt = q[:, :, q0:q1], out[:, :, q0:q1], grad_out[:, :, q0:q1]
        lt = lse[:, :, q0:q1].contiguous()
        for tile in plan.tiles(q0, q1, q.dtype, q.device):
            mask, _ = _kernel_mask(plan, q0, q1, tile, q.dtype, q.device)
            k0, k1 = tile.k0, tile.k1
            g_q, g_k, g_v = _BACKWARD(
                gt,
                qt,
                k[:, :, k0:k1],
                v[:, :, k0:k1],
                ot,
                lt,
                0.0,
                tile.square,
                attn_mask=mask,
                scale=plan.scale,
            )
            dq[:, :, q0:q1] += g_q
            dk[:, :, k0:k1] += g_k
            dv[:, :, k0:k1] += g_v
    return tuple(
        g.to(dt).reshape(shape) for g, dt, shape in zip((dq, dk, dv), dtypes, shapes, strict=True)
    )
