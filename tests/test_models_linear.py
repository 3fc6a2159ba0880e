"""attnkit.models.linear: prepacked weights give F.linear's numbers, and never stale ones."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from attnkit.models import GPT, GPTConfig
from attnkit.models.linear import (
    Linear,
    pack_linears,
    packed_count,
    packing_available,
    unpack_linears,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="no oneDNN in this torch")


def _reference(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    w = layer.weight.detach().double()
    b = None if layer.bias is None else layer.bias.detach().double()
    return F.linear(x.double(), w, b)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [(1,), (3, 1), (2, 7), (5, 4, 3)])
@pytest.mark.parametrize("shape", [(17, 9), (64, 130), (1, 33)])
def test_packed_matches_float64_as_well_as_f_linear(rows, shape, bias):
    torch.manual_seed(0)
    d_in, d_out = shape
    layer = Linear(d_in, d_out, bias=bias)
    x = torch.randn(*rows, d_in)
    ref = _reference(x, layer)
    with torch.no_grad():
        plain = layer(x)
        assert pack_linears(layer) == 1
        packed = layer(x)
    assert packed.shape == plain.shape == (*rows, d_out)
    err_plain = (plain.double() - ref).abs().max().item()
    err_packed = (packed.double() - ref).abs().max().item()
    assert err_packed <= 2 * err_plain + 1e-6


def test_strided_and_expanded_inputs():
    torch.manual_seed(1)
    layer = Linear(24, 10)
    pack_linears(layer)
    base = torch.randn(6, 3, 24)
    for x in (base.transpose(0, 1), base[:, ::2], torch.randn(1, 24).expand(4, 24)):
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_changed_weight_is_never_read_from_a_stale_copy():
    torch.manual_seed(2)
    layer = Linear(8, 5)
    x = torch.randn(3, 8)
    pack_linears(layer)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: the version counter moves
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert packed_count(layer) == 0
    layer.weight = torch.nn.Parameter(torch.randn(5, 8))  # replaced
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert pack_linears(layer) == 1 and packed_count(layer) == 1
    with torch.no_grad():
        layer.bias.add_(1.0)  # the bias is read live, never copied
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_gradients_use_the_parameters():
    torch.manual_seed(3)
    layer = Linear(6, 4)
    pack_linears(layer)
    x = torch.randn(2, 6, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    torch.testing.assert_close(layer.weight.grad, torch.ones(2, 4).T @ x.detach())


def test_non_float32_inputs_and_weights_take_f_linear():
    layer = Linear(6, 4).double()
    assert pack_linears(layer) == 0  # a float64 weight is not packed
    x = torch.randn(2, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer32 = Linear(6, 4)
        pack_linears(layer32)
        out = layer32(torch.randn(2, 6))
    assert out.dtype == torch.bfloat16  # autocast is honoured, not bypassed


def test_copies_stay_out_of_deepcopy_pickle_and_state_dict():
    layer = Linear(4, 3)
    pack_linears(layer)
    assert set(layer.state_dict()) == {"weight", "bias"}
    clone = copy.deepcopy(layer)
    again = pickle.loads(pickle.dumps(layer))
    assert packed_count(clone) == 0 and packed_count(again) == 0
    unpack_linears(layer)
    assert packed_count(layer) == 0


def test_gpt_generate_packs_once_and_gives_the_same_tokens():
    torch.manual_seed(4)
    model = GPT(GPTConfig.preset("tiny")).eval()
    idx = torch.randint(0, model.cfg.vocab_size, (3, 7))
    mask = torch.ones_like(idx)
    mask[0, :3] = 0
    plain = model.generate(idx, 6, attention_mask=mask, pack_weights=False)
    assert packed_count(model) == 0
    fast = model.generate(idx, 6, attention_mask=mask)
    n = sum(isinstance(m, Linear) for m in model.modules())
    assert packed_count(model) == n > 0
    assert torch.equal(plain, fast)
    model.train()  # training frees the copies: the weights are about to change
    assert packed_count(model) == 0


def test_gpt_generate_rejects_a_non_bool_pack_weights():
    model = GPT(GPTConfig.preset("tiny"))
    with pytest.raises(TypeError, match="pack_weights"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 1, pack_weights=1)  # type: ignore[arg-type]
