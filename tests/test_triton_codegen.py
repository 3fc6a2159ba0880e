"""Traced mods generated into the Triton kernels (``backends/triton/codegen.py``).

Every score mod here is a plain lambda or closure (no ``spec``): it reaches the kernels
only through the tracer and the code generator, forward and both backward kernels.
Without a GPU the kernels run on Triton's interpreter (``TRITON_INTERPRET=1``). Each
case is checked against float64 attention written out here with the mod's dense form,
by flash-attn's rule: our float32 error is at most twice that of plain float32 math,
for the output, dQ, dK, dV and every captured tensor's gradient. Sizes are tiny but odd,
so they cross the interpreter's 16/32 tile edges.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import triton
import triton.language as tl
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attnkit import attention
from attnkit.backends.triton import backend as TB
from attnkit.backends.triton.compiled import compile_mods
from attnkit.mod_graph import trace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("one_thread")
EPS = {torch.float32: 5e-6, torch.bfloat16: 1e-3}


def grids(b: int, h: int, lq: int, lk: int) -> tuple[torch.Tensor, ...]:
    """Index grids ``b (b,1,1,1), h (1,h,1,1), i (1,1,lq,1), j (1,1,1,lk)``."""
    return (
        torch.arange(b).view(-1, 1, 1, 1),
        torch.arange(h).view(1, -1, 1, 1),
        torch.arange(lq).view(1, 1, -1, 1),
        torch.arange(lk).view(1, 1, 1, -1),
    )


def plain(q, k, v, dense, keep):
    """Attention written out in q's dtype; ``dense(s, b, h, i, j)`` mods the scores."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if dense is not None:
        s = dense(s, *grids(q.shape[0], q.shape[1], q.shape[2], k.shape[2])).to(q.dtype)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    return (e / torch.where(den > 0, den, torch.ones_like(den))) @ v


