"""The ``sdpa`` backend: torch's fused ``scaled_dot_product_attention``.

Translations made here so that results equal the reference backend:
    - masks: attnkit's bool polarity is SDPA's (True = attend); float masks are added.
    - causal: SDPA's ``is_causal`` is top-left; a bottom-right triangle with
      ``l_q != l_k`` (or any causal plus a mask) is passed as an explicit mask.
    - fully masked rows: SDPA would return NaN; such rows are opened to every key
      for the kernel and their outputs zeroed afterwards (no NaN in the backward).
    - GQA: ``enable_gqa=True``, no copy of the key/value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.backends.registry import AttentionCall, BackendResult, register_backend
from attnkit.masks import dead_rows, is_top_left_triangle

__all__ = ["sdpa_attention"]


def _supports(call: AttentionCall) -> str | None:
    if call.need_weights:
        return "the fused kernel does not return attention weights (use backend='reference')"
    if call.score_mod is not None:
        return "the fused kernel takes no score_mod (use backend='reference')"
    if call.sinks is not None:
        return "the fused kernel takes no sinks (use backend='blockwise')"
    if call.return_lse:
        return "the fused kernel does not return the log-sum-exp (use backend='blockwise')"
    return None


def _auto_supports(call: AttentionCall) -> str | None:
    if call.dropout_p > 0.0:
        # The fused kernel draws its own random stream; "auto" leaves dropout to the
        # reference backend, which reproduces nn.Dropout's stream exactly (the seed
        # tutorial's numbers depend on it). Name backend="sdpa" for fast dropout.
        return "auto leaves dropout to the reference backend"
    return _supports(call)


def sdpa_attention(call: AttentionCall) -> BackendResult:
    """Run ``call`` through ``torch.nn.functional.scaled_dot_product_attention``."""
    q, k, v = call.query, call.key, call.value
    plain_causal = (
        call.mask is None
        and call.window is None
        and call.mask_mod is None
        and call.block_mask is None
    )
    is_causal = plain_causal and is_top_left_triangle(call.q_len, call.k_len, call.causal)
    mask = None if is_causal else call.dense_mask()
    # A row keeps no key only through a mask, a mod, a block mask, a window, or a
    # bottom-right causal triangle with more queries than keys (its first rows sit before
    # key 0): a causal triangle alone needs no dead-row pass.
    no_dead_row = (
        plain_causal and call.causal is not None
        and (call.causal == "top_left" or call.q_len <= call.k_len)
    )  # fmt: skip
    dead = None
    if mask is not None and not no_dead_row:
        if mask.dim() == 1:  # a (l_k,) mask broadcasts, but SDPA wants (..., l_q, l_k)
            mask = mask.unsqueeze(0)
        dead = dead_rows(mask)  # (..., t, 1)
        # Branch-free (no `if dead.any()`): a data-dependent branch would break
        # torch.compile(fullgraph=True); opening no row is a no-op.
        mask = mask | dead if mask.dtype == torch.bool else mask.masked_fill(dead, 0.0)
    squeeze = q.dim() == 2
    if squeeze:  # SDPA wants a head dim
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=call.dropout_p,
        is_causal=is_causal,
        scale=call.scale,
        enable_gqa=call.gqa_groups > 1,
    )
    if squeeze:
        out = out.squeeze(0)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
    return out, None, None


register_backend("sdpa", sdpa_attention, supports=_supports, auto_supports=_auto_supports)
