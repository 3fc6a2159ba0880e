"""Packed variable-length batches on the native kernel (``attention.cpp``, ``Args.nseq``).

A packed batch holds ``n`` sequences one after another along the token dim (flash-attn's
``cu_seqlens`` layout): ``q (total_q, h, d)``, ``k``/``v (total_k, h_kv, d)``, sequence
``i`` owning the queries ``cu_q[i]:cu_q[i + 1]`` and the keys ``cu_k[i]:cu_k[i + 1]``. The
kernel runs each sequence as a call of its own (its work items are ``(sequence, head,
query block)``, its keys packed per sequence) and never reads another sequence's keys; no
``total x total`` mask exists anywhere.

The kernel keeps the log-sum-exp and the gradients of the rows sequence by sequence
(``(h, len)`` blocks, :attr:`VarlenSpec.pos_q`); this module moves them to and from the
packed ``(total, h)`` layout. :class:`VarlenKernel` is the autograd function: ``(out,
lse)`` over the keys, with gradients for ``q``, ``k``, ``v`` (and through ``lse``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from attnkit.backends.blockwise.native import (
    BLOCK_Q,
    KEY_CHUNK,
    _check_code,
    _kernel,
    abi,
    backward_block_q,
)
from attnkit.backends.blockwise.plan import Band
from attnkit.masks import ScoreMod

__all__ = ["VarlenKernel", "VarlenSpec", "varlen_spec"]


@dataclass(frozen=True)
class VarlenSpec:
    """One packed call as the kernel reads it (built once per call by :func:`varlen_spec`).

    Attributes:
        cu_q, cu_k: int64 ``(n + 1,)`` offsets.
        pos_q: int64 ``(total_q, h)``: where row ``(token, head)`` sits in the kernel's
            sequence-by-sequence layout; ``pos_k (total_k, h_kv)`` the same for keys.
        scale: the score scale.
        band_lo, band_hi: causal/window as a band at alignment offset 0 (the kernel shifts
            it by ``len_k - len_q`` per sequence when ``align``).
        align: causal/window aligned bottom-right in each sequence.
        rel: ``(h|1, n)`` float32 relative bias of ``j - i = rel_lo + n`` (or None).
        bf16: the kernel reads bf16 inputs as they are.
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    pos_q: torch.Tensor
    pos_k: torch.Tensor
    scale: float
    band_lo: int
    band_hi: int
    align: bool
    rel: torch.Tensor | None
    rel_lo: int
    bf16: bool


