"""attnkit's own CPU kernel (``attention.cpp``): the fused engine's first choice.

torch's fused CPU flash kernel is fast on long unmasked rows, but a masked call runs it
on many small tiles (a window's band, a document's blocks), each with a float mask
tensor, at well below its peak. This kernel walks a plan's tiles itself: for each block
of query rows it visits only the key chunks that causal/window bounds (a band of
diagonals ``lo <= j - i <= hi``) and a :class:`~attnkit.BlockMask` (its stored bool
tiles, read in place) leave, applies a ``mask`` tensor (bool, or float added; read in
place through its broadcast strides), adds a relative bias (``masks.alibi``,
``masks.relative_bias``: one vector per head) in-tile, runs any other ``score_mod`` that
:mod:`attnkit.mod_graph` traces as generated row functions (:mod:`.codegen`, forward and
backward, its tensors' gradients included), and keeps the FlashAttention
running max and sum per row: a row is alive when one key survives every mask at once.

:func:`forward` returns the output and the log-sum-exp; :func:`backward` recomputes the
weights from them (FlashAttention-2's backward in one pass, dQ partials summed in a
fixed order). A plan runs here when :func:`why_not` (:func:`why_not_backward`) finds
nothing against it (asked once per call, by :mod:`..engines`); otherwise the engine's
torch-kernel paths run. The library is built on first use (:mod:`.build`); where it
cannot be, nothing changes but speed. float32 arithmetic; bf16 inputs on an avx512-bf16
or avx512-amx build compute every product with bf16 products (vdpbf16ps, or AMX tiles;
float32 softmax and sums), forward and backward; other builds read a bf16 forward as it
is (a decode step converts keys and values as it reads them, any other call converts q
to float32 once, inside the kernel, its keys as it packs them and its values as the P V
product loads them, or once where a head has more than one query block) and have a bf16
backward upcast first (:func:`reads_bf16`); float16 is upcast, float64 runs on torch's
kernel.

A decode step (at most :data:`DIRECT_ROWS` query rows per key/value head, contiguous or
paged) reads the keys and values where they are (bf16 ones converted as read, products
in float32) instead of packing them, skipping every weight of exactly 0 (a key the mask
removes never reaches the row, NaN or not), and a call with few query blocks splits its
keys into ranges merged by their log-sum-exps (split-KV decoding; :data:`KV_SPLITS`;
docs/serving.md).
"""

from __future__ import annotations

import ctypes
from typing import Literal, overload

import torch

from attnkit import mod_graph
from attnkit.backends.blockwise.native import abi, calibrate, codegen, mask_codegen
from attnkit.backends.blockwise.native.build import library, status, warn_once
from attnkit.backends.blockwise.plan import Band, TilePlan
from attnkit.block_mask import PARTIAL
from attnkit.paged_kv_cache import check_page_ids

__all__ = [
    "BACKWARD_BLOCK_Q",
    "BACKWARD_BLOCK_Q_AMX",
    "BLOCK_Q",
    "KEY_CHUNK",
    "available",
    "backward",
    "backward_block_q",
    "bf16",
    "cascade",
    "explain_block_mask",
    "forward",
    "forward_paged",
    "isa",
    "mask_program",
    "score_mod_program",
    "status",
    "why_not",
    "why_not_backward",
]

#: Query rows per block of the kernel's forward (a block mask's own rows when there is
#: one): a multiple of every build's register tile height and vector width (AVX2: 3 rows
#: and 8 floats; AVX-512: 6 and 16; NEON: 6 and 4), so that no block ends in a short
#: tile. Against 128 rows the forward took 0.974-0.989x the time on the AVX2 build and
#: 0.993-0.998x on AVX-512 (causal, T=1024-8192, session 25).
BLOCK_Q = 144
#: ... and of its backward (:func:`backward_block_q`): 96 rows, against 128 0.961-0.975x
#: the backward's time on AVX2, 0.978x on AVX-512 and 0.980x in bf16 on avx512-bf16
#: (causal T=8192, 2 threads; the same at T=2048; session 35; 144 measured no faster in
#: session 25) ...
BACKWARD_BLOCK_Q = 96
#: ... but 128 where bf16 products run on AMX tiles (96 rows there: 1.024x, 72: 1.41x).
BACKWARD_BLOCK_Q_AMX = 128
#: Keys per chunk inside the kernel (``KC`` in attention.cpp); the relative bias vector
#: is padded to whole chunks.
KEY_CHUNK = 64
#: Split-KV decoding (attention.cpp's ``kv_splits``): 0 = the kernel cuts the keys of a
#: call with few query blocks into ranges chosen from the shapes alone (every thread count
#: gives the same bits), 1 = never; tests set it to compare the two.
KV_SPLITS = 0
#: Below this many multiply-adds a paged call runs on the calling thread alone (waking
#: another costs more than it saves). Was 2**20, set when the kernel woke a pool of its
#: own; on torch's OpenMP threads, a 2-core Zen 4 (session 17, 12 or 4 heads, d=64, fp32
#: and bf16, pages of 16) ran every paged step from 2**16 multiply-adds faster on 2
#: threads: 0.94x at 2**16, 0.76-0.87x at 2**17-2**18, 0.60-0.75x at 2**19-2**21.
PAGED_ONE_THREAD = 2**16
#: Dense float32 forward plans with few query rows per key/value head go to torch's fused
#: kernel where it is faster (the kernel packs every key, 8 x 8 transposes, for few
#: products). Measured on a 2-core AMD EPYC Zen 5 (d=64, 2 heads, 2 threads, with the LSE,
#: 1024-16384 keys, native / torch's kernel, noisy to ~10%): the 16-float builds took
#: 0.95-1.3x at 9-10 rows, 0.8-1.08x at 12 and 0.64-0.87x from 16 (FEW_ROWS[16] = 12);
#: the AVX2 build (torch held to AVX2) 1.04-1.2x at 16 rows, 1.0-1.3x at 32-40 and
#: 0.86-1.09x at 48-64 (FEW_ROWS[8] = 48; NEON, unmeasured, as AVX2). Up to DIRECT_ROWS
#: rows (attention.cpp's DIRECT_ROWS) the kernel reads the keys in place and splits them
#: across the threads; whether that beats torch's own decode step is measured on each
#: machine (:func:`decode_pays`).
#: DIRECT_ROWS is the one decode bound of the kernel, contiguous and paged alike (a paged
#: decode step of rows of different lengths, ``paged_decode``, is taken only this way);
#: inside blockwise such a step always runs here (see :func:`why_not`).
#: ``ATTNKIT_NATIVE_SPEED=fast`` (the tests) lets the kernel run these too.
DIRECT_ROWS = 8
FEW_ROWS = {16: 12, 8: 48, 4: 48}
#: ``mask_kind`` of attention.cpp.
_MASK_BOOL, _MASK_FLOAT = 1, 2


