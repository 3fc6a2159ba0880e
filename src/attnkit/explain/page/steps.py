"""The tutorial page's steps: which of an :class:`~attnkit.explain.Explanation`'s tensors each
step shows, in the book's order, and how a cell of each table explains itself.

Nothing here computes a stage: every matrix is one :func:`~attnkit.explain.explain` recorded.
A table names its matrix and a cell *kind* (``"dot"``, ``"softmax"``, ``"context"``, ...) with
the operand matrices the page's script needs to write the cell's computation out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from attnkit.explain.core import BOOK_SEEDS, Explanation, _lists

__all__ = ["STEP_IDS", "Step", "Table", "build_steps", "format_number", "matrices", "stage_seed"]

#: The steps, in the book's order, and the stage each needs.
STEP_IDS: dict[str, str] = {
    "scores": "simplified",
    "normalize": "simplified",
    "context": "simplified",
    "qkv": "trainable",
    "scaled": "trainable",
    "causal": "causal",
    "renormalize": "causal",
    "dropout": "dropout",
    "wrapper": "multihead",
    "multihead": "multihead",
}


@dataclass
class Table:
    """One matrix on a step.

    Attributes:
        id: unique in the page (``"scaled-weights"``).
        caption: key of the caption in the language file.
        matrix: name of the matrix in :func:`matrices`.
        kind: how a cell explains itself (read by the page's script).
        rows: row labels (tokens, or dimensions for a weight matrix).
        cols: column labels.
        args: operand matrices and numbers the explanation needs.
        query_only: show only the current query's row.
        style: ``"input"`` (numbers as given, 2 decimals at least) or ``"value"`` (4 decimals).
        head: the head number a caption names, if any.
    """

    id: str
    caption: str
    matrix: str
    kind: str
    rows: list[str]
    cols: list[str]
    args: dict[str, Any] = field(default_factory=dict)
    query_only: bool = False
    style: str = "value"
    head: int | None = None


@dataclass
class Step:
    """One screen of the page: a narration (by ``id`` in the language file) and its tables."""

    id: str
    stage: str
    tables: list[Table]


def format_number(v: float | None, style: str = "value") -> str:
    """A cell as the book prints it: 4 decimals (``"input"``: as given, at least 2 decimals);
    ``None`` (a score masked to -inf) is ``"−∞"``; no ``-0.0000``."""
    if v is None or (isinstance(v, float) and math.isinf(v) and v < 0):
        return "\u2212\u221e"
    if style == "input":
        s = f"{v:.4f}".rstrip("0")
        s = s + "0" * max(0, 2 - len(s.split(".")[1]))
    else:
        s = f"{v:.4f}"
    if float(s) == 0.0:
        s = s.lstrip("-")
    return s.replace("-", "\u2212")


def matrices(expl: Explanation) -> dict[str, Any]:
    """Every matrix the page shows or explains with: ``"x"`` and ``"<stage>.<name>"``
    (per head: ``"multihead.<name>.<h>"``, ``"multihead.wrapper_<name>.<h>"``)."""
    out: dict[str, Any] = {"x": _lists(expl.embeddings)}
    for stage, values in expl.stages.items():
        for name, t in values.items():
            if name in ("inputs", "output") and stage != "multihead":
                continue
            if stage == "multihead" and t.dim() == 3:  # (h, t, ...): one matrix per head
                for h in range(t.shape[0]):
                    out[f"{stage}.{name}.{h}"] = _lists(t[h])
            elif t.dim() == 0:
                out[f"{stage}.{name}"] = float(t)
            else:
                out[f"{stage}.{name}"] = _lists(t)
    return out


def _dims(n: int) -> list[str]:
    return [str(i + 1) for i in range(n)]


def _t(
    id: str,
    caption: str,
    matrix: str,
    kind: str,
    rows: list[str],
    cols: list[str],
    *,
    query_only: bool = False,
    style: str = "value",
    head: int | None = None,
    **args: Any,
) -> Table:
    return Table(id, caption, matrix, kind, rows, cols, args, query_only, style, head)


def build_steps(expl: Explanation) -> list[Step]:
    """The steps for the stages ``expl`` has, in the book's order."""
    tok = list(expl.tokens)
    d_in = expl.embeddings.shape[1]
    dims_in = _dims(d_in)
    st = expl.stages
    steps: list[Step] = []
    if "simplified" in st:
        s = "simplified"
        x = _t("scores-x", "inputs", "x", "x", tok, dims_in, style="input")
        omega = _t(
            "scores-omega",
            "omega_row",
            f"{s}.scores",
            "dot",
            tok,
            tok,
            query_only=True,
            a="x",
            b="x",
        )
        steps.append(Step("scores", s, [x, omega]))
        norm = []
        if "naive_weights" in st[s]:  # absent where a row of scores sums to 0
            norm.append(
                _t(
                    "normalize-naive",
                    "naive_row",
                    f"{s}.naive_weights",
                    "naive",
                    tok,
                    tok,
                    query_only=True,
                    s=f"{s}.scores",
                )
            )
        norm.append(
            _t(
                "normalize-softmax",
                "softmax_row",
                f"{s}.weights",
                "softmax",
                tok,
                tok,
                query_only=True,
                s=f"{s}.scores",
                v="x",
            )
        )
        steps.append(Step("normalize", s, norm))
        weights = _t(
            "context-weights",
            "weights",
            f"{s}.weights",
            "softmax",
            tok,
            tok,
            s=f"{s}.scores",
            v="x",
        )
        z = _t(
            "context-z",
            "context_x",
            f"{s}.context",
            "context",
            tok,
            dims_in,
            w=f"{s}.weights",
            v="x",
        )
        steps.append(Step("context", s, [weights, z]))
    if "trainable" in st:
        s = "trainable"
        d_out = st[s]["queries"].shape[-1]
        seed = stage_seed(expl, s)
        proj = [
            _t(f"qkv-{w}", w, f"{s}.{w}", "param", dims_in, _dims(d_out), seed=seed, name=w)
            for w in ("W_query", "W_key", "W_value")
        ]
        proj += [
            _t(
                f"qkv-{n}",
                n,
                f"{s}.{n}",
                "proj",
                tok,
                _dims(d_out),
                x="x",
                W=f"{s}.{w}",
                name=n[0],
                wname=w,
            )
            for n, w in (("queries", "W_query"), ("keys", "W_key"), ("values", "W_value"))
        ]
        steps.append(Step("qkv", s, proj))
        steps.append(Step("scaled", s, _attention_tables("scaled", s, tok, d_out)))
    if "causal" in st:
        s = "causal"
        d_out = st[s]["queries"].shape[-1]
        steps.append(Step("causal", s, _attention_tables("causal", s, tok, d_out, causal=True)))
        steps.append(
            Step(
                "renormalize",
                s,
                [
                    _t(
                        "renormalize-unmasked",
                        "unmasked",
                        f"{s}.unmasked_weights",
                        "softmax",
                        tok,
                        tok,
                        s=f"{s}.scaled_scores",
                        scaled=True,
                    ),
                    _t(
                        "renormalize-zeroed",
                        "zeroed",
                        f"{s}.zeroed_weights",
                        "zero",
                        tok,
                        tok,
                        w=f"{s}.unmasked_weights",
                        causal=True,
                    ),
                    _t(
                        "renormalize-renorm",
                        "renormalized",
                        f"{s}.renormalized_weights",
                        "renorm",
                        tok,
                        tok,
                        w=f"{s}.zeroed_weights",
                        causal=True,
                    ),
                ],
            )
        )
    if "dropout" in st:
        s = "dropout"
        d_out = st[s]["values"].shape[-1]
        p = float(expl.options.get("dropout", 0.0))
        steps.append(
            Step(
                "dropout",
                s,
                [
                    _t(
                        "dropout-before",
                        "before_dropout",
                        f"{s}.softmax_weights",
                        "softmax",
                        tok,
                        tok,
                        s=f"{s}.masked_scores",
                        scaled=True,
                        causal=True,
                    ),
                    _t(
                        "dropout-after",
                        "after_dropout",
                        f"{s}.weights",
                        "drop",
                        tok,
                        tok,
                        w=f"{s}.softmax_weights",
                        p=p,
                        causal=True,
                    ),
                    _t(
                        "dropout-z",
                        "context_v",
                        f"{s}.context",
                        "context",
                        tok,
                        _dims(d_out),
                        w=f"{s}.weights",
                        v=f"{s}.values",
                        before=f"{s}.softmax_weights",
                        causal=True,
                    ),
                ],
            )
        )
    if "multihead" in st:
        steps += _multihead_steps(expl, tok)
    return steps


def stage_seed(expl: Explanation, stage: str) -> int:
    """The seed a stage's modules were built with (the book's unless ``seed`` was given)."""
    seed = expl.options.get("seed")
    return BOOK_SEEDS[stage] if seed is None else int(seed)


def _attention_tables(
    step: str,
    s: str,
    tok: list[str],
    d: int,
    *,
    causal: bool = False,
    head: int | None = None,
    prefix: str = "",
) -> list[Table]:
    """Scaled (and masked) scores, weights and context vectors of one head (key width ``d``)."""
    suffix = "" if head is None else f".{head}"
    q, k, v = (f"{s}.{prefix}{n}{suffix}" for n in ("queries", "keys", "values"))
    tid = step if head is None else f"{step}-h{head}"
    kind = "masked_scores" if causal else "scaled_scores"
    scores = f"{s}.{prefix}{kind}{suffix}"
    weights = f"{s}.{prefix}weights{suffix}"
    return [
        _t(
            f"{tid}-scores",
            kind,
            scores,
            "masked" if causal else "scaled",
            tok,
            tok,
            head=head,
            a=q,
            b=k,
            dk=d,
            causal=causal,
        ),
        _t(
            f"{tid}-weights",
            "weights",
            weights,
            "softmax",
            tok,
            tok,
            head=head,
            s=scores,
            v=v,
            scaled=True,
            causal=causal,
        ),
        _t(
            f"{tid}-z",
            "context_v",
            f"{s}.{prefix}context{suffix}",
            "context",
            tok,
            _dims(d),
            head=head,
            w=weights,
            v=v,
            causal=causal,
        ),
    ]


def _multihead_steps(expl: Explanation, tok: list[str]) -> list[Step]:
    s = "multihead"
    v = expl.stages[s]
    h, _, head_dim = v["context"].shape
    d_out = h * head_dim
    wrapper_d = v["wrapper_context"].shape[-1]
    wrapper: list[Table] = []
    for i in range(h):
        wrapper += _attention_tables(
            "wrapper", s, tok, wrapper_d, causal=True, head=i, prefix="wrapper_"
        )[1:]
    wrapper.append(
        _t(
            "wrapper-out",
            "wrapper_output",
            f"{s}.wrapper_output",
            "concat",
            tok,
            _dims(h * wrapper_d),
            ctx=f"{s}.wrapper_context",
            head_dim=wrapper_d,
        )
    )
    fused: list[Table] = []
    for i in range(h):
        fused += _attention_tables("multihead", s, tok, head_dim, causal=True, head=i)[1:]
    dims = _dims(d_out)
    fused += [
        _t(
            "multihead-concat",
            "concat",
            f"{s}.concat",
            "concat",
            tok,
            dims,
            ctx=f"{s}.context",
            head_dim=head_dim,
        ),
        _t(
            "multihead-W_out",
            "out_proj_weight",
            f"{s}.out_proj_weight",
            "param",
            dims,
            dims,
            seed=stage_seed(expl, s),
            name="W_out",
        ),
        _t(
            "multihead-out",
            "output",
            f"{s}.output",
            "out",
            tok,
            dims,
            c=f"{s}.concat",
            W=f"{s}.out_proj_weight",
            b=f"{s}.out_proj_bias",
        ),
    ]
    return [Step("wrapper", s, wrapper), Step("multihead", s, fused)]
