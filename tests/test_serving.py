"""Continuous batching (attnkit.models.serving.Server) and GPT generation on a paged
cache: every request gets exactly the tokens it gets decoded alone (greedy), requests
join and leave between steps, prompts prefill in chunks beside running decodes, and no
sequence reads another's pages; the ``attnkit serve`` demo."""

from __future__ import annotations

import pytest
import torch

from attnkit.cli import main
from attnkit.models import GPT, GPTConfig
from attnkit.models.serving import Server


def _model(dtype=torch.float64, **overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", **overrides)).to(dtype).eval()


def _prompts(lengths, vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # learned positions, MHA
        dict(rope=True, n_kv_heads=2, window=12, global_every=2),  # RoPE, GQA, local layers
        dict(rope=True, attn_sinks=True),  # learned sinks
    ],
)
def test_each_request_gets_the_tokens_it_gets_alone(overrides):
    model = _model(**overrides)
    lengths, news = [5, 30, 1, 17, 9], [6, 3, 9, 4, 1]
    prompts = _prompts(lengths)
    server = Server(model, page_size=4, max_batch=3, prefill_chunk=8, max_step_tokens=20)
    ids = [server.submit(p, n) for p, n in zip(prompts, news, strict=True)]
    joined_late = False
    while server.pending:
        before = set(server.running)
        server.step()
        joined_late |= bool(set(server.running) - before) and bool(before)
    assert joined_late  # requests joined while others were running
    for rid, p, n in zip(ids, prompts, news, strict=True):
        alone = model.generate(torch.tensor([p]), n, pack_weights=False)[0].tolist()
        assert server.result(rid) == alone, rid
    assert server.cache.num_free_pages == server.cache.num_pages  # every page came back


def test_float32_on_the_native_kernel_gives_the_same_tokens():
    model = _model(torch.float32, rope=True)
    prompts = _prompts([3, 50, 21, 8], seed=1)
    server = Server(model, page_size=16, max_batch=4, prefill_chunk=16)
    ids = [server.submit(p, 12) for p in prompts]
    server.run()
    for rid, p in zip(ids, prompts, strict=True):
        assert server.result(rid) == model.generate(torch.tensor([p]), 12)[0].tolist()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_no_sequence_reads_pages_it_did_not_write(dtype):
    """The pool starts full of NaN: a key read from a page a sequence never wrote (another
    request's, a freed one, a page's unwritten tail) would turn its logits to NaN (float32:
    the native kernel, decode tokens in one call; float64: the gathered path)."""
    model = _model(dtype)
    server = Server(model, page_size=5, max_batch=2, prefill_chunk=4)
    server.cache.k_pages.fill_(float("nan"))
    server.cache.v_pages.fill_(float("nan"))
    prompts = _prompts([7, 2, 13], seed=2)
    ids = [server.submit(p, 6) for p in prompts]
    server.run()
    for rid, p in zip(ids, prompts, strict=True):
        assert server.result(rid) == model.generate(torch.tensor([p]), 6)[0].tolist()


def test_prompts_prefill_in_chunks_beside_running_decodes():
    model = _model()
    server = Server(model, page_size=4, max_batch=2, prefill_chunk=4)
    first = server.submit(_prompts([2])[0], 8)
    server.step()  # the first request's prompt; it decodes from now on
    second = server.submit(_prompts([13], seed=3)[0], 2)
    got = [server.step() for _ in range(4)]  # 13 tokens of prompt: 4 steps of 4
    assert all(first in g for g in got)  # the first request decoded every step
    assert [second in g for g in got] == [False, False, False, True]
    server.run()
    assert server.done(first) and server.done(second)


