"""The fused engine's forward for masks that depend on ``q_pos - k_pos`` only.

Causal, a sliding window and a relative bias (``masks.alibi``, ``masks.relative_bias``:
mods that declare ``relative``) give each (query, key) pair a value
``f(head, q_pos - k_pos)``: ``-inf`` where causal/window drop the pair, else the bias.
Such a mask is Toeplitz, and two layouts of the kernel calls need no mask tile per
(query block, key block):

* **band** (a window, or a block mask that is a function of ``q_idx - kv_idx`` with a
  narrow support, as a sliding window written as a mod): every query block of ``bq``
  rows sees the same ``L`` keys relative to its first row, so all blocks go into ONE
  kernel call: the queries viewed as ``(n, h, bq, d)``, the keys as an *overlapping*
  strided view ``(n, h_kv, L, d)`` of the key tensor, and one ``(h|1, bq, L)`` mask
  shared by every block; the few blocks that reach past either end of the keys (or of
  the queries) are gathered into a second call with their own masks::

      keys  ...[ block 0's L keys ]...
                 [ block 1's L keys ]...        (views into one tensor, no copies)
                    [ block 2's L keys ]

* **rows** (no window): query block ``[q0, q1)`` sees keys ``[lo, hi)``. With the keys
  in reverse order, ``f(q_pos - k_pos)`` is ``g[i + j]`` for one vector ``g`` per head, and
  ``g.unfold`` is the ``(bq, L)`` mask as a view: no ``bq x L`` tensor is written.

The kernel adds the same float mask the general path would build, so results match it
to rounding. Only the forward runs here; the backward (from the output and
log-sum-exp, whatever computed them) is the engine's usual one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.backends.blockwise import plan as _plan
from attnkit.backends.blockwise.plan import Band, TilePlan

#: torch's fused CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``),
#: as :mod:`.flash_cpu` hands it in.
Kernel = Callable[..., Any]


def layout(plan: TilePlan) -> str | None:
    """``"band"``, ``"rows"`` or None (the general path) for a fused plan. Under
    ``torch.compile`` the general path runs (the layouts branch on data)."""
    if not plan.fused or plan.mask is not None or plan.mask_mod is not None:
        return None
    if torch.compiler.is_compiling():
        return None
    if plan.block_mask is not None and plan.block_mask.toeplitz() is None:
        return None
    relative = None if plan.score_mod is None else getattr(plan.score_mod, "relative", None)
    if plan.score_mod is not None and relative is None:
        return None
    band = key_band(plan)
    if band is not None:
        narrow = plan.window is not None or band[1] - band[0] < plan.s // 4
        return "band" if narrow and plan.t >= 4 * _plan.BAND_BLOCK_Q else None
    return "rows" if relative is not None and plan.block_mask is None else None


def key_band(plan: TilePlan) -> tuple[int, int] | None:
    """``(a, b)``: query ``i`` can see keys ``i + a .. i + b`` only (causal/window with the
    plan's offset, a Toeplitz block mask's kept differences); None = unbounded."""
    band = plan.band
    if plan.block_mask is not None:
        lo, keep = plan.block_mask.toeplitz()  # type: ignore[misc]
        hi = lo + keep.numel() - 1  # kept differences q - kv in [lo, hi]
        band = band & Band(-hi, -lo)
    if band.lo is None or band.hi is None:
        return None
    return band.lo, max(band.lo, band.hi)


def forward(plan: TilePlan, layout: str, kernel: Kernel, q, k, v, out, lse) -> None:
    """Fill ``out`` ``(b, h, t, d_v)`` and ``lse`` ``(b, h, t)`` in ``layout`` (what
    :func:`layout` said for this plan).

    ``q``, ``k``, ``v`` are the engine's ``(b, heads, len, d)`` views in the kernel dtype.
    """
    if layout == "band":
        for bi in range(plan.b):
            _band(plan, kernel, q[bi], k[bi], v[bi], out[bi], lse[bi])
    elif layout == "rows":
        _rows(plan, kernel, q, k, v, out, lse)
    else:
        raise ValueError(f"unknown Toeplitz layout {layout!r}")


def _values(plan: TilePlan, delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask value of each pair ``delta = i - j`` (query index minus key index)
    ``(..., n)``: ``(h|1, ..., n)`` float, ``-inf`` where causal/window (which see query
    ``i`` at key position ``i + offset``) or the block mask drop the pair, else the
    relative bias (or 0)."""
    pos = delta + plan.offset
    keep = torch.ones_like(delta, dtype=torch.bool)
    if plan.causal:
        keep &= pos >= 0
    if plan.window is not None:
        keep &= pos < plan.window
        if not plan.causal:
            keep &= pos > -plan.window
    if plan.block_mask is not None:
        lo, table = plan.block_mask.toeplitz()  # type: ignore[misc]
        n = delta - lo
        inside = (n >= 0) & (n < table.numel())
        keep &= inside & table.to(delta.device)[n.clamp(0, table.numel() - 1)]
    relative = getattr(plan.score_mod, "relative", None)
    if relative is None:
        base = torch.zeros(1, *delta.shape, dtype=dtype, device=delta.device)
    else:
        # the mods see query i at q_base + i and key j at k_base + j
        kv_minus_q = plan.k_base - plan.q_base - delta.reshape(-1)
        flat = relative(kv_minus_q, dtype)  # (h, n)
        base = flat.reshape(flat.shape[0], *delta.shape)
    return base.masked_fill(~keep, float("-inf"))


