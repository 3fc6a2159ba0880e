"""Packed variable-length batches: :func:`attnkit.attention` with ``cu_seqlens_q=`` /
``cu_seqlens_k=`` (flash-attn's ``flash_attn_varlen_func`` layout).

Notation used for tensor shapes:
    - n: sequences in the batch; total_q / total_k: their queries / keys, packed
    - h / h_kv: query / key-value heads; d, d_v: head dims

Sequence ``i`` owns the queries ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of the packed
``query (total_q, h, d)`` and the keys ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]`` of
``key``/``value (total_k, h_kv, d)``; it attends to its own keys only. Per sequence
everything is as a call of its own: ``causal=True`` lines up bottom-right when its
lengths differ (flash-attn >= 2.1; ``"top_left"`` as in :mod:`attnkit.masks`), a
window counts from its own positions, and a ``mask_mod`` / ``score_mod`` sees
``q_idx``, ``kv_idx`` starting at 0 in each sequence and ``b`` = the sequence's index.

Two engines, one answer: the native kernel (:mod:`.backends.blockwise.native.varlen`:
work items ``(sequence, head, query block)``, no ``total x total`` mask) where it takes
the call, else a loop over the sequences through :func:`attnkit.attention` (any
backend, any mod, dropout). :func:`why_not_native` says why the kernel stood aside.
"""

from __future__ import annotations

import math

import torch

from attnkit import trace
from attnkit._validate import (
    check_backend,
    check_bool,
    check_cu_seqlens,
    check_float,
    check_max_seqlen,
    check_packed_qkv,
    check_probability,
    check_window,
)
from attnkit.backends.blockwise.merge import merge_partials
from attnkit.masks import MaskMod, ScoreMod, normalize_causal

__all__ = ["varlen_attention", "why_not_native"]


class _SequenceMaskMod:
    """``mask_mod`` of the whole batch seen from sequence ``index`` (a call of batch 1)."""

    def __init__(self, mod: MaskMod, index: int) -> None:
        self.mod, self.index = mod, index

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mod(b + self.index, h, q_idx, kv_idx)


class _SequenceScoreMod:
    """``score_mod`` of the whole batch seen from sequence ``index``; a relative bias
    (``.relative``, the same in every sequence) is kept for the kernels."""

    def __init__(self, mod: ScoreMod, index: int) -> None:
        self.mod, self.index = mod, index
        relative = getattr(mod, "relative", None)
        if relative is not None:
            self.relative = relative

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.mod(score, b + self.index, h, q_idx, kv_idx)


