"""The native kernel's one-time speed calibration (``native/calibrate.py``): measured on
first use whatever context the user's call runs in, cached per build, never an error."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import attention
from attnkit.backends.blockwise import native
from attnkit.backends.blockwise.native import build, calibrate

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"no native kernel: {native.status()}"
)


@pytest.fixture
def uncalibrated(monkeypatch, tmp_path):
    """No speed known yet (none forced, none cached), a small measured case."""
    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED", raising=False)
    monkeypatch.setattr(calibrate, "_cache", {})
    monkeypatch.setattr(calibrate, "CASE", (1, 2, 256, 32))
    monkeypatch.setattr(calibrate, "REPS", 2)
    monkeypatch.setattr(calibrate, "MIN_SAMPLE", 0.0)
    monkeypatch.setattr(calibrate, "MIN_SHARE", 0.0)  # (the tests share the machine)
    saved = tmp_path / "speed.json"
    monkeypatch.setattr(calibrate, "_cache_file", lambda key: saved)
    return saved


def _qkv(t=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, t, 32, generator=g) for _ in range(3))


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_first_use_inside_no_grad_or_inference_mode(uncalibrated, context):
    """The first dense call of a process may be an inference call: the calibration (which
    times a backward too) runs in a context of its own and the call is answered."""
    q, k, v = _qkv()
    guard = torch.no_grad() if context == "no_grad" else torch.inference_mode()
    with guard:
        out = attention(q, k, v, causal=True, backend="blockwise")
    ref = attention(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    speed = calibrate.speed()
    assert speed.source == "measured" and speed.forward > 0 and speed.backward > 0


def test_measured_once_then_cached(uncalibrated):
    first = calibrate.speed()
    assert uncalibrated.exists()
    calibrate._cache.clear()  # as a new process
    again = calibrate.speed()
    assert again.source == "cached"
    assert (again.forward, again.backward) == (first.forward, first.backward)


def test_the_speed_file_sits_beside_its_build(monkeypatch, tmp_path):
    """Keyed by the library (so by ISA and source), torch's version, the vector code of
    torch's own kernels, the threads (how many, and whose: native.threads), the dtype and
    the measured length."""
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_files", {})
    # (a build of its own, at -O0: the file's name, not the code's speed, is tested)
    monkeypatch.setattr(build, "FLAGS", tuple("-O0" if f == "-O3" else f for f in build.FLAGS))
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    key = calibrate.cache_key(torch.bfloat16, 4096)
    assert key[1:] == (torch.__version__, f"3t-{build.pool()}", key[3], "bfloat16", 4096)
    key = (*key[:3], "AVX2", *key[4:])
    path = calibrate._cache_file(key)
    assert path is not None and path.parent == tmp_path
    assert path.name.startswith(f"attention-{build.selected_isa()}-") and path.name.endswith(
        f"torch{torch.__version__}-avx2-3t-{build.pool()}-bfloat16-T4096.json"
    )


def test_a_failed_measurement_is_slower_and_not_kept(uncalibrated, monkeypatch):
    def broken():
        raise RuntimeError("no clock")

    monkeypatch.setattr(calibrate, "_time_case", lambda dtype, t, bias=False: broken())
    speed = calibrate.speed()
    assert not speed.forward_ok and not speed.backward_ok
    assert "measurement failed" in speed.source and "no clock" in speed.source
    assert not uncalibrated.exists()
    q, k, v = _qkv(seed=1)
    with torch.no_grad():  # dense plans then run on torch's kernel, same answer
        out = attention(q, k, v, causal=True, backend="blockwise")
    ref = attention(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("forced, ok", [("fast", True), ("slow", False)])
def test_a_forced_speed_skips_the_measurement(uncalibrated, monkeypatch, forced, ok):
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", forced)
    monkeypatch.setattr(
        calibrate, "_time_case", lambda dtype, t, bias=False: pytest.fail("measured")
    )
    speed = calibrate.speed()
    assert speed.forward_ok is ok and speed.source == "ATTNKIT_NATIVE_SPEED"


FEW = native.few_rows() if native.available() else 20


@pytest.mark.parametrize(
    ("rows", "groups", "keys", "native_runs"),
    [(FEW, 1, 2048, False), (FEW + 1, 1, 2048, True), (9, 1, 2048, False), (8, 1, 2048, True),
     (1, 4, 1024, True), (1, 1, 512, True), (256, 1, 2048, True)],
)  # fmt: skip
def test_short_dense_plans_go_to_torch_by_measured_speed(
    monkeypatch, rows, groups, keys, native_runs
):
    """Few query rows per kv head against a dense float32 plan: torch's fused kernel
    (faster there: native.few_rows() for this build's width), with the reason; decode
    steps (at most native.DIRECT_ROWS rows: the kernel beat torch's engine at every
    size), longer queries and masked plans stay native; ATTNKIT_NATIVE_SPEED=fast (the
    tests) runs them all."""
    from attnkit import explain_dispatch

    if not native.available():
        pytest.skip(native.status())
    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED")  # (the tests' "fast": measured here)
    monkeypatch.setattr(
        calibrate,
        "speed",
        lambda dtype=None, keys=None, bias=False: calibrate.Speed(0.5, 0.5, "measured"),
    )
    q = torch.randn(1, 2 * groups, rows, 64)
    k = torch.randn(1, 2, keys, 64)
    text = explain_dispatch(q, k, k, return_lse=True, backend="blockwise")
    forward = next(line for line in text.splitlines() if line.startswith("forward:"))
    assert forward.startswith("forward: native_cpu") == native_runs, text
    if not native_runs:
        assert "torch's fused kernel is faster" in forward
        masked = explain_dispatch(q, k, k, window=64, return_lse=True, backend="blockwise")
        assert "forward: native_cpu" in masked  # nothing else runs a window this fast
    monkeypatch.setattr(
        calibrate,
        "speed",
        lambda dtype=None, keys=None, bias=False: calibrate.Speed(0.5, 0.5, calibrate.FORCED),
    )
    text = explain_dispatch(q, k, k, return_lse=True, backend="blockwise")
    assert "forward: native_cpu" in text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_and_few_rows_stay_native(monkeypatch, dtype):
    """torch's half-precision kernels are slow at few query rows (a decode step: several
    times its float32 time), so neither short-plan bound sends a bf16/fp16 call there."""
    from attnkit import explain_dispatch

    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED")  # (the tests' "fast": measured here)
    monkeypatch.setattr(
        calibrate,
        "speed",
        lambda dtype=None, keys=None, bias=False: calibrate.Speed(0.5, 0.5, "measured"),
    )
    for rows, groups in ((1, 4), (FEW, 1)):
        q = torch.randn(1, 2 * groups, rows, 64, dtype=dtype)
        k = torch.randn(1, 2, 2048, 64, dtype=dtype)
        text = explain_dispatch(q, k, k, return_lse=True, backend="blockwise")
        assert "forward: native_cpu" in text, text


def test_a_decode_step_is_not_judged_by_the_prefill_calibration(monkeypatch):
    """The calibration times a prefill; a decode step (reading the cache in place, memory
    bound) runs on the kernel inside blockwise even where the prefill measured slower."""
    from attnkit import explain_dispatch

    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED")  # (the tests' "fast": measured here)
    monkeypatch.setattr(
        calibrate,
        "speed",
        lambda dtype=None, keys=None, bias=False: calibrate.Speed(2.0, 2.0, "measured"),
    )
    k = torch.randn(1, 2, 8192, 64)
    decode = explain_dispatch(torch.randn(1, 8, 1, 64), k, k, backend="blockwise")
    assert "forward: native_cpu" in decode, decode
    asked: list[tuple] = []  # a decode forward does not even ask (no prefill measured)

    def spy(dtype=None, keys=None, bias=False):
        asked.append((dtype, keys))
        return calibrate.Speed(2.0, 2.0, "measured")

    monkeypatch.setattr(calibrate, "speed", spy)
    decode = explain_dispatch(torch.randn(1, 8, 1, 64), k, k, backend="blockwise")
    assert decode.splitlines()[1] == "forward: native_cpu", decode
    assert asked == [(torch.float32, 8192)], asked  # the backward's, planned beside it
    prefill = explain_dispatch(torch.randn(1, 2, 256, 64), k, k, backend="blockwise")
    assert "slower than torch's kernel" in prefill, prefill


def test_each_dtype_is_measured_in_that_dtype_and_kept_apart(uncalibrated, monkeypatch):
    """torch's bf16 kernel and ours compare differently from fp32 on each CPU: a bf16 call
    is decided by a bf16 measurement, made once, cached apart from the fp32 one."""
    measured: list[torch.dtype] = []

    def fake(dtype, t, bias=False):
        measured.append(dtype)
        return (0.5, 0.6, False) if dtype == torch.float32 else (1.4, 1.5, False)

    monkeypatch.setattr(calibrate, "_time_case", fake)
    files: dict[tuple, object] = {}
    monkeypatch.setattr(calibrate, "_cache_file", lambda key: files.setdefault(key, None))
    fp32, bf16 = calibrate.speed(torch.float32), calibrate.speed(torch.bfloat16)
    assert (fp32.forward, fp32.backward, bf16.forward, bf16.backward) == (0.5, 0.6, 1.4, 1.5)
    assert fp32.forward_ok and not bf16.forward_ok and not bf16.backward_ok
    assert calibrate.speed(torch.bfloat16) is bf16 and calibrate.speed() is fp32
    assert measured == [torch.float32, torch.bfloat16]  # once each
    assert sorted(key[-2] for key in files) == ["bfloat16", "float32"]


def test_a_bf16_call_follows_the_bf16_measurement(monkeypatch):
    """The engines ask for the speed of the call's own dtype (not the kernel's view of it)."""
    from attnkit import explain_dispatch

    asked: list[torch.dtype] = []

    def fake(dtype=torch.float32, keys=None, bias=False):
        asked.append(dtype)
        ratio = 0.5 if dtype == torch.float32 else 1.5
        return calibrate.Speed(ratio, ratio, "measured")

    monkeypatch.setattr(calibrate, "speed", fake)
    q = torch.randn(1, 2, 512, 64)
    text = explain_dispatch(q, q, q, causal=True, backend="blockwise")
    assert "forward: native_cpu" in text, text
    qb = q.bfloat16()
    text = explain_dispatch(qb, qb, qb, causal=True, backend="blockwise")
    assert "forward: flash_cpu" in text and "slower than torch's kernel" in text, text
    assert torch.bfloat16 in asked


@pytest.mark.parametrize(
    ("ratio", "native_runs"), [(0.5, True), (0.96, True), (0.98, False), (1.0, False), (1.2, False)]
)
def test_a_tie_goes_to_torch(ratio, native_runs):
    """Within calibrate.TIE of torch's time the native kernel stands aside: a wrong call
    there costs at most 3%, a noisy "faster" could cost more."""
    speed = calibrate.Speed(ratio, ratio, "measured")
    assert speed.forward_ok is native_runs and speed.backward_ok is native_runs


def test_the_ratio_is_of_the_best_long_samples(monkeypatch):
    """On a fake clock: each sample repeats a call until it lasts MIN_SAMPLE, the two
    alternate, and bursts of a busy neighbour (on either side) do not move the ratio."""
    now = [0.0]
    calls = {"native": 0, "torch": 0}

    def clock():
        return now[0]

    def native_fn():
        calls["native"] += 1
        now[0] += 0.002 + (0.5 if calls["native"] == 9 else 0.0)  # one burst

    def torch_fn():
        calls["torch"] += 1
        now[0] += 0.001 + (0.3 if calls["torch"] in (20, 40) else 0.0)  # two bursts

    monkeypatch.setattr(calibrate.time, "perf_counter", clock)
    monkeypatch.setattr(calibrate.time, "process_time", lambda: now[0] * threads)  # all ours
    monkeypatch.setattr(calibrate, "MIN_SAMPLE", 0.01)
    monkeypatch.setattr(calibrate, "REPS", 5)
    threads = torch.get_num_threads()
    ratio, loaded = calibrate._best_ratio(native_fn, torch_fn)
    assert ratio == pytest.approx(2.0) and not loaded
    assert calls == {"native": 2 + 5 * 5, "torch": 2 + 5 * 10}  # warm-up, then 10 ms samples


def _shared_clock(monkeypatch, native_ms, torch_ms, native_share):
    """A fake wall clock and CPU clock; calls (native, torch) of these lengths, the
    native ones getting native_share(n) of the threads' time at their nth call."""
    now, cpu = [0.0], [0.0]
    calls = {"native": 0, "torch": 0}
    threads = torch.get_num_threads()

    def native_fn():
        calls["native"] += 1
        share = native_share(calls["native"])
        now[0] += native_ms(share) / 1e3
        cpu[0] += native_ms(share) / 1e3 * threads * share

    def torch_fn():
        calls["torch"] += 1
        now[0] += torch_ms / 1e3
        cpu[0] += torch_ms / 1e3 * threads

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(calibrate.time, "process_time", lambda: cpu[0])
    monkeypatch.setattr(calibrate, "MIN_SAMPLE", 0.0)
    monkeypatch.setattr(calibrate, "REPS", 5)
    return native_fn, torch_fn, calls


