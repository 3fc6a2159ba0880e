""":class:`GPTConfig`: the hyper-parameters of :class:`~attnkit.models.GPT` and its presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attnkit._validate import (
    check_bool,
    check_float,
    check_int,
    check_optional_int,
    check_probability,
    check_window,
)

__all__ = ["GPTConfig"]

_PRESETS: dict[str, dict[str, Any]] = {
    # A few hundred thousand parameters: trains on the synthetic tasks in a minute or two.
    "tiny": dict(vocab_size=256, context_length=64, emb_dim=64, n_layers=2, n_heads=4),
    # Shaped like GPT-2 small (124M parameters): the decode benchmark's model.
    "gpt2-small": dict(
        vocab_size=50257, context_length=1024, emb_dim=768, n_layers=12, n_heads=12, qkv_bias=True
    ),
}


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`~attnkit.models.GPT`.

    Attributes:
        vocab_size: number of token ids.
        context_length: the most tokens a sequence may have.
        emb_dim: model width (``d_out`` of every attention layer).
        n_layers: transformer blocks.
        n_heads: query heads per attention layer.
        n_kv_heads: key/value heads (None = ``n_heads``; fewer = GQA; 1 = MQA).
        drop_rate: dropout on embeddings, attention weights and residual branches.
        qkv_bias: biases in W_query, W_key, W_value.
        rope: rotary positions instead of a learned position embedding.
        rope_theta: RoPE frequency base.
        window: sliding-window size of the local layers (every layer without
            ``global_every``), or None for full causal attention.
        global_every: with ``window``: every ``global_every``-th layer (the 2nd, 4th, ...
            for 2, as Gemma 2 and gpt-oss alternate) attends globally, the others locally.
        layer_windows: an explicit window per layer (None = global), instead of
            ``window``/``global_every``.
        attn_sinks: learn one attention-sink logit per head in every layer (gpt-oss).
        mla_kv_rank: multi-head latent attention (DeepSeek-V2/V3) with a cached latent of
            this size per token; None = ordinary (GQA) attention. Needs ``rope``.
        mla_rope_dim: MLA's decoupled rotary key size (default ``head_dim // 2``, even).
        attn_backend: the attention backend of every layer (``"auto"``, ``"reference"``,
            ``"sdpa"``, ...; see :func:`attnkit.backends.available_backends`).
    """

    vocab_size: int = 256
    context_length: int = 64
    emb_dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    drop_rate: float = 0.0
    qkv_bias: bool = False
    rope: bool = False
    rope_theta: float = 10000.0
    window: int | None = None
    global_every: int | None = None
    layer_windows: list[int | None] | None = None
    attn_sinks: bool = False
    mla_kv_rank: int | None = None
    mla_rope_dim: int | None = None
    attn_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "emb_dim", "n_layers", "n_heads"):
            check_int(getattr(self, name), f"GPTConfig.{name}")
        if self.emb_dim % self.n_heads:
            raise ValueError(
                f"emb_dim ({self.emb_dim}) must be divisible by n_heads ({self.n_heads})"
            )
        kv = check_optional_int(self.n_kv_heads, "GPTConfig.n_kv_heads")
        if kv is not None and self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})")
        check_probability(self.drop_rate, "GPTConfig.drop_rate")
        for name in ("qkv_bias", "rope", "attn_sinks"):
            check_bool(getattr(self, name), f"GPTConfig.{name}")
        check_float(self.rope_theta, "GPTConfig.rope_theta", minimum=0.0, min_inclusive=False)
        check_window(self.window, "GPTConfig.window")
        check_optional_int(self.global_every, "GPTConfig.global_every")
        if self.global_every is not None and self.window is None:
            raise ValueError("GPTConfig.global_every needs a window (the local layers' size)")
        if self.layer_windows is not None:
            if self.window is not None or self.global_every is not None:
                raise ValueError("give either layer_windows or window/global_every, not both")
            if not isinstance(self.layer_windows, (list, tuple)):
                raise TypeError(
                    f"GPTConfig.layer_windows must be a list, got {type(self.layer_windows).__name__}"
                )
            if len(self.layer_windows) != self.n_layers:
                raise ValueError(
                    f"GPTConfig.layer_windows has {len(self.layer_windows)} entries, "
                    f"n_layers is {self.n_layers}"
                )
            for i, w in enumerate(self.layer_windows):
                check_window(w, f"GPTConfig.layer_windows[{i}]")
            self.layer_windows = list(self.layer_windows)
        head_dim = self.emb_dim // self.n_heads
        if self.mla_kv_rank is not None:
            check_int(self.mla_kv_rank, "GPTConfig.mla_kv_rank")
            if not self.rope:
                raise ValueError("mla_kv_rank needs rope=True (MLA's decoupled RoPE key)")
            if kv is not None and kv != self.n_heads:
                raise ValueError("MLA replaces GQA: leave n_kv_heads None with mla_kv_rank")
        if self.mla_rope_dim is not None:
            check_int(self.mla_rope_dim, "GPTConfig.mla_rope_dim")
            if self.mla_kv_rank is None:
                raise ValueError("mla_rope_dim needs mla_kv_rank")
        if self.rope and self.rope_dim() % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.rope_dim()}")
        if head_dim == 0:  # pragma: no cover - emb_dim >= n_heads is implied above
            raise ValueError("head_dim must be positive")
        if not isinstance(self.attn_backend, str):
            raise TypeError(f"attn_backend must be a str, got {type(self.attn_backend).__name__}")

    def rope_dim(self) -> int:
        """Size of the rotated part of each query/key head."""
        head_dim = self.emb_dim // self.n_heads
        if self.mla_kv_rank is not None:
            return self.mla_rope_dim or max(2, head_dim // 2 // 2 * 2)
        return head_dim

    def windows(self) -> list[int | None]:
        """The sliding window of every layer (None = global attention)."""
        if self.layer_windows is not None:
            return list(self.layer_windows)
        if self.global_every is None:
            return [self.window] * self.n_layers
        return [
            None if (i + 1) % self.global_every == 0 else self.window for i in range(self.n_layers)
        ]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """Return the named preset (``"tiny"``, ``"gpt2-small"``), with ``overrides`` applied.

        Raises:
            ValueError: an unknown name (the valid ones are listed).
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid: {', '.join(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def presets(cls) -> list[str]:
        """Return the preset names."""
        return list(_PRESETS)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """Build a config from :meth:`to_dict`'s output; unknown keys raise ValueError.

        Fields added later (layer patterns, sinks, MLA) take their defaults when absent,
        so configs written before them load unchanged.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {', '.join(unknown)}")
        return cls(**data)
