"""Tree verification for speculative decoding: a draft tree checked in one call.

A draft model proposes a *tree* of candidate tokens; the target model scores every node
at once. Node ``i`` attends to the whole KV cache, to its ancestors and to itself — the
tokens that would precede it if its branch were decoded one token at a time — and sits
at position ``start + depth(i)`` for RoPE. The tree is given as a parent array
(``parents[i]`` = the parent's index, ``-1`` for a root; parents come first)::

    parents = [-1, 0, 0, 1, 1, 2]         tree mask (True = may attend), depth
                                               0 1 2 3 4 5
          0                              0  [ x . . . . . ]   0
        ┌─┴─┐                            1  [ x x . . . . ]   1
        1   2                            2  [ x . x . . . ]   1
      ┌─┴─┐ │                            3  [ x x . x . . ]   2
      3   4 5                            4  [ x x . . x . ]   2
                                         5  [ x . x . . x ]   2

or as a FlashInfer-style packed-bit mask: the boolean ``(num_nodes, kv_len)`` mask
flattened row by row (query first, kv last) and packed 8 to a ``uint8`` in "little" bit
order (element ``8 j + b`` is bit ``b`` of byte ``j``; see :func:`pack_tree_mask`).

:func:`build_tree` turns either into a :class:`DraftTree` (mask and depths, built once
and shared by every layer); :func:`tree_attention` attends the nodes' queries to the
cache (no mask: one pass over the cache for every node) and to the tree (the tree mask),
and merges the two by their log-sum-exps. Model-level verification lives in
:mod:`attnkit.models.speculative`.

Shapes: b batch, h_q / h_kv heads, n tree nodes, L cached keys, d head_dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast, overload

import torch

from attnkit import cascade
from attnkit._validate import check_bool, check_float, check_int, check_parents
from attnkit.attention import attention, check_sinks
from attnkit.backends.blockwise.merge import add_sinks, merge_partials
from attnkit.cascade import joined_view

__all__ = [
    "DraftTree",
    "build_tree",
    "pack_tree_mask",
    "tree_attention",
    "tree_from_mask",
    "unpack_tree_mask",
]


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree, planned once: parents, depths and the ancestor mask.

    Attributes:
        parents: ``parents[i]`` is node ``i``'s parent (``-1`` for a root).
        depth: ``(n,)`` long: a root's depth is 0, a child's its parent's plus one.
        mask: ``(n, n)`` bool: ``mask[i, j]`` is True when node ``j`` is node ``i`` or one
            of its ancestors (True = may attend).
    """

    parents: tuple[int, ...]
    depth: torch.Tensor
    mask: torch.Tensor
    #: the last :meth:`_joined_mask` made, by (cache length, group, device)
    _joined: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    #: the last :meth:`_stacked_mask` made, by (group, device)
    _stacked: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        """How many nodes the tree has."""
        return len(self.parents)

    def positions(self, start: int) -> torch.Tensor:
        """``(n,)`` positions of the nodes when ``start`` tokens precede the tree:
        ``start + depth`` (a branch decoded token by token gets the same)."""
        return self.depth + check_int(start, "start", minimum=0)

    def path(self, node: int) -> list[int]:
        """The nodes from ``node``'s root down to ``node``."""
        check_int(node, "node", minimum=0, maximum=self.num_nodes - 1)
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def leaves(self) -> list[int]:
        """The nodes with no child, in index order."""
        has_child = set(self.parents)
        return [i for i in range(self.num_nodes) if i not in has_child]

    def branches(self) -> list[list[int]]:
        """Every root-to-leaf path (one per leaf)."""
        return [self.path(leaf) for leaf in self.leaves()]

    def _joined_mask(self, cache: int, groups: int, device: torch.device) -> torch.Tensor:
        """:func:`_joined_mask` of this tree's mask; the last one made is kept (every layer
        of one verification step asks for the same)."""
        return _keep_last(
            self._joined, (cache, groups, device),
            lambda: _joined_mask(self.mask.to(device), cache, groups),
        )  # fmt: skip

    def _stacked_mask(self, groups: int, device: torch.device) -> torch.Tensor:
        """``(1, 1, groups * n, n)`` bool: the tree mask for a GQA group's heads stacked
        as rows (:func:`_joined_mask` of no cache), as the one pass of
        :func:`attnkit.cascade.fused_native` reads it; the last one made is kept."""
        n = self.num_nodes
        return _keep_last(
            self._stacked, (groups, device),
            lambda: _joined_mask(self.mask.to(device), 0, groups).view(1, 1, groups * n, n),
        )  # fmt: skip

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree with its tensors on ``device``."""
        return DraftTree(self.parents, self.depth.to(device), self.mask.to(device))


def build_tree(parents: Any, *, device: torch.device | str | None = None) -> DraftTree:
    """Plan a draft tree from its parent array (checked: parents precede their children).

    Args:
        parents: ``parents[i]`` = node ``i``'s parent, ``-1`` for a root: a list of ints
            or a 1-D integer tensor.
        device: where the mask and depths live.

    Returns:
        The :class:`DraftTree`.

    Raises:
        TypeError / ValueError: from :func:`attnkit._validate.check_parents`, naming the node.

    Example:
        >>> tree = build_tree([-1, 0, 0, 1])
        >>> tree.depth.tolist(), tree.mask[3].tolist()
        ([0, 1, 1, 2], [True, True, False, True])
    """
    par = check_parents(parents)
    n = len(par)
    depth = [0] * n
    mask = torch.eye(n, dtype=torch.bool)  # (n, n): each node sees itself
    for i, p in enumerate(par):
        if p >= 0:
            depth[i] = depth[p] + 1
            mask[i, :i] |= mask[p, :i]  # a node sees what its parent sees (and the parent)
    return DraftTree(tuple(par), torch.tensor(depth, device=device), mask.to(device))


def tree_from_mask(mask: torch.Tensor, *, cache_len: int = 0) -> DraftTree:
    """Recover the :class:`DraftTree` of a boolean tree mask.

    Args:
        mask: ``(n, cache_len + n)`` bool, True = may attend (FlashInfer's custom mask of
            one request, e.g. from :func:`unpack_tree_mask`): the first ``cache_len``
            columns are the cache (all True: verification reads the whole cache), the
            last ``n`` the tree (each row: the node and its ancestors).
        cache_len: cached keys before the tree's columns.

    Raises:
        TypeError: not a bool tensor.
        ValueError: a wrong shape, a cache column masked, or rows that are no tree's
            ancestor sets (naming the first bad node).
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
    cache_len = check_int(cache_len, "cache_len", minimum=0)
    if mask.dim() != 2 or mask.shape[1] != cache_len + mask.shape[0] or mask.shape[0] == 0:
        raise ValueError(
            f"mask must be (n, cache_len + n) with cache_len={cache_len}, got {tuple(mask.shape)}"
        )
    mask = mask.cpu()
    if cache_len and not bool(mask[:, :cache_len].all()):
        row = int((~mask[:, :cache_len]).any(1).nonzero()[0])
        raise ValueError(
            f"mask row {row} hides a cached key: every node attends to the whole cache"
        )
    tree = mask[:, cache_len:]  # (n, n)
    n = tree.shape[0]
    idx = torch.arange(n)
    before = tree & (idx.view(1, -1) < idx.view(-1, 1))  # strict ancestors
    parents = torch.where(before, idx.view(1, -1), -1).amax(1)  # the nearest: the parent
    planned = build_tree(parents)
    bad = (planned.mask != tree).any(1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(
            f"mask row {row} is not a tree node's ancestor set (itself, its parent and the "
            f"parent's ancestors, all before it): {tree[row].int().tolist()}"
        )
    return planned


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask into FlashInfer's bit layout: flattened row by row (query first,
    kv last), 8 elements per ``uint8``, "little" bit order (element ``8 j + b`` is bit
    ``b`` of byte ``j``), the last byte padded with zeros.

    Args:
        mask: ``(q_len, kv_len)`` bool.

    Returns:
        ``(ceil(q_len * kv_len / 8),)`` uint8.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError(f"mask must be a 2-D bool tensor, got {mask!r:.80}")
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    flat = torch.cat((flat, flat.new_zeros(pad))).view(-1, 8).to(torch.uint8)  # (bytes, 8)
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=mask.device)
    return (flat * weights).sum(1, dtype=torch.uint8)


