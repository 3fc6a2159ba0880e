"""CausalSelfAttention: with everything handed in, it equals a float64 reference; a mask
built by the model equals the causal/window flags it replaces."""

from __future__ import annotations

import pytest
import torch

from attnkit.models import AttentionInputs, CausalSelfAttention
from attnkit.models.plan import keep_mask
from attnkit.rope import rope_values
from tests.conftest import TOL
from tests.reference import ref_attention
from tests.test_mla import ref_rotate


@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("rope", [False, True])
def test_layer_equals_float64_reference(window, kv_heads, rope):
    layer = CausalSelfAttention(
        12, 16, num_heads=4, num_kv_heads=kv_heads, qkv_bias=True, window=window
    ).double()
    b, t, d = 2, 11, 4
    x = torch.randn(b, t, 12, dtype=torch.float64)
    pos = torch.arange(t)
    cos, sin = rope_values(pos, d, dtype=torch.float64)
    rope_in = (cos.double()[None, None], sin.double()[None, None]) if rope else None
    flags = AttentionInputs(pos, rope_in, window=window)
    masked = AttentionInputs(pos, rope_in, mask=keep_mask(pos, pos, window=window), causal=False)
    q = layer.W_query(x).view(b, t, 4, d).transpose(1, 2)
    k = layer.W_key(x).view(b, t, kv_heads, d).transpose(1, 2)
    v = layer.W_value(x).view(b, t, kv_heads, d).transpose(1, 2)
    if rope:
        q, k = ref_rotate(q, pos), ref_rotate(k, pos)
    keep = torch.tensor(
        [[j <= i and (window is None or i - j < window) for j in range(t)] for i in range(t)]
    )
    ctx, _ = ref_attention(q, k, v, mask=keep)
    want = layer.out_proj(ctx.transpose(1, 2).reshape(b, t, 16))
    torch.testing.assert_close(layer(x, flags), want, **TOL[torch.float64])
    torch.testing.assert_close(layer(x, masked), want, **TOL[torch.float64])


def test_keep_mask_rules():
    q, k = torch.tensor([5, 6]), torch.tensor([0, 1, -1, 3, 4, 5, 6])
    got = keep_mask(q, k, window=3, sink_tokens=2)[0, 0]
    want = torch.tensor(
        [[j >= 0 and j <= i and (i - j < 3 or j < 2) for j in k.tolist()] for i in q.tolist()]
    )
    assert torch.equal(got, want)
    real = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1] * 7]).bool()
    padded = keep_mask(q, k, window=None, key_real=real)
    assert padded.shape == (2, 1, 2, 7) and not padded[0, 0, :, 0].any() and padded[1, 0, 1, 0]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads"):
        CausalSelfAttention(8, 8, num_heads=4, num_kv_heads=3)
    with pytest.raises(TypeError, match="num_heads must be an int"):
        CausalSelfAttention(8, 8, num_heads=True)
    with pytest.raises(ValueError, match="window must be >= 1"):
        CausalSelfAttention(8, 8, num_heads=2, window=0)
    with pytest.raises(ValueError, match="nope"):
        CausalSelfAttention(8, 8, num_heads=2, backend="nope")


def test_learned_sinks_equal_float64_reference_and_get_gradients():
    """gpt-oss sinks: each row normalises over its keys plus exp(sink[h]), dropped after."""
    layer = CausalSelfAttention(8, 8, num_heads=2, num_kv_heads=1, sinks=True).double()
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([0.5, -1.0], dtype=torch.float64))
    b, t, d = 2, 6, 4
    x = torch.randn(b, t, 8, dtype=torch.float64)
    pos = torch.arange(t)
    out = layer(x, AttentionInputs(pos, window=3))
    q = layer.W_query(x).view(b, t, 2, d).transpose(1, 2)
    k = layer.W_key(x).view(b, t, 1, d).transpose(1, 2).expand(b, 2, t, d)
    v = layer.W_value(x).view(b, t, 1, d).transpose(1, 2).expand(b, 2, t, d)
    ctx = torch.zeros(b, 2, t, d, dtype=torch.float64)
    for h in range(2):
        for i in range(t):
            keys = [j for j in range(t) if j <= i and i - j < 3]
            s = torch.stack([(q[:, h, i] * k[:, h, j]).sum(-1) / d**0.5 for j in keys], -1)
            e = torch.exp(s)
            w = e / (e.sum(-1, keepdim=True) + torch.exp(layer.sinks[h]))
            ctx[:, h, i] = sum(w[:, n, None] * v[:, h, j] for n, j in enumerate(keys))
    want = layer.out_proj(ctx.transpose(1, 2).reshape(b, t, 8))
    torch.testing.assert_close(out, want, **TOL[torch.float64])
    out.sum().backward()
    assert layer.sinks.grad is not None and layer.sinks.grad.abs().min() > 0
