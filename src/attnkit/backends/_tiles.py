"""Tile planning for the blockwise backend: layout, skipping and per-tile masks.

Notation: ``b`` batch (leading dims flattened), ``h`` query heads, ``h_kv`` key/value
heads, ``g = h // h_kv`` query heads per kv head, ``t`` queries, ``s`` keys.

GQA without a copy: a query tile is viewed as ``(b, h_kv, g, bq, d)`` and a key tile
as ``(b, h_kv, 1, bk, d)``; ``matmul`` broadcasts the key over the ``g`` query heads
that share it. Scores are then viewed as ``(b, h, bq, bk)`` for masks and mods.

A tile is *skipped* when no query in it may attend to any key in it: causal and
window bounds are computed from indices (no tensor); a bool mask or a ``mask_mod``
is evaluated on the tile and the tile skipped when it keeps nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnkit.backends import AttentionCall
from attnkit.masks import MaskMod, ScoreMod, position_keep


@dataclass
class TilePlan:
    """Everything the kernels need to know besides the tensors."""

    b: int
    h: int
    h_kv: int
    t: int
    s: int
    scale: float
    causal: bool
    offset: int  # aligned position of query i is i + offset
    window: int | None
    mask: torch.Tensor | None  # (b|1, h|1, t|1, s|1) bool or float
    mask_mod: MaskMod | None
    score_mod: ScoreMod | None
    block_q: int
    block_k: int
    #: Run the tiles on torch's fused CPU kernel (``_fused_tiles``) instead of PyTorch ops.
    fused: bool = False

    @property
    def groups(self) -> int:
        return self.h // self.h_kv

    def q_blocks(self) -> list[tuple[int, int]]:
        return [(i, min(i + self.block_q, self.t)) for i in range(0, self.t, self.block_q)]

    def k_range(self, q0: int, q1: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` that any query in ``[q0, q1)`` may reach by causal/window."""
        lo, hi = 0, self.s
        first, last = q0 + self.offset, q1 - 1 + self.offset  # aligned positions
        if self.causal:
            hi = min(hi, last + 1)
        elif self.window is not None:
            hi = min(hi, last + self.window)
        if self.window is not None:
            lo = max(lo, first - self.window + 1)
        return lo, max(lo, hi)

    def k_blocks(self, q0: int, q1: int) -> list[tuple[int, int]]:
        lo, hi = self.k_range(q0, q1)
        return [(j, min(j + self.block_k, hi)) for j in range(lo, hi, self.block_k)]

    def _bounds_mask(self, q0: int, q1: int, k0: int, k1: int, device: torch.device):
        """``(bq, bk)`` bool for causal/window inside this tile, or None if the tile is all in."""
        first, last = q0 + self.offset, q1 - 1 + self.offset
        inside = True
        if self.causal and k1 - 1 > first:
            inside = False
        if self.window is not None:
            if k0 <= last - self.window:
                inside = False
            if not self.causal and k1 - 1 >= first + self.window:
                inside = False
        if inside:
            return None
        pos = torch.arange(q0, q1, device=device).unsqueeze(-1) + self.offset  # (bq, 1)
        kv = torch.arange(k0, k1, device=device)  # (bk,)
        return position_keep(pos, kv, causal=self.causal, window=self.window)  # (bq, bk)

    def grids(self, q0: int, q1: int, k0: int, k1: int, device: torch.device):
        """Broadcastable 4-D ``(b, h, q_idx, kv_idx)`` index tensors of one tile."""
        return (
            torch.arange(self.b, device=device).view(-1, 1, 1, 1),
            torch.arange(self.h, device=device).view(1, -1, 1, 1),
            torch.arange(q0, q1, device=device).view(1, 1, -1, 1),
            torch.arange(k0, k1, device=device).view(1, 1, 1, -1),
        )

    def tile_mask(
        self, q0: int, q1: int, k0: int, k1: int, device: torch.device
    ) -> tuple[bool, torch.Tensor | None, torch.Tensor | None]:
        """Return ``(skip, keep, bias)`` for one tile.

        ``keep`` is a bool tensor broadcastable to ``(b, h, bq, bk)`` (None = keep all),
        ``bias`` a float tensor to add (None = nothing).
        """
        keep = self._bounds_mask(q0, q1, k0, k1, device)
        bias = None
        if self.mask is not None:
            m = _slice(self.mask, q0, q1, k0, k1)
            if m.dtype == torch.bool:
                keep = m if keep is None else keep & m
            else:
                bias = m
        if self.mask_mod is not None:
            m = torch.as_tensor(self.mask_mod(*self.grids(q0, q1, k0, k1, device)), device=device)
            m = m.to(torch.bool)
            keep = m if keep is None else keep & m
        if (
            keep is not None
            and (self.mask is not None or self.mask_mod is not None)
            # Skipping on the mask's *data* is a data-dependent branch: under
            # torch.compile every such tile is computed (masked) instead.
            and not torch.compiler.is_compiling()
            and not bool(keep.any())
        ):
            return True, None, None
        return False, keep, bias

    def scores(
        self,
        q5: torch.Tensor,
        k5: torch.Tensor,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        acc: torch.dtype,
    ) -> torch.Tensor:
        """Scaled raw scores of one tile, ``(b, h, bq, bk)`` in ``acc`` dtype.

        A query already in ``acc`` dtype comes pre-scaled (see ``_views``); a
        half-precision one is scaled after the upcast.
        """
        qt = q5[..., q0:q1, :]  # (b, h_kv, g, bq, d)
        kt = k5[..., k0:k1, :]  # (b, h_kv, 1, bk, d)
        s = torch.matmul(qt, kt.transpose(-2, -1))  # (b, h_kv, g, bq, bk)
        s = s.view(self.b, self.h, q1 - q0, k1 - k0)
        return s if s.dtype == acc else s.to(acc).mul_(self.scale)