def test_samples_without_their_threads_time_do_not_count(monkeypatch):
    """A neighbour holding a core through a whole round slows every native sample of it
    (4x here, as a busy loop did to the 2-core Xeon of session 28): those samples do not
    count, and a round where the threads had their time decides."""
    native_fn, torch_fn, calls = _shared_clock(
        monkeypatch,
        native_ms=lambda share: 2.0 if share == 1.0 else 8.0,
        torch_ms=3.0,
        native_share=lambda n: 0.5 if n <= 7 else 1.0,  # (2 warm-up calls, round 1)
    )
    ratio, loaded = calibrate._best_ratio(native_fn, torch_fn)
    assert ratio == pytest.approx(2.0 / 3.0) and not loaded
    assert calls["native"] == 2 + 2 * 5  # a second round was taken


def test_a_measurement_always_under_load_is_not_kept(uncalibrated, monkeypatch):
    """Never enough samples with their threads' time: the best of all, for this process
    only ("measured under load"), measured again by the next; a clean one is kept, and a
    file from before samples were checked is measured again."""
    monkeypatch.setattr(calibrate, "MIN_SHARE", 0.85)
    native_fn, torch_fn, calls = _shared_clock(
        monkeypatch, native_ms=lambda share: 8.0, torch_ms=3.0, native_share=lambda n: 0.5
    )

    def loaded_case(dtype, t, bias=False):
        ratio, loaded = calibrate._best_ratio(native_fn, torch_fn)
        return ratio, ratio, loaded

    monkeypatch.setattr(calibrate, "_time_case", loaded_case)
    speed = calibrate.speed(torch.float32)
    assert speed.source == calibrate.UNDER_LOAD and speed.forward == pytest.approx(8 / 3, 1e-3)
    assert not speed.forward_ok and not uncalibrated.exists()
    assert calls["native"] == 2 + 3 * 5  # every round
    monkeypatch.setattr(calibrate, "_cache", {})
    monkeypatch.setattr(calibrate, "_time_case", lambda dtype, t, bias=False: (0.5, 0.6, False))
    assert calibrate.speed(torch.float32).source == "measured" and uncalibrated.exists()
    monkeypatch.setattr(calibrate, "_cache", {})
    assert calibrate.speed(torch.float32).source == "cached"
    uncalibrated.write_text('{"forward": 1.76, "backward": 1.32, "source": "measured"}')
    monkeypatch.setattr(calibrate, "_cache", {})
    assert calibrate.speed(torch.float32).forward == 0.5  # measured again, not 1.76


