"""How the native kernel compares with torch's on this machine, measured once per build.

A kernel that is fast on one CPU can be slow on another (its AVX2 build ran 15x slower
than torch's on a Zen 3 before the kernel was made portable), so ``"auto"`` never trusts
a speed it has not seen here. On first use for a dtype, each build times itself against
:func:`torch.nn.functional.scaled_dot_product_attention` on one dense causal case
(B=1, H=4, T=1024, d=64, in that dtype, this process's thread count), forward and
forward+backward, and keeps the two ratios (:class:`Speed`). Dense calls against more
than 2048 keys are decided by a second such measurement at :data:`LONG_TOKENS`, made on
the first of them. Plans whose only score_mod is a relative bias (ALiBi) are decided by
measurements of their own, the same case with ALiBi against the ``blockwise-flash``
backend (what runs them without the native kernel: torch's kernel on tiles, the bias
added to each), not against SDPA. A call that records a backward is judged by the
forward+backward ratio (its whole cost), one without by the forward's.

The measurement is made to be the same in every run on one machine: each sample repeats
a call until it lasts at least :data:`MIN_SAMPLE` seconds (one 3 ms call is mostly the
noise of the clock and the scheduler), native and torch alternate for :data:`REPS`
samples each, and the ratio kept is of their best samples (load only ever adds time). A ratio within :data:`TIE` of 1
(the two within 3%) counts as a tie, which torch's kernel takes: a wrong call there costs
at most 3%, while a noisy "faster" could cost more. A ratio within :data:`CLOSE` of 1
(0.74-1.35, forward or forward+backward) is measured :data:`TAKES` times and the median of
each kept: there one noisy take, kept on disk, would decide every later process.

Load does not add time evenly, though: where another process holds a core for the whole
measurement, every sample is slowed, the native kernel's about twice as much as torch's
(on the 2-core Xeon of session 28, T=1024 with a busy loop beside it: native 2.4 → 9-11 ms,
SDPA 3.2 → 6.5-7.3 ms), and one such calibration, kept, had ``auto`` send dense float32
calls to torch's slower kernel in every later process (native/SDPA read 1.76 at T=1024
where 0.73 at 4096). So a sample counts only where this process had its threads' time:
its CPU time over the wall time times the thread count, at least :data:`MIN_SHARE` (about
1.0 on an idle machine, 0.53-0.75 beside the busy loop). Up to :data:`MAX_ROUNDS` rounds
of samples are taken until each side has :data:`REPS` // 2 + 1 such samples; a
measurement that never gets them is used by this process only (``source`` "measured
under load") and made again by the next.

The ratios are cached as JSON beside the build (same private directory, keyed by the
library, torch's version, the vector code torch's own kernels run
(``torch.backends.cpu.get_cpu_capability()``: ``ATEN_CPU_CAPABILITY`` changes it, and
the levels ``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS`` hold oneDNN and MKL to:
torch's bf16 SDPA runs on AMX tiles through them, 4x faster than held below AMX), the
thread count, the dtype and the measured length), so the decision is made once per
machine and is the same in every later process.

Decode steps (a query row or a few per key/value head, keys read in place) are measured
apart, by :func:`decode_pays`: native against SDPA at a few cache lengths, with and
without grouped query heads, each length on a call's first need; the same rules of
samples, ties and keeping apply. So is the way a float32 paged decode step reads its
pages (:func:`heads_apart`: a page's heads walked together, or a head at a time), the
two ways timed against each other.

Where the ratio is not below 1 - TIE, the native kernel does not run dense plans of that
dtype and length class (no
mask or block mask beyond causal, no score_mod): the fused engine takes torch's kernel
there, and ``"auto"`` keeps sdpa first; masked and sparse plans still run natively, where
skipping tiles is what makes it fast. ``ATTNKIT_NATIVE_SPEED=fast|slow`` skips the
measurement (tests, or a user who knows better).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attnkit.backends.blockwise.native import build

__all__ = ["Speed", "decode_pays", "flash_reads_bf16", "heads_apart", "speed"]

#: The measured case: (batch, heads, tokens, head size), causal.
CASE = (1, 4, 1024, 64)
#: Dense plans of more than twice CASE's tokens are decided by a second measurement at
#: this many tokens (made on the first such call): which kernel is faster can change with
#: the length (bf16 forward+backward on an avx512-bf16 build: 1.09x SDPA's time at 1024
#: tokens, 0.63x at 4096 in one busy run).
LONG_TOKENS = 4096
#: Timed samples of each (native, torch) per direction; the ratio of their best is kept.
REPS = 7
#: Seconds each timed sample lasts at least (a call is repeated until it does).
MIN_SAMPLE = 0.02
#: Ratios up to 1 + TIE are ties; torch's kernel keeps those.
TIE = 0.03
#: The least share of its threads' time (CPU time / (wall time x threads)) a sample of
#: this process must have had to count (another process held a core below it).
MIN_SHARE = 0.85
#: The most rounds of REPS sample pairs taken to find enough samples that count.
MAX_ROUNDS = 3
#: ``Speed.source`` of a measurement whose samples were too few that had their threads'
#: time: used by this process, never kept.
UNDER_LOAD = "measured under load"
#: A measurement whose forward or forward+backward ratio lies within this factor of 1
#: (0.74-1.35) is made TAKES times and the median of each ratio kept: one take, kept on
#: disk, decides every later process, and within this band one noisy take turns it.
CLOSE = 1.35
#: Takes of a measurement within :data:`CLOSE` of 1 (odd: a median of takes, not a mean).
TAKES = 3

_lock = threading.Lock()
_cache: dict[tuple, Speed] = {}
_measuring = threading.local()


@dataclass(frozen=True)
class Speed:
    """Native time over torch's on the measured case (below 1: native is faster)."""

    forward: float
    backward: float  # forward + backward
    source: str  # "measured", "cached", "ATTNKIT_NATIVE_SPEED" or "measurement failed (...)"
    tokens: int = 0  # the measured length (0: none measured)

    @property
    def forward_ok(self) -> bool:
        """Whether the native kernel runs dense forward plans (measurably faster)."""
        return self.forward <= 1.0 - TIE

    @property
    def backward_ok(self) -> bool:
        """Whether the native kernel runs dense forward+backward plans."""
        return self.backward <= 1.0 - TIE