def _positions(offsets: list[int], heads: int) -> torch.Tensor:
    """``(total, heads)`` int64: row ``(t, h)`` of sequence ``i`` (starting at ``c``, ``n``
    long) at ``heads * c + h * n + (t - c)``."""
    cu = torch.tensor(offsets, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # (total,)
    start, n = cu[:-1][seq], lengths[seq]
    local = torch.arange(offsets[-1]) - start
    h = torch.arange(heads)
    return heads * start[:, None] + h[None, :] * n[:, None] + local[:, None]


def varlen_spec(
    offsets_q: list[int],
    offsets_k: list[int],
    heads: int,
    kv_heads: int,
    *,
    scale: float,
    causal: str | None,
    window: int | None,
    score_mod: ScoreMod | None,
    max_q: int,
    max_k: int,
    bf16: bool,
) -> VarlenSpec:
    """The :class:`VarlenSpec` of a packed call (``causal``: None or an alignment name;
    ``score_mod``: None or a relative bias, ``score_mod.relative``)."""
    band = Band.of(causal is not None, window, 0)
    reach = max_q + max_k + 1  # no bound, or a wider one, is the same clamped bound
    lo = -reach if band.lo is None else max(band.lo, -reach)
    hi = reach if band.hi is None else min(band.hi, reach)
    rel, rel_lo = None, 0
    relative = None if score_mod is None else getattr(score_mod, "relative", None)
    if relative is not None:
        # one vector for every sequence: j - i from -(max_q - 1) to the last key chunk
        rel_lo = -(max(max_q, 1) - 1)
        s_pad = -(-max(max_k, 1) // KEY_CHUNK) * KEY_CHUNK
        j_minus_i = torch.arange(rel_lo, s_pad)
        values = torch.as_tensor(relative(j_minus_i, torch.float32), dtype=torch.float32)
        rel = values.reshape(-1, j_minus_i.numel()).contiguous()  # (h|1, n)
        if rel.shape[0] not in (1, heads):
            raise ValueError(f"a relative score_mod gave {rel.shape[0]} heads for {heads}")
    return VarlenSpec(
        cu_q=torch.tensor(offsets_q, dtype=torch.int64),
        cu_k=torch.tensor(offsets_k, dtype=torch.int64),
        pos_q=_positions(offsets_q, heads),
        pos_k=_positions(offsets_k, kv_heads),
        scale=scale,
        band_lo=lo,
        band_hi=hi,
        align=causal != "top_left",
        rel=rel,
        rel_lo=rel_lo,
        bf16=bf16,
    )


def _args(
    spec: VarlenSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out,
    lse,
    block_q: int = BLOCK_Q,
) -> abi.Args:
    """The kernel's arguments: ``q``, ``k``, ``v`` packed ``(total, heads, d)`` with unit
    last stride, ``out`` ``(total_q, h, d_v)`` float32 (or None), ``lse`` ``(h * total_q,)``;
    ``block_q`` query rows a block (:func:`~attnkit.backends.blockwise.native.backward_block_q`
    for a backward)."""
    o_strides = (0, out.stride(1), out.stride(0)) if out is not None else (0, 0, 0)
    args = abi.Args(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if out is None else out.data_ptr(),
        lse.data_ptr(),
        0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0),
        *o_strides,
        1, q.shape[1], k.shape[1], q.shape[0], k.shape[0], q.shape[2], v.shape[2],
        spec.scale, spec.band_lo, spec.band_hi, block_q,
    )  # fmt: skip
    if spec.rel is not None:
        args.rel, args.rel_lo = spec.rel.data_ptr(), spec.rel_lo
        args.rel_sh = 0 if spec.rel.shape[0] == 1 else spec.rel.stride(0)
    args.threads = torch.get_num_threads()
    args.dtype = abi.DT_BF16 if q.dtype == torch.bfloat16 else abi.DT_F32
    args.cu_q, args.cu_k = spec.cu_q.data_ptr(), spec.cu_k.data_ptr()
    args.nseq = spec.cu_q.numel() - 1
    args.varlen_align = int(spec.align)
    args.kv_splits = 1
    return args


def _view(x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """What the kernel reads: float32 (bf16 as it is on a bf16 build), unit last stride."""
    x = x.detach()
    if not (bf16 and x.dtype == torch.bfloat16):
        x = x.to(torch.float32)
    return x if x.stride(-1) == 1 else x.contiguous()


def forward(
    spec: VarlenSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out (total_q, h, d_v), lse (total_q, h), lse in the kernel's layout)``, float32."""
    q, k, v = (_view(x, spec.bf16) for x in (q, k, v))
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32)
    lse_seq = torch.empty(q.shape[0] * q.shape[1], dtype=torch.float32)
    args = _args(spec, q, k, v, out, lse_seq)
    _check_code(_kernel("attnkit_forward")(ctypes.byref(args)))
    lse = torch.index_select(lse_seq, 0, spec.pos_q.reshape(-1)).view(spec.pos_q.shape)
    return out, lse, lse_seq


def backward(
    spec: VarlenSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse_seq: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the packed layouts and the dtypes of ``q``, ``k``, ``v``, from
    the forward's ``out`` and kernel-layout ``lse_seq`` (FlashAttention-2's backward, as
    :func:`..native.backward`)."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v = (_view(x, spec.bf16) for x in (q, k, v))
    tq, h, dv_ = out.shape
    delta = (grad_out.to(torch.float32) * out).sum(-1)  # (total_q, h)
    if grad_lse is not None:
        delta = delta - grad_lse.to(torch.float32)
    # Between the packed layout and the kernel's, rows move by index_copy_ and
    # index_select (of whole rows; torch's advanced indexing with the (total, h) positions
    # took twice as long: 1.2 against 0.6 ms a gradient at 8192 x 4 x 64)
    rows_q = spec.pos_q.reshape(-1)
    dout_seq = torch.empty(
        tq * h, dv_, dtype=q.dtype if q.dtype == torch.bfloat16 else torch.float32
    )
    dout_seq.index_copy_(0, rows_q, grad_out.reshape(-1, dv_).to(dout_seq.dtype))
    delta_seq = torch.empty(tq * h, dtype=torch.float32)
    delta_seq.index_copy_(0, rows_q, delta.reshape(-1))
    lse_seq = lse_seq.masked_fill(torch.isneginf(lse_seq), float("inf"))  # dead rows: P = 0
    dq = torch.empty(tq * h, q.shape[2], dtype=torch.float32)
    dk = torch.empty(k.shape[0] * k.shape[1], k.shape[2], dtype=torch.float32)
    dv = torch.empty(k.shape[0] * k.shape[1], dv_, dtype=torch.float32)
    args = _args(spec, q, k, v, None, lse_seq, backward_block_q(q.dtype))
    grads = abi.Grads(*(x.data_ptr() for x in (dout_seq, delta_seq, dq, dk, dv)))
    _check_code(_kernel("attnkit_backward")(ctypes.byref(args), ctypes.byref(grads)))

    def packed(x: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x.to(dtype)  # (first: a bf16 gradient then moves, and is allocated, at half size)
        return torch.index_select(x, 0, pos.reshape(-1)).view(*pos.shape, x.shape[-1])

    return (
        packed(dq, spec.pos_q, dtypes[0]),
        packed(dk, spec.pos_k, dtypes[1]),
        packed(dv, spec.pos_k, dtypes[2]),
    )


class VarlenKernel(torch.autograd.Function):
    """``apply(spec, q, k, v) -> (out (total_q, h, d_v), lse (total_q, h))`` float32."""

    @staticmethod
    def forward(ctx, spec: VarlenSpec, q, k, v):  # type: ignore[override]
        out, lse, lse_seq = forward(spec, q, k, v)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, out, lse_seq)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse_seq = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = backward(ctx.spec, q, k, v, out, lse_seq, grad_out, grad_lse)
        return None, dq, dk, dv