def test_a_ratio_near_one_is_the_median_of_three_takes(uncalibrated, monkeypatch):
    """Near 1 one noisy take would decide every later process (session 37: a kept 1.02
    where the kernel measures 0.82-0.89 sent dense bf16 plans to torch's kernel): three
    takes there, each ratio their median; a clear first take is kept alone; a take under
    load makes the whole measurement unkept; a file of one take is measured again."""
    takes = iter([(1.02, 0.5, False), (0.85, 0.55, False), (0.88, 0.45, False)])
    calls = []

    def fake(dtype, t, bias=False):
        calls.append(t)
        return next(takes)

    monkeypatch.setattr(calibrate, "_time_case", fake)
    speed = calibrate.speed(torch.float32)
    assert (speed.forward, speed.backward, speed.source) == (0.88, 0.5, "measured")
    assert speed.forward_ok and len(calls) == calibrate.TAKES == 3
    assert json.loads(uncalibrated.read_text())["takes"] is True

    # a clear first take (outside 0.74-1.35): kept alone
    monkeypatch.setattr(calibrate, "_cache", {})
    uncalibrated.unlink()
    calls.clear()
    takes = iter([(0.5, 1.6, False)])
    assert calibrate.speed(torch.float32).forward == 0.5 and len(calls) == 1

    # one take of three under load: used, not kept
    monkeypatch.setattr(calibrate, "_cache", {})
    uncalibrated.unlink()
    takes = iter([(0.9, 0.9, False), (0.9, 0.9, True), (0.9, 0.9, False)])
    assert calibrate.speed(torch.float32).source == calibrate.UNDER_LOAD
    assert not uncalibrated.exists()

    # a file kept from one take (before the takes): measured again
    monkeypatch.setattr(calibrate, "_cache", {})
    uncalibrated.write_text(
        '{"forward": 1.02, "backward": 0.5, "source": "measured", "load_checked": true}'
    )
    takes = iter([(0.8, 0.5, False)] * 3)
    assert calibrate.speed(torch.float32).forward == 0.8


