"""The shared timing pieces of the benches (``attnkit.bench.timing``)."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from attnkit.bench.timing import Case, Unsupported, time_case, time_cases


def _case(impl: str) -> Case:
    return Case("kernel", impl, "causal", 4, "fp32", False, {})


def test_time_cases_runs_round_robin_after_a_warm_up():
    order: list[str] = []

    def build(case: Case):
        return lambda: order.append(case.impl)

    cases = time_cases([_case("a"), _case("b")], 3, build)
    assert order == ["a", "b"] + ["a", "b"] * 3  # warm-ups, then one run of each per round
    assert all(len(c.times) == 3 and c.seconds is not None for c in cases)


def test_a_case_that_cannot_run_is_a_note_not_a_crash():
    def build(case: Case):
        if case.impl == "flex":
            raise Unsupported("no backward on CPU")
        if case.impl == "broken":
            raise RuntimeError("boom\nmore")
        return lambda: None

    flex, broken, fine = time_cases([_case("flex"), _case("broken"), _case("ok")], 1, build)
    assert flex.seconds is None and flex.note == "unsupported: no backward on CPU"
    assert broken.seconds is None and broken.note == "failed: RuntimeError: boom"
    assert fine.seconds is not None and fine.note == ""
    assert time_case(_case("ok"), 2, build).seconds is not None


def test_the_benches_do_not_import_each_other():
    """Regression: kernel_layer imported Case and time_cases from suite, which imported
    kernel_layer back."""
    code = "import sys, attnkit.bench.kernel_layer; print('attnkit.bench.suite' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_interleaved_samples_last_min_sample_and_rounds_are_shuffled(monkeypatch):
    """On a fake clock: a 2 ms call is repeated 5 times per 10 ms sample, a 20 ms call
    once; every round runs each sample once, not always in the same order; the times
    are per call."""
    from attnkit.bench import timing

    now = [0.0]
    order: list[str] = []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def call(name: str, seconds: float):
        def run():
            order.append(name)
            now[0] += seconds

        return run

    times = timing.interleaved({"a": call("a", 0.002), "b": call("b", 0.02)}, 6, 0.01, seed=1)
    assert times["a"] == pytest.approx([0.002] * 6) and times["b"] == pytest.approx([0.02] * 6)
    timed = order[4:]  # after two warm-up calls each
    assert len(timed) == 6 * (5 + 1)
    firsts = {timed[i * 6] for i in range(6)}  # which sample opened each round
    assert firsts == {"a", "b"}


def test_spread_is_median_and_quartiles():
    from attnkit.bench.timing import spread

    assert spread([3.0]) == (3.0, 3.0, 3.0)
    assert spread([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, 2.0, 4.0)


def test_paired_ratio_is_the_median_of_the_rounds_ratios():
    """The machine slows down 3x in the middle of round 3 (between its two calls): every
    round but that one reads 0.5, and so does the median of the rounds' ratios, while the
    ratio of the two medians takes one side's from before and the other's from after the
    change (1/6)."""
    from attnkit.bench.timing import paired_ratio

    num, den = [1.0, 1.0, 1.0, 3.0, 3.0], [2.0, 2.0, 6.0, 6.0, 6.0]
    assert paired_ratio(num, den) == (0.5, 0.5, 0.5)
    assert statistics.median(num) / statistics.median(den) == pytest.approx(1 / 6)
    assert paired_ratio([3.0, 1.0], [1.0, 1.0]) == (2.0, 1.5, 2.5)


@pytest.mark.parametrize(
    ("num", "den", "match"),
    [([1.0], [1.0, 2.0], "equal, non-empty"), ([], [], "equal, non-empty"),
     ([1.0], [0.0], "positive"), ([-1.0], [1.0], "positive")],
)  # fmt: skip
def test_paired_ratio_rejects_unpaired_or_non_positive_times(num, den, match):
    from attnkit.bench.timing import paired_ratio

    with pytest.raises(ValueError, match=match):
        paired_ratio(num, den)


def test_case_ratio_reads_two_cases_timed_round_robin():
    """The target row of two cases: the paired median, its quartiles and the ratio of
    medians beside it; all None where a case did not run; as text with its quartiles."""
    from attnkit.bench.timing import case_ratio, ratio_text

    a, b = _case("a"), _case("b")
    a.times, b.times = [1.0, 3.0, 3.0, 8.0], [2.0, 2.0, 6.0, 4.0]  # ratios 0.5 1.5 0.5 2
    row = case_ratio(a, b)
    assert row["ratio"] == 1.0 and row["quartiles"] == [0.5, 1.625]
    assert row["ratio of medians"] == pytest.approx(3.0 / 3.0)
    assert ratio_text(row) == "1.000 [0.500-1.625]"
    empty = {"ratio": None, "quartiles": None, "ratio of medians": None}
    assert case_ratio(a, None) == empty and case_ratio(a, _case("c")) == empty
    assert ratio_text(empty) == "-"