#: ``Speed.source`` when ``ATTNKIT_NATIVE_SPEED`` decides instead of a measurement.
FORCED = "ATTNKIT_NATIVE_SPEED"


def measuring() -> bool:
    """True while this thread is calibrating (the native kernel then runs every plan)."""
    return getattr(_measuring, "on", False)


def forced() -> Speed | None:
    """The :class:`Speed` ``ATTNKIT_NATIVE_SPEED=fast|slow`` sets, or None (measured)."""
    value = os.environ.get("ATTNKIT_NATIVE_SPEED")
    if value not in ("fast", "slow"):
        return None
    ratio = 0.5 if value == "fast" else 2.0
    return Speed(ratio, ratio, FORCED)


def speed(dtype: torch.dtype = torch.float32, keys: int | None = None, bias: bool = False) -> Speed:
    """This machine's :class:`Speed` for the loaded build on dense calls of ``dtype``
    against ``keys`` keys (each dtype and length class measured on its first use: torch's
    bf16 kernel and ours differ from fp32 in other ways on each CPU, and long calls from
    short ones). Up to twice :data:`CASE`'s tokens (or ``keys=None``) the measurement at
    CASE's length decides, above it the one at :data:`LONG_TOKENS`. ``bias``: for plans
    with a relative bias (ALiBi), measured on their own (:func:`_time_case`)."""
    forced_speed = forced()
    if forced_speed is not None:
        return forced_speed
    key = cache_key(dtype, keys, bias)
    return _kept(key, lambda: _time_case(dtype, key[-1], bias=bias))


#: The decode steps measured for :func:`decode_pays`: (query heads, key/value heads) of a
#: step without and with grouped queries (GQA), head size 64, one query row a head.
DECODE_HEADS = {False: (12, 12), True: (32, 8)}
#: The cache lengths a decode step is measured at, shortest first (each on first need).
DECODE_KEYS = (128, 512, 2048, 8192)
_DECODE_D = 64


