"""Multi-head latent attention: the cache holds the compressed latent; absorbed = expanded
= an independent float64 expanded reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.kv_cache import KVCache
from attnkit.models import GPT, AttentionInputs, GPTConfig, MultiHeadLatentAttention
from attnkit.rope import rope_values
from tests.conftest import TOL
from tests.reference import ref_attention


def ref_rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float64, pair (i, i + d/2) by angle pos * 10000^(-2i/d)."""
    d = x.shape[-1]
    half = d // 2
    freq = 10000.0 ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * freq  # (t, d/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()), -1)


def ref_mla(layer: MultiHeadLatentAttention, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """The uncompressed computation: per-head keys and values expanded from the latent."""
    b, t, _ = x.shape
    h, d, r, rd = layer.num_heads, layer.head_dim, layer.kv_rank, layer.rope_dim
    pos = torch.arange(t)
    q = (x @ layer.W_query.weight.double().T).view(b, t, h, d + rd).transpose(1, 2)
    lat = x @ layer.W_dkv.weight.double().T
    c, k_r = lat[..., :r], lat[..., r:]
    c = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.kv_norm.weight.double()
    kv = (c @ layer.W_ukv.weight.double().T).view(b, t, h, 2, d)
    k_nope, v = kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2)
    k_rope = ref_rotate(k_r, pos)[:, None].expand(b, h, t, rd)
    q = torch.cat((q[..., :d], ref_rotate(q[..., d:], pos)), -1)
    k = torch.cat((k_nope, k_rope), -1)
    keep = torch.tensor(
        [[j <= i and (window is None or i - j < window) for j in range(t)] for i in range(t)]
    )
    ctx, _ = ref_attention(q, k, v, mask=keep, scale=1 / math.sqrt(d + rd))
    out = ctx.transpose(1, 2).reshape(b, t, h * d)
    return out @ layer.out_proj.weight.double().T + layer.out_proj.bias.double()


@pytest.mark.parametrize("window", [None, 3])
def test_absorbed_and_expanded_equal_the_float64_reference(window):
    layer = MultiHeadLatentAttention(
        16, 24, num_heads=3, kv_rank=10, rope_dim=4, window=window
    ).double()
    with torch.no_grad():
        layer.kv_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    cos, sin = rope_values(torch.arange(9), 4, dtype=torch.float64)
    inputs = AttentionInputs(
        torch.arange(9), (cos.double()[None, None], sin.double()[None, None]), window=window
    )
    want = ref_mla(layer, x, window)
    expanded = layer(x, inputs, absorb=False)
    absorbed = layer(x, inputs, absorb=True)
    torch.testing.assert_close(expanded, want, **TOL[torch.float64])
    torch.testing.assert_close(absorbed, want, **TOL[torch.float64])
    # gradients reach the latent projections through both forms
    layer(x, inputs, absorb=True).sum().backward()
    assert layer.W_dkv.weight.grad.abs().sum() > 0 and layer.W_ukv.weight.grad.abs().sum() > 0


def test_cache_holds_the_compressed_latent_only():
    cfg = GPTConfig(
        vocab_size=40, context_length=32, emb_dim=32, n_layers=2, n_heads=4, rope=True,
        mla_kv_rank=12, mla_rope_dim=4,
    )  # fmt: skip
    model = GPT(cfg).eval()
    model.setup_cache(3, 20)
    for cache in model.caches:
        assert isinstance(cache, KVCache)
        assert cache.k_cache.shape == (3, 1, 20, 12 + 4) and cache.v_cache is None
        assert cache.nbytes() == 3 * 20 * (12 + 4) * 4
    mha_bytes = 3 * 20 * 2 * 4 * 8 * 4  # (b, L, k and v, heads, head_dim, fp32)
    assert cache.nbytes() < mha_bytes / 3
    # the decode path reads the latents: the output equals the uncached (expanded) forward
    tokens = torch.randint(0, 40, (3, 20))
    with torch.no_grad():
        steps = [model(tokens[:, :7], input_pos=torch.arange(7))]
        steps += [model(tokens[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(7, 20)]
        model.delete_cache()
        full = model(tokens)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
