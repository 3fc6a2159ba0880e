"""The decode benchmark runs (tiny sizes: a smoke test, not a measurement)."""

from __future__ import annotations

import pytest
import torch

from attnkit.bench.decode import kv_cache_bytes, kv_memory_table, padded_prompts, run
from attnkit.models import GPTConfig


def test_kv_memory_table_has_the_mla_row_and_matches_the_formula():
    table = kv_memory_table("gpt2-small", 4096)
    assert table["MHA"] == 2 * 12 * 4096 * 768 * 4 / 2**20  # 288 MiB
    assert table["GQA-4"] == table["MHA"] / 3 and table["MQA"] == table["MHA"] / 12
    assert table["MLA"] == 12 * 4096 * (256 + 32) * 4 / 2**20  # latent + RoPE key: 54 MiB
    local = GPTConfig.preset("tiny", window=8, global_every=2)
    assert kv_cache_bytes(local, 64) == 64 * 2 * 64 * 4 + 8 * 2 * 64 * 4


def test_padded_prompts_are_left_padded_and_span_the_lengths():
    ids, mask = padded_prompts(5, 3, 9, 50, torch.Generator().manual_seed(0))
    assert ids.shape == (5, 9) and mask.sum(1).tolist()[:2] == [3, 9]
    assert (mask[:, -1] == 1).all() and (ids[mask == 0] == 0).all()


def test_run_smoke():
    pytest.importorskip("transformers")
    res = run("tiny", prompt_len=10, new_tokens=3, batch=3, min_len=4, uncached_tokens=3, repeats=1)
    assert res["b1_hf_tokens_identical"] and res["b3_hf_tokens_identical"]
    assert res["uncached_tokens_identical"]
    assert res["b3_vs_hf"] > 0 and res["b1_profile"]["wall_ms_per_token"] > 0
    assert set(res["kv_cache_MiB_at_4096"]) == {"MHA", "GQA-4", "MQA", "MLA"}