def why_not_native(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    backend: str,
    dropout_p: float,
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
    window: int | None,
) -> str | None:
    """Why the native kernel does not run this packed call (None when it does)."""
    from attnkit.backends.blockwise import native, score_mod_tensors
    from attnkit.backends.blockwise.native import calibrate

    if backend not in ("auto", "blockwise"):
        return f"backend={backend!r} (the kernel is blockwise's)"
    if query.device.type != "cpu":
        return "not a CPU tensor"
    if dropout_p > 0.0:
        return "dropout"
    if trace.is_recording():
        return "a trace is recording (the reference backend runs)"
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{query.dtype} (the kernel computes float32, and bf16)"
    if value.shape[-1] % 16:
        return "value heads not a multiple of 16 wide"
    if query.dtype == torch.bfloat16 and query.shape[-1] % 2 and native.bf16():
        return "bf16 query heads of odd width (bf16 products read pairs)"
    if (
        torch.is_grad_enabled()
        and query.shape[-1] % 16
        and any(t.requires_grad for t in (query, key, value))
    ):
        return "query heads not a multiple of 16 wide (the native backward)"
    if mask_mod is not None:
        return "a mask_mod (each sequence's block mask is built on the per-sequence path)"
    if score_mod is not None:
        if getattr(score_mod, "relative", None) is None:
            return "a score_mod that is not a relative bias"
        if score_mod_tensors(score_mod, query.dtype, query.device):
            return "a score_mod whose tensors want gradients"
    if torch.compiler.is_compiling():
        return "under torch.compile (a foreign call)"
    if not native.available():
        return native.status()
    dense = window is None and score_mod is None
    if dense and not calibrate.measuring() and not calibrate.speed(query.dtype).forward_ok:
        return "slower than torch's kernel on this machine for dense plans (native.calibrate)"
    return None


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool | str = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch of sequences (see the module docs).

    Args:
        query: ``(total_q, h, d)``.
        key: ``(total_k, h_kv, d)``, ``h_kv`` dividing ``h``.
        value: ``(total_k, h_kv, d_v)``.
        cu_seqlens_q: int32/int64 ``(n + 1,)``: ``[0, ..., total_q]``, non-decreasing.
        cu_seqlens_k: the same for the keys (as many sequences).
        max_seqlen_q, max_seqlen_k: the longest sequence (checked; computed if None).
        causal, scale, dropout_p, window, mask_mod, score_mod, sinks, backend: as
            :func:`attnkit.attention`, per sequence.
        return_lse: also return the log-sum-exp ``(total_q, h)`` (the output's shape
            without its last dim; flash-attn returns its transpose).

    Returns:
        ``(total_q, h, d_v)`` in the query's dtype; with ``return_lse``, ``(out, lse)``.
        A sequence with no keys gets zeros (and ``-inf``, or its sink).
    """
    check_packed_qkv(query, key, value)
    offsets_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", query.shape[0])
    offsets_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", key.shape[0])
    if len(offsets_q) != len(offsets_k):
        raise ValueError(
            f"cu_seqlens_q has {len(offsets_q) - 1} sequences but cu_seqlens_k has "
            f"{len(offsets_k) - 1}: they must describe the same sequences"
        )
    max_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q", offsets_q)
    max_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k", offsets_k)
    causal_mode = normalize_causal(causal)
    scale_value = 1.0 / math.sqrt(query.shape[-1]) if scale is None else check_float(scale, "scale")
    dropout_p = check_probability(dropout_p, "dropout_p")
    window = check_window(window)
    return_lse = check_bool(return_lse, "return_lse")
    backend = check_backend(backend)
    h = query.shape[1]
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor)
        or not sinks.is_floating_point()
        or sinks.shape != (h,)
        or sinks.device != query.device
    ):
        raise ValueError(
            f"sinks must be a float tensor of shape (h_q,) = ({h},) on the query's device, "
            f"got {sinks!r}"
        )
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    why = why_not_native(
        query,
        key,
        value,
        backend=backend,
        dropout_p=dropout_p,
        mask_mod=mask_mod,
        score_mod=score_mod,
        window=window,
    )
    if why is None:
        out, lse = _native(
            query, key, value, offsets_q, offsets_k, max_q, max_k,
            scale=scale_value, causal=causal_mode, window=window, score_mod=score_mod,
            sinks=sinks,
        )  # fmt: skip
    else:
        out, lse = _per_sequence(
            query, key, value, offsets_q, offsets_k,
            causal=causal_mode, scale=scale, dropout_p=dropout_p, window=window,
            mask_mod=mask_mod, score_mod=score_mod, sinks=sinks, backend=backend,
        )  # fmt: skip
    return (out, lse) if return_lse else out


def _native(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offsets_q: list[int],
    offsets_k: list[int],
    max_q: int,
    max_k: int,
    *,
    scale: float,
    causal: str | None,
    window: int | None,
    score_mod: ScoreMod | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``(out, lse)``, sinks merged in as one more partial (the one merge)."""
    from attnkit.backends.blockwise import native
    from attnkit.backends.blockwise.native.varlen import VarlenKernel, varlen_spec

    spec = varlen_spec(
        offsets_q, offsets_k, query.shape[1], key.shape[1],
        scale=scale, causal=causal, window=window, score_mod=score_mod,
        max_q=max_q, max_k=max_k,
        bf16=query.dtype == torch.bfloat16 and native.bf16(),
    )  # fmt: skip
    out, lse = VarlenKernel.apply(spec, query, key, value)  # (tq, h, d_v), (tq, h) float32
    if sinks is not None:
        sink_lse = sinks.to(lse.dtype).view(1, -1).expand_as(lse)
        out, lse = merge_partials(out, lse, torch.zeros((), dtype=out.dtype), sink_lse)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return out.to(query.dtype), lse.to(lse_dtype)


def _per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offsets_q: list[int],
    offsets_k: list[int],
    *,
    causal: str | None,
    scale: float | None,
    dropout_p: float,
    window: int | None,
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
    sinks: torch.Tensor | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence through :func:`attnkit.attention` as a batch of one, then packed."""
    from attnkit.attention import attention

    h, d_v = query.shape[1], value.shape[-1]
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    for i in range(len(offsets_q) - 1):
        q0, q1, k0, k1 = offsets_q[i], offsets_q[i + 1], offsets_k[i], offsets_k[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: zeros (a sink's share is dropped), lse = the sink or -inf
            outs.append(query.new_zeros(q1 - q0, h, d_v))
            lse = torch.full((q1 - q0, h), float("-inf"), dtype=lse_dtype, device=query.device)
            if sinks is not None:
                lse = sinks.to(lse_dtype).view(1, h).expand(q1 - q0, h)
            lses.append(lse)
            continue
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # (1, h, l_q, d)
        k = key[k0:k1].transpose(0, 1).unsqueeze(0)  # (1, h_kv, l_k, d)
        v = value[k0:k1].transpose(0, 1).unsqueeze(0)  # (1, h_kv, l_k, d_v)
        out, lse = attention(
            q, k, v,
            causal=causal or False, scale=scale, dropout_p=dropout_p, window=window,
            mask_mod=None if mask_mod is None else _SequenceMaskMod(mask_mod, i),
            score_mod=None if score_mod is None else _SequenceScoreMod(score_mod, i),
            sinks=sinks, return_lse=True, backend=backend,
        )  # fmt: skip
        outs.append(out[0].transpose(0, 1))  # (l_q, h, d_v)
        lses.append(lse[0].transpose(0, 1).to(lse_dtype))  # (l_q, h)
    if not outs:
        return query.new_zeros(0, h, d_v), torch.zeros(0, h, dtype=lse_dtype, device=query.device)
    return torch.cat(outs), torch.cat(lses)
