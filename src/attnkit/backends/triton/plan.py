"""What the Triton kernels need to know about a call, worked out once per call.

:class:`KernelPlan` holds the flags the kernels are specialised on (causal, window,
dense mask kind, score mod, sinks), the tile sizes, and, for a ``mask_mod`` or a block
mask, the block-sparse tables: for every query block the list of non-empty key blocks
(and the transpose, for the dK/dV kernel), each entry marked FULL (no per-element
mask) or pointing at its PARTIAL tile's packed keep bits. The ``mask_mod`` is
evaluated once, on the PARTIAL tiles only.

Torch only: this module imports no triton, so the plan can be tested anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnkit.masks import MaskMod

EMPTY, PARTIAL, FULL = 0, 1, 2

#: Partial tiles evaluated per ``mask_mod`` call when packing (bounds the temporaries).
PACK_CHUNK = 1024


@dataclass
class SparseTables:
    """Block-sparse iteration lists for one block mask (see the module docs).

    ``kv_num (Bm*Hm*n_qb,)``, ``kv_idx``/``kv_part (Bm*Hm*n_qb*n_kb,)``: per query block
    the count and the ascending indices of its non-empty key blocks, with the partial
    tile id (``-1`` = FULL); ``q_num``/``q_idx``/``q_part``: the same per key block;
    ``part (P, q_block, kv_block)`` uint8 keep bits of the PARTIAL tiles.
    """

    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    kv_part: torch.Tensor
    q_num: torch.Tensor
    q_idx: torch.Tensor
    q_part: torch.Tensor
    part: torch.Tensor
    batch: int
    heads: int
    n_qb: int
    n_kb: int
    q_block: int
    kv_block: int


def _lists(nonempty: torch.Tensor, part_id: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row of ``nonempty (.., n_rows, n_cols)``: count, ascending indices, partial ids."""
    # a stable sort on "is empty" puts the non-empty columns first, in index order
    order = torch.sort((~nonempty).to(torch.int8), dim=-1, stable=True).indices
    num = nonempty.sum(-1).to(torch.int32).reshape(-1)
    idx = order.to(torch.int32).reshape(-1)
    part = part_id.gather(-1, order).reshape(-1)
    return num.contiguous(), idx.contiguous(), part.contiguous()


def sparse_tables(
    block_kind: torch.Tensor,
    mask_mod: MaskMod | None,
    q_len: int,
    k_len: int,
    q_block: int,
    kv_block: int,
    device: torch.device,
) -> SparseTables:
    """Build the iteration lists and pack the PARTIAL tiles' keep bits.

    Args:
        block_kind: int8 ``(Bm, Hm, n_qb, n_kb)`` of EMPTY / PARTIAL / FULL.
        mask_mod: the predicate evaluated on the PARTIAL tiles (absolute positions).
        q_len, k_len: the call's lengths (indices past them are clamped: the kernels
            mask those positions anyway).
        q_block, kv_block: the block sizes ``block_kind`` was built with.
        device: where the kernels run.
    """
    kind = block_kind.to(device=device, dtype=torch.int8)
    bm, hm, n_qb, n_kb = kind.shape
    nonempty = kind != EMPTY
    partial = kind == PARTIAL
    coords = partial.nonzero()  # (P, 4): b, h, qb, kb
    part_id = torch.full(kind.shape, -1, dtype=torch.int32, device=device)
    part_id[partial] = torch.arange(coords.shape[0], dtype=torch.int32, device=device)
    kv_num, kv_idx, kv_part = _lists(nonempty, part_id)
    q_num, q_idx, q_part = _lists(nonempty.transpose(-1, -2), part_id.transpose(-1, -2))
    part = torch.empty(coords.shape[0], q_block, kv_block, dtype=torch.uint8, device=device)
    if coords.shape[0]:
        if mask_mod is None:
            raise ValueError("a block mask with PARTIAL tiles needs its mask_mod")
        rows = torch.arange(q_block, device=device).view(1, -1, 1)
        cols = torch.arange(kv_block, device=device).view(1, 1, -1)
        for lo in range(0, coords.shape[0], PACK_CHUNK):
            c = coords[lo : lo + PACK_CHUNK]
            b, h = c[:, 0].view(-1, 1, 1), c[:, 1].view(-1, 1, 1)
            q_idx_t = (c[:, 2].view(-1, 1, 1) * q_block + rows).clamp(max=q_len - 1)
            kv_idx_t = (c[:, 3].view(-1, 1, 1) * kv_block + cols).clamp(max=k_len - 1)
            keep = torch.as_tensor(mask_mod(b, h, q_idx_t, kv_idx_t), device=device)
            part[lo : lo + PACK_CHUNK] = keep.expand(c.shape[0], q_block, kv_block).to(torch.uint8)
    return SparseTables(
        kv_num, kv_idx, kv_part, q_num, q_idx, q_part, part, bm, hm, n_qb, n_kb, q_block, kv_block
    )


def classify(
    mask_mod: MaskMod,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    q_block: int,
    kv_block: int,
    device: torch.device,
) -> torch.Tensor:
    """EMPTY / PARTIAL / FULL of every tile of ``mask_mod``, one row of query blocks at a time.

    Returns:
        int8 ``(batch, heads, n_qb, n_kb)``.
    """
    n_qb, n_kb = -(-q_len // q_block), -(-k_len // kv_block)
    kind = torch.empty(batch, heads, n_qb, n_kb, dtype=torch.int8, device=device)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    kv = torch.arange(n_kb * kv_block, device=device).view(1, 1, 1, -1)
    kv_in = kv < k_len
    for qb in range(n_qb):
        q = torch.arange(qb * q_block, (qb + 1) * q_block, device=device).view(1, 1, -1, 1)
        inside = (q < q_len) & kv_in  # (1, 1, q_block, n_kb * kv_block)
        keep = torch.as_tensor(mask_mod(b, h, q.clamp(max=q_len - 1), kv.clamp(max=k_len - 1)))
        keep = keep.to(device=device, dtype=torch.bool).expand(batch, heads, q_block, -1)
        tiles = (keep & inside).reshape(batch, heads, q_block, n_kb, kv_block)
        holes = (~keep & inside).reshape(batch, heads, q_block, n_kb, kv_block)
        anyk = tiles.any(-1).any(2)  # (b, h, n_kb)
        full = ~holes.any(-1).any(2)
        kind[:, :, qb] = torch.where(
            anyk, torch.where(full, FULL, PARTIAL), EMPTY
        ).to(torch.int8)
    return kind


ModSpec = tuple[int, float, "torch.Tensor | None"]


def score_mod_spec(score_mod: Callable | None) -> ModSpec | None:
    """``(MOD, cap, slopes)`` for a score mod the kernels run in-tile, None for one they cannot.

    The kernels run the mods of :mod:`attnkit.masks` that describe themselves with a
    ``spec``: ``alibi`` (its slopes receive gradients) and ``softcap``.
    """
    if score_mod is None:
        return (0, 0.0, None)
    spec = getattr(score_mod, "spec", None)
    if not isinstance(spec, tuple) or not spec:
        return None
    if spec[0] == "alibi" and isinstance(spec[1], torch.Tensor):
        return (1, 0.0, spec[1])
    if spec[0] == "softcap" and isinstance(spec[1], float):
        return (2, spec[1], None)
    return None
