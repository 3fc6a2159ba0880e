"""attnkit.models.plan reads a Layout, not the model: a hand-made Layout plans a forward
exactly as the model's own does."""

from __future__ import annotations

import pytest
import torch

from attnkit.models import GPT, GPTConfig
from attnkit.models.plan import Layout, build_plan, check_inputs, plan_forward
from attnkit.rope import RotaryEmbedding


def _layout(**kw) -> Layout:
    base = dict(vocab_size=50, context_length=16, caches=None, streaming=None,
                rope=RotaryEmbedding(8, 16, 10000.0), windows=[None, 4])  # fmt: skip
    return Layout(**{**base, **kw})


def test_a_layout_alone_plans_a_forward():
    layout = _layout()
    idx = torch.randint(0, 50, (2, 6))
    plan = plan_forward(layout, idx, None, None)
    assert plan.positions.tolist() == [list(range(6))]
    assert len(plan.inputs) == 2 and plan.inputs[1].window == 4 and plan.inputs[0].causal
    cos, sin = plan.inputs[0].rope
    assert torch.equal(cos[0, 0], layout.rope.cos[:6]) and torch.equal(
        sin[0, 0], layout.rope.sin[:6]
    )  # the table's rows, looked up once
    with pytest.raises(ValueError, match="17 tokens exceed context_length=16"):
        check_inputs(layout, torch.zeros(1, 17, dtype=torch.long), None, None)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\)"):
        check_inputs(layout, torch.full((1, 3), 50), None, None)


def test_the_models_layout_is_what_it_plans_with():
    cfg = GPTConfig(vocab_size=40, context_length=12, emb_dim=16, n_heads=2, n_layers=2,
                    rope=True, layer_windows=[None, 3])  # fmt: skip
    model = GPT(cfg).eval()
    layout = model.layout()
    assert (layout.vocab_size, layout.context_length) == (40, 12)
    assert list(layout.windows) == [None, 3] and layout.rope is model.rope
    assert layout.caches is None and layout.streaming is None
    model.setup_cache(1, 12)
    cached = model.layout()
    assert cached.caches is not None and len(cached.caches) == 2
    pos = torch.arange(5)
    mine = build_plan(cached, pos, None)
    assert torch.equal(mine.positions, pos[None])
