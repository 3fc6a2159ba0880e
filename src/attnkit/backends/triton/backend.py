"""The ``triton`` backend: what it honours, what it refuses (and why), and the call itself.

Honoured: causal (both alignments), ``window``, a dense bool/float ``mask``, a
``mask_mod`` or block mask (block-sparse: only non-empty tiles are visited; a
``mask_mod`` that traces is generated into the kernels for the partial tiles), the
``alibi``/``softcap`` score mods of :mod:`attnkit.masks` (hand-written; ALiBi slopes
receive gradients) and any other ``score_mod`` that traces (:mod:`attnkit.mod_graph`),
generated into the forward and both backward kernels (:mod:`.codegen`; captured tensors
that require grad receive gradients), sinks, the log-sum-exp, GQA/MQA in place, ``l_q != l_k``, head dims up to
256, float16/bfloat16/float32, forward and backward.

Refused, with the reason, so ``auto`` falls through: dropout, ``need_weights``, float64,
a float mask that needs a gradient, a ``score_mod`` that does not trace (the tracer's
reason) or whose integers/indices may overflow for the call's sizes, CPU tensors unless
Triton's interpreter is on (``TRITON_INTERPRET=1``), block sizes that are not powers
of two of at least 16.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from attnkit.backends.registry import AttentionCall, BackendResult
from attnkit.backends.triton import plan as P
from attnkit.block_mask import BlockMask
from attnkit.block_mask_cache import cached_block_mask
from attnkit.mod_graph import ModGraph, Unsupported, traced

#: (BLOCK_M, BLOCK_N) of the forward and backward kernels by head dim on a GPU (first
#: guesses, not tuned: on an H100 the bf16 forward ran at 0.53-0.86 of SDPA's flash kernel,
#: docs/benchmarks/gpu).
GPU_BLOCKS = {64: ((128, 64), (64, 64)), 128: ((128, 64), (64, 64)), 256: ((64, 32), (32, 32))}
#: Tiles under the interpreter: small, so short test sequences cross many tile edges.
INTERPRET_BLOCKS = ((32, 16), (16, 32))
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when the kernels run on Triton's interpreter (CPU tensors allowed).

    Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so once the kernels
    are imported their kind decides, not the variable.
    """
    fwd = sys.modules.get("attnkit.backends.triton._fwd")
    if fwd is not None:
        return _interpreted(fwd.attn_fwd) and _stdlib_interpreted()
    env = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return env and _stdlib_interpreted()


def _interpreted(fn: object) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def _stdlib_interpreted() -> bool:
    """Whether triton's own library (``tl.zeros``, ...) was defined for the interpreter:
    only when ``TRITON_INTERPRET`` was set before triton was first imported."""
    if "triton" not in sys.modules:
        return True  # it will be, when imported now
    import triton.language as tl

    return _interpreted(tl.zeros)


def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is in the dev extra
        return f"triton is not importable ({exc}); install attnkit[gpu]"
    return None


def supports(call: AttentionCall) -> str | None:
    """Why the triton backend cannot run ``call`` (None when it can)."""
    missing = _triton_missing()
    if missing is not None:
        return missing
    q = call.query
    if q.dtype not in DTYPES:
        return f"the triton kernels take float16, bfloat16 or float32, got {q.dtype}"
    if q.device.type == "cpu" and not interpreting():
        return (
            "triton runs on CUDA tensors (CPU tensors only under Triton's interpreter: "
            "TRITON_INTERPRET=1 set before triton is first imported)"
        )
    if q.device.type not in ("cpu", "cuda"):
        return f"triton runs on CUDA tensors, got {q.device.type}"
    if call.dropout_p > 0.0:
        return "the triton kernels do not implement dropout (use backend='sdpa' or 'reference')"
    if call.need_weights:
        return "the triton kernels keep no attention weights (use backend='reference')"
    if q.shape[-1] > MAX_HEAD_DIM or call.value.shape[-1] > MAX_HEAD_DIM:
        return f"the triton kernels take head dims up to {MAX_HEAD_DIM}"
    if call.mask is not None and call.mask.is_floating_point() and call.mask.requires_grad:
        return "the triton kernels give no gradient to a float mask (use backend='reference')"
    why = _score_graph(call)
    if isinstance(why, str):
        return why
    bm = call.block_mask
    if bm is not None and call.mask_mod is not None:
        return (
            "the triton kernels take a mask_mod or a block_mask, not both "
            "(build one block mask from attnkit.masks.and_masks of the two)"
        )
    if bm is not None:
        for name in ("Q_BLOCK_SIZE", "KV_BLOCK_SIZE"):
            size = getattr(bm, name)
            if size < 16 or size & (size - 1):
                return f"the triton kernels need block sizes that are powers of two >= 16, got {name}={size}"
        return _plan_mismatch(bm)
    return None


