"""The seed tutorial as a program: every stage's numbers for any sentence.

:func:`explain` runs attnkit's own seed-stage modules under :func:`attnkit.trace.record`
and keeps what they computed, so the numbers shown are the library's numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attnkit import trace
from attnkit._validate import check_int, check_probability
from attnkit.modules import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV2,
    SimplifiedSelfAttention,
)

__all__ = ["JSON_KEYS", "STAGES", "Explanation", "explain"]

#: The stages, in the tutorial's order.
STAGES = ("simplified", "trainable", "causal", "dropout", "multihead")

#: The keys each stage has in :meth:`Explanation.to_dict` (the JSON contract).
JSON_KEYS: dict[str, tuple[str, ...]] = {
    "simplified": ("scores", "weights", "context"),
    "trainable": ("queries", "keys", "values", "scores", "scaled_scores", "weights", "context"),
    "causal": ("scores", "masked_scores", "weights", "context"),
    "dropout": ("weights", "context"),
    "multihead": ("heads", "output"),
}

#: The book's seeds: 789 for the trainable stage, 123 for the later ones.
BOOK_SEEDS = {"trainable": 789, "causal": 123, "dropout": 123, "multihead": 123}


@dataclass
class Explanation:
    """Everything :func:`explain` computed.

    Attributes:
        tokens: the sentence's tokens.
        embeddings: ``(t, d_in)`` input embeddings.
        stages: ``stage -> name -> tensor``, unbatched. Per stage: ``scale`` (float
            tensor), ``queries``/``keys``/``values`` ``(t, d)``, ``scores`` (raw
            dot products), ``scaled_scores``, ``masked_scores`` (-inf = masked),
            ``weights`` (after dropout in the dropout stage), ``context``. The
            multihead stage has ``weights (h, t, t)``, ``context (h, t, head_dim)``
            and ``output (t, d_out)``.

            The tutorial page (:mod:`attnkit.explain.page`) also reads what the book shows
            beside each stage: ``naive_weights``/``naive_context`` (simplified, normalised
            by the row sum; absent where a row of scores sums to 0), the projection
            matrices ``W_query``/``W_key``/``W_value`` as ``(d_in, d_out)`` (``x @
            W_query``), the causal mask applied after the softmax (``unmasked_weights``,
            ``zeroed_weights``, ``renormalized_weights``), ``out_proj_weight (d_out,
            d_out)``/``out_proj_bias`` and the wrapper's heads (``wrapper_queries``,
            ``wrapper_keys``, ``wrapper_values``, ``wrapper_masked_scores``, ``wrapper_weights``, ``wrapper_context``
            ``(h, t, ...)`` and ``wrapper_output (t, h * d_out)``).
        options: the settings used (d_out, heads, dropout, seed).
    """

    tokens: list[str]
    embeddings: torch.Tensor
    stages: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract: matrices as nested lists; masked scores as ``null``."""
        stages: dict[str, Any] = {}
        for name, values in self.stages.items():
            if name == "multihead":
                heads = [
                    {
                        "weights": _lists(values["weights"][i]),
                        "context": _lists(values["context"][i]),
                    }
                    for i in range(values["weights"].shape[0])
                ]
                stages[name] = {"heads": heads, "output": _lists(values["output"])}
            else:
                stages[name] = {key: _lists(values[key]) for key in JSON_KEYS[name]}
        out = {
            "tokens": list(self.tokens),
            "embeddings": _lists(self.embeddings),
            "stages": stages,
        }
        if "embeddings" in self.options:  # where the vectors came from ("random (seed 0, ...)")
            out["embeddings_source"] = str(self.options["embeddings"])
        return out

    def _repr_html_(self) -> str:
        """In a notebook: the tutorial page of these numbers (see :mod:`attnkit.explain.page`)."""
        from attnkit.explain.page import TutorialPage

        return TutorialPage(self)._repr_html_()

    def attention_maps(self) -> dict[str, torch.Tensor]:
        """``stage -> weights (heads, t, t)`` for the pictures (one head but in multihead)."""
        maps = {}
        for name, values in self.stages.items():
            w = values["weights"]
            maps[name] = w if w.dim() == 3 else w.unsqueeze(0)  # (h, t, t)
        return maps


