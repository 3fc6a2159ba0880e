import pytest
import torch
from torch import nn

from attnkit.modules._projection import fused_qkv
from tests.conftest import TOL


@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_equals_three_linears(bias):
    lins = [nn.Linear(6, 4, bias=bias).double() for _ in range(3)]
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    ours = fused_qkv(x, *lins)
    for got, lin in zip(ours, lins, strict=True):
        torch.testing.assert_close(got, lin(x), **TOL[torch.float64])
    sum(t.square().sum() for t in ours).backward()
    assert all(lin.weight.grad is not None for lin in lins)


def test_fused_qkv_rejects_mixed_biases():
    with pytest.raises(ValueError, match="bias"):
        fused_qkv(
            torch.randn(1, 2, 3), nn.Linear(3, 3), nn.Linear(3, 3, bias=False), nn.Linear(3, 3)
        )