def test_long_dense_calls_follow_a_measurement_at_long_length(uncalibrated, monkeypatch):
    """Which kernel wins can change with the length: up to twice CASE's tokens the short
    measurement decides, above it one at LONG_TOKENS, made on the first such call."""
    lengths: list[int] = []

    def fake(dtype, t, bias=False):
        lengths.append(t)
        return (1.5, 1.4, False) if t == 256 else (0.6, 0.5, False)

    monkeypatch.setattr(calibrate, "_time_case", fake)
    monkeypatch.setattr(calibrate, "LONG_TOKENS", 1024)
    monkeypatch.setattr(calibrate, "_cache_file", lambda key: None)
    short, edge, long = (calibrate.speed(torch.float32, keys) for keys in (100, 512, 513))
    assert short is edge and (short.tokens, short.forward_ok) == (256, False)
    assert (long.tokens, long.forward, long.backward_ok) == (1024, 0.6, True)
    assert calibrate.speed() is short and lengths == [256, 1024]


@pytest.mark.parametrize(("forward", "backward"), [(1.5, 0.5), (0.5, 1.5)])
def test_a_gradient_call_is_judged_by_its_forward_plus_backward(monkeypatch, forward, backward):
    """A call that records a backward costs its forward and its backward: its dense plan
    runs natively where the measured forward+backward is faster (even if the forward
    alone is not), and on torch's kernel where it is not (even if the forward alone is).
    A call without gradients follows the forward's measurement."""
    from attnkit import explain_dispatch

    monkeypatch.setattr(
        calibrate,
        "speed",
        lambda dtype=None, keys=None, bias=False: calibrate.Speed(forward, backward, "x"),
    )
    q = torch.randn(1, 2, 512, 64)
    with torch.no_grad():
        text = explain_dispatch(q, q, q, causal=True, backend="blockwise")
    assert ("forward: native_cpu" in text) == (forward < 1), text
    qg = q.clone().requires_grad_()
    text = explain_dispatch(qg, qg, qg, causal=True, backend="blockwise")
    lines = text.splitlines()
    assert ("forward: native_cpu" in lines) == (backward < 1), text
    assert ("backward: native_cpu" in lines) == (backward < 1), text
    if backward > 1:
        assert "forward+backward plans" in text
    auto = explain_dispatch(qg, qg, qg, causal=True)
    assert auto.splitlines()[0] == ("backend: blockwise" if backward < 1 else "backend: sdpa")


