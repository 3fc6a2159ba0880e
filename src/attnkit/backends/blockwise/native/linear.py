"""The native library's skinny linear layer (``linear.h``): ``x @ weight.T + bias`` for
the few rows of a decode step, reading the weight once, in place.

At a few rows a linear layer's time is one pass over its weight, and torch's paths read
it slowly there: 8 rows of GPT-2 small's linears took 28.5-29.4 ms a step through oneDNN
on a prepacked copy and 50 ms through MKL, where the kernel reads the weights as stored
in 25.7 (2 threads of the Xeon of session 27; one row: 20.5 against oneDNN's 23.4). Each
output is one dot product whose sum does not depend on the threads.
:class:`attnkit.models.linear.Linear` calls it on a layer prepared for inference
(:func:`~attnkit.models.linear.pack_linears`) for calls of at most :data:`MAX_ROWS` rows.
"""

from __future__ import annotations

import torch

from attnkit.backends.blockwise.native import _check_code, _kernel
from attnkit.backends.blockwise.native.build import library

__all__ = ["MAX_ROWS", "ONE_THREAD", "linear", "takes"]

#: Most rows of ``x`` (tokens) a call sends to the kernel; more go to oneDNN's copy. At
#: 16 rows the kernel took 43.8 ms a GPT-2-small step against oneDNN's 35.5 (its sums for
#: 8 rows of x at a time: a second pass over the weight, from L1).
MAX_ROWS = 8
#: Below this many multiply-adds a call runs on the calling thread alone (waking a second
#: one costs more than it saves), as
#: :data:`attnkit.backends.blockwise.native.PAGED_ONE_THREAD`.
ONE_THREAD = 2**16


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs ``x`` ``(..., in)`` against ``weight`` ``(out, in)``:
    float32 CPU tensors, at most :data:`MAX_ROWS` rows, a weight whose rows are contiguous,
    and a built kernel. (The caller has checked that no gradient is wanted.)"""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[-1]  # (else F.linear says what is wrong)
        and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
        and x.device.type == "cpu"
        and weight.stride(-1) == 1
        and library() is not None
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` ``(..., out)`` from ``x`` ``(..., in)``, where :func:`takes`
    holds.

    Raises:
        RuntimeError: the kernel failed (it checks the sizes it is given).
        MemoryError: it ran out of memory.
    """
    n, k = weight.shape
    rows = x.reshape(-1, k)  # (m, in)
    if rows.stride(-1) != 1 or rows.stride(0) < k:  # (an expanded x: rows stride 0)
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    threads = 1 if m * n * k < ONE_THREAD else torch.get_num_threads()
    code = _kernel("attnkit_linear")(
        rows.data_ptr(), rows.stride(0), weight.data_ptr(), weight.stride(0),
        None if b is None else b.data_ptr(), y.data_ptr(), n, m, n, k, threads,
    )  # fmt: skip
    _check_code(code)
    return y.view(*x.shape[:-1], n)
