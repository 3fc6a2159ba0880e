"""Traced mask_mods generated into the native kernel's mask test (mod_graph -> native/codegen.py
``attnkit_mask_row``), on every ISA build this CPU runs: a block mask built from a traceable
mask_mod stores no partial tile, and the kernel makes each partial tile's rows itself.

Proved here: the project's mod catalogue (its mask mods) gives bit-identical outputs and
dq/dk/dv through the generated path and through stored tiles (``generated=False``), and
matches float64 with flash-attn's 2x rule; tiles cross the kernel's 64-key chunks both ways
(key tiles a multiple of 64 read in place, others assembled a chunk at a time); sliced
masks (query offsets), snapshots of captured tensors, the tiles other readers evaluate, a
fuzzer of random integer masks, and every fallback keeping its tiles with its reason.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import attention, explain_dispatch
from attnkit import mod_graph as G
from attnkit.backends.blockwise.native import mask_codegen
from attnkit.block_mask import create_block_mask
from tests.conftest import kernel_isas
from tests.test_mods_catalogue import CATALOGUE

pytestmark = pytest.mark.usefixtures("one_thread", "isa")

B, HQ, HKV, D = 2, 4, 2, 16
MASK_MODS = [n for n, e in CATALOGUE.items() if e.kind == "mask"]


def _qkv(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, t, D, generator=g) for n in (HQ, HKV, HKV)]


def _run(q, k, v, bm, g_out):
    """``(out, dq, dk, dv)`` through the blockwise backend (the native kernel)."""
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = attention(*xs, block_mask=bm, backend="blockwise")
    return (out, *torch.autograd.grad((out * g_out).sum(), xs))


def _reference(q, k, v, keep, g_out, dtype):
    """``(out, dq, dk, dv)`` of dense attention in ``dtype`` with the bool ``keep``."""
    xs = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    kk, vv = (x.repeat_interleave(HQ // HKV, 1) for x in xs[1:])
    s = (xs[0] @ kk.transpose(-2, -1) / math.sqrt(D)).masked_fill(~keep, -math.inf)
    out = torch.softmax(s, -1) @ vv
    return (out, *torch.autograd.grad((out * g_out.to(dtype)).sum(), xs))


def _explain(q, k, v, bm) -> str:
    return explain_dispatch(q, k, v, block_mask=bm, backend="blockwise")


def _same_bits(a, b, what):
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b, strict=True):
        assert torch.equal(x, y), f"{what}: {name} differs ({(x - y).abs().max():.3g})"


@pytest.mark.parametrize("block", [16, (16, 48), 64])
@pytest.mark.parametrize("name", MASK_MODS)
def test_catalogue_mask_generated_equals_stored_tiles(name, block):
    """Every mask mod of the catalogue: its block mask stores no tile, the kernel makes
    them, and outputs and gradients are bitwise those of the stored-tile path, and within
    flash-attn's 2x rule of float64 (the entry's own dense mask)."""
    entry = CATALOGUE[name]
    mod, _ = entry.make()
    t = entry.length
    gen = create_block_mask(mod, B, HQ, t, t, block_size=block)
    stored = create_block_mask(mod, B, HQ, t, t, block_size=block, generated=False)
    assert not gen.stored and gen.stored_why is None and stored.stored
    assert torch.equal(gen.block_kind, stored.block_kind)
    q, k, v = _qkv(t, seed=len(name))
    why = _explain(q, k, v, gen)
    assert "forward: native_cpu" in why and "backward: native_cpu" in why, why
    assert "partial tiles made in the kernel" in why or "read as a band" in why, why
    g_out = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(1))
    ours = _run(q, k, v, gen, g_out)
    _same_bits(ours, _run(q, k, v, stored, g_out), name)
    i, j = torch.arange(t).view(1, 1, -1, 1), torch.arange(t).view(1, 1, 1, -1)
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(HQ).view(1, -1, 1, 1)
    keep = torch.as_tensor(entry.dense(i, j, b, h)).expand(B, HQ, t, t)
    ref = _reference(q, k, v, keep, g_out, torch.float64)
    plain = _reference(q, k, v, keep, g_out, torch.float32)
    for what, a, p, r in zip(("out", "dq", "dk", "dv"), ours, plain, ref, strict=True):
        err, plain_err = (a.double() - r).abs().max(), (p.double() - r).abs().max()
        assert err <= 2 * plain_err + 2e-6, f"{what}: {err:.3g} vs plain {plain_err:.3g}"


def _dilated(b, h, q, kv):
    """A fully partial mask (every tile mixed): causal, dilated by 3, and the diagonal."""
    return ((q - kv) % 3 == 0) & (kv <= q) | ((q // 7) % 2 == (kv // 5) % 2) & (kv > q + 40)


@pytest.mark.parametrize("block", [128, 96, (64, 192)])
def test_whole_chunks_and_assembled_chunks(block):
    """T=300 over whole 64-key chunks: key tiles a multiple of 64 (rows made in the Masker)
    and not (rows assembled a chunk at a time); bitwise the stored path, and the mask
    evaluated by other readers (to_dense, partial_masks) equal to the stored one."""
    t = 300
    gen = create_block_mask(_dilated, None, None, t, t, block_size=block)
    stored = create_block_mask(_dilated, None, None, t, t, block_size=block, generated=False)
    assert not gen.stored
    assert torch.equal(gen.to_dense(), stored.to_dense())
    assert torch.equal(gen.partial_masks, stored.partial_masks)
    q, k, v = _qkv(t, seed=7)
    assert "partial tiles made in the kernel" in _explain(q, k, v, gen)
    g_out = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(2))
    _same_bits(_run(q, k, v, gen, g_out), _run(q, k, v, stored, g_out), "dilated")


@pytest.mark.parametrize(("start", "stop"), [(128, 300), (37, 250), (0, 1)])
def test_sliced_mask_keeps_its_offset(start, stop):
    """``bm[:, :, start:stop]`` of a generated mask: row 0 is query ``start`` (aligned
    slices share the kinds, others are rebuilt), bitwise the stored mask's slice."""
    t = 300
    gen = create_block_mask(_dilated, None, None, t, t, block_size=64)[:, :, start:stop]
    stored = create_block_mask(_dilated, None, None, t, t, block_size=64, generated=False)
    stored = stored[:, :, start:stop]
    assert not gen.stored and gen.graph_q_offset == start
    assert torch.equal(gen.to_dense(), stored.to_dense())
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, stop - start, D, generator=g)
    k, v = (torch.randn(B, HKV, t, D, generator=g) for _ in range(2))
    g_out = torch.randn(q.shape, generator=g)
    _same_bits(_run(q, k, v, gen, g_out), _run(q, k, v, stored, g_out), "sliced")


