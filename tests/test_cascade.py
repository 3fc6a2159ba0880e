"""Shared-prefix cascades: equal to attention over each request's whole sequence.

The reference is written here in float64 from explicit loops: request ``r`` attends to
``prefix ++ its own suffix keys``, query row ``i`` at suffix position ``len_r - t + i``
seeing every prefix key and its suffix keys up to that position. Forward, lse and the
gradients of every input (the shared prefix's gradient sums over the requests).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import attention, cascade_attention
from attnkit.backends.blockwise import plan as blockwise_plan
from tests.conftest import TOL
from tests.reference import ref_attention_lse

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles small enough that the prefix pass's stacked rows cross tile edges."""
    monkeypatch.setattr(blockwise_plan, "BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "FUSED_BLOCK_Q", 16)
    monkeypatch.setattr(blockwise_plan, "BLOCK_K", 24)


def _inputs(n, hq, hkv, t, p, s, d, dv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return (
        r(n, hq, t, d),
        r(hkv, p, d),
        r(hkv, p, dv),
        r(n, hkv, s, d),
        r(n, hkv, s, dv),
        r(hq),
    )


def _reference(q, pk, pv, sk, sv, lengths, sinks):
    """Per request: float64 attention over prefix ++ own suffix, mask from loops."""
    n, _, t, _ = q.shape
    p = pk.shape[1]
    outs, lses = [], []
    for r in range(n):
        length = int(lengths[r])
        if p + length == 0:  # no key: zeros, and lse = the sink's logit (or -inf)
            hq, dv = q.shape[1], pv.shape[-1]
            outs.append(torch.zeros(1, hq, t, dv, dtype=torch.float64))
            none = torch.full((1, hq, t), -math.inf, dtype=torch.float64)
            lses.append(none if sinks is None else sinks.view(1, hq, 1).expand(1, hq, t))
            continue
        k = torch.cat((pk, sk[r, :, :length]), 1)[None]  # (1, h_kv, p + len, d)
        v = torch.cat((pv, sv[r, :, :length]), 1)[None]
        keep = torch.zeros(t, p + length, dtype=torch.bool)
        for i in range(t):
            pos = length - t + i  # the query's suffix position
            for j in range(p + length):
                keep[i, j] = j < p or (j - p) <= pos
        out, lse = ref_attention_lse(q[r : r + 1], k, v, keep=keep, sinks=sinks)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _loss_and_grads(fn, xs, g_out, g_lse):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out, lse = fn(*xs)
    loss = (out * g_out).sum() + (lse.masked_fill(~torch.isfinite(lse), 0.0) * g_lse).sum()
    if not loss.requires_grad:  # no key anywhere (the reference's constants)
        return out, lse, [None] * len(xs)
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    return out, lse, grads


@st.composite
def cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    s = draw(st.sampled_from([0, 1, 2, 5, 9]))
    d = draw(st.sampled_from([4, 7]))
    return {
        "n": draw(st.integers(1, 4)),
        "hkv": hkv,
        "hq": hkv * draw(st.sampled_from([1, 2, 3])),
        "t": draw(st.integers(1, max(1, s))),
        "p": draw(st.sampled_from([0, 1, 2, 13, 40])),
        "s": s,
        "d": d,
        "dv": draw(st.sampled_from([d, d + 2])),
        "ragged": draw(st.booleans()),
        "sinks": draw(st.booleans()),
        "backend": draw(st.sampled_from(["auto", "blockwise", "reference"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(
    max_examples=30,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(cases())
def test_cascade_equals_whole_sequence_float64(case):
    """Forward, lse and all gradients against the float64 reference: prefix/suffix
    lengths 0 and 1 included, decode (t = 1) and suffix prefill, GQA, padded suffixes."""
    n, s, t = case["n"], case["s"], case["t"]
    q, pk, pv, sk, sv, sinks = _inputs(
        n, case["hq"], case["hkv"], t, case["p"], s, case["d"], case["dv"], seed=case["seed"]
    )
    if case["ragged"]:
        gen = torch.Generator().manual_seed(case["seed"])
        lengths = torch.randint(0, s + 1, (n,), generator=gen)
    else:
        lengths = torch.full((n,), s)
    use_sinks = case["sinks"]
    gen = torch.Generator().manual_seed(1)
    g_out = torch.randn(n, case["hq"], t, case["dv"], generator=gen, dtype=torch.float64)
    g_lse = torch.randn(n, case["hq"], t, generator=gen, dtype=torch.float64)
    xs = [q, pk, pv, sk, sv, sinks]

    def ours(q_, pk_, pv_, sk_, sv_, sinks_):
        return cascade_attention(
            q_,
            pk_,
            pv_,
            sk_,
            sv_,
            suffix_lengths=lengths if case["ragged"] else None,
            sinks=sinks_ if use_sinks else None,
            return_lse=True,
            backend=case["backend"],
        )

    def ref(q_, pk_, pv_, sk_, sv_, sinks_):
        return _reference(q_, pk_, pv_, sk_, sv_, lengths, sinks_ if use_sinks else None)

    got = _loss_and_grads(ours, xs, g_out, g_lse)
    want = _loss_and_grads(ref, xs, g_out, g_lse)
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float64])
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    torch.testing.assert_close(got[1], want[1], **TOL[torch.float64])
    names = ["dq", "dprefix_key", "dprefix_value", "dsuffix_key", "dsuffix_value", "dsinks"]
    for name, a, b, x in zip(names, got[2], want[2], xs, strict=True):
        if name == "dsinks" and not use_sinks:
            continue
        a = torch.zeros_like(x) if a is None else a  # an empty prefix/suffix: no gradient
        b = torch.zeros_like(x) if b is None else b
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a, b, **TOL[torch.float64], msg=f"{name} ({case})")


@pytest.mark.parametrize("t", [1, 128], ids=["decode", "prefill"])
def test_cascade_equals_causal_attention_on_the_whole_sequence(t):
    """The brief's statement, through attnkit's own causal attention over prefix ++ suffix
    for every request: identical up to float64 rounding, forward and gradients."""
    n, hq, hkv, p, s, d = 3, 4, 2, 37, 128, 8
    q, pk, pv, sk, sv, _ = _inputs(n, hq, hkv, t, p, s, d, d)
    xs = [q, pk, pv, sk, sv]
    g = torch.randn(n, hq, t, d, dtype=torch.float64)

    def whole(q_, pk_, pv_, sk_, sv_):
        k = torch.cat((pk_.expand(n, -1, -1, -1), sk_), 2)  # (n, h_kv, p + s, d)
        v = torch.cat((pv_.expand(n, -1, -1, -1), sv_), 2)
        return attention(q_, k, v, causal=True, return_lse=True)

    got = _loss_and_grads(cascade_attention_lse, xs, g, torch.zeros(n, hq, t, dtype=torch.float64))
    want = _loss_and_grads(whole, xs, g, torch.zeros(n, hq, t, dtype=torch.float64))
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def cascade_attention_lse(*xs):
    return cascade_attention(*xs, return_lse=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_error_rule(dtype):
    """In float32 / bfloat16: the cascade's error against the float64 reference is at most
    twice that of plain attention in the same dtype (plus a tiny epsilon), out and grads."""
    n, hq, hkv, t, p, s, d = 4, 6, 2, 3, 97, 11, 16
    xs64 = list(_inputs(n, hq, hkv, t, p, s, d, d))[:5]
    xs = [x.to(dtype) for x in xs64]
    g = torch.randn(n, hq, t, d, dtype=torch.float64)

    def plain(q_, pk_, pv_, sk_, sv_):
        k = torch.cat((pk_.expand(n, -1, -1, -1), sk_), 2).repeat_interleave(hq // hkv, 1)
        v = torch.cat((pv_.expand(n, -1, -1, -1), sv_), 2).repeat_interleave(hq // hkv, 1)
        keep = torch.ones(t, p + s, dtype=torch.bool).tril(p + s - t)
        sc = (q_ @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~keep, -math.inf)
        return torch.softmax(sc.float(), -1).to(q_.dtype) @ v

    def run(fn, inputs):
        ins = [x.detach().clone().requires_grad_(True) for x in inputs]
        out = fn(*ins)
        grads = torch.autograd.grad((out.double() * g).sum(), ins)
        return [out.double(), *(x.double() for x in grads)]

    ref = run(plain, xs64)
    ours = run(cascade_attention, xs)
    base = run(plain, xs)
    for name, o, b, r in zip(
        ["out", "dq", "dpk", "dpv", "dsk", "dsv"], ours, base, ref, strict=True
    ):
        err, allowed = (o - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 2 * allowed + 1e-5, f"{name}: {err} > 2 * {allowed}"


def test_prefix_is_read_in_one_call(monkeypatch):
    """Every request's rows face the shared prefix in ONE attention call whose keys are
    the prefix itself (h_kv, p, d) — not once per request — and one call for the suffixes."""
    calls = []
    real = attnkit.cascade.attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), k.data_ptr()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(attnkit.cascade, "attention", spy)
    n, hq, hkv, t, p, s, d = 8, 6, 2, 1, 50, 4, 8
    q, pk, pv, sk, sv, _ = _inputs(n, hq, hkv, t, p, s, d, d)
    cascade_attention(q, pk, pv, sk, sv)
    assert len(calls) == 2
    (q_rows, k_shape, k_ptr), (q_suffix, k_suffix, _) = calls
    assert q_rows == (1, hkv, n * (hq // hkv) * t, d) and k_shape == (1, hkv, p, d)
    assert k_ptr == pk.data_ptr()  # the prefix tensor itself: no per-request copy
    assert q_suffix == (n, hkv, hq // hkv, d) and k_suffix == (n, hkv, s, d)  # GQA rows


def test_no_keys_at_all_gives_zeros_and_minus_inf():
    q, pk, pv, sk, sv, _ = _inputs(2, 2, 1, 1, 0, 0, 4, 4)
    out, lse = cascade_attention(q, pk, pv, sk, sv, return_lse=True)
    assert out.shape == (2, 2, 1, 4) and out.abs().max() == 0
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (dict(query=torch.randn(2, 4, 8)), ValueError, "query"),
        (dict(prefix_key=torch.randn(2, 2, 5, 8)), ValueError, "prefix_key"),
        (dict(suffix_key=torch.randn(3, 2, 3, 8)), ValueError, "suffix_key"),
        (dict(suffix_value=torch.randn(2, 2, 4, 8)), ValueError, "suffix_value"),
        (dict(prefix_value=torch.randn(2, 5, 8, dtype=torch.float64)), TypeError, "prefix_value"),
        (
            dict(prefix_key=torch.randn(3, 5, 8), prefix_value=torch.randn(3, 5, 8)),
            ValueError,
            "heads",
        ),
        (dict(suffix_lengths=torch.tensor([1, 4])), ValueError, "suffix_lengths"),
        (dict(suffix_lengths=torch.tensor([1.0, 2.0])), TypeError, "suffix_lengths"),
        (dict(suffix_lengths=torch.tensor([1])), ValueError, "suffix_lengths"),
        (dict(return_lse=1), TypeError, "return_lse"),
        (dict(sinks=torch.randn(3)), ValueError, "sinks"),
    ],
)
def test_bad_arguments_name_the_argument(change, error, words):
    args = dict(
        query=torch.randn(2, 4, 1, 8),
        prefix_key=torch.randn(2, 5, 8),
        prefix_value=torch.randn(2, 5, 8),
        suffix_key=torch.randn(2, 2, 3, 8),
        suffix_value=torch.randn(2, 2, 3, 8),
    )
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    with pytest.raises(error, match=words):
        cascade_attention(*args.values(), **kwargs)


def test_bench_runners_compute_the_same_attention():
    """The benchmark's two sides of each ratio compute the same thing (small sizes)."""
    from attnkit.bench import cascade_tree

    shape = {"h": 4, "h_kv": 2, "d": 8}
    for pattern in ("decode", "prefill"):
        kw = dict(pattern=pattern, t=40, dtype=torch.float64, n=3, own=5, **shape)
        ours = cascade_tree.runner("cascade", **kw)()
        theirs = torch.cat(cascade_tree.runner("independent", **kw)())  # type: ignore[arg-type]
        torch.testing.assert_close(ours, theirs, **TOL[torch.float64])
    # the sequential side costs what decoding 7 tokens costs (step i: the cache and the
    # i keys before it); nodes 0 and 1 (the root and its first child) see exactly those
    kw = dict(pattern="tree", t=40, dtype=torch.float64, nodes=7, **shape)
    tree = cascade_tree.runner("tree", **kw)()
    steps = cascade_tree.runner("sequential", **kw)()
    assert tree.shape == (1, 4, 7, 8) and len(steps) == 7  # type: ignore[union-attr, arg-type]
    for node in (0, 1):
        torch.testing.assert_close(tree[:, :, node : node + 1], steps[node], **TOL[torch.float64])  # type: ignore[index]


# -- the native kernel's one-call cascade (attention.cpp's cascade_call) -------------------


@pytest.fixture
def kernel_cascades(monkeypatch, isa) -> list[tuple]:
    """Record the one-call cascades the native kernel runs (once per build this CPU runs);
    a dispatch to attention() in the same call fails the test."""
    from attnkit.backends.blockwise import native

    seen: list[tuple] = []
    original = native.cascade

    def spy(pre, suf, prefix_key, *args, **kwargs):  # (the prefix pass's rows: its plan's)
        seen.append(((pre.b, pre.h, pre.t, prefix_key.shape[-1]), suf.t, suf.s))
        return original(pre, suf, prefix_key, *args, **kwargs)

    def no_dispatch(*args, **kwargs):
        raise AssertionError("the one-call cascade dispatched an attention() pass")

    monkeypatch.setattr(native, "cascade", spy)
    monkeypatch.setattr(attnkit.cascade, "attention", no_dispatch)
    return seen


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(1, 5),
    hkv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3, 4]),
    t=st.sampled_from([1, 1, 2, 7]),
    p=st.sampled_from([1, 63, 64, 130]),
    s=st.sampled_from([7, 65, 140]),
    d=st.sampled_from([16, 48, 64]),
    dv=st.sampled_from([16, 32, 64]),
    ragged=st.booleans(),
    sinks=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_one_kernel_call_equals_the_whole_sequence(
    kernel_cascades, n, hkv, groups, t, p, s, d, dv, ragged, sinks, dtype, seed
):
    """Both passes and their merge in one native call (no grad wanted): the flash-attn rule
    against the float64 reference, keys across chunk edges (64), GQA, padded suffixes
    (shorter than the queries too), value heads of another size, sinks, float32 and bf16,
    every build this CPU runs."""
    kernel_cascades.clear()  # (one list for every example)
    hq = hkv * groups
    xs64 = list(_inputs(n, hq, hkv, t, p, s, d, dv, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    # (a length under t: the rows before the suffix's first key see the prefix alone)
    lengths = torch.randint(0, s + 1, (n,), generator=gen) if ragged else torch.full((n,), s)
    sink = xs64[5] if sinks else None
    out, lse = cascade_attention(
        *(x.to(dtype) for x in xs64[:5]),
        suffix_lengths=lengths if ragged else None,
        sinks=None if sink is None else sink.to(dtype),
        return_lse=True,
    )
    assert kernel_cascades == [((1, hkv, n * groups * t, d), t, s)]
    # float64 of the inputs as the kernel and plain math both read them (rounded to the
    # dtype): the rule weighs each one's arithmetic, not the rounding of its inputs
    rounded = [x.to(dtype).double() for x in xs64]
    want, want_lse = _reference(*rounded[:5], lengths, rounded[5] if sinks else None)
    # plain attention in the same dtype, per request (the flash-attn rule's yardstick)
    q, pk, pv, sk, sv = (x.to(dtype) for x in xs64[:5])
    plain = []
    for r in range(n):
        k = torch.cat((pk, sk[r, :, : int(lengths[r])]), 1).repeat_interleave(groups, 0)
        v = torch.cat((pv, sv[r, :, : int(lengths[r])]), 1).repeat_interleave(groups, 0)
        own = torch.arange(k.shape[1]) - p  # suffix position of each key (< 0: prefix)
        keep = own.view(1, -1) <= int(lengths[r]) - t + torch.arange(t).view(-1, 1)
        keep |= own.view(1, -1) < 0  # the prefix, whole
        sc = (q[r] @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~keep, -math.inf)
        if sink is not None:  # a sink: one more logit, no value
            sc = torch.cat((sc, sink.to(dtype).view(hq, 1, 1).expand(hq, t, 1)), -1)
            v = torch.cat((v, torch.zeros_like(v[:, :1])), 1)
        plain.append(torch.softmax(sc.float(), -1).to(dtype) @ v)
    err_plain = (torch.stack(plain).double() - want).abs().max().item()
    err = (out.double() - want).abs().max().item()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)
    assert (lse.double() - want_lse).abs().max().item() <= 1e-4 * max(1.0, want_lse.abs().max())


def test_one_kernel_call_keeps_a_nan_to_its_own_rows(kernel_cascades):
    """A NaN in one request's own keys reaches that request's rows alone; one in the shared
    prefix reaches every row (as the two passes and attention() give)."""
    q, pk, pv, sk, sv, _ = (x.float() for x in _inputs(3, 4, 2, 1, 70, 9, 16, 16))
    sk[1, 0, 4, 2] = math.nan
    out, lse = cascade_attention(q, pk, pv, sk, sv, return_lse=True)
    nan_rows = out.isnan().any(-1)  # (n, h, t)
    assert nan_rows[1, :2].all() and not nan_rows[1, 2:].any()  # kv head 0's group only
    assert not nan_rows[0].any() and not nan_rows[2].any()
    assert torch.equal(lse.isnan(), nan_rows)
    pk[1, 3, 0] = math.nan
    assert cascade_attention(q, pk, pv, sk, sv)[:, 2:].isnan().all()  # kv head 1's rows
    assert len(kernel_cascades) == 2


def test_a_gradient_or_another_backend_takes_the_two_passes(isa, monkeypatch):
    """The kernel's cascade is forward only: with a gradient wanted, a backend other than
    auto/blockwise, or a scale <= 0, the two passes run (and give the same answer)."""
    from attnkit.backends.blockwise import native

    called: list[int] = []
    original = native.cascade
    monkeypatch.setattr(native, "cascade", lambda *a, **k: called.append(1) or original(*a, **k))
    q, pk, pv, sk, sv, _ = (x.float() for x in _inputs(2, 4, 2, 1, 100, 9, 16, 16))
    one = cascade_attention(q, pk, pv, sk, sv)
    assert called == [1]
    two = cascade_attention(q.requires_grad_(), pk, pv, sk, sv)
    plain = cascade_attention(q.detach(), pk, pv, sk, sv, backend="reference")
    assert called == [1]
    torch.testing.assert_close(one, two.detach(), **TOL[torch.float32])
    torch.testing.assert_close(one, plain, **TOL[torch.float32])
    for scale in (0.0, -0.3):  # attention() folds these into the query: two passes
        got = cascade_attention(q.detach(), pk, pv, sk, sv, scale=scale)
        want = cascade_attention(q.detach(), pk, pv, sk, sv, scale=scale, backend="reference")
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert called == [1]


@pytest.mark.parametrize("n", [1, 3])
def test_one_kernel_call_takes_strided_and_expanded_inputs(kernel_cascades, n):
    """A query whose last dim is strided (its stacked rows then too), one whose heads and
    positions are laid out the other way round (the kernel gathers the stacked rows with
    the query's own strides), a prefix expanded over its heads (stride 0) and suffixes
    sliced out of a longer cache: the same answer."""
    hq, hkv, t, p, s, d = 4, 2, 2, 90, 33, 32
    q, pk, pv, sk, sv, _ = (x.float() for x in _inputs(n, hq, hkv, t, p, s, d, d, seed=n))
    q_strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim stride t
    pk_one, pv_one = pk[:1], pv[:1]
    pk_expanded, pv_expanded = pk_one.expand(hkv, -1, -1), pv_one.expand(hkv, -1, -1)
    cache_k, cache_v = torch.cat((sk, sk), 2), torch.cat((sv, sv), 2)  # (n, h_kv, 2s, d)
    sk_slice, sv_slice = cache_k[:, :, :s], cache_v[:, :, :s]
    assert q_strided.stride(-1) != 1 and pk_expanded.stride(0) == 0
    out = cascade_attention(q_strided, pk_expanded, pv_expanded, sk_slice, sv_slice)
    q_swapped = q.transpose(1, 2).contiguous().transpose(1, 2)  # (n, hq, t, d), t outer
    assert q_swapped.stride(-1) == 1 and q_swapped.stride(1) < q_swapped.stride(2)
    out_swapped = cascade_attention(q_swapped, pk_expanded, pv_expanded, sk_slice, sv_slice)
    assert len(kernel_cascades) == 2
    want, _ = _reference(
        q.double(), pk_one.expand(hkv, -1, -1).double(), pv_one.expand(hkv, -1, -1).double(),
        sk.double(), sv.double(), torch.full((n,), s), None,
    )  # fmt: skip
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (out_swapped.double() - want).abs().max().item() < 1e-5


def test_a_repeated_cascade_is_planned_once_and_a_changed_one_anew(kernel_cascades, monkeypatch):
    """Every layer of a decode step makes the same cascade: its two plans are kept
    (plan_cache); a call of another size, scale, dtype or padding mask shape is planned
    again; a padded call of the same shape reuses them with its own lengths; and every
    answer meets the float64 reference."""
    from attnkit.backends.blockwise import plan as plan_module
    from attnkit.backends.blockwise import plan_cache

    planned: list[tuple] = []
    original = plan_module.build_plan

    def counting(q, k, **kwargs):
        planned.append(tuple(q.shape))
        return original(q, k, **kwargs)

    monkeypatch.setattr(plan_module, "build_plan", counting)
    plan_cache.clear()
    attnkit.cascade._lane.clear()  # (a call kept there from before would plan nothing)
    xs = [x.float() for x in _inputs(3, 4, 2, 1, 100, 9, 16, 16, seed=5)]
    q, pk, pv, sk, sv, _ = xs
    short = (q, pk[:, :70], pv[:, :70], sk, sv)
    lengths, other = torch.tensor([9, 4, 0]), torch.tensor([2, 9, 5])
    calls = [  # (inputs, options): the first one three times
        (xs[:5], {}), (xs[:5], {}), (xs[:5], {}), (short, {}), (xs[:5], {"scale": 0.3}),
        ([x.to(torch.bfloat16) for x in xs[:5]], {}), (xs[:5], {"suffix_lengths": lengths}),
        (xs[:5], {"suffix_lengths": lengths}), (xs[:5], {"suffix_lengths": other}),
        (short, {}),
    ]  # fmt: skip
    for inputs, options in calls:
        out = cascade_attention(*inputs, **options)
        rounded = [x.double() for x in inputs]
        if "scale" in options:  # (the reference scales by 1/sqrt(d): fold the rest into q)
            rounded[0] = rounded[0] * options["scale"] * math.sqrt(q.shape[-1])
        n_own = options.get("suffix_lengths", torch.full((3,), 9))
        want, _ = _reference(*rounded, n_own, None)
        tol = 1e-5 if inputs[0].dtype == torch.float32 else 2e-2
        assert (out.double() - want).abs().max().item() < tol
    # two plans (prefix, suffix) for each call planned: the first, the short prefix, the
    # new scale, bf16 and the first padded call; the repeats (padded ones with other
    # lengths included) and the short prefix again kept
    assert len(planned) == 2 * 5
    assert len(kernel_cascades) == len(calls)  # and every call ran in one kernel call


@pytest.mark.parametrize(
    ("t", "ragged", "route"),
    [
        (1, False, "forward"),
        (5, True, "suffix mask"),
        (1, True, "suffix mask"),
        (5, False, "cascade"),
    ],
)
def test_one_request_whose_suffix_follows_the_prefix_is_one_pass(
    isa, native_routes, t, ragged, route
):
    """One request whose suffix keys and values follow the prefix's in memory (one buffer
    split in two) runs ONE native forward over prefix ++ suffix, its mask (a padded
    suffix's, stacked for a GQA group's heads) over the suffix alone; a causal suffix of
    several queries and no mask keeps the cascade's two passes (its band differs row by
    row once the heads are stacked). Both within the flash-attn rule of float64."""
    hq, hkv, p, s, d = 6, 2, 70, 37, 32
    q64, *_ = _inputs(1, hq, hkv, t, p, s, d, d, seed=t)
    g = torch.Generator().manual_seed(3)
    keys64, values64 = (
        torch.randn(1, hkv, p + s, d, generator=g, dtype=torch.float64) for _ in "kv"
    )
    lengths = torch.tensor([s - 4 if ragged else s])
    parts64 = (keys64[0, :, :p], values64[0, :, :p], keys64[:, :, p:], values64[:, :, p:])
    want, _ = _reference(q64, *parts64, lengths, None)
    q, keys, values = (x.float() for x in (q64, keys64, values64))
    parts = (keys[0, :, :p], values[0, :, :p], keys[:, :, p:], values[:, :, p:])
    with torch.no_grad():
        got = cascade_attention(q, *parts, suffix_lengths=lengths if ragged else None)
    assert native_routes == [route]
    # the yardstick: plain attention in float32 over prefix ++ suffix (cast back)
    plain = attention(
        q, keys, values, mask=_keep(t, p, int(lengths[0]), s), scale=1 / math.sqrt(d),
        backend="reference",
    )  # fmt: skip
    plain_err = (plain.double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2 * plain_err + 1e-6


def _keep(t: int, p: int, length: int, s: int) -> torch.Tensor:
    """``(t, p + s)`` bool: the prefix whole, the suffix's first ``length`` keys causally
    (queries at the suffix's last ``t`` positions of ``length``)."""
    j = torch.arange(p + s).view(1, -1) - p  # suffix position of each key (< 0: prefix)
    i = torch.arange(t).view(-1, 1) + length - t
    return (j < 0) | ((j <= i) & (j < length))


# -- the cascade lane (cascade.py's _lane: a repeated plain call straight to the kernel) ---


def test_a_repeated_plain_cascade_runs_in_the_lane_on_its_own_tensors(isa, monkeypatch):
    """(feature "cascade lane") A plain cascade of several requests that the kernel ran as
    given is kept under its tensors' shapes, strides, dtypes and devices: the next call of
    that key, with other tensors, skips the checks and the plans (made to fail here) and
    gives the bits the full path gives for those tensors (3-D prefix, lse, bf16 too)."""
    from attnkit import cascade

    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.bfloat16 and not attnkit.backends.blockwise.native.reads_bf16():
            continue
        first, second = (
            [x.to(dtype) for x in _inputs(3, 4, 2, 1, 130, 9, 16, 16, seed=seed)[:5]]
            for seed in (1, 2)
        )
        cascade._lane.clear()
        full = cascade_attention(*second, return_lse=True)  # (the full path: kept)
        cascade._lane.clear()
        cascade_attention(*first, return_lse=True)
        assert len(cascade._lane) == 1
        with monkeypatch.context() as m:
            m.setattr(cascade, "_check", _fails)
            m.setattr(cascade, "fused_native", _fails)
            got = cascade_attention(*second, return_lse=True)
        assert got[0].dtype == dtype
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])
        want, _ = _reference(*(x.double() for x in second), torch.full((3,), 9), None)
        assert (got[0].double() - want).abs().max().item() < (
            1e-5 if dtype == torch.float32 else 3e-2
        )


def test_the_cascade_lane_leaves_other_calls_to_the_full_path(isa, monkeypatch):
    """Not taken: other strides (a key of their own, planned and kept anew), a gradient
    wanted, suffix lengths, a scale or sinks given; a call whose tensors the kernel could
    not read as given (copied) or of one request (its route depends on where its suffix
    lies) is not kept. Each answer is the full path's."""
    from attnkit import cascade

    q, pk, pv, sk, sv = (x.float() for x in _inputs(3, 4, 2, 1, 130, 9, 16, 16, seed=3)[:5])
    ran: list[str] = []
    real = cascade.run_lane
    monkeypatch.setattr(
        cascade, "run_lane", lambda kept, *a, **k: ran.append(kept[0]) or real(kept, *a, **k)
    )
    cascade._lane.clear()
    cascade_attention(q, pk, pv, sk, sv)
    # the query a slice of a wider tensor: the same shape, other strides, another key
    q_t = torch.cat((q, q), -1)[..., :16]
    out = cascade_attention(q_t, pk, pv, sk, sv)
    assert ran == [] and len(cascade._lane) == 2
    assert torch.equal(out, cascade_attention(q, pk, pv, sk, sv))
    assert ran == ["two passes"]
    others = [
        dict(suffix_lengths=torch.tensor([9, 3, 0])), dict(scale=0.25),
        dict(sinks=torch.zeros(4)),
    ]  # fmt: skip
    for options in others:
        cascade_attention(q, pk, pv, sk, sv, **options)
    cascade_attention(q.clone().requires_grad_(), pk, pv, sk, sv)
    assert ran == ["two passes"]
    # the kernel's split-KV ranges, which the kept arguments hold, are part of the key
    monkeypatch.setattr(attnkit.backends.blockwise.native, "KV_SPLITS", 3)
    cascade_attention(q, pk, pv, sk, sv)
    assert ran == ["two passes"] and len(cascade._lane) == 3
    # a value read through a last dim of stride 2 (copied) and one request: not kept
    cascade._lane.clear()
    wide = torch.stack((sv, sv), -1)[..., 0]  # (n, h_kv, s, d_v), last dim stride 2
    cascade_attention(q, pk, pv, sk, wide)
    cascade_attention(q[:1], pk, pv, sk[:1], sv[:1])
    assert len(cascade._lane) == 0


def _fails(*args, **kwargs):
    raise AssertionError("the lane ran the full path")