#: Set to "1" to let ``backend="auto"`` run generated mods in the Triton kernels on a GPU.
GENERATED_ON_GPU = "ATTNKIT_TRITON_GENERATED"


def auto_supports(call: AttentionCall) -> str | None:
    """``supports`` for ``backend="auto"``: on a real GPU, the kernels' generated mods are
    taken only when asked for.

    Mods compiled into the Triton kernels (any traced ``score_mod``, a traced ``mask_mod``
    inside partial tiles) are proven under Triton's interpreter and compiled for sm_90 in
    CI; on a GPU they ran once (one H100: the codegen tests passed, the catalogue of every
    op did not finish in the time lent). Until the whole catalogue has passed on one,
    ``auto`` keeps such calls on the other paths, and ``backend="triton"`` (or
    ``ATTNKIT_TRITON_GENERATED=1``) runs them.
    """
    why = supports(call)
    if why is not None or interpreting() or os.environ.get(GENERATED_ON_GPU) == "1":
        return why
    generated = isinstance(_score_graph(call), ModGraph) or _mask_graph(call) is not None
    if generated:
        return (
            "auto runs mods generated into the triton kernels on a GPU only when asked "
            f"(backend='triton' or {GENERATED_ON_GPU}=1): their whole catalogue has not yet "
            "passed on a GPU"
        )
    return None


def _batch_heads(call: AttentionCall) -> tuple[int, int]:
    """``(B, h_q)``: the kernels' batch (the leading dims flattened) and query heads."""
    shape = call.query.shape
    return (math.prod(shape[:-3]) if len(shape) > 3 else 1), (shape[-3] if len(shape) > 2 else 1)


def _score_graph(call: AttentionCall) -> ModGraph | str | None:
    """The traced score mod the kernels generate code for (None: none, or a hand-written
    one), or why the mod cannot run in the kernels."""
    if P.score_mod_spec(call.score_mod) is not None:
        return None
    graph = traced(call.score_mod, "score")  # type: ignore[arg-type]
    name = getattr(call.score_mod, "__name__", None) or repr(call.score_mod)
    if isinstance(graph, Unsupported):
        return f"the triton kernels compile a score_mod that traces; {name}: {graph.reason}"
    bsz, heads = _batch_heads(call)
    why = graph.check(bsz, heads, call.q_len, call.k_len)
    if why is not None:
        return f"the triton kernels cannot run score_mod {name} for these sizes: {why}"
    return graph


def _mask_graph(call: AttentionCall) -> ModGraph | None:
    """The traced mask mod generated into the kernels' partial tiles (None: the tiles'
    stored bits are read instead, as for a mask_mod that does not trace)."""
    if call.mask_mod is None:
        return None
    graph = traced(call.mask_mod, "mask")
    if isinstance(graph, Unsupported):
        return None
    bsz, heads = _batch_heads(call)
    return graph if graph.check(bsz, heads, call.q_len, call.k_len) is None else None


