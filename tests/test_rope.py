"""RoPE against an independent complex-number reference, and its relative-position property."""

from __future__ import annotations

import pytest
import torch

from attnkit.rope import RotaryEmbedding, apply_rope, rope_tables, rope_values


def ref_rope(x: torch.Tensor, positions: list[int], theta: float) -> torch.Tensor:
    """float64 reference: pair (x[i], x[i + d/2]) as a complex number rotated by pos * freq_i."""
    x = x.double()
    d = x.shape[-1]
    half = d // 2
    out = torch.empty_like(x)
    for ti, p in enumerate(positions):
        for i in range(half):
            angle = p * theta ** (-2.0 * i / d)
            z = torch.complex(x[..., ti, i], x[..., ti, i + half]) * complex(
                torch.cos(torch.tensor(angle, dtype=torch.float64)).item(),
                torch.sin(torch.tensor(angle, dtype=torch.float64)).item(),
            )
            out[..., ti, i], out[..., ti, i + half] = z.real, z.imag
    return out


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_matches_reference(theta):
    rope = RotaryEmbedding(8, 32, theta)
    x = torch.randn(2, 3, 5, 8)
    positions = [0, 3, 7, 20, 31]
    got = rope(x, torch.tensor(positions))
    torch.testing.assert_close(got.double(), ref_rope(x, positions, theta), atol=2e-6, rtol=1e-5)


def test_scores_depend_on_relative_position_only():
    rope = RotaryEmbedding(16, 64).double()
    q, k = (
        torch.randn(1, 1, 1, 16, dtype=torch.float64),
        torch.randn(1, 1, 1, 16, dtype=torch.float64),
    )

    def score(m: int, n: int) -> float:
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum().item()

    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-6)  # float32 tables
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
    torch.testing.assert_close(rope(q, torch.tensor([9])).norm(), q.norm())  # a rotation


def test_position_zero_is_identity_and_gradients_flow():
    rope = RotaryEmbedding(4, 8)
    x = torch.randn(1, 2, 1, 4, requires_grad=True)
    torch.testing.assert_close(rope(x, torch.tensor([0])), x)
    rope(x, torch.tensor([3])).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_not_in_state_dict():
    assert RotaryEmbedding(4, 8).state_dict() == {}


@pytest.mark.parametrize(
    "args, match",
    [
        ((5, 8), "even, positive head_dim, got 5"),
        ((4, 0), "max_seq_len"),
        ((4, 8, -1.0), "rope_theta"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        rope_tables(*args)


def test_rope_values_match_the_table_and_extend_past_it():
    rope = RotaryEmbedding(8, 16, 500.0)
    pos = torch.tensor([0, 3, 15])
    cos, sin = rope_values(pos, 8, 500.0)
    torch.testing.assert_close(cos, rope.cos[pos])
    torch.testing.assert_close(sin, rope.sin[pos])
    x = torch.randn(1, 2, 2, 8)
    far = torch.tensor([-7, 40])  # before the start and past the table: same formula
    c, s = rope_values(far, 8, 500.0, dtype=torch.float64)
    got = apply_rope(x.double(), c, s)
    torch.testing.assert_close(got, ref_rope(x, far.tolist(), 500.0), atol=1e-10, rtol=1e-10)
