"""The backend registry: the call every backend receives, and how a backend is chosen.

A backend is a function ``fn(call: AttentionCall) -> (context, weights | None, lse | None)``
(a 2-tuple ``(context, weights)`` is accepted too and read as ``lse = None``)
plus a ``supports(call) -> str | None`` check that returns *why* it cannot honour
a call (or None when it can). :func:`dispatch` never lets a backend drop part
of a request: an explicitly named backend that cannot honour it raises, and
``"auto"`` picks the first backend in :data:`AUTO_ORDER` that can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnkit.masks import CausalAlignment, MaskMod, ScoreMod, materialize

if TYPE_CHECKING:
    from attnkit.block_mask import BlockMask

__all__ = [
    "AUTO_ORDER",
    "CUDA_KERNEL",
    "AttentionCall",
    "Backend",
    "BackendResult",
    "auto_order",
    "available_backends",
    "dispatch",
    "generation",
    "get_backend",
    "is_sparse",
    "register_backend",
    "run",
    "select",
]


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention request, as every backend receives it.

    Attributes:
        query: ``(..., h_q, l_q, d)`` (or rank 2 ``(l_q, d)``).
        key: ``(..., h_kv, l_k, d)``.
        value: ``(..., h_kv, l_k, d_v)``.
        mask: bool (True = may attend) or float (added), broadcastable to the scores, or None.
        causal: None, ``"top_left"`` or ``"bottom_right"``.
        scale: the factor applied to ``query @ key^T``.
        dropout_p: dropout on the weights, 0.0 for none.
        need_weights: whether the weights must be returned.
        window: sliding-window size, or None.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)`` predicate (True = attend), or None.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` on the scaled scores, or None.
        block_mask: a :class:`attnkit.BlockMask` fitting the call, or None.
        sinks: ``(h_q,)`` learned sink logits, or None.
        return_lse: whether the log-sum-exp ``(..., h_q, l_q)`` must be returned.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    causal: CausalAlignment | None
    scale: float
    dropout_p: float
    need_weights: bool
    window: int | None = None
    mask_mod: MaskMod | None = None
    score_mod: ScoreMod | None = None
    block_mask: BlockMask | None = None
    sinks: torch.Tensor | None = None
    return_lse: bool = False
    #: What a backend worked out for this call and may need again (blockwise keeps its
    #: plan here, so ``auto_first`` and the run build it once); not part of the request.
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def dense_mask(self) -> torch.Tensor | None:
        """Everything that masks this call (mask, causal, window, mask_mod, block_mask) as
        one dense tensor."""
        dense = materialize(
            self.mask,
            self.causal,
            self.window,
            self.mask_mod,
            self.query.shape,
            self.k_len,
            self.query.device,
        )
        if self.block_mask is None:
            return dense
        keep = self.block_mask.to_dense().to(self.query.device)  # (B|1, H|1, t, s)
        if dense is None:
            return keep
        if dense.dtype == torch.bool:
            return dense & keep
        return dense.masked_fill(~keep, float("-inf"))

    @property
    def q_len(self) -> int:
        return self.query.shape[-2]

    @property
    def k_len(self) -> int:
        return self.key.shape[-2]

    @property
    def gqa_groups(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        if self.query.dim() < 3:
            return 1
        return self.query.shape[-3] // self.key.shape[-3]


BackendResult = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


@dataclass(frozen=True)
class Backend:
    """A registered backend: its name, its function, its capability checks, and when
    ``"auto"`` should try it before the others (``auto_first``)."""

    name: str
    fn: Callable[[AttentionCall], tuple]
    supports: Callable[[AttentionCall], str | None]
    auto_supports: Callable[[AttentionCall], str | None]
    auto_first: Callable[[AttentionCall], bool]


_REGISTRY: dict[str, Backend] = {}
_generation = 0  # bumped by every registration (fast_lane keys hold it)


def generation() -> int:
    """How many times a backend has been registered: a key that holds it (the ``auto``
    fast lane's, :mod:`attnkit.backends.fast_lane`) is new after any registration."""
    return _generation


#: The order in which ``backend="auto"`` tries the registered backends: torch's fused
#: kernel first, then the blockwise kernel (score mods, weights without grad), then
#: the explicit math (dropout, gradients through weights or float masks).
AUTO_ORDER: list[str] = ["sdpa", "blockwise", "reference"]

#: On CUDA, ``"auto"`` tries the Triton kernels (where registered) right after sdpa, and
#: before it for the calls sdpa would run on a dense mask or cannot run: score mods,
#: windows, mask mods, block masks and sinks.
CUDA_KERNEL = "triton"


def is_sparse(call: AttentionCall) -> bool:
    """Whether a window, a ``mask_mod`` or a block mask may leave tiles of ``call`` empty."""
    return call.window is not None or call.mask_mod is not None or call.block_mask is not None


def auto_order(call: AttentionCall) -> list[str]:
    """The backends ``"auto"`` tries for ``call``, fastest first: :data:`AUTO_ORDER`, with
    the backends whose ``auto_first(call)`` holds moved to the front (blockwise for
    sparse masks and the CPU calls its native kernel runs); on CUDA, see :data:`CUDA_KERNEL`."""
    if call.query.is_cuda and CUDA_KERNEL in _REGISTRY:
        rest = [n for n in AUTO_ORDER if n != CUDA_KERNEL]
        if is_sparse(call) or call.score_mod is not None or call.sinks is not None:
            return [CUDA_KERNEL, *rest]
        return [*rest[:1], CUDA_KERNEL, *rest[1:]]
    first = [n for n in AUTO_ORDER if n in _REGISTRY and _REGISTRY[n].auto_first(call)]
    return [*first, *(n for n in AUTO_ORDER if n not in first)]


def _never(call: AttentionCall) -> bool:
    return False


def _always(call: AttentionCall) -> str | None:
    return None


def register_backend(
    name: str,
    fn: Callable[[AttentionCall], tuple],
    *,
    supports: Callable[[AttentionCall], str | None] = _always,
    auto_supports: Callable[[AttentionCall], str | None] | None = None,
    auto_first: Callable[[AttentionCall], bool] = _never,
) -> None:
    """Register ``fn`` under ``name`` (replacing any backend of that name).

    Args:
        name: the name users pass as ``backend=``.
        fn: the implementation, ``fn(call) -> (context, weights or None)``.
        supports: returns why ``fn`` cannot honour a call, or None when it can.
        auto_supports: the stricter check ``backend="auto"`` uses (default: ``supports``).
        auto_first: whether ``"auto"`` should try this backend before the others for a
            call (it is faster there); it still needs ``auto_supports``.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto', got {name!r}")
    hooks = {
        "fn": fn,
        "supports": supports,
        "auto_supports": auto_supports,
        "auto_first": auto_first,
    }
    for arg, value in hooks.items():
        if value is not None and not callable(value):
            raise TypeError(f"register_backend's {arg} must be callable, got {value!r}")
    global _generation
    _REGISTRY[name] = Backend(name, fn, supports, auto_supports or supports, auto_first)
    _generation += 1


def available_backends() -> list[str]:
    """Return the names of the registered backends."""
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    """Return the backend called ``name``.

    Raises:
        ValueError: naming the valid backends, when ``name`` is unknown.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        valid = ", ".join(["auto", *available_backends()])
        raise ValueError(f"unknown attention backend {name!r}; valid: {valid}") from None


def select(name: str, call: AttentionCall) -> Backend:
    """Return the backend that will run ``call`` for the requested ``name``.

    Raises:
        ValueError: when the named backend cannot run ``call`` (with its reason), or when
            ``"auto"`` finds none that can (naming every backend it tried and its reason).
    """
    if name == "auto":
        reasons = []
        for candidate in auto_order(call):
            backend = _REGISTRY.get(candidate)
            if backend is None:
                reasons.append(f"{candidate}: not registered")
                continue
            reason = backend.auto_supports(call)
            if reason is None:
                return backend
            reasons.append(f"{candidate}: {reason}")
        tried = "; ".join(reasons) if reasons else "none"
        raise ValueError(f"backend='auto' found no attention backend for this call; tried {tried}")
    backend = get_backend(name)
    reason = backend.supports(call)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run this call: {reason}")
    return backend


def dispatch(name: str, call: AttentionCall) -> BackendResult:
    """Run ``call`` on the backend chosen for ``name``: ``(context, weights, lse)``."""
    return run(select(name, call), call)


def run(backend: Backend, call: AttentionCall) -> BackendResult:
    """Run ``call`` on ``backend`` (what :func:`select` chose): ``(context, weights, lse)``."""
    result = backend.fn(call)
    if len(result) == 2:
        result = (*result, None)
    if call.return_lse and result[2] is None:  # a backend accepted what it cannot do
        raise RuntimeError(f"attention backend {backend.name!r} returned no log-sum-exp")
    return result  # type: ignore[return-value]
