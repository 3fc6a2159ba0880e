"""A catalogue of the mods FlexAttention users write, run unchanged through every backend.

Each mod is written as for ``flex_attention`` (scalar indices, captured tensors indexed
in every way, learnable tensors reached through closures, dicts, partials, bound
methods, nested mods and modules). Each entry also carries its own dense float64
equivalent, written here independently, which the independent reference
(``tests/reference.py``) uses. Forward, dq/dk/dv and every captured tensor's gradient
are compared; tiles are small so every case crosses tile edges (odd length 37, GQA).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from attnkit import attention
from attnkit import masks as M
from attnkit.backends.blockwise import plan as blockwise_plan
from tests.conftest import TOL
from tests.reference import ref_from_scores

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ["reference", "sdpa", "blockwise", "blockwise-flash", "blockwise-tiles", "auto"]
B, HQ, HKV, T = 2, 4, 2, 37
NEG_INF = float("-inf")


@dataclass
class Entry:
    """A mod and its dense equivalent: ``dense(scores f64 (b, h, t, s), i, j, b, h)``
    returns the modded scores (score mods, -inf where masked) or a bool keep (mask mods)."""

    kind: str  # "score" or "mask"
    make: Callable[[], tuple[Callable, list[torch.Tensor]]]  # -> (mod, learnable tensors)
    dense: Callable[..., torch.Tensor]
    length: int = T
    params: list[torch.Tensor] = field(default_factory=list)


def _param(*shape: int, seed: int = 0, scale: float = 0.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_(True)


SLOPES = torch.tensor([2.0 ** (-8 * (n + 1) / HQ) for n in range(HQ)], dtype=torch.float64)
DOCS = torch.tensor([0] * 10 + [1] * 15 + [2] * 12)
PREFIX = 9
WINDOW = 8
SIDE, RADIUS = 6, 1  # NATTEN: a 6 x 6 image, 3 x 3 neighbourhoods
LENGTHS = torch.tensor([37, 20])


class BiasModule(torch.nn.Module):
    """A learnable per-head bias as an nn.Module score mod (forward) and a bound method."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(_param(HQ, seed=5).detach())

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.bias[h]

    def scaled(self, score, b, h, q_idx, kv_idx):
        return score * (1.0 + self.bias[h])


def _partial_mod(score, b, h, q_idx, kv_idx, table):
    return score + table[h][q_idx - kv_idx + T - 1]


