"""A document block mask built analytically: :func:`document_block_mask`.

A packed batch of documents (``cu_seqlens``, or a document id per token) attends within
each document (and causally, if asked). Evaluating that ``mask_mod`` element by element
(:func:`attnkit.create_block_mask`) touches every ``(q, kv)`` pair; here the tile kinds
come from the first and last document id of each block alone, and only the partial
tiles' masks are evaluated, all at once, with tensor ops (no Python per tile, no
``T x T`` tensor, nothing compiled). For ids that are not sorted (a document in several
pieces) the mod is evaluated as :func:`attnkit.create_block_mask` does.

The result is the :class:`~attnkit.BlockMask` that
``create_block_mask(and_masks(document(ids), causal("top_left")), ...)`` builds (the
tests check it), and its ``mask_mod`` is that mod.
"""

from __future__ import annotations

import torch

from attnkit._validate import check_bool, check_cu_seqlens, check_int
from attnkit.block_mask import EMPTY, FULL, PARTIAL, BlockMask, create_block_mask
from attnkit.masks import MaskMod, and_masks, document
from attnkit.masks import causal as causal_mod

__all__ = ["document_block_mask"]


def document_block_mask(
    cu_seqlens: torch.Tensor | None = None,
    *,
    ids: torch.Tensor | None = None,
    causal: bool = False,
    block_size: int = 128,
) -> BlockMask:
    """The block mask of packed documents: a query sees the keys of its own document
    (and, with ``causal``, only those at or before it).

    Args:
        cu_seqlens: int32/int64 ``(n + 1,)`` offsets ``[0, ..., total]`` of the documents
            (flash-attn's layout; empty documents allowed).
        ids: or: an integer document id per token, ``(seq,)`` or ``(batch, seq)``
            (non-decreasing along ``seq`` for the fast path; any ids are taken).
        causal: also causal within each document (self-attention: top-left = bottom-right).
        block_size: the tile size (queries and keys).

    Returns:
        A :class:`~attnkit.BlockMask` for ``Q_LEN = KV_LEN = total`` (``B`` = the ids'
        batch, or None), on the ids' device.

    Raises:
        ValueError / TypeError: neither or both of ``cu_seqlens`` and ``ids``, bad offsets
            (see :func:`attnkit._validate.check_cu_seqlens`), ids that are not an integer
            ``(seq,)`` / ``(batch, seq)`` tensor, a bad ``block_size``.
    """
    causal = check_bool(causal, "causal")
    size = check_int(block_size, "block_size")
    if (cu_seqlens is None) == (ids is None):
        raise ValueError("give exactly one of cu_seqlens and ids")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        total = int(cu_seqlens[-1]) if cu_seqlens.numel() else 0
        check_cu_seqlens(cu_seqlens, "cu_seqlens", total)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
        doc = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=cu_seqlens.device), lengths
        ).unsqueeze(0)  # (1, total), sorted
        batch = None
    else:
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() not in (1, 2):
            raise TypeError(f"ids must be a (seq,) or (batch, seq) integer tensor, got {ids!r}")
        doc = ids.to(torch.int64).reshape(-1, ids.shape[-1])  # (b, seq)
        batch = doc.shape[0] if ids.dim() == 2 else None
    mod = _mod(doc if ids is None else ids, causal)
    seq = doc.shape[-1]
    if seq > 1 and bool((doc[:, 1:] < doc[:, :-1]).any()):  # a document in pieces
        return create_block_mask(mod, batch, None, seq, seq, block_size=size, device=doc.device)
    return _sorted(doc, causal, size, mod, batch)


def _mod(ids: torch.Tensor, causal: bool) -> MaskMod:
    """The equivalent mask_mod (the block mask's ``mask_mod``)."""
    same = document(ids.reshape(-1) if ids.shape[0] == 1 and ids.dim() == 2 else ids)
    return and_masks(same, causal_mod("top_left")) if causal else same


def _unique_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique rows, index of each row's)`` of an int ``(n, m)`` tensor: rows hashed to one
    int64 each (``torch.unique(dim=0)`` compares rows one pair at a time), the hash checked
    against the rows themselves (a collision falls back to the exact unique). Rows are
    gathered whole (``index_select``: several times faster than element indexing)."""
    weights = torch.randint(
        -(2**62), 2**62, (rows.shape[1],), generator=torch.Generator().manual_seed(0)
    ).to(rows.device)
    keys = (rows.to(torch.int64) * weights).sum(1)  # wraps around: a hash
    _, which = torch.unique(keys, return_inverse=True)
    first = torch.full((int(which.max()) + 1 if which.numel() else 0,), rows.shape[0],
                       dtype=torch.int64, device=rows.device)  # fmt: skip
    first.scatter_reduce_(0, which, torch.arange(rows.shape[0], device=rows.device), "amin")
    unique = rows.index_select(0, first)
    if not torch.equal(unique.index_select(0, which), rows):  # a hash collision
        unique, which = torch.unique(rows, dim=0, return_inverse=True)
    return unique, which


def _unique_small(x: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(x, return_inverse=True)`` of integers in ``[0, bound)``: counted
    (``bincount``), not sorted, where ``bound`` is small."""
    if bound > 1 << 22:
        return torch.unique(x, return_inverse=True)
    present = torch.bincount(x, minlength=bound) > 0
    rank = torch.cumsum(present, 0) - 1  # a present value's place among the present
    return present.nonzero().flatten(), rank.index_select(0, x.to(torch.int64))