def _slice(m: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    if m.shape[-2] != 1:
        m = m[..., q0:q1, :]
    if m.shape[-1] != 1:
        m = m[..., k0:k1]
    return m


def apply_tile_mask(
    s: torch.Tensor, keep: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """Add ``bias`` and set the scores ``keep`` removes to ``-inf``."""
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: Default tile sizes (queries, keys), tuned on a 2-core CPU: large tiles keep the
#: per-op overhead small; tests shrink them to exercise many tiles. The fused engine
#: takes larger query tiles (each is one kernel call per key segment) and cuts keys
#: at ``BLOCK_K`` only where masks must be materialised.
BLOCK_Q = 512
BLOCK_K = 1024
FUSED_BLOCK_Q = 1024


def default_blocks(t: int, s: int, fused: bool = False) -> tuple[int, int]:
    """The tile sizes for ``t`` queries and ``s`` keys."""
    return min(FUSED_BLOCK_Q if fused else BLOCK_Q, max(t, 1)), min(BLOCK_K, max(s, 1))


def build_plan(
    call: AttentionCall, block_q: int | None, block_k: int | None, *, fused: bool = False
) -> TilePlan:
    """Flatten the call's layout to ``(b, h, t, d)`` terms and collect its masking."""
    q = call.query
    h = q.shape[-3] if q.dim() >= 3 else 1
    h_kv = call.key.shape[-3] if q.dim() >= 3 else 1
    b = math.prod(q.shape[:-3]) if q.dim() >= 4 else 1
    t, s = call.q_len, call.k_len
    dq, dk = default_blocks(t, s, fused)
    if call.window is not None:  # narrow query tiles waste less of a narrow band
        dq = min(dq, max(64, call.window // 2))
    mask = call.mask
    if mask is not None:
        mask = _mask_4d(mask, q.shape, b, h)
    offset = s - t if call.causal == "bottom_right" or call.causal is None else 0
    return TilePlan(
        b=b,
        h=h,
        h_kv=h_kv,
        t=t,
        s=s,
        scale=call.scale,
        causal=call.causal is not None,
        offset=offset,
        window=call.window,
        mask=mask,
        mask_mod=call.mask_mod,
        score_mod=call.score_mod,
        block_q=block_q or dq,
        block_k=block_k or dk,
        fused=fused,
    )


def _mask_4d(mask: torch.Tensor, q_shape: torch.Size, b: int, h: int) -> torch.Tensor:
    """View a mask broadcastable to ``(..., h, t, s)`` as ``(b|1, h|1, t|1, s|1)``."""
    rank = max(len(q_shape), 2)
    while mask.dim() < rank:
        mask = mask.unsqueeze(0)
    lead = mask.shape[:-3] if mask.dim() >= 3 else ()
    hm = mask.shape[-3] if mask.dim() >= 3 else 1
    if all(n == 1 for n in lead):
        bm = 1
    else:
        mask = mask.expand(*q_shape[:-3], *mask.shape[-3:])
        bm = b
    return mask.reshape(bm, hm, mask.shape[-2], mask.shape[-1])