def _kernel(name: str):
    """``attnkit_forward`` or ``attnkit_backward`` of the library (typed and ABI-checked
    when it was loaded)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"attnkit's native kernel is not available: {status()}")
    return getattr(lib, name)


def isa() -> str | None:
    """The instruction set of the loaded build (``"avx512-amx"``, ``"avx512-bf16"``,
    ``"avx512"``, ``"avx2"``, ``"neon"``), or None when there is none."""
    lib = library()
    return None if lib is None else lib.attnkit_isa().decode()


def backward_block_q(dtype: torch.dtype) -> int:
    """Query rows per block of the kernel's backward of ``dtype`` inputs on the loaded
    build (:data:`BACKWARD_BLOCK_Q`, :data:`BACKWARD_BLOCK_Q_AMX`)."""
    amx = dtype == torch.bfloat16 and isa() == "avx512-amx"
    return BACKWARD_BLOCK_Q_AMX if amx else BACKWARD_BLOCK_Q


def bf16() -> bool:
    """Whether the loaded build computes bf16 inputs with bf16 products (AVX512_BF16, and
    AMX tiles on an avx512-amx build): every product in bf16 with float32 softmax and
    accumulators, forward and backward."""
    lib = library()
    return lib is not None and bool(lib.attnkit_bf16())


def reads_bf16(with_backward: bool = False) -> bool:
    """Whether the loaded build reads a bf16 call's tensors as they are, with no float32
    copy made by the caller: every call on a build with bf16 products (:func:`bf16`), and
    on every build a forward without a backward (a decode step, at most
    :data:`DIRECT_ROWS` query rows per key/value head, converts keys and values as it
    reads them; any other forward converts q to float32 once inside the kernel, into a
    buffer it reuses, and its keys as it packs them and its values once, or, where one
    block of rows reads a kv head, both a chunk at a time in that block: attention.cpp's
    "bf16 read" and "bf16 in item"). The one rule the engines,
    :func:`why_not` and :mod:`attnkit.paged_attention` ask.

    (Before it, an AVX2 build upcast a bf16 decode step's whole cache to float32 on every
    step, and a paged one gathered its pages first: 2.2 and 12.5 ms a GPT-2-small step
    against 4096 keys on a Zen 3, where a float32 step took 1.3 ms. Other forwards were
    upcast by torch into three new tensors a call until session 11.)"""
    if not available():
        return False
    return bf16() or not with_backward


def available() -> bool:
    """Whether the kernel is built and loaded (see :func:`status` when it is not)."""
    return library() is not None


def why_not(
    plan: TilePlan,
    dtype: torch.dtype,
    d: int,
    d_v: int,
    *,
    paged: bool = False,
    call_dtype: torch.dtype | None = None,
    with_backward: bool = False,
    one_of_two: bool = False,
) -> str | None:
    """Why the kernel cannot run this fused plan (CPU tensors) on the engine's views of
    ``dtype`` (None when it can): it takes float32 (bf16 on a build with bf16 products),
    value heads a multiple of 16 wide, causal/window bounds, a block mask, a ``mask`` tensor, a
    relative bias, and any ``score_mod`` that compiles (:func:`score_mod_program`), not
    under ``torch.compile``. Asked once per call, by :mod:`..engines` (and by
    :mod:`attnkit.paged_attention` with ``paged``: no torch kernel reads paged keys, so the
    speed measured against torch's does not apply). ``call_dtype``: the dtype of the call's
    own tensors (default ``dtype``), whose measured speed (:func:`.calibrate.speed`, for
    the plan's length) decides dense plans; ``with_backward``: the call runs a backward
    too, so its forward is judged by the measured forward+backward speed (what the call
    will cost as a whole, not the forward alone); ``one_of_two``: the plan is one pass of
    a call that runs two (:func:`cascade`), so the few-rows bound, which weighs one
    call's Python and packing against torch's kernel, is not the question (the measured
    speed still is)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return "the native kernel runs float32 (and bf16) tensors"
    if dtype == torch.bfloat16 and not reads_bf16(with_backward):
        return (
            "a bf16 backward needs a build with bf16 products (avx512-bf16, avx512-amx; a "
            "forward without a backward reads bf16 on every build)"
        )
    if d_v % 16 or d == 0:
        return "the native kernel needs value heads a multiple of 16 wide"
    if plan.mask_mod is not None:
        return "a mask_mod not made a block mask"
    if plan.t == 0 or plan.s == 0:
        return "no queries or no keys"
    bm = plan.block_mask
    if bm is not None and (
        bm.device.type != "cpu"
        or (plan.t, plan.s) != (bm.Q_LEN, bm.KV_LEN)
        or bm.block_kind.shape[0] not in (1, plan.b)
        or bm.block_kind.shape[1] not in (1, plan.h)
    ):
        return "a block mask of other sizes or on another device"
    if torch.compiler.is_compiling():
        return "under torch.compile (a foreign call)"
    if not available():
        warn_once()
        return status()
    if plan.score_mod is not None and getattr(plan.score_mod, "relative", None) is None:
        program = score_mod_program(plan)  # (compiled once, by the first call that asks)
        if isinstance(program, str):
            return f"a score_mod not compiled ({program})"
    if paged or not _dense(plan) or calibrate.measuring():
        return None  # (no torch kernel reads pages; the measurement runs the kernel itself)
    rows = plan.t * (plan.h // plan.h_kv)  # query rows each kv head's keys serve
    if rows <= DIRECT_ROWS and not with_backward and calibrate.forced() is None:
        # A decode step reads the cache in place, split across the threads: inside
        # blockwise its other engine is torch's kernel through the tile plan, which the
        # kernel beat at every decode size measured (session 12, Zen 3, with the LSE:
        # 0.47-0.92x on 2 threads, 0.59-1.01x on 1, 64-16384 keys). Whether blockwise
        # takes the step at all, against SDPA, is auto's question (decode_pays). Decided
        # before the calibration, which times a prefill (and measures on its first use).
        return None
    call_dtype = call_dtype or dtype
    biased = plan.score_mod is not None  # (a relative bias: dense runs no other score_mod)
    # dense: torch's runs them too (a relative bias on its tiles: measured apart)
    speed = calibrate.speed(call_dtype, plan.s, bias=biased)
    ok, ratio = (
        (speed.backward_ok, speed.backward) if with_backward else (speed.forward_ok, speed.forward)
    )
    slower = (
        None
        if ok
        else _slower(
            "forward+backward" if with_backward else "forward",
            ratio,
            speed.tokens,
            biased,
        )
    )
    if speed.source == calibrate.FORCED:  # ATTNKIT_NATIVE_SPEED decides alone
        return slower
    if slower is not None:
        return slower
    # (torch's half-precision kernels lose at few rows too)
    short = call_dtype == torch.float32 and rows <= few_rows() and not one_of_two
    return _short(rows, plan.s) if short else None


def decode_pays(
    dtype: torch.dtype,
    batch: int,
    heads: int,
    kv_heads: int,
    keys: int,
    head_dim: int,
    *,
    sdpa_masked: bool = False,
) -> bool:
    """Whether a dense decode step (at most :data:`DIRECT_ROWS` query rows per key/value
    head) runs faster here than in torch's kernel: measured on this machine by the
    multiply-adds of one query row's Q Kᵀ (``batch * heads * keys * head_dim``: a step is
    memory-bound, its few rows read the same keys), with and without grouped query heads
    (:func:`.calibrate.decode_pays`; the one decode rule, asked by ``auto`` before it plans
    a call: where it is False SDPA takes the step; a call blockwise takes anyway, one that
    wants the log-sum-exp say, runs the step on the kernel).

    ``sdpa_masked``: torch's kernel would need a dense mask for the step's causal triangle
    (several queries, bottom-right), so the kernel pays from any size: on the Zen 3 of
    session 16 (d=64, 2 threads, through attention(), interleaved) it took 0.56-0.98x
    SDPA's time for 2-8 queries against 128-4096 keys, 12/12 and 32/8 heads.

    The rule before the measurement (session 11, two AMD EPYCs: float32 from 2^20
    multiply-adds with GQA and 2^21 without, bf16 and fp16 always, torch's half-precision
    steps there being several times slower) had ``auto`` take up to 3.9x SDPA's time on
    the Xeon of session 28, whose torch runs decode steps on fast oneDNN code."""
    if torch.compiler.is_compiling():
        return False  # (the kernel is a foreign call there, and nothing is measured)
    if not available():
        return False  # (nothing to measure: without a build blockwise runs torch's kernel)
    if sdpa_masked:
        return True
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False  # (the kernel reads no other dtype)
    work = batch * heads * keys * head_dim
    return calibrate.decode_pays(dtype, heads > kv_heads, work)


def few_rows() -> int:
    """The most query rows per key/value head for which torch's fused kernel runs a dense
    float32 forward faster than this build (:data:`FEW_ROWS`, by vector width)."""
    name = isa() or ""
    return FEW_ROWS[16 if name.startswith("avx512") else 8 if name == "avx2" else 4]


def _short(rows: int, keys: int) -> str:
    return (
        f"{rows} query rows per key/value head against {keys} keys: torch's fused "
        "kernel is faster for a dense plan this short"
    )


def score_mod_program(plan: TilePlan) -> codegen.CompiledMod | str:
    """The plan's ``score_mod`` compiled into row functions the kernel calls in-tile
    (:mod:`.codegen`), or why not (a reason from :mod:`attnkit.mod_graph` or the build).
    Made once per plan (kept in ``plan.memo``); the trace and the library are cached per
    mod and per generated source."""
    if "native-score-mod" not in plan.memo:
        plan.memo["native-score-mod"] = _program(plan)
    return plan.memo["native-score-mod"]


def _program(plan: TilePlan) -> codegen.CompiledMod | str:
    if plan.score_mod is None:
        return "no score_mod"
    graph = mod_graph.traced(plan.score_mod, "score")
    if isinstance(graph, mod_graph.Unsupported):
        return graph.reason
    if torch.compiler.is_compiling():
        return "under torch.compile"
    sizes = (plan.b, plan.h, plan.t, plan.s, plan.q_base, plan.k_base)
    return codegen.compile_mod(graph, sizes)


def mask_program(plan: TilePlan) -> mask_codegen.CompiledMask | str:
    """The plan's block mask's traced ``mask_mod`` compiled into the kernel's mask test
    (:func:`.mask_codegen.compile_mask`), or why not: a block mask that stores its tiles
    (``BlockMask.stored_why``), or a build that failed (the kernel then reads the tiles,
    evaluated once). Made once per plan (``plan.memo``)."""
    if "native-mask-mod" not in plan.memo:
        plan.memo["native-mask-mod"] = _mask_program(plan.block_mask)
    return plan.memo["native-mask-mod"]


def explain_block_mask(plan: TilePlan) -> str:
    """One line: how the kernel reads the plan's block mask (a band, tiles it makes with
    the generated mask_mod, or stored tiles, and why)."""
    if not _band(plan)[2]:
        return "block mask: read as a band (no tile read)"
    program = mask_program(plan)
    if isinstance(program, mask_codegen.CompiledMask):
        return "block mask: partial tiles made in the kernel (the mask_mod, generated)"
    return f"block mask: partial tiles stored ({program})"


def _mask_program(bm) -> mask_codegen.CompiledMask | str:
    if bm is None:
        return "no block mask"
    if bm.mask_graph is None:
        return str(bm.stored_why)
    bk, hk = bm.block_kind.shape[:2]
    off = bm.graph_q_offset
    sizes = (bk, hk, bm.Q_LEN, bm.KV_LEN, off, 0)
    return mask_codegen.compile_mask(bm.mask_graph, sizes)


def _program_of(plan: TilePlan) -> codegen.CompiledMod | None:
    """The plan's compiled score_mod where the kernel runs one (None: none, or a relative
    bias the kernel reads as a vector)."""
    if plan.score_mod is None or getattr(plan.score_mod, "relative", None) is not None:
        return None
    program = score_mod_program(plan)
    return None if isinstance(program, str) else program


def _dense(plan: TilePlan) -> bool:
    """A plan with nothing to skip but the causal triangle, which torch's kernel runs as
    well: no mask, window or block mask, and no score_mod but a relative bias (ALiBi: its
    bias rows are added to torch's tiles; on the AVX2 build a bf16 ALiBi forward ran 1.27x
    slower natively than there, as dense bf16 plans do; its speed is measured apart,
    :func:`.calibrate.speed` with ``bias``)."""
    mod = plan.score_mod
    return (
        plan.mask is None
        and (mod is None or getattr(mod, "relative", None) is not None)
        and plan.window is None
        and plan.block_mask is None
    )


def _slower(direction: str, ratio: float, tokens: int, bias: bool = False) -> str:
    plans = f"dense {direction} plans" + (" with a relative bias" if bias else "")
    against = "torch's kernel on tiles" if bias else "torch's kernel"
    return (
        f"slower than {against} on this machine for {plans}, or within "
        f"{calibrate.TIE:.0%} of it ({ratio:.2f}x at {tokens} tokens, measured once: see "
        "native.calibrate)"
    )


def _band(plan: TilePlan) -> tuple[int, int, bool]:
    """``(lo, hi, block_mask_needed)``: causal/window keep key ``j`` for query ``i`` iff
    ``lo <= j - i <= hi``. A block mask that is itself such a band (a sliding window or
    causal mask written as a mod: :meth:`BlockMask.toeplitz` with every difference in its
    range kept) joins the band and is not read at all."""
    band, read = plan.band, False
    bm = plan.block_mask
    if bm is not None:
        toeplitz = bm.toeplitz()
        if toeplitz is None or not bool(toeplitz[1].all()):
            read = True
        else:
            first, keep = toeplitz  # kept q - kv: first .. first + n - 1
            band = band & Band(-(first + keep.numel() - 1), -first)
    # no bound, or one wider than both sequences, is the same clamped bound: int64-safe
    reach = plan.t + plan.s + 1
    lo = -reach if band.lo is None else max(band.lo, -reach)
    hi = reach if band.hi is None else min(band.hi, reach)
    return lo, hi, read


def _args(
    plan: TilePlan, q, k, v, out, lse, block_q: int = BLOCK_Q
) -> tuple[abi.Args, list[object]]:
    """The kernel's arguments for ``plan`` and the tensors they point into (keep them
    alive through the call): ``q``, ``k``, ``v`` the engine's ``(b, heads, len, d)``
    float32 views, ``out`` ``(b, h, t, d_v)`` (or None), ``lse`` ``(b, h, t)`` contiguous;
    ``block_q`` query rows a block (:func:`backward_block_q` for a backward)."""
    b, h, t, s = plan.b, plan.h, plan.t, plan.s
    band_lo, band_hi, read_block_mask = _band(plan)
    out_strides = out.stride()[:3] if out is not None else (0, 0, 0)
    args = abi.Args(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if out is None else out.data_ptr(),
        0 if lse is None else lse.data_ptr(), *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *out_strides,
        b, h, plan.h_kv, t, s, q.shape[-1], v.shape[-1],
        plan.scale, band_lo, band_hi, block_q,
    )  # fmt: skip
    keep_alive: list[object] = []  # what the kernel reads, alive through the call
    bm = plan.block_mask
    if bm is not None and read_block_mask:
        generated = None if bm.stored else mask_program(plan)
        if isinstance(generated, mask_codegen.CompiledMask):  # rows made in-tile: no tiles read
            mask_call = codegen.ModCall(generated, s - 1, bm.graph_q_offset, 0)
            args.mask_row, args.mask_ctx = generated.row, mask_call.address
            kind = bm.block_kind.to(torch.int8).contiguous()
            index = masks = kind  # not read: the kernel reads kinds and calls mask_row
            keep_alive.append(mask_call)
        else:  # stored tiles (a generated mask whose code did not build: evaluated once)
            kind, index, masks = _block_mask_tensors(bm)
        keep_alive += [kind, index, masks]
        args.bm_kind, args.bm_index, args.bm_masks = (
            kind.data_ptr(), index.data_ptr(), masks.data_ptr()
        )  # fmt: skip
        args.bm_sb = kind.stride(0) if kind.shape[0] > 1 else 0
        args.bm_sh = kind.stride(1) if kind.shape[1] > 1 else 0
        args.bm_si = kind.stride(2)
        args.bm_qb, args.bm_kb = bm.Q_BLOCK_SIZE, bm.KV_BLOCK_SIZE
        args.bq = bm.Q_BLOCK_SIZE
    relative = None if plan.score_mod is None else getattr(plan.score_mod, "relative", None)
    if relative is not None:
        # rel[n] is the bias of j - i = -(t - 1) + n, over whole key chunks
        s_pad = -(-s // KEY_CHUNK) * KEY_CHUNK
        j_minus_i = torch.arange(-(t - 1), s_pad)
        rel = relative(j_minus_i + (plan.k_base - plan.q_base), torch.float32)  # (h|1, n)
        rel = torch.as_tensor(rel, dtype=torch.float32).reshape(-1, j_minus_i.numel()).contiguous()
        if rel.shape[0] not in (1, h):
            raise ValueError(f"a relative score_mod gave {rel.shape[0]} heads for {h}")
        keep_alive.append(rel)
        args.rel, args.rel_lo = rel.data_ptr(), -(t - 1)
        args.rel_sh = 0 if rel.shape[0] == 1 else rel.stride(0)
    if plan.mask is not None:  # (b|1, h|1, t|1, s|1), bool = keep, float = added
        keep_alive.append(_set_mask(args, plan.mask, 0))
    program = _program_of(plan)
    if program is not None:  # a compiled score_mod: its row functions and their context
        call = codegen.ModCall(program, s - 1, plan.q_base, plan.k_base)
        keep_alive.append(call)
        args.mod_forward, args.mod_backward = program.forward, program.backward
        args.mod_ctx = call.address
    args.threads = torch.get_num_threads()
    args.dtype = abi.DT_BF16 if q.dtype == torch.bfloat16 else abi.DT_F32
    args.kv_splits = KV_SPLITS
    return args, keep_alive


def _set_mask(args: abi.Args, mask: torch.Tensor, column0: int) -> torch.Tensor:
    """Point ``args`` at ``mask`` ``(b|1, h|1, t|1, n|1)`` (bool = keep, float = added)
    over the keys from ``column0`` on (every key before it kept); the tensor the kernel
    reads (keep it alive through the call)."""
    if mask.dtype == torch.bool:
        mask, args.mask_kind = mask.view(torch.uint8), _MASK_BOOL
    else:
        mask, args.mask_kind = mask.to(torch.float32), _MASK_FLOAT
    args.mask, args.mask_c0 = mask.data_ptr(), column0
    args.sm_b, args.sm_h, args.sm_t, args.sm_s = (
        0 if n == 1 else st for n, st in zip(mask.shape, mask.stride(), strict=True)
    )
    return mask


@overload
def forward(
    plan: TilePlan,
    q,
    k,
    v,
    *,
    suffix_mask: torch.Tensor | None = None,
    reuse: list | None = None,
    with_lse: Literal[True] = True,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def forward(
    plan: TilePlan,
    q,
    k,
    v,
    *,
    suffix_mask: torch.Tensor | None = None,
    reuse: list | None = None,
    with_lse: Literal[False],
) -> tuple[torch.Tensor, None]: ...
@overload
def forward(
    plan: TilePlan,
    q,
    k,
    v,
    *,
    suffix_mask: torch.Tensor | None = None,
    reuse: list | None = None,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]: ...
def forward(
    plan: TilePlan,
    q,
    k,
    v,
    *,
    suffix_mask: torch.Tensor | None = None,
    reuse: list | None = None,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out (b, h, t, d_v) float32, lse (b, h, t))`` of a plan :func:`why_not` accepts,
    ``q``, ``k``, ``v`` the engine's ``(b, heads, len, d)`` views.

    ``suffix_mask``: a mask ``(b|1, h|1, t, n)`` over the last ``n`` keys, every key
    before them kept, for a plan of no mask of its own: a draft tree's stacked rows over
    ``cache ++ tree`` (:func:`attnkit.tree_attention`), the cache's chunks run unmasked,
    without a mask as wide as the cache.

    ``reuse``: as :func:`cascade`'s, a list the caller keeps for calls of this plan whose
    tensors have the same shapes and strides (and ``torch.get_num_threads()``): empty, it
    is given the call's arguments where they point at nothing but the three tensors, out,
    lse and a suffix mask read in place (bool or float32); filled, a call whose suffix
    mask (or none) has the same shape, strides and dtype copies those and points them at
    its own tensors (the fast lane's repeated decode steps, a draft tree's: 10-30 us of
    Python a call, after a long step has pushed the interpreter's data out of the
    caches).

    ``with_lse=False``: ``(out, None)``, ``out`` in ``q``'s dtype where that is bf16 (the
    kernel rounds it as ``.to(torch.bfloat16)`` does: no float32 output, lse or cast made
    here), float32 otherwise."""
    out, lse = _outputs(plan, q, v, with_lse)
    mask = (
        None
        if suffix_mask is None
        else (suffix_mask.shape, suffix_mask.stride(), suffix_mask.dtype)
    )
    kept = reuse[0] if reuse else None  # (one read: another thread may replace it)
    if kept is not None and kept[2] == mask:
        args = _pointed(kept, q, k, v, out, lse)
        if suffix_mask is not None:  # (bool read as bytes, float32 as it is: no copy)
            args.mask = suffix_mask.data_ptr()
        _check_code(kept[1](ctypes.byref(args)))
        return out, lse
    args, keep_alive = _args(plan, q, k, v, out, lse)
    _point_outputs(args, out, lse)
    if suffix_mask is not None:
        if plan.mask is not None or not 0 < suffix_mask.shape[-1] <= plan.s:
            raise ValueError(
                f"suffix_mask must cover 1..{plan.s} keys of a plan without a mask, got "
                f"{tuple(suffix_mask.shape)}"
            )
        read = _set_mask(args, suffix_mask, plan.s - suffix_mask.shape[-1])
        if read.data_ptr() == suffix_mask.data_ptr():  # (read in place: no copy to keep)
            keep_alive.append(read)
        else:
            keep_alive += [read, "a copy"]  # (not reusable: the copy is this call's)
    kernel = _kernel("attnkit_forward")
    _check_code(kernel(ctypes.byref(args)))
    if reuse is not None and len(keep_alive) == (suffix_mask is not None):
        reuse[:] = [(abi.Args.from_buffer_copy(args), kernel, mask)]
    del keep_alive
    return out, lse


def cascade(
    prefix_plan: TilePlan,
    suffix_plan: TilePlan,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    query: torch.Tensor,
    suffix_key: torch.Tensor,
    suffix_value: torch.Tensor,
    *,
    reuse: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared-prefix cascade's two passes and their merge in one kernel call
    (:func:`attnkit.cascade_attention`; attention.cpp's ``cascade_call``), plans that
    :func:`why_not` accepts (the prefix's with ``one_of_two``).

    Args:
        prefix_plan: the prefix pass: every request's query rows stacked per kv head
            (request, then group head, then query: ``(1, h_kv, n * g * t, d)``, gathered
            from ``query`` by the kernel) against the shared keys (no mask).
        suffix_plan: the suffix pass, ``query`` against each request's own keys.
        prefix_key: ``(1, h_kv, p, d)``; prefix_value: ``(1, h_kv, p, d_v)``.
        query: ``(n, h, t, d)``; suffix_key: ``(n, h_kv, s, d)``; suffix_value:
            ``(n, h_kv, s, d_v)`` (all with the last dim contiguous).

        reuse: a list kept by the caller for calls of these plans whose tensors have the
            same shapes and strides (its key says so; ``torch.get_num_threads()`` too):
            empty, it is given the two passes' arguments (where they point at nothing but
            the five tensors, out and lse); filled, the call copies those and points them
            at its own tensors instead of making them anew (6-7 us of Python a call).

    Returns:
        ``(out (n, h, t, d_v) float32, lse (n, h, t) float32)`` over prefix ++ suffix.
    """
    n, h, t = query.shape[:3]
    out = torch.empty(n, h, t, suffix_value.shape[-1], dtype=torch.float32)
    lse = torch.empty(n, h, t, dtype=torch.float32)
    if reuse:
        pre, suf = (abi.Args.from_buffer_copy(x) for x in reuse)
        pre.q = suf.q = query.data_ptr()
        pre.k, pre.v = prefix_key.data_ptr(), prefix_value.data_ptr()
        suf.k, suf.v = suffix_key.data_ptr(), suffix_value.data_ptr()
        pre.lse = suf.lse = lse.data_ptr()
        suf.out = out.data_ptr()
        _check_code(_kernel("attnkit_cascade")(ctypes.byref(pre), ctypes.byref(suf)))
        return out, lse
    # (the prefix pass's rows, out and lse are the kernel's own buffers: _args is handed
    # the query and the call's lse only to fill the struct, and the kernel sets all three)
    pre, keep_pre = _args(prefix_plan, query, prefix_key, prefix_value, None, lse)
    suf, keep_suf = _args(suffix_plan, query, suffix_key, suffix_value, out, lse)
    _check_code(_kernel("attnkit_cascade")(ctypes.byref(pre), ctypes.byref(suf)))
    if reuse is not None and not keep_pre and not keep_suf:
        reuse[:] = [abi.Args.from_buffer_copy(pre), abi.Args.from_buffer_copy(suf)]
    del keep_pre, keep_suf
    return out, lse


@overload
def forward_paged(
    plan: TilePlan,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_lens: torch.Tensor | None = None,
    *,
    reuse: list | None = None,
    heads_apart: bool | None = None,
    with_lse: Literal[True] = True,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def forward_paged(
    plan: TilePlan,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_lens: torch.Tensor | None = None,
    *,
    reuse: list | None = None,
    heads_apart: bool | None = None,
    with_lse: Literal[False],
) -> tuple[torch.Tensor, None]: ...
def forward_paged(
    plan: TilePlan,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    key_lens: torch.Tensor | None = None,
    *,
    reuse: list | None = None,
    heads_apart: bool | None = None,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward` with keys and values read through a page table (the forward only).

    Args:
        plan: the call's plan, with ``s`` the keys each row attends to.
        q: ``(b, h, t, d)`` (last dim contiguous), the kernel's dtype.
        k_pages: ``(num_pages, h_kv, page_size, d)`` key pages (last dim contiguous).
        v_pages: ``(num_pages, h_kv, page_size, d_v)`` value pages.
        page_table: int64 ``(b, n)``, row ``i`` the pages of batch row ``i`` in order
            (its shape checked by the caller: ``n * page_size >= s``; the ids a row reads
            by the kernel, a ValueError naming them when one is outside the pool).
        key_lens: int64 ``(b,)``, row ``i`` attending to its first ``key_lens[i] <= s``
            keys: a decode step of sequences of different lengths (one query row per kv
            head and few heads a group, no band); None = every row to ``s``.
        reuse: as :func:`forward`'s, for calls of no ``key_lens`` whose query, pages and
            page table have the same shapes and strides (the paged lane's); a kept call
            runs with the choices its first call made (``heads_apart`` included).
        with_lse: as :func:`forward`'s.
        heads_apart: whether a float32 decode step's work items read a head at a time
            rather than walking each page's heads together (None: what this machine
            measured faster, :func:`.calibrate.heads_apart`).
    """
    out, lse = _outputs(plan, q, v_pages, with_lse)
    table = _int64_cpu(page_table)
    kept = reuse[0] if reuse and key_lens is None else None  # (one read, as forward's)
    if kept is not None:
        args = _pointed(kept, q, k_pages, v_pages, out, lse)
        args.pages = table.data_ptr()
        _check_paged(kept[1](ctypes.byref(args)), plan, table, key_lens, k_pages)
        return out, lse
    args, keep_alive = _args(plan, q, k_pages, v_pages, out, lse)
    _point_outputs(args, out, lse)
    if args.dtype == abi.DT_F32:
        args.page_heads_apart = calibrate.heads_apart() if heads_apart is None else heads_apart
    keep_alive.append(table)
    # _args read the pages' strides as (b, h, t): the first is a page's stride here
    args.sk_page, args.sv_page, args.sk_b, args.sv_b = args.sk_b, args.sv_b, 0, 0
    args.pages, args.pages_sb, args.page_size = table.data_ptr(), table.stride(0), k_pages.shape[2]
    args.num_pages = k_pages.shape[0]
    if key_lens is not None:
        key_lens = _int64_cpu(key_lens)
        keep_alive.append(key_lens)
        args.key_lens = key_lens.data_ptr()
    if plan.b * plan.h * plan.t * plan.s * (q.shape[-1] + v_pages.shape[-1]) < PAGED_ONE_THREAD:
        args.threads = 1  # a short decode step: waking a thread costs more than it saves
    kernel = _kernel("attnkit_forward")
    _check_paged(kernel(ctypes.byref(args)), plan, table, key_lens, k_pages)
    if reuse is not None and key_lens is None and len(keep_alive) == 1:  # (the table alone)
        reuse[:] = [(abi.Args.from_buffer_copy(args), kernel, None)]
    del keep_alive
    return out, lse


def _check_paged(code: int, plan: TilePlan, table, key_lens, k_pages: torch.Tensor) -> None:
    """A paged call's return: a bad page id named (the kernel checked every id a row
    reads before reading), any other failure raised."""
    if code == abi.BAD_PAGE:
        lens = plan.s if key_lens is None else key_lens
        check_page_ids(table, lens, k_pages.shape[2], k_pages.shape[0])
    _check_code(code)


def _outputs(
    plan: TilePlan, q: torch.Tensor, v: torch.Tensor, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A forward's ``out (b, h, t, d_v)`` and ``lse (b, h, t)`` (None without
    ``with_lse``), as :func:`forward` returns them (bf16 ``out`` only without
    ``with_lse``, for a bf16 ``q``)."""
    dtype = torch.bfloat16 if not with_lse and q.dtype == torch.bfloat16 else torch.float32
    out = torch.empty(plan.b, plan.h, plan.t, v.shape[-1], dtype=dtype)
    lse = torch.empty(plan.b, plan.h, plan.t, dtype=torch.float32) if with_lse else None
    return out, lse


def _point_outputs(args: abi.Args, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Point ``args`` at ``out`` (a bf16 one through ``out16``) and ``lse`` (None: the
    kernel keeps its own)."""
    if out.dtype == torch.bfloat16:
        args.out, args.out16 = None, out.data_ptr()
    else:
        args.out, args.out16 = out.data_ptr(), None
    args.lse = None if lse is None else lse.data_ptr()


def _pointed(kept: tuple, q, k, v, out, lse) -> abi.Args:
    """A copy of the arguments a ``reuse`` list keeps (its one entry ``(Args, kernel
    function, the suffix mask's shape, strides and dtype or None)``: see :func:`forward`;
    never changed once made, so a reader that took it holds one consistent entry) pointed
    at this call's tensors."""
    args = abi.Args.from_buffer_copy(kept[0])
    args.q, args.k, args.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    _point_outputs(args, out, lse)
    return args


def _int64_cpu(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous CPU int64 tensor, for the kernel to read (never a device
    pointer, whatever device the caller keeps it on); ``x`` itself where it is one (a
    decode step's table, every layer: no tensor op after a step that has pushed the
    interpreter's data out of the caches, where each costs several microseconds)."""
    if x.dtype == torch.int64 and x.device.type == "cpu" and x.is_contiguous():
        return x
    return x.to("cpu", torch.int64).contiguous()


def why_not_backward(
    plan: TilePlan,
    dtype: torch.dtype,
    d: int,
    d_v: int,
    extra: tuple,
    *,
    call_dtype: torch.dtype | None = None,
) -> str | None:
    """Why :func:`backward` cannot run (None when it can): as :func:`why_not` (float32
    views: the backward upcasts), with head sizes a multiple of 16, and a ``score_mod``
    whose tensors want gradients compiled (:func:`score_mod_program`) with its gradient
    partials (one per backward task) within :data:`.codegen.MAX_GRAD_PARTIALS`."""
    if extra:
        program = _program_of(plan)
        if program is None:
            return "a score_mod whose tensors want gradients, not compiled"
        tasks = _backward_tasks(plan, d)
        if program.ngrad * tasks > codegen.MAX_GRAD_PARTIALS:
            return (
                f"the score_mod's tensors want {program.ngrad} gradients per backward task "
                f"x {tasks} tasks, over {codegen.MAX_GRAD_PARTIALS}"
            )
    if d % 16:
        return "the native backward needs query heads a multiple of 16 wide"
    # (a dense plan: the measured forward+backward speed decides, in why_not)
    return why_not(plan, dtype, d, d_v, call_dtype=call_dtype, with_backward=True)


def _backward_tasks(plan: TilePlan, d: int) -> int:
    """The backward's tasks (attention.cpp's key_groups: batch x kv heads x key groups)."""
    chunks = -(-plan.s // KEY_CHUNK)
    per_group = plan.b * plan.h * plan.t * d
    groups = max(2, 32 // max(1, plan.b * plan.h_kv))
    groups = min(groups, (64 << 20) // max(1, per_group))
    return plan.b * plan.h_kv * max(1, min(groups, chunks))


def backward(
    plan: TilePlan,
    q,
    k,
    v,
    out,
    lse,
    grad_out,
    grad_lse: torch.Tensor | None,
    mod_grads: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` float32 in the engine's ``(b, heads, len, d)`` layout from the total
    ``out`` and ``lse`` (sinks included) of a plan :func:`why_not_backward` accepts: the
    weights recomputed from ``lse``, ``dS = P (dP - delta)`` with
    ``delta = rowsum(dO * O) - dlse`` (so a gradient through the returned log-sum-exp
    costs nothing extra). ``mod_grads``: a dict given receives the compiled score_mod's
    captured-tensor gradients, ``{slot: gradient}`` (:class:`attnkit.mod_graph.ModGraph`
    slots), bitwise the same for any number of threads."""
    b, h, t = plan.b, plan.h, plan.t
    dv_ = v.shape[-1]
    out = out.reshape(b, h, t, dv_).to(torch.float32)
    grad_out = grad_out.reshape(b, h, t, dv_).to(torch.float32).contiguous()
    delta = (grad_out * out).sum(-1)  # (b, h, t)
    if q.dtype == torch.bfloat16:  # bf16 products read dO in bf16 too
        grad_out = grad_out.to(torch.bfloat16)
    if grad_lse is not None:
        delta = delta - grad_lse.reshape(b, h, t).to(torch.float32)
    lse = lse.reshape(b, h, t).to(torch.float32)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf")).contiguous()  # dead rows: P = 0
    delta = delta.contiguous()
    dq = torch.empty(b, h, t, q.shape[-1], dtype=torch.float32)
    dk = torch.empty(b, plan.h_kv, plan.s, k.shape[-1], dtype=torch.float32)
    dv = torch.empty(b, plan.h_kv, plan.s, dv_, dtype=torch.float32)
    args, keep_alive = _args(plan, q, k, v, None, lse, backward_block_q(q.dtype))
    grads = abi.Grads(*(x.data_ptr() for x in (grad_out, delta, dq, dk, dv)))
    program = _program_of(plan)
    dgrad = None
    if mod_grads is not None and program is not None and program.ngrad:
        dgrad = torch.zeros(program.ngrad, dtype=torch.float64)
        args.mod_ngrad, args.mod_dgrad = program.ngrad, dgrad.data_ptr()
    _check_code(_kernel("attnkit_backward")(ctypes.byref(args), ctypes.byref(grads)))
    if dgrad is not None and mod_grads is not None:
        call = next(x for x in keep_alive if isinstance(x, codegen.ModCall))
        mod_grads.update(call.gradients(dgrad))
    del keep_alive
    return dq, dk, dv


def _check_code(code: int) -> None:
    """A nonzero return of the kernel as a Python exception."""
    if code == abi.NO_MEMORY:
        raise MemoryError("attnkit's native kernel ran out of memory")
    if code != abi.OK:
        why = abi.CODES.get(code, f"code {code}")
        raise RuntimeError(f"attnkit's native kernel failed: {why}")


def _block_mask_tensors(bm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kind int8, partial_index int64, partial masks uint8)`` of a block mask, checked:
    every partial tile's index must name a stored mask (a hand-built BlockMask may not)."""
    kind = bm.block_kind.to(torch.int8).contiguous()  # (B|1, H|1, nq, nk)
    index = bm.partial_index.to(torch.int64).contiguous()  # same
    masks = bm.partial_masks.to(torch.bool).contiguous().view(torch.uint8)  # (n, qb, kb)
    used = index[kind == PARTIAL]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= masks.shape[0]):
        raise ValueError(
            f"block_mask has a partial tile index out of range [0, {masks.shape[0]}) "
            f"(found {int(used.min())}..{int(used.max())})"
        )
    if tuple(masks.shape[1:]) != (bm.Q_BLOCK_SIZE, bm.KV_BLOCK_SIZE):
        raise ValueError(
            f"block_mask's partial masks are {tuple(masks.shape[1:])}, not its block size "
            f"{(bm.Q_BLOCK_SIZE, bm.KV_BLOCK_SIZE)}"
        )
    return kind, index, masks