def check(make, dense, *, params=(), keep=None, b=1, hq=2, hkv=2, lq=37, lk=35, d=16, seed=0,
          dtype=torch.float32, admit=None, **kwargs):  # fmt: skip
    """Run ``make(params) -> score_mod`` on the triton backend against float64.

    ``params``: float64 captured tensors (leaves); ours get float32 copies that require
    grad, the references float64 / float32 ones. ``keep (b|1, h|1, lq, lk)`` is the mask
    the call's other arguments (``kwargs``) describe. ``admit(s)``, if given, sees the
    float64 scores ``(b, hq, lq, lk)`` before anything runs (a fuzzer's ``assume``).
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64)
    d_out = torch.randn(b, hq, lq, d, generator=gen, dtype=torch.float64)
    keep = torch.ones(1, 1, lq, lk, dtype=torch.bool) if keep is None else keep
    if admit is not None:
        admit(q @ k.repeat_interleave(hq // hkv, 1).transpose(-2, -1) / math.sqrt(d))

    def run(dtype, ours):
        xs = [t.to(DEVICE if ours else "cpu", dtype).requires_grad_(True) for t in (q, k, v)]
        ps = [p.detach().to(dtype).requires_grad_(True) for p in params]
        if ours:
            kw = dict(kwargs)
            if make is not None:
                kw["score_mod"] = make(ps)
            out = attention(*xs, backend="triton", **kw)
        else:
            out = plain(*xs, (lambda *a: dense(*a, ps)) if dense else None, keep)
        grads = torch.autograd.grad(out, xs + ps, d_out.to(out), allow_unused=True)
        return [
            out,
            *(torch.zeros_like(p) if g is None else g for g, p in zip(grads, xs + ps, strict=True)),
        ]

    ref, base, got = run(torch.float64, False), run(dtype, False), run(dtype, True)
    names = ["out", "dq", "dk", "dv"] + [f"d_param{n}" for n in range(len(params))]
    for name, r, p, o in zip(names, ref, base, got, strict=True):
        o = o.cpu()
        assert not torch.isnan(o).any(), name
        err, err_plain = (o.double() - r).abs().max(), (p.double() - r).abs().max()
        eps = EPS[dtype] * (1 + r.abs().max().item() * (name.startswith("d_param")))
        assert err <= 2 * err_plain + eps, f"{name}: {err:.3g} vs plain {err_plain:.3g}"
    return got


def test_softcap_lambda():
    check(
        lambda ps: lambda s, b, h, q, kv: 2.0 * torch.tanh(s / 2.0),
        lambda s, b, h, i, j, ps: 2.0 * torch.tanh(s / 2.0),
        causal=True,
        b=2,
        lq=29,
        lk=37,
        keep=(torch.arange(37).view(1, -1) <= torch.arange(29).view(-1, 1) + 8),
    )


def test_alibi_as_a_lambda_with_slope_gradients():
    """The ALiBi the issue names, as a user writes it: refused before, now generated."""
    slopes = torch.rand(4, dtype=torch.float64) * 0.5
    got = check(
        lambda ps: lambda s, b, h, q, kv: s - ps[0][h] * (q - kv),
        lambda s, b, h, i, j, ps: s - ps[0].view(1, -1, 1, 1) * (i - j),
        params=[slopes], hq=4, hkv=2, lq=37, lk=37, causal="top_left",
        keep=torch.arange(37).view(1, -1) <= torch.arange(37).view(-1, 1),
    )  # fmt: skip
    assert got[-1].abs().min() > 0  # every head's slope got a gradient


def test_learned_t5_table():
    """``s + table[h, kv - q + T]``: a gathered index, scattered back without atomics."""
    lq, lk = 37, 35
    table = torch.randn(2, lq + lk - 1, dtype=torch.float64)
    got = check(
        lambda ps: lambda s, b, h, q, kv: s + ps[0][h, kv - q + (lq - 1)],
        lambda s, b, h, i, j, ps: s + ps[0][h, j - i + (lq - 1)],
        params=[table], lq=lq, lk=lk,
    )  # fmt: skip
    assert (got[-1] != 0).all()  # every relative position is reached


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_custom_lambda_of_head_and_distance(dtype):
    check(
        lambda ps: lambda s, b, h, q, kv: s * 0.5 + (h + 1) * 0.01 * (q - kv),
        lambda s, b, h, i, j, ps: s * 0.5 + (h + 1) * 0.01 * (i - j),
        hq=4, hkv=1, lq=19, lk=37, dtype=dtype,
    )  # fmt: skip


def test_sliding_window_mask_mod_with_a_score_mod():
    """A traced mask_mod is generated into the partial tiles of the block-sparse path."""
    lq = lk = 37
    i, j = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)
    check(
        lambda ps: lambda s, b, h, q, kv: s + ps[0][h] * torch.sigmoid(s),
        lambda s, b, h, i, j, ps: s + ps[0].view(1, -1, 1, 1) * torch.sigmoid(s),
        params=[torch.randn(2, dtype=torch.float64)], lq=lq, lk=lk,
        mask_mod=lambda b, h, q, kv: (kv <= q) & (q - kv < 7),
        keep=(j <= i) & (i - j < 7),
    )  # fmt: skip


def test_documents_mask_mod_from_captured_ids():
    lq = lk = 37
    ids = torch.tensor([0] * 11 + [1] * 17 + [2] * 9)
    keep = (ids.view(-1, 1) == ids.view(1, -1)) & (torch.arange(lk) <= torch.arange(lq).view(-1, 1))
    on = ids.to(DEVICE)  # what a mod captures lives on the call's device, as in FlexAttention
    check(None, None, lq=lq, lk=lk, keep=keep,
          mask_mod=lambda b, h, q, kv: (on[q] == on[kv]) & (kv <= q))  # fmt: skip


def test_generated_mask_replaces_the_stored_bits(monkeypatch):
    """Inside a partial tile the mask graph's code decides, not the block mask's stored
    bits: with the bits zeroed, the answer is still right."""
    import dataclasses

    real = TB.P.sparse_tables
    blanked = lambda bm, device: dataclasses.replace(  # noqa: E731
        real(bm, device), part=torch.zeros_like(real(bm, device).part)
    )
    monkeypatch.setattr(TB.P, "sparse_tables", blanked)
    lq = lk = 53
    ids = torch.tensor([0] * 11 + [1] * 25 + [2] * 17)
    keep = (ids.view(-1, 1) == ids.view(1, -1)) & (torch.arange(lk) <= torch.arange(lq).view(-1, 1))
    on = ids.to(DEVICE)
    check(None, None, b=1, hq=2, hkv=2, lq=lq, lk=lk, keep=keep,
          mask_mod=lambda b, h, q, kv: (on[q] == on[kv]) & (kv <= q))  # fmt: skip


def test_untraceable_mod_is_refused_with_the_reason():
    w = torch.randn(2, 3, device=DEVICE)

    def mod(s, b, h, q, kv):
        return s + w[h].sum()  # a reduction: outside the traced set

    q = torch.randn(1, 2, 20, 16, device=DEVICE)
    with pytest.raises(ValueError, match="traces; .*partly indexed"):
        attention(q, q, q, score_mod=mod, backend="triton")
    torch.testing.assert_close(  # auto runs it elsewhere
        attention(q, q, q, score_mod=mod), attention(q, q, q, score_mod=mod, backend="reference")
    )


def test_an_index_that_may_leave_its_table_is_refused():
    table = torch.randn(10)
    q = torch.randn(1, 2, 20, 16, device=DEVICE)
    with pytest.raises(ValueError, match="out of range"):
        attention(q, q, q, score_mod=lambda s, b, h, qi, kv: s + table[qi], backend="triton")


def test_captured_gradients_are_bitwise_deterministic():
    """Per-program private buffers summed in a fixed order: the same bits every run."""
    lq, lk = 37, 35
    table = torch.randn(2, lq + lk - 1, requires_grad=True)
    slopes = torch.rand(2, requires_grad=True)
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE) for n in (lq, lk, lk))

    def mod(s, b, h, qi, kv):
        return s + table[h, kv - qi + lq - 1] - slopes[h] * (qi - kv).abs()

    runs = []
    for _ in range(3):
        out = attention(q, k, v, score_mod=mod, backend="triton")
        runs.append(torch.autograd.grad(out.sum(), [table, slopes]))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


def test_generated_module_is_cached_per_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    w = torch.randn(4)
    g1 = trace(lambda s, b, h, q, kv: s * w[h] + 0.125)
    g2 = trace(lambda s, b, h, q, kv: s * w[h] + 0.125)
    m1, m2 = compile_mods(g1, None), compile_mods(g2, None)
    assert m1.module is m2.module  # one module per source
    assert m1.path.parent == tmp_path / "triton" and m1.path.stat().st_mode & 0o077 == 0


def test_an_unsafe_cache_directory_is_not_used(tmp_path, monkeypatch):
    """A cache directory others may write is skipped for a private temporary one."""
    from attnkit.backends.triton import compiled

    shared = tmp_path / "shared"
    (shared / "triton").mkdir(parents=True)
    (shared / "triton").chmod(0o777)
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(shared))
    monkeypatch.setattr(compiled, "_MODULES", {})
    cm = compile_mods(trace(lambda s, b, h, q, kv: s * 0.375 - 1.0), None)
    assert shared not in cm.path.parents and cm.path.read_text().startswith('"""Generated')