def decode_pays(dtype: torch.dtype, grouped: bool, work: int) -> bool:
    """Whether the native kernel runs a decode step of ``work`` multiply-adds of one
    query row's Q Kᵀ (batch x query heads x keys x head size) faster than torch's SDPA
    here: measured (native through ``attention(backend="blockwise")``, SDPA with
    ``enable_gqa``) on :data:`DECODE_HEADS` steps (``grouped``: query heads sharing a
    key/value head) at the lengths of :data:`DECODE_KEYS` up to the call's work, each on
    first need and kept as the prefill measurements are; True where one of them up to
    the call's work was faster by more than :data:`TIE` (a longer cache amortises the
    kernel's fixed costs over more memory-bound work: the shortest such length is the
    crossover). ``ATTNKIT_NATIVE_SPEED=fast|slow`` decides alone.

    Measured on the Xeon of session 28 (d=64, 2 threads, auto against SDPA, no grad):
    torch's decode steps there run on fast oneDNN/MKL code, and the kernel's rule before
    this one (float32 from 2^20-2^21 multiply-adds, bf16 always; measured on AMD EPYCs,
    where torch's bf16 step was several times slower) had ``auto`` take 1.07-2.3x SDPA's
    time for float32 steps without GQA at 32-8192 keys and 1.2-3.9x for bf16 ones."""
    forced_speed = forced()
    if forced_speed is not None:
        return forced_speed.forward_ok
    heads = DECODE_HEADS[grouped][0]
    for keys in DECODE_KEYS:
        if work < heads * keys * _DECODE_D:
            return False
        key = _decode_key(dtype, grouped, keys)
        if _kept(key, functools.partial(_time_decode, dtype, grouped, keys)).forward_ok:
            return True
    return False


#: The paged step :func:`heads_apart` is decided by: (heads, keys, page size, head size),
#: float32, pages in shuffled order (GPT-2-small's heads; 25 MB of keys and values).
WALK_CASE = (12, 4096, 16, 64)


def heads_apart() -> bool:
    """Whether a float32 paged decode step reads a head at a time here, rather than walking
    each page's heads together (attention.cpp's feature "page walk",
    ``Args.page_heads_apart``): measured once (:data:`WALK_CASE`, both ways through
    :func:`attnkit.backends.blockwise.native.forward_paged`), kept as the other
    measurements are; True only where a head at a time was faster by more than
    :data:`TIE` (the walk, measured better on the AMD EPYCs of sessions 16-17, stays the
    default). ``ATTNKIT_NATIVE_SPEED=fast|slow`` keeps the default without measuring.

    Session 30, the Xeon (2 threads, C ABI, L=4096 x 12 heads, shuffled pages), paged over
    contiguous: 1.08-1.14 walked, 0.97-1.00 a head at a time; session 17, a Zen 4 (1
    thread): 1.03 walked, 1.38 a head at a time."""
    if forced() is not None:
        return False
    key = (*cache_key(torch.float32)[:-2], "float32-paged-heads-apart", WALK_CASE[1])
    return _kept(key, _time_walk).forward_ok


#: The call :func:`flash_reads_bf16` is decided by: (batch, heads, tokens, head size), causal.
FLASH_CASE = (1, 4, 1024, 64)


def flash_reads_bf16() -> bool:
    """Whether torch's fused kernel, where ``blockwise`` runs a bf16 forward on it as one
    call over every query (:func:`attnkit.backends.blockwise.flash_cpu.forward`: no mask,
    every key or causal from key 0), reads bf16 as it is rather than float32 copies:
    measured once (:data:`FLASH_CASE`, bf16 in against the copies made and read), kept as
    the other measurements are; True only where bf16 was faster by more than :data:`TIE`.
    ``ATTNKIT_NATIVE_SPEED=fast|slow`` (tests): True, without measuring; under
    ``torch.compile``: False (nothing is measured there).

    Which is faster is torch's build and the CPU's. Session 37, the Xeon, 2 threads: torch's
    bf16 kernel runs its products on AMX tiles there, 3.4x faster than on the copies at
    causal T=4096 (13 against 44 ms); with torch held to AVX2 it took 0.98-1.19x the
    copies' time (GQA, 128 rows against 2048 keys: 3.9 against 3.3 ms)."""
    if forced() is not None:
        return True
    if torch.compiler.is_compiling():
        return False
    key = (*cache_key(torch.bfloat16)[:-2], "bfloat16-flash-whole", FLASH_CASE[2])
    return _kept(key, _time_flash).forward_ok


