"""Masks: the one convention attnkit uses, and the causal mask in both alignments.

Mask convention (the only one in attnkit)
-----------------------------------------
* A **boolean** mask says where a query *may attend*: ``True`` = attend,
  ``False`` = masked out. (Same as ``torch.nn.functional.scaled_dot_product_attention``;
  the *opposite* of ``torch.nn.MultiheadAttention``'s ``attn_mask``, where True = masked.)
* A **float** mask is *added* to the scaled scores: ``0`` keeps a position,
  ``-inf`` removes it, anything else biases it.
* A mask broadcasts to the scores' shape ``(..., heads, Lq, Lk)``.
* A query row whose keys are all masked gets weights of zero and a context
  vector of zeros (never NaN), in the forward and the backward pass.

Causal alignment when ``Lq != Lk``
---------------------------------
``causal=True`` means ``"bottom_right"``: the *last* query lines up with the
*last* key, as when new queries follow the keys already in a KV cache.
``"top_left"`` lines the first query up with the first key, as
``scaled_dot_product_attention(is_causal=True)`` does. For ``Lq == Lk`` both
are the usual lower triangle. With Lq = 2, Lk = 5 (``1`` = may attend)::

    bottom_right (default)      top_left
        k0 k1 k2 k3 k4            k0 k1 k2 k3 k4
    q0   1  1  1  1  0        q0   1  0  0  0  0
    q1   1  1  1  1  1        q1   1  1  0  0  0

With Lq > Lk, ``bottom_right`` leaves the first ``Lq - Lk`` queries with no
key at all: their outputs are zeros.

Windows and mods
----------------
``window=w`` keeps, for the query at aligned position ``p``, the keys
``p - w < kv_idx`` (itself and ``w - 1`` before; symmetric ``|p - kv_idx| < w``
without ``causal``). ``mask_mod(b, h, q_idx, kv_idx)`` returns True where a query
may attend; ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites the scaled scores
(its tensors receive gradients). Indices are plain ``0..L-1`` positions in the call.
Every piece is ANDed: causal, window, mask_mod and ``mask``.

Composable pieces
-----------------
Mask mods (predicates, True = may attend): :func:`causal`, :func:`sliding_window`
(aligned as ``causal=True``/``window=``: bottom-right, so they take ``q_len``/``k_len``,
or ``"top_left"`` without),
:func:`padding`, :func:`prefix_lm`, :func:`document`, combined with :func:`and_masks`
and :func:`or_masks`. Score mods: :func:`alibi`, :func:`softcap`, :func:`relative_bias`.
Each backend turns them into what it needs: the reference and sdpa backends a dense
bool mask (or a dense score tensor), the blockwise backend a cached block plan
(:mod:`attnkit.block_mask`) whose empty tiles it skips. Mods are called with
FlexAttention's scalar-index semantics (:mod:`attnkit.mods`); the ones here also run on
broadcast index grids (``grid = True``). A score mod's learnable tensors get gradients
on every backend (the blockwise one finds them through the mod's autograd graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnkit._validate import (
    Alignment,
    check_alignment,
    check_bool,
    check_float,
    check_int,
    check_window,
)

__all__ = [
    "CausalAlignment",
    "MaskMod",
    "ScoreMod",
    "alibi",
    "and_masks",
    "causal",
    "causal_mask",
    "check_mod_sizes",
    "dead_rows",
    "document",
    "keeps_every_key",
    "materialize",
    "normalize_causal",
    "or_masks",
    "padding",
    "position_keep",
    "prefix_lm",
    "reachable_keys",
    "relative_bias",
    "removed_keys",
    "sliding_window",
    "softcap",
    "window_mask",
]

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend), written for
#: scalar indices as in FlexAttention (see :mod:`attnkit.mods`).
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled scores.
ScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]

CausalAlignment = Alignment


def normalize_causal(causal: bool | str | None) -> CausalAlignment | None:
    """Turn a user's ``causal`` argument into an alignment name, or None.

    Raises:
        ValueError: for a string that names no alignment.
        TypeError: for anything that is not a bool, a string or None.
    """
    if causal is None or causal is False:
        return None
    if causal is True:
        return "bottom_right"
    if isinstance(causal, str):
        return check_alignment(causal, "causal")
    raise TypeError(f"causal must be a bool or an alignment name, got {type(causal).__name__}")


def position_keep(
    pos: torch.Tensor, kv_idx: torch.Tensor, *, causal: bool, window: int | None
) -> torch.Tensor:
    """The causal/window rule, the one place it is written (True = may attend).

    Args:
        pos: aligned query positions, broadcastable against ``kv_idx``.
        kv_idx: key indices.
        causal: drop keys after the query's position.
        window: keep only ``pos - window < kv_idx`` (and, without ``causal``,
            ``kv_idx < pos + window``); None for no window.
    """
    if causal:
        keep = kv_idx <= pos
    elif window is not None:
        keep = kv_idx < pos + window
    else:
        raise ValueError("position_keep needs causal=True or a window")
    if window is not None:
        keep = keep & (kv_idx > pos - window)
    return keep


def reachable_keys(
    q_len: int, k_len: int, causal: CausalAlignment | None, window: int | None
) -> tuple[int, int]:
    """The keys ``[lo, hi)`` that causal/window leave to at least one query (plain ints).

    Keys outside are removed for every query (e.g. the keys after the last query with
    ``"top_left"`` and ``Lk > Lq``, or before the first query's window).
    """
    if q_len == 0 or (causal is None and window is None):
        return 0, k_len
    offset = k_len - q_len if (causal or "bottom_right") == "bottom_right" else 0
    first, last = offset, offset + q_len - 1  # aligned positions of the first/last query
    lo = 0 if window is None else max(0, first - window + 1)
    hi = last + 1 if causal is not None else last + (window or 0)  # no causal: a window
    return min(lo, k_len), max(0, min(hi, k_len))


def causal_keeps_every_key(q_len: int, k_len: int, causal: CausalAlignment | None) -> bool:
    """Whether ``causal`` alone removes no key from any query: the first query's aligned
    position is at or past the last key (``"bottom_right"`` with one query, ``"top_left"``
    with one key). :func:`attnkit.attention` then drops it (without a window), so that a
    decode step called with ``causal=True`` takes the unmasked paths."""
    if causal is None:
        return True
    offset = k_len - q_len if causal == "bottom_right" else 0
    return offset >= k_len - 1


def is_top_left_triangle(q_len: int, k_len: int, causal: CausalAlignment | None) -> bool:
    """Whether ``causal`` is the triangle ``scaled_dot_product_attention(is_causal=True)``
    draws: ``"top_left"``, or ``"bottom_right"`` with as many queries as keys (any other
    causal call takes a dense mask there)."""
    return causal == "top_left" or (causal == "bottom_right" and q_len == k_len)


def _aligned_positions(
    q_len: int, k_len: int, alignment: CausalAlignment, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned query positions ``(q, 1)`` and key indices ``(k,)`` (see the module docs)."""
    offset = k_len - q_len if alignment == "bottom_right" else 0
    pos = torch.arange(q_len, device=device).unsqueeze(-1) + offset  # (q, 1)
    return pos, torch.arange(k_len, device=device)  # (q, 1), (k,)


def causal_mask(
    q_len: int,
    k_len: int,
    alignment: CausalAlignment = "bottom_right",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Return the ``(q_len, k_len)`` boolean causal mask (True = may attend).

    Args:
        q_len: number of queries.
        k_len: number of keys.
        alignment: ``"bottom_right"`` (default) or ``"top_left"``; see the module docs.
        device: where to build the mask.

    Raises:
        TypeError: ``q_len`` or ``k_len`` not an int (``bool`` included).
        ValueError: a negative length, or an ``alignment`` that is neither (a typo is not
            read as top-left).
    """
    q_len = check_int(q_len, "q_len", minimum=0)
    k_len = check_int(k_len, "k_len", minimum=0)
    alignment = check_alignment(alignment)
    pos, kv = _aligned_positions(q_len, k_len, alignment, device)
    return position_keep(pos, kv, causal=True, window=None)  # (q, k)


def window_mask(
    q_len: int,
    k_len: int,
    window: int,
    alignment: CausalAlignment = "bottom_right",
    causal: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Return the ``(q_len, k_len)`` boolean sliding-window mask (True = may attend).

    A query at aligned position ``p`` (``q_idx + k_len - q_len`` for bottom-right,
    ``q_idx`` for top-left) keeps the keys ``p - window < kv_idx``: itself and the
    ``window - 1`` before it. Without ``causal`` the window is symmetric
    (``|p - kv_idx| < window``); with it, later keys are removed too.

    Raises:
        TypeError / ValueError: a ``window`` that is not an int >= 1 (0 would keep no
            key), lengths that are not ints >= 0, a ``causal`` that is not a bool, or an
            ``alignment`` that is neither ``"top_left"`` nor ``"bottom_right"``.
    """
    q_len = check_int(q_len, "q_len", minimum=0)
    k_len = check_int(k_len, "k_len", minimum=0)
    window = check_window(window, optional=False)
    alignment = check_alignment(alignment)
    causal = check_bool(causal, "causal")
    pos, kv = _aligned_positions(q_len, k_len, alignment, device)
    return position_keep(pos, kv, causal=causal, window=window)  # (q, k)


def index_grids(
    batch: int, heads: int, q_len: int, k_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Broadcastable ``(b, h, q_idx, kv_idx)`` index tensors for mask and score mods."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(k_len, device=device).view(1, 1, 1, -1)
    return b, h, q, kv


def materialize(
    mask: torch.Tensor | None,
    causal: CausalAlignment | None,
    window: int | None,
    mask_mod: MaskMod | None,
    query_shape: torch.Size,
    k_len: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Fold causal, window and ``mask_mod`` into one dense mask (bool stays bool, float stays float).

    Returns None when nothing masks the call.
    """
    q_len = query_shape[-2]
    keep = None
    if causal is not None or window is not None:
        pos, kv = _aligned_positions(q_len, k_len, causal or "bottom_right", device)
        keep = position_keep(pos, kv, causal=causal is not None, window=window)  # (q, k)
    if mask_mod is not None:
        from attnkit.mods import eval_mask_mod

        b, h = query_shape[0], query_shape[1]
        m = eval_mask_mod(mask_mod, b, h, 0, q_len, 0, k_len, device)  # (b|1, h|1, q, k)
        keep = m if keep is None else keep & m
    if keep is None:
        return mask
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, float("-inf"))


def check_mod_sizes(
    mod: MaskMod | ScoreMod | None, name: str, batch: int, heads: int, q_len: int, k_len: int
) -> None:
    """Check, before any computation, that ``mod`` was built for these sizes.

    The mods of this module that index a tensor by batch, head or position
    (:func:`padding`, :func:`document`, :func:`alibi`, :func:`relative_bias`) know
    the sizes they need; a user's plain function is not checked here (its output
    shape is checked where it is called).

    Raises:
        ValueError: naming ``name``, the mod and the mismatched sizes.
    """
    check = getattr(mod, "check_sizes", None)
    if check is not None:
        problem = check(batch, heads, q_len, k_len)
        if problem is not None:
            raise ValueError(f"{name} {mod!r} does not fit this call: {problem}")


def _kept(mask: torch.Tensor) -> torch.Tensor:
    """Where a bool or float mask keeps a score (a float mask removes only ``-inf``)."""
    return mask if mask.dtype == torch.bool else ~torch.isneginf(mask)


def _any(kept: torch.Tensor, dim: int) -> torch.Tensor:
    """``kept.any(dim=dim)`` of a bool tensor, reduced as uint8 on CPU: torch's CPU bool
    reductions run element by element (a 128 x 2080 mask: 230 us, as uint8 13 us)."""
    if kept.device.type != "cpu" or kept.numel() == 0 or torch.compiler.is_compiling():
        return kept.any(dim=dim)
    return kept.view(torch.uint8).amax(dim=dim).bool()  # (bool bytes are 0 or 1)


def keeps_every_key(mask: torch.Tensor) -> bool:
    """Whether every (head, key) of ``mask`` is kept by some query row: then
    :func:`removed_keys` finds no key, for any grouping of the heads; known from one
    reduction (and one value read) without building the removed set.

    Args:
        mask: a bool or float mask broadcastable to ``(..., h_q, l_q, l_k)``.
    """
    kept = _kept(mask)
    return bool((kept if kept.dim() == 1 else _any(kept, -2)).all())


def removed_keys(mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The keys ``mask`` removes for *every* query: bool ``(..., h_kv|1, l_k, 1)``.

    A key shared by several query heads (GQA) counts as removed only if every one of
    them removes it. The result broadcasts against a key ``(..., h_kv, l_k, d)``.

    Args:
        mask: a bool or float mask broadcastable to ``(..., h_q, l_q, l_k)``.
        kv_heads: the key/value heads ``h_kv`` (1 for a key without a head dim).
    """
    kept = _kept(mask)
    if kept.dim() == 1:  # (l_k,)
        return ~kept.unsqueeze(-1)
    kept = _any(kept, -2)  # (..., h_q|1, l_k): kept by some query
    if mask.dim() >= 3 and kept.shape[-2] not in (1, kv_heads):
        kept = _any(kept.unflatten(-2, (kv_heads, -1)), -2)  # (..., h_kv, l_k)
    return ~kept.unsqueeze(-1)


def dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """Return a ``(..., Lq, 1)`` bool tensor: True where a query row keeps no key."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


# ---------------------------------------------------------------------------
# Composable mask mods and score mods
# ---------------------------------------------------------------------------


class _Mod:
    """A named mask/score mod: callable, printable, listing its learnable ``tensors``."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        tensors: tuple[torch.Tensor, ...] = (),
        additive: bool = False,
        grid: bool = True,
        check_sizes: Callable[[int, int, int, int], str | None] | None = None,
        spec: tuple = (),
        relative: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.name, self._fn, self.tensors = name, fn, tensors
        #: attnkit's mods also run on broadcast index grids (see :mod:`attnkit.mods`)
        self.grid = grid
        #: ``check_sizes(batch, heads, q_len, k_len) -> problem or None``: what the mod
        #: needs of a call (see :func:`check_mod_sizes`).
        self.check_sizes = check_sizes or (lambda batch, heads, q_len, k_len: None)
        #: what the mod computes, for kernels that run it in-tile (the triton backend):
        #: ``("alibi", slopes)`` or ``("softcap", cap)``; empty for other mods.
        self.spec = spec
        #: ``relative(kv_minus_q (n,), dtype) -> (heads, n)``: for an additive mod whose
        #: bias depends on the head and ``kv_idx - q_idx`` only (the same for every batch
        #: element), that bias, computed as the mod computes it; kernels then build a
        #: tile's bias from one vector (:mod:`attnkit.backends.blockwise.toeplitz`).
        self.relative = relative
        #: True when the mod adds a bias that does not depend on the score
        #: (d out / d score = 1): a backward may then skip autograd for the score.
        self.additive = additive

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self._fn(*args)

    def __repr__(self) -> str:
        return self.name


def _mod_offset(name: str, alignment: str, q_len: int | None, k_len: int | None) -> int:
    """The query offset of a causal/window mod, aligned as ``attention(causal=...)`` is.

    Bottom-right (the default, as ``causal=True``) lines the last query up with the
    last key: a mod cannot see the lengths, so it must be given them; top-left needs none.
    """
    check_alignment(alignment)
    if alignment == "top_left":
        if q_len is not None or k_len is not None:
            raise ValueError(f"{name}: top_left alignment takes no q_len/k_len")
        return 0
    if q_len is None or k_len is None:
        raise ValueError(
            f"{name}: bottom_right alignment (the default, as causal=True) needs q_len and "
            "k_len, which a mask mod cannot see; pass them, or alignment='top_left' "
            "(the same when q_len == k_len)"
        )
    return check_int(k_len, "k_len", minimum=0) - check_int(q_len, "q_len", minimum=0)


def causal(
    alignment: CausalAlignment = "bottom_right", q_len: int | None = None, k_len: int | None = None
) -> MaskMod:
    """Causal mask mod, aligned as ``attention(causal=True)`` (bottom-right) by default.

    Bottom-right needs ``q_len`` and ``k_len`` (a mod only sees indices); ``"top_left"``
    needs neither. Raises ValueError when bottom-right lengths are missing.
    """
    offset = _mod_offset("causal", alignment, q_len, k_len)
    return _Mod(
        f"causal({alignment!r})",
        lambda b, h, q, kv: position_keep(q + offset, kv, causal=True, window=None),
    )


def sliding_window(
    window: int,
    causal: bool = True,
    alignment: CausalAlignment = "bottom_right",
    q_len: int | None = None,
    k_len: int | None = None,
) -> MaskMod:
    """Keep ``p - window < kv_idx`` (and ``kv_idx <= p`` if ``causal``, else
    ``kv_idx < p + window``), ``p`` the aligned query position: the same keys as
    ``attention(window=window, causal=causal)``. Aligned like :func:`causal` (bottom-right
    needs ``q_len`` and ``k_len``; ``"top_left"`` needs neither)."""
    w = check_window(window, optional=False)
    offset = _mod_offset("sliding_window", alignment, q_len, k_len)

    def fn(b, h, q, kv):
        return position_keep(q + offset, kv, causal=causal, window=w)

    return _Mod(f"sliding_window({w}, causal={causal}, {alignment!r})", fn)


def padding(lengths: torch.Tensor) -> MaskMod:
    """Key padding: batch element ``i`` keeps its first ``lengths[i]`` keys."""
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError(f"lengths must be a 1-D tensor of key counts, got {lengths!r}")
    if lengths.is_floating_point() or bool((lengths < 0).any()):
        raise ValueError(f"lengths must be non-negative integers, got {lengths.tolist()}")
    n = lengths.shape[0]

    def sizes(batch: int, heads: int, q_len: int, k_len: int) -> str | None:
        if n not in (1, batch):
            return f"lengths has {n} entries but the batch has {batch} elements"
        return None

    return _Mod(
        f"padding({lengths.tolist()})",
        lambda b, h, q, kv: kv < lengths.to(kv.device)[b if n > 1 else torch.zeros_like(b)],
        check_sizes=sizes,
    )


def prefix_lm(prefix: int) -> MaskMod:
    """Prefix LM: the first ``prefix`` keys are seen by every query; after that, causal."""
    n = check_int(prefix, "prefix", minimum=0)
    return _Mod(f"prefix_lm({n})", lambda b, h, q, kv: (kv < n) | (kv <= q))


def document(ids: torch.Tensor) -> MaskMod:
    """Block-diagonal mask for packed sequences: a query sees keys of its own document.

    Args:
        ids: ``(seq,)`` or ``(batch, seq)`` integer document id of each position
            (queries and keys share the positions: self-attention).
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or ids.is_floating_point():
        raise ValueError(f"ids must be a (seq,) or (batch, seq) integer tensor, got {ids!r}")
    table = ids if ids.dim() == 2 else ids.unsqueeze(0)  # (b|1, seq)

    def sizes(batch: int, heads: int, q_len: int, k_len: int) -> str | None:
        if table.shape[0] not in (1, batch):
            return f"ids has {table.shape[0]} rows but the batch has {batch} elements"
        if not table.shape[1] == q_len == k_len:
            return (
                f"ids has {table.shape[1]} positions but the call has {q_len} queries and "
                f"{k_len} keys (document() is for self-attention: all three must be equal)"
            )
        return None

    def fn(b, h, q, kv):
        t = table.to(q.device)
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        return t[bi, q] == t[bi, kv]

    return _Mod(f"document({tuple(ids.shape)})", fn, check_sizes=sizes)


def _all_sizes(mods: tuple[MaskMod, ...]) -> Callable[[int, int, int, int], str | None]:
    """A ``check_sizes`` for a combination: the first problem any part reports."""

    def sizes(batch: int, heads: int, q_len: int, k_len: int) -> str | None:
        for m in mods:
            check = getattr(m, "check_sizes", None)
            problem = None if check is None else check(batch, heads, q_len, k_len)
            if problem is not None:
                return f"{m!r}: {problem}"
        return None

    return sizes


def _check_mods(mods: tuple[MaskMod, ...], name: str) -> None:
    """Every part of a combination is callable (a mask mod), checked when it is built."""
    for i, m in enumerate(mods):
        if not callable(m):
            raise TypeError(f"{name}: mod {i} must be a callable mask mod, got {m!r}")


def and_masks(*mods: MaskMod) -> MaskMod:
    """A mask mod keeping what *every* one of ``mods`` keeps."""
    if not mods:
        raise ValueError("and_masks needs at least one mask mod")
    _check_mods(mods, "and_masks")

    def fn(b, h, q, kv):
        keep = mods[0](b, h, q, kv)
        for m in mods[1:]:
            keep = keep & m(b, h, q, kv)
        return keep

    grid = all(getattr(m, "grid", False) is True for m in mods)
    name = f"and_masks({', '.join(map(repr, mods))})"
    return _Mod(name, fn, grid=grid, check_sizes=_all_sizes(mods))


def or_masks(*mods: MaskMod) -> MaskMod:
    """A mask mod keeping what *any* one of ``mods`` keeps."""
    if not mods:
        raise ValueError("or_masks needs at least one mask mod")
    _check_mods(mods, "or_masks")

    def fn(b, h, q, kv):
        keep = mods[0](b, h, q, kv)
        for m in mods[1:]:
            keep = keep | m(b, h, q, kv)
        return keep

    grid = all(getattr(m, "grid", False) is True for m in mods)
    name = f"or_masks({', '.join(map(repr, mods))})"
    return _Mod(name, fn, grid=grid, check_sizes=_all_sizes(mods))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes ``2^(-8 i / n)`` (interleaved for non-powers of 2).

    Returned in float64, so that a call in any dtype casts them down once, exactly.
    """
    n = check_int(num_heads, "num_heads")
    p = 2 ** int(torch.log2(torch.tensor(float(n))).floor())

    def powers(k: int) -> list[float]:
        return [2 ** (-8.0 * (i + 1) / k) for i in range(k)]

    slopes = powers(p) + powers(2 * p)[0::2][: n - p]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi(num_heads: int, slopes: torch.Tensor | None = None) -> ScoreMod:
    """ALiBi score mod: ``score - slope[h] * |q_idx - kv_idx|``.

    Args:
        num_heads: number of query heads.
        slopes: ``(num_heads,)`` slopes (e.g. an ``nn.Parameter`` to learn them);
            the paper's fixed slopes by default. Gradients flow into it.
    """
    num_heads = check_int(num_heads, "num_heads")
    s = alibi_slopes(num_heads) if slopes is None else slopes
    if not isinstance(s, torch.Tensor) or s.shape != (num_heads,):
        raise ValueError(
            f"slopes must be a tensor of shape ({num_heads},), got {getattr(s, 'shape', s)!r}"
        )

    def sizes(batch: int, heads: int, q_len: int, k_len: int) -> str | None:
        if heads != num_heads:
            return f"it has {num_heads} slopes (num_heads) but the query has {heads} heads"
        return None

    def fn(score, b, h, q, kv):
        dist = (q.to(score.dtype) - kv.to(score.dtype)).abs_()  # (.., q, kv), small
        return torch.addcmul(score, s.to(h.device, score.dtype)[h], dist, value=-1.0)

    def relative(rel: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # the same arithmetic as fn on a zero score: -(slope * |q - kv|)
        return -(s.to(rel.device, dtype).view(-1, 1) * rel.to(dtype).abs())  # (h, n)

    return _Mod(
        f"alibi({num_heads})",
        fn,
        (s,),
        additive=True,
        check_sizes=sizes,
        spec=("alibi", s),
        relative=relative,
    )


def softcap(cap: float) -> ScoreMod:
    """Soft-capping score mod: ``cap * tanh(score / cap)`` (Gemma-2 style)."""
    # finite and > 0: an infinite cap gives inf/inf = NaN, a bool is not a number
    c = check_float(cap, "cap", minimum=0.0, min_inclusive=False)
    return _Mod(
        f"softcap({c})", lambda score, b, h, q, kv: c * torch.tanh(score / c), spec=("softcap", c)
    )


def relative_bias(table: torch.Tensor) -> ScoreMod:
    """Relative-position bias: ``score + table[h, clamp(kv_idx - q_idx) + max_distance - 1]``.

    Args:
        table: ``(num_heads, 2 * max_distance - 1)`` biases (an ``nn.Parameter`` to
            learn them); distances beyond ``max_distance - 1`` use the edge entries.
    """
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] % 2 != 1:
        raise ValueError(
            f"table must be (num_heads, 2 * max_distance - 1), got {getattr(table, 'shape', table)}"
        )
    m = (table.shape[1] - 1) // 2

    def sizes(batch: int, heads: int, q_len: int, k_len: int) -> str | None:
        if table.shape[0] != heads:
            return f"table has {table.shape[0]} rows (num_heads) but the query has {heads} heads"
        return None

    def fn(score, b, h, q, kv):
        rel = (kv - q).clamp(-m, m) + m
        return score + table.to(h.device, score.dtype)[h, rel]

    def relative(rel: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return table.to(rel.device, dtype)[:, rel.clamp(-m, m) + m]  # (h, n)

    return _Mod(
        f"relative_bias({tuple(table.shape)})",
        fn,
        (table,),
        additive=True,
        check_sizes=sizes,
        relative=relative,
    )
