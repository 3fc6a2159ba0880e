"""The ``auto`` grid of the native-kernel bench (``attnkit.bench.auto_grid``) and its
per-build driver (``attnkit.bench.native_kernel``): every backend of a case computes the
same attention, each row says what ``auto`` ran and how spread its ratio is, and a build
narrower than torch's kernels runs in a child with torch held to its instruction set."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from attnkit.backends.blockwise import native
from attnkit.bench import auto_grid, isa_env, native_kernel


@pytest.mark.parametrize("pattern", auto_grid.PATTERNS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_backend_of_a_case_computes_the_same_attention(pattern, dtype):
    """So that the grid compares like with like (SDPA gets the pattern's dense mask, in the
    case's dtype), against a float64 reference written here."""
    t = 200
    torch_dtype = auto_grid.DTYPES[dtype]
    kwargs, sdpa_mask = auto_grid.pattern_call(pattern, t, torch_dtype)
    q, k, v = auto_grid.inputs(t, False, seed=3, dtype=torch_dtype)
    scores = q.double() @ k.double().transpose(-1, -2) / 8.0  # (b, h, t, t); d=64
    i, j = torch.arange(t).view(-1, 1), torch.arange(t).view(1, -1)
    keep = j <= i
    if pattern == "window256":
        keep &= i - j < auto_grid.WINDOW
    if pattern == "documents":
        ids = torch.arange(t) // (t // 8)
        keep &= ids.view(-1, 1) == ids.view(1, -1)
    if pattern == "alibi":
        slopes = 2.0 ** (-8.0 * torch.arange(1, 5, dtype=torch.float64) / 4)  # (h,)
        scores = scores - slopes.view(4, 1, 1) * (i - j).abs()
    ref = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()  # (b, h, t, d)
    tol = 2e-2 if dtype == "bf16" else 1e-5
    for name in auto_grid.BACKENDS:
        out = auto_grid.step(auto_grid._call(name, q, k, v, kwargs, sdpa_mask), False)()
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=name)


def test_the_grid_reports_ratio_spread_and_what_auto_ran():
    rows = auto_grid.grid((64,), ("fp32", "bf16"), reps=2, min_sample=0.0, peak_gflops=100.0)
    assert len(rows) == len(auto_grid.PATTERNS) * 2 * 2
    for r in rows:
        assert r["fastest"] in ("sdpa", "blockwise", "blockwise-flash")
        assert r["seconds"][r["fastest"]] == min(s for n, s in r["seconds"].items() if n != "auto")
        q1, q3 = r["auto/fastest quartiles"]
        assert 0 < q1 <= r["auto/fastest"] <= q3
        assert set(r["ran"]) == set(auto_grid.BACKENDS) and r["ran"]["sdpa"] == "sdpa"
        assert r["same"] == (r["ran"]["auto"] == r["ran"][r["fastest"]])
        assert (r["blockwise % of peak"] is None) == (r["dtype"] == "bf16")
    if native.available():  # the grid's blockwise is the kernel itself, forced or not
        assert all(r["ran"]["blockwise"] == "blockwise[native_cpu]" for r in rows)
    text = "\n".join(auto_grid.markdown_rows(rows))
    assert "| pattern | T | dtype | direction | fastest | auto ran |" in text
    assert "worst auto / fastest:" in text


def test_held_env_holds_torch_below_its_own_width(monkeypatch):
    from attnkit.backends.blockwise.native import build

    monkeypatch.setattr(isa_env, "torch_capability", lambda: "AVX512")
    monkeypatch.setattr(build, "host_isas", lambda: ["avx512", "avx2"])
    assert isa_env.held_env("avx2") == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert isa_env.held_env("avx512") is None  # the machine's best: nothing to hold
    # on an AMX machine the lower AVX-512 builds hold oneDNN and MKL below AMX (and bf16)
    monkeypatch.setattr(build, "host_isas", lambda: ["avx512-amx", "avx512-bf16", "avx512"])
    assert isa_env.held_env("avx512-amx") is None
    assert isa_env.held_env("avx512-bf16") == {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3",
    }
    assert isa_env.held_env("avx512")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_VNNI"
    monkeypatch.setattr(isa_env, "torch_capability", lambda: "AVX2")
    assert isa_env.held_env("avx2") is None  # already held (the child itself)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert isa_env.torch_libraries() == "oneDNN up to AVX2"