def _decode_key(dtype: torch.dtype, grouped: bool, keys: int) -> tuple:
    """What a decode measurement is kept under (as :func:`cache_key`'s, the case named in
    the dtype's place)."""
    case = str(dtype).removeprefix("torch.") + ("-decode-gqa" if grouped else "-decode-mha")
    return (*cache_key(dtype)[:-2], case, keys)


def _kept(key: tuple, time_case: Callable[[], tuple[float, float, bool]]) -> Speed:
    """The speed kept under ``key`` (this process's, or the file's), measured by
    ``time_case`` where there is none."""
    with _lock:
        if key not in _cache:
            _cache[key] = _load_or_measure(key, time_case)
    return _cache[key]


def cache_key(
    dtype: torch.dtype = torch.float32, keys: int | None = None, bias: bool = False
) -> tuple:
    """What a measurement is kept under: the loaded build, torch's version, the thread
    count and the threads the kernel runs on (:func:`.build.pool`), the vector code of
    torch's kernels, the dtype (with ``-bias`` for the relative-bias case) and the
    measured length (last) that decides calls against ``keys`` keys."""
    tokens = CASE[2] if keys is None or keys <= 2 * CASE[2] else LONG_TOKENS
    return (
        build.status(),
        torch.__version__,
        f"{torch.get_num_threads()}t-{build.pool()}",
        str(torch.backends.cpu.get_cpu_capability()) + _libraries(),
        str(dtype).removeprefix("torch.") + ("-bias" if bias else ""),
        tokens,
    )


#: The variables that hold torch's oneDNN and MKL below the CPU's level (read when they
#: load), and the library each holds.
LIBRARY_LEVELS = {"ONEDNN_MAX_CPU_ISA": "oneDNN", "MKL_ENABLE_INSTRUCTIONS": "MKL"}


def _libraries() -> str:
    """``"+onednn=avx512_core_bf16+mkl=avx512_e3"``-like: where this process holds oneDNN or
    MKL (a measurement made without the hold says nothing about a process with it, and the
    other way round); ``""`` where it does not."""
    held = ((lib, os.environ.get(var)) for var, lib in LIBRARY_LEVELS.items())
    return "".join(f"+{lib.lower()}={level.lower()}" for lib, level in held if level)


def _cache_file(key: tuple) -> Path | None:
    """Beside the loaded library in the (private) cache directory; None for a private
    temporary build, whose measurement is kept for this process only."""
    _, version, threads, capability, dtype, tokens = key
    library = build.library_file()
    if library is None or build._private_dir(library.parent) is not None:
        return None
    name = (
        f"{library.stem}.speed-torch{version}-{capability.lower()}-{threads}-{dtype}-T{tokens}.json"
    )
    return library.with_name(name)


def _load_or_measure(key: tuple, time_case: Callable[[], tuple[float, float, bool]]) -> Speed:
    tokens = key[-1]
    path = _cache_file(key)
    if path is not None:
        try:
            data = json.loads(path.read_text())
            # (a file without "takes" predates the takes or the samples' load check: again)
            if data.get("takes") is True:
                return Speed(float(data["forward"]), float(data["backward"]), "cached", tokens)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    measured = _measure(time_case, tokens)
    if path is not None and measured.source == "measured":  # (a failure or a loaded one: not)
        with contextlib.suppress(OSError):
            build._write_atomic(path, json.dumps({**asdict(measured), "takes": True}))
    return measured


def _repeats(fn) -> int:
    """How many calls of ``fn`` in a row last at least :data:`MIN_SAMPLE` (after a warm-up)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(1, math.ceil(MIN_SAMPLE / max(time.perf_counter() - t0, 1e-7)))


def _sample(fn, n: int) -> tuple[float, float]:
    """(seconds a call, the share of its threads' time this process had: CPU time over
    wall time x threads) of ``n`` calls of ``fn`` in a row."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall / n, cpu / max(wall * torch.get_num_threads(), 1e-9)


