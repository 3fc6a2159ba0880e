"""The backward kernels, recomputing each tile's weights from the saved log-sum-exp.

``attn_bwd_dkdv``: one program per (key tile, batch x key/value head), looping over the
query heads of its GQA group and the query tiles that can see the key tile; it writes
dK and dV with the key/value head count (no expanded copy). ``attn_bwd_dq``: one program
per (query tile, batch x query head), also writing the ALiBi slope gradient per row.
``DELTA`` is ``rowsum(dO * O) - dLSE`` (the log-sum-exp's own gradient folded in).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnkit.backends.triton._tile import LOG2E, mma, narrow, partial_keep, score_tile

# Kernel signatures are kept dense (one line per group of arguments), not one per line.
# fmt: off

@triton.jit
def _dkdv_tile(dk, dv, kT, vT, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_n, offs_d,
               offs_dv, h, q_len, k_len, shift, window, scale, cap, slope, mask_ptr, smm, smn,
               sqm, sdom, extra_keep, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
               BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               MASK: tl.constexpr, MOD: tl.constexpr, LIBDEVICE: tl.constexpr, HAS_EXTRA: tl.constexpr,
               UPCAST: tl.constexpr, PREC: tl.constexpr, b, CF, CI, SCORE_FN: tl.constexpr,
               GEN_MASK: tl.constexpr, MASK_FN: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_m = offs_m < q_len
    q = tl.load(q_ptrs + offs_m[:, None].to(tl.int64) * sqm,
                mask=in_m[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)  # (m, d)
    do = tl.load(do_ptrs + offs_m[:, None].to(tl.int64) * sdom,
                 mask=in_m[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)  # (m, dv)
    lse = tl.load(lse_ptr + offs_m, mask=in_m, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows with no key: p = 0
    delta = tl.load(delta_ptr + offs_m, mask=in_m, other=0.0)
    qk = mma(q, kT, UPCAST, PREC)
    s, dmod = score_tile(qk, offs_m, offs_n, b, h, q_len, k_len, shift, window, scale, cap,
                         slope, mask_ptr, smm, smn, CF, CI, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE,
                         SCORE_FN, True)
    if HAS_EXTRA:
        if GEN_MASK:  # the mask_mod's generated code instead of the tile's stored bits
            extra_keep = MASK_FN(b, h, offs_m[:, None], offs_n[None, :],
                                 in_m[:, None] & (offs_n[None, :] < k_len), CF, CI, LIBDEVICE)
        s = tl.where(extra_keep, s, float("-inf"))
        if MOD == 3:
            dmod = tl.where(extra_keep, dmod, 0.0)
    p = tl.exp2((s - lse[:, None]) * LOG2E)  # (m, n)
    dv += mma(narrow(tl.trans(p), do.dtype, UPCAST), do, UPCAST, PREC)
    dp = mma(do, vT, UPCAST, PREC)
    ds = p * (dp - delta[:, None]) * dmod
    dk += mma(narrow(tl.trans(ds), q.dtype, UPCAST), q, UPCAST, PREC)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, MASK_T, SLOPES, Q_NUM, Q_IDX, Q_PART, PART, CF, CI,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
    smb, smh, smm, smn,
    num_heads, num_kv_heads, groups, q_len, k_len, shift, window, scale, cap,
    sp_b, sp_h, n_qb, n_kb,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr, MOD: tl.constexpr, LIBDEVICE: tl.constexpr,
    SPARSE: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    SCORE_FN: tl.constexpr, GEN_MASK: tl.constexpr, MASK_FN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_n = offs_n < k_len
    kT = tl.load(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[None, :].to(tl.int64)
                 * skn + offs_d[:, None] * skd,
                 mask=in_n[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)  # (d, n)
    vT = tl.load(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[None, :].to(tl.int64)
                 * svn + offs_dv[:, None] * svd,
                 mask=in_n[None, :] & (offs_dv[:, None] < HEAD_DV), other=0.0)  # (dv, n)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, groups):
        h = hk * groups + g
        bh = b * num_heads + h
        q_ptrs = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_d[None, :] * sqd
        do_ptrs = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + offs_dv[None, :] * sdod
        lse_ptr = LSE + bh.to(tl.int64) * q_len
        delta_ptr = DELTA + bh.to(tl.int64) * q_len
        mask_ptr = MASK_T + b.to(tl.int64) * smb + h.to(tl.int64) * smh
        slope = 0.0
        if MOD == 1:
            slope = tl.load(SLOPES + h).to(tl.float32)
        if SPARSE:
            kb = start_n // KB
            col0 = start_n - kb * KB
            row = ((b % sp_b) * sp_h + (h % sp_h)) * n_kb + kb
            count = tl.load(Q_NUM + row)
            for i in range(0, count):
                qb = tl.load(Q_IDX + row * n_qb + i)
                part = tl.load(Q_PART + row * n_qb + i)
                for sub in range(0, QB, BLOCK_M):
                    if part >= 0:
                        if GEN_MASK:
                            extra = 0
                        else:
                            extra = partial_keep(PART, part, sub, col0, QB, KB, BLOCK_M, BLOCK_N)
                        dk, dv = _dkdv_tile(
                            dk, dv, kT, vT, q_ptrs, do_ptrs, lse_ptr, delta_ptr, qb * QB + sub,
                            offs_n, offs_d, offs_dv, h, q_len, k_len, shift, window, scale, cap,
                            slope, mask_ptr, smm, smn, sqm, sdom, extra, HEAD_D, HEAD_DV,
                            BLOCK_M, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE, True, UPCAST, PREC, b, CF, CI, SCORE_FN, GEN_MASK, MASK_FN)
                    else:
                        dk, dv = _dkdv_tile(
                            dk, dv, kT, vT, q_ptrs, do_ptrs, lse_ptr, delta_ptr, qb * QB + sub,
                            offs_n, offs_d, offs_dv, h, q_len, k_len, shift, window, scale, cap,
                            slope, mask_ptr, smm, smn, sqm, sdom, 0, HEAD_D, HEAD_DV,
                            BLOCK_M, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE, False, UPCAST, PREC, b, CF, CI, SCORE_FN, GEN_MASK, MASK_FN)
        else:
            lo = 0
            hi = q_len
            if CAUSAL:
                lo = tl.maximum(lo, start_n - shift)
            if WINDOW:
                hi = tl.minimum(hi, start_n + BLOCK_N - 1 - shift + window)
                if not CAUSAL:
                    lo = tl.maximum(lo, start_n - shift - window + 1)
            lo = (lo // BLOCK_M) * BLOCK_M
            for start_m in range(lo, hi, BLOCK_M):
                dk, dv = _dkdv_tile(
                    dk, dv, kT, vT, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_n, offs_d,
                    offs_dv, h, q_len, k_len, shift, window, scale, cap, slope, mask_ptr, smm,
                    smn, sqm, sdom, 0, HEAD_D, HEAD_DV, BLOCK_M, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE,
                    False, UPCAST, PREC, b, CF, CI, SCORE_FN, GEN_MASK, MASK_FN)
    dk = dk * scale
    out_n = in_n[:, None]
    dk_ptrs = (DK + pid_bh.to(tl.int64) * k_len * HEAD_D + offs_n[:, None].to(tl.int64) * HEAD_D
               + offs_d[None, :])
    dk = narrow(dk, DK.dtype.element_ty, UPCAST).to(DK.dtype.element_ty)
    tl.store(dk_ptrs, dk, mask=out_n & (offs_d[None, :] < HEAD_D))
    dv_ptrs = (DV + pid_bh.to(tl.int64) * k_len * HEAD_DV + offs_n[:, None].to(tl.int64) * HEAD_DV
               + offs_dv[None, :])
    dv = narrow(dv, DV.dtype.element_ty, UPCAST).to(DV.dtype.element_ty)
    tl.store(dv_ptrs, dv, mask=out_n & (offs_dv[None, :] < HEAD_DV))


@triton.jit
def _dq_tile(dq, gslope, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_d, offs_dv, h,
             q_len, k_len, shift, window, scale, cap, slope, mask_ptr, smm, smn, skn, svn,
             extra_keep, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr, MOD: tl.constexpr, LIBDEVICE: tl.constexpr,
             HAS_EXTRA: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, b, CF, CI, gp,
             SCORE_FN: tl.constexpr, GEN_MASK: tl.constexpr, MASK_FN: tl.constexpr,
             GRAD_FN: tl.constexpr, HAS_GRADS: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_n = offs_n < k_len
    k = tl.load(k_ptrs + offs_n[:, None].to(tl.int64) * skn,
                mask=in_n[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)  # (n, d)
    vT = tl.load(v_ptrs + offs_n[None, :].to(tl.int64) * svn,
                 mask=in_n[None, :] & (offs_dv[:, None] < HEAD_DV), other=0.0)  # (dv, n)
    qk = mma(q, tl.trans(k), UPCAST, PREC)
    s, dmod = score_tile(qk, offs_m, offs_n, b, h, q_len, k_len, shift, window, scale, cap,
                         slope, mask_ptr, smm, smn, CF, CI, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE,
                         SCORE_FN, True)
    if HAS_EXTRA:
        if GEN_MASK:  # the mask_mod's generated code instead of the tile's stored bits
            extra_keep = MASK_FN(b, h, offs_m[:, None], offs_n[None, :],
                                 (offs_m[:, None] < q_len) & in_n[None, :], CF, CI, LIBDEVICE)
        s = tl.where(extra_keep, s, float("-inf"))
        if MOD == 3:
            dmod = tl.where(extra_keep, dmod, 0.0)
    p = tl.exp2((s - lse[:, None]) * LOG2E)
    dp = mma(do, vT, UPCAST, PREC)
    ds = p * (dp - delta[:, None])  # d loss / d (modded score)
    if MOD == 1:
        dist = tl.abs(offs_m[:, None] - offs_n[None, :]).to(tl.float32)
        gslope -= tl.sum(ds * dist, 1)
    if HAS_GRADS:  # a traced mod's captured tensors: into this program's private buffer
        GRAD_FN(qk * scale, ds, b, h, offs_m[:, None], offs_n[None, :],
                (offs_m[:, None] < q_len) & in_n[None, :], CF, CI, gp, LIBDEVICE)
    ds = ds * dmod
    dq += mma(narrow(ds, k.dtype, UPCAST), k, UPCAST, PREC)
    return dq, gslope


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, GSLOPE, MASK_T, SLOPES, KV_NUM, KV_IDX, KV_PART, PART,
    CF, CI, GP, GNUM,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
    smb, smh, smm, smn,
    num_heads, groups, q_len, k_len, shift, window, scale, cap,
    sp_b, sp_h, n_qb, n_kb,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr, MOD: tl.constexpr, LIBDEVICE: tl.constexpr,
    SPARSE: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    SCORE_FN: tl.constexpr, GEN_MASK: tl.constexpr, MASK_FN: tl.constexpr,
    GRAD_FN: tl.constexpr, HAS_GRADS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // groups
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_m = offs_m < q_len
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None].to(tl.int64)
                * sqm + offs_d[None, :] * sqd,
                mask=in_m[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + offs_m[:, None].to(tl.int64)
                 * sdom + offs_dv[None, :] * sdod,
                 mask=in_m[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * q_len + offs_m, mask=in_m, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * q_len + offs_m, mask=in_m, other=0.0)
    k_ptrs = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_d[None, :] * skd
    v_ptrs = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_dv[:, None] * svd
    mask_ptr = MASK_T + b.to(tl.int64) * smb + h.to(tl.int64) * smh
    slope = 0.0
    if MOD == 1:
        slope = tl.load(SLOPES + h).to(tl.float32)
    # this program's private buffer of captured-tensor gradients (summed afterwards in order)
    gp = GP + (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m) * GNUM
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    gslope = tl.zeros([BLOCK_M], tl.float32)  # per-row ALiBi slope gradient
    if SPARSE:
        qb = start_m // QB
        row0 = start_m - qb * QB
        row = ((b % sp_b) * sp_h + (h % sp_h)) * n_qb + qb
        count = tl.load(KV_NUM + row)
        for i in range(0, count):
            kb = tl.load(KV_IDX + row * n_kb + i)
            part = tl.load(KV_PART + row * n_kb + i)
            for sub in range(0, KB, BLOCK_N):
                if part >= 0:
                    if GEN_MASK:
                        extra = 0
                    else:
                        extra = partial_keep(PART, part, row0, sub, QB, KB, BLOCK_M, BLOCK_N)
                    dq, gslope = _dq_tile(
                        dq, gslope, q, do, lse, delta, k_ptrs, v_ptrs, kb * KB + sub, offs_m,
                        offs_d, offs_dv, h, q_len, k_len, shift, window, scale, cap, slope,
                        mask_ptr, smm, smn, skn, svn, extra, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL,
                        WINDOW, MASK, MOD, LIBDEVICE, True, UPCAST, PREC, b, CF, CI, gp, SCORE_FN, GEN_MASK, MASK_FN,
                        GRAD_FN, HAS_GRADS)
                else:
                    dq, gslope = _dq_tile(
                        dq, gslope, q, do, lse, delta, k_ptrs, v_ptrs, kb * KB + sub, offs_m,
                        offs_d, offs_dv, h, q_len, k_len, shift, window, scale, cap, slope,
                        mask_ptr, smm, smn, skn, svn, 0, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL,
                        WINDOW, MASK, MOD, LIBDEVICE, False, UPCAST, PREC, b, CF, CI, gp, SCORE_FN, GEN_MASK, MASK_FN,
                        GRAD_FN, HAS_GRADS)
    else:
        lo = 0
        hi = k_len
        if CAUSAL:
            hi = tl.minimum(hi, start_m + BLOCK_M + shift)
        if WINDOW:
            lo = tl.maximum(lo, start_m + shift - window + 1)
            if not CAUSAL:
                hi = tl.minimum(hi, start_m + BLOCK_M - 1 + shift + window)
        lo = (lo // BLOCK_N) * BLOCK_N
        for start_n in range(lo, hi, BLOCK_N):
            dq, gslope = _dq_tile(
                dq, gslope, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_d, offs_dv,
                h, q_len, k_len, shift, window, scale, cap, slope, mask_ptr, smm, smn, skn, svn,
                0, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE, False, UPCAST, PREC, b, CF, CI, gp, SCORE_FN, GEN_MASK, MASK_FN,
                        GRAD_FN, HAS_GRADS)
    dq = dq * scale
    dq_ptrs = (DQ + pid_bh.to(tl.int64) * q_len * HEAD_D + offs_m[:, None].to(tl.int64) * HEAD_D
               + offs_d[None, :])
    dq = narrow(dq, DQ.dtype.element_ty, UPCAST).to(DQ.dtype.element_ty)
    tl.store(dq_ptrs, dq, mask=in_m[:, None] & (offs_d[None, :] < HEAD_D))
    if MOD == 1:
        tl.store(GSLOPE + pid_bh.to(tl.int64) * q_len + offs_m, gslope, mask=in_m)
# fmt: on
