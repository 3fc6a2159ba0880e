"""Speculative decoding with draft trees: verify a tree in one forward, accept a branch.

A draft proposes a tree of tokens after the ``start`` tokens already in the KV caches;
node 0 is usually the last accepted token (not yet cached), its children the draft's
guesses for the next token, and so on. :func:`verify_tree` runs the target model once
over all nodes: each node attends to the cache, its ancestors and itself at position
``start + depth`` (:mod:`attnkit.tree`), so its logits equal those of decoding its
branch one token at a time. :func:`greedy_accept` walks the tree along the target's
argmax; :func:`accept_path` moves the accepted nodes' keys/values into place, after
which the caches are exactly those of sequential decoding::

    time:    0 .. start-1 | start start+1 ... start+n-1      (slots the tree is written to)
    caches:  the prompt   | node 0  node 1 ... node n-1       after verify_tree
    caches:  the prompt   | path[0] path[1] ... path[m-1]     after accept_path(path)

Data flows down as in every forward: the model computes positions, RoPE values and the
tree mask once (:func:`tree_inputs`) and hands them to every layer; caches keep no counter,
so ``start`` comes from the caller.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from attnkit._validate import check_int
from attnkit.kv_cache import KVCache
from attnkit.models.attention import AttentionInputs
from attnkit.models.plan import Plan, check_context, check_idx
from attnkit.tree import DraftTree, build_tree, tree_attention

if TYPE_CHECKING:
    from attnkit.models.gpt import GPT

__all__ = ["accept_path", "greedy_accept", "tree_inputs", "verify_tree"]


def verify_tree(model: GPT, tokens: torch.Tensor, tree: Any, start: int) -> torch.Tensor:
    """Logits of every node of a draft tree, in one forward over the model's KV caches.

    The caches (:meth:`GPT.setup_cache`) hold time indices ``0 .. start - 1``; the nodes'
    keys and values are written to ``start .. start + n - 1`` (scratch until
    :func:`accept_path`).

    Args:
        model: a :class:`~attnkit.models.GPT` with caches and global attention layers.
        tokens: ``(b, n)`` token ids of the nodes (one tree shape for every row; rows
            of equal length: no padding mask).
        tree: a :class:`~attnkit.tree.DraftTree` or its parent array (``-1`` = root).
        start: the tokens already cached (time index of the tree's first slot).

    Returns:
        ``(b, n, vocab_size)``: node ``i``'s logits predict the token after it.

    Raises:
        TypeError / ValueError: no caches, ring/streaming caches or windowed layers,
            a bad parent array, ids out of the vocabulary, ``tokens`` not ``(b, n)``,
            or ``start + depth`` / ``start + n`` past ``context_length`` or the caches.
    """
    plan = tree_inputs(model, tokens, tree, start)
    return model._run(tokens, plan, last_only=False)


def tree_inputs(model: GPT, tokens: torch.Tensor, tree: Any, start: int) -> Plan:
    """Check a verification's inputs and plan it: positions ``start + depth``, their RoPE
    values, and one :class:`AttentionInputs` shared by every layer (the tree mask as a
    dense mask, and an ``attend`` that splits cache and tree, :func:`attnkit.tree.tree_attention`)."""
    layout = model.layout()
    check_idx(layout, tokens)
    tree = tree if isinstance(tree, DraftTree) else build_tree(tree)
    n = tree.num_nodes
    if tokens.shape[1] != n:
        raise ValueError(f"tokens has {tokens.shape[1]} nodes per row, the tree {n}")
    start = check_int(start, "start", minimum=0)
    caches = layout.caches
    if caches is None:
        raise ValueError(
            "verify_tree needs KV caches: call model.setup_cache(batch, max_len) first"
        )
    if layout.streaming is not None or any(c.window is not None for c in caches):
        raise ValueError("verify_tree needs full caches: no ring (sliding window) or streaming")
    if any(w is not None for w in layout.windows):
        raise ValueError("verify_tree supports global attention layers only (no window)")
    if caches[0].k_cache.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"tokens has {tokens.shape[0]} rows, the caches {caches[0].k_cache.shape[0]}"
        )
    check_context(layout, start + n)  # the slots the nodes are written to
    device = tokens.device
    tree = tree.to(device)
    positions = tree.positions(start)[None]  # (1, n): start + depth
    input_pos = torch.arange(start, start + n, device=device)  # (n,) time indices (slots)
    rope = None
    if layout.rope is not None:
        cos, sin = layout.rope.cos[positions], layout.rope.sin[positions]  # (1, n, d)
        rope = (cos[:, None], sin[:, None])  # (1, 1, n, d)
    s = caches[0].size if caches[0].static else start + n  # keys a cache update returns
    mask = torch.zeros(n, s, dtype=torch.bool, device=device)
    mask[:, :start] = True  # the whole cache
    mask[:, start : start + n] = tree.mask  # ancestors and self
    attend = partial(_tree_attend, start=start, tree=tree)
    inputs = AttentionInputs(input_pos, rope, mask=mask[None, None], causal=False, attend=attend)
    return Plan(positions, [inputs] * len(layout.windows))


def _tree_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    start: int,
    tree: DraftTree,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    dropout_p: float = 0.0,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """A layer's ``attend`` for verification: the keys ``k`` ``(b, h_kv, s, d)`` a cache
    returned are split into the cache ``[0, start)`` and the tree ``[start, start + n)``
    (views, no copy) and attended by :func:`attnkit.tree.tree_attention`. ``mask`` is the
    same relation as a dense mask (for layers that call :func:`attnkit.attention` with it)
    and is not needed here."""
    if dropout_p > 0:
        raise ValueError("tree verification runs without dropout: call model.eval()")
    n = tree.num_nodes
    kc, vc = k.narrow(2, 0, start), v.narrow(2, 0, start)  # (b, h_kv, start, d)
    kt, vt = k.narrow(2, start, n), v.narrow(2, start, n)  # (b, h_kv, n, d)
    return tree_attention(q, kc, vc, kt, vt, tree, sinks=sinks, backend=backend)


def accept_path(model: GPT, tree: Any, start: int, path: list[int]) -> None:
    """Move the keys/values of an accepted root-to-node ``path`` of the last verified tree
    to the time indices ``start .. start + len(path) - 1``: the caches then hold exactly
    what decoding those tokens one by one writes (node ``path[i]`` was computed at
    position ``start + i``).

    Raises:
        ValueError: no caches, or ``path`` not a path from a root down the tree.
    """
    tree = tree if isinstance(tree, DraftTree) else build_tree(tree)
    start = check_int(start, "start", minimum=0)
    if not isinstance(path, (list, tuple)) or not path:
        raise ValueError(f"path must be a non-empty list of node indices, got {path!r}")
    for i, node in enumerate(path):
        check_int(node, f"path[{i}]", minimum=0, maximum=tree.num_nodes - 1)
        want = -1 if i == 0 else path[i - 1]
        if tree.parents[node] != want:
            raise ValueError(
                f"path[{i}] = {node} has parent {tree.parents[node]}, not {want}: a path runs "
                "from a root down the tree"
            )
    if model.caches is None:
        raise ValueError("accept_path needs the KV caches verify_tree wrote to")
    m = len(path)
    caches: list[KVCache] = list(model.caches)  # type: ignore[arg-type]
    with torch.no_grad():
        for cache in caches:
            slots = torch.tensor(path, device=cache.k_cache.device) + start  # (m,)
            for buf in (cache.k_cache, cache.v_cache):
                if buf is not None:
                    buf.narrow(2, start, m).copy_(buf.index_select(2, slots))


def greedy_accept(tokens: torch.Tensor, tree: Any, logits: torch.Tensor) -> tuple[list[int], int]:
    """The longest branch the target model agrees with, greedily (one row).

    Starting at the root (node 0, the last accepted token), move to the child whose token
    is the argmax of the current node's logits while there is one.

    Args:
        tokens: ``(n,)`` the nodes' token ids.
        tree: a :class:`~attnkit.tree.DraftTree` or parent array with one root, node 0.
        logits: ``(n, vocab)`` from :func:`verify_tree` (one row of it).

    Returns:
        ``(path, next_token)``: the accepted nodes from the root, and the target's token
        after the last of them (the bonus token). The new tokens are
        ``tokens[path[1:]] + [next_token]``.

    Raises:
        ValueError: shapes that do not match the tree, or a tree with another root than node 0.
    """
    tree = tree if isinstance(tree, DraftTree) else build_tree(tree)
    n = tree.num_nodes
    if any(p < 0 for p in tree.parents[1:]):
        raise ValueError("greedy_accept needs a single root, node 0 (the last accepted token)")
    if not isinstance(tokens, torch.Tensor) or tokens.shape != (n,):
        raise ValueError(f"tokens must be ({n},), got {getattr(tokens, 'shape', tokens)}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != n:
        raise ValueError(f"logits must be ({n}, vocab), got {getattr(logits, 'shape', logits)}")
    best = logits.argmax(-1).tolist()  # (n,)
    toks = tokens.tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p, []).append(i)
    path = [0]
    while True:
        nxt = next((c for c in children.get(path[-1], []) if toks[c] == best[path[-1]]), None)
        if nxt is None:
            return path, best[path[-1]]
        path.append(nxt)
