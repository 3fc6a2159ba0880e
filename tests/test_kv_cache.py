"""KVCache: update(input_pos, k, v) keeps no position; key_positions says what it returns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.kv_cache import KVCache


def stamped(b: int, h: int, times: torch.Tensor, d: int) -> torch.Tensor:
    """Keys whose every entry is the token's time index (and its row, head)."""
    rows = torch.arange(b).view(b, 1, 1, 1) * 1000.0
    heads = torch.arange(h).view(1, h, 1, 1) * 100000.0
    return (times.view(1, 1, -1, 1).double() + rows + heads).expand(b, h, -1, d).clone()


@settings(max_examples=60, deadline=None)
@given(
    window=st.one_of(st.none(), st.integers(1, 9)),
    sinks=st.integers(0, 3),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=8),
    static=st.booleans(),
    bounded=st.booleans(),
)
def test_returned_keys_are_the_times_key_positions_names(window, sinks, chunks, static, bounded):
    """Fuzz: after any sequence of chunks, every returned key is the one written at the
    time :meth:`key_positions` gives (ring, StreamingLLM sinks, chunks longer than the ring)."""
    if window is None:
        sinks = 0
    total = sum(chunks)
    max_len = total if bounded or window is None else None
    cache = KVCache(
        2, max_len, 3, 4, window=window, sink_tokens=sinks, static=static, dtype=torch.float64
    )
    start = 0
    for t in chunks:
        pos = torch.arange(start, start + t)
        keys, values = cache.update(pos, stamped(2, 3, pos, 4), stamped(2, 3, pos, 4) + 0.5)
        k_time = cache.key_positions(pos)
        assert keys.shape[2] == k_time.shape[0] == values.shape[2]
        live = k_time >= 0
        want = stamped(2, 3, k_time[live], 4)
        torch.testing.assert_close(keys[:, :, live], want)
        torch.testing.assert_close(values[:, :, live], want + 0.5)
        end = start + t
        # everything a query may need is there: the sinks and the last `window` times
        needed = set(range(end)) if window is None else set(range(min(sinks, end)))
        if window is not None:
            needed |= set(range(max(0, start - window + 1), end))
        assert needed <= set(k_time[live].tolist())
        if window is not None and (max_len is None or sinks + window < max_len):
            assert cache.k_cache.shape[2] == sinks + window  # bounded memory
        start = end


def test_keys_only_cache_and_memory():
    cache = KVCache(2, 10, 1, 6, value_dim=0)
    assert cache.v_cache is None and cache.nbytes() == 2 * 10 * 6 * 4
    keys, values = cache.update(torch.arange(3), torch.randn(2, 1, 3, 6))
    assert keys.shape == (2, 1, 3, 6) and values is None
    sizes = [KVCache(1, 1024, h, 64).nbytes() for h in (12, 4, 1)]
    assert sizes == [2 * 12 * 1024 * 64 * 4, 2 * 4 * 1024 * 64 * 4, 2 * 1024 * 64 * 4]
    assert KVCache(1, 1024, 12, 64, window=128).nbytes() == sizes[0] // 8
    assert KVCache(1, None, 12, 64, window=124, sink_tokens=4).nbytes() == sizes[0] // 8


def test_overflow_and_misuse_errors():
    cache = KVCache(1, 6, 2, 4)
    cache.update(torch.arange(6), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
    with pytest.raises(ValueError, match="KV cache overflow: writing time index 6"):
        cache.update(torch.tensor([6]), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(ValueError, match="do not fit the cache"):
        cache.update(torch.tensor([0]), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    with pytest.raises(ValueError, match=r"input_pos must have shape \(1,\)"):
        cache.update(torch.tensor([0, 1]), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(ValueError, match="max_seq_len may be None only for a ring"):
        KVCache(1, None, 2, 4)
    with pytest.raises(ValueError, match="sink_tokens needs a window"):
        KVCache(1, 8, 2, 4, sink_tokens=2)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        KVCache(True, 8, 2, 4)
    with pytest.raises(ValueError, match="window must be >= 1"):
        KVCache(1, 8, 2, 4, window=0)


def test_reset_zeroes_and_rewriting_a_full_cache_is_allowed():
    cache = KVCache(1, 4, 1, 2)
    k = torch.randn(1, 1, 4, 2)
    cache.update(torch.arange(4), k, k)
    keys, _ = cache.update(torch.arange(2), k[:, :, :2] * 2, k[:, :, :2] * 2)  # rewind
    torch.testing.assert_close(keys, k[:, :, :2] * 2)
    cache.reset()
    assert not cache.k_cache.any() and not cache.v_cache.any()


@pytest.mark.parametrize(
    "kw, name", [(dict(window=True), "window"), (dict(head_dim=True), "head_dim")]
)
def test_kv_cache_refuses_bool_where_an_int_is_meant(kw, name):
    """Regression: KVCache(window=True) was accepted as a window of 1."""
    args = dict(batch_size=1, max_seq_len=8, num_kv_heads=2, head_dim=4) | kw
    with pytest.raises(TypeError, match=rf"{name} must be an int, got bool"):
        KVCache(**args)


def test_kv_cache_is_exported_from_attnkit_and_models():
    import attnkit
    import attnkit.models
    from attnkit import KVCache as top
    from attnkit.kv_cache import KVCache
    from attnkit.models import KVCache as models

    assert top is KVCache and models is KVCache
    assert "KVCache" in attnkit.__all__ and "KVCache" in attnkit.models.__all__
