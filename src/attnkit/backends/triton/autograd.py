"""Launching the kernels, and the autograd function that ties forward and backward together.

Tensors arrive as ``(B, h, l, d)`` views (any strides: no copy of Q, K, V, and GQA
reads each key/value head in place). The forward saves only the output and the
log-sum-exp; the backward computes ``delta = rowsum(dO * O) - dLSE`` in torch, then
runs the dK/dV and dQ kernels. Sink and ALiBi-slope gradients are reduced in torch
from per-row partial sums, in float64 (deterministic, no atomics). A traced mod's
captured tensors (:mod:`.codegen`) get their gradients the same way: each dQ program
adds into its own row of a ``(programs, trainable captured floats)`` buffer, summed over
the rows in float64 afterwards.
"""

from __future__ import annotations

import torch
import triton

from attnkit.backends.triton import _bwd, _fwd
from attnkit.backends.triton.compiled import packed
from attnkit.backends.triton.plan import KernelPlan


def _common_args(plan: KernelPlan, q: torch.Tensor) -> tuple[list, dict]:
    """The mask pointer and strides, and the constexpr flags every kernel takes."""
    mask = plan.mask if plan.mask is not None else q  # a dummy pointer, never read
    mstrides = list(plan.mask.stride()) if plan.mask is not None else [0, 0, 0, 0]
    cm = plan.compiled
    flags = dict(
        SCORE_FN=cm.score_fn if cm is not None and plan.mod == 3 else None,
        GEN_MASK=cm is not None and cm.mask is not None,
        MASK_FN=cm.mask_fn if cm is not None else None,
        CAUSAL=plan.causal,
        WINDOW=plan.window > 0,
        MASK=plan.mask_kind,
        MOD=plan.mod,
        LIBDEVICE=not plan.interpret,
        BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])),
        HEAD_D=q.shape[-1],
        UPCAST=plan.interpret and q.dtype == torch.bfloat16,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return [mask, *mstrides], flags


def _captured(plan: KernelPlan, q: torch.Tensor) -> list[torch.Tensor]:
    """``[CF, CI]``: a traced mod's captured values, packed (dummies without one)."""
    if plan.compiled is None:
        return [torch.zeros(1, device=q.device), torch.zeros(1, dtype=torch.int32, device=q.device)]
    return list(packed(plan.compiled, q.device))


def _sparse_args(
    plan: KernelPlan, q: torch.Tensor, transpose: bool
) -> tuple[list, dict, tuple[int, int, int, int]]:
    sp = plan.sparse
    if sp is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
        return [dummy, dummy, dummy, dummy], dict(SPARSE=False, QB=16, KB=16), (1, 1, 1, 1)
    tables = [sp.q_num, sp.q_idx, sp.q_part] if transpose else [sp.kv_num, sp.kv_idx, sp.kv_part]
    return (
        [*tables, sp.part],
        dict(SPARSE=True, QB=sp.q_block, KB=sp.kv_block),
        (sp.batch, sp.heads, sp.n_qb, sp.n_kb),
    )


def _blocks(plan: KernelPlan, blocks: tuple[int, int]) -> tuple[int, int]:
    m, n = blocks
    if plan.sparse is not None:  # kernel tiles divide the plan's blocks (powers of two)
        m, n = min(m, plan.sparse.q_block), min(n, plan.sparse.kv_block)
    return m, n


