"""attnkit's parts in the book's chapter-4 ``GPTModel``: ``CausalSelfAttention`` replaces
the book's ``MultiHeadAttention``, the model hands it ``AttentionInputs``, and a
``KVCache`` per block (a full one, or a ring for a sliding window, its mask built from
``cache.key_positions(input_pos)``) makes generation incremental. The references are the
book's own attention code (explicit scores, ``masked_fill``, softmax) and a full
recompute of every step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnkit.models import AttentionInputs, CausalSelfAttention, KVCache

CFG = {
    "vocab_size": 50,
    "context_length": 24,
    "emb_dim": 32,
    "n_heads": 4,
    "n_kv_heads": 2,  # GQA: query head i reads kv head i // 2
    "n_layers": 2,
    "drop_rate": 0.0,
    "qkv_bias": False,
}


class LayerNorm(nn.Module):
    """The book's LayerNorm (biased variance, learnable scale and shift)."""

    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class FeedForward(nn.Module):
    """The book's feed-forward: 4x expansion with tanh-approximated GELU."""

    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(emb_dim, 4 * emb_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * emb_dim, emb_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def book_attention(att: CausalSelfAttention, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """The book's ``MultiHeadAttention.forward`` on ``att``'s weights (plus GQA's repeat
    and a sliding window): explicit scores, ``masked_fill(-inf)``, softmax, context."""
    b, t, _ = x.shape
    h, h_kv, d = att.num_heads, att.num_kv_heads, att.head_dim
    queries = att.W_query(x).view(b, t, h, d).transpose(1, 2)  # (b, h, t, d)
    keys = att.W_key(x).view(b, t, h_kv, d).transpose(1, 2)  # (b, h_kv, t, d)
    values = att.W_value(x).view(b, t, h_kv, d).transpose(1, 2)
    keys = keys.repeat_interleave(h // h_kv, dim=1)  # (b, h, t, d)
    values = values.repeat_interleave(h // h_kv, dim=1)
    attn_scores = queries @ keys.transpose(2, 3)  # (b, h, t, t)
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    if window is not None:  # also drop keys `window` or more positions back
        mask |= torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-window)
    attn_scores.masked_fill_(mask, -torch.inf)
    attn_weights = torch.softmax(attn_scores / d**0.5, dim=-1)
    context = (attn_weights @ values).transpose(1, 2).reshape(b, t, att.d_out)
    return att.out_proj(context)  # (b, t, d_out)


class TransformerBlock(nn.Module):
    """The book's block (pre-LayerNorm, shortcuts) with attnkit's attention inside."""

    def __init__(self, cfg: dict, window: int | None) -> None:
        super().__init__()
        self.att = CausalSelfAttention(
            cfg["emb_dim"],
            cfg["emb_dim"],
            num_heads=cfg["n_heads"],
            num_kv_heads=cfg["n_kv_heads"],
            qkv_bias=cfg["qkv_bias"],
            dropout=cfg["drop_rate"],
            window=window,
        )
        self.ff = FeedForward(cfg["emb_dim"])
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(
        self,
        x: torch.Tensor,
        inputs: AttentionInputs | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        shortcut = x
        x = self.norm1(x)
        if inputs is None:  # the book's own attention code, for the reference
            x = book_attention(self.att, x, self.att.window)
        else:
            x = self.att(x, inputs, cache)
        x = self.drop_shortcut(x) + shortcut
        shortcut = x
        x = self.drop_shortcut(self.ff(self.norm2(x))) + shortcut
        return x


def layer_inputs(
    input_pos: torch.Tensor, cache: KVCache | None, window: int | None
) -> AttentionInputs:
    """What the model hands a layer: the causal(/window) flags without a cache, else a
    mask from the time index of every key the cache will return."""
    if cache is None:
        return AttentionInputs(input_pos, causal=True, window=window)
    k_time = cache.key_positions(input_pos)[None, :]  # (1, s); -1 = empty slot
    q_time = input_pos[:, None]  # (t, 1)
    keep = (k_time >= 0) & (k_time <= q_time)  # (t, s)
    if window is not None:
        keep &= k_time > q_time - window
    return AttentionInputs(input_pos, mask=keep[None, None])  # (1, 1, t, s)


class GPTModel(nn.Module):
    """The book's chapter-4 GPTModel; ``forward(idx, input_pos)`` also takes the time
    indices of ``idx``'s tokens, which the caches need."""

    def __init__(self, cfg: dict, window: int | None = None) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.ModuleList(
            TransformerBlock(cfg, window) for _ in range(cfg["n_layers"])
        )
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)
        self.window = window
        self.caches: list[KVCache] | None = None

    def setup_cache(self, batch_size: int, ring: bool) -> None:
        """One KVCache per block: full (``max_seq_len = context_length``) or a ring of the
        window (no maximum length)."""
        att = self.trf_blocks[0].att
        max_len = None if ring else self.pos_emb.num_embeddings
        window = self.window if ring else None
        self.caches = [
            KVCache(batch_size, max_len, att.num_kv_heads, att.head_dim, window=window)
            for _ in self.trf_blocks
        ]

    def forward(
        self, in_idx: torch.Tensor, input_pos: torch.Tensor | None = None, *, book: bool = False
    ) -> torch.Tensor:
        if input_pos is None:
            input_pos = torch.arange(in_idx.shape[1])
        tok_embeds = self.tok_emb(in_idx)  # (b, t, emb_dim)
        pos_embeds = self.pos_emb(input_pos)  # (t, emb_dim)
        x = self.drop_emb(tok_embeds + pos_embeds)
        caches = self.caches or [None] * len(self.trf_blocks)
        for block, cache in zip(self.trf_blocks, caches, strict=True):
            inputs = None if book else layer_inputs(input_pos, cache, self.window)
            x = block(x, inputs, cache)
        return self.out_head(self.final_norm(x))  # (b, t, vocab_size)


def generate_uncached(model: GPTModel, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, list]:
    """The book's ``generate_text_simple``: recompute the whole sequence for every token."""
    logits_seen = []
    for _ in range(n):
        logits = model(idx, book=True)[:, -1, :]  # (b, vocab)
        logits_seen.append(logits)
        idx = torch.cat((idx, logits.argmax(dim=-1, keepdim=True)), dim=1)
    return idx, logits_seen


def generate_cached(
    model: GPTModel, idx: torch.Tensor, n: int, *, ring: bool, prefill_chunk: int
) -> tuple[torch.Tensor, list]:
    """Prefill in chunks, then one token per step through the KV caches."""
    model.setup_cache(idx.shape[0], ring)
    logits_seen = []
    t0 = idx.shape[1]
    for start in range(0, t0, prefill_chunk):
        stop = min(start + prefill_chunk, t0)
        logits = model(idx[:, start:stop], torch.arange(start, stop))[:, -1, :]
    for step in range(n):
        logits_seen.append(logits)
        nxt = logits.argmax(dim=-1, keepdim=True)  # (b, 1)
        idx = torch.cat((idx, nxt), dim=1)
        if step < n - 1:
            logits = model(nxt, torch.tensor([idx.shape[1] - 1]))[:, -1, :]
    model.caches = None
    return idx, logits_seen


@torch.no_grad()
def test_attnkit_attention_equals_the_books_code_in_the_model():
    for window in (None, 5):
        model = GPTModel(CFG, window=window).eval()
        idx = torch.randint(0, CFG["vocab_size"], (2, 17))
        want = model(idx, book=True)
        got = model(idx)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # the window changes the result (so it is really applied)
        assert window is None or not torch.allclose(got, model_no_window(model, idx), atol=1e-3)


def model_no_window(model: GPTModel, idx: torch.Tensor) -> torch.Tensor:
    """``model`` run by the book's code with the window switched off."""
    saved = model.window
    for block in model.trf_blocks:
        block.att.window = None
    try:
        return model(idx, book=True)
    finally:
        for block in model.trf_blocks:
            block.att.window = saved


@torch.no_grad()
@pytest.mark.parametrize(
    ("window", "ring", "prefill_chunk"),
    [
        (None, False, 7),  # a full cache, one-shot prefill
        (None, False, 3),  # a full cache, chunked prefill
        (4, False, 7),  # a window on a full cache (mask from key_positions)
        (4, True, 7),  # a ring of the window: the prefill chunk is longer than the ring
        (4, True, 2),  # a ring, chunked prefill
        (1, True, 1),  # a ring of one slot, token by token
    ],
)
def test_cached_generation_equals_full_recompute(window, ring, prefill_chunk):
    model = GPTModel(CFG, window=window).eval()
    idx = torch.randint(0, CFG["vocab_size"], (2, 7))
    n = CFG["context_length"] - idx.shape[1]  # up to the position table's end
    want_idx, want_logits = generate_uncached(model, idx, n)
    got_idx, got_logits = generate_cached(model, idx, n, ring=ring, prefill_chunk=prefill_chunk)
    assert torch.equal(got_idx, want_idx)
    assert len(got_logits) == len(want_logits) == n
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_ring_cache_holds_only_the_window():
    model = GPTModel(CFG, window=4)
    model.setup_cache(2, ring=True)
    assert model.caches is not None
    cache = model.caches[0]
    assert cache.is_ring and cache.k_cache.shape == (2, CFG["n_kv_heads"], 4, 8)
    # after times 0..9 the ring holds 8, 9, 6, 7 (time p in slot p % 4)
    assert cache.key_positions(torch.tensor([9])).tolist() == [8, 9, 6, 7]
    full = KVCache(2, CFG["context_length"], CFG["n_kv_heads"], 8)
    assert full.key_positions(torch.tensor([9])).tolist() == list(range(10))
