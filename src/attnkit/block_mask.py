"""Block masks: a ``mask_mod`` evaluated once into a plan of empty, full and partial tiles.

A :class:`BlockMask` cuts the ``(Q_LEN, KV_LEN)`` score matrix into tiles of
``Q_BLOCK_SIZE x KV_BLOCK_SIZE`` and records, per tile (and per batch element and head
where the mod depends on them), whether the tile is

* :data:`EMPTY`: no query in it may attend to any key in it (the kernels skip it);
* :data:`FULL`: every query may attend to every key (the kernels run it with no mask);
* :data:`PARTIAL`: some may; the tile's boolean mask is stored and used as it is, or,
  for a ``mask_mod`` that traces into :mod:`attnkit.mod_graph`, not stored at all: the
  native kernel generates the mod into its per-element mask test and makes each row of a
  partial tile where it reads it, so the plan holds O(tiles) bytes, never
  O(partial tiles x block size^2) (other readers evaluate the tiles they ask for).

It is built once (:func:`create_block_mask`), vectorised and chunked so that no
``Q_LEN x KV_LEN`` tensor is ever held, and reused by every layer, call, forward and
backward: a call with a block mask does no mask work beyond its partial tiles.
Indices the ``mask_mod`` receives are absolute positions ``q_idx in [0, Q_LEN)``,
``kv_idx in [0, KV_LEN)``, evaluated with FlexAttention's scalar semantics (see
:mod:`attnkit.mods`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from attnkit._validate import check_bool, check_int
from attnkit.block_mask_graph import evaluate_graph, generated_graph
from attnkit.mods import eval_mask_mod

if TYPE_CHECKING:  # mod_graph reaches this module through block_mask_cache: no cycle
    from attnkit.mod_graph import ModGraph

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMask", "create_block_mask"]

EMPTY, PARTIAL, FULL = 0, 1, 2

#: The most mask elements evaluated at once while building a block mask.
CHUNK_ELEMENTS = 1 << 23
#: Partial tiles compared at once by :meth:`BlockMask.toeplitz`.
_TOEPLITZ_TILES_AT_ONCE = 64

#: The most bytes of assembled partial-tile masks a block mask keeps for reuse.
DENSE_CACHE_BYTES = 1 << 26


class BlockMask:
    """Which tiles of the score matrix are empty, full or partial (see the module docs).

    Attributes:
        mask_mod: the predicate it was built from (None when built from a dense mask).
        B, H: batch size and head count it was built for; None = the same for all.
        Q_LEN, KV_LEN: query and key lengths.
        Q_BLOCK_SIZE, KV_BLOCK_SIZE: the tile sizes.
        block_kind: int8 ``(B or 1, H or 1, n_q_blocks, n_kv_blocks)`` of EMPTY / PARTIAL / FULL.
        stored_why: why the partial tiles are stored (e.g. the mod does not trace), or
            None when they are not (a generated mask: see :attr:`stored`).
        mask_graph: a generated mask's traced mod (:class:`attnkit.mod_graph.ModGraph`),
            its row 0 being query ``graph_q_offset``; None for stored tiles.
    """

    def __init__(
        self,
        *,
        mask_mod: Callable[..., Any] | None,
        B: int | None,
        H: int | None,
        Q_LEN: int,
        KV_LEN: int,
        Q_BLOCK_SIZE: int,
        KV_BLOCK_SIZE: int,
        block_kind: torch.Tensor,
        partial_index: torch.Tensor,
        partial_masks: torch.Tensor | None,
        partial_tril: np.ndarray | None = None,
        stored_why: str | None = "built from stored tiles",
        mask_graph: ModGraph | None = None,
        graph_q_offset: int = 0,
    ) -> None:
        self.mask_mod = mask_mod
        self.B, self.H = B, H
        self.Q_LEN, self.KV_LEN = Q_LEN, KV_LEN
        self.Q_BLOCK_SIZE, self.KV_BLOCK_SIZE = Q_BLOCK_SIZE, KV_BLOCK_SIZE
        self.block_kind = block_kind  # (Bk, Hk, nq, nk) int8
        #: index into ``partial_masks`` of each PARTIAL tile, -1 elsewhere
        self.partial_index = partial_index  # (Bk, Hk, nq, nk) int64
        # the stored masks of the partial tiles, padded with False past the ends (None: a
        # generated mask, whose tiles are evaluated where read; see partial_masks)
        self._partial_masks = partial_masks  # (n_partial, Q_BLOCK_SIZE, KV_BLOCK_SIZE) bool
        self.stored_why = None if partial_masks is None else stored_why
        self._evaluated: torch.Tensor | None = None  # a generated mask's tiles, once read
        #: the traced mask_mod a generated mask's tiles come from (None: stored tiles), and
        #: the query index its row 0 has (a sliced mask's start)
        self.mask_graph = mask_graph if partial_masks is None else None
        self.graph_q_offset = graph_q_offset
        if partial_masks is None and mask_graph is None:
            raise ValueError("a BlockMask without stored partial tiles needs its mask_graph")
        # partial tiles that are exactly the top-left causal triangle (a diagonal tile of
        # a causal mod): kernels may run them as is_causal with no mask
        if partial_tril is None:
            if partial_masks is None:
                raise ValueError("a BlockMask without stored partial tiles needs partial_tril")
            partial_tril = _tril_flags(partial_masks)
        self._tril = partial_tril
        self._index = partial_index.cpu().numpy()
        # Plans read the kinds from numpy: no tensor op (and no graph break) per tile.
        self._kinds = block_kind.cpu().numpy()
        self._dense_cache: dict[tuple[int, int, int, int], torch.Tensor | None] = {}
        self._dense_bytes = 0
        self._runs: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self._toeplitz: tuple = None  # type: ignore[assignment]  # () = checked, not one

    # -- shape -----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int | None, int | None, int, int]:
        return (self.B, self.H, self.Q_LEN, self.KV_LEN)

    @property
    def device(self) -> torch.device:
        return self.block_kind.device

    @property
    def stored(self) -> bool:
        """Whether the partial tiles' masks are held (False: a generated mask, whose
        tiles the native kernel makes row by row and other readers evaluate)."""
        return self._partial_masks is not None

    @property
    def partial_masks(self) -> torch.Tensor:
        """The partial tiles' bool masks ``(n_partial, Q_BLOCK_SIZE, KV_BLOCK_SIZE)``,
        padded with False past the ends. A generated mask evaluates them all on this first
        read and keeps them (readers that cannot make tiles themselves: Triton, or the
        native kernel where the generated code could not be built)."""
        if self._partial_masks is not None:
            return self._partial_masks
        if self._evaluated is None:
            qb, kb = self.Q_BLOCK_SIZE, self.KV_BLOCK_SIZE
            bk, hk, nq, nk = self.block_kind.shape
            masks = torch.zeros(int(self._tril.size), qb, kb, dtype=torch.bool, device=self.device)
            for i in range(nq):  # a row of tiles at a time: no Q_LEN x KV_LEN tensor
                idx = self.partial_index[:, :, i]  # (bk, hk, nk)
                sel = idx >= 0
                if bool(sel.any()):
                    row = self._assemble(i, i + 1, 0, nk).expand(bk, hk, qb, nk * kb)
                    tiles = row.reshape(bk, hk, qb, nk, kb).transpose(2, 3)  # (bk, hk, nk, qb, kb)
                    masks[idx[sel]] = tiles[sel]
            self._evaluated = masks
        return self._evaluated

    def num_blocks(self) -> tuple[int, int]:
        return self.block_kind.shape[-2], self.block_kind.shape[-1]

    # -- what users read -------------------------------------------------------------------
    def sparsity(self) -> float:
        """Percent of tiles that are EMPTY (skipped)."""
        return 100.0 * float((self._kinds == EMPTY).mean()) if self._kinds.size else 0.0

    def to_dense(self) -> torch.Tensor:
        """The bool mask ``(B|1, H|1, Q_LEN, KV_LEN)`` it stands for (True = may attend)."""
        nq, nk = self.num_blocks()
        return self._assemble(0, nq, 0, nk)[..., : self.Q_LEN, : self.KV_LEN]

    def __repr__(self) -> str:
        counts = {
            name: int((self._kinds == code).sum())
            for name, code in (("full", FULL), ("partial", PARTIAL), ("empty", EMPTY))
        }
        name = getattr(self.mask_mod, "__name__", None) or repr(self.mask_mod)
        lines = [
            f"BlockMask(shape={self.shape}, block_size=({self.Q_BLOCK_SIZE}, "
            f"{self.KV_BLOCK_SIZE}), sparsity={self.sparsity():.1f}%, tiles={counts}, "
            f"mask_mod={name})"
        ]
        nq, nk = self.num_blocks()
        if nq <= 16 and nk <= 32:  # a picture of the first (batch, head): # full, ░ partial
            glyph = {FULL: "█", PARTIAL: "░", EMPTY: "·"}
            lines += ["  " + "".join(glyph[int(c)] for c in row) for row in self._kinds[0, 0]]
        return "\n".join(lines)

    # -- slicing ---------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> BlockMask:
        """``bm[:, :, start:stop]``: the query rows ``start:stop`` (in tokens), e.g. a decode
        step's; ``bm[start:stop]`` is the same. Batch and head must be left whole."""
        rows = key
        if isinstance(key, tuple):
            if len(key) not in (1, 3) or any(k != slice(None) for k in key[:-1]):
                raise TypeError("a BlockMask is sliced in query rows only: bm[:, :, start:stop]")
            rows = key[-1]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"a BlockMask is sliced with a step-1 slice of rows, got {rows!r}")
        start, stop, _ = rows.indices(self.Q_LEN)
        return self.slice_queries(start, max(start, stop))

    def slice_queries(self, start: int, stop: int) -> BlockMask:
        """The block mask of query rows ``[start, stop)``; the mod then sees ``q_idx + start``."""
        start = check_int(start, "start", minimum=0, maximum=self.Q_LEN)
        stop = check_int(stop, "stop", minimum=start, maximum=self.Q_LEN)
        mod = self.mask_mod
        shifted = None if mod is None else _ShiftedMod(mod, start)
        qb = self.Q_BLOCK_SIZE
        if start % qb == 0:  # whole tiles: share the stored partial masks
            i0, i1 = start // qb, -(-stop // qb)
            return BlockMask(
                mask_graph=self.mask_graph,
                graph_q_offset=self.graph_q_offset + start,
                partial_tril=self._tril,
                stored_why=self.stored_why,
                mask_mod=shifted,
                B=self.B,
                H=self.H,
                Q_LEN=stop - start,
                KV_LEN=self.KV_LEN,
                Q_BLOCK_SIZE=qb,
                KV_BLOCK_SIZE=self.KV_BLOCK_SIZE,
                block_kind=self.block_kind[:, :, i0:i1].clone(),
                partial_index=self.partial_index[:, :, i0:i1].clone(),
                partial_masks=self._partial_masks,
            )
        i0, i1 = start // qb, -(-stop // qb)
        nk = self.num_blocks()[1]
        rows = self._assemble(i0, i1, 0, nk)[..., start - i0 * qb : stop - i0 * qb, : self.KV_LEN]
        built = _Builder(qb, self.KV_BLOCK_SIZE, stop - start, self.KV_LEN, rows.device)
        built.store = self.stored
        built.add_rows(0, rows)
        return built.finish(
            shifted,
            self.B,
            self.H,
            mask_graph=self.mask_graph,
            graph_q_offset=self.graph_q_offset + start,
            stored_why=self.stored_why,
        )

    # -- what kernels read -----------------------------------------------------------------
    def check_call(self, batch: int, heads: int, q_len: int, kv_len: int) -> str | None:
        """Why this block mask does not fit a call's shapes, or None when it does."""
        if (q_len, kv_len) != (self.Q_LEN, self.KV_LEN):
            return (
                f"block_mask was built for Q_LEN={self.Q_LEN}, KV_LEN={self.KV_LEN} but the "
                f"call has {q_len} queries and {kv_len} keys"
            )
        if self.B not in (None, 1, batch):
            return f"block_mask was built for B={self.B} but the call has batch {batch}"
        if self.H not in (None, 1, heads):
            return f"block_mask was built for H={self.H} but the call has {heads} query heads"
        return None

    def kinds(self, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
        """The kinds of the tiles covering rows ``[q0, q1)`` and keys ``[k0, k1)`` (numpy)."""
        qb, kb = self.Q_BLOCK_SIZE, self.KV_BLOCK_SIZE
        return self._kinds[:, :, q0 // qb : -(-q1 // qb), k0 // kb : -(-k1 // kb)]

    def keep(self, q0: int, q1: int, k0: int, k1: int) -> tuple[int, torch.Tensor | None]:
        """``(kind, keep)`` of rows ``[q0, q1)`` x keys ``[k0, k1)``: EMPTY / FULL with
        ``keep=None``, or PARTIAL with the bool ``(B|1, H|1, q1 - q0, k1 - k0)`` mask."""
        kinds = self.kinds(q0, q1, k0, k1)
        if (kinds == EMPTY).all():
            return EMPTY, None
        if (kinds == FULL).all():
            return FULL, None
        key = (q0, q1, k0, k1)
        cached = self._dense_cache.get(key)
        if cached is None:
            qb, kb = self.Q_BLOCK_SIZE, self.KV_BLOCK_SIZE
            i0, j0 = q0 // qb, k0 // kb
            dense = self._assemble(i0, -(-q1 // qb), j0, -(-k1 // kb))
            cached = dense[..., q0 - i0 * qb : q1 - i0 * qb, k0 - j0 * kb : k1 - j0 * kb]
            if self._dense_bytes + cached.numel() <= DENSE_CACHE_BYTES:
                # plans ask for the same tiles call after call, forward and backward
                self._dense_cache[key] = cached
                self._dense_bytes += cached.numel()
        return PARTIAL, cached

    def is_causal_tile(self, q0: int, q1: int, k0: int, k1: int, causal: bool = False) -> bool:
        """Whether rows ``[q0, q1)`` x keys ``[k0, k1)`` are an aligned square of whole
        tiles whose mask is exactly the top-left causal triangle, for every batch element
        and head: the diagonal tiles causal PARTIAL ones, those below FULL, those above
        EMPTY (a document of a causal document mask, say).

        ``causal``: the call applies the triangle itself (``causal=True`` on this square),
        so diagonal tiles may also be FULL and tiles above the diagonal anything."""
        qb, kb = self.Q_BLOCK_SIZE, self.KV_BLOCK_SIZE
        size = q1 - q0
        if qb != kb or q0 % qb or k0 % kb or size != k1 - k0 or size <= 0:
            return False
        if size > qb and size % qb:
            return False
        n, i0, j0 = max(1, size // qb), q0 // qb, k0 // kb
        if i0 + n > self._index.shape[2] or j0 + n > self._index.shape[3]:
            return False
        idx = self._index[:, :, i0 : i0 + n, j0 : j0 + n]
        kinds = self._kinds[:, :, i0 : i0 + n, j0 : j0 + n]
        diag, diag_kind = (
            idx[:, :, np.arange(n), np.arange(n)],
            kinds[:, :, np.arange(n), np.arange(n)],
        )
        tril = np.zeros(diag.shape, dtype=bool)  # no partial tiles at all: none is a triangle
        tril[diag >= 0] = self._tril[diag[diag >= 0]]
        if not (tril | (causal & (diag_kind == FULL))).all():
            return False
        below, above = np.tri(n, k=-1, dtype=bool), np.tri(n, k=-1, dtype=bool).T
        if not (kinds[:, :, below] == FULL).all():
            return False
        return causal or bool((kinds[:, :, above] == EMPTY).all())

    def toeplitz(self) -> tuple[int, torch.Tensor] | None:
        """The mask as a function of ``q_idx - kv_idx`` when it is one (a sliding window
        written as a mod, say), else None: ``(lo, keep)`` with ``keep[n]`` the value at
        ``q_idx - kv_idx = lo + n``, trimmed to the kept range. Cached.

        Read off the first block row and column, then checked against every tile: the
        kinds (EMPTY/FULL/PARTIAL over each tile's range of differences) and the stored
        masks of the partial tiles. The same for every batch element and head only.
        """
        if self._toeplitz is not None:
            return self._toeplitz or None
        self._toeplitz = ()
        qb, kb = self.Q_BLOCK_SIZE, self.KV_BLOCK_SIZE
        if qb != kb or tuple(self.block_kind.shape[:2]) != (1, 1):
            return None
        nq, nk = self.num_blocks()
        dev = self.device
        # the dense first column (rows i, key 0) and first row (query 0, keys j)
        col = self._assemble(0, nq, 0, 1)[0, 0, : self.Q_LEN, 0]  # M[i, 0]
        row = self._assemble(0, 1, 0, nk)[0, 0, 0, : self.KV_LEN]  # M[0, j]
        lo = -(self.KV_LEN - 1)
        f = torch.cat((row.flip(0)[:-1], col))  # f[n]: q - kv = lo + n
        # every tile against f: its differences a - b + (i - j) * qb span one range
        bi = torch.arange(nq, device=dev).view(-1, 1)
        bj = torch.arange(nk, device=dev).view(1, -1)
        rows = torch.clamp(self.Q_LEN - bi * qb, max=qb)  # valid rows of the tile
        cols = torch.clamp(self.KV_LEN - bj * kb, max=kb)
        d0 = (bi - bj) * qb - lo  # index in f of a = b = 0
        first, last = d0 - (cols - 1), d0 + (rows - 1)  # inclusive
        ones = F.pad(f.long().cumsum(0), (1, 0))
        kept = ones[last + 1] - ones[first]
        span = last - first + 1
        kind = torch.full((nq, nk), PARTIAL, dtype=torch.int8, device=dev)
        kind[kept == 0] = EMPTY
        kind[kept == span] = FULL
        if not torch.equal(kind, self.block_kind[0, 0]):
            return None
        a = torch.arange(qb, device=dev).view(1, -1, 1)
        b = torch.arange(kb, device=dev).view(1, 1, -1)
        tiles = (self.partial_index[0, 0] >= 0).nonzero()  # the stored partial tiles
        for part in tiles.split(_TOEPLITZ_TILES_AT_ONCE):  # bounded temporaries
            ti, tj = part.unbind(1)
            n = d0[ti, tj].view(-1, 1, 1) + a - b  # (p, qb, kb) indices into f
            valid = (a < rows[ti, 0].view(-1, 1, 1)) & (b < cols[0, tj].view(-1, 1, 1))
            want = f[n.clamp(0, f.numel() - 1)] & valid
            if not torch.equal(want, self._tiles(ti, tj)):
                return None
        where = f.nonzero().flatten()
        if where.numel() == 0:
            return None
        start, stop = int(where[0]), int(where[-1]) + 1
        self._toeplitz = (lo + start, f[start:stop].clone())
        return self._toeplitz

    def causal_runs(self, max_rows: int, causal: bool = False) -> list[tuple[int, int]]:
        """The query rows cut for a kernel with a causal flag: maximal runs of whole block
        rows (at most ``max_rows`` rows) whose diagonal square :meth:`is_causal_tile`
        (each run is then ONE causal tile), single block rows elsewhere. Cached.

        ``causal``: the call applies causality itself (see :meth:`is_causal_tile`)."""
        runs = self._runs.get((max_rows, causal))
        if runs is not None:
            return runs
        qb, nq = self.Q_BLOCK_SIZE, self.num_blocks()[0]
        runs, i = [], 0
        while i < nq:
            j = i + 1
            if self.is_causal_tile(i * qb, j * qb, i * qb, j * qb, causal):
                while (
                    j < nq
                    and (j + 1 - i) * qb <= max_rows
                    and self.is_causal_tile(i * qb, (j + 1) * qb, i * qb, (j + 1) * qb, causal)
                ):
                    j += 1
            runs.append((i * qb, min(j * qb, self.Q_LEN)))
            i = j
        self._runs[(max_rows, causal)] = runs
        return runs

    def _tiles(self, ti: torch.Tensor, tj: torch.Tensor) -> torch.Tensor:
        """The masks ``(p, qb, kb)`` of the PARTIAL tiles ``(ti[n], tj[n])`` of batch
        element and head 0 (padded with False past the ends)."""
        if self._partial_masks is not None:
            return self._partial_masks[self.partial_index[0, 0, ti, tj]]
        graph = self.mask_graph
        if graph is None:  # pragma: no cover - one of the two is always there
            raise ValueError("a BlockMask with neither stored tiles nor a mask graph")
        qb, kb = self.Q_BLOCK_SIZE, self.KV_BLOCK_SIZE
        dev = self.device
        q = ti.view(-1, 1, 1) * qb + torch.arange(qb, device=dev).view(1, -1, 1)  # (p, qb, 1)
        kv = tj.view(-1, 1, 1) * kb + torch.arange(kb, device=dev).view(1, 1, -1)  # (p, 1, kb)
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        # rows and keys past the ends: evaluated at the last ones (in range), then dropped
        q_in, kv_in = q.clamp(max=self.Q_LEN - 1), kv.clamp(max=self.KV_LEN - 1)
        keep = graph.evaluate(None, zero, zero, q_in + self.graph_q_offset, kv_in)
        keep = keep.to(torch.bool).expand(ti.numel(), qb, kb)
        return keep & (q < self.Q_LEN) & (kv < self.KV_LEN)

    def _assemble(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Dense bool of the tiles ``[i0, i1) x [j0, j1)``: ``(Bk, Hk, ni*qb, nj*kb)``."""
        qb, kb = self.Q_BLOCK_SIZE, self.KV_BLOCK_SIZE
        kind = self.block_kind[:, :, i0:i1, j0:j1]
        idx = self.partial_index[:, :, i0:i1, j0:j1]
        bk, hk, ni, nj = kind.shape
        tiles = (kind == FULL).view(bk, hk, ni, nj, 1, 1).expand(bk, hk, ni, nj, qb, kb).clone()
        sel = idx >= 0
        if bool(sel.any()) and self._partial_masks is None:  # a generated mask: evaluated
            dense = self._evaluate(
                i0 * qb, min(i1 * qb, self.Q_LEN), j0 * kb, min(j1 * kb, self.KV_LEN)
            )
            dense = F.pad(dense, (0, nj * kb - dense.shape[-1], 0, ni * qb - dense.shape[-2]))
            dense = dense.expand(bk, hk, ni * qb, nj * kb).reshape(bk, hk, ni, qb, nj, kb)
            tiles[sel] = dense.permute(0, 1, 2, 4, 3, 5)[sel]
        elif bool(sel.any()):
            tiles[sel] = self.partial_masks[idx[sel]]
        return tiles.permute(0, 1, 2, 4, 3, 5).reshape(bk, hk, ni * qb, nj * kb)

    def _evaluate(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """A generated mask on rows ``[q0, q1)`` x keys ``[k0, k1)``: bool
        ``(Bk|1, Hk|1, rows, keys)``, for readers other than the native kernel."""
        bk, hk = self.block_kind.shape[:2]
        graph = self.mask_graph
        if graph is None:  # pragma: no cover - stored tiles are read, not evaluated
            raise ValueError("a BlockMask with stored tiles is not evaluated")
        off = self.graph_q_offset
        return evaluate_graph(graph, bk, hk, q0 + off, q1 + off, k0, k1, self.device)


def _tril_flags(masks: torch.Tensor) -> np.ndarray:
    """Which of the tile masks ``(n, qb, kb)`` are exactly the top-left causal triangle."""
    tri = torch.ones(masks.shape[1:], dtype=torch.bool, device=masks.device).tril()
    return (masks == tri).flatten(1).all(1).cpu().numpy()


class _ShiftedMod:
    """``mod`` seen from query row ``start`` on (a sliced block mask's mod)."""

    def __init__(self, mod: Callable[..., Any], start: int) -> None:
        self.mod, self.start = mod, start
        self.__name__ = f"{getattr(mod, '__name__', repr(mod))}[q+{start}]"

    def __call__(self, b, h, q, kv):
        return self.mod(b, h, q + self.start, kv)


class _Builder:
    """Accumulates block kinds and partial-tile masks, rows of tiles at a time."""

    def __init__(self, qb: int, kb: int, q_len: int, kv_len: int, device: torch.device) -> None:
        self.qb, self.kb, self.q_len, self.kv_len, self.device = qb, kb, q_len, kv_len, device
        self.nq, self.nk = -(-q_len // qb), -(-kv_len // kb)
        # tile row -> (kinds, partial masks) or, not storing, (kinds, their causal flags)
        self.rows: dict[int, tuple[torch.Tensor, Any]] = {}
        self.lead = (1, 1)
        self.store = True  # False: a generated mask, only each partial tile's causal flag

    def add_rows(self, q0: int, dense: torch.Tensor) -> None:
        """Add the bool ``(b|1, h|1, rows, kv_len)`` mask of rows ``q0..``, ``q0 % qb == 0``."""
        qb, kb = self.qb, self.kb
        bk, hk, rows, kv = dense.shape
        ni = -(-rows // qb)
        pad_q, pad_k = ni * qb - rows, self.nk * kb - kv
        valid = torch.ones(rows, kv, dtype=torch.bool, device=dense.device)
        if pad_q or pad_k:
            dense = torch.nn.functional.pad(dense, (0, pad_k, 0, pad_q), value=False)
            valid = torch.nn.functional.pad(valid, (0, pad_k, 0, pad_q), value=False)
        tiles = dense.view(bk, hk, ni, qb, self.nk, kb).permute(0, 1, 2, 4, 3, 5)
        vt = valid.view(ni, qb, self.nk, kb).permute(0, 2, 1, 3)  # (ni, nk, qb, kb)
        anyk = tiles.any(-1).any(-1)
        allk = (tiles | ~vt).all(-1).all(-1)
        kind = torch.full(anyk.shape, PARTIAL, dtype=torch.int8, device=dense.device)
        kind[~anyk] = EMPTY
        kind[allk & anyk] = FULL
        masks = tiles[kind == PARTIAL]  # (n, qb, kb)
        self.rows[q0 // qb] = (kind, masks if self.store else _tril_flags(masks))
        self.lead = (max(self.lead[0], bk), max(self.lead[1], hk))

    def finish(
        self,
        mask_mod,
        B: int | None,
        H: int | None,
        *,
        mask_graph: ModGraph | None = None,
        graph_q_offset: int = 0,
        stored_why: str | None = "built from stored tiles",
    ) -> BlockMask:
        bk, hk = self.lead
        kinds, indices, masks = [], [], []
        count = 0
        for i in sorted(self.rows):
            kind, m = self.rows[i]
            # a row whose mask did not depend on batch/head is expanded: its partial
            # tiles are stored once and shared by every (b, h) index
            idx = torch.full(kind.shape, -1, dtype=torch.int64, device=kind.device)
            sel = kind == PARTIAL
            idx[sel] = torch.arange(count, count + m.shape[0], device=kind.device)
            count += m.shape[0]
            kinds.append(kind.expand(bk, hk, *kind.shape[2:]))
            indices.append(idx.expand(bk, hk, *idx.shape[2:]))
            masks.append(m)
        if kinds:
            kind_t, idx_t = torch.cat(kinds, 2).contiguous(), torch.cat(indices, 2).contiguous()
        else:
            kind_t = torch.zeros(bk, hk, 0, self.nk, dtype=torch.int8, device=self.device)
            idx_t = torch.zeros(bk, hk, 0, self.nk, dtype=torch.int64, device=self.device)
        if not self.store:  # a generated mask: the causal flags, no tiles
            flags = np.concatenate(masks) if masks else np.zeros(0, dtype=bool)
            return BlockMask(
                mask_mod=mask_mod, B=B, H=H, Q_LEN=self.q_len, KV_LEN=self.kv_len,
                Q_BLOCK_SIZE=self.qb, KV_BLOCK_SIZE=self.kb, block_kind=kind_t,
                partial_index=idx_t, partial_masks=None, partial_tril=flags,
                mask_graph=mask_graph, graph_q_offset=graph_q_offset,
            )  # fmt: skip
        store = torch.cat(masks) if masks else torch.zeros(0, self.qb, self.kb, dtype=torch.bool)
        return BlockMask(
            mask_mod=mask_mod,
            B=B,
            H=H,
            Q_LEN=self.q_len,
            KV_LEN=self.kv_len,
            Q_BLOCK_SIZE=self.qb,
            KV_BLOCK_SIZE=self.kb,
            block_kind=kind_t,
            partial_index=idx_t,
            partial_masks=store.to(self.device),
            stored_why=stored_why,
        )


def _block_sizes(block_size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(block_size, tuple):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a (q, kv) pair, got {block_size!r}")
        return (
            check_int(block_size[0], "block_size[0]"),
            check_int(block_size[1], "block_size[1]"),
        )
    size = check_int(block_size, "block_size")
    return size, size


def create_block_mask(
    mask_mod: Callable[..., Any],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    *,
    block_size: int | tuple[int, int] = 128,
    device: torch.device | str | None = None,
    generated: bool = True,
) -> BlockMask:
    """Evaluate ``mask_mod`` once into a :class:`BlockMask` (FlexAttention's signature).

    A mod that traces into :mod:`attnkit.mod_graph` (and whose float ops round exactly as
    torch's) gives a *generated* mask: its tile kinds are computed from the graph with
    torch ops on index grids, and its partial tiles are not stored (the native kernel
    makes their rows with generated code): O(tiles) memory. Any other mod stores its
    partial tiles, and ``stored_why`` says why.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend), written
            for scalar indices as for ``flex_attention`` (attnkit's own mods also run
            on broadcast grids, which is faster).
        B: batch size, or None when the mask is the same for every batch element.
        H: query heads, or None when the mask is the same for every head.
        Q_LEN: number of queries.
        KV_LEN: number of keys.
        block_size: tile size, an int or a ``(q, kv)`` pair.
        device: where the mask lives (CPU by default).
        generated: False stores the partial tiles even of a mod that would be generated
            (the path of a mod that does not trace).

    Raises:
        TypeError / ValueError: a mod that is not callable, bad sizes, or a mod whose
            result is not a bool per ``(b, h, q_idx, kv_idx)``.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    b = 1 if B is None else check_int(B, "B")
    h = 1 if H is None else check_int(H, "H")
    q_len, kv_len = check_int(Q_LEN, "Q_LEN", minimum=0), check_int(KV_LEN, "KV_LEN", minimum=0)
    qb, kb = _block_sizes(block_size)
    dev = torch.device("cpu") if device is None else torch.device(device)
    generated = check_bool(generated, "generated")
    graph, why = (
        generated_graph(mask_mod, b, h, q_len, kv_len, dev)
        if generated
        else (None, "create_block_mask(generated=False)")
    )
    builder = _Builder(qb, kb, q_len, kv_len, dev)
    builder.store = graph is None
    # rows of tiles per evaluation: bounded so no Q_LEN x KV_LEN tensor is ever held
    per_row = max(1, b * h * qb * max(kv_len, 1))
    step = max(1, CHUNK_ELEMENTS // per_row) * qb
    for q0 in range(0, q_len, step):
        q1 = min(q0 + step, q_len)
        if graph is None:
            dense = eval_mask_mod(mask_mod, b, h, q0, q1, 0, kv_len, dev)  # (b|1, h|1, rows, kv)
        else:
            dense = evaluate_graph(graph, b, h, q0, q1, 0, kv_len, dev)
        builder.add_rows(q0, dense)
    return builder.finish(mask_mod, B, H, mask_graph=graph, stored_why=why)


def block_mask_from_dense(
    keep: torch.Tensor, *, block_size: int | tuple[int, int] = 128
) -> BlockMask:
    """A :class:`BlockMask` of a dense bool mask ``(Q_LEN, KV_LEN)`` or ``(B|1, H|1, Q, KV)``."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() not in (2, 4):
        raise TypeError("keep must be a 2-D or 4-D bool tensor")
    keep4 = keep if keep.dim() == 4 else keep.view(1, 1, *keep.shape)
    qb, kb = _block_sizes(block_size)
    builder = _Builder(qb, kb, keep4.shape[-2], keep4.shape[-1], keep.device)
    step = max(1, CHUNK_ELEMENTS // max(1, math.prod(keep4.shape[:2]) * qb * keep4.shape[-1]))
    for q0 in range(0, keep4.shape[-2], step * qb):
        builder.add_rows(q0, keep4[:, :, q0 : q0 + step * qb])
    b = keep4.shape[0] if keep4.shape[0] > 1 else None
    h = keep4.shape[1] if keep4.shape[1] > 1 else None
    return builder.finish(None, b, h)
