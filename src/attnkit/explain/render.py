"""Writing an :class:`~attnkit.explain.Explanation` as text, Markdown or JSON.

Both text and Markdown are built from the same list of blocks (headings, one-line
step descriptions, token-labelled tables, walkthrough lines), so they say the
same thing. Text fits ``width`` columns: wide tables are split into column blocks.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnkit.explain.core import Explanation

__all__ = ["FORMATS", "find_token", "render"]

FORMATS = ("text", "markdown", "json", "html")
_CELL = 9  # width of one number column: " -12.3456"
_LABEL = 10  # width of the row-label column


@dataclass
class _Heading:
    text: str


@dataclass
class _Step:
    text: str


@dataclass
class _Table:
    rows: list[str]
    cols: list[str]
    values: list[list[float]]


@dataclass
class _Walk:
    lines: list[str]


_Block = _Heading | _Step | _Table | _Walk


def find_token(tokens: Sequence[str], token: str) -> int:
    """Index of ``token`` in ``tokens`` (exact match first, then case-insensitive).

    A token that occurs more than once is chosen with ``#n`` (1-based): ``"the#2"`` is the
    second "the". Without ``#n`` a repeated token is refused rather than guessed.

    Raises:
        ValueError: the token is not in the sentence (the message lists the tokens), it is
            repeated and no ``#n`` says which, or ``n`` is out of range.
    """
    name, nth = token, None
    match = re.fullmatch(r"(.+)#(\d+)", token)
    if match and token not in tokens:
        name, nth = match.group(1), int(match.group(2))
    hits = [i for i, t in enumerate(tokens) if t == name]
    if not hits:
        hits = [i for i, t in enumerate(tokens) if t.lower() == name.lower()]
    if not hits:
        raise ValueError(f"token {name!r} is not in the sentence {list(tokens)}")
    if nth is None:
        if len(hits) > 1:
            choices = ", ".join(f"{name}#{k}" for k in range(1, len(hits) + 1))
            raise ValueError(f"token {name!r} occurs {len(hits)} times; choose one of {choices}")
        return hits[0]
    if not 1 <= nth <= len(hits):
        raise ValueError(f"token {name!r} occurs {len(hits)} times, so #{nth} does not exist")
    return hits[nth - 1]


def render(
    expl: Explanation,
    *,
    fmt: str = "text",
    query: str | None = None,
    width: int = 80,
    lang: str = "en",
) -> str:
    """Render ``expl`` as ``"text"``, ``"markdown"``, ``"json"`` or ``"html"``.

    Args:
        expl: what :func:`~attnkit.explain.explain` computed.
        fmt: output format; JSON follows the contract of :meth:`Explanation.to_dict`;
            HTML is the step-through page (:func:`~attnkit.explain.tutorial_page`).
        query: a token to follow step by step (dot products, softmax arithmetic,
            weighted sum), as the seeds do for "journey" and "shiny"; the HTML page
            opens on its row.
        width: text width in columns.
        lang: the HTML page's language: ``"en"``, ``"ja"`` or ``"pt"``.

    Raises:
        ValueError: unknown format or language, or ``query`` not in the sentence.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {list(FORMATS)}")
    if fmt == "html":
        from attnkit.explain.page import TutorialPage

        return TutorialPage(expl, lang=lang, query=query).to_html()
    qi = None if query is None else find_token(expl.tokens, query)
    if fmt == "json":
        return json.dumps(expl.to_dict())
    blocks = _blocks(expl, qi, width)
    return _as_markdown(blocks) if fmt == "markdown" else _as_text(blocks, width)


# --- what to say --------------------------------------------------------------------


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _blocks(expl: Explanation, qi: int | None, width: int) -> list[_Block]:
    tok = expl.tokens
    x = expl.embeddings  # (t, d_in)
    t, d_in = x.shape
    dims = [f"d{j}" for j in range(d_in)]
    out: list[_Block] = [
        _Heading(f'inputs: "{" ".join(tok)}" -- {t} tokens, d_in={d_in}'),
        _Step(
            f"inputs: one embedding per token, shape {_shape(x)}"
            + (f"; embeddings {expl.options['embeddings']}" if "embeddings" in expl.options else "")
        ),
        _Table(tok, dims, x.tolist()),
    ]
    for stage, v in expl.stages.items():
        out.extend(_STAGE_BLOCKS[stage](expl, v, qi, width))
    return out


