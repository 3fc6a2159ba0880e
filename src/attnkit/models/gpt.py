"""A small GPT: token (+ position) embeddings, pre-norm transformer blocks, a linear head.

Each block is the seeds' "many repeated layers" with attnkit's
:class:`~attnkit.modules.MultiHeadAttention` inside::

    x ─┬─ LayerNorm ─ MultiHeadAttention (causal; GQA / RoPE / window) ─(+)─┬─ LayerNorm ─ FeedForward ─(+)─>
       └─────────────────────────────────────────────────────────────────┘  └────────────────────────┘

Shapes: b batch, t tokens, d emb_dim, v vocab_size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnkit import trace
from attnkit.modules import MultiHeadAttention

__all__ = ["GPT", "GPTConfig", "TransformerBlock"]

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
    """Hyper-parameters of :class:`GPT`.

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
        window: sliding-window attention size, or None for full causal attention.
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
    attn_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "emb_dim", "n_layers", "n_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.emb_dim % self.n_heads:
            raise ValueError(
                f"emb_dim ({self.emb_dim}) must be divisible by n_heads ({self.n_heads})"
            )
        kv = self.n_kv_heads
        if kv is not None and (not isinstance(kv, int) or kv <= 0 or self.n_heads % kv):
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})")
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise ValueError(f"window must be a positive int or None, got {self.window!r}")
        if self.rope and (self.emb_dim // self.n_heads) % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.emb_dim // self.n_heads}")
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {self.drop_rate}")
        if not isinstance(self.attn_backend, str):
            raise TypeError(f"attn_backend must be a str, got {type(self.attn_backend).__name__}")

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
        """Build a config from :meth:`to_dict`'s output; unknown keys raise ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {', '.join(unknown)}")
        return cls(**data)


class FeedForward(nn.Module):
    """``Linear(d, 4d) -> GELU (tanh approximation, as GPT-2) -> Linear(4d, d)``."""

    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(emb_dim, 4 * emb_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * emb_dim, emb_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc, gelu, proj = self.layers  # unpacked: one module call fewer per token when decoding
        return proj(gelu(fc(x)))  # (b, t, d)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + ff(norm2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.emb_dim)
        self.att = MultiHeadAttention(
            cfg.emb_dim,
            cfg.emb_dim,
            cfg.context_length,
            cfg.drop_rate,
            cfg.n_heads,
            cfg.qkv_bias,
            num_kv_heads=cfg.n_kv_heads,
            rope=cfg.rope,
            rope_theta=cfg.rope_theta,
            window=cfg.window,
            backend=cfg.attn_backend,
        )
        self.norm2 = nn.LayerNorm(cfg.emb_dim)
        self.ff = FeedForward(cfg.emb_dim)
        self.drop_resid = nn.Dropout(cfg.drop_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.att(self.norm1(x)))  # (b, t, d)
        return x + self._drop(self.ff(self.norm2(x)))  # (b, t, d)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Dropout only when it does something: skipping the call matters when decoding.
        return self.drop_resid(x) if self.training and self.drop_resid.p > 0 else x


class GPT(nn.Module):
    """A decoder-only transformer language model.

    Args:
        cfg: the hyper-parameters; see :class:`GPTConfig` and :meth:`GPTConfig.preset`.

    Example:
        >>> model = GPT(GPTConfig.preset("tiny"))
        >>> model(torch.zeros(1, 5, dtype=torch.long)).shape
        torch.Size([1, 5, 256])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = None if cfg.rope else nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.emb_dim)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # Tokens held by the caches, as a tensor updated in place: a compiled decode
        # step reads it as data instead of specialising (recompiling) on a Python int.
        self.register_buffer("cache_pos", torch.zeros((), dtype=torch.long), persistent=False)
        self._cached = False

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())

    # -- caching ---------------------------------------------------------------------------
    def setup_cache(
        self, batch_size: int, max_seq_len: int | None = None, *, static: bool = False
    ) -> None:
        """Give every attention layer a KV cache; calls then take only the new tokens."""
        for block in self.trf_blocks:
            block.att.setup_cache(batch_size, max_seq_len, static=static)
        self._cached = True
        self.cache_pos.zero_()

    def reset_cache(self) -> None:
        """Empty every layer's cache, keeping the buffers."""
        for block in self.trf_blocks:
            block.att.reset_cache()
        self.cache_pos.zero_()

    def delete_cache(self) -> None:
        """Remove the caches: calls process whole sequences again."""
        for block in self.trf_blocks:
            block.att.delete_cache()
        self._cached = False
        self.cache_pos.zero_()

    def forward(self, idx: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        """Return next-token logits.

        Args:
            idx: token ids ``(b, t)``; with a cache, only the tokens not yet seen.
            last_only: compute the logits of the last position only (generation).

        Returns:
            ``(b, t, vocab_size)`` logits (``(b, 1, vocab_size)`` with ``last_only``).

        Raises:
            TypeError / ValueError: non-integer ids, a wrong rank, ids out of the
                vocabulary, or more tokens than ``context_length``.
        """
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.long, torch.int):
            raise TypeError("idx must be an integer (long) tensor of token ids")
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, tokens), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if not torch.compiler.is_compiling():
            # Data-dependent checks read tensor values: eager only (a graph break under
            # torch.compile); the compiled path relies on the eager prefill's checks.
            start = int(self.cache_pos) if self._cached else 0
            if start + t > self.cfg.context_length:
                raise ValueError(
                    f"{start + t} tokens exceed context_length={self.cfg.context_length}"
                )
            if t and (int(idx.min()) < 0 or int(idx.max()) >= self.cfg.vocab_size):
                raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        x = self.tok_emb(idx)  # (b, t, d)
        if self.pos_emb is not None:
            positions = torch.arange(t, device=idx.device)  # (t,)
            if self._cached:
                positions = positions + self.cache_pos  # absolute positions of the new tokens
            x = x + self.pos_emb(positions)  # (b, t, d)
        x = self.drop_emb(x)
        for i, block in enumerate(self.trf_blocks):
            with trace.scope(f"blocks.{i}"):  # names recorded weights "blocks.<i>.weights"
                x = block(x)  # (b, t, d)
        if self._cached:
            self.cache_pos.add_(t)
        if last_only:
            x = x[:, -1:]  # (b, 1, d)
        return self.out_head(self.final_norm(x))  # (b, t, v)

    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(b, t)``.

        Args:
            idx: the prompt, token ids ``(b, t)``.
            max_new_tokens: tokens to add.
            temperature: softmax temperature; 0 means greedy (argmax).
            top_k: sample only among the ``top_k`` most likely tokens.
            use_cache: decode with KV caches (one token per step) instead of
                recomputing the whole sequence at every step; same result.
            generator: random generator for sampling.

        Returns:
            ``(b, t + max_new_tokens)`` token ids.

        Raises:
            ValueError: an empty prompt, ``t + max_new_tokens > context_length``, a
                negative temperature or a bad ``top_k``.
        """
        if idx.dim() != 2 or idx.shape[1] == 0:
            raise ValueError(
                f"idx must be a non-empty (batch, tokens) tensor, got {tuple(idx.shape)}"
            )
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        total = idx.shape[1] + max_new_tokens
        if total > self.cfg.context_length:
            raise ValueError(
                f"prompt ({idx.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"context_length ({self.cfg.context_length})"
            )
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and not 0 < top_k <= self.cfg.vocab_size:
            raise ValueError(f"top_k must be in [1, {self.cfg.vocab_size}], got {top_k}")
        was_training, had_cache = self.training, self._cached
        self.eval()
        try:
            if use_cache:  # allocated outside inference mode: the cache may outlive this call
                self.setup_cache(idx.shape[0], total)
            # inference_mode rather than no_grad: less bookkeeping per op, which is
            # what a batch-1 decode step mostly spends its non-matmul time on.
            with torch.inference_mode():
                out, step_input = idx, idx
                for _ in range(max_new_tokens):
                    logits = self(step_input if use_cache else out, last_only=True)[:, -1]  # (b, v)
                    next_id = _sample(logits, temperature, top_k, generator)  # (b, 1)
                    out = torch.cat((out, next_id), dim=1)
                    step_input = next_id
        finally:
            if use_cache and not had_cache:
                self.delete_cache()
            self.train(was_training)
        return out.clone()  # a normal tensor: inference tensors cannot be saved for backward


def _sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (b, 1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)  # (b, 1)