def test_a_generated_mask_reads_a_snapshot_of_its_tensors():
    """A captured tensor mutated in place after the block mask was built changes neither
    its kinds nor the rows the kernel makes (as stored tiles would not change)."""
    t = 200
    docs = torch.arange(t) // 50

    def same_doc(b, h, q, kv):
        return docs[q] == docs[kv]

    gen = create_block_mask(same_doc, None, None, t, t, block_size=64)
    stored = create_block_mask(same_doc, None, None, t, t, block_size=64, generated=False)
    docs[:] = torch.arange(t) // 30  # different documents now
    q, k, v = _qkv(t, seed=4)
    g_out = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(5))
    _same_bits(_run(q, k, v, gen, g_out), _run(q, k, v, stored, g_out), "snapshot")


def test_documents_of_any_length_share_one_library():
    """A per-sequence document mask over captured ids of another length (a longer packed
    batch: the ids' row stride changes) reuses the generated library (sizes and strides
    come with the call), and each length's rows are those of stored tiles."""
    texts = []
    real = mask_codegen.cached_library

    def spy(text, *args):
        texts.append(text)
        return real(text, *args)

    mp = pytest.MonkeyPatch()
    mp.setattr(mask_codegen, "cached_library", spy)
    try:
        for t, size in ((70, 30), (129, 50), (200, 64)):
            docs = torch.stack([torch.arange(t) // size, (torch.arange(t) + 7) // (size // 2)])

            def same_doc(b, h, q, kv, docs=docs):
                return docs[b][q] == docs[b][kv]

            gen = create_block_mask(same_doc, B, None, t, t, block_size=32)
            stored = create_block_mask(same_doc, B, None, t, t, block_size=32, generated=False)
            assert not gen.stored
            q, k, v = _qkv(t, seed=t)
            g_out = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(t))
            _same_bits(_run(q, k, v, gen, g_out), _run(q, k, v, stored, g_out), f"T={t}")
    finally:
        mp.undo()
    assert len(texts) == 3 and len(set(texts)) == 1


def _float_mask(b, h, q, kv):
    """Float ops rounded as torch rounds them: a true division by 3 (not a product with
    its reciprocal), products and sums (no FMA contraction), sqrt, floor, casts."""
    x = (q * kv + 1).float() * 0.37
    u, w = q.float() * 0.1, kv.float() * 0.3
    thirds = x / 3.0 * 3.0 == x  # a product with 1/3 rounds differently for many x
    fused = u * w - u * w == 0.0  # an FMA would leave the first product's rounding error
    return (thirds ^ fused ^ (torch.sqrt(x) < 9.5)) | (torch.floor(u) == torch.floor(w))


def test_float_mask_rounds_as_torch():
    """A mask with float arithmetic is generated, and keeps exactly the stored tiles' keys
    (the generated code rounds each float op once, as torch does)."""
    t = 257
    gen = create_block_mask(_float_mask, None, None, t, t, block_size=64)
    stored = create_block_mask(_float_mask, None, None, t, t, block_size=64, generated=False)
    assert not gen.stored
    q, k, v = _qkv(t, seed=9)
    g_out = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(9))
    _same_bits(_run(q, k, v, gen, g_out), _run(q, k, v, stored, g_out), "float mask")