def _simplified(expl: Explanation, v: dict, qi: int | None, width: int) -> list[_Block]:
    tok, x = expl.tokens, expl.embeddings
    t, d = x.shape
    out: list[_Block] = [
        _Heading("simplified: self-attention on the raw embeddings, no trainable weights"),
        _Step(f"scores = inputs @ inputs.T, dot products: ({t}, {d}) @ ({d}, {t}) -> ({t}, {t})"),
        _Table(tok, tok, v["scores"].tolist()),
        _Step(f"weights = softmax(scores) per row, each row sums to 1: ({t}, {t})"),
        _Table(tok, tok, v["weights"].tolist()),
        _Step(f"context = weights @ inputs, weighted sums: ({t}, {t}) @ ({t}, {d}) -> ({t}, {d})"),
        _Table(tok, _dims(d), v["context"].tolist()),
    ]
    if qi is not None:
        out.append(_Walk(_follow(tok, qi, x[qi], x, x, 1.0, None, v["context"][qi], width)))
    return out


def _trainable(expl: Explanation, v: dict, qi: int | None, width: int) -> list[_Block]:
    tok, x = expl.tokens, expl.embeddings
    t, d_in = x.shape
    d_out = v["queries"].shape[-1]
    scale = float(v["scale"])
    out: list[_Block] = [
        _Heading(f"trainable: W_query, W_key, W_value project d_in={d_in} to d_out={d_out}"),
    ]
    for name, w in (("queries", "W_query"), ("keys", "W_key"), ("values", "W_value")):
        out.append(
            _Step(f"{name} = inputs @ {w}: ({t}, {d_in}) @ ({d_in}, {d_out}) -> ({t}, {d_out})")
        )
        out.append(_Table(tok, _dims(d_out), v[name].tolist()))
    out += [
        _Step(f"scores = queries @ keys.T: ({t}, {d_out}) @ ({d_out}, {t}) -> ({t}, {t})"),
        _Table(tok, tok, v["scores"].tolist()),
        _Step(f"scaled_scores = scores / sqrt(d_out={d_out}), i.e. x {scale:.4f}: ({t}, {t})"),
        _Table(tok, tok, v["scaled_scores"].tolist()),
        _Step(f"weights = softmax(scaled_scores) per row: ({t}, {t})"),
        _Table(tok, tok, v["weights"].tolist()),
        _Step(f"context = weights @ values: ({t}, {t}) @ ({t}, {d_out}) -> ({t}, {d_out})"),
        _Table(tok, _dims(d_out), v["context"].tolist()),
    ]
    if qi is not None:
        walk = _follow(
            tok, qi, v["queries"][qi], v["keys"], v["values"], scale, None, v["context"][qi], width
        )
        out.append(_Walk(walk))
    return out


def _causal(expl: Explanation, v: dict, qi: int | None, width: int) -> list[_Block]:
    tok = expl.tokens
    t = len(tok)
    d_out = v["values"].shape[-1]
    scale = float(v["scale"])
    out: list[_Block] = [
        _Heading("causal: each token attends to itself and the tokens before it"),
        _Step(f"scores = queries @ keys.T (seeded W_query, W_key, W_value): ({t}, {t})"),
        _Table(tok, tok, v["scores"].tolist()),
        _Step(f"masked_scores = scores x {scale:.4f}, future tokens set to -inf: ({t}, {t})"),
        _Table(tok, tok, v["masked_scores"].tolist()),
        _Step(f"weights = softmax(masked_scores); the future gets weight 0: ({t}, {t})"),
        _Table(tok, tok, v["weights"].tolist()),
        _Step(f"context = weights @ values: ({t}, {t}) @ ({t}, {d_out}) -> ({t}, {d_out})"),
        _Table(tok, _dims(d_out), v["context"].tolist()),
    ]
    if qi is not None:
        allowed = [j <= qi for j in range(t)]
        walk = _follow(
            tok,
            qi,
            v["queries"][qi],
            v["keys"],
            v["values"],
            scale,
            allowed,
            v["context"][qi],
            width,
        )
        out.append(_Walk(walk))
    return out


