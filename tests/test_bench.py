"""Smoke test of the benchmark suite in --quick mode (tiny sizes, a few seconds)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from attnkit.bench import peers
from attnkit.cli import main


def test_quick_bench_writes_json_markdown(tmp_path, capsys):
    assert main(["bench", "--quick", "--reps", "1", "--serving", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert {row["target"] for row in result["targets"]} == set("abcdefghij") | {
        "cascade",
        "tree",
        "varlen",
        "split-kv",
        "doc-mask",
    }
    measured = [c for cs in result["target_cases"].values() for c in cs if c["seconds"]]
    assert len(measured) >= 12 and all(c["seconds"] > 0 for c in measured)
    flex_bwd = [
        c for c in result["target_cases"]["e"] if c["impl"] == "flex-eager" and c["backward"]
    ]
    assert flex_bwd[0]["note"].startswith("unsupported")  # reported, not silently dropped
    assert result["machine"]["torch"] == torch.__version__
    # a time ratio is the median of its rounds' ratios, its quartiles around it (--reps 1:
    # all three the one round's), the ratio of the medians beside it
    timed = [r for r in result["targets"] if r.get("quartiles")]
    assert {r["target"] for r in timed} >= {"a", "b", "f", "cascade", "tree", "varlen"}
    for r in timed:
        q1, q3 = r["quartiles"]
        assert q1 <= r["ratio"] <= q3 and r["ratio of medians"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "| target | ratio | goal | met |" in md
    assert f"{timed[0]['ratio']:.3f} [" in md
    out = capsys.readouterr().out
    assert "Targets" in out
    # bench --quick says it is a smoke run (no toy-size "NO" grades), writes the promised
    # plot, and prints where the results went
    assert "Smoke run" in md and "| NO |" not in md and "| yes |" not in md
    assert (tmp_path / "targets.png").read_bytes()[:4] == b"\x89PNG"
    assert f"results: {tmp_path / 'results.json'}" in out and "targets.png" in out
    assert "smoke run" in out.splitlines()[-1]
    # --serving: the paged decode step in both dtypes and the race against transformers
    serving = json.loads((tmp_path / "serving.json").read_text())
    assert [row["dtype"] for row in serving["paged_decode"]] == ["float32", "bfloat16"]
    assert serving["continuous_batching"]["identical_requests"] == 3
    assert "## Serving (issue 20)" in out and "requests with identical tokens" in out
    assert (tmp_path / "serving.md").read_text() in out


def test_bad_reps_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "--quick", "--reps", "0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_peers_compute_the_same_attention():
    """The compared implementations agree, so the benchmark compares like with like."""
    torch.manual_seed(0)
    outs = {}
    for name in ("attnkit-auto", "attnkit-blockwise", "attnkit-reference", "sdpa"):
        torch.manual_seed(1)
        outs[name] = peers.kernel_runner(
            name, b=1, h=2, t=300, d=16, dtype=torch.float32, pattern="window256", backward=False
        )()
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["sdpa"], atol=1e-5, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="valid"):
        peers.kernel_runner(
            "nope", b=1, h=1, t=8, d=8, dtype=torch.float32, pattern="causal", backward=False
        )


def test_machine_peak_and_the_kernel_report(tmp_path):
    """The machine's fp32 peak and bandwidth are measured (positive, and all threads at least
    as fast as one within noise), and the per-build report names every build and row."""
    from attnkit.backends.blockwise import native
    from attnkit.bench import native_kernel

    one = native_kernel.machine_peak(1)
    assert one["copy_gbps"] > 0.1
    if native.available():
        assert one["fp32_gflops"] > 0.1
    fake = {
        "machine": {"cpu": "Test CPU", "threads": 2, "torch": "x"},
        "t": 8192,
        "builds": {
            "avx2": {
                "status": "avx2 build",
                "peak": {"1 thread": {"fp32_gflops": 50.0, "copy_gbps": 20.0}},
                "causal": {"native/sdpa fwd": 0.7541, "fwd % of peak": 71.04},
                "grid": [{"pattern": "causal", "t": 1024, "direction": "fwd",
                          "fastest": "blockwise", "auto/fastest": 1.01}],
            },
            "neon": {"status": "this CPU cannot run the neon build"},
        },
    }  # fmt: skip
    native_kernel.write(fake, tmp_path)
    text = (tmp_path / "native.md").read_text()
    # a ratio to three places (0.754 is no 0.75 beside a goal of <= 0.75), a rate to one
    for needle in ("## avx2", "| 1 thread | 50.0 | 20.0 |", "| native/sdpa fwd | 0.754 |",
                   "| fwd % of peak | 71.0 |", "worst auto / fastest: 1.01", "## neon",
                   "cannot run the neon build"):  # fmt: skip
        assert needle in text, needle


def test_native_ab_times_two_sources_on_the_same_call(capsys, monkeypatch):
    """The A/B bench builds the kernel from each source directory and times the same call
    on each: the same source twice gives the same bits and a positive FLOP rate; bad
    sizes are a one-line usage error (exit 2)."""
    from attnkit.backends.blockwise import native
    from attnkit.backends.blockwise.native import build
    from attnkit.bench import native_ab

    if not native.available():
        pytest.skip(f"no native kernel: {native.status()}")
    here = build.SOURCE.parent
    # (built at -O0: what is tested is the building, loading and timing, not the speed)
    monkeypatch.setattr(build, "FLAGS", tuple("-O0" if f == "-O3" else f for f in build.FLAGS))
    attached: list[object] = []  # every build runs on torch's threads, as the package's
    monkeypatch.setattr(native_ab.threads, "attach", lambda lib: attached.append(lib))
    rows = native_ab.compare([here, here], build.selected_isa(), t=200, threads=2, reps=2)
    assert rows[0]["vs_first"] == 1.0 and len(rows) == 2
    assert all(r["same_bits_as_first"] and r["gflops"] > 0 for r in rows)
    assert len(attached) == 2
    rows = native_ab.compare([here, here], build.selected_isa(), 200, 1, 2, backward=True)
    assert all(r["same_bits_as_first"] and r["gflops"] > 0 for r in rows)  # (dQ's bits)
    with pytest.raises(SystemExit) as err:
        native_ab.main([str(here), "--t", "0"])
    assert err.value.code == 2 and "--t" in capsys.readouterr().err


def test_the_backward_forward_rate_is_read_round_by_round(monkeypatch):
    """The backward/forward FLOP rate pairs each fwd+bwd round with a forward timed in the
    same round: a drift of the machine's speed between the forward phase and the fwd+bwd
    one (here a forward 10x slower in its own phase) does not reach it."""
    from attnkit.bench import native_kernel

    def fake_interleaved(fns, reps, min_sample=0.0):
        if "native fwd" in fns:  # the fwd+bwd rounds: each 5x its own round's forward
            speeds = [1.0, 2.0, 3.0]
            fwd = [0.002 * s for s in speeds]
            return {"native": [5 * f for f in fwd], "sdpa": [6 * f for f in fwd],
                    "native fwd": fwd}  # fmt: skip
        return {name: [0.02, 0.02, 0.02] for name in fns}  # the forward phase: slow

    monkeypatch.setattr(native_kernel, "interleaved", fake_interleaved)
    rows = native_kernel.causal_rows(64, reps=3, peak_all=100.0)
    assert rows["bwd/fwd FLOP rate"] == pytest.approx(2.5 / 4)  # 2.5 f / (5 f - f)
    assert rows["native/sdpa fwd+bwd"] == pytest.approx(5 / 6)


def test_the_forward_share_of_peak_is_read_round_by_round(monkeypatch):
    """The forward's share of the peak pairs each forward with the FMA probe timed in its
    own round: on a machine running 1x, 2x and 4x slower from round to round (both slowed
    alike), with the forward's middle round 1.5x slower still, the rounds read 1/2, 1/3 and
    1/2 of the peak: 50%, where the two medians would give 33%; a probe of the peak made
    before, at full speed, reads less."""
    from attnkit.bench import native_kernel

    t = 64
    fwd_flops = 4 * 1 * 4 * t * t * 64 / 2
    probe_flops = 1e9
    monkeypatch.setattr(native_kernel, "fma_probe", lambda threads: (lambda: None, probe_flops))

    def fake_interleaved(fns, reps, min_sample=0.0):
        slow = [1.0, 2.0, 4.0]
        if "fma probe" in fns:  # the forward's rounds: at half the probe's rate each round
            assert "native fwd" not in fns
            probe = [1.0 * s for s in slow]  # 1 GFLOP/s at full speed
            fwd = [
                2 * fwd_flops / probe_flops * p * j for p, j in zip(probe, [1, 1.5, 1], strict=True)
            ]
            return {"native": fwd, "sdpa": fwd, "fma probe": probe}
        return {name: [0.01] * 3 for name in fns}

    monkeypatch.setattr(native_kernel, "interleaved", fake_interleaved)
    rows = native_kernel.causal_rows(t, reps=3, peak_all=1.0)  # GFLOP/s, probed before
    assert rows["fwd % of peak, same rounds"] == pytest.approx(50.0)
    assert rows["fwd % of peak"] == pytest.approx(100 / 6)  # the median round: 3x slow


@pytest.mark.parametrize(
    ("module", "flag", "folder"),
    [
        ("native_kernel", "--json", False),
        ("native_kernel", "--out", True),
        ("mods", "--json", False),
        ("serving", "--out", False),
        ("decode", "--out", False),
        ("context_parallel", "--json", False),
        ("suite", "--out", True),
        ("compile", "--out", True),
    ],
)
def test_an_output_path_is_checked_before_the_run(
    tmp_path, capsys, monkeypatch, module, flag, folder
):
    """A benchmark's output path is made or refused before it runs, not after (a 17-minute
    run lost to a missing --json folder): a missing folder is made, a path that cannot be
    written is a one-line usage error naming the flag (exit 2), and nothing is timed."""
    import importlib

    from attnkit.bench import report

    bench = importlib.import_module(f"attnkit.bench.{module}")

    class Ran(Exception):
        """The check passed: the timed work would start here."""

    real = report.check_output

    def checked(parser, flag_, path, **kw):
        real(parser, flag_, path, **kw)
        if flag_ == flag:
            raise Ran

    def timed(*args):
        raise AssertionError("timed before its output was checked")

    monkeypatch.setattr(time, "perf_counter", timed)  # (the benchmarks' clock)
    monkeypatch.setattr(report, "check_output", checked)
    monkeypatch.setattr(bench, "check_output", checked, raising=False)
    target = tmp_path / "new" / "deeper" / ("out" if folder else "out.json")
    with pytest.raises(Ran):
        bench.main([flag, str(target)])
    assert (target if folder else target.parent).is_dir()  # made where missing

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as err:
        bench.main([flag, str(blocker / "x.json")])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.value.code == 2 and flag in message and "is a file, not a directory" in message
    if not folder:
        with pytest.raises(SystemExit) as err:
            bench.main([flag, str(tmp_path)])
        assert err.value.code == 2 and "is a directory, not a file" in capsys.readouterr().err
