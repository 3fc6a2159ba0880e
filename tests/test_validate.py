"""The shared argument checks: bool is not an int, bounds, finiteness, names in messages."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import (
    CausalAttention,
    KVCache,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV2,
    causal_mask,
    load_seed_state_dict,
)
from attnkit import attention as attention_fn
from attnkit import masks as M
from attnkit._validate import (
    broadcasts_to,
    check_backend,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_optional_int,
    check_probability,
)
from attnkit.models import AttentionInputs, CausalSelfAttention, MultiHeadLatentAttention


def test_check_int_refuses_bool_and_names_the_argument():
    with pytest.raises(TypeError, match="n_kv_heads must be an int.*bool"):
        check_int(True, "n_kv_heads")


@pytest.mark.parametrize("bad", [2.5, "3", None])
def test_check_int_refuses_non_ints(bad):
    with pytest.raises(TypeError, match="max_new_tokens"):
        check_int(bad, "max_new_tokens")


def test_check_int_bounds():
    assert check_int(1, "n") == 1
    assert check_int(0, "n", minimum=0) == 0
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        check_int(0, "n")
    with pytest.raises(ValueError, match="n must be <= 4, got 5"):
        check_int(5, "n", maximum=4)
    assert check_optional_int(None, "n") is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_check_float_refuses_non_finite(bad):
    with pytest.raises(ValueError, match="lr must be finite"):
        check_float(bad, "lr")


def test_check_float_bounds_and_types():
    assert check_float(3, "lr") == 3.0
    with pytest.raises(TypeError, match="lr must be a number"):
        check_float(True, "lr")
    with pytest.raises(ValueError, match="lr must be > 0"):
        check_float(0.0, "lr", minimum=0.0, min_inclusive=False)


def test_check_probability():
    assert check_probability(0.0, "dropout") == 0.0
    with pytest.raises(ValueError, match=r"dropout must be < 1.0, got 1.0"):
        check_probability(1.0, "dropout")
    with pytest.raises(ValueError, match="dropout must be >= 0"):
        check_probability(-0.1, "dropout")


def test_check_bool_and_choice():
    assert check_bool(False, "qkv_bias") is False
    with pytest.raises(TypeError, match="qkv_bias must be True or False.*'no'"):
        check_bool("no", "qkv_bias")
    assert check_choice("a", "mode", ("a", "b")) == "a"
    with pytest.raises(ValueError, match="mode must be one of 'a', 'b'; got 'c'"):
        check_choice("c", "mode", ("a", "b"))


def test_check_alignment_refuses_typos_and_non_strings():
    from attnkit._validate import check_alignment

    assert check_alignment("top_left") == "top_left"
    assert check_alignment("bottom_right", "causal") == "bottom_right"
    with pytest.raises(
        ValueError, match="alignment must be 'top_left' or 'bottom_right'.*'botom_right'"
    ):
        check_alignment("botom_right")
    with pytest.raises(TypeError, match="causal must be 'top_left' or 'bottom_right', got bool"):
        check_alignment(True, "causal")


def test_check_window_is_an_int_of_at_least_one():
    from attnkit._validate import check_window

    assert check_window(None) is None and check_window(3) == 3
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        check_window(0)
    with pytest.raises(TypeError, match="window must be an int.*bool"):
        check_window(True)
    with pytest.raises(TypeError, match="window must be an int.*None"):
        check_window(None, optional=False)


def test_check_backend_accepts_auto_and_registered_names_and_lists_the_valid_ones():
    assert check_backend("auto") == "auto"
    assert check_backend("reference") == "reference"
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; valid: auto, .*sdpa"):
        check_backend("nope")


def test_modules_take_check_backend_from_validate():
    """``check_backend`` moved out of the private ``modules._common``; the modules use it."""
    from attnkit.modules import MultiHeadAttention, _common

    assert not hasattr(_common, "check_backend")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        MultiHeadAttention(4, 4, 8, 0.0, num_heads=2, backend="nope")


def _q() -> torch.Tensor:
    return torch.randn(1, 2, 4, 8)


def _cache() -> KVCache:
    return KVCache(1, 8, 2, 4)


def _kv(t: int = 1) -> torch.Tensor:
    return torch.randn(1, 2, t, 4)


# Each probe: a public call with one bad argument, the error it must raise and a pattern
# naming the argument (and the value) in the message. Before issue 23 each of these was an
# AttributeError, IndexError, a torch error that named no argument, or silently accepted.
PROBES = [
    ("causal_mask q_len bool", lambda: causal_mask(True, 4), TypeError, r"q_len .*bool \(True\)"),
    ("causal_mask q_len float", lambda: causal_mask(2.0, 4), TypeError, r"q_len .*float \(2.0\)"),
    (
        "causal_mask k_len < 0",
        lambda: causal_mask(4, -1),
        ValueError,
        r"k_len must be >= 0, got -1",
    ),
    ("window_mask q_len < 0", lambda: M.window_mask(-4, 4, 2), ValueError, r"q_len .* -4"),
    (
        "window_mask causal str",
        lambda: M.window_mask(4, 4, 2, causal="no"),
        TypeError,
        r"causal .*'no'",
    ),
    (
        "and_masks non-callable",
        lambda: M.and_masks(M.prefix_lm(1), 3),
        TypeError,
        r"and_masks: mod 1 .* 3",
    ),
    ("or_masks non-callable", lambda: M.or_masks("a"), TypeError, r"or_masks: mod 0 .*'a'"),
    (
        "MultiHeadAttention qkv_bias str",
        lambda: MultiHeadAttention(4, 4, 6, 0.0, num_heads=2, qkv_bias="no"),
        TypeError,
        r"qkv_bias .*'no'",
    ),
    (
        "CausalAttention qkv_bias int",
        lambda: CausalAttention(3, 2, 6, 0.0, qkv_bias=0),
        TypeError,
        r"qkv_bias .*int \(0\)",
    ),
    (
        "SelfAttentionV2 qkv_bias str",
        lambda: SelfAttentionV2(3, 2, qkv_bias="y"),
        TypeError,
        r"qkv_bias .*'y'",
    ),
    (
        "MultiHeadAttentionWrapper qkv_bias int",
        lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2, qkv_bias=1),
        TypeError,
        r"qkv_bias .*int \(1\)",
    ),
    (
        "CausalSelfAttention qkv_bias int",
        lambda: CausalSelfAttention(8, 8, num_heads=2, qkv_bias=1),
        TypeError,
        r"qkv_bias .*\(1\)",
    ),
    (
        "CausalSelfAttention sinks str",
        lambda: CausalSelfAttention(8, 8, num_heads=2, sinks="y"),
        TypeError,
        r"sinks .*'y'",
    ),
    (
        "MultiHeadLatentAttention qkv_bias str",
        lambda: MultiHeadLatentAttention(8, 8, num_heads=2, kv_rank=4, rope_dim=2, qkv_bias="x"),
        TypeError,
        r"qkv_bias .*'x'",
    ),
    (
        "MultiHeadLatentAttention sinks int",
        lambda: MultiHeadLatentAttention(8, 8, num_heads=2, kv_rank=4, rope_dim=2, sinks=1),
        TypeError,
        r"sinks .*\(1\)",
    ),
    (
        "CausalSelfAttention x of the wrong width",
        lambda: CausalSelfAttention(8, 8, num_heads=2)(
            torch.randn(1, 3, 5), AttentionInputs(torch.arange(3))
        ),
        ValueError,
        r"x must be \(batch, tokens, d_in=8\), got \(1, 3, 5\)",
    ),
    (
        "CausalSelfAttention x 2-D",
        lambda: CausalSelfAttention(8, 8, num_heads=2)(
            torch.randn(3, 8), AttentionInputs(torch.arange(3))
        ),
        ValueError,
        r"x must be .*got \(3, 8\)",
    ),
    (
        "CausalSelfAttention inputs None",
        lambda: CausalSelfAttention(8, 8, num_heads=2)(torch.randn(1, 3, 8), None),
        TypeError,
        r"inputs must be an AttentionInputs, got NoneType",
    ),
    (
        "AttentionInputs input_pos list",
        lambda: AttentionInputs([0, 1]),
        TypeError,
        r"input_pos .*list",
    ),
    (
        "AttentionInputs input_pos 2-D",
        lambda: AttentionInputs(torch.zeros(1, 2, dtype=torch.long)),
        ValueError,
        r"input_pos .*\(1, 2\)",
    ),
    (
        "KVCache dtype str",
        lambda: KVCache(1, 8, 2, 4, dtype="float32"),
        TypeError,
        r"dtype .*'float32'",
    ),
    (
        "KVCache dtype int",
        lambda: KVCache(1, 8, 2, 4, dtype=torch.long),
        TypeError,
        r"dtype .*torch.int64",
    ),
    (
        "KVCache.update input_pos list",
        lambda: _cache().update([0], _kv(), _kv()),
        TypeError,
        r"input_pos .*list",
    ),
    (
        "KVCache.update input_pos float",
        lambda: _cache().update(torch.tensor([0.0]), _kv(), _kv()),
        TypeError,
        r"input_pos .*torch.float32",
    ),
    (
        "KVCache.update input_pos < 0",
        lambda: _cache().update(torch.tensor([-1]), _kv(), _kv()),
        ValueError,
        r"input_pos .*>= 0, got \[-1\]",
    ),
    (
        "KVCache.update k 3-D",
        lambda: _cache().update(torch.tensor([0]), torch.randn(2, 1, 4), torch.randn(2, 1, 4)),
        ValueError,
        r"k must be \(batch, kv heads, tokens, head_dim\), got \(2, 1, 4\)",
    ),
    (
        "KVCache.key_positions list",
        lambda: _cache().key_positions([0]),
        TypeError,
        r"input_pos .*list",
    ),
    (
        "KVCache.key_positions empty",
        lambda: _cache().key_positions(torch.tensor([], dtype=torch.long)),
        ValueError,
        r"input_pos must be a non-empty 1-D tensor, got shape \(0,\)",
    ),
    (
        "load_seed_state_dict state_dict int",
        lambda: load_seed_state_dict(MultiHeadAttention(4, 4, 6, 0.0, num_heads=2), 3),
        TypeError,
        r"state_dict must be a mapping .* int",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "match"), [p[1:] for p in PROBES], ids=[p[0] for p in PROBES]
)
def test_public_api_probe_raises_a_named_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_probed_calls_still_accept_good_arguments():
    assert causal_mask(0, 0).shape == (0, 0) and causal_mask(2, 3).sum() == 5
    assert M.window_mask(3, 3, 2, causal=False).sum() == 7
    keep = M.and_masks(M.prefix_lm(1), M.causal("top_left"))(0, 0, torch.tensor(1), torch.tensor(0))
    assert bool(keep)
    cache = KVCache(1, 8, 2, 4, dtype=torch.bfloat16)
    keys, values = cache.update(torch.tensor([0, 1]), _kv(2), _kv(2))
    assert keys.dtype == torch.bfloat16 and keys.shape == (1, 2, 2, 4) and values is not None
    assert cache.key_positions(torch.tensor([2])).tolist() == [0, 1, 2]
    att = CausalSelfAttention(8, 8, num_heads=2, qkv_bias=True, sinks=True)
    assert att(torch.randn(1, 3, 8), AttentionInputs(torch.arange(3))).shape == (1, 3, 8)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=5),
    st.lists(st.integers(0, 3), max_size=5),
)
def test_broadcasts_to_agrees_with_torch(shape, target):
    """The plain-int check _check_mask uses agrees with torch.broadcast_shapes (exactly
    the target: no dim grown, no dim added in front)."""
    try:
        want = tuple(torch.broadcast_shapes(tuple(shape), tuple(target))) == tuple(target)
    except RuntimeError:
        want = False
    assert broadcasts_to(shape, target) == want


def test_a_mask_that_does_not_broadcast_is_named():
    q = torch.randn(1, 2, 3, 8)
    for bad in (torch.ones(4, 5, dtype=torch.bool), torch.ones(2, 1, 2, 3, 5, dtype=torch.bool)):
        with pytest.raises(ValueError, match="mask of shape"):
            attention_fn(q, q, q, mask=bad)