def _catalogue() -> dict[str, Entry]:
    cat: dict[str, Entry] = {}

    def score(name, make, dense, length=T):
        cat[name] = Entry("score", make, dense, length)

    def mask(name, make, dense, length=T):
        cat[name] = Entry("mask", make, dense, length)

    # -- score mods ---------------------------------------------------------------------
    score(
        "relative-position",
        lambda: (lambda s, b, h, q, kv: s + 0.05 * (q - kv), []),
        lambda s, i, j, b, h: s + 0.05 * (i - j),
    )
    score(
        "alibi",
        lambda: (lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv).abs(), []),
        lambda s, i, j, b, h: s - SLOPES.view(1, -1, 1, 1) * (i - j).abs(),
    )

    def learned_alibi():
        slopes = _param(HQ, seed=1, scale=0.1)
        return (lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs()), [slopes]

    score("alibi-learned", learned_alibi, None)  # dense filled in from the params below
    score(
        "softcap",
        lambda: (lambda s, b, h, q, kv: 2.0 * torch.tanh(s / 2.0), []),
        lambda s, i, j, b, h: 2.0 * torch.tanh(s / 2.0),
    )
    score(
        "causal-as-score-mod",
        lambda: (lambda s, b, h, q, kv: torch.where(q >= kv, s, NEG_INF), []),
        lambda s, i, j, b, h: s.masked_fill(j > i, NEG_INF),
    )

    def head_bias():
        p = _param(HQ, seed=2)
        return (lambda s, b, h, q, kv: s + p[h]), [p]

    score("per-head-bias", head_bias, None)

    def position_bias():  # chained indexing: bias[q][kv]
        p = _param(T, T, seed=3)
        return (lambda s, b, h, q, kv: s + p[q][kv]), [p]

    score("per-position-bias[q][kv]", position_bias, None)

    def batch_bias():  # chained indexing: bias[b][q]
        p = _param(B, T, seed=4)
        return (lambda s, b, h, q, kv: s + p[b][q]), [p]

    score("batch-bias[b][q]", batch_bias, None)

    def through_dict():
        params = {"scale": _param(HQ, seed=6, scale=0.2)}
        return (lambda s, b, h, q, kv: s * (1.0 + params["scale"][h])), [params["scale"]]

    score("tensor-in-dict", through_dict, None)

    def through_partial():
        table = _param(HQ, 2 * T - 1, seed=7)
        return functools.partial(_partial_mod, table=table), [table]

    score("functools.partial", through_partial, None)

    def module_forward():
        m = BiasModule()
        return m, [m.bias]

    score("nn.Module", module_forward, None)

    def bound_method():
        m = BiasModule()
        return m.scaled, [m.bias]

    score("bound-method", bound_method, None)

    def nested():
        p = _param(HQ, seed=8)

        def inner(s, b, h, q, kv):
            return s + p[h]

        def outer(s, b, h, q, kv):
            return 3.0 * torch.tanh(inner(s, b, h, q, kv) / 3.0)

        return outer, [p]

    score("nested-mod", nested, None)

    def non_leaf():
        p = _param(HQ, seed=9)
        w = p * 2.0  # a captured non-leaf tensor: the gradient reaches p through it
        return (lambda s, b, h, q, kv: s + w[h]), [p]

    score("non-leaf-capture", non_leaf, None)
    score(
        "attnkit-masks.alibi+softcap",
        lambda: (M.alibi(HQ), []),
        lambda s, i, j, b, h: s - SLOPES.view(1, -1, 1, 1) * (i - j).abs(),
    )

    # -- mask mods ----------------------------------------------------------------------
    mask("causal", lambda: (lambda b, h, q, kv: q >= kv, []), lambda i, j, b, h: j <= i)
    mask(
        "sliding-window",
        lambda: (lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW), []),
        lambda i, j, b, h: (j <= i) & (i - j < WINDOW),
    )
    mask(
        "prefix-lm",
        lambda: (lambda b, h, q, kv: (kv < PREFIX) | (q >= kv), []),
        lambda i, j, b, h: (j < PREFIX) | (j <= i),
    )
    mask(
        "documents",
        lambda: (lambda b, h, q, kv: DOCS[q] == DOCS[kv], []),
        lambda i, j, b, h: DOCS.view(-1, 1) == DOCS.view(1, -1),
    )
    mask(
        "causal-documents",
        lambda: (lambda b, h, q, kv: (DOCS[q] == DOCS[kv]) & (q >= kv), []),
        lambda i, j, b, h: (DOCS.view(-1, 1) == DOCS.view(1, -1)) & (j <= i),
    )

    def natten(b, h, q, kv):
        qx, qy, kx, ky = q // SIDE, q % SIDE, kv // SIDE, kv % SIDE
        return ((qx - kx).abs() <= RADIUS) & ((qy - ky).abs() <= RADIUS)

    mask(
        "natten-2d",
        lambda: (natten, []),
        lambda i, j, b, h: (
            ((i // SIDE - j // SIDE).abs() <= RADIUS) & ((i % SIDE - j % SIDE).abs() <= RADIUS)
        ),
        length=SIDE * SIDE,
    )
    mask(
        "padding-per-batch",
        lambda: (lambda b, h, q, kv: kv < LENGTHS[b], []),
        lambda i, j, b, h: j < LENGTHS.view(-1, 1, 1, 1),
    )
    mask(
        "per-head",
        lambda: (lambda b, h, q, kv: (q >= kv) | (h % 2 == 1), []),
        lambda i, j, b, h: (j <= i) | (h % 2 == 1),
    )
    mask(
        "attnkit-masks.and(prefix,padding)",
        lambda: (M.and_masks(M.prefix_lm(PREFIX), M.padding(LENGTHS)), []),
        lambda i, j, b, h: ((j < PREFIX) | (j <= i)) & (j < LENGTHS.view(-1, 1, 1, 1)),
    )
    return cat


CATALOGUE = _catalogue()


def _learned_dense(name: str, params: list[torch.Tensor]):
    """The dense equivalents of the learnable entries, from the very tensors they capture."""
    p = params[0] if params else None
    table = {
        "alibi-learned": lambda s, i, j, b, h: s - p.view(1, -1, 1, 1) * (i - j).abs(),
        "per-head-bias": lambda s, i, j, b, h: s + p.view(1, -1, 1, 1),
        "per-position-bias[q][kv]": lambda s, i, j, b, h: s + p,
        "batch-bias[b][q]": lambda s, i, j, b, h: s + p.view(B, 1, -1, 1),
        "tensor-in-dict": lambda s, i, j, b, h: s * (1.0 + p.view(1, -1, 1, 1)),
        "functools.partial": lambda s, i, j, b, h: s + p[h, i - j + T - 1],
        "nn.Module": lambda s, i, j, b, h: s + p.view(1, -1, 1, 1),
        "bound-method": lambda s, i, j, b, h: s * (1.0 + p.view(1, -1, 1, 1)),
        "nested-mod": lambda s, i, j, b, h: 3.0 * torch.tanh((s + p.view(1, -1, 1, 1)) / 3.0),
        "non-leaf-capture": lambda s, i, j, b, h: s + 2.0 * p.view(1, -1, 1, 1),
    }
    return table[name]


def _reference(entry: Entry, name: str, q, k, v, params):
    """Float64 attention with the entry's dense equivalent, written out."""
    t = entry.length
    i, j = torch.arange(t).view(1, 1, -1, 1), torch.arange(t).view(1, 1, 1, -1)
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(HQ).view(1, -1, 1, 1)
    g = HQ // HKV
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ kk.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if entry.kind == "mask":
        keep = entry.dense(i[0, 0], j[0, 0], b, h).expand(B, HQ, t, t)
        s = s.masked_fill(~keep, NEG_INF)
    else:
        dense = entry.dense or _learned_dense(name, params)
        s = dense(s, i, j, b, h)
    return ref_from_scores(s, vv)[0]


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(blockwise_plan, "BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "FUSED_BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue_mod_on_every_backend(name, backend):
    entry = CATALOGUE[name]
    mod, params = entry.make()
    t = entry.length
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(B, HQ, t, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(B, HKV, t, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(B, HKV, t, 8, generator=gen, dtype=torch.float64)
    kwarg = "score_mod" if entry.kind == "score" else "mask_mod"
    if backend == "sdpa" and entry.kind == "score":
        with pytest.raises(ValueError, match="score_mod"):
            attention(q, k, v, backend=backend, **{kwarg: mod})
        return
    xs = [t_.clone().requires_grad_(True) for t_ in (q, k, v)]
    out = attention(*xs, backend=backend, **{kwarg: mod})
    g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad((out * g_out).sum(), [*xs, *params])
    ys = [t_.clone().requires_grad_(True) for t_ in (q, k, v)]
    ref_out = _reference(entry, name, *ys, params)
    ref = torch.autograd.grad((ref_out * g_out).sum(), [*ys, *params])
    torch.testing.assert_close(out, ref_out, **TOL[torch.float64])
    for what, a, r in zip(["dq", "dk", "dv", *["d_param"] * len(params)], ours, ref, strict=True):
        assert a is not None, what
        assert not torch.isnan(a).any(), what
        torch.testing.assert_close(a, r, **TOL[torch.float64], msg=what)
    for p_grad in ours[3:]:
        assert p_grad.abs().sum() > 0  # never a silent zero / None gradient


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue_matches_torch_flex_attention(name):
    """The same mod objects through torch's own flex_attention (forward; eager, CPU)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    entry = CATALOGUE[name]
    mod, _ = entry.make()
    t = entry.length
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(B, h, t, 8, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV))
    if name.startswith("attnkit-"):
        pytest.skip("attnkit's own mods take *args, which flex_attention's arity check refuses")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        if entry.kind == "score":
            theirs = flex.flex_attention(q, k, v, score_mod=mod, enable_gqa=True)
            ours = attention(q, k, v, score_mod=mod, backend="blockwise")
        else:
            bm = flex.create_block_mask(mod, B, HQ, t, t, device="cpu")
            theirs = flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
            ours = attention(q, k, v, mask_mod=mod, backend="blockwise")
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
