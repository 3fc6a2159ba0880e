"""Training data, the loop (loss goes down on copy) and checkpoints."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from attnkit.models import GPT, GPTConfig
from attnkit.train import (
    CheckpointError,
    TaskData,
    TextData,
    load_checkpoint,
    save_checkpoint,
    train,
)
from attnkit.train.data import IGNORE
from attnkit.train.loop import Schedule


@pytest.mark.parametrize("task", ["copy", "reverse", "sort", "recall"])
def test_task_answers_are_right(task):
    data = TaskData(task, 5)
    tok = data.tokenizer
    for row in data.sample(20, torch.Generator().manual_seed(0)).tolist():
        q, a = tok.decode(row).split(">")
        if task == "recall":
            pairs, key = q.split("?")
            assert dict(zip(pairs[::2], pairs[1::2], strict=True))[key] == a
        else:
            expected = {"copy": q, "reverse": q[::-1], "sort": "".join(sorted(q))}[task]
            assert a == expected


def test_only_answers_are_scored():
    data = TaskData("reverse", 4)
    inputs, targets = data.batch(3)
    assert inputs.shape == targets.shape == (3, 8)
    assert (targets[:, :4] == IGNORE).all() and (targets[:, 4:] != IGNORE).all()


def test_copy_loss_goes_down():
    torch.manual_seed(0)
    data = TaskData("copy", 4)
    model = GPT(GPTConfig.preset("tiny", vocab_size=22, context_length=data.seq_len))
    g = torch.Generator().manual_seed(0)
    losses = train(model, lambda: data.batch(32, g), 120, progress=False)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10


def test_lr_schedule_is_warmup_cosine_through_lambdalr():
    seen: list[float] = []
    data = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    gpt = GPT(GPTConfig(vocab_size=4, context_length=2, emb_dim=8, n_layers=1, n_heads=2))
    opt = torch.optim.AdamW(gpt.parameters(), lr=1.0)
    train(
        gpt,
        lambda: (seen.append(opt.param_groups[0]["lr"]), data)[1],
        100,
        optimizer=opt,
        progress=False,
    )
    expected = [Schedule(100).factor(s) for s in range(1, 101)]
    assert seen == pytest.approx(expected)
    assert seen[0] == pytest.approx(1 / 50 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 100))))
    assert seen[-1] == pytest.approx(0.1)
    # resumed at step 60 with the saved optimizer state: the same rates as without a stop
    resumed: list[float] = []
    opt2 = torch.optim.AdamW(gpt.parameters(), lr=123.0)  # --lr on resume does not matter
    opt2.load_state_dict(opt.state_dict())
    train(
        gpt,
        lambda: (resumed.append(opt2.param_groups[0]["lr"]), data)[1],
        100,
        optimizer=opt2,
        start_step=60,
        schedule=Schedule(100),
        progress=False,
    )
    assert resumed == pytest.approx(expected[60:])


def test_resumed_lr_schedule_does_not_jump_when_steps_grow():
    old = Schedule(100)
    new = old.extended(60, 300)
    assert new.factor(60) == pytest.approx(old.factor(60))  # continuous at the resume point
    steps = [new.factor(s) for s in range(60, 301)]
    assert max(abs(a - b) for a, b in itertools.pairwise(steps)) < 0.01  # no jump
    assert steps[-1] == pytest.approx(0.1)
    assert old.extended(60, 100) is old  # same total: exactly the original curve
    assert Schedule.from_dict(new.to_dict()) == new
    with pytest.raises(ValueError, match="schedule"):
        Schedule.from_dict({"total": "x"})


def test_text_data(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello attention")
    x, y = TextData(f, 8).batch(4)
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        TextData(tmp_path / "e.txt", 8)


def test_checkpoint_round_trip_and_corruption(tmp_path):
    data = TaskData("copy", 3)
    model = GPT(GPTConfig.preset("tiny", vocab_size=22, context_length=data.seq_len, rope=True))
    opt = torch.optim.AdamW(model.parameters())
    train(model, lambda: data.batch(4), 2, optimizer=opt, progress=False)
    save_checkpoint(tmp_path, model, data.tokenizer, optimizer=opt, meta={"step": 2})
    loaded, tok, meta, opt_state = load_checkpoint(tmp_path)
    assert meta["step"] == 2 and tok.symbols == data.tokenizer.symbols
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    opt2 = torch.optim.AdamW(loaded.parameters())
    opt2.load_state_dict(opt_state)
    assert torch.equal(
        opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporaries
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt or mismatched weights|torn checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / "manifest.json").unlink()  # a checkpoint from before manifests
    (tmp_path / "config.json").write_text(json.dumps({"model": {"heads": 3}}))
    with pytest.raises(CheckpointError, match="corrupt checkpoint config"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(tmp_path, require_manifest=True)
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(vocab_size=10**13),
            r"tok_emb.weight \(vocab_size, emb_dim\) would be \(10000000000000",
        ),
        (dict(n_layers=10**9), r"the number of blocks \(n_layers\) would be 1000000000 .* hold 2"),
        (dict(emb_dim=2**20, n_heads=2**10), "tok_emb.weight"),
        (dict(context_length=10**12), r"pos_emb.weight would be \(1000000000000, 64\)"),
        (dict(n_kv_heads=2), r"trf_blocks.0.att.W_key.weight would be \(32, 64\)"),
    ],
)
def test_a_config_asking_for_other_sizes_than_the_weights_is_refused_before_allocating(
    tmp_path, change, match
):
    # an old checkpoint (no manifest) whose config.json asks for an absurd model: refused from
    # the safetensors header, not an allocator traceback (or an hour of allocating)
    model = GPT(GPTConfig.preset("tiny", vocab_size=22, context_length=8))
    save_checkpoint(tmp_path, model, TaskData("copy", 3).tokenizer)
    (tmp_path / "manifest.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"does not match model.safetensors: {match}"):
        load_checkpoint(tmp_path)


def test_a_config_too_large_to_allocate_is_one_checkpoint_error(tmp_path):
    # with RoPE the context length is in no weight: its table cannot be allocated
    model = GPT(GPTConfig.preset("tiny", vocab_size=22, context_length=8, rope=True))
    save_checkpoint(tmp_path, model, TaskData("copy", 3).tokenizer)
    (tmp_path / "manifest.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"]["context_length"] = 10**15
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="asks for a model that cannot be allocated") as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value)


def test_attention_maps_of_trained_gpt_use_viz(tmp_path):
    """The GPT's maps are attnkit.viz AttentionMaps (the duplicate heatmap code is gone)."""
    from attnkit import viz
    from attnkit.train import plots

    model = GPT(GPTConfig(vocab_size=20, context_length=8, emb_dim=16, n_layers=2, n_heads=2))
    idx = torch.randint(0, 20, (6,))
    labels = list("abcdef")
    maps = plots.attention_maps(model, idx, labels)
    assert isinstance(maps, viz.AttentionMaps) and maps.names == ["layer 0", "layer 1"]
    for w in maps.weights:  # (heads, t, t): causal rows that sum to one
        assert w.shape == (2, 6, 6)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 6))
        assert torch.equal(w.triu(1), torch.zeros_like(w))
    paths = plots.plot_attention_maps(model, idx, labels, tmp_path)
    assert [p.name for p in paths] == ["layer0.png", "layer1.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    with pytest.raises(ValueError, match="5 labels for 6 tokens"):
        plots.attention_maps(model, idx, labels[:5])
