"""Which engine runs a blockwise call, forward and backward: chosen once, when the call is
planned, from one priority list (:data:`~.plan.PRIORITY`: attnkit's native kernel, then
torch's fused flash kernel, then PyTorch ops), every refusal kept.

:func:`plan_call` is the only place that asks the engines whether they take a call; the
forward, the backward, ``auto`` and context-parallel segments read the answer from the
plan (:class:`~.plan.Engines`), and ``plan.engines.explain()`` says why.
"""

from __future__ import annotations

from typing import Any

import torch

from attnkit.backends.blockwise import flash_cpu, native
from attnkit.backends.blockwise.plan import (
    FLASH_CPU,
    FUSED_ENGINES,
    NATIVE_CPU,
    PRIORITY,
    TORCH_TILES,
    Engines,
    TilePlan,
    build_plan,
)

__all__ = ["choose", "plan_call"]


def plan_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    requested: str,
    extra: tuple[torch.Tensor, ...],
    **plan_kwargs: Any,
) -> TilePlan:
    """The plan of a call on the engines from ``requested`` down the priority list, its
    :class:`Engines` chosen (``extra``: the ``score_mod``'s tensors wanting gradients)."""
    passed: list[tuple[str, str, str]] = []
    grad = torch.is_grad_enabled() and (
        bool(extra) or any(x.requires_grad for x in (query, key, value))
    )
    engine = requested
    if engine in FUSED_ENGINES:
        why = flash_cpu.why_not(query, key, value, plan_kwargs.get("score_mod"), extra)
        if (
            why is not None
            and engine == NATIVE_CPU
            and flash_cpu.why_not(query, key, value, None, ()) is None
        ):
            # only the score_mod keeps torch's fused kernel out: the native kernel may run
            # it compiled (native.score_mod_program), forward at least; else the tiles
            plan = build_plan(query, key, engine=engine, **plan_kwargs)
            engines = choose(plan, query.dtype, query.shape[-1], value.shape[-1], extra, grad=grad)
            if engines.forward == NATIVE_CPU:
                plan.engines = engines
                return plan
            passed += [p for p in engines.passed_over if p[1] == NATIVE_CPU]
            passed += [("forward", FLASH_CPU, why), ("backward", FLASH_CPU, why)]
            engine = TORCH_TILES
        elif why is not None:  # neither fused engine: the tiles are planned for PyTorch ops
            for skipped in PRIORITY[PRIORITY.index(engine) : PRIORITY.index(TORCH_TILES)]:
                passed += [("forward", skipped, why), ("backward", skipped, why)]
            engine = TORCH_TILES
    plan = build_plan(query, key, engine=engine, **plan_kwargs)
    plan.engines = choose(
        plan, query.dtype, query.shape[-1], value.shape[-1], extra, passed, grad=grad
    )
    return plan


def choose(
    plan: TilePlan,
    dtype: torch.dtype,
    d: int,
    d_v: int,
    extra: tuple[torch.Tensor, ...],
    passed: list[tuple[str, str, str]] | None = None,
    *,
    grad: bool = False,
) -> Engines:
    """The engines of a planned call (see the module docs); ``grad``: the call records a
    backward, so a dense plan's forward is judged by the measured forward+backward speed
    (:mod:`.native.calibrate`)."""
    passed = list(passed or [])
    if plan.engine == TORCH_TILES:
        return Engines(TORCH_TILES, TORCH_TILES, passed_over=tuple(passed))
    forward = backward = FLASH_CPU
    bf16 = False
    if plan.engine == NATIVE_CPU:
        # what the native kernel would read: bf16 as it is where the build reads it
        # (native.reads_bf16), other half precision upcast to float32, float32/float64 as
        # they are
        bf16 = dtype == torch.bfloat16 and native.reads_bf16(with_backward=grad)
        view = dtype if dtype in (torch.float32, torch.float64) or bf16 else torch.float32
        why = native.why_not(plan, view, d, d_v, call_dtype=dtype, with_backward=grad)
        if why is None:
            forward = NATIVE_CPU
        else:
            passed.append(("forward", NATIVE_CPU, why))
        why = native.why_not_backward(plan, view, d, d_v, extra, call_dtype=dtype)
        if why is None:
            backward = NATIVE_CPU
        else:
            passed.append(("backward", NATIVE_CPU, why))
    if backward == FLASH_CPU and plan.score_mod is not None:
        passed.append(("backward", FLASH_CPU, "a score_mod (its backward runs on the tiles)"))
        backward = TORCH_TILES
    return Engines(forward, backward, bf16, tuple(passed))