def test_a_held_build_runs_in_a_child_with_torch_held(monkeypatch):
    """The child gets the held variables, its build, no forced speed, and --isa/--json;
    its rows come back under the build's name; a failed child is a status, not a crash."""
    seen: dict = {}

    def fake_run(argv, env, **kwargs):
        seen.update(argv=argv, env=env)
        out = argv[argv.index("--json") + 1]
        with open(out, "w") as f:
            json.dump({"builds": {"avx2": {"status": "avx2 build", "torch": "AVX2"}}}, f)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setenv("ATTNKIT_NATIVE_SPEED", "fast")
    monkeypatch.setattr(isa_env.subprocess, "run", fake_run)
    held = {"ATEN_CPU_CAPABILITY": "avx2"}
    rows = native_kernel._in_child("avx2", held, quick=True, reps=2)
    assert rows == {"status": "avx2 build", "torch": "AVX2"}
    assert seen["env"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert seen["env"]["ATTNKIT_NATIVE_ISA"] == "avx2"
    assert "ATTNKIT_NATIVE_SPEED" not in seen["env"]
    assert seen["env"][isa_env.CHILD] == "1"  # a child never starts another
    assert seen["argv"][seen["argv"].index("--isa") + 1] == "avx2" and "--quick" in seen["argv"]

    def failing(argv, env, **kwargs):
        return subprocess.CompletedProcess(argv, 1, "", "Traceback...\nRuntimeError: boom\n")

    monkeypatch.setattr(isa_env.subprocess, "run", failing)
    rows = native_kernel._in_child("avx2", held, quick=True, reps=2)
    assert "child process failed" in rows["status"] and "boom" in rows["status"]


def test_an_isa_this_cpu_cannot_run_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        native_kernel.main(["--quick", "--isa", "sparc"])
    assert exit_.value.code == 2 and "sparc" in capsys.readouterr().err


@pytest.mark.slow
def test_the_quick_bench_of_a_held_build_runs_for_real():
    """The whole --quick path of a build narrower than torch's kernels, child included
    (the faked child and the grid test above cover the same pieces in the default tier)."""
    from attnkit.backends.blockwise.native import build

    isa = next((i for i in build.host_isas() if isa_env.held_env(i) is not None), None)
    if isa is None:
        pytest.skip("no build narrower than torch's kernels on this CPU")
    result = native_kernel.run(quick=True, reps=1, isas=[isa])
    rows = result["builds"][isa]
    held = isa_env.held_env(isa) or {}
    want = held.get("ATEN_CPU_CAPABILITY", isa_env.torch_capability().lower())
    assert rows["torch"].lower() == want, rows.get("status")
    assert rows["libraries"] == ", ".join(
        f"{lib} up to {held[var]}"
        for var, lib in (("ONEDNN_MAX_CPU_ISA", "oneDNN"), ("MKL_ENABLE_INSTRUCTIONS", "MKL"))
        if var in held
    )
    assert len(rows["grid"]) == len(auto_grid.PATTERNS) * 2 * 2 * 2
    assert f"## {isa}" in native_kernel.markdown(result)


def test_the_ratio_comes_from_auto_and_the_fastest_timed_back_to_back():
    # phase one: blockwise fastest by its median, auto's rounds drifted (2x); phase two:
    # auto and blockwise alone, 10% apart in every round
    times = {"sdpa": [3.0] * 4, "blockwise": [1.0] * 4, "blockwise-flash": [2.0] * 4,
             "auto": [2.0, 2.0, 1.0, 2.0]}  # fmt: skip
    duel = {"auto": [1.1, 2.2, 1.1], "blockwise": [1.0, 2.0, 1.0]}
    fastest = auto_grid._fastest(times)
    assert fastest == "blockwise"
    row = auto_grid._row("causal", 64, "fp32", False, times, fastest, duel, 64 * 65 // 2, 100.0)
    assert row["fastest"] == "blockwise"
    assert row["auto/fastest"] == pytest.approx(1.1)
    assert row["auto/fastest quartiles"] == pytest.approx([1.1, 1.1])
    assert row["seconds"]["blockwise"] == 1.0 and row["seconds"]["auto"] == 2.0