def _lists(t: torch.Tensor) -> Any:
    """Nested lists of the float32 values, each written as its shortest round-tripping decimal
    (0.76, not 0.7599999904632568); -inf (a masked score) becomes None."""

    def clean(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return [clean(x) for x in v]
        return None if not np.isfinite(v) else float(str(v))

    return clean(t.detach().to(torch.float32).cpu().numpy())


def explain(
    tokens: Sequence[str],
    embeddings: torch.Tensor,
    *,
    stages: Sequence[str] = STAGES,
    d_out: int = 2,
    heads: int = 2,
    dropout: float = 0.5,
    seed: int | None = None,
) -> Explanation:
    """Compute every selected seed stage on ``embeddings`` with attnkit's modules.

    Stages: ``simplified`` (:class:`~attnkit.SimplifiedSelfAttention`), ``trainable``
    (:class:`~attnkit.SelfAttentionV2`), ``causal`` (:class:`~attnkit.CausalAttention`),
    ``dropout`` (the same with ``dropout`` in training mode) and ``multihead``
    (:class:`~attnkit.MultiHeadAttention` with ``heads`` heads).

    Args:
        tokens: one label per row of ``embeddings``.
        embeddings: ``(t, d_in)`` float tensor.
        stages: which stages to compute (any order; kept in the tutorial's order).
        d_out: output size of the trainable stages (the multihead model size).
        heads: number of heads of the multihead stage; must divide ``d_out``.
        dropout: weight-dropout probability of the dropout stage, in ``[0, 1)``.
        seed: ``torch.manual_seed`` before building each module; ``None`` uses the
            book's (789 for trainable, 123 after), reproducing its numbers.

    Returns:
        An :class:`Explanation`.

    Raises:
        ValueError: unknown stage, tokens/embeddings mismatch, bad sizes or dropout.
        TypeError: ``embeddings`` is not a float tensor.
    """
    selected = _check(tokens, embeddings, stages, d_out, heads, dropout)
    x = embeddings.detach().to(torch.float32)  # (t, d_in)
    t, d_in = x.shape
    result = Explanation(
        list(tokens),
        x,
        options={"d_out": d_out, "heads": heads, "dropout": dropout, "seed": seed},
    )

    def seeded(stage: str) -> None:
        torch.manual_seed(BOOK_SEEDS[stage] if seed is None else seed)

    with torch.no_grad():
        for stage in selected:
            if stage == "simplified":
                rec = _record(SimplifiedSelfAttention(), x)
                rec["scale"] = torch.tensor(1.0)
                try:  # the naive normalisation the book shows first
                    naive = _record(SimplifiedSelfAttention("sum"), x)
                    rec["naive_weights"], rec["naive_context"] = naive["weights"], naive["context"]
                except ValueError:  # a row of scores sums to 0: no naive weights to show
                    pass
            elif stage == "trainable":
                seeded(stage)
                sa_v2 = SelfAttentionV2(d_in, d_out)
                rec = _record(sa_v2, x)
                rec["scale"] = torch.tensor(1.0 / math.sqrt(d_out))
                rec.update(_projections(sa_v2))
            elif stage in ("causal", "dropout"):
                seeded(stage)
                p = dropout if stage == "dropout" else 0.0
                module: torch.nn.Module = CausalAttention(d_in, d_out, context_length=t, dropout=p)
                module.train(stage == "dropout")  # dropout acts in training mode only
                seeded(stage)  # the dropout mask's seed, as the book seeds it before dropping
                rec = _record(module, x)
                rec["scale"] = torch.tensor(1.0 / math.sqrt(d_out))
                rec.update(_projections(module))
                if stage == "dropout":
                    rec["softmax_weights"] = rec["weights"]
                    rec["weights"] = rec.get("dropped_weights", rec["weights"])
                else:  # the book's other way: softmax first, then zero the future and renormalise
                    after = CausalAttention(
                        d_in, d_out, context_length=t, dropout=0.0, masking="after_softmax"
                    )
                    after.load_state_dict(module.state_dict())
                    rec_after = _record(after.eval(), x)
                    rec["unmasked_weights"] = rec_after["weights"]
                    rec["zeroed_weights"] = rec_after["zeroed_weights"]
                    rec["renormalized_weights"] = rec_after["renormalized_weights"]
            else:
                seeded(stage)
                wrapper = MultiHeadAttentionWrapper(d_in, d_out, t, 0.0, num_heads=heads).eval()
                wrapped = _record(wrapper, x)
                seeded(stage)
                mha = MultiHeadAttention(d_in, d_out, t, 0.0, num_heads=heads).eval()
                rec = _record(mha, x)
                rec["scale"] = torch.tensor(1.0 / math.sqrt(d_out // heads))
                rec.update(_projections(mha))
                rec["out_proj_weight"] = mha.out_proj.weight.detach().clone()  # (d_out, d_out)
                rec["out_proj_bias"] = mha.out_proj.bias.detach().clone()  # (d_out,)
                for name in ("queries", "keys", "values", "masked_scores", "weights", "context"):
                    rec[f"wrapper_{name}"] = torch.stack(  # (h, t, ...)
                        [wrapped[f"heads.{i}.{name}"] for i in range(heads)]
                    )
                rec["wrapper_output"] = wrapped["concat"]  # (t, h * d_out)
            result.stages[stage] = rec
    return result


def _projections(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``W_query``/``W_key``/``W_value`` as the book writes them, ``(d_in, d_out)``."""
    return {
        name: getattr(module, name).weight.detach().T.clone()  # (d_in, d_out)
        for name in ("W_query", "W_key", "W_value")
    }


def _record(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run ``module`` on unbatched ``x`` and return its recorded intermediates, batch dim dropped."""
    with trace.record() as rec:
        out = module(x)
    values = {name: t.squeeze(0) for name, t in rec.items()}  # drop the (1, ...) batch dim
    values.setdefault("output", out)
    return values


def _check(
    tokens: Sequence[str],
    embeddings: torch.Tensor,
    stages: Sequence[str],
    d_out: int,
    heads: int,
    dropout: float,
) -> list[str]:
    if isinstance(stages, str):
        stages = [stages]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; choose from {list(STAGES)}")
    if not isinstance(embeddings, torch.Tensor) or not embeddings.is_floating_point():
        raise TypeError(f"embeddings must be a float tensor, got {type(embeddings).__name__}")
    if embeddings.dim() != 2 or embeddings.shape[0] == 0 or embeddings.shape[1] == 0:
        raise ValueError(f"embeddings must be (tokens, d_in), got shape {tuple(embeddings.shape)}")
    if len(tokens) != embeddings.shape[0]:
        raise ValueError(f"{len(tokens)} tokens but {embeddings.shape[0]} embedding vectors")
    if not torch.isfinite(embeddings).all():
        raise ValueError("embeddings contain inf or NaN")
    check_int(d_out, "d_out")
    check_int(heads, "heads")
    if "multihead" in stages and d_out % heads != 0:
        raise ValueError(f"d_out ({d_out}) must be divisible by heads ({heads})")
    check_probability(dropout, "dropout")
    return [s for s in STAGES if s in stages]