def _best_ratio(native, torch_fn) -> tuple[float, bool]:
    """(native's best time over torch's, whether too few samples had their threads' time),
    each side's best of the samples that had it (:data:`MIN_SHARE`), at least
    :data:`MIN_SAMPLE` long, the two alternating (neither always runs first). A busy
    neighbour only ever adds time, and not to every sample: the best of each is the
    machine's own speed (a median of paired ratios kept what a busy minute said: the
    bf16 upcast copies, each a torch parallel region, cost 4-8 ms apiece on a busy 2-core
    machine, and one calibration measured 2.2x where the idle grid measured 0.8x). Rounds
    of :data:`REPS` pairs until each side has ``REPS // 2 + 1`` samples that count, at most
    :data:`MAX_ROUNDS`; where they never do, the best of all samples and True."""
    n_native, n_torch = _repeats(native), _repeats(torch_fn)
    ours: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    need = REPS // 2 + 1

    def counted(samples: list[tuple[float, float]]) -> list[float]:
        return [seconds for seconds, share in samples if share >= MIN_SHARE]

    for i in range(REPS * MAX_ROUNDS):
        if i % 2:
            theirs.append(_sample(torch_fn, n_torch))
            ours.append(_sample(native, n_native))
        else:
            ours.append(_sample(native, n_native))
            theirs.append(_sample(torch_fn, n_torch))
        if (i + 1) % REPS == 0 and min(len(counted(ours)), len(counted(theirs))) >= need:
            return min(counted(ours)) / max(min(counted(theirs)), 1e-9), False
    return min(s for s, _ in ours) / max(min(s for s, _ in theirs), 1e-9), True


def _close(*ratios: float) -> bool:
    """Whether any ratio lies within :data:`CLOSE` of 1 (where one noisy take decides)."""
    return any(1.0 / CLOSE <= r <= CLOSE for r in ratios)


def _measure(time_case: Callable[[], tuple[float, float, bool]], tokens: int) -> Speed:
    """Time the case (``time_case``: the ratios and whether they were measured under load);
    where a ratio is within :data:`CLOSE` of 1, :data:`TAKES` times, each ratio the median
    of its takes (a take under load makes the whole one "measured under load"). A
    measurement that fails for any reason counts as "slower" (torch's kernel keeps dense
    plans), never as an error in the call that triggered it.

    Why the takes (session 37, the Xeon): the bf16 forward at T=4096 measures 0.82-0.89 of
    SDPA's time, but one take kept by session 36 read 1.02; every later process then sent
    dense bf16 plans to torch's kernel, and a 32-node tree verification, whose dense part
    runs inside blockwise, took 2x its time (0.50 ms, 0.27 with the kernel)."""
    takes: list[tuple[float, float, bool]] = []
    _measuring.on = True
    try:
        # The first dense call may come from inside no_grad() or inference_mode(): measure
        # in a context of our own, with gradients on for the backward.
        with torch.inference_mode(False), torch.enable_grad():
            while len(takes) < TAKES:
                takes.append(time_case())
                if len(takes) == 1 and not _close(*takes[0][:2]):
                    break  # (clearly one side: a noisy take does not turn it)
    except Exception as err:  # any failure: the safe answer, and why
        return Speed(2.0, 2.0, f"measurement failed ({type(err).__name__}: {err})", 0)
    finally:
        _measuring.on = False
    forward, backward = (statistics.median(take[i] for take in takes) for i in (0, 1))
    source = UNDER_LOAD if any(take[2] for take in takes) else "measured"
    return Speed(round(forward, 3), round(backward, 3), source, tokens)


