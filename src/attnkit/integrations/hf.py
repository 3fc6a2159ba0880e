"""A Hugging Face ``transformers`` attention backend that computes through :func:`attnkit.attention`.

Usage::

    import attnkit.integrations.hf as attnkit_hf

    attnkit_hf.register()                      # name="attnkit", backend="auto"
    model.set_attn_implementation("attnkit")   # or from_pretrained(..., attn_implementation="attnkit")

:func:`register` adds two things under the same name, so a mask is never dropped:

* an attention function to ``transformers.AttentionInterface``;
* a mask function to ``transformers.AttentionMaskInterface``. Without one, transformers
  builds *no* mask at all for a custom implementation (padding and causality would be
  silently lost). Ours is transformers' ``sdpa_mask`` with every "skip" disabled, so each
  layer receives a dense boolean mask ``(b, 1, l_q, l_k)`` in which True = may attend
  — attnkit's own polarity (:mod:`attnkit.masks`), passed through unchanged. It already
  holds causality, padding (left or right), the sliding window of sliding layers and the
  cache offsets, exactly as the mask that eager attention receives.

Layouts (as transformers passes them to every attention function):
    query ``(b, h_q, l_q, d)``, key/value ``(b, h_kv, l_k, d)`` with ``h_kv`` dividing
    ``h_q`` (GQA, no copies made here), mask ``(b, 1, l_q, l_k)`` bool or float
    (a user-prepared 4-D float mask is added, as eager does). Returns
    ``(attn_output (b, l_q, h_q, d), attn_weights (b, h_q, l_q, l_k) or None)``.

Keywords:
    ``scaling``, ``dropout``: passed on as ``scale`` / ``dropout_p``.
    ``softcap``: ``c * tanh(s / c)`` on the scaled scores, as an attnkit ``score_mod``.
    Inside an :func:`attnkit.trace.record` block each layer also records its queries and keys
    as it receives them (after RoPE) and its scale, as ``layers.<layer_idx>.queries`` /
    ``.keys`` / ``.scale``, next to the reference backend's ``scores`` and ``weights``
    (:func:`attnkit.viz.record_hf` reads them); outside one nothing is kept.
    ``output_attentions``: the weights are returned (attnkit's reference backend). When a
        model does not pass it down (GPT-2 in transformers 5), the request is read from
        transformers' output collector.
    ``sliding_window``: already part of the mask (as for eager); applied by attnkit only
        when a layer gets no mask.
    ``is_causal``: with a mask, causality is the mask's; without one it is applied by attnkit.
    ``position_bias`` (T5 and its family): an additive float bias ``(b or 1, h, l_q, l_k)`` on
        the scaled scores, as eager adds it; combined with the mask into one float mask.
    Keywords that cannot change the attention are ignored: bookkeeping (position ids, cache
    objects, output flags) and flags meant for other parts or kernels
    (``output_router_logits`` of Mixtral/Qwen3-MoE, ``deterministic`` of ModernBERT's
    flash-attention path). Any other keyword with a value raises ``ValueError`` naming it:
    it might change the attention (``s_aux`` sinks, packed-sequence lengths), and dropping
    it would give a silently wrong answer.

A query row with no key left (the padding positions of a left-padded batch) returns zeros,
where eager spreads it uniformly over the masked keys; real tokens never read those rows,
so logits and attentions of real tokens are unaffected.

Minimum version: transformers 4.56, the first release with everything used here
(``AttentionInterface``, ``AttentionMaskInterface``, ``masking_utils.sdpa_mask``,
``PreTrainedModel.set_attn_implementation``; checked in its source). Tested with 5.23.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "attnkit.integrations.hf needs transformers>=4.56: pip install 'attnkit[hf]'"
    ) from exc
try:  # transformers >= 5 records attentions with hooks and no longer tells every layer
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - older transformers pass output_attentions instead
    _active_collector = None  # type: ignore[assignment]

from attnkit import trace
from attnkit._validate import check_backend
from attnkit.attention import attention

__all__ = [
    "MIN_TRANSFORMERS_VERSION",
    "attnkit_mask",
    "make_attention_function",
    "register",
]

#: The oldest transformers release whose interfaces this module relies on.
MIN_TRANSFORMERS_VERSION = "4.56.0"

# Keywords transformers' models forward to every attention function that do not change
# the attention itself (they drive caches, outputs and positions elsewhere).
_BOOKKEEPING = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "past_key_values",
        "past_key_value",
        "output_hidden_states",
        "return_dict",
        "layer_idx",
        "position_embeddings",
        "kwargs",
        # meant for other parts of the model or other kernels; the attention is the same:
        "output_router_logits",  # MoE routers (Mixtral, Qwen3-MoE)
        "deterministic",  # flash-attention's deterministic backward (ModernBERT)
    }
)
# transformers' own implementations, which register() refuses to replace.
_RESERVED = frozenset(
    {
        "eager",
        "sdpa",
        "flex_attention",
        "flash_attention_2",
        "flash_attention_3",
        "flash_attention_4",
        "paged|eager",
    }
)


def _softcap_mod(cap: float) -> Callable[..., torch.Tensor]:
    """Gemma-2-style logit softcapping, ``cap * tanh(score / cap)``, as a score_mod."""

    def softcap(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return softcap


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    unknown = sorted(k for k, v in kwargs.items() if k not in _BOOKKEEPING and v is not None)
    if unknown:
        raise ValueError(
            f"attnkit's transformers backend cannot honour keyword(s) {unknown}; "
            "load this model with attn_implementation='eager' instead"
        )


def _check_mask(attention_mask: Any) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            "attnkit's transformers backend takes a dense bool or float attention_mask, got "
            f"{type(attention_mask).__name__} (was the model's mask built for another "
            "implementation? call attnkit.integrations.hf.register() before loading)"
        )
    if attention_mask.dim() != 4:
        raise ValueError(
            "attention_mask must be 4-D (b, 1 or h, l_q, l_k) when it reaches the attention "
            f"function, got shape {tuple(attention_mask.shape)}"
        )


def _with_position_bias(
    attention_mask: torch.Tensor | None, position_bias: Any, query: torch.Tensor
) -> torch.Tensor | None:
    """T5's additive ``position_bias`` merged with the mask into one float mask (or the mask)."""
    if position_bias is None:
        return attention_mask
    if not isinstance(position_bias, torch.Tensor) or not position_bias.is_floating_point():
        raise TypeError(f"position_bias must be a float tensor, got {type(position_bias).__name__}")
    if position_bias.dim() != 4:
        raise ValueError(
            f"position_bias must be (b or 1, h, l_q, l_k), got shape {tuple(position_bias.shape)}"
        )
    bias = position_bias.to(query.dtype)
    if attention_mask is None:
        return bias
    if attention_mask.dtype == torch.bool:  # True = may attend: keep the bias, -inf elsewhere
        return bias.masked_fill(~attention_mask, float("-inf"))
    return bias + attention_mask.to(query.dtype)


