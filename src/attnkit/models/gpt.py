"""A small GPT: token (+ position) embeddings, pre-norm transformer blocks, a linear head.

The model owns everything positional: the one RoPE table, each row's positions, the
mask and the KV caches. Once per forward it computes them and hands each attention
layer an :class:`~attnkit.models.attention.AttentionInputs` (one per kind of layer:
global, or local with its window); layers read nothing back::

    x ─┬─ LayerNorm ─ attention (GQA / MLA; RoPE values, mask, cache handed in) ─(+)─┬─ LayerNorm ─ FeedForward ─(+)─>
       └──────────────────────────────────────────────────────────────────────────┘  └────────────────────────┘

Time indices vs positions: a token's *time index* is its column in ``idx`` (where a
cache stores it); its *position* (RoPE angle, learned position embedding) counts the
real tokens before it in its row, so a left-padded row starts at position 0 on its
first real token and computes exactly what it computes alone.

Shapes: b batch, t tokens, s keys, d emb_dim, v vocab_size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnkit import trace
from attnkit._validate import check_bool, check_int, check_window
from attnkit.kv_cache import KVCache
from attnkit.models.attention import AttentionInputs, CausalSelfAttention
from attnkit.models.config import GPTConfig
from attnkit.models.linear import Linear, pack_linears, unpack_linears
from attnkit.models.mla import MultiHeadLatentAttention
from attnkit.models.plan import Layout, Plan, build_packed_plan, build_plan, plan_forward
from attnkit.paged_kv_cache import PagedBatch, PagedKVCache, PagedLayer
from attnkit.rope import RotaryEmbedding

__all__ = ["GPT", "GPTConfig", "TransformerBlock"]


class FeedForward(nn.Module):
    """``Linear(d, 4d) -> GELU (tanh approximation, as GPT-2) -> Linear(4d, d)``."""

    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            Linear(emb_dim, 4 * emb_dim),
            nn.GELU(approximate="tanh"),
            Linear(4 * emb_dim, emb_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc, gelu, proj = self.layers  # unpacked: one module call fewer per token when decoding
        return proj(gelu(fc(x)))  # (b, t, d)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + ff(norm2(x))``.

    Args:
        cfg: the model's hyper-parameters.
        window: this layer's sliding window (None = global).
    """

    def __init__(self, cfg: GPTConfig, window: int | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.emb_dim)
        self.att: CausalSelfAttention | MultiHeadLatentAttention
        common = dict(dropout=cfg.drop_rate, window=window, sinks=cfg.attn_sinks)
        if cfg.mla_kv_rank is not None:
            self.att = MultiHeadLatentAttention(
                cfg.emb_dim,
                cfg.emb_dim,
                num_heads=cfg.n_heads,
                kv_rank=cfg.mla_kv_rank,
                rope_dim=cfg.rope_dim(),
                qkv_bias=cfg.qkv_bias,
                backend=cfg.attn_backend,
                **common,  # type: ignore[arg-type]
            )
        else:
            self.att = CausalSelfAttention(
                cfg.emb_dim,
                cfg.emb_dim,
                num_heads=cfg.n_heads,
                num_kv_heads=cfg.n_kv_heads,
                qkv_bias=cfg.qkv_bias,
                backend=cfg.attn_backend,
                **common,  # type: ignore[arg-type]
            )
        self.norm2 = nn.LayerNorm(cfg.emb_dim)
        self.ff = FeedForward(cfg.emb_dim)
        self.drop_resid = nn.Dropout(cfg.drop_rate)

    def forward(
        self, x: torch.Tensor, inputs: AttentionInputs, cache: KVCache | None = None
    ) -> torch.Tensor:
        x = x + self._drop(self.att(self.norm1(x), inputs, cache))  # (b, t, d)
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
        # The one RoPE table of the model (non-persistent: not in the state dict).
        self.rope = (
            RotaryEmbedding(cfg.rope_dim(), cfg.context_length, cfg.rope_theta)
            if cfg.rope
            else None
        )
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.windows = cfg.windows()
        self.trf_blocks = nn.ModuleList(TransformerBlock(cfg, w) for w in self.windows)
        self.final_norm = nn.LayerNorm(cfg.emb_dim)
        self.out_head = Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.caches: nn.ModuleList | None = None
        self.streaming: tuple[int, int] | None = None

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())

    # -- inference weights -----------------------------------------------------------------
    def pack_weights(self) -> int:
        """Prepack every linear layer's weight for oneDNN, so that calls with no gradient
        (decoding above all) run on it: 2.66x the tokens/s of HF for GPT-2 small at batch 1
        and 8 on a 2-core CPU (README, LLM section). See :mod:`attnkit.models.linear`.

        The copies take as much memory as the weights; they are made once and kept
        while they stay exact (a changed weight is recomputed with ``F.linear`` until
        packed again). ``train()`` and :meth:`unpack_weights` free them.
        :meth:`generate` calls this unless told ``pack_weights=False``.

        Returns:
            How many layers run on a packed copy (0 on builds without oneDNN, and for
            weights that are not CPU float32).
        """
        return pack_linears(self)

    def unpack_weights(self) -> None:
        """Free the prepacked weight copies (see :meth:`pack_weights`)."""
        unpack_linears(self)

    def train(self, mode: bool = True) -> GPT:
        """Set training mode; entering it frees the prepacked copies (the weights are
        about to change)."""
        if mode:
            unpack_linears(self)
        return super().train(mode)

    # -- caching ---------------------------------------------------------------------------
    def setup_cache(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        *,
        static: bool = False,
        streaming: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Give every attention layer a KV cache (owned here); forwards then take only the
        new tokens, with ``input_pos`` saying which time indices they are.

        Args:
            batch_size: rows decoded together.
            max_seq_len: time indices the caches serve (default ``context_length``);
                local layers keep a ring of their window.
            static: fixed-shape caches (whole buffers plus a mask), for ``torch.compile``.
            streaming: ``(sink_tokens, window)``: StreamingLLM. Global layers keep the
                first ``sink_tokens`` tokens and the last ``window``; memory is bounded
                and decoding may run past ``context_length``. Needs ``rope``: cached keys
                are stored unrotated and re-positioned every step (positions then stay
                below ``sink_tokens + window``).

        Raises:
            ValueError: bad sizes, ``max_seq_len > context_length``, or streaming without
                RoPE / with ``sink_tokens + window > context_length``.
        """
        check_int(batch_size, "batch_size")
        check_bool(static, "static")
        ctx = self.cfg.context_length
        if streaming is not None:
            if not isinstance(streaming, tuple) or len(streaming) != 2:
                raise TypeError(f"streaming must be (sink_tokens, window), got {streaming!r}")
            sinks = check_int(streaming[0], "streaming sink_tokens", minimum=0)
            window = check_window(streaming[1], "streaming window", optional=False)
            if not self.cfg.rope:
                raise ValueError(
                    "streaming needs rope=True: learned position embeddings stop at "
                    f"context_length ({ctx})"
                )
            if sinks + window > ctx:
                raise ValueError(
                    f"streaming sink_tokens + window ({sinks} + {window}) exceeds "
                    f"context_length ({ctx})"
                )
            self.streaming = (sinks, window)
        else:
            self.streaming = None
        length = ctx if max_seq_len is None else check_int(max_seq_len, "max_seq_len")
        if length > ctx:
            raise ValueError(f"max_seq_len ({length}) exceeds context_length ({ctx})")
        ref = self.tok_emb.weight
        caches = []
        for block, w in zip(self.trf_blocks, self.windows, strict=True):
            att: CausalSelfAttention | MultiHeadLatentAttention = block.att  # type: ignore[assignment]
            heads, k_dim, v_dim = att.cache_shape()
            if self.streaming is None:
                geometry: dict = dict(max_seq_len=length, window=w)
            elif w is None or w >= self.streaming[1]:  # global: sinks + the window
                geometry = dict(max_seq_len=None, window=self.streaming[1], sink_tokens=sinks)
            else:  # a local layer keeps its own ring
                geometry = dict(max_seq_len=None, window=w)
            caches.append(
                KVCache(
                    batch_size,
                    num_kv_heads=heads,
                    head_dim=k_dim,
                    value_dim=v_dim,
                    static=static,
                    dtype=dtype or ref.dtype,
                    device=ref.device,
                    **geometry,
                )
            )
        self.caches = nn.ModuleList(caches)

    def setup_paged_cache(
        self, num_pages: int, page_size: int = 16, *, dtype: torch.dtype | None = None
    ) -> PagedKVCache:
        """Give every attention layer a view of one :class:`~attnkit.PagedKVCache` (a pool
        of ``num_pages`` pages of ``page_size`` tokens, every layer's keys and values per
        page) and return the cache: the caller allocates, grows, forks and frees its
        sequences and hands each forward a :class:`~attnkit.paged_kv_cache.PagedBatch`
        (:meth:`step` with ``paged=``; :meth:`generate` with ``page_size``;
        :mod:`attnkit.models.serving`).

        Raises:
            ValueError: bad sizes, or a model whose layers a paged cache cannot serve
                (latent attention, StreamingLLM).
        """
        if self.cfg.mla_kv_rank is not None:
            raise ValueError(
                "a paged cache serves GQA/MHA layers; this model uses latent attention"
            )
        att: CausalSelfAttention = self.trf_blocks[0].att  # type: ignore[assignment]
        heads, k_dim, v_dim = att.cache_shape()
        ref = self.tok_emb.weight
        cache = PagedKVCache(
            num_pages,
            page_size,
            heads,
            k_dim,
            num_layers=len(self.trf_blocks),
            value_dim=v_dim,
            dtype=dtype or ref.dtype,
            device=ref.device,
        )
        self.caches = nn.ModuleList(PagedLayer(cache, i) for i in range(len(self.trf_blocks)))
        self.streaming = None
        return cache

    def reset_cache(self) -> None:
        """Zero every cache's buffers (a cache holds no position: nothing else to reset)."""
        for cache in self.caches or ():
            if isinstance(cache, PagedLayer):
                cache.cache.reset()
            else:
                cache.reset()  # type: ignore[operator]

    def delete_cache(self) -> None:
        """Remove the caches: forwards process whole sequences again."""
        self.caches, self.streaming = None, None

    # -- the forward ------------------------------------------------------------------------
    def forward(
        self,
        idx: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return next-token logits ``(b, t, vocab_size)``.

        Args:
            idx: token ids ``(b, t)``; with a cache, only the new tokens.
            attention_mask: ``(b, L)``, 1 (or True) = token, 0 = padding, indexed by time
                from 0 and covering every time index up to the last of ``idx``
                (``L >= input_pos[-1] + 1``); each row's ones must be contiguous (left or
                right padding). None = no padding.
            input_pos: ``(t,)`` consecutive time indices of ``idx``'s tokens; required
                with a cache, default ``0 .. t - 1`` without.

        Raises:
            TypeError / ValueError: non-integer ids, a wrong rank, ids out of the
                vocabulary, more tokens than ``context_length``, a bad mask or input_pos.
        """
        plan = plan_forward(self.layout(), idx, attention_mask, input_pos)
        return self._run(idx, plan, last_only=False)

    def step(
        self,
        idx: torch.Tensor,
        input_pos: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        last_only: bool = True,
        paged: PagedBatch | None = None,
    ) -> torch.Tensor:
        """One decoding step that trusts its inputs: :meth:`forward` without the checks.

        For a caller that checked ``idx``, the mask and the context bound once for many
        steps, as :func:`attnkit.models.generate.generate` does (its new tokens come from
        the model's own logits). Nothing is validated here: a bad input gives a wrong
        result or an indexing error, not a message naming it; use :meth:`forward` for that.

        Args:
            idx: token ids ``(b, t)`` in ``[0, vocab_size)``; with a cache, the new tokens.
            input_pos: ``(t,)`` consecutive time indices of ``idx``'s tokens, within
                ``context_length`` and the cache.
            attention_mask: bool ``(b, L)``, True = token, ``L > input_pos[-1]``, each row
                left-padded; None = no padding.
            last_only: return the logits of the last position only.
            paged: on a paged cache (:meth:`setup_paged_cache`), the forward's sequences
                and page tables (reserved for the new tokens). A packed batch
                (``paged.counts`` set: ``idx`` ``(1, sum(counts))``, ``input_pos``
                ignored) returns the logits of each sequence's last new token,
                ``(1, len(counts), vocab_size)``.

        Returns:
            Next-token logits ``(b, 1, vocab_size)`` (``(b, t, vocab_size)`` when not
            ``last_only``).
        """
        if paged is not None and paged.counts is not None:
            plan = build_packed_plan(self.layout(), paged, idx.device)
            last = torch.tensor(paged.counts, device=idx.device).cumsum(0) - 1  # (n,)
            return self._run(idx, plan, last)
        plan = build_plan(self.layout(), input_pos, attention_mask, paged)
        return self._run(idx, plan, last_only)

    def layout(self) -> Layout:
        """What planning a forward reads of the model (handed down to
        :mod:`attnkit.models.plan`): vocabulary and context bounds, caches, streaming,
        RoPE table and layer windows."""
        caches = None if self.caches is None else [c for c in self.caches]  # KVCache each
        return Layout(
            vocab_size=self.cfg.vocab_size,
            context_length=self.cfg.context_length,
            caches=caches,  # type: ignore[arg-type]
            streaming=self.streaming,
            rope=self.rope,
            windows=self.windows,
        )

    def _run(self, idx: torch.Tensor, plan: Plan, last_only: bool | torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)  # (b, t, d)
        if self.pos_emb is not None:
            x = x + self.pos_emb(plan.positions)  # (b|1, t, d)
        x = self.drop_emb(x)
        caches = self.caches if self.caches is not None else [None] * len(self.trf_blocks)
        for i, (block, cache) in enumerate(zip(self.trf_blocks, caches, strict=True)):
            with trace.scope(f"blocks.{i}"):  # names recorded weights "blocks.<i>.weights"
                x = block(x, plan.inputs[i], cache)  # (b, t, d)
        if isinstance(last_only, torch.Tensor):  # the rows whose logits are wanted
            x = x[:, last_only]  # (b, n, d)
        elif last_only:
            x = x[:, -1:]  # (b, 1, d)
        return self.out_head(self.final_norm(x))  # (b, t, v)

    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        attention_mask: torch.Tensor | None = None,
        eos_id: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        streaming: tuple[int, int] | None = None,
        pack_weights: bool = True,
        page_size: int | None = None,
    ) -> torch.Tensor:
        """Append up to ``max_new_tokens`` tokens to every row of ``idx`` ``(b, t)``.

        See :func:`attnkit.models.generate.generate` for the arguments.
        """
        from attnkit.models.generate import generate

        return generate(
            self,
            idx,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            attention_mask=attention_mask,
            eos_id=eos_id,
            use_cache=use_cache,
            generator=generator,
            streaming=streaming,
            pack_weights=pack_weights,
            page_size=page_size,
        )

    # -- speculative decoding --------------------------------------------------------------
    def verify_tree(self, tokens: torch.Tensor, tree: Any, start: int) -> torch.Tensor:
        """Logits ``(b, n, vocab_size)`` of every node of a draft tree, in one forward over
        the caches holding ``start`` tokens; each equals decoding its branch token by token.

        See :func:`attnkit.models.speculative.verify_tree`.
        """
        from attnkit.models.speculative import verify_tree

        return verify_tree(self, tokens, tree, start)

    def accept_tree_path(self, tree: Any, start: int, path: list[int]) -> None:
        """Keep an accepted branch of the last verified tree in the caches (at time indices
        ``start ..``); see :func:`attnkit.models.speculative.accept_path`."""
        from attnkit.models.speculative import accept_path

        accept_path(self, tree, start, path)