def test_a_strided_non_leaf_capture_gets_its_gradient():
    """A transposed view of a parameter: packed in its logical order, the gradient
    reaches the parameter through the view."""
    lq = lk = 37
    base = torch.randn(lq + lk - 1, 2, dtype=torch.float64, requires_grad=True)
    q, k, v = (torch.randn(1, 2, lq, 16, dtype=torch.float64) for _ in range(3))

    def run(dtype, backend):
        table = base.to(dtype).t()  # (2, lq + lk - 1), non-contiguous, not a leaf
        xs = [x.to(DEVICE if backend == "triton" else "cpu", dtype) for x in (q, k, v)]
        out = attention(*xs, backend=backend,
                        score_mod=lambda s, b, h, qi, kv: s + table[h, kv - qi + lq - 1])  # fmt: skip
        return torch.autograd.grad(out.square().sum(), base)[0]

    got, want = run(torch.float32, "triton"), run(torch.float64, "reference")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# A fuzzer over random mod expressions
# ---------------------------------------------------------------------------------------

LEAVES = ("s", "q-kv", "h", "b", "w[h]", "tab[(q-kv)%5]", "c")
UNARY = ("tanh", "sigmoid", "exp_tanh", "abs", "neg", "sqrt1p")
BINARY = ("add", "sub", "mul", "where_gt", "min", "max", "div1p")