def test_eos_and_errors():
    model = _model()
    prompt = _prompts([6])[0]
    alone = model.generate(torch.tensor([prompt]), 5)[0].tolist()
    server = Server(model, page_size=4, eos_id=alone[7])
    rid = server.submit(prompt, 5)
    server.run()
    assert server.result(rid) == alone[:8]  # stopped at (and kept) the eos token
    with pytest.raises(ValueError, match="no request with id 99"):
        server.result(99)
    rid = server.submit(prompt, 3)
    with pytest.raises(ValueError, match=f"request {rid} is not finished"):
        server.result(rid)
    with pytest.raises(ValueError, match=r"must be in \[0, 256\), got 300"):
        server.submit([1, 300], 2)
    with pytest.raises(TypeError, match="prompt_ids must hold ints"):
        server.submit([1, True], 2)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        server.submit([], 2)
    with pytest.raises(ValueError, match="exceeds context_length"):
        server.submit(prompt, 64)
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        server.submit(prompt, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be an attnkit.models.GPT"):
        Server(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_generate_on_a_paged_cache_equals_the_contiguous_cache(dtype):
    model = _model(dtype, rope=True, n_kv_heads=2)
    idx = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    want = model.generate(idx, 6, attention_mask=mask)
    assert torch.equal(model.generate(idx, 6, attention_mask=mask, page_size=4), want)
    assert torch.equal(model.generate(idx, 6, attention_mask=mask, page_size=64), want)
    with pytest.raises(ValueError, match="page_size .* needs use_cache=True"):
        model.generate(idx, 2, page_size=4, use_cache=False)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        model.generate(idx, 2, page_size=0)


def test_serve_demo_cli(capsys):
    argv = ["serve", "--demo", "--requests", "3", "--max-new-tokens", "3", "--max-batch", "2"]
    code = main([*argv, "--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "joined" in out and "finished" in out
    assert "check: 3 of 3 requests got the tokens they get alone" in out
    assert main(["serve"]) == 2
    assert "DIR with --prompt (or --prompts-file), or --demo" in capsys.readouterr().err
    assert main(["serve", "--demo", "--page-size", "0"]) == 2
    assert "--page-size must be >= 1, got 0" in capsys.readouterr().err


def test_a_paged_model_says_how_to_run_it():
    model = _model()
    cache = model.setup_paged_cache(8, 4)
    assert cache.num_layers == model.cfg.n_layers and cache.num_pages == 8
    with pytest.raises(ValueError, match=r"cache is paged .*paged=cache.batch"):
        model(torch.tensor([[1, 2]]), input_pos=torch.arange(2))
    model.delete_cache()
    with pytest.raises(ValueError, match="latent attention"):
        _model(mla_kv_rank=16, rope=True).setup_paged_cache(8, 4)


def test_the_serving_bench_runs_its_decode_step():
    from attnkit.bench import serving as bench

    row = bench.paged_decode(length=100, page_size=16, reps=2)
    assert row["max_abs_diff"] < 1e-5 and row["ratio"] > 0
    q1, q3 = row["quartiles"]  # the median of the per-round ratios, with its quartiles
    assert q1 <= row["ratio"] <= q3 and row["ratio of medians"] > 0
    assert row["auto_us"] > 0 and row["paged_over_auto"] > 0  # (auto's contiguous step beside)


def test_the_serving_bench_says_what_it_skips_without_transformers(monkeypatch, tmp_path):
    """Without transformers (a bare install) the serving bench still times the paged
    decode step and says in one line which extra the race needs."""
    import importlib.util

    from attnkit.bench import serving as bench

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    result = bench.run(quick=True)
    assert result["continuous_batching"] == {"skipped": bench.NEEDS_HF}
    assert all(row["ratio"] > 0 for row in result["paged_decode"])
    bench.write(result, tmp_path)
    md = (tmp_path / "serving.md").read_text()
    assert "skipped (needs transformers: pip install 'attnkit[hf]')" in md
    assert md.count("| L=512, page 16,") == 2 and "not graded" in md
    assert "| paged / auto |" in md  # (the step over auto's contiguous one, as before)


@pytest.mark.slow
def test_the_serving_bench_races_transformers_on_the_same_weights():
    pytest.importorskip("transformers")
    from attnkit.bench import serving as bench

    result = bench.continuous_batching(2, 3, (4, 8), repeats=1, small=True)
    assert result["identical_requests"] == 2 and result["speedup"] > 0
