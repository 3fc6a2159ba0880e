"""Linear layers that decode fast on CPU: for inference, a decode step's few rows on
attnkit's native kernel and longer inputs on oneDNN-prepacked weights.

A decode step multiplies a few rows (one per sequence) by every weight matrix of the
model. PyTorch's default CPU path (MKL GEMM on the ``(out, in)`` weight) is slow at
so few rows: for GPT-2 small's matrices at 8 rows it took 46.6 ms a step on one
thread here, where oneDNN on a copy of the weights reordered once into its blocked
layout ("prepacking", what ``torch.compile`` does for frozen CPU models) took 14.9 ms.
At up to :data:`~attnkit.backends.blockwise.native.linear.MAX_ROWS` rows the native
kernel's skinny linear reads the weight itself, in place, faster still (8 rows of the
whole model: 25.7 ms a step against oneDNN's 28.5 on the 2-core Xeon of session 27).

:class:`Linear` is :class:`torch.nn.Linear` (same parameters, same state dict) that
computes that way once :func:`pack_linears` has prepared it and while the call records
no gradient. The prepared state is used only while it is exact: once the weight changes
(in place or replaced) the layer goes back to :func:`torch.nn.functional.linear` until
it is packed again, so a stale copy can never be read. Copies live outside the module
(a weak table), so ``copy.deepcopy``, pickling and state dicts never see them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.backends.blockwise.native import linear as native_linear

__all__ = ["Linear", "pack_linears", "packed_count", "packing_available", "unpack_linears"]

#: Rows the oneDNN reorder is tuned for; 8 served 1, 8 and 64 rows alike when measured.
_ROWS_HINT = 8


@dataclass(frozen=True)
class _Pack:
    source: torch.Tensor  # the weight the copy was made from
    version: int  # its version counter then
    packed: torch.Tensor  # oneDNN's blocked copy


_PACKS: weakref.WeakKeyDictionary[Linear, _Pack] = weakref.WeakKeyDictionary()


def packing_available() -> bool:
    """Whether this torch build can prepack linear weights (oneDNN on the CPU)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """:class:`torch.nn.Linear` that runs on attnkit's kernel or a prepacked weight copy
    once prepared for inference.

    A prepared layer (see :func:`pack_linears`) serves calls with no gradient recording,
    on CPU float32 inputs, outside autocast and ``torch.compile``, while the weight is
    the very tensor its copy was made from, unchanged: a decode step's few rows on the
    native skinny linear (:mod:`attnkit.backends.blockwise.native.linear`, where the
    kernel is built), longer inputs on the copy. Every other call is
    :func:`torch.nn.functional.linear`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pack = _PACKS.get(self)
        if pack is not None and _usable(pack, self.weight, x):
            # (..., in) -> (..., out)
            if native_linear.takes(x, self.weight):
                return native_linear.linear(x, self.weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, pack.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _exact(pack: _Pack | None, weight: torch.Tensor) -> bool:
    """Whether ``pack`` is a copy of ``weight`` as it is now."""
    return pack is not None and weight is pack.source and weight._version == pack.version


def _usable(pack: _Pack, weight: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        not torch.is_grad_enabled()
        and _exact(pack, weight)
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[-1]  # (else F.linear's error, not oneDNN's)
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


def _packable(layer: Linear) -> bool:
    w = layer.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.layout == torch.strided


def pack_linears(model: nn.Module) -> int:
    """Prepack the weights of every :class:`Linear` in ``model`` (CPU float32 ones).

    Idempotent: a layer whose copy is still exact is left as it is, so calling it
    before every generation costs nothing after the first. The copies take as much
    memory as the weights they copy; :func:`unpack_linears` frees them.

    Returns:
        How many layers hold an exact copy afterwards (0 where
        :func:`packing_available` is False).
    """
    if not packing_available():
        return 0
    count = 0
    for layer in model.modules():
        if not isinstance(layer, Linear) or not _packable(layer):
            continue
        w = layer.weight
        if not _exact(_PACKS.get(layer), w):
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROWS_HINT)
            _PACKS[layer] = _Pack(w, w._version, packed)
        count += 1
    return count


def unpack_linears(model: nn.Module) -> None:
    """Free the prepacked copies of ``model``'s :class:`Linear` layers."""
    for layer in model.modules():
        if isinstance(layer, Linear):
            _PACKS.pop(layer, None)


def packed_count(model: nn.Module) -> int:
    """How many :class:`Linear` layers of ``model`` hold an exact prepacked copy."""
    return sum(
        1
        for layer in model.modules()
        if isinstance(layer, Linear) and _exact(_PACKS.get(layer), layer.weight)
    )