def _plan_mismatch(bm: BlockMask) -> str | None:
    """Why the kernels cannot trust ``bm``'s tables (their reads follow them unchecked)."""
    tiles = (-(-bm.Q_LEN // bm.Q_BLOCK_SIZE), -(-bm.KV_LEN // bm.KV_BLOCK_SIZE))
    if tuple(bm.block_kind.shape[-2:]) != tiles or bm.partial_index.shape != bm.block_kind.shape:
        return (
            f"block_mask's block_kind {tuple(bm.block_kind.shape)} does not cover its "
            f"{bm.Q_LEN} x {bm.KV_LEN} scores in {bm.Q_BLOCK_SIZE} x {bm.KV_BLOCK_SIZE} tiles"
        )
    if tuple(bm.partial_masks.shape[1:]) != (bm.Q_BLOCK_SIZE, bm.KV_BLOCK_SIZE):
        return f"block_mask's partial tiles have shape {tuple(bm.partial_masks.shape[1:])}"
    return None


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """``(..., h, l, d)`` as ``(B, h, l, d)`` (a view where the strides allow)."""
    if t.dim() == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if t.dim() == 3:
        return t.unsqueeze(0)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def _mask_4d(call: AttentionCall, q4: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    mask = call.mask
    if mask is None:
        return None, 0
    target = (*call.query.shape[:-1], call.k_len)
    mask = _as_4d(mask.expand(target))  # broadcast dims keep stride 0
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), 1
    return mask, 2


def _blocks(d: int, interpret: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    if interpret:
        return INTERPRET_BLOCKS
    for limit, blocks in GPU_BLOCKS.items():
        if d <= limit:
            return blocks
    return GPU_BLOCKS[256]


def build_plan(call: AttentionCall, q4: torch.Tensor) -> P.KernelPlan:
    """Everything the kernels are specialised on, worked out once for ``call``."""
    interpret = interpreting() or q4.device.type == "cpu"
    fwd_blocks, bwd_blocks = _blocks(max(q4.shape[-1], call.value.shape[-1]), interpret)
    mask, mask_kind = _mask_4d(call, q4)
    score_graph = _score_graph(call)
    if isinstance(score_graph, str):
        raise ValueError(score_graph)  # supports() said so first
    mask_graph = _mask_graph(call)
    compiled = None
    if score_graph is not None or mask_graph is not None:
        from attnkit.backends.triton.compiled import compile_mods

        compiled = compile_mods(score_graph, mask_graph)
    mod, cap = (3, 0.0) if score_graph is not None else P.score_mod_spec(call.score_mod)[:2]  # type: ignore[index]
    align = call.causal or "bottom_right"
    sparse = None
    bm = call.block_mask
    if bm is None and call.mask_mod is not None:  # the plan, built once (and cached)
        size = max(*fwd_blocks, *bwd_blocks)
        bm = cached_block_mask(
            call.mask_mod, q4.shape[0], q4.shape[1], call.q_len, call.k_len, block_size=size,
            device=q4.device,
        )  # fmt: skip
    if bm is not None:
        sparse = P.sparse_tables(bm, q4.device)
    return P.KernelPlan(
        causal=call.causal is not None,
        shift=call.k_len - call.q_len if align == "bottom_right" else 0,
        window=call.window or 0,
        mask=mask,
        mask_kind=mask_kind,
        mod=mod,
        cap=cap,
        scale=call.scale,
        sparse=sparse,
        fwd_blocks=fwd_blocks,
        bwd_blocks=bwd_blocks,
        num_warps=4 if q4.shape[-1] <= 64 else 8,
        num_stages=2,
        interpret=interpret,
        compiled=compiled,
    )


def run(call: AttentionCall, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (..., h, t, d_v), lse (..., h, t) float32)`` of ``call`` on the Triton kernels."""
    from attnkit.backends.triton.autograd import TritonAttention

    q4, k4, v4 = _as_4d(call.query), _as_4d(call.key), _as_4d(call.value)
    plan = build_plan(call, q4)
    spec = P.score_mod_spec(call.score_mod)
    slopes = spec[2] if spec is not None else None
    captured = plan.compiled.score.tensors if plan.compiled and plan.compiled.score else ()
    out, lse = TritonAttention.apply(plan, q4, k4, v4, sinks, slopes, *captured)
    out = out.reshape(*call.query.shape[:-1], call.value.shape[-1])  # (..., h, t, d_v)
    return out, lse.reshape(call.query.shape[:-1])


def triton_attention(call: AttentionCall) -> BackendResult:
    """Run ``call`` on the Triton kernels (see the module docs)."""
    out, lse = run(call, call.sinks)
    return out, None, (lse if call.return_lse else None)
