"""attnkit.mod_graph: mods traced into typed expression graphs, the graph evaluated back
equal to the mod (FlexAttention's scalar semantics through vmap), the reasons of what
does not trace, range checks, and the cache."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import masks as M
from attnkit import mod_graph as G
from attnkit.mods import eval_mask_mod, eval_score_mod
from tests.test_mods_catalogue import CATALOGUE

B, H, T = 2, 4, 37


def _grids(t: int = T):
    return (
        torch.arange(B).view(-1, 1, 1, 1),
        torch.arange(H).view(1, -1, 1, 1),
        torch.arange(t).view(1, 1, -1, 1),
        torch.arange(t).view(1, 1, 1, -1),
    )


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue_traces_and_evaluates_like_the_mod(name):
    entry = CATALOGUE[name]
    mod, _ = entry.make()
    t = entry.length
    graph = G.trace(mod, entry.kind)
    assert graph.check(B, H, t, t) is None
    b, h, i, j = _grids(t)
    if entry.kind == "score":
        s = torch.randn(B, H, t, t, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        want = eval_score_mod(mod, s, 0, 0)
        got = graph.evaluate(s, b, h, i, j)
        # (torch computes int-by-Python-float products in float32; the graph in the score dtype)
        torch.testing.assert_close(got.expand_as(want), want, rtol=1e-6, atol=1e-6)
    else:
        want = eval_mask_mod(mod, B, H, 0, t, 0, t, torch.device("cpu"))
        got = graph.evaluate(None, b, h, i, j)
        assert torch.equal(got.expand(B, H, t, t), want.expand(B, H, t, t))


def test_graph_nodes_are_typed_and_topological():
    table = torch.randn(H, 2 * T - 1, requires_grad=True)
    graph = G.trace(lambda s, b, h, q, kv: s + table[h][kv - q + T - 1])
    for n, node in enumerate(graph.nodes):
        assert node.op in G.OPS and node.dtype in G.DTYPES
        assert all(a < n for a in node.args)
    out = graph.nodes[graph.output]
    assert (out.op, out.dtype) == ("add", "float")
    load = graph.nodes[out.args[1]]
    assert load.op == "load" and len(load.args) == 2 and graph.tensors[load.value] is table
    assert graph.grad_slots() == [0]
    assert graph.uses("score") and graph.uses("kv_idx") and not graph.uses("b")
    assert "load t0(4, 73)" in graph.describe()


def test_types_follow_torch_promotion():
    g = G.trace(lambda s, b, h, q, kv: s + (q // 3) % 2 + (q / 2) * (kv > 1))
    ops = {(n.op, n.dtype) for n in g.nodes}
    assert ("floordiv", "int") in ops and ("mod", "int") in ops and ("div", "float") in ops
    assert ("gt", "bool") in ops
    b, h, i, j = _grids()
    s = torch.zeros(1, 1, T, T, dtype=torch.float64)
    want = s + (i // 3) % 2 + (i / 2) * (j > 1)
    torch.testing.assert_close(g.evaluate(s, b, h, i, j).expand_as(want), want)


@pytest.mark.parametrize(
    ("mod", "reason"),
    [
        (lambda s, b, h, q, kv: s if q > kv else -s, "Python control flow"),
        (lambda s, b, h, q, kv: s + math.tanh(s), "Python float"),
        (lambda s, b, h, q, kv: s + TABLE[h].sum(), "partly indexed"),
        (lambda s, b, h, q, kv: s + TABLE[:, q][0], "only scalar indices"),
        (lambda s, b, h, q, kv: s + torch.erf(s), "torch.erf is not in the supported set"),
        (lambda s, b, h, q, kv: q + kv, "not a float score"),
        (lambda s, b, h, q, kv: s + TABLE, "without indexing"),
        (lambda s, b, h, q, kv: s + (q & kv), "bitwise"),
        (lambda s, b, h, q, kv: s + TABLE[h][s], "float index"),
    ],
)
def test_unsupported_says_why(mod, reason):
    with pytest.raises(G.Unsupported, match=reason):
        G.trace(mod)
    why = G.traced(mod)
    assert isinstance(why, G.Unsupported) and reason in why.reason


TABLE = torch.randn(H, 2 * T)


def test_check_proves_ints_and_indices():
    table = torch.randn(H, 2 * T - 1)
    graph = G.trace(lambda s, b, h, q, kv: s + table[h, kv - q + T - 1])
    assert graph.check(B, H, T, T) is None
    assert "out of range" in graph.check(B, H, T + 1, T + 1)  # the table is too short
    assert "out of range" in graph.check(B, H + 1, T, T)
    wide = G.trace(lambda s, b, h, q, kv: s + (q * kv * kv).float())
    assert wide.check(1, 1, 100, 100) is None
    assert "int32" in wide.check(1, 1, 5000, 5000)
    docs = torch.tensor([0, 0, 1, 1, 5])
    lookup = G.trace(lambda s, b, h, q, kv: s + table[docs[q], kv])
    assert "out of range" in lookup.check(1, 1, 5, 5)  # docs' values 0..5, table has 4 rows
    assert G.trace(lambda s, b, h, q, kv: s + table[docs[q] - 2, kv]).check(1, 1, 5, 5) is None


def test_check_refuses_an_integer_division_by_zero():
    """An int // or % by a value that may be 0 is not compiled (it would trap in C++)."""
    assert "may be 0" in G.trace(lambda s, b, h, q, kv: s + (q // kv).float()).check(1, 1, 9, 9)
    assert "may be 0" in G.trace(lambda s, b, h, q, kv: s + (q % (kv - 3)).float()).check(
        1, 1, 9, 9
    )
    assert G.trace(lambda s, b, h, q, kv: s + (q // (kv + 1)).float()).check(1, 1, 9, 9) is None
    assert G.trace(lambda s, b, h, q, kv: s + q / kv).check(1, 1, 9, 9) is None  # float: inf


def test_negative_indices_wrap_like_torch():
    table = torch.randn(H, 2 * T)
    graph = G.trace(lambda s, b, h, q, kv: s + table[h, q - kv])  # -(T-1) .. T-1
    assert graph.check(B, H, T, T) is None
    b, h, i, j = _grids()
    s = torch.zeros(1, 1, T, T)
    torch.testing.assert_close(graph.evaluate(s, b, h, i, j), s + table[h, i - j])


def test_attnkit_mods_trace():
    assert isinstance(G.traced(M.alibi(H)), G.ModGraph)
    assert isinstance(G.traced(M.softcap(2.0)), G.ModGraph)
    assert isinstance(G.traced(M.relative_bias(torch.randn(H, 9))), G.ModGraph)
    docs = torch.tensor([0] * 10 + [1] * 27)
    assert isinstance(G.traced(M.document(docs), "mask"), G.ModGraph)
    assert isinstance(G.traced(M.sliding_window(8, alignment="top_left"), "mask"), G.ModGraph)


def test_cache_reuses_and_retraces_on_mutation():
    G.clear_cache()
    p = torch.zeros(H)

    def mod(s, b, h, q, kv):
        return s + p[h]

    first = G.traced(mod)
    assert G.traced(mod) is first  # the same graph object: not traced again
    p.add_(1.0)  # a new version of a captured tensor: traced again
    second = G.traced(mod)
    assert second is not first and G.traced(mod) is second
    with pytest.raises(ValueError, match="kind"):
        G.trace(mod, "other")
