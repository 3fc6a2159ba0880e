"""The blockwise plan: layout, all tile sizing, and :meth:`TilePlan.tiles` with skipping.

Notation: ``b`` batch (leading dims flattened), ``h`` query heads, ``h_kv`` key/value
heads, ``g = h // h_kv`` query heads per kv head, ``t`` queries, ``s`` keys.

A plan is built once per call (:func:`build_plan`) or per context-parallel segment
(:func:`segment_plan`) and read by both engines, forward and backward. For a block of
queries, :meth:`TilePlan.tiles` lists the key tiles to compute, skipping the empty
ones, each with what masks it: nothing (a *full* tile), the fused kernel's top-left
causal triangle (a *square*), and/or an explicit bool ``keep`` and float ``bias``.
Causal and window bounds come from indices (no tensor); a :class:`BlockMask` from its
precomputed tile kinds; a bool or float ``mask`` and a plain ``mask_mod`` are read on
the tile.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from attnkit.block_mask import EMPTY, FULL, BlockMask
from attnkit.block_mask_cache import cached_block_mask
from attnkit.masks import MaskMod, ScoreMod, position_keep
from attnkit.mods import eval_mask_mod, eval_score_mod

#: Default tile sizes (queries, keys), tuned on a 2-core CPU: large tiles keep the
#: per-op overhead small; tests shrink them to exercise many tiles. The fused engine
#: takes larger query tiles (each is one kernel call per key segment) and cuts keys
#: at ``BLOCK_K`` only where masks must be materialised.
BLOCK_Q = 512
BLOCK_K = 1024
FUSED_BLOCK_Q = 1024
#: The most elements of one materialised mask tile of the fused engine. Larger tiles cost
#: more than their size: each fresh allocation past glibc's mmap threshold (32 MB) is
#: page-faulted in anew (an ALiBi bias tile of 12 x 1024 x 1024 took 3x longer per element).
MASK_TILE_ELEMENTS = 1 << 22

#: Query rows per block of the fused engine's Toeplitz layouts (:mod:`.toeplitz`): a
#: window's band (narrow: a block computes ``bq + w - 1`` keys per row for ``w`` needed;
#: 32 was fastest for w=256 at T=8192) and the rows of a relative bias (each block
#: wastes half its ``bq x bq`` diagonal square).
BAND_BLOCK_Q = 32
ROWS_BLOCK_Q = 256

#: Tile size of the block mask a plain ``mask_mod=`` is turned into (at most; smaller
#: when the tiles above are made smaller, as tests do).
MOD_BLOCK = 128

#: The engines: attnkit's native CPU kernel where it can run the plan (:mod:`.native`,
#: forward and backward; else torch's fused kernel), torch's fused CPU kernel alone, and
#: PyTorch ops. The first two plan the same tiles: the fused engines.
NATIVE_CPU = "native_cpu"
FLASH_CPU = "flash_cpu"
TORCH_TILES = "torch_tiles"
FUSED_ENGINES = (NATIVE_CPU, FLASH_CPU)
#: The one priority list: each direction of a call runs on the first engine of it that
#: takes the call (see :mod:`.engines`).
PRIORITY = (NATIVE_CPU, FLASH_CPU, TORCH_TILES)


@dataclass(frozen=True)
class Engines:
    """The engines chosen for a plan, once (:func:`.engines.plan_call`).

    Attributes:
        forward: the engine of the forward (one of :data:`PRIORITY`).
        backward: the engine of the backward (torch's fused backward takes no gradient
            through the log-sum-exp: such a backward, known only then, runs on the tiles).
        bf16: where the native kernel runs a direction, it reads bf16 inputs as they are
            (bf16 products: an avx512-bf16 or avx512-amx build).
        passed_over: ``(direction, engine, why)`` for every engine ahead of the chosen
            one that refused, in priority order.
    """

    forward: str
    backward: str
    bf16: bool = False
    passed_over: tuple[tuple[str, str, str], ...] = ()

    def explain(self) -> str:
        """One line per direction: its engine, and why the faster ones stood aside."""
        lines = []
        for direction, engine in (("forward", self.forward), ("backward", self.backward)):
            why = [f"{e}: {w}" for d, e, w in self.passed_over if d == direction]
            lines.append(f"{direction}: {engine}" + (f" ({'; '.join(why)})" if why else ""))
        return "\n".join(lines)


@dataclass(frozen=True)
class Band:
    """Causal, window and alignment as one value: key ``j`` is kept for query ``i`` iff
    ``lo <= j - i <= hi`` (None: no bound on that side). Derived in one place
    (:meth:`of`, from the rule :func:`attnkit.masks.position_keep` writes) and read by the
    tiles, the mask-free layouts and the native kernel."""

    lo: int | None = None
    hi: int | None = None

    @staticmethod
    def of(causal: bool, window: int | None, offset: int) -> Band:
        """The band of causal/window with query ``i`` at key position ``i + offset``:
        causal keeps ``j <= i + offset``, a window ``i + offset - window < j`` (and without
        causal ``j < i + offset + window``)."""
        lo = None if window is None else offset - window + 1
        if causal:
            hi: int | None = offset
        else:
            hi = None if window is None else offset + window - 1
        return Band(lo, hi)

    def __and__(self, other: Band) -> Band:
        """The pairs both bands keep."""
        los = [x for x in (self.lo, other.lo) if x is not None]
        his = [x for x in (self.hi, other.hi) if x is not None]
        return Band(max(los) if los else None, min(his) if his else None)

    def keys(self, q0: int, q1: int, s: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` of ``[0, s)`` that some query of ``[q0, q1)`` keeps."""
        lo = 0 if self.lo is None else max(0, q0 + self.lo)
        hi = s if self.hi is None else min(s, q1 - 1 + self.hi + 1)
        return lo, max(lo, hi)


