"""attnkit.viz.record: a model's attention, queries and keys and next-token tree, recorded
through attnkit's backend, checked against float64 math written here from the weights.

Every model is a tiny random one built from a config: nothing is downloaded.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from attnkit import viz
from attnkit.models import GPT, GPTConfig
from attnkit.viz.record import MAX_NODES, neuron

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

IDS = [5, 17, 3, 44, 9, 71, 23, 8, 60, 2, 31]  # 11 tokens: odd on purpose


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=97, n_embd=48, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # sharper attention than the tiny init's near-uniform one
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(8.0)
    return model


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


def _hidden(model, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """Each layer's input, from transformers' own eager run."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states  # (1, t, d) per layer + final


def _softmax_causal(scores: torch.Tensor) -> torch.Tensor:
    t = scores.shape[-1]
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


@torch.no_grad()
def gpt2_reference(model, ids: list[int], dtype: torch.dtype) -> list[tuple]:
    """Per layer (q, k, weights), ``(h, t, d)`` / ``(h, t, t)``, by plain math in ``dtype``."""
    cfg = model.config
    h, d = cfg.n_head, cfg.n_embd // cfg.n_head
    out = []
    for layer, x in zip(model.transformer.h, _hidden(model, ids), strict=False):
        x = x[0].to(dtype)  # (t, d_model)
        ln = layer.ln_1
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        x = (x - mu) / torch.sqrt(var + ln.eps) * ln.weight.to(dtype) + ln.bias.to(dtype)
        qkv = x @ layer.attn.c_attn.weight.to(dtype) + layer.attn.c_attn.bias.to(dtype)  # Conv1D
        q, k, _ = qkv.split(cfg.n_embd, dim=-1)
        q = q.view(-1, h, d).transpose(0, 1)  # (h, t, d)
        k = k.view(-1, h, d).transpose(0, 1)
        out.append((q, k, _softmax_causal(q @ k.transpose(-2, -1) / math.sqrt(d))))
    return out


@torch.no_grad()
def llama_reference(model, ids: list[int], dtype: torch.dtype) -> list[tuple]:
    """Per layer (q, k after RoPE, weights) by plain math: RMSNorm, projections, RoPE, GQA."""
    cfg = model.config
    h, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // h
    theta = cfg.rope_parameters["rope_theta"]
    t = len(ids)
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None]  # (t, d/2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)  # (t, d)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)

    def rope(x: torch.Tensor) -> torch.Tensor:  # (heads, t, d)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    out = []
    for layer, x in zip(model.model.layers, _hidden(model, ids), strict=False):
        x = x[0].to(dtype)
        norm = layer.input_layernorm
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.variance_epsilon)
        x = x * norm.weight.to(dtype)
        attn = layer.self_attn
        q = rope((x @ attn.q_proj.weight.to(dtype).T).view(t, h, d).transpose(0, 1))
        k = rope((x @ attn.k_proj.weight.to(dtype).T).view(t, h_kv, d).transpose(0, 1))
        k = k.repeat_interleave(h // h_kv, dim=0)  # (h, t, d)
        out.append((q, k, _softmax_causal(q @ k.transpose(-2, -1) * d**-0.5)))
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_recording_equals_float64_reference(family):
    """q, k (after RoPE for Llama) and weights recorded through attnkit equal float64 math;
    error at most 2x plain float32 math's. The neuron view's products sum to the score,
    whose softmax over the row is the recorded weight."""
    model, ref = (gpt2(), gpt2_reference) if family == "gpt2" else (llama(), llama_reference)
    rec = viz.record_hf(model, IDS, qk=True)
    assert rec.rope is (family == "llama")
    exact, plain = ref(model, IDS, torch.float64), ref(model, IDS, torch.float32)
    assert rec.queries is not None and rec.keys is not None
    for layer, ((q64, k64, w64), (_, _, w32)) in enumerate(zip(exact, plain, strict=True)):
        torch.testing.assert_close(rec.queries[layer].double(), q64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rec.keys[layer].double(), k64, rtol=1e-5, atol=1e-5)
        ours = (rec.maps.weights[layer].double() - w64).abs().max().item()
        base = (w32.double() - w64).abs().max().item()
        assert ours <= 2 * base + 1e-6, (layer, ours, base)
        assert w64.max() > 0.3  # the test sees a peaked attention, not a uniform one
    t = len(IDS)
    for layer, head, query in [(0, 0, t - 1), (1, 3, 6), (1, 1, 0)]:
        scores = []
        for key in range(query + 1):
            n = neuron(rec, layer, head, query, key)
            assert n.dot == pytest.approx(float(n.products.sum()), abs=1e-12)
            assert n.score == pytest.approx(n.scale * n.dot, abs=1e-12)
            q64, k64, _ = exact[layer]
            assert n.score == pytest.approx(
                float(q64[head, query] @ k64[head, key]) * n.scale, abs=1e-4
            )
            scores.append(n.score)
        weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
        recorded = rec.maps.weights[layer][head, query, : query + 1].double()
        torch.testing.assert_close(recorded, weights, rtol=1e-5, atol=1e-6)


def test_qk_only_when_asked():
    rec = viz.record_hf(gpt2(), IDS[:4])
    assert rec.queries is None and rec.next_token is None
    with pytest.raises(ValueError, match="qk=True"):
        neuron(rec, 0, 0, 0, 0)


def test_sdpa_model_still_records():
    """A model loaded the default way (SDPA, where outputs.attentions is None) records
    through attnkit, and keeps SDPA afterwards."""
    model = gpt2()
    model.set_attn_implementation("sdpa")
    rec = viz.record_hf(model, IDS[:5])
    assert model.config._attn_implementation == "sdpa"
    assert len(rec.maps.weights) == 2 and rec.maps.weights[0].shape == (4, 5, 5)
    torch.testing.assert_close(rec.maps.weights[1].sum(-1), torch.ones(4, 5))


def test_next_token_tree_matches_fresh_forwards():
    model = gpt2()
    ids = IDS[:5]
    rec = viz.record_hf(model, ids, steps=2, branch=2, top=6)
    root = rec.next_token
    assert root is not None and root.count() == 1 + 2 + 4
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits, 6)
    assert root.top_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(root.top_logits), top.values, rtol=1e-5, atol=1e-5)
    child = root.children[1]
    assert child.token == root.top_ids[1]
    fresh = viz.record_hf(model, [*ids, child.token])
    rows = torch.stack([w[:, -1] for w in fresh.maps.weights])  # (l, h, t)
    torch.testing.assert_close(child.rows, rows)
    assert child.rows.shape == (2, 4, 6) and child.children[0].rows.shape == (2, 4, 7)