def _expr(draw, depth):
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        leaf = draw(st.sampled_from(LEAVES))
        if leaf == "c":
            return ("c", round(draw(st.floats(-2, 2, allow_nan=False)), 2))
        return (leaf,)
    if draw(st.booleans()):
        return (draw(st.sampled_from(UNARY)), _expr(draw, depth - 1))
    return (draw(st.sampled_from(BINARY)), _expr(draw, depth - 1), _expr(draw, depth - 1))


exprs = st.composite(lambda draw: _expr(draw, 3))()


def _eval(e, s, b, h, q, kv, w, tab, margins=None):
    """``e`` on the scores; ``margins`` (a list), if given, gets each kink's or branch's
    distance from its tie (abs at 0, min/max/where_gt at x = y), relative to the sides."""
    op, *args = e
    r = [_eval(a, s, b, h, q, kv, w, tab, margins) if isinstance(a, tuple) else a for a in args]
    if margins is not None and op in ("abs", "min", "max", "where_gt"):
        x, y = (r[0], torch.zeros_like(r[0])) if op == "abs" else r
        margins.append((x - y).abs() / (1.0 + x.abs() + y.abs()))
    leaves = {
        "s": lambda: s,
        "q-kv": lambda: (q - kv) * 0.1,
        "h": lambda: h * 0.5,
        "b": lambda: b * 0.25,
        "w[h]": lambda: w[h],
        "tab[(q-kv)%5]": lambda: tab[(q - kv) % 5],
        "c": lambda: torch.full_like(s, r[0]),
    }
    if op in leaves:
        return leaves[op]()
    ops = {
        "tanh": lambda x: torch.tanh(x),
        "sigmoid": lambda x: torch.sigmoid(x),
        "exp_tanh": lambda x: torch.exp(torch.tanh(x)),
        "abs": lambda x: torch.abs(x),
        "neg": lambda x: -x,
        "sqrt1p": lambda x: torch.sqrt(1.0 + x * x),
        "add": lambda x, y: x + y,
        "sub": lambda x, y: x - y,
        "mul": lambda x, y: x * torch.tanh(y),
        "where_gt": lambda x, y: torch.where(x > y, x, y * 0.5),
        "min": lambda x, y: torch.minimum(x, y),
        "max": lambda x, y: torch.maximum(x, y),
        "div1p": lambda x, y: x / (1.0 + y * y),
    }
    return ops[op](*r)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(expr=exprs, seed=st.integers(0, 2**16))
