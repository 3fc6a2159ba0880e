"""The shared argument checks: bool is not an int, bounds, finiteness, names in messages."""

import math

import pytest

from attnkit._validate import (
    check_backend,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_optional_int,
    check_probability,
)


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
