"""The GPT: presets, cached generation equals uncached, HF GPT-2 weight mapping."""

from __future__ import annotations

import pytest
import torch

from attnkit.models import GPT, GPTConfig

VARIANTS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "rope": dict(rope=True),
    "window": dict(window=5),
}


def small(**kw) -> GPT:
    return GPT(GPTConfig(vocab_size=40, context_length=32, emb_dim=32, n_layers=2, n_heads=4, **kw))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_generation_equals_uncached(name):
    model = small(**VARIANTS[name]).eval()
    prompt = torch.randint(0, 40, (2, 6))
    cached = model.generate(prompt, 20, temperature=0, use_cache=True)
    uncached = model.generate(prompt, 20, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    with torch.no_grad():  # logits of every position, recomputed vs decoded one by one
        full = model(cached)
        model.setup_cache(2)
        steps = [model(cached[:, :6])] + [model(cached[:, i : i + 1]) for i in range(6, 26)]
        model.delete_cache()
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_generate_output_and_cache_work_outside_inference_mode():
    # generate decodes under torch.inference_mode; what it leaves behind must not be
    # inference tensors: the ids feed a training step, a cache set up before goes on.
    model = small()
    prompt = torch.randint(0, 40, (2, 5))
    out = model.generate(prompt, 4, temperature=0)
    assert not out.is_inference()
    model(out).sum().backward()  # embedding saves the ids for backward
    assert model.tok_emb.weight.grad is not None and model.training
    model.eval()
    model.setup_cache(2)
    model.generate(prompt, 3, temperature=0)
    with torch.no_grad():
        model.reset_cache()
        first = model(prompt)  # the cache buffers can be written outside inference mode
    model.delete_cache()
    with torch.no_grad():
        torch.testing.assert_close(first, model(prompt), atol=1e-6, rtol=1e-6)


def test_sampling_is_seeded_and_respects_top_k():
    model = small().eval()
    prompt = torch.randint(0, 40, (1, 4))
    a = model.generate(prompt, 10, top_k=3, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 10, top_k=3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (1, 14)
    with torch.no_grad():
        logits = model(a[:, :-1])[0, 3:]  # (10, vocab): the logits each new token came from
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == a[0, 4:, None]).any(dim=-1).all()


def test_presets():
    cfg = GPTConfig.preset("gpt2-small")
    assert (cfg.n_layers, cfg.n_heads, cfg.emb_dim, cfg.context_length, cfg.vocab_size) == (
        12,
        12,
        768,
        1024,
        50257,
    )
    assert GPTConfig.preset("tiny", vocab_size=10).vocab_size == 10
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'; valid: tiny, gpt2-small"):
        GPTConfig.preset("huge")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_heads=5), r"emb_dim \(64\) must be divisible by n_heads \(5\)"),
        (dict(n_kv_heads=3), r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        (dict(window=0), "window must be a positive int"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kw)


def test_generate_errors():
    model = small()
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_new_tokens \(5\) exceeds"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="token ids must be in"):
        model(torch.full((1, 3), 40))


def test_hf_gpt2_mapping_round_trip():
    transformers = pytest.importorskip("transformers")
    from attnkit.models.hf_gpt2 import (
        config_from_hf,
        export_hf_gpt2_state_dict,
        load_hf_gpt2_state_dict,
    )

    hf_cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=False
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    model = load_hf_gpt2_state_dict(GPT(config_from_hf(hf_cfg)), hf.state_dict()).eval()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-5, rtol=1e-5)
    exported = export_hf_gpt2_state_dict(model)
    for k, v in exported.items():
        torch.testing.assert_close(v, hf.state_dict()[k])
    with pytest.raises(ValueError, match="GPT-2 has learned positions"):
        export_hf_gpt2_state_dict(small(rope=True))
