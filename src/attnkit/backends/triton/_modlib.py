"""Triton device functions that generated mod code (:mod:`.codegen`) calls.

Each matches the torch op the traced graph names (:mod:`attnkit.mod_graph`), on float32
and int32 tiles: torch's flooring integer division and remainder (Triton's ``//`` and
``%`` truncate, as C does), round half to even, ``trunc``, ``pow``, and the reduction
of a captured tensor's gradient into one program's private buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from attnkit.backends.triton._tile import _tanh

__all__ = [
    "_tanh",
    "floordiv_i",
    "grad_scatter",
    "grad_sum",
    "mod_i",
    "pow_f",
    "round_f",
    "trunc_f",
]


@triton.jit
def floordiv_i(a, b):
    """``a // b`` rounded toward -inf (torch), from Triton's truncating division."""
    q = a // b
    fix = ((a % b) != 0) & ((a < 0) != (b < 0))
    return q - fix.to(q.dtype)


@triton.jit
def mod_i(a, b):
    """``torch.remainder(a, b)``: the sign of ``b``."""
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def round_f(x):
    """Round half to even (``torch.round``)."""
    r = tl.floor(x + 0.5)
    half = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(half & odd, r - 1.0, r)


@triton.jit
def trunc_f(x):
    """Round toward zero."""
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def pow_f(a, b, LIBDEVICE: tl.constexpr):
    """``a ** b`` for floats: libdevice's on a GPU; under the interpreter (no libdevice)
    ``2 ** (b log2 |a|)``, negative for a negative base with an odd integral exponent,
    NaN for a negative base with a fractional one."""
    if LIBDEVICE:
        return libdevice.pow(a, b)
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = tl.floor(b) == b
    half = b * 0.5
    odd = tl.floor(half) != half  # of an integral exponent
    signed = tl.where(odd, -mag, mag)
    return tl.where(a < 0, tl.where(whole, signed, float("nan")), mag)


@triton.jit
def grad_sum(gptr, contrib, live):
    """Add the sum of ``contrib`` over the ``live`` elements of the tile to ``*gptr``
    (an index the whole tile shares, e.g. ``slopes[h]``). ``gptr`` is in this program's
    private buffer; the barriers order the read-modify-write across the program's threads."""
    total = tl.sum(tl.sum(tl.where(live, contrib, 0.0), 1), 0)
    tl.debug_barrier()
    tl.store(gptr, tl.load(gptr) + total)
    tl.debug_barrier()


@triton.jit
def grad_scatter(gptr, index, contrib, live, CHUNK: tl.constexpr):
    """Add ``contrib`` at ``gptr[index]`` for the ``live`` elements of a tile, in a fixed
    order and without atomics: for every chunk of ``CHUNK`` consecutive indices in the
    tile's range, each index gets the sum of the elements that name it (a one-hot
    reduction), so the result does not depend on thread timing."""
    index = tl.where(live, index, 0)
    lo = tl.min(tl.min(tl.where(live, index, 2147483647), 1), 0)
    hi = tl.max(tl.max(tl.where(live, index, -1), 1), 0)
    for j0 in range(lo, hi + 1, CHUNK):
        js = j0 + tl.arange(0, CHUNK)  # (CHUNK,)
        hit = (index[None, :, :] == js[:, None, None]) & live[None, :, :]  # (CHUNK, m, n)
        part = tl.sum(tl.sum(tl.where(hit, contrib[None, :, :], 0.0), 2), 1)  # (CHUNK,)
        ok = js <= hi
        tl.debug_barrier()
        tl.store(gptr + js, tl.load(gptr + js, mask=ok, other=0.0) + part, mask=ok)
        tl.debug_barrier()
