"""Recording intermediates with attnkit.trace."""

from __future__ import annotations

import torch

from attnkit import MultiHeadAttention, MultiHeadAttentionWrapper, trace


def test_records_every_step_with_shapes():
    mha = MultiHeadAttention(3, 4, 6, 0.0, num_heads=2)
    x = torch.rand(2, 6, 3)
    with torch.no_grad(), trace.record() as rec:
        out = mha(x)
    assert list(rec) == [
        "inputs",
        "queries",
        "keys",
        "values",
        "scores",
        "scaled_scores",
        "masked_scores",
        "weights",
        "context",
        "concat",
        "output",
    ]
    assert rec.shapes()["weights"] == (2, 2, 6, 6)
    torch.testing.assert_close(rec["output"], out)
    torch.testing.assert_close(rec["scaled_scores"], rec["scores"] / 2**0.5)
    upper = torch.ones(6, 6, dtype=torch.bool).triu(1)
    assert (rec["masked_scores"][..., upper] == float("-inf")).all()
    assert torch.isfinite(rec["masked_scores"][..., ~upper]).all()


def test_scopes_name_each_head():
    with trace.record() as rec:
        MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(torch.rand(6, 3))
    assert "heads.0.weights" in rec and "heads.1.context" in rec and "concat" in rec


def test_nothing_recorded_outside_block():
    with trace.record() as rec:
        pass
    MultiHeadAttention(3, 4, 6, 0.0, 2)(torch.rand(6, 3))
    assert len(rec) == 0 and not trace.is_recording()


def test_dropout_weights_recorded():
    m = MultiHeadAttention(3, 4, 6, 0.5, 2)
    with trace.record() as rec:
        m(torch.rand(6, 3))
    assert "dropped_weights" in rec
