"""Weights in and out: torch.nn.MultiheadAttention both ways, and the seed notebook's names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnkit import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    load_seed_state_dict,
)
from attnkit.examples import YOUR_JOURNEY
from attnkit.models import CausalSelfAttention, MultiHeadLatentAttention
from attnkit.modules import from_torch_mha, to_torch_mha

F32 = dict(atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_matches_outputs(bias):
    theirs = nn.MultiheadAttention(16, 4, bias=bias, batch_first=True).eval()
    ours = from_torch_mha(theirs, context_length=32).eval()
    x = torch.randn(3, 10, 16)
    ref, _ = theirs(x, x, x, need_weights=False)
    torch.testing.assert_close(ours(x, causal=False), ref, **F32)
    # causal: torch's mask polarity is True = masked out
    tri = torch.ones(10, 10, dtype=torch.bool).triu(1)
    ref, _ = theirs(x, x, x, attn_mask=tri, need_weights=False)
    torch.testing.assert_close(ours(x), ref, **F32)


def test_to_torch_round_trip():
    torch.manual_seed(0)
    ours = MultiHeadAttention(16, 16, 32, 0.0, 4, qkv_bias=True).eval()
    theirs = to_torch_mha(ours).eval()
    assert theirs.batch_first
    x = torch.randn(2, 9, 16)
    ref, w = theirs(x, x, x, attn_mask=torch.ones(9, 9, dtype=torch.bool).triu(1))
    out, our_w = ours(x, need_weights=True)
    torch.testing.assert_close(out, ref, **F32)
    torch.testing.assert_close(our_w.mean(1), w, **F32)  # torch averages heads by default
    back = from_torch_mha(theirs, context_length=32)
    for (n1, p1), (n2, p2) in zip(
        ours.state_dict().items(), back.state_dict().items(), strict=True
    ):
        assert n1 == n2
        torch.testing.assert_close(p1, p2)


def test_to_torch_without_qkv_bias_and_cross_attention():
    ours = MultiHeadAttention(8, 8, 16, 0.0, 2).eval()
    theirs = to_torch_mha(ours).eval()
    x, enc = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    ref, _ = theirs(x, enc, enc, need_weights=False)
    torch.testing.assert_close(ours(x, enc), ref, **F32)


def test_interop_errors():
    with pytest.raises(ValueError, match=r"kdim \(5\) and vdim \(5\) must equal embed_dim \(8\)"):
        from_torch_mha(nn.MultiheadAttention(8, 2, kdim=5, vdim=5), context_length=4)
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch_mha(nn.MultiheadAttention(8, 2, add_bias_kv=True), context_length=4)
    with pytest.raises(TypeError, match="nn.MultiheadAttention"):
        from_torch_mha(nn.Linear(2, 2), context_length=4)
    with pytest.raises(ValueError, match="d_in == d_out"):
        to_torch_mha(MultiHeadAttention(3, 4, 6, 0.0, 2))


def test_to_torch_refuses_what_torch_cannot_compute():
    """GQA/MQA and the LLM layers (RoPE, windows, sinks, MLA) are refused, never approximated."""
    with pytest.raises(ValueError, match="no GQA/MQA: got num_kv_heads=2, num_heads=4"):
        to_torch_mha(MultiHeadAttention(16, 16, 24, 0.0, 4, num_kv_heads=2))
    with pytest.raises(ValueError, match="no GQA/MQA: got num_kv_heads=1"):
        to_torch_mha(MultiHeadAttention(16, 16, 24, 0.0, 4, num_kv_heads=1))
    llm = CausalSelfAttention(16, 16, num_heads=4, window=4)
    with pytest.raises(TypeError, match="converts attnkit.MultiHeadAttention only, got Causal"):
        to_torch_mha(llm)
    mla = MultiHeadLatentAttention(16, 16, num_heads=4, kv_rank=8, rope_dim=4)
    with pytest.raises(TypeError, match="got MultiHeadLatentAttention"):
        to_torch_mha(mla)
    with pytest.raises(TypeError, match="got Linear"):
        to_torch_mha(nn.Linear(2, 2))


def test_interop_and_multihead_import_one_way():
    import ast
    import inspect

    from attnkit.modules import multihead

    tree = ast.parse(inspect.getsource(multihead))
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "attnkit.modules.interop" not in imported
    assert not hasattr(MultiHeadAttention, "to_torch") and not hasattr(MultiHeadAttention, "rope")


# --- the seed notebook's classes, written here independently, to produce its state dicts ---
class NotebookMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.h, self.d_out = num_heads, d_out
        self.query = nn.Linear(d_in, d_out, bias=False)
        self.key = nn.Linear(d_in, d_out, bias=False)
        self.value = nn.Linear(d_in, d_out, bias=False)
        self.output = nn.Linear(d_out, d_out, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), 1))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            f(x).view(b, t, self.h, -1).transpose(1, 2) for f in (self.query, self.key, self.value)
        )
        s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        w = torch.softmax(s / k.shape[-1] ** 0.5, -1)
        return self.output((w @ v).transpose(1, 2).reshape(b, t, self.d_out))


class NotebookCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.query = nn.Linear(d_in, d_out, bias=False)
        self.key = nn.Linear(d_in, d_out, bias=False)
        self.value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), 1))


def test_load_notebook_multihead_state_dict():
    x = torch.stack([YOUR_JOURNEY.tensor()] * 2)
    torch.manual_seed(42)
    nb = NotebookMHA(3, 2, 6, 2)
    ours = MultiHeadAttention(3, 2, 6, 0.0, 2)
    load_seed_state_dict(ours, nb.state_dict())
    torch.testing.assert_close(ours(x), nb(x), **F32)
    # the notebook printed these with torch.manual_seed(42)
    torch.testing.assert_close(
        ours(x)[0, :2].detach(),
        torch.tensor([[-0.1268, -0.1532], [-0.1070, -0.1730]]),
        atol=6e-5,
        rtol=0,
    )


def test_load_notebook_names_into_wrapper_heads():
    nb_heads = [NotebookCausal(3, 2, 6) for _ in range(2)]
    sd = {f"heads.{i}.{k}": v for i, h in enumerate(nb_heads) for k, v in h.state_dict().items()}
    wrapper = MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2)
    load_seed_state_dict(wrapper, sd)
    torch.testing.assert_close(wrapper.heads[1].W_key.weight, nb_heads[1].key.weight)


def test_load_book_state_dict_with_mask_buffer():
    book_sd = dict(CausalAttention(3, 2, 6, 0.0).state_dict())
    book_sd["mask"] = torch.triu(torch.ones(6, 6), 1)  # the book registers this buffer
    target = CausalAttention(3, 2, 6, 0.0)
    load_seed_state_dict(target, book_sd)
    torch.testing.assert_close(target.W_value.weight, book_sd["W_value.weight"])
