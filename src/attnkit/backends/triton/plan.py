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

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnkit.block_mask import EMPTY, BlockMask

if TYPE_CHECKING:
    from attnkit.backends.triton.compiled import CompiledMod


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


#: The tables built for each block mask (per device): a block mask reused by every layer
#: and step is turned into tables once.
_TABLES: weakref.WeakKeyDictionary[BlockMask, dict[torch.device, SparseTables]] = (
    weakref.WeakKeyDictionary()
)


def sparse_tables(block_mask: BlockMask, device: torch.device) -> SparseTables:
    """The kernels' iteration lists for ``block_mask`` (built once per mask and device; its
    stored partial tiles are used as they are: the ``mask_mod`` is not evaluated again)."""
    per_device = _TABLES.setdefault(block_mask, {})
    if device not in per_device:
        per_device[device] = _build_tables(block_mask, device)
    return per_device[device]


def _build_tables(block_mask: BlockMask, device: torch.device) -> SparseTables:
    kind = block_mask.block_kind.to(device=device, dtype=torch.int8)  # (Bk, Hk, n_qb, n_kb)
    bm, hm, n_qb, n_kb = kind.shape
    nonempty = kind != EMPTY
    part_id = block_mask.partial_index.to(device=device, dtype=torch.int32)  # -1: not PARTIAL
    kv_num, kv_idx, kv_part = _lists(nonempty, part_id)
    q_num, q_idx, q_part = _lists(nonempty.transpose(-1, -2), part_id.transpose(-1, -2))
    part = block_mask.partial_masks.to(device=device, dtype=torch.uint8).contiguous()
    if part.shape[0] == 0:  # a valid pointer for the kernels, never read
        part = torch.zeros(1, 1, 1, dtype=torch.uint8, device=device)
    return SparseTables(
        kv_num, kv_idx, kv_part, q_num, q_idx, q_part, part, bm, hm, n_qb, n_kb,
        block_mask.Q_BLOCK_SIZE, block_mask.KV_BLOCK_SIZE,
    )  # fmt: skip


@dataclass
class KernelPlan:
    """The call as the kernels see it (built once per call by the backend)."""

    causal: bool
    shift: int
    window: int  # 0 = no window
    mask: torch.Tensor | None  # (B|bcast, h|bcast, l_q, l_k) view, uint8 or float
    mask_kind: int
    mod: int
    cap: float
    scale: float
    sparse: SparseTables | None
    fwd_blocks: tuple[int, int]
    bwd_blocks: tuple[int, int]
    num_warps: int
    num_stages: int
    interpret: bool
    compiled: CompiledMod | None = None  # a traced score_mod (mod 3) and/or mask_mod, generated


ModSpec = tuple[int, float, "torch.Tensor | None"]


def score_mod_spec(score_mod: Callable | None) -> ModSpec | None:
    """``(MOD, cap, slopes)`` for a score mod the kernels run in-tile, None for one they cannot.

    The kernels run the mods of :mod:`attnkit.masks` that describe themselves with a
    ``spec``: ``alibi`` (its slopes receive gradients) and ``softcap``, with hand-written
    code; any other mod is traced (:mod:`attnkit.mod_graph`) and generated
    (:mod:`.codegen`), ``MOD`` 3, by the backend.
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