def forward(
    plan: KernelPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: ``out (B, h_q, l_q, d_v)`` and ``lse (B, h_q, l_q)`` float32."""
    bsz, h_q, l_q, _ = q.shape
    h_kv, l_k, d_v = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.empty(bsz, h_q, l_q, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, h_q, l_q, dtype=torch.float32, device=q.device)
    margs, flags = _common_args(plan, q)
    sargs, sflags, sdims = _sparse_args(plan, q, transpose=False)
    block_m, block_n = _blocks(plan, plan.fwd_blocks)
    grid = (triton.cdiv(l_q, block_m), bsz * h_q)
    if min(grid) == 0:  # nothing to compute (no key: the kernel still writes zeros, -inf)
        return out, lse
    _fwd.attn_fwd[grid](
        q, k, v, out, lse, margs[0],
        sinks if sinks is not None else lse, slopes if slopes is not None else lse,
        *sargs, *_captured(plan, q),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *margs[1:],
        h_q, h_q // h_kv, l_q, l_k, plan.shift, plan.window, plan.scale, plan.cap,
        *sdims,
        HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)), HEAD_DV=d_v,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **flags, **sflags,
    )  # fmt: skip
    return out, lse


def backward(
    plan: KernelPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    d_lse: torch.Tensor | None,
    slopes: torch.Tensor | None,
    captured_grads: bool = False,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None
]:
    """Run the backward kernels: ``dq, dk, dv``, the per-head slope gradient (ALiBi),
    ``delta (B, h_q, l_q)`` (for the sink gradient) and, with ``captured_grads``, the
    gradient of a traced mod's captures that get one (float64, at their ``grad_offset``)."""
    bsz, h_q, l_q, d = q.shape
    h_kv, l_k, d_v = k.shape[1], k.shape[2], v.shape[-1]
    delta = (d_out.float() * out.float()).sum(-1)  # (B, h_q, l_q)
    if d_lse is not None:
        delta = delta - d_lse.float()
    delta = delta.contiguous()
    dq = torch.empty(bsz, h_q, l_q, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(bsz, h_kv, l_k, d, dtype=k.dtype, device=k.device)
    dv = torch.empty(bsz, h_kv, l_k, d_v, dtype=v.dtype, device=v.device)
    margs, flags = _common_args(plan, q)
    caps = _captured(plan, q)
    block_m, block_n = _blocks(plan, plan.bwd_blocks)
    sizes = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
                 HEAD_DV=d_v, num_warps=plan.num_warps, num_stages=plan.num_stages)  # fmt: skip
    slope_arg = slopes if slopes is not None else lse
    sargs, sflags, sdims = _sparse_args(plan, q, transpose=True)
    grid = (triton.cdiv(l_k, block_n), bsz * h_kv)
    if min(grid) == 0 or l_q == 0:  # no key or no query: dK, dV are empty or zero
        dk.zero_()
        dv.zero_()
    else:
        _bwd.attn_bwd_dkdv[grid](
            q, k, v, d_out, lse, delta, dk, dv, margs[0], slope_arg, *sargs, *caps,
            *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *margs[1:],
            h_q, h_kv, h_q // h_kv, l_q, l_k, plan.shift, plan.window, plan.scale, plan.cap,
            *sdims, **sizes, **flags, **sflags,
        )  # fmt: skip
    sargs, sflags, sdims = _sparse_args(plan, q, transpose=False)
    n_mb = triton.cdiv(l_q, block_m)
    gslope = torch.zeros(bsz * h_q * l_q, dtype=torch.float32, device=q.device)
    grid = (n_mb, bsz * h_q)
    cm = plan.compiled if captured_grads else None
    g_num = cm.layout.grad_size if cm is not None else 0
    grad_fn = cm.grads_fn if cm is not None else None
    g_priv = torch.zeros(max(1, n_mb * bsz * h_q * g_num), dtype=torch.float32, device=q.device)
    if min(grid) > 0:
        _bwd.attn_bwd_dq[grid](
            q, k, v, d_out, lse, delta, dq, gslope, margs[0], slope_arg, *sargs, *caps, g_priv,
            g_num,
            *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *margs[1:],
            h_q, h_q // h_kv, l_q, l_k, plan.shift, plan.window, plan.scale, plan.cap, *sdims,
            **sizes, **flags, **sflags, GRAD_FN=grad_fn,
            HAS_GRADS=g_num > 0,
        )  # fmt: skip
    # the programs' private gradient buffers, summed in a fixed order
    d_caps = None
    if g_num:
        d_caps = (
            g_priv.view(-1, g_num).double().sum(0)
            if min(grid) > 0
            else g_priv.new_zeros(g_num, dtype=torch.float64)
        )
    # per-row partial sums, reduced in float64 (a sum over b * l_q * l_k terms)
    d_slopes = gslope.view(bsz, h_q, l_q).double().sum((0, 2)) if slopes is not None else None
    return dq, dk, dv, d_slopes, delta, d_caps


class TritonAttention(torch.autograd.Function):
    """``(out, lse) = attention(q, k, v)`` on the Triton kernels, with sinks, ALiBi slopes
    and a traced mod's captured tensors (``*captured``, the score graph's, in slot order)
    as differentiable inputs."""

    @staticmethod
    def forward(ctx, plan, q, k, v, sinks, slopes, *captured):  # type: ignore[override]
        sinks_k = None if sinks is None else sinks.detach().to(q.device, torch.float32).contiguous()
        slopes_k = (
            None if slopes is None else slopes.detach().to(q.device, torch.float32).contiguous()
        )
        out, lse = forward(plan, q, k, v, sinks_k, slopes_k)
        ctx.plan = plan
        ctx.sinks, ctx.slopes, ctx.captured = sinks, slopes, captured
        ctx.save_for_backward(q, k, v, out, lse, sinks_k, slopes_k)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):  # type: ignore[override]
        q, k, v, out, lse, sinks_k, slopes_k = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        cm = ctx.plan.compiled
        wanted = [
            k for k in (cm.grad_slots if cm is not None else ()) if ctx.needs_input_grad[6 + k]
        ]
        dq, dk, dv, d_slopes, delta, d_caps = backward(
            ctx.plan, q, k, v, out, lse, d_out, d_lse, slopes_k, bool(wanted)
        )
        d_sinks = None
        if sinks_k is not None and ctx.needs_input_grad[4]:
            # the sink's weight is exp(sink - lse); its "value" is zero, so dS = -p * delta
            p_sink = torch.exp(sinks_k.view(1, -1, 1) - lse)  # (B, h_q, l_q)
            d_sinks = -(p_sink.double() * delta).sum((0, 2))
            d_sinks = d_sinks.to(device=ctx.sinks.device, dtype=ctx.sinks.dtype)
        if d_slopes is not None and ctx.needs_input_grad[5]:
            d_slopes = d_slopes.to(device=ctx.slopes.device, dtype=ctx.slopes.dtype)
        else:
            d_slopes = None
        d_captured: list[torch.Tensor | None] = [None] * len(ctx.captured)
        for k in wanted:
            slot, t = cm.layout.slots[0][k], ctx.captured[k]
            flat = d_caps[slot.grad_offset : slot.grad_offset + t.numel()]  # type: ignore[index]
            d_captured[k] = flat.view(t.shape).to(device=t.device, dtype=t.dtype)
        return None, dq, dk, dv, d_sinks, d_slopes, *d_captured