def unpack_tree_mask(packed: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """Unpack :func:`pack_tree_mask`'s (FlashInfer's) bits into a ``(q_len, kv_len)`` bool mask.

    Raises:
        TypeError: ``packed`` not a 1-D uint8 tensor.
        ValueError: its length is not ``ceil(q_len * kv_len / 8)``.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"packed must be a 1-D uint8 tensor, got {packed!r:.80}")
    q_len, kv_len = check_int(q_len, "q_len"), check_int(kv_len, "kv_len")
    need = (q_len * kv_len + 7) // 8
    if packed.numel() != need:
        raise ValueError(
            f"packed has {packed.numel()} bytes; a ({q_len}, {kv_len}) mask packs into {need}"
        )
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) >> shifts) & 1  # (bytes, 8): bit b of byte j = element 8j + b
    return bits.reshape(-1)[: q_len * kv_len].view(q_len, kv_len).bool()


def _cascade(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_key: torch.Tensor,
    tree_value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    backend: str,
    tree: DraftTree | None,
    lane: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, lse)`` (float32) of both passes in ONE call of the native kernel, as a shared-prefix
    cascade of one request (:func:`attnkit.cascade.fused_native`): the cache is the prefix,
    every node's rows of a GQA group stacked against it with no mask; the tree's keys are
    the suffix, under the tree mask. Where the tree's keys and values follow the cache's
    in memory (a model's cache buffer), that call is one forward over ``cache ++ tree``
    whose mask covers the tree's ``n`` keys alone; elsewhere the kernel runs the two
    passes and merges them. None where it does not run: a batch of several
    rows (each has its own cache), an empty cache, inputs whose dtypes, devices or sizes
    do not fit together (:func:`attnkit.attention` then says what is wrong), and where
    ``fused_native`` stands aside (a gradient, another backend or device, a dtype the
    kernel does not read). ``tree``: the DraftTree whose ``mask`` this is, if any (it
    keeps the mask stacked per GQA group); ``lane``: the call's key in the cascade lane
    (:func:`_lane_key`), or None."""
    if query.shape[0] != 1 or key.shape[0] != 1 or key.shape[2] == 0 or mask.dim() > 4:
        return None
    d, d_v, h_kv = query.shape[3], value.shape[3], key.shape[1]
    parts = (key, value, tree_key, tree_value)
    if (
        any(x.dtype != query.dtype or x.device != query.device for x in parts)
        or value.dim() != 4
        or value.shape[:3] != key.shape[:3]
        or key.shape[3] != d
        or tree_key.shape[:2] != (1, h_kv)
        or tree_key.shape[3] != d
        or tree_value.shape[:3] != tree_key.shape[:3]
        or tree_value.shape[3] != d_v
        or mask.device != query.device
    ):
        return None
    from attnkit.cascade import fused_native

    mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (1, 1|h_q, n, n)
    if mask4.shape[0] != 1:
        return None
    # (a DraftTree keeps its mask stacked per GQA group for the one pass)
    stacked = None if tree is None else tree._stacked_mask(query.shape[1] // h_kv, query.device)
    return fused_native(
        query, key, value, tree_key, tree_value, mask4, scale, backend, stacked_mask=stacked,
        lane=lane,
    )  # fmt: skip


def _lane_key(
    query: object,
    key: object,
    value: object,
    tree_key: object,
    tree_value: object,
    return_lse: object,
    backend: object,
) -> tuple | None:
    """The key of a call of a :class:`DraftTree` (no scale, no sinks) in the cascade lane
    (:mod:`attnkit.cascade`'s, whose keys these are apart: tagged "tree"): a batch of one
    row whose tree follows the cache in memory runs there as its first call ran, one
    kernel pass over ``cache ++ tree`` (the tree's mask from the tree each call). Such a
    call costs the full path 35-40 us of Python (32 nodes, 8/2 heads, Xeon of session 29).
    None where the lane does not take the call."""
    if type(query) is not torch.Tensor or query.dim() != 4 or query.shape[0] != 1:
        return None
    found = cascade._lane_key(query, key, value, tree_key, tree_value, return_lse, backend)
    return None if found is None else ("tree", *found)


def _one_pass(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_key: torch.Tensor,
    tree_value: torch.Tensor,
    mask: torch.Tensor,
    tree: DraftTree | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(keys, values, mask)`` of ONE call over ``cache ++ tree`` where the tree's keys
    and values follow the cache's in memory and no gradient is wanted: the mask keeps
    every cache column (chunks the kernel then runs unmasked) and the tree mask on the
    last ``n``, for a GQA group's stacked rows ``(g*n, L + n)``. None where the two passes
    must run (a cache alone in memory, a gradient to record, a mask per batch or head)."""
    if key.shape[2] == 0 or (tree is None and mask.dim() != 2):
        return None
    if torch.is_grad_enabled() and any(
        x.requires_grad for x in (query, key, value, tree_key, tree_value)
    ):
        return None  # (the joined views would route gradients through as_strided)
    k_all, v_all = joined_view(key, tree_key), joined_view(value, tree_value)
    if k_all is None or v_all is None:
        return None
    cache, g = key.shape[2], query.shape[1] // key.shape[1]
    if tree is not None:
        return k_all, v_all, tree._joined_mask(cache, g, query.device)
    return k_all, v_all, _joined_mask(mask, cache, g)


def _keep_last(store: dict, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``store[key]``, made by ``make()`` (and every other entry dropped) if missing."""
    if key not in store:
        store.clear()
        store[key] = make()
    return store[key]


def _joined_mask(mask: torch.Tensor, cache: int, groups: int) -> torch.Tensor:
    """``(groups * n, cache + n)`` bool: every cache column kept, the tree ``mask`` on the
    last ``n``, for a GQA group's heads stacked as rows (row ``j n + i``: node ``i`` of
    head ``j``)."""
    n = mask.shape[0]
    joined = torch.ones(groups * n, cache + n, dtype=torch.bool, device=mask.device)
    joined[:, cache:] = mask.repeat(groups, 1)
    return joined


@overload
def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_key: torch.Tensor,
    tree_value: torch.Tensor,
    tree: DraftTree | torch.Tensor,
    *,
    scale: float | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
) -> torch.Tensor: ...


@overload
def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_key: torch.Tensor,
    tree_value: torch.Tensor,
    tree: DraftTree | torch.Tensor,
    *,
    scale: float | None = ...,
    sinks: torch.Tensor | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_key: torch.Tensor,
    tree_value: torch.Tensor,
    tree: DraftTree | torch.Tensor,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a draft tree's nodes to the cache and to their ancestors, in one call.

    Equals, for every node, attention over ``cache ++ (its ancestors, itself)``: what
    decoding its branch token by token computes. The cache pass has no mask (each
    GQA group's heads are stacked as rows, so the cache is read once per key/value
    head); the tree pass applies the tree mask; the two merge by log-sum-exp. A batch of
    one row that wants no gradient runs in ONE native kernel call: where the tree's keys
    and values follow the cache's in memory (one cache buffer split in two, as
    :mod:`attnkit.models.speculative` hands them in), one pass over ``cache ++ tree`` whose
    mask covers the tree's keys alone (4% less time than two passes, 32 nodes against
    2048 keys on a 2-core Zen 4); elsewhere both passes and their merge, as a
    shared-prefix cascade of one request (:func:`attnkit.cascade_attention`). Other
    calls whose tree follows the cache in memory (several batch rows, another backend)
    with no gradient wanted and a 2-D mask make both passes ONE attention call over
    ``cache ++ tree`` with a mask that keeps every cache column (chunks the native kernel
    then runs unmasked): 11-14% less time for a 32-node tree against 2048 keys (a 2-core
    Zen 3, fp32 and bf16). A :class:`DraftTree` verified this way with no ``scale`` or
    ``sinks`` is remembered by its tensors' shapes and strides, and the next such call
    goes straight to the kernel (:mod:`attnkit.cascade`'s lane: the same bits, 20-40 us
    less Python).

    Args:
        query: ``(b, h_q, n, d)``: the nodes' queries (RoPE'd at their tree positions).
        key: ``(b, h_kv, L, d)``: the cache (``L = 0`` allowed).
        value: ``(b, h_kv, L, d_v)``.
        tree_key: ``(b, h_kv, n, d)``: the nodes' own keys.
        tree_value: ``(b, h_kv, n, d_v)``.
        tree: a :class:`DraftTree` (see :func:`build_tree`), or a bool ``(n, n)`` mask
            broadcastable to ``(b, h_q, n, n)`` (True = may attend).
        scale: score scale; ``1 / sqrt(d)`` by default.
        sinks: ``(h_q,)`` learned sink logits, merged once.
        return_lse: also return the log-sum-exp ``(b, h_q, n)``.
        backend: the :func:`attnkit.attention` backend of both passes.

    Returns:
        The context ``(b, h_q, n, d_v)``, and the lse when ``return_lse``.

    Raises:
        TypeError / ValueError: as :func:`attnkit.attention` for the two passes, and a
            ``tree`` that is neither a DraftTree nor a bool mask, or whose size is not n.
    """
    lane = (
        _lane_key(query, key, value, tree_key, tree_value, return_lse, backend)
        if type(tree) is DraftTree and scale is None and sinks is None
        else None
    )
    if lane is not None and (kept := cascade._lane.get(lane)) is not None:
        stacked = tree._stacked_mask(query.shape[1] // key.shape[1], query.device)  # type: ignore[union-attr]
        ran = cascade.run_lane(
            kept, query, key, value, tree_key, tree_value, stacked, with_lse=return_lse is True
        )
        if ran is not None:
            out, lse = ran
            if out.dtype != query.dtype:
                out = out.to(query.dtype)
            return (out, cast(torch.Tensor, lse)) if return_lse else out
    return_lse = check_bool(return_lse, "return_lse")
    if isinstance(tree, DraftTree):
        mask = tree.mask if tree.mask.device == query.device else tree.mask.to(query.device)
    elif isinstance(tree, torch.Tensor) and tree.dtype == torch.bool:
        mask = tree
    else:
        raise TypeError(f"tree must be a DraftTree or a bool mask, got {type(tree).__name__}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (b, heads, len, dim) tensor, got {x!r:.60}")
    n = query.shape[2]
    if mask.shape[-1] != n or mask.shape[-2] != n:
        raise ValueError(f"the tree has {mask.shape[-1]} nodes but query has {n} rows")
    for name, x in (("tree_key", tree_key), ("tree_value", tree_value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[2] != n:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be (b, h_kv, n={n}, dim): one key per node, got {shape}")
    check_sinks(sinks, query)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scale = check_float(scale, "scale")  # (bool is no number; any sign, as attention's)
    b, h_q, _, d = query.shape
    h_kv = key.shape[1]
    if key.shape[2] > 0 and (h_kv == 0 or h_q % h_kv):
        raise ValueError(f"query heads ({h_q}) must be a multiple of key heads ({h_kv})")
    drafted = tree if isinstance(tree, DraftTree) else None
    fused = _cascade(query, key, value, tree_key, tree_value, mask, scale, backend, drafted, lane)
    if fused is not None:  # both passes and their merge in one kernel call
        out, lse = fused
    elif (whole := _one_pass(query, key, value, tree_key, tree_value, mask, drafted)) is not None:
        k_all, v_all, mask_all = whole  # cache ++ tree is one view: one call, one mask
        rows = query.reshape(b, h_kv, -1, d)  # (b, h_kv, g*n, d): a GQA group's rows
        out, lse = attention(
            rows, k_all, v_all, mask=mask_all, scale=scale, return_lse=True, backend=backend
        )  # (b, h_kv, g*n, d_v), (b, h_kv, g*n)
        out, lse = out.reshape(b, h_q, n, -1), lse.reshape(b, h_q, n)
    else:  # the two passes, merged
        out, lse = attention(
            query, tree_key, tree_value, mask=mask, scale=scale, return_lse=True, backend=backend
        )  # (b, h_q, n, d_v), (b, h_q, n): ancestors and self (never empty: the diagonal)
        if key.shape[2] > 0:
            rows = query.reshape(b, h_kv, -1, d)  # (b, h_kv, g*n, d): a GQA group's rows
            out_c, lse_c = attention(
                rows, key, value, scale=scale, return_lse=True, backend=backend
            )
            out_c = out_c.reshape(b, h_q, n, -1)  # (b, h_q, n, d_v)
            out, lse = merge_partials(out_c, lse_c.reshape(b, h_q, n), out, lse)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks, h_q)
    if out.dtype != query.dtype:  # (the kernel's float32 out rounded once, after the sink)
        out = out.to(query.dtype)
    return (out, lse) if return_lse else out