def _time_case(
    dtype: torch.dtype = torch.float32, t: int | None = None, bias: bool = False
) -> tuple[float, float, bool]:
    """(forward, forward+backward) ratios of native over torch's time on :data:`CASE`
    (``t`` tokens), and whether either was measured under load (:func:`_best_ratio`). ``bias``: with ALiBi, against what runs it without the native kernel
    (the ``blockwise-flash`` backend: torch's fused kernel on tiles, the bias added to
    each), whose cost is not SDPA's: on the Sapphire Rapids-class Xeon of session 26, SDPA
    ran causal bf16 on AMX while a bf16 ALiBi plan through torch's tiles took 1.3-3.5x the
    native kernel's time, so SDPA's speed said nothing about it."""
    from attnkit import masks  # (the core imports the backends)
    from attnkit.attention import attention

    b, h, t_case, d = CASE
    t = t or t_case
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(dtype) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kwargs: dict = {"causal": True}
    if bias:
        kwargs["score_mod"] = masks.alibi(h)

        def theirs(q, k, v):
            return attention(q, k, v, backend="blockwise-flash", **kwargs)
    else:

        def theirs(q, k, v):
            return sdpa(q, k, v, is_causal=True)

    with torch.no_grad():
        forward, loaded = _best_ratio(
            lambda: attention(q, k, v, backend="blockwise", **kwargs),
            lambda: theirs(q, k, v),
        )
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def native_step():
        attention(qg, kg, vg, backend="blockwise", **kwargs).sum().backward()

    def torch_step():
        theirs(qg, kg, vg).sum().backward()

    backward, loaded_backward = _best_ratio(native_step, torch_step)
    return forward, backward, loaded or loaded_backward


def _time_walk() -> tuple[float, float, bool]:
    """(ratio, ratio, loaded): a float32 paged step's time read a head at a time over its
    time walking each page whole (:func:`heads_apart`)."""
    from attnkit.backends.blockwise import native
    from attnkit.backends.blockwise.plan import NATIVE_CPU, build_plan

    h, keys, page_size, d = WALK_CASE
    g = torch.Generator().manual_seed(0)
    n = keys // page_size
    q = torch.randn(1, h, 1, d, generator=g)
    k_pages, v_pages = (torch.randn(n, h, page_size, d, generator=g) for _ in range(2))
    table = torch.randperm(n, generator=g)[None]  # (1, n)
    plan = build_plan(
        q, torch.empty(1, h, keys, d), scale=d**-0.5, causal=None, window=None, mask=None,
        mask_mod=None, score_mod=None, block_mask=None, engine=NATIVE_CPU,
    )  # fmt: skip

    def step(apart: bool):
        return lambda: native.forward_paged(plan, q, k_pages, v_pages, table, heads_apart=apart)

    with torch.no_grad():
        ratio, loaded = _best_ratio(step(True), step(False))
    return ratio, ratio, loaded


def _time_flash() -> tuple[float, float, bool]:
    """(ratio, ratio, loaded): torch's fused forward on bf16 over the same on float32
    copies, the copies' making included (:func:`flash_reads_bf16`)."""
    from attnkit.backends.blockwise import flash_cpu  # (it imports this package)

    b, h, t, d = FLASH_CASE
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(torch.bfloat16) for _ in range(3))

    def call(upcast: bool) -> Callable[[], object]:
        def run() -> object:
            x = (q.float(), k.float(), v.float()) if upcast else (q, k, v)
            return flash_cpu._FORWARD(*x, 0.0, True, scale=d**-0.5)

        return run

    with torch.no_grad():
        ratio, loaded = _best_ratio(call(False), call(True))
    return ratio, ratio, loaded


def _time_decode(dtype: torch.dtype, grouped: bool, keys: int) -> tuple[float, float, bool]:
    """(ratio, ratio, loaded): a decode step's time on the native kernel over SDPA's
    (:func:`decode_pays`), no gradient."""
    from attnkit.attention import attention  # (the core imports the backends)

    h, h_kv = DECODE_HEADS[grouped]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, 1, _DECODE_D, generator=g).to(dtype)
    k, v = (torch.randn(1, h_kv, keys, _DECODE_D, generator=g).to(dtype) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        ratio, loaded = _best_ratio(
            lambda: attention(q, k, v, backend="blockwise"),
            lambda: sdpa(q, k, v, enable_gqa=grouped),
        )
    return ratio, ratio, loaded
