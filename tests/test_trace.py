"""Recording intermediates with attnkit.trace."""

from __future__ import annotations

import torch

import attnkit
from attnkit import MultiHeadAttention, MultiHeadAttentionWrapper, trace


def test_records_every_step_with_shapes():
    mha = MultiHeadAttention(3, 4, 6, 0.0, num_heads=2)
    x = torch.rand(2, 6, 3)
    with torch.no_grad(), trace.record() as rec:
        out = mha(x)
    assert list(rec) == [
        "inputs",
        "queries",
        "keys",
        "values",
        "scores",
        "scaled_scores",
        "masked_scores",
        "weights",
        "context",
        "concat",
        "output",
    ]
    assert rec.shapes()["weights"] == (2, 2, 6, 6)
    torch.testing.assert_close(rec["output"], out)
    torch.testing.assert_close(rec["scaled_scores"], rec["scores"] / 2**0.5)
    upper = torch.ones(6, 6, dtype=torch.bool).triu(1)
    assert (rec["masked_scores"][..., upper] == float("-inf")).all()
    assert torch.isfinite(rec["masked_scores"][..., ~upper]).all()


def test_scopes_name_each_head():
    with trace.record() as rec:
        MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(torch.rand(6, 3))
    assert "heads.0.weights" in rec and "heads.1.context" in rec and "concat" in rec


def test_nothing_recorded_outside_block():
    with trace.record() as rec:
        pass
    MultiHeadAttention(3, 4, 6, 0.0, 2)(torch.rand(6, 3))
    assert len(rec) == 0 and not trace.is_recording()


def test_dropout_weights_recorded():
    m = MultiHeadAttention(3, 4, 6, 0.5, 2)
    with trace.record() as rec:
        m(torch.rand(6, 3))
    assert "dropped_weights" in rec


# --- context-local state (issue 13): real threads, ordered with events ---------------


def _run_in_thread(fn):
    import threading

    errors: list[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    return t, errors


def test_recording_in_one_thread_does_not_capture_another_threads_tensors():
    import threading

    started, done = threading.Event(), threading.Event()

    def other():
        started.wait(5)
        trace.emit("other_thread_tensor", torch.ones(3))
        with trace.scope("other"):
            trace.emit("scoped", torch.ones(2))
        done.set()

    t, errors = _run_in_thread(other)
    with trace.record() as rec:
        started.set()
        assert done.wait(5)
        trace.emit("mine", torch.zeros(1))
    t.join(5)
    assert not errors
    assert list(rec) == ["mine"]


def test_scope_in_one_thread_does_not_rename_another_threads_names():
    import threading

    inside, emitted = threading.Event(), threading.Event()
    other_rec: dict = {}

    def other():
        with trace.record() as rec:
            inside.wait(5)  # the main thread is now inside its scope("main")
            trace.emit("x", torch.ones(1))
            emitted.set()
        other_rec.update(rec)

    t, errors = _run_in_thread(other)
    with trace.record() as rec, trace.scope("main"):
        inside.set()
        assert emitted.wait(5)
        trace.emit("y", torch.ones(1))
    t.join(5)
    assert not errors
    assert list(other_rec) == ["x"]  # not "main.x"
    assert list(rec) == ["main.y"]


def test_recording_in_one_thread_does_not_switch_other_threads_auto_backend(monkeypatch):
    import threading

    from attnkit import backends

    chosen: dict[str, str] = {}
    real_select = backends.select

    def spy(name, call):
        chosen.setdefault(threading.current_thread().name, name)
        return real_select(name, call)

    monkeypatch.setattr(backends, "select", spy)
    recording, done = threading.Event(), threading.Event()
    q = torch.rand(1, 2, 5, 4)

    def other():
        assert recording.wait(5)
        assert not trace.is_recording()
        out = attnkit.attention(q, q, q)
        torch.testing.assert_close(out, attnkit.attention(q, q, q, backend="sdpa"))
        done.set()

    t, errors = _run_in_thread(other)
    t.name = "other"
    with trace.record() as rec:
        assert trace.is_recording()
        recording.set()
        assert done.wait(5)
        attnkit.attention(q, q, q)
    t.join(5)
    assert not errors
    assert chosen["other"] == "auto"  # the other thread's auto was left alone
    assert chosen["MainThread"] == "reference"  # this thread's recording switched it
    assert "weights" in rec and not trace.is_recording()


def test_fast_path_counter_returns_to_zero_after_nested_records():
    with trace.record() as outer:
        with trace.record() as inner:
            trace.emit("a", torch.ones(1))
        trace.emit("b", torch.ones(1))
    assert trace._ACTIVE == 0 and not trace.is_recording()
    assert list(inner) == ["a"] and list(outer) == ["a", "b"]