@dataclass
class Tile:
    """Keys ``[k0, k1)`` of one query block and what masks them.

    ``square``: the keys are the block's own positions and the top-left causal triangle
    applies (the fused kernel's ``is_causal``; see :meth:`TilePlan.full_keep`).
    ``keep``: bool ``(b|1, h|1, bq, bk)``, None = all kept (beyond the triangle).
    ``bias``: float ``(b|1, h|1, bq|1, bk|1)`` added to the scores, None = nothing.
    """

    k0: int
    k1: int
    square: bool = False
    keep: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def masked(self) -> bool:
        return self.keep is not None or self.bias is not None


@dataclass
class TilePlan:
    """Everything the engines need besides the tensors."""

    b: int
    h: int
    h_kv: int
    t: int
    s: int
    scale: float
    causal: bool
    offset: int  # causal/window: query i sits at key position i + offset
    window: int | None
    mask: torch.Tensor | None  # (b|1, h|1, t|1, s|1) bool or float
    mask_mod: MaskMod | None
    score_mod: ScoreMod | None
    block_mask: BlockMask | None
    block_q: int
    block_k: int
    engine: str = TORCH_TILES  # the engine the tiles are planned for (fused or not)
    q_base: int = 0  # the mods see query i as q_base + i
    k_base: int = 0  # and key j as k_base + j
    engines: Engines | None = None  # what runs it, each direction (None: the tiles)
    #: what engines derive from the plan once (e.g. a compiled score_mod), by name
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def groups(self) -> int:
        return self.h // self.h_kv

    @property
    def fused(self) -> bool:
        return self.engine in FUSED_ENGINES

    def q_blocks(self) -> list[tuple[int, int]]:
        """The query blocks ``[(q0, q1), ...]``. The fused engine walks a block mask's
        rows one block row at a time, except where rows form causal squares (documents
        of a causal document mask): each such run, up to ``FUSED_BLOCK_Q`` rows, is one
        block whose diagonal is ONE ``is_causal`` tile."""
        bm = self.block_mask
        if (
            self.fused
            and bm is not None
            and self.block_q == bm.Q_BLOCK_SIZE
            and self.offset == 0
            and self.t == self.s == bm.Q_LEN == bm.KV_LEN
            and self.q_base == self.k_base
        ):
            return bm.causal_runs(FUSED_BLOCK_Q, self.causal)
        return [(i, min(i + self.block_q, self.t)) for i in range(0, self.t, self.block_q)]

    @property
    def band(self) -> Band:
        """Causal, window and the alignment offset as one :class:`Band`."""
        return Band.of(self.causal, self.window, self.offset)

    def k_range(self, q0: int, q1: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` that any query in ``[q0, q1)`` may reach by causal/window."""
        return self.band.keys(q0, q1, self.s)

    def materialises(self) -> bool:
        """Whether some tiles need an explicit mask or bias (beyond causal/window bounds)."""
        return (
            self.mask is not None
            or self.mask_mod is not None
            or self.score_mod is not None
            or self.block_mask is not None
        )

    # -- the tiles -------------------------------------------------------------------------
    def tiles(self, q0: int, q1: int, dtype: torch.dtype, device: torch.device) -> list[Tile]:
        """The key tiles of query block ``[q0, q1)``, empty ones skipped.

        Adjacent unmasked tiles are merged (up to ``block_k`` keys on the tile engine, with
        no limit on the fused one, whose kernel tiles internally); so are adjacent masked
        ones up to the engine's tile size.
        """
        lo, hi = self.k_range(q0, q1)
        if lo >= hi:
            return []
        first, last = q0 + self.offset, q1 - 1 + self.offset
        points = {lo, hi}
        if self.window is not None:
            points.add(min(max(last - self.window + 1, lo), hi))  # left edge | interior
            if not self.causal:  # symmetric window: interior | right edge
                points.add(min(max(first + self.window, lo), hi))
        square = (
            self.fused
            and self.causal
            and lo <= first
            and last + 1 == hi
            and (self.window is None or q1 - q0 <= self.window)
        )
        if self.causal:
            points.add(min(max(first, lo), hi))  # interior | causal square
        step = self.mask_block_k(q1 - q0)
        if not self.fused or self.materialises():
            end = first if square else hi
            points.update(range(lo - lo % step + step, end, step))
        if self.block_mask is not None:
            kb = self.block_mask.KV_BLOCK_SIZE
            points.update(range(lo - lo % kb + kb, hi, kb))
            if self.fused and q1 - q0 > self.block_mask.Q_BLOCK_SIZE and lo <= q0 < q1 <= hi:
                # a causal run of q_blocks(): its diagonal square stays one tile
                points = {p for p in points if not q0 < p < q1} | {q0, q1}
        out: list[Tile] = []
        limit = hi if self.fused else step
        for k0, k1 in itertools.pairwise(sorted(points)):
            if k0 >= k1:
                continue
            tile = self._tile(q0, q1, k0, k1, square and k0 == first, dtype, device)
            if tile is None:
                continue
            prev = out[-1] if out else None
            if prev is not None and prev.k1 == k0 and not prev.square and not tile.square:
                if not prev.masked and not tile.masked and k1 - prev.k0 <= limit:
                    prev.k1 = k1
                    continue
                if prev.masked and tile.masked and k1 - prev.k0 <= step:
                    out[-1] = _concat(prev, tile, q1 - q0)
                    continue
            out.append(tile)
        return out

    def _tile(
        self,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        square: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Tile | None:
        """One tile's masks, or None when nothing in it may attend."""
        keep = None if square else self._bounds(q0, q1, k0, k1, device)
        if self.block_mask is not None:
            kind, m = self.block_mask.keep(q0, q1, k0, k1)
            if kind == EMPTY:
                return None
            if kind != FULL:
                # (a square of the call's own causality may hold FULL tiles on its diagonal)
                if self.fused and self.block_mask.is_causal_tile(q0, q1, k0, k1, square):
                    square = True  # a causal mod's diagonal square: the kernel's is_causal
                else:
                    keep = _and(keep, m)
        bias = None
        if self.mask is not None:
            m = _slice(self.mask, q0, q1, k0, k1)
            if m.dtype == torch.bool:
                keep = _and(keep, m)
            else:
                bias = m
        if self.mask_mod is not None:
            m = eval_mask_mod(
                self.mask_mod,
                self.b,
                self.h,
                self.q_base + q0,
                self.q_base + q1,
                self.k_base + k0,
                self.k_base + k1,
                device,
            )
            keep = _and(keep, m)
        if self.fused and self.score_mod is not None:  # an additive mod: its bias on the tile
            zero = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device).expand(
                self.b, self.h, q1 - q0, k1 - k0
            )
            mod_bias = self.mod_scores(zero, q0, k0)
            bias = mod_bias if bias is None else bias + mod_bias
        if (
            keep is not None
            and (self.mask is not None or self.mask_mod is not None or self.block_mask is not None)
            # Skipping on the mask's *data* is a data-dependent branch: under
            # torch.compile every such tile is computed (masked) instead.
            and not torch.compiler.is_compiling()
            and not bool(keep.any())
        ):
            return None
        return Tile(k0, k1, square, keep, bias)

    def _bounds(
        self, q0: int, q1: int, k0: int, k1: int, device: torch.device
    ) -> torch.Tensor | None:
        """``(bq, bk)`` bool for causal/window inside this tile, or None if all in."""
        if not self.causal and self.window is None:
            return None
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

    def full_keep(self, q0: int, q1: int, tile: Tile, device: torch.device) -> torch.Tensor | None:
        """The tile's complete bool mask, the square's triangle included (None = all)."""
        if not tile.square:
            return tile.keep
        n = torch.arange(q1 - q0, device=device)
        tri = n.view(-1, 1) >= torch.arange(tile.k1 - tile.k0, device=device)  # (bq, bk)
        return _and(tri, tile.keep)

    # -- sizes -----------------------------------------------------------------------------
    def mask_lead(self) -> int:
        """The (batch x heads) extent of a materialised mask tile, at most."""
        lead = 1
        if self.score_mod is not None or self.mask_mod is not None:
            lead = self.b * self.h
        if self.mask is not None:
            lead = max(lead, self.mask.shape[0] * self.mask.shape[1])
        if self.block_mask is not None:
            lead = max(lead, math.prod(self.block_mask.block_kind.shape[:2]))
        return lead

    def mask_block_k(self, bq: int) -> int:
        """Keys per masked tile: ``block_k``, fewer when a fused mask tile would be too large."""
        if not self.fused:
            return self.block_k
        fit = MASK_TILE_ELEMENTS // (self.mask_lead() * bq) // 64 * 64
        return min(self.block_k, max(64, fit))

    # -- scores ----------------------------------------------------------------------------
    def mod_scores(self, s: torch.Tensor, q0: int, k0: int) -> torch.Tensor:
        """``score_mod`` on the tile ``s (b, h, bq, bk)`` of query ``q0``, key ``k0``."""
        if self.score_mod is None:
            return s
        out = eval_score_mod(self.score_mod, s, self.q_base + q0, self.k_base + k0)
        # in the scores' dtype (a mod reading a float64 tensor promotes float32 scores)
        return out if out.dtype == s.dtype else out.to(s.dtype)


def _and(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def _lead4(x: torch.Tensor) -> torch.Tensor:
    while x.dim() < 4:
        x = x.unsqueeze(0)
    return x


def _concat(a: Tile, b: Tile, bq: int) -> Tile:
    """Two adjacent masked tiles as one."""

    def part(t: Tile, attr: str, fill: float | bool, dtype: torch.dtype) -> torch.Tensor:
        x = getattr(t, attr)
        if x is None:
            return torch.full((1, 1, bq, t.k1 - t.k0), fill, dtype=dtype)
        return _lead4(x).expand(*_lead4(x).shape[:2], bq, t.k1 - t.k0)

    keep = bias = None
    if a.keep is not None or b.keep is not None:
        parts = [part(t, "keep", True, torch.bool) for t in (a, b)]
        keep = _cat_lead(parts)
    if a.bias is not None or b.bias is not None:
        dt = (a.bias if a.bias is not None else b.bias).dtype  # type: ignore[union-attr]
        parts = [part(t, "bias", 0.0, dt) for t in (a, b)]
        bias = _cat_lead(parts)
    return Tile(a.k0, b.k1, False, keep, bias)


def _cat_lead(parts: list[torch.Tensor]) -> torch.Tensor:
    lead = torch.broadcast_shapes(*(p.shape[:2] for p in parts))
    device = next((p.device for p in parts if p.numel()), parts[0].device)
    return torch.cat([p.to(device).expand(*lead, *p.shape[2:]) for p in parts], -1)


def _slice(m: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    if m.shape[-2] != 1:
        m = m[..., q0:q1, :]
    if m.shape[-1] != 1:
        m = m[..., k0:k1]
    return m


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _layout(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    h = q.shape[-3] if q.dim() >= 3 else 1
    h_kv = k.shape[-3] if q.dim() >= 3 else 1
    b = math.prod(q.shape[:-3]) if q.dim() >= 4 else 1
    return b, h, h_kv


def build_plan(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float,
    causal: str | None,
    window: int | None,
    mask: torch.Tensor | None,
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
    block_mask: BlockMask | None,
    engine: str,
    block_q: int | None = None,
    block_k: int | None = None,
    mod_offsets: tuple[int, int] = (0, 0),
    position_offset: int | None = None,
) -> TilePlan:
    """The plan of one attention call (flattened to ``(b, h, t, d)`` terms): tile sizes
    chosen here, in one place, for the engine that will run it. A plain ``mask_mod``
    becomes a cached :class:`BlockMask` (positions shifted by ``mod_offsets``).
    ``position_offset``: query ``i`` sits at key position ``i + position_offset`` for
    causal and window (default: from the causal alignment; a context-parallel segment
    passes its own)."""
    b, h, h_kv = _layout(query, key)
    t, s = query.shape[-2], key.shape[-2]
    fused = engine in FUSED_ENGINES
    if mask_mod is not None and block_mask is None and query.dim() == 4:
        # a plain mask_mod: the same block plan, built once and cached
        size = min(MOD_BLOCK, BLOCK_Q, BLOCK_K, FUSED_BLOCK_Q)
        block_mask = cached_block_mask(
            mask_mod,
            b,
            h,
            t,
            s,
            device=query.device,
            block_size=size,
            q_offset=mod_offsets[0],
            k_offset=mod_offsets[1],
        )
        mask_mod = None
    offset = position_offset
    if offset is None:
        offset = s - t if causal == "bottom_right" or causal is None else 0
    if window is not None and window > t + s + abs(offset):
        # wider than any query-key distance: no bound (and no band of `window` keys to
        # lay out: the torch-kernel layouts grew with it, 34 GB asked for window=2**31)
        window = None
    dq = min(FUSED_BLOCK_Q if fused else BLOCK_Q, max(t, 1))
    dk = min(BLOCK_K, max(s, 1))
    if window is not None:  # narrow query tiles waste less of a narrow band
        dq = min(dq, max(64, window // 2))
    if block_mask is not None:  # tiles made of whole blocks: one block row per query tile
        qb, kb = block_mask.Q_BLOCK_SIZE, block_mask.KV_BLOCK_SIZE
        dq = qb if fused else max(qb, dq // qb * qb)
        dk = max(kb, dk // kb * kb)
    if mask is not None:
        mask = _mask_4d(mask, query.shape, b)
    plan = TilePlan(
        b=b,
        h=h,
        h_kv=h_kv,
        t=t,
        s=s,
        scale=scale,
        causal=causal is not None,
        offset=offset,
        window=window,
        mask=mask,
        mask_mod=mask_mod,
        score_mod=score_mod,
        block_mask=block_mask,
        block_q=block_q or dq,
        block_k=block_k or dk,
        engine=engine,
        q_base=mod_offsets[0],
        k_base=mod_offsets[1],
    )
    if fused and block_q is None and block_mask is None and plan.materialises():
        # a causal square (bq x bq) with a mask must fit MASK_TILE_ELEMENTS
        fit = math.isqrt(MASK_TILE_ELEMENTS // plan.mask_lead()) // 64 * 64
        plan.block_q = min(plan.block_q, max(64, fit))
    return plan


def _mask_4d(mask: torch.Tensor, q_shape: torch.Size, b: int) -> torch.Tensor:
    """View a mask broadcastable to ``(..., h, t, s)`` as ``(b|1, h|1, t|1, s|1)``."""
    shape = mask.shape
    lead = shape[:-3]
    hm = shape[-3] if len(shape) >= 3 else 1
    t, s = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
    if all(n == 1 for n in lead):  # (one view: the missing and unit dims are 1)
        return mask.reshape(1, hm, t, s)
    mask = mask.expand(*q_shape[:-3], hm, t, s)
    return mask.reshape(b, hm, t, s)