def _attentions_requested(module: torch.nn.Module) -> bool:
    """Whether the running forward records attention weights (``output_attentions=True``).

    transformers 5 collects them with hooks on the attention modules and, for some models
    (GPT-2), does not pass ``output_attentions`` down; its active collector says so instead.
    """
    if _active_collector is not None:
        collected = _active_collector.get()
        if collected is not None:
            return "attentions" in collected or "cross_attentions" in collected
    config = getattr(module, "config", None)
    return bool(getattr(config, "output_attentions", False))


def _maskless_causality(
    is_causal: bool, sliding_window: int | None, q_len: int, k_len: int
) -> tuple[bool, int | None]:
    """Causality and window for a layer that received no mask (alignment must be unambiguous)."""
    window = sliding_window if sliding_window is not None and sliding_window < k_len else None
    if (is_causal or window is not None) and 1 < q_len != k_len:
        raise ValueError(
            f"no attention_mask for {q_len} queries over {k_len} keys with is_causal={is_causal}, "
            f"sliding_window={sliding_window}: the causal alignment is ambiguous; pass a mask "
            "(the mask function that attnkit.integrations.hf.register() installs builds one)"
        )
    return is_causal, window


def make_attention_function(backend: str = "auto") -> Callable[..., tuple[torch.Tensor, Any]]:
    """Return a transformers attention function that runs attnkit's ``backend``.

    Args:
        backend: an attnkit backend name or ``"auto"`` (weights and softcapping
            then go to the reference backend, everything else to the fastest that can).

    Returns:
        ``fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)
        -> (attn_output (b, l_q, h_q, d), attn_weights (b, h_q, l_q, l_k) or None)``.
    """
    check_backend(backend)  # ValueError listing the valid names

    def attnkit_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        is_causal: bool | None = None,
        output_attentions: bool | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check_kwargs(kwargs)
        if query.dim() != 4:
            raise ValueError(
                f"query must be (b, h, l_q, d) as transformers lays it out, got {tuple(query.shape)}"
            )
        _check_mask(attention_mask)
        if position_bias is not None and attention_mask is None and (is_causal or sliding_window):
            raise ValueError(
                "position_bias without an attention_mask on a causal or windowed layer: "
                "pass the mask (register() installs the mask function that builds it)"
            )
        attention_mask = _with_position_bias(attention_mask, position_bias, query)
        if output_attentions is None:
            output_attentions = _attentions_requested(module)
        causal, window = False, None
        if attention_mask is None:
            wants_causal = (
                is_causal if is_causal is not None else getattr(module, "is_causal", False)
            )
            causal, window = _maskless_causality(
                bool(wants_causal), sliding_window, query.shape[-2], key.shape[-2]
            )
        if softcap is not None and softcap <= 0:
            raise ValueError(f"softcap must be positive, got {softcap}")
        # inside a trace.record() block only (attnkit.viz): this layer's q, k, scale and
        # the reference backend's steps, named layers.<layer_idx>.*; else nothing at all
        named: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if trace.is_recording():
            layer = getattr(module, "layer_idx", None)
            named = trace.scope(f"layers.{layer}" if isinstance(layer, int) else "layers")
        with named:
            if trace.is_recording():
                _emit_inputs(query, key, scaling)
            result = attention(
                query,  # (b, h_q, l_q, d)
                key,  # (b, h_kv, l_k, d)
                value,  # (b, h_kv, l_k, d)
                mask=attention_mask,  # (b, 1, l_q, l_k), True = may attend
                causal=causal,
                scale=scaling,
                dropout_p=float(dropout),
                need_weights=bool(output_attentions),
                window=window,
                score_mod=None if softcap is None else _softcap_mod(float(softcap)),
                backend=backend,
            )
        if isinstance(result, tuple):
            context, weights = result[0], result[1]
        else:
            context, weights = result, None
        return context.transpose(1, 2).contiguous(), weights  # (b, l_q, h_q, d)

    return attnkit_attention_forward


