"""Triton device functions shared by the forward and backward kernels.

One place computes a tile's scores the way every kernel sees them: scaled, modded
(ALiBi or softcap), biased by a float mask, and set to ``-inf`` where causal, the
window, a bool mask, a partial block-mask tile or the key length masks them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# Kernel signatures are kept dense (one line per group of arguments), not one per line.
# fmt: off

#: log2(e). A global that jitted code reads must be a ``tl.constexpr`` instance: the
#: compiler refuses plain globals (the interpreter does not, so only a GPU or
#: tests/triton_compile_only.py sees it).
LOG2E = tl.constexpr(1.4426950408889634)

#: score mods the kernels run (``MOD`` constexpr)
MOD_NONE = 0
MOD_ALIBI = 1
MOD_SOFTCAP = 2
MOD_GENERATED = 3  # a traced mod's generated ``score_mod`` (:mod:`.codegen`), ``SCORE_FN``
#: dense ``mask`` kinds (``MASK`` constexpr)
MASK_NONE = 0
MASK_BOOL = 1
MASK_FLOAT = 2


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """``a @ b`` accumulated in float32.

    ``UPCAST`` (bfloat16 under the interpreter, whose bf16 ``tl.dot`` is wrong): the
    operands, bf16 values, are multiplied in float32, which is exact for their products.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def narrow(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """``x`` rounded to ``dtype`` (round to nearest even, as a GPU does).

    Under ``UPCAST`` the interpreter would truncate float32 -> bfloat16, so the rounding
    is done on the bits and the (exactly representable) value is kept in float32.
    """
    if UPCAST:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    """tanh to a few ulps: libdevice's on a GPU; under the interpreter (which has no
    libdevice) ``expm1(2|x|) / (expm1(2|x|) + 2)`` with Kahan's accurate expm1."""
    if LIBDEVICE:
        return libdevice.tanh(x)
    ax = tl.minimum(tl.abs(x), 10.0)  # tanh(10) rounds to 1 in float32
    y = 2.0 * ax
    u = tl.exp(y)
    one = u == 1.0
    em1 = tl.where(one, y, (u - 1.0) * y / tl.log(tl.where(one, 2.0, u)))
    t = em1 / (em1 + 2.0)
    return tl.where(x < 0, -t, t)


@triton.jit
def score_tile(
    qk,
    offs_m,
    offs_n,
    b,
    h,
    q_len,
    k_len,
    shift,
    window,
    scale,
    cap,
    slope,
    mask_ptr,
    smm,
    smn,
    CF,
    CI,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK: tl.constexpr,
    MOD: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    SCORE_FN: tl.constexpr,
    WANT_D: tl.constexpr,
):
    """Return ``(s, dmod)``: the tile's final scores (``-inf`` where masked) and
    ``d s / d (scaled score)`` of the score mod (1 without a mod).

    ``offs_m``/``offs_n`` are query/key indices; ``shift`` aligns the causal/window
    rule (``k_len - q_len`` bottom-right, 0 top-left); ``mask_ptr`` already points at
    this (batch, head)'s dense mask. ``MOD == 3``: ``SCORE_FN`` is a traced mod's
    generated function reading the packed captured tensors ``CF``/``CI``; ``dmod`` is
    computed only when ``WANT_D`` (the backward), and is 0 where the score is masked.
    """
    s = qk * scale
    dmod = 1.0
    if MOD == 1:  # ALiBi: s - slope * |q - kv|
        dist = tl.abs(offs_m[:, None] - offs_n[None, :]).to(tl.float32)
        s = s - slope * dist
    if MOD == 2:  # softcap: cap * tanh(s / cap)
        th = _tanh(s / cap, LIBDEVICE)
        s = cap * th
        dmod = 1.0 - th * th
    inside = (offs_m[:, None] < q_len) & (offs_n[None, :] < k_len)
    if MOD == 3:  # a traced mod, generated (codegen.py)
        s, dmod = SCORE_FN(s, b, h, offs_m[:, None], offs_n[None, :], inside, CF, CI, LIBDEVICE,
                           WANT_D)
    keep = (offs_n[None, :] < k_len) & (offs_m[:, None] < q_len)
    pos = offs_m[:, None] + shift
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= pos)
    if WINDOW:
        keep = keep & (offs_n[None, :] > pos - window)
        if not CAUSAL:
            keep = keep & (offs_n[None, :] < pos + window)
    if MASK != 0:
        ptrs = mask_ptr + offs_m[:, None].to(tl.int64) * smm + offs_n[None, :].to(tl.int64) * smn
        if MASK == 1:
            keep = keep & (tl.load(ptrs, mask=inside, other=0) != 0)
        else:
            s = s + tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    s = tl.where(keep, s, float("-inf"))
    if MOD == 3 and WANT_D:  # 0 * inf would poison dS where the score is masked
        dmod = tl.where(keep, dmod, 0.0)
    return s, dmod


@triton.jit
def partial_keep(part_ptr, part, row0, col0, QB: tl.constexpr, KB: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The packed keep bits of a PARTIAL block-mask tile (``part`` >= 0), rows from
    ``row0`` and columns from ``col0`` inside it, as a ``(BLOCK_M, BLOCK_N)`` bool."""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    ptrs = part_ptr + part.to(tl.int64) * (QB * KB) + rows[:, None] * KB + cols[None, :]
    return tl.load(ptrs) != 0
# fmt: on
