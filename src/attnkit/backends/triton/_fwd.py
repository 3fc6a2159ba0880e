"""The forward kernel: one program per (query tile, batch x query head), online softmax.

Key/value tiles are streamed; a program visits only the key tiles that can hold a
kept score: the causal/window range, or (``SPARSE``) the block plan's list of
non-empty tiles, where FULL tiles skip the per-element block-mask bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnkit.backends.triton._tile import LOG2E, mma, narrow, partial_keep, score_tile

# Kernel signatures are kept dense (one line per group of arguments), not one per line.
# fmt: off

@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_d, offs_dv, h, q_len, k_len,
              shift, window, scale, cap, slope, mask_ptr, smm, smn, skn, svn, extra_keep,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr, MOD: tl.constexpr, LIBDEVICE: tl.constexpr,
              HAS_EXTRA: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
              b, CF, CI, SCORE_FN: tl.constexpr, GEN_MASK: tl.constexpr, MASK_FN: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_k = offs_n < k_len
    k = tl.load(k_ptrs + offs_n[None, :].to(tl.int64) * skn,
                mask=in_k[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)  # (d, n)
    qk = mma(q, k, UPCAST, PREC)
    s, _ = score_tile(qk, offs_m, offs_n, b, h, q_len, k_len, shift, window, scale, cap, slope,
                      mask_ptr, smm, smn, CF, CI, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE, SCORE_FN,
                      False)
    if HAS_EXTRA:
        if GEN_MASK:  # the mask_mod's generated code instead of the tile's stored bits
            extra_keep = MASK_FN(b, h, offs_m[:, None], offs_n[None, :],
                                 (offs_m[:, None] < q_len) & in_k[None, :], CF, CI, LIBDEVICE)
        s = tl.where(extra_keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2((s - m_safe[:, None]) * LOG2E)
    alpha = tl.exp2((m_i - m_safe) * LOG2E)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs + offs_n[:, None].to(tl.int64) * svn,
                mask=in_k[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)  # (n, dv)
    acc = acc * alpha[:, None] + mma(narrow(p, v.dtype, UPCAST), v, UPCAST, PREC)
    return acc, m_new, l_i


@triton.jit
def attn_fwd(
    Q, K, V, O, LSE, MASK_T, SINKS, SLOPES, KV_NUM, KV_IDX, KV_PART, PART, CF, CI,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    smb, smh, smm, smn,
    num_heads, groups, q_len, k_len, shift, window, scale, cap,
    sp_b, sp_h, n_qb, n_kb,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr, MOD: tl.constexpr, LIBDEVICE: tl.constexpr,
    HAS_SINKS: tl.constexpr, SPARSE: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    SCORE_FN: tl.constexpr, GEN_MASK: tl.constexpr, MASK_FN: tl.constexpr,
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

    q_ptrs = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    q = tl.load(q_ptrs + offs_m[:, None].to(tl.int64) * sqm + offs_d[None, :] * sqd,
                mask=in_m[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)  # (m, d)
    k_ptrs = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_d[:, None] * skd
    v_ptrs = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_dv[None, :] * svd
    mask_ptr = MASK_T + b.to(tl.int64) * smb + h.to(tl.int64) * smh
    slope = 0.0
    if MOD == 1:
        slope = tl.load(SLOPES + h).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
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
                    acc, m_i, l_i = _fwd_tile(
                        acc, m_i, l_i, q, k_ptrs, v_ptrs, kb * KB + sub, offs_m, offs_d, offs_dv,
                        h, q_len, k_len, shift, window, scale, cap, slope, mask_ptr, smm, smn,
                        skn, svn, extra, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE,
                        True, UPCAST, PREC, b, CF, CI, SCORE_FN, GEN_MASK, MASK_FN)
                else:
                    acc, m_i, l_i = _fwd_tile(
                        acc, m_i, l_i, q, k_ptrs, v_ptrs, kb * KB + sub, offs_m, offs_d, offs_dv,
                        h, q_len, k_len, shift, window, scale, cap, slope, mask_ptr, smm, smn,
                        skn, svn, 0, HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE,
                        False, UPCAST, PREC, b, CF, CI, SCORE_FN, GEN_MASK, MASK_FN)
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
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_d, offs_dv, h, q_len,
                k_len, shift, window, scale, cap, slope, mask_ptr, smm, smn, skn, svn, 0,
                HEAD_D, HEAD_DV, BLOCK_N, CAUSAL, WINDOW, MASK, MOD, LIBDEVICE, False, UPCAST, PREC, b, CF, CI, SCORE_FN, GEN_MASK, MASK_FN)

    if HAS_SINKS:  # the sink joins the normaliser; its share of the output is dropped
        sink = tl.load(SINKS + h).to(tl.float32)
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2((m_i - m_fin) * LOG2E)
        l_i = l_i * alpha + tl.exp2((sink - m_fin) * LOG2E)
        acc = acc * alpha[:, None]
        m_i = m_fin
    alive = l_i > 0.0
    l_safe = tl.where(alive, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(alive, m_i + tl.log2(l_safe) / LOG2E, float("-inf"))
    o_ptrs = (O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
              + offs_m[:, None].to(tl.int64) * som + offs_dv[None, :] * sod)
    out = narrow(out, O.dtype.element_ty, UPCAST).to(O.dtype.element_ty)
    tl.store(o_ptrs, out, mask=in_m[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(LSE + pid_bh.to(tl.int64) * q_len + offs_m, lse, mask=in_m)
# fmt: on