def _dropout(expl: Explanation, v: dict, qi: int | None, width: int) -> list[_Block]:
    tok = expl.tokens
    t = len(tok)
    p = float(expl.options.get("dropout", 0.0))
    d_out = v["values"].shape[-1]
    out: list[_Block] = [
        _Heading(f"dropout: causal weights with dropout p={p:g} (training mode only)"),
        _Step(
            f"weights = dropout(causal weights): a weight is zeroed with probability {p:g}, "
            f"the kept ones scaled by 1/(1-p) = {1 / (1 - p):.4f}: ({t}, {t})"
        ),
        _Table(tok, tok, v["weights"].tolist()),
        _Step(f"context = weights @ values: ({t}, {t}) @ ({t}, {d_out}) -> ({t}, {d_out})"),
        _Table(tok, _dims(d_out), v["context"].tolist()),
    ]
    if qi is not None:
        lines = [f'follow "{tok[qi]}": its row of weights before and after dropout']
        for j, name in enumerate(tok):
            before = float(v["softmax_weights"][qi, j])
            after = float(v["weights"][qi, j])
            what = "dropped" if after == 0.0 and before != 0.0 else "kept"
            if before == 0.0:
                what = "masked" if j > qi else "zero"
            lines.append(f"  {name[:8]:<8} {before:.4f} -> {after:.4f}  {what}")
        lines.append(f"  context = {_vec(v['context'][qi].tolist(), width - 12)}")
        out.append(_Walk(lines))
    return out


def _multihead(expl: Explanation, v: dict, qi: int | None, width: int) -> list[_Block]:
    tok = expl.tokens
    t, d_in = expl.embeddings.shape
    h, _, head_dim = v["context"].shape
    d_out = h * head_dim
    out: list[_Block] = [
        _Heading(f"multihead: {h} causal heads of head_dim={head_dim}, then out_proj"),
        _Step(
            f"queries/keys/values = inputs @ W_*, split into heads: ({t}, {d_in}) -> ({h}, {t}, {head_dim})"
        ),
    ]
    for i in range(h):
        out += [
            _Step(f"head {i}: weights = softmax(causal scaled scores): ({t}, {t})"),
            _Table(tok, tok, v["weights"][i].tolist()),
            _Step(f"head {i}: context = weights @ values: ({t}, {head_dim})"),
            _Table(tok, _dims(head_dim), v["context"][i].tolist()),
        ]
        if qi is not None:
            allowed = [j <= qi for j in range(t)]
            walk = _follow(
                tok,
                qi,
                v["queries"][i, qi],
                v["keys"][i],
                v["values"][i],
                float(v["scale"]),
                allowed,
                v["context"][i, qi],
                width,
            )
            out.append(_Walk([f"head {i}: {walk[0]}", *walk[1:]]))
    out += [
        _Step(f"concat the heads: ({h}, {t}, {head_dim}) -> ({t}, {d_out})"),
        _Table(tok, _dims(d_out), v["concat"].tolist()),
        _Step(f"output = out_proj(concat): ({t}, {d_out}) -> ({t}, {d_out})"),
        _Table(tok, _dims(d_out), v["output"].tolist()),
    ]
    return out


_STAGE_BLOCKS = {
    "simplified": _simplified,
    "trainable": _trainable,
    "causal": _causal,
    "dropout": _dropout,
    "multihead": _multihead,
}


def _dims(d: int) -> list[str]:
    return [f"d{j}" for j in range(d)]


def _short(v: float) -> str:
    """A number as the seeds write it: up to 4 decimals, no trailing zeros."""
    s = f"{v:.4f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def _paren(v: float) -> str:
    s = _short(v)
    return f"({s})" if s.startswith("-") else s


def _vec(values: list[float], room: int) -> str:
    """``[a, b, c]`` with 4 decimals, shortened with ``...`` to fit ``room`` columns."""
    cells = [f"{v:.4f}" for v in values]
    full = "[" + ", ".join(cells) + "]"
    if len(full) <= room or len(cells) <= 3:
        return full
    return "[" + ", ".join(cells[:2]) + ", ..., " + cells[-1] + "]"