def test_fuzz_random_mod_expressions(expr, seed):
    """Random expressions of float ops, comparisons, ``where`` and table loads with
    computed indices: output, dQ/dK/dV and the captured tables' gradients."""
    w = torch.randn(2, dtype=torch.float64)
    tab = torch.randn(5, dtype=torch.float64)

    def make(ps):
        return lambda s, b, h, q, kv: s + _eval(expr, s, b, h, q, kv, ps[0], ps[1])

    def dense(s, b, h, i, j, ps):
        return s + _eval(expr, s, b, h, i, j, ps[0], ps[1])

    def admit(s):
        # A branch or kink that float32 rounding can put on either side of its tie (s
        # against tanh(s) near 0: their gap s^3 / 3 is below a few ulps for |s| < 1e-3)
        # makes a gradient that no float32 code has to reproduce: such examples are not
        # drawn (as far from a tie as 1e-5 relative, 10x float32's error here).
        margins: list[torch.Tensor] = []
        _eval(expr, s, *grids(*s.shape), w, tab, margins)
        assume(all(m.min() > 1e-5 for m in margins))

    check(make, dense, params=[w, tab], b=1, hq=2, hkv=1, lq=19, lk=23, seed=seed, admit=admit)


#: One score mod per op (and per rule: integer division and remainder of negatives,
#: round half to even, constant and traced exponents, casts), with values that reach
#: both signs. ``w`` is a captured float table, ``n`` an int one.
OP_MODS = {
    "exp": lambda s, b, h, q, kv, w, n: torch.exp(s * 0.5),
    "log": lambda s, b, h, q, kv, w, n: torch.log(s * s + 0.5),
    "tanh": lambda s, b, h, q, kv, w, n: torch.tanh(s),
    "sigmoid": lambda s, b, h, q, kv, w, n: torch.sigmoid(s) * w[h],
    "sqrt": lambda s, b, h, q, kv, w, n: torch.sqrt(s * s + 1.0),
    "rsqrt": lambda s, b, h, q, kv, w, n: torch.rsqrt(s * s + 1.0),
    "sin_cos": lambda s, b, h, q, kv, w, n: torch.sin(s) + torch.cos(s * w[h]),
    "floor_ceil": lambda s, b, h, q, kv, w, n: torch.floor(s * 2) + torch.ceil(s * 3) + s,
    "trunc_round": lambda s, b, h, q, kv, w, n: torch.trunc(s * 3) + torch.round(s * 2) + s,
    "round_half": lambda s, b, h, q, kv, w, n: s + torch.round((q - kv) * 0.5),
    "neg_abs": lambda s, b, h, q, kv, w, n: -torch.abs(s) * w[h],
    "floordiv_mod_int": lambda s, b, h, q, kv, w, n: s + (q - kv) // 3 + (q - kv) % 4,
    "floordiv_mod_int_negative_divisor": lambda s, b, h, q, kv, w, n: (
        s + (q - kv) // -3 + (q - kv) % -4
    ),
    "floordiv_mod_float": lambda s, b, h, q, kv, w, n: (
        (q - kv) * 0.3 // 0.7 + torch.remainder(s, 0.6) + torch.remainder(s, -0.6)
    ),
    "div": lambda s, b, h, q, kv, w, n: s / (1.0 + w[h] * w[h]),
    "pow_const": lambda s, b, h, q, kv, w, n: s**2 + (s * s + 1) ** 0.5 + (s * s + 1) ** -1.5,
    "pow_traced": lambda s, b, h, q, kv, w, n: (s * s + 1.0) ** (w[h] * 0.5),
    "min_max_clamp": lambda s, b, h, q, kv, w, n: (
        torch.minimum(s, w[h]) + torch.clamp(s, -0.5, 0.7)
    ),
    "compare_where": lambda s, b, h, q, kv, w, n: torch.where((s > 0) ^ (q >= kv), s, -s * w[h]),
    "logic": lambda s, b, h, q, kv, w, n: torch.where(
        ((q == kv) | (q != kv + 1)) & ~(s <= 0.1) | (s < -1.0), s, s * 0.5
    ),
    "casts": lambda s, b, h, q, kv, w, n: (
        s + (s * 4).long() + (q > kv).float() + (q - kv).bool().int()
    ),
    "int_table": lambda s, b, h, q, kv, w, n: s * n[(q - kv) % 5] + n[-1],
    "table_negative_index": lambda s, b, h, q, kv, w, n: s + w[h - 3] + w[(kv - q) % 3 - 3],
    "consts": lambda s, b, h, q, kv, w, n: torch.where(s > 1.0, float("inf"), s + 0.25),
    "batch": lambda s, b, h, q, kv, w, n: s * (b + 1) + h,
}