def test_record_gpt_rope_neuron_and_tree():
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=97, emb_dim=32, n_heads=4, n_kv_heads=2, rope=True)).eval()
    rec = viz.record_gpt(
        model, IDS[:6], qk=True, steps=1, branch=2, top=5, decode=lambda i: f"<{i}>"
    )
    assert rec.rope and rec.maps.tokens[0] == "<5>" and rec.queries[0].shape == (4, 6, 8)
    scores = torch.tensor([neuron(rec, 1, 2, 5, k).score for k in range(6)], dtype=torch.float64)
    torch.testing.assert_close(
        rec.maps.weights[1][2, 5].double(), torch.softmax(scores, 0), rtol=1e-5, atol=1e-6
    )
    with torch.no_grad():
        logits = model(torch.tensor([IDS[:6]]))[0, -1]
    assert rec.next_token.top_ids == torch.topk(logits, 5).indices.tolist()
    assert [c.label for c in rec.next_token.children] == [
        f"<{i}>" for i in rec.next_token.top_ids[:2]
    ]


def test_bad_arguments_are_named():
    model = gpt2()
    with pytest.raises(ValueError, match="budget"):
        viz.record_hf(model, IDS[:3], steps=9, branch=3)
    assert MAX_NODES < 3**9
    with pytest.raises(ValueError, match="branch"):
        viz.record_hf(model, IDS[:3], steps=1, branch=5, top=4)
    with pytest.raises(TypeError, match="qk"):
        viz.record_hf(model, IDS[:3], qk=1)
    with pytest.raises(ValueError, match="input_ids"):
        viz.record_hf(model, torch.rand(3))
    with pytest.raises(ValueError, match="2 tokens for 3"):
        viz.record_hf(model, IDS[:3], tokens=["a", "b"])
    rec = viz.record_hf(model, IDS[:3], qk=True)
    with pytest.raises(ValueError, match="key 3 out of range"):
        neuron(rec, 0, 0, 0, 3)
    with pytest.raises(TypeError, match="GPT"):
        viz.record_gpt(model, IDS[:3])