def _follow(
    tok: Sequence[str],
    qi: int,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    allowed: list[bool] | None,
    context: torch.Tensor,
    width: int,
) -> list[str]:
    """The seeds' walkthrough for one query: dot products, softmax arithmetic, weighted sum."""
    name = tok[qi]
    qv = q.double().tolist()
    ok = allowed or [True] * len(tok)
    lines = [f'follow "{name}": its score with every token (query . key)']
    scores: list[float | None] = []
    for j, other in enumerate(tok):
        if not ok[j]:
            lines.append(f"  {other[:8]:<8} masked: a future token, score -inf")
            scores.append(None)
            continue
        kv = keys[j].double().tolist()
        s = sum(a * b for a, b in zip(qv, kv, strict=True))
        terms = [f"{_paren(a)}*{_paren(b)}" for a, b in zip(qv, kv, strict=True)]
        tail = f" = {s:.4f}" + (f"; x {scale:.4f} = {s * scale:.4f}" if scale != 1.0 else "")
        head = f"  {other[:8]:<8} "
        line = head + " + ".join(terms) + tail
        if len(line) > width:
            line = head + f"{terms[0]} + ... + {terms[-1]} ({len(terms)} terms)" + tail
        if len(line) > width:
            line = head + f"q . k ({len(terms)} terms)" + tail
        scores.append(s * scale)
        lines.append(line)
    exps = [None if s is None else math.exp(s) for s in scores]
    total = sum(e for e in exps if e is not None)
    lines.append("softmax: exponentiate each score, divide by their sum")
    for other, s, e in zip(tok, scores, exps, strict=True):
        if s is not None and e is not None:
            lines.append(f"  {other[:8]:<8} exp({s:.4f}) = {e:.4f}")
    lines.append(f"  sum of the exponentials = {total:.4f}")
    weights = [0.0 if e is None else e / total for e in exps]
    for other, e, w in zip(tok, exps, weights, strict=True):
        if e is not None:
            lines.append(f"  {other[:8]:<8} weight = {e:.4f} / {total:.4f} = {w:.4f}")
    lines.append(f'context of "{name}" = sum of weight x value')
    room = width - 24
    for j, (other, w) in enumerate(zip(tok, weights, strict=True)):
        if ok[j]:
            lines.append(f"  {other[:8]:<8} {w:.4f} x {_vec(values[j].tolist(), room)}")
    lines.append(f"  {'':<8} = {_vec(context.tolist(), width - 13)}")
    return lines


# --- how to write it ----------------------------------------------------------------


def _fmt_cell(v: float) -> str:
    if math.isinf(v):
        return "-inf" if v < 0 else "inf"
    return f"{v:.4f}"


def _as_text(blocks: list[_Block], width: int) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, _Heading):
            out += ["", f"== {b.text}"[:width]]
        elif isinstance(b, _Step):
            out += textwrap.wrap(b.text, width, subsequent_indent="    ")
        elif isinstance(b, _Table):
            out += _text_table(b, width)
        else:
            out += b.lines
    return "\n".join(out).lstrip("\n") + "\n"


def _text_table(table: _Table, width: int) -> list[str]:
    per_block = max(1, (width - _LABEL) // _CELL)
    lines = []
    for start in range(0, len(table.cols), per_block):
        cols = range(start, min(start + per_block, len(table.cols)))
        lines.append(" " * _LABEL + "".join(f"{table.cols[c][: _CELL - 1]:>{_CELL}}" for c in cols))
        for label, row in zip(table.rows, table.values, strict=True):
            cells = "".join(f"{_fmt_cell(row[c]):>{_CELL}}" for c in cols)
            lines.append(f"  {label[: _LABEL - 3]:<{_LABEL - 2}}{cells}")
    return lines


def _as_markdown(blocks: list[_Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, _Heading):
            out += [f"### {b.text}", ""]
        elif isinstance(b, _Step):
            out += [b.text, ""]
        elif isinstance(b, _Table):
            esc = [c.replace("|", "\\|") for c in b.cols]
            out.append("| | " + " | ".join(esc) + " |")
            out.append("|---|" + "---:|" * len(b.cols))
            for label, row in zip(b.rows, b.values, strict=True):
                label_md = label.replace("|", "\\|")
                cells = " | ".join(_fmt_cell(v) for v in row)
                out.append(f"| **{label_md}** | {cells} |")
            out.append("")
        else:
            out += ["```", *b.lines, "```", ""]
    return "\n".join(out)
