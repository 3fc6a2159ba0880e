"""KV caches: cached attention equals recomputation (MHA, GQA, MQA, RoPE, window, cross)."""

from __future__ import annotations

import pytest
import torch

from attnkit import MultiHeadAttention
from attnkit.kv_cache import KVCache
from tests.reference import ref_attention

VARIANTS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "rope": dict(rope=True),
    "window": dict(window=4),
    "gqa_rope_window": dict(num_kv_heads=2, rope=True, window=3),
}


def make(**kw) -> MultiHeadAttention:
    return MultiHeadAttention(16, 16, 24, 0.0, 4, qkv_bias=True, **kw).eval()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_token_by_token_and_chunked_prefill_equal_full(name, static):
    mha = make(**VARIANTS[name])
    x = torch.randn(2, 17, 16)
    with torch.no_grad():
        full = mha(x)  # (2, 17, 16)
        mha.setup_cache(2, 20, static=static)
        chunks = [x[:, :5], x[:, 5:11], *(x[:, i : i + 1] for i in range(11, 17))]
        cached = torch.cat([mha(c) for c in chunks], dim=1)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_window_ring_past_wraparound_equals_window_mask_reference():
    """The ring buffer (4 slots) after 3 wrap-arounds equals a dense sliding-window reference."""
    torch.manual_seed(1)
    mha = make(window=4).double()
    x = torch.randn(1, 15, 16, dtype=torch.float64)
    with torch.no_grad():
        mha.setup_cache(1, 15)
        assert mha.kv_cache.k_cache.shape[2] == 4  # only `window` positions are kept
        cached = torch.cat([mha(x[:, i : i + 1]) for i in range(15)], dim=1)
        q = mha.W_query(x).view(1, 15, 4, 4).transpose(1, 2)
        k = mha.W_key(x).view(1, 15, 4, 4).transpose(1, 2)
        v = mha.W_value(x).view(1, 15, 4, 4).transpose(1, 2)
    keep = torch.tensor([[0 <= i - j < 4 for j in range(15)] for i in range(15)])
    ctx = ref_attention(q, k, v, mask=keep)[0].transpose(1, 2).reshape(1, 15, 16)
    torch.testing.assert_close(cached, mha.out_proj(ctx), atol=1e-10, rtol=1e-10)


def test_cross_attention_cache_reuses_encoder_keys():
    mha = MultiHeadAttention(16, 16, 24, 0.0, 4, num_kv_heads=2).eval()
    enc, x = torch.randn(2, 9, 16), torch.randn(2, 6, 16)
    calls = []
    mha.W_key.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        full = mha(x, enc)
        mha.setup_cache(2, cross_attention=True)
        steps = [mha(x[:, :1], enc)] + [mha(x[:, i : i + 1]) for i in range(1, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-6, rtol=1e-6)
    assert len(calls) == 2  # once uncached, once to fill the cache


def test_reset_and_overflow():
    mha = make()
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        mha.setup_cache(1, 6)
        first = mha(x)
        with pytest.raises(ValueError, match="KV cache overflow: writing 1 tokens at position 6"):
            mha(x[:, :1])
        mha.reset_cache()
        assert int(mha.kv_cache.pos) == 0
        torch.testing.assert_close(mha(x), first)


def test_cache_memory_scales_with_kv_heads():
    sizes = [KVCache(1, 1024, h, 64).nbytes() for h in (12, 4, 1)]
    assert sizes == [2 * 12 * 1024 * 64 * 4, 2 * 4 * 1024 * 64 * 4, 2 * 1024 * 64 * 4]
    assert KVCache(1, 1024, 12, 64, window=128).nbytes() == sizes[0] // 8


def test_gqa_projection_shapes_and_reference():
    mha = MultiHeadAttention(8, 8, 10, 0.0, 4, num_kv_heads=2).double()
    assert mha.W_key.weight.shape == (4, 8) and mha.W_value.weight.shape == (4, 8)
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    q = mha.W_query(x).view(3, 7, 4, 2).transpose(1, 2)
    k = mha.W_key(x).view(3, 7, 2, 2).transpose(1, 2)
    v = mha.W_value(x).view(3, 7, 2, 2).transpose(1, 2)
    ctx = ref_attention(q, k, v, causal="bottom_right")[0].transpose(1, 2).reshape(3, 7, 8)
    torch.testing.assert_close(mha(x), mha.out_proj(ctx))


def test_gradients_flow_with_rope_and_window():
    mha = MultiHeadAttention(8, 8, 10, 0.0, 2, rope=True, window=3)
    x = torch.randn(2, 10, 8, requires_grad=True)
    mha(x).square().sum().backward()
    assert torch.isfinite(x.grad).all() and mha.W_key.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_kv_heads=3), r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
        (dict(num_kv_heads=0), "num_kv_heads must be >= 1, got 0"),
        (dict(window=0), "window must be >= 1, got 0"),
    ],
)
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(16, 16, 24, 0.0, 4, **kw)


def test_misuse_errors():
    with pytest.raises(ValueError, match="rope needs an even head_dim, got 3"):
        MultiHeadAttention(6, 6, 8, 0.0, 2, rope=True)
    mha = make()
    with pytest.raises(ValueError, match=r"max_seq_len \(30\) exceeds context_length \(24\)"):
        mha.setup_cache(1, 30)
    with pytest.raises(ValueError, match="self-attention only"):
        make(rope=True)(torch.randn(1, 3, 16), torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="no GQA, rope or window"):
        make(num_kv_heads=2).to_torch()


@pytest.mark.parametrize(
    "kw, name", [(dict(window=True), "window"), (dict(head_dim=True), "head_dim")]
)
def test_kv_cache_refuses_bool_where_an_int_is_meant(kw, name):
    """Regression: KVCache(window=True) was accepted as a window of 1."""
    args = dict(batch_size=1, max_seq_len=8, num_kv_heads=2, head_dim=4) | kw
    with pytest.raises(TypeError, match=rf"{name} must be an int, got bool"):
        KVCache(**args)