@triton.jit
def _tile_kernel(S, O, D, G, CF, CI, b, h, lq, lk, FN: tl.constexpr, GF: tl.constexpr,
                 M: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """A ``(M, N)`` tile of scores through a generated ``score_mod`` / ``score_grads``."""
    om = tl.arange(0, M)
    on = tl.arange(0, N)
    s = tl.load(S + om[:, None] * N + on[None, :])
    valid = (om[:, None] < lq) & (on[None, :] < lk)
    out, d = FN(s, b, h, om[:, None], on[None, :], valid, CF, CI, False, True)
    tl.store(O + om[:, None] * N + on[None, :], out)
    tl.store(D + om[:, None] * N + on[None, :], d)
    GF(s, tl.where(valid, 1.0, 0.0), b, h, om[:, None], on[None, :], valid, CF, CI, G, False)


@pytest.mark.parametrize("name", list(OP_MODS))
def test_every_op_matches_torch_on_a_tile(name):
    """Each op's generated value, ``d out / d s`` and captured-table gradient on a tile
    with out-of-range rows and columns, against torch autograd in float64."""
    from attnkit.backends.triton.compiled import packed

    fn = OP_MODS[name]
    w = torch.tensor([0.7, -1.3, 0.4])
    n = torch.tensor([2, -3, 0, 5, 1])
    w.requires_grad_(True)
    cm = compile_mods(trace(lambda s, b, h, q, kv: fn(s, b, h, q, kv, w, n)), None)
    cf, ci = packed(cm, torch.device("cpu"))
    gen = torch.Generator().manual_seed(zlib_seed(name))
    s = (torch.randn(16, 16, generator=gen) * 1.5).to(DEVICE)
    out, d = torch.empty_like(s), torch.empty_like(s)
    g = torch.zeros(cm.layout.grad_size + 1, device=DEVICE)
    b, h, lq, lk = 1, 2, 13, 11
    _tile_kernel[(1,)](s, out, d, g, cf.to(DEVICE), ci.to(DEVICE), b, h, lq, lk,
                       FN=cm.score_fn, GF=cm.grads_fn, M=16, N=16)  # fmt: skip
    s64 = s[:lq, :lk].cpu().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    qi, ki = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)
    ref = fn(s64, torch.tensor(b), torch.tensor(h), qi, ki, w64, n)
    ds, dw = torch.autograd.grad(ref.sum(), [s64, w64], allow_unused=True)
    torch.testing.assert_close(out[:lq, :lk].cpu().double(), ref, atol=2e-5, rtol=2e-5)
    ds = torch.zeros_like(s64) if ds is None else ds
    torch.testing.assert_close(d[:lq, :lk].cpu().double(), ds, atol=2e-5, rtol=2e-5)
    if dw is not None:
        torch.testing.assert_close(g[:3].cpu().double(), dw, atol=1e-4, rtol=1e-5)