@pytest.mark.parametrize(
    ("dense", "biased", "engine"), [(1.5, 0.5, "native_cpu"), (0.5, 1.5, "flash_cpu")]
)
def test_alibi_plans_follow_their_own_measurement(monkeypatch, dense, biased, engine):
    """A plan whose score_mod is a relative bias is decided by the measurement with ALiBi
    (against torch's kernel on tiles), not by plain causal against SDPA: on an AMX Xeon
    SDPA ran causal bf16 faster than the native kernel while torch's tiles with the bias
    took 1.3-3.5x the native time."""
    from attnkit import explain_dispatch, masks

    asked: list[bool] = []

    def fake(dtype=torch.float32, keys=None, bias=False):
        asked.append(bias)
        ratio = biased if bias else dense
        return calibrate.Speed(ratio, ratio, "measured")

    monkeypatch.setattr(calibrate, "speed", fake)
    q = torch.randn(1, 4, 512, 64)
    text = explain_dispatch(q, q, q, causal=True, score_mod=masks.alibi(4), backend="blockwise")
    assert f"forward: {engine}" in text, text
    assert asked and all(asked), asked
    if engine == "flash_cpu":
        assert "with a relative bias" in text and "on tiles" in text, text


def test_the_alibi_case_is_measured_against_torch_on_tiles(uncalibrated, monkeypatch):
    """The relative-bias measurement really runs both sides (on a small case) and is kept
    under a key of its own."""
    monkeypatch.setattr(calibrate, "CASE", (1, 2, 128, 32))
    monkeypatch.setattr(calibrate, "MIN_SAMPLE", 0.001)
    monkeypatch.setattr(calibrate, "REPS", 2)
    ran: list[str] = []
    real = calibrate._best_ratio

    def spy(native, torch_fn):
        ran.append("pair")
        return real(native, torch_fn)

    monkeypatch.setattr(calibrate, "_best_ratio", spy)
    files: dict[tuple, object] = {}
    monkeypatch.setattr(calibrate, "_cache_file", lambda key: files.setdefault(key, None))
    speed = calibrate.speed(torch.float32, bias=True)
    assert speed.source == "measured", speed
    assert 0 < speed.forward < 100 and 0 < speed.backward < 100
    assert len(ran) in (2, 2 * calibrate.TAKES)  # forward, forward+backward (a take each)
    assert [key[-2] for key in files] == ["float32-bias"]
    assert calibrate.speed(torch.float32, bias=True) is speed  # once