def _call(
    kernel: Kernel, q, k, v, mask, scale: float, alive: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on ``(B, h, bq, d)`` queries; rows not ``alive`` (``(B|1, h|1, bq)``: the
    mask keeps no key of theirs) get output 0 and log-sum-exp ``-inf`` (the kernel
    itself would report 0)."""
    o, lse = kernel(q, k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
    if not bool(alive.all()):
        o = o.masked_fill(~alive.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(~alive, float("-inf"))
    return o, lse


def _alive(mask: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(mask).any(-1)  # (B|1, h|1, bq)


def _band(plan: TilePlan, kernel: Kernel, q, k, v, out, lse) -> None:
    """One batch element (``q`` ``(h, t, d)``...) of the band layout."""
    bq, t, s = _plan.BAND_BLOCK_Q, plan.t, plan.s
    band = key_band(plan)
    assert band is not None
    first, last = band  # query i sees keys i + first .. i + last at most
    width = bq + last - first  # keys per block: L
    n = -(-t // bq)
    # interior blocks [lo, hi): all their keys and rows exist, so they are views
    lo = min(n, max(0, -(first // bq)))  # ceil(-first / bq)
    hi = max(lo, min(n, (s - width - first) // bq + 1, t // bq))

    def blocks(x: torch.Tensor, start: int, count: int, length: int) -> torch.Tensor:
        """``(heads, len, d)`` -> ``(count, heads, length, d)``, block m starting at
        ``start + m * bq`` (a view; the key views overlap)."""
        sh, st, sd = x.stride()
        return x.as_strided(
            (count, x.shape[0], length, x.shape[2]),
            (bq * st, sh, st, sd),
            x.storage_offset() + start * st,
        )

    i = torch.arange(bq, device=q.device).view(-1, 1)
    j = torch.arange(width, device=q.device).view(1, -1)
    # block m's row i is query m*bq + i, its key j key m*bq + first + j: i - j - first
    shared = _values(plan, i - j - first, q.dtype).unsqueeze(0)  # (1, h|1, bq, L)

    def put(o: torch.Tensor, m: torch.Tensor, at: torch.Tensor | slice) -> None:
        """Blocks' ``(count, h, bq, ...)`` results into ``out``/``lse`` rows (past t dropped)."""
        rows = (torch.arange(n * bq, device=q.device).view(n, bq)[at]).flatten()
        keep = rows < t
        o = o.transpose(0, 1).reshape(plan.h, -1, o.shape[-1])  # (h, count * bq, d_v)
        m = m.transpose(0, 1).reshape(plan.h, -1)
        if isinstance(at, slice):
            out[:, at.start * bq : at.stop * bq] = o
            lse[:, at.start * bq : at.stop * bq] = m
        else:
            out[:, rows[keep]] = o[:, keep].to(out.dtype)
            lse[:, rows[keep]] = m[:, keep]

    if hi > lo:
        put(
            *_call(
                kernel,
                blocks(q, lo * bq, hi - lo, bq),
                blocks(k, first + lo * bq, hi - lo, width),
                blocks(v, first + lo * bq, hi - lo, width),
                shared,
                plan.scale,
                _alive(shared),
            ),
            slice(lo, hi),
        )
    edge = torch.cat((torch.arange(lo), torch.arange(hi, n))).to(q.device)
    if edge.numel():  # blocks past an end: gathered (few), the missing keys/rows masked
        k_pos = (edge * bq + first).view(-1, 1, 1) + j  # (e, 1, L)
        rows = (edge * bq).view(-1, 1, 1) + i  # (e, bq, 1)
        outside = (k_pos < 0) | (k_pos >= s) | (rows >= t)  # (e, bq, L)
        mask = shared.masked_fill(outside.unsqueeze(1), float("-inf"))  # (e, h|1, bq, L)
        kk, rr = k_pos.flatten().clamp(0, s - 1), rows.flatten().clamp(0, t - 1)

        def gather(x: torch.Tensor, at: torch.Tensor, length: int) -> torch.Tensor:
            return x[:, at].view(x.shape[0], -1, length, x.shape[-1]).transpose(0, 1)

        put(
            *_call(
                kernel, gather(q, rr, bq), gather(k, kk, width), gather(v, kk, width),
                mask, plan.scale, _alive(mask),
            ),
            edge,
        )  # fmt: skip


def _rows(plan: TilePlan, kernel: Kernel, q, k, v, out, lse) -> None:
    """The rows layout: one kernel call per query block over its keys, reversed."""
    k_rev, v_rev = k.flip(-2), v.flip(-2)  # (b, h_kv, s, d); key j sits at s - 1 - j
    s = plan.s
    step = _plan.ROWS_BLOCK_Q
    for q0 in range(0, plan.t, step):
        q1 = min(q0 + step, plan.t)
        lo, hi = plan.k_range(q0, q1)
        if lo >= hi:
            continue  # rows seeing no key keep out 0, lse -inf
        bq, width = q1 - q0, hi - lo
        # reversed key j' is key hi - 1 - j': i - j = (i + j') + q0 - hi + 1
        m_idx = torch.arange(bq + width - 1, device=q.device)
        g = _values(plan, m_idx + (q0 - hi + 1), q.dtype)  # (h|1, bq + L - 1)
        mask = g.unfold(-1, width, 1).unsqueeze(0)  # (1, h|1, bq, L), a view of g
        # row i keeps a key when g[i : i + L] holds a finite value
        seen = F.pad(torch.isfinite(g).cumsum(-1), (1, 0))  # (h|1, bq + L)
        alive = (seen[..., width:] - seen[..., :bq] > 0).unsqueeze(0)  # (1, h|1, bq)
        o, m = _call(
            kernel,
            q[:, :, q0:q1],
            k_rev[:, :, s - hi : s - lo],
            v_rev[:, :, s - hi : s - lo],
            mask,
            plan.scale,
            alive,
        )
        out[:, :, q0:q1] = o.to(out.dtype)
        lse[:, :, q0:q1] = m