def _erf_mask(b, h, q, kv):
    return (torch.erf((q - kv) * 0.1) > -0.5) & ((q * kv) % 5 != 1)  # (not a band)


def _exp_mask(b, h, q, kv):
    return (torch.exp((kv - q) * 0.05) > 0.2) & ((q * kv) % 5 != 1)


_HEAD_W = torch.tensor([[1.0, -2.0], [0.5, 0.25]])


def _reduction(b, h, q, kv):
    return ((_HEAD_W[h % 2].sum() > 0) | (q >= kv)) & ((q * kv) % 5 != 1)  # a reduction


@pytest.mark.parametrize(
    ("mod", "reason"),
    [
        (_erf_mask, "torch.erf is not in the supported set"),
        (_exp_mask, "a float torch.exp"),
        (_reduction, "does not trace"),
    ],
)
def test_fallbacks_store_their_tiles_with_a_reason(mod, reason):
    """A mask_mod that does not trace, or whose float ops the generated code might round
    differently from torch (exp), keeps its stored tiles; explain_dispatch says why, and
    the answer is the reference's."""
    t = 150
    bm = create_block_mask(mod, None, None, t, t, block_size=64)
    assert bm.stored and bm.mask_graph is None and reason in str(bm.stored_why), bm.stored_why
    q, k, v = _qkv(t, seed=6)
    why = _explain(q, k, v, bm)
    assert "forward: native_cpu" in why and "partial tiles stored (" in why, why
    assert reason in why, why
    i, j = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    keep = mod(0, 0, i, j).expand(t, t)  # these mods also run on index grids
    assert torch.equal(bm.to_dense()[0, 0], keep)
    out = attention(q, k, v, block_mask=bm, backend="blockwise")
    g_out = torch.zeros_like(out)
    ref = _reference(q, k, v, keep, g_out, torch.float64)[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    t=st.integers(1, 200),
    block=st.sampled_from([16, 48, 64, 128]),
    a=st.integers(-3, 3),
    c=st.integers(-3, 3),
    m=st.integers(1, 9),
    r=st.integers(0, 9),
    lo=st.integers(-50, 50),
    ids=st.booleans(),
)
def test_fuzz_integer_masks(t, block, a, c, m, r, lo, ids):
    """Random integer masks (linear forms, floor modulo, comparisons, a table load with a
    computed index, and/or): generated == stored tiles, bit for bit."""
    table = torch.randint(0, 3, (t,))

    def mod(b, h, q, kv):
        keep = ((a * q + c * kv) % m < r) | (kv - q > lo)
        if ids:
            keep = keep & (table[q] == table[kv]) | (h == 1)
        return keep

    gen = create_block_mask(mod, None, HQ, t, t, block_size=block)
    stored = create_block_mask(mod, None, HQ, t, t, block_size=block, generated=False)
    assert not gen.stored
    q, k, v = _qkv(t, seed=t)
    g_out = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(t))
    _same_bits(_run(q, k, v, gen, g_out), _run(q, k, v, stored, g_out), "fuzz")