def test_a_measurement_is_kept_apart_for_each_hold_of_onednn_and_mkl(monkeypatch):
    """torch's bf16 SDPA runs on AMX tiles through oneDNN and MKL, 4x faster than with them
    held below AMX: a measurement made under one hold never decides for another (a held
    benchmark child once reused an unheld measurement and sent bf16 to a 3x slower SDPA)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    free = calibrate.cache_key(torch.bfloat16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    onednn = calibrate.cache_key(torch.bfloat16)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX512_E3")
    both = calibrate.cache_key(torch.bfloat16)
    assert len({free, onednn, both}) == 3
    assert both[3].endswith("+onednn=avx512_core_bf16+mkl=avx512_e3"), both[3]


def test_decode_steps_are_measured_by_length_up_to_the_calls_work(uncalibrated, monkeypatch):
    """calibrate.decode_pays: a decode step pays where a measured step of at most its work
    (DECODE_HEADS at DECODE_KEYS, each dtype and grouping apart) was faster than SDPA,
    each length measured on first need only and kept under a key of its own; forced
    speeds decide alone. And the measurement itself runs both sides (a small real one)."""
    files: dict[tuple, object] = {}
    monkeypatch.setattr(calibrate, "_cache_file", lambda key: files.setdefault(key, None))
    asked: list[tuple] = []

    def fake(dtype, grouped, keys):
        asked.append((grouped, keys))
        ratio = 0.6 if keys >= 2048 else 1.4  # the kernel's fixed costs lose short steps
        return ratio, ratio, False

    monkeypatch.setattr(calibrate, "_time_decode", fake)
    mha = calibrate.DECODE_HEADS[False][0] * 64  # work of one key of the MHA case
    assert not calibrate.decode_pays(torch.float32, False, 100 * mha)  # under 128: none
    assert asked == []
    assert not calibrate.decode_pays(torch.float32, False, 1000 * mha)
    assert asked == [(False, 128), (False, 512)]
    assert calibrate.decode_pays(torch.float32, False, 5000 * mha)
    assert asked == [(False, 128), (False, 512), (False, 2048)]  # (kept: not again)
    assert calibrate.decode_pays(torch.float32, False, 10**9)  # 2048 decides: 8192 unasked
    assert [key[-2:] for key in files] == [("float32-decode-mha", n) for n in (128, 512, 2048)]
    for value, pays in (("fast", True), ("slow", False)):
        monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", value)
        assert calibrate.decode_pays(torch.bfloat16, True, 10**9) is pays
    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED")
    with monkeypatch.context() as m:  # under torch.compile: never measured, never native
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not native.decode_pays(torch.float32, 1, 12, 12, 10**6, 64)
    assert len(asked) == 3
    ratio, same, loaded = calibrate._time_decode(torch.float32, True, 128)
    assert 0 < ratio < 100 and same == ratio and loaded in (True, False)


def test_a_decode_step_the_kernel_cannot_take_is_never_measured(uncalibrated, monkeypatch):
    """A decode step wanting a gradient or weights, or any on a machine without the
    kernel, goes to SDPA without measuring anything (a measurement costs about a second)."""

    measured: list[tuple] = []  # (a measurement's failure is caught: recorded instead)
    monkeypatch.setattr(
        calibrate, "_time_decode", lambda *args: measured.append(args) or (0.5, 0.5, False)
    )
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 12, 1, 64, generator=gen, requires_grad=True)
    k, v = torch.randn(1, 12, 4096, 64, generator=gen), torch.randn(1, 12, 4096, 64)
    out = attention(q, k, v)  # a gradient wanted: not a decode step for the kernel
    out.sum().backward()
    with torch.no_grad():
        attention(q, k, v, need_weights=True)
        monkeypatch.setattr(native, "available", lambda: False)
        attention(q, k, v)
    assert q.grad is not None and measured == []


def _faked(monkeypatch, timer: str, ratios: list[float]):
    """``(files, asked, real)``: calibrate's ``timer`` replaced by one returning ``ratios`` in
    turn (each asked one appended to ``asked``), the files it would keep recorded by key
    in ``files`` (none written), and the real timer."""
    files: dict[tuple, object] = {}
    monkeypatch.setattr(calibrate, "_cache_file", lambda key: files.setdefault(key, None))
    left = iter(ratios)
    asked: list[float] = []

    def fake():
        asked.append(next(left))
        return asked[-1], asked[-1], False

    real = getattr(calibrate, timer)
    monkeypatch.setattr(calibrate, timer, fake)
    return files, asked, real


def test_a_paged_step_reads_a_head_at_a_time_where_that_measured_faster(uncalibrated, monkeypatch):
    """calibrate.heads_apart: measured once (kept under a key of its own), a head at a time
    only where it was faster by more than TIE; forced speeds keep the page walk without
    measuring; forward_paged hands the kernel what was decided (float32 only) unless told.
    And the measurement itself runs both ways (a small real one)."""
    # (near 1: three takes, the median)
    files, asked, real = _faked(monkeypatch, "_time_walk", [0.9, 0.95, 0.85, 0.99, 1.2, 0.97])
    assert calibrate.heads_apart() and calibrate.heads_apart()  # 0.9: apart, kept
    assert len(asked) == 3 and [key[-2:] for key in files] == [
        ("float32-paged-heads-apart", calibrate.WALK_CASE[1])
    ]
    monkeypatch.setattr(calibrate, "_cache", {})
    assert not calibrate.heads_apart()  # 0.99: a tie, the walk stays
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "fast")
    assert not calibrate.heads_apart() and len(asked) == 6
    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED")

    seen: list[int] = []  # what the kernel was handed
    forward = native._kernel("attnkit_forward")
    monkeypatch.setattr(
        native,
        "_kernel",
        lambda name: lambda args: seen.append(args._obj.page_heads_apart) or forward(args),
    )
    q = torch.randn(1, 2, 1, 16)
    pages = torch.randn(4, 2, 16, 16)
    table = torch.tensor([[2, 0, 3]])
    plan = _paged_plan(q, 40)
    for dtype, told, want in (
        (torch.float32, None, 0),  # (the 0.99 kept above: the walk)
        (torch.float32, True, 1),
        (torch.bfloat16, None, 0),  # (bf16 reads a head at a time whatever the field)
    ):
        x, p = q.to(dtype), pages.to(dtype)
        native.forward_paged(plan, x, p, p, table, heads_apart=told)
        assert seen[-1] == want
    monkeypatch.setattr(calibrate, "WALK_CASE", (4, 256, 16, 32))
    ratio, same, loaded = real()
    assert 0 < ratio < 100 and same == ratio and loaded in (True, False)


def _paged_plan(q, keys):
    from attnkit.backends.blockwise.plan import NATIVE_CPU, build_plan

    k = torch.empty(q.shape[0], q.shape[1], keys, q.shape[-1])
    return build_plan(
        q, k, scale=0.25, causal=None, window=None, mask=None, mask_mod=None,
        score_mod=None, block_mask=None, engine=NATIVE_CPU,
    )  # fmt: skip


def test_torch_reads_bf16_in_one_call_where_that_measured_faster(uncalibrated, monkeypatch):
    """calibrate.flash_reads_bf16: measured once (kept under a key of its own), bf16 read as
    it is only where that was faster than float32 copies by more than TIE; forced speeds
    say yes without measuring; under torch.compile, no. And the measurement itself runs
    both (a small real one)."""
    files, asked, real = _faked(monkeypatch, "_time_flash", [0.5, 1.5])  # (clear: a take each)
    assert calibrate.flash_reads_bf16() and calibrate.flash_reads_bf16()  # 0.5: kept
    assert len(asked) == 1
    assert [key[-2:] for key in files] == [("bfloat16-flash-whole", calibrate.FLASH_CASE[2])]
    monkeypatch.setattr(calibrate, "_cache", {})
    assert not calibrate.flash_reads_bf16()  # 1.5: the copies
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setattr(calibrate, "_cache", {})
        assert not calibrate.flash_reads_bf16() and len(asked) == 2
    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "fast")
    assert calibrate.flash_reads_bf16() and len(asked) == 2
    monkeypatch.delenv("ATTNKIT_NATIVE_SPEED")
    monkeypatch.setattr(calibrate, "FLASH_CASE", (1, 2, 64, 16))
    ratio, same, loaded = real()
    assert 0 < ratio < 100 and same == ratio and loaded in (True, False)
