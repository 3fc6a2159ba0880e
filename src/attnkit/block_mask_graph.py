"""A generated block mask's graph: whether a ``mask_mod`` can be one, and its values.

:func:`attnkit.create_block_mask` asks :func:`generated_graph` whether the native kernel
can make a mod's partial tiles itself (it traces, rounds its floats as torch does, and
its ints and indices fit for the sizes); such a block mask keeps the graph instead of its
tiles, and evaluates it with torch ops on index grids (:func:`evaluate_graph`) for its
tile kinds and for every reader other than the kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # mod_graph reaches block_mask through block_mask_cache: no cycle
    from attnkit.mod_graph import ModGraph

__all__ = ["evaluate_graph", "generated_graph"]


def evaluate_graph(
    graph: ModGraph, b: int, h: int, q0: int, q1: int, k0: int, k1: int, device: torch.device
) -> torch.Tensor:
    """A traced mask_mod on rows ``[q0, q1)`` x keys ``[k0, k1)`` with torch ops on
    broadcast index grids (no Python per element): bool ``(b|1, h|1, rows, keys)``. Ints
    in int32 (a generated mask's graph passed :meth:`ModGraph.check` for its sizes)."""

    def grid(n0: int, n1: int, dim: int) -> torch.Tensor:
        shape = [1, 1, 1, 1]
        shape[dim] = n1 - n0
        return torch.arange(n0, n1, dtype=torch.int32, device=device).view(shape)

    grids = (grid(0, b, 0), grid(0, h, 1), grid(q0, q1, 2), grid(k0, k1, 3))
    out = graph.evaluate(None, *grids, int_dtype=torch.int32)
    out = out.to(torch.bool)
    out = out.view((1,) * (4 - out.dim()) + tuple(out.shape))
    return out.expand(out.shape[0], out.shape[1], q1 - q0, k1 - k0)


def generated_graph(
    mask_mod: Callable[..., Any], b: int, h: int, q_len: int, kv_len: int, device: torch.device
) -> tuple[ModGraph | None, str | None]:
    """``(graph, None)`` where the native kernel can make ``mask_mod``'s partial tiles
    itself (traced, exact, in range for these sizes), else ``(None, why not)``."""
    from attnkit import mod_graph  # here: mod_graph -> block_mask_cache -> block_mask -> us

    if device.type != "cpu":
        return None, f"a block mask on {device.type} (generated masks run in the CPU kernel)"
    if torch.compiler.is_compiling():  # (dynamo cannot trace our own tracer)
        return None, "built under torch.compile (its stored tiles are built with torch ops)"
    graph = mod_graph.traced(mask_mod, "mask")
    if isinstance(graph, mod_graph.Unsupported):
        return None, f"the mask_mod does not trace ({graph.reason})"
    why = graph.inexact() or graph.check(b, h, q_len, kv_len)
    if why is None and any(t.dim() > 6 for t in graph.tensors):
        why = "a captured tensor of more than 6 dimensions"
    if why:
        return None, f"the mask_mod is not generated: {why}"
    # a snapshot of what it reads, as stored tiles would be: a tensor mutated in place
    # later changes neither the kinds nor the rows the kernel makes
    tensors = tuple(t.detach().clone() for t in graph.tensors)
    return dataclasses.replace(graph, tensors=tensors, _int_ranges={}), None