def zlib_seed(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


def test_every_op_of_the_graph_has_code():
    """The op mods above reach every op a graph may hold."""
    from attnkit.mod_graph import OPS

    w, n = torch.zeros(3, requires_grad=True), torch.zeros(5, dtype=torch.long)
    seen = set()
    for fn in OP_MODS.values():
        graph = trace(lambda s, b, h, q, kv, fn=fn: fn(s, b, h, q, kv, w, n))
        seen |= {graph.nodes[i].op for i in graph.live()}
    assert set(OPS) <= seen, set(OPS) - seen


# ---------------------------------------------------------------------------------------
# The project's mod catalogue (tests/test_mods_catalogue.py) on the Triton kernels
# ---------------------------------------------------------------------------------------


def _catalogue():
    from tests import test_mods_catalogue as C

    return C


def test_every_catalogue_mod_compiles_for_the_kernels():
    """Each FlexAttention-style mod of the catalogue is hand-written in the kernels
    (``masks.alibi``/``softcap``) or traces and passes the range check for its sizes."""
    from attnkit.backends.triton import plan as P
    from attnkit.mod_graph import Unsupported, traced

    C = _catalogue()
    for name, entry in C.CATALOGUE.items():
        mod, _ = entry.make()
        if entry.kind == "score" and P.score_mod_spec(mod) is not None:
            continue
        graph = traced(mod, entry.kind)
        assert not isinstance(graph, Unsupported), f"{name}: {graph.reason}"
        assert graph.check(C.B, C.HQ, entry.length, entry.length) is None, name


@pytest.mark.slow
def test_catalogue_on_triton_against_float64():
    """Forward, dQ/dK/dV and captured gradients of every catalogue mod, float32 kernels
    against the catalogue's own float64 dense equivalents."""
    C = _catalogue()
    for name, entry in C.CATALOGUE.items():
        mod, params = entry.make()
        gen = torch.Generator().manual_seed(11)
        t = entry.length
        q, k, v = (
            torch.randn(C.B, h, t, 8, generator=gen, dtype=torch.float64)
            for h in (C.HQ, C.HKV, C.HKV)
        )
        kwarg = "score_mod" if entry.kind == "score" else "mask_mod"
        xs = [x.to(DEVICE, torch.float32).requires_grad_(True) for x in (q, k, v)]
        out = attention(*xs, backend="triton", **{kwarg: mod})
        g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        ours = torch.autograd.grad((out * g_out.to(out)).sum(), [*xs, *params])
        ys = [x.clone().requires_grad_(True) for x in (q, k, v)]
        ref_out = C._reference(entry, name, *ys, params)
        ref = torch.autograd.grad((ref_out * g_out).sum(), [*ys, *params])
        names = ["out", "dq", "dk", "dv", *["d_param"] * len(params)]
        for what, a, r in zip(names, [out, *ours], [ref_out, *ref], strict=True):
            err = (a.cpu().double() - r).abs().max().item()
            assert err <= 1e-4 * (1 + r.abs().max().item()), f"{name} {what}: {err:.3g}"


def test_auto_leaves_generated_mods_to_an_explicit_request_on_a_real_gpu(monkeypatch):
    """No GPU has run the generated kernels yet: on one, ``auto`` passes them over with
    the reason, ``backend='triton'`` (its ``supports``) and the opt-in variable still run
    them; hand-written mods and plain calls are unaffected."""
    from attnkit.backends.registry import AttentionCall
    from attnkit.backends.triton import backend as TB
    from attnkit.masks import softcap

    q = torch.randn(1, 2, 8, 16)
    slopes = torch.tensor([0.5, 0.25])

    def lam(s, b, h, qi, kv):
        return s - slopes[h] * (qi - kv)

    def call(score_mod):
        return AttentionCall(q, q, q, None, None, 0.25, 0.0, False, score_mod=score_mod)

    monkeypatch.setattr(TB, "interpreting", lambda: False)
    monkeypatch.setattr(TB, "supports", lambda call: None)  # as on a GPU
    monkeypatch.delenv(TB.GENERATED_ON_GPU, raising=False)
    why = TB.auto_supports(call(lam))
    assert why is not None and "backend='triton'" in why and TB.GENERATED_ON_GPU in why
    assert TB.auto_supports(call(softcap(30.0))) is None
    assert TB.auto_supports(call(None)) is None
    monkeypatch.setenv(TB.GENERATED_ON_GPU, "1")
    assert TB.auto_supports(call(lam)) is None