def _gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` of a bool ``(n, m)`` tensor, its rows moved as int64 words where ``m``
    allows (8 bools a word: a row of 128 is 16 words, not 128 elements)."""
    if rows.shape[1] % 8 == 0 and rows.is_contiguous():
        words = rows.view(torch.int64)  # (n, m / 8)
        return words.index_select(0, index).view(torch.bool)
    return rows.index_select(0, index)


def _sorted(
    doc: torch.Tensor, causal: bool, size: int, mod: MaskMod, batch: int | None
) -> BlockMask:
    """The block mask of non-decreasing ids ``doc (b, seq)``: kinds from each block's
    first and last id; a partial tile's row ``r`` keeps the columns ``[lo_r, hi_r)`` (its
    document's span, cut by causality), and tiles with the same spans share one mask."""
    b, seq = doc.shape
    n = -(-seq // size)  # blocks per side
    dev = doc.device
    blocks = torch.arange(n, device=dev)
    first = doc[:, ::size]  # (b, n): a block's smallest id
    last = doc[:, torch.clamp(blocks * size + size - 1, max=seq - 1)]  # (b, n): its largest
    # documents sorted: two blocks share an id iff their id ranges overlap
    share = (first[:, :, None] <= last[:, None, :]) & (first[:, None, :] <= last[:, :, None])
    single = first == last
    one = single[:, :, None] & single[:, None, :] & share  # (b, nq, nk): one document
    if causal:
        key_end = torch.clamp(blocks * size + size - 1, max=seq - 1)  # last real key
        share = share & (blocks * size <= (blocks * size + size - 1)[:, None])  # a key <= a query
        one = one & (key_end <= (blocks * size)[:, None])  # every key <= every query
    # one implies share: the kinds as int8 sums (no int64 tensors of n x n to convert)
    kind = EMPTY + share.to(torch.int8) * (PARTIAL - EMPTY) + one.to(torch.int8) * (FULL - PARTIAL)
    bi, qi, ki = (kind == PARTIAL).nonzero(as_tuple=True)
    # each token's document span [start, end) (sorted ids: a search); the rows past seq
    # (the last block's padding) get the empty span [0, 0)
    # positions and spans in int32 where they fit (half the traffic of int64)
    small = torch.int32 if max(seq, (size + 1) ** 2) < 2**31 else torch.int64
    pos = torch.arange(seq, device=dev, dtype=small)
    change = doc[:, 1:] != doc[:, :-1]  # (b, seq - 1): a new document starts at p + 1
    starts = torch.nn.functional.pad(change, (1, 0), value=True)
    ends = torch.nn.functional.pad(change, (0, 1), value=True)  # p is a document's last
    start = torch.cummax(torch.where(starts, pos, 0), 1).values  # (b, seq)
    end = torch.cummin(torch.where(ends, pos + 1, seq).flip(1), 1).values.flip(1)  # <= seq
    pad = (0, n * size - seq)
    start = torch.nn.functional.pad(start, pad).view(b * n, size)  # (b n, size): block rows
    end = torch.nn.functional.pad(end, pad).view(b * n, size)
    tile_rows = bi * n + qi  # each partial tile's block row: whole rows gathered, not elements
    k0 = (ki * size).to(small)[:, None]
    lo = start.index_select(0, tile_rows) - k0  # (n_partial, size)
    hi = end.index_select(0, tile_rows) - k0
    cols = torch.arange(size, device=dev, dtype=small)
    if causal:  # a row keeps no key past itself: r - k0 + 1 = (qi - ki) size + c + 1
        hi = torch.minimum(hi, ((qi - ki) * size).to(small)[:, None] + (cols + 1))
    # a row's span [lo, hi) as one int lo (size + 1) + hi: (size + 1)^2 kinds at most
    pairs = lo.clamp_(0, size).mul_(size + 1).add_(hi.clamp_(0, size))  # (n_partial, size)
    spans, which = _unique_rows(pairs)  # tiles with the same spans share one mask
    # each distinct span's row made once, the tiles gathered from them (one pass over the
    # masks, not three)
    pair, row_of = _unique_small(spans.flatten(), (size + 1) ** 2)
    span_rows = (cols >= (pair // (size + 1))[:, None]) & (cols < (pair % (size + 1))[:, None])
    masks = _gather_rows(span_rows, row_of).view(*spans.shape, size)  # (u, qb, kb)
    # the top-left causal triangle: row r keeps [0, r + 1), i.e. its pair is r + 1 (a pair
    # below size + 1 has lo = 0; what BlockMask would compare)
    tril = (spans == cols + 1).all(1).cpu().numpy()
    index = torch.full((b, n, n), -1, dtype=torch.int64, device=dev)
    index[bi, qi, ki] = which
    return BlockMask(
        mask_mod=mod,
        B=batch,
        H=None,
        Q_LEN=seq,
        KV_LEN=seq,
        Q_BLOCK_SIZE=size,
        KV_BLOCK_SIZE=size,
        block_kind=kind.unsqueeze(1),  # (b, 1, nq, nk)
        partial_index=index.unsqueeze(1),
        partial_masks=masks,
        partial_tril=tril,
    )