def test_generated_mask_cross_compiles_for_neon(tmp_path):
    """A mask row function (int and float ops, bool and int loads, b and h read) compiles
    for aarch64 NEON (W = 4) with the cross compiler, FMA contraction off."""
    if os.environ.get("ATTNKIT_NATIVE_ISA") != kernel_isas()[0]:
        pytest.skip("once per run")
    gxx = shutil.which("aarch64-linux-gnu-g++")
    if gxx is None:
        pytest.skip("needs aarch64-linux-gnu-g++ (Debian: g++-aarch64-linux-gnu)")
    flags = torch.tensor([True, False] * 45)
    docs = torch.arange(90) // 10

    def mod(b, h, q, kv):
        near = (q * 0.5 + kv * 0.25 < 40.0) | (torch.sqrt((q - kv).abs().float()) < 3.0)
        return near & flags[kv] & (docs[q] == docs[kv]) | ((h + b) % 3 == 1)

    graph = G.trace(mod, "mask")
    assert mask_codegen.mask_why_not(graph) is None
    src = tmp_path / "mask.cpp"
    src.write_text(mask_codegen.mask_source(graph, set(), True, True))
    run = subprocess.run(
        [gxx, "-std=c++17", "-O2", "-march=armv8-a", "-ffp-contract=fast", "-fPIC", "-c",
         "-I", str(Path(mask_codegen.__file__).parent), "-o", str(tmp_path / "mask.o"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("backend", ["blockwise-tiles", "blockwise-flash", "reference"])
def test_other_engines_evaluate_a_generated_mask(backend):
    """The PyTorch-op engines and the dense reference read a generated mask's tiles by
    evaluating its graph where they ask: the same outputs and gradients as its stored
    tiles give them (these engines are not bitwise the kernel: compared with themselves)."""
    if os.environ.get("ATTNKIT_NATIVE_ISA") != kernel_isas()[0]:
        pytest.skip("once per run: no native build is involved")
    t = 150
    gen = create_block_mask(_dilated, B, None, t, t, block_size=32)
    stored = create_block_mask(_dilated, B, None, t, t, block_size=32, generated=False)
    q, k, v = _qkv(t, seed=11)
    g_out = torch.randn(B, HQ, t, D, generator=torch.Generator().manual_seed(11))
    runs = []
    for bm in (gen, stored):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = attention(*xs, block_mask=bm, backend=backend)
        runs.append((out, *torch.autograd.grad((out * g_out).sum(), xs)))
    _same_bits(runs[0], runs[1], backend)


def test_block_mask_bench_measures_both_paths():
    """``python -m attnkit.bench.block_masks``'s build row at toy size: the generated mask
    holds no tile (kinds and indices only), the stored one a tile per partial tile."""
    if os.environ.get("ATTNKIT_NATIVE_ISA") != kernel_isas()[0]:
        pytest.skip("once per run")
    from attnkit.bench import block_masks

    row = block_masks.build_row(512, 1)
    tiles = row["stored"]["partial_tiles"]
    assert tiles == row["generated"]["partial_tiles"] == 16  # every one of the 4 x 4 tiles
    assert row["stored"]["bytes"] - row["generated"]["bytes"] == tiles * 128 * 128