def _emit_inputs(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
    """Offer one layer's queries and keys (as the attention receives them: after RoPE, where
    the model applies it) and its score scale to the active :func:`attnkit.trace.record`
    blocks: ``queries`` ``(b, h_q, l_q, d)``, ``keys`` ``(b, h_kv, l_k, d)``, ``scale`` (0-d)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    trace.emit("queries", query)
    trace.emit("keys", key)
    trace.emit("scale", torch.tensor(float(scale), dtype=torch.float64))


def attnkit_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with ``AttentionMaskInterface``.

    transformers' ``sdpa_mask`` with its "skip the mask" shortcuts disabled, so that every
    layer gets the full boolean mask ``(batch_size, 1, q_length, kv_length)`` (True = may
    attend). Arguments are passed through unchanged: they are transformers' mask-interface
    arguments, whose names vary across releases (``cache_position`` in 4.56, ``q_length``
    and ``q_offset`` in 5.x).
    """
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False  # absorbed by **kwargs where unknown
    return sdpa_mask(*args, **kwargs)


def register(name: str = "attnkit", *, backend: str = "auto") -> str:
    """Register attnkit with transformers under ``name`` (attention and mask function).

    Afterwards ``model.set_attn_implementation(name)`` (or ``attn_implementation=name`` at
    load time) runs every attention layer through :func:`attnkit.attention`.

    Args:
        name: the implementation name models will use.
        backend: the attnkit backend to run (``"auto"`` by default).

    Returns:
        ``name``.

    Raises:
        ValueError: ``name`` is empty or one of transformers' own implementations, or
            ``backend`` is unknown.
        ImportError: the installed transformers is older than :data:`MIN_TRANSFORMERS_VERSION`.
    """
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS_VERSION):
        raise ImportError(
            f"attnkit.integrations.hf needs transformers>={MIN_TRANSFORMERS_VERSION}, "
            f"found {transformers.__version__}"
        )
    if not isinstance(name, str) or not name or name in _RESERVED:
        raise ValueError(
            f"name must be a non-empty string other than transformers' own "
            f"{sorted(_RESERVED)}, got {name!r}"
        )
    fn = make_attention_function(backend)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, attnkit_mask)
    return name
