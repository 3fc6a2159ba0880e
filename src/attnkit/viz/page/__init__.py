"""One self-contained, offline page of a recording: model, head, neuron and next-token views.

The page is a jinja2 template (``templates/page.html.j2``) with one bundled script
(``static/views.js``) and stylesheet (``static/views.css``), all inlined: it makes no
network request. The recording goes in as one JSON block:

* weights as 16-bit fixed point (``round(w * 65535)``, absolute error <= 7.7e-6), base64;
  a causal layer stores only its lower triangle — a 12-layer x 12-head, 64-token
  recording is about 0.8 MB;
* queries and keys (neuron view) as float32, base64, so the page's products sum to the
  score the model computed;
* the next-token tree: per node the ``top`` largest logits (float, as recorded) and the
  last token's attention row.

What the next-token panel computes, in the page's script: ``softmax(logits / temperature)``
over the stored logits, then top-k, then top-p (the smallest prefix, most likely first,
whose probability reaches p), each renormalised. The step button samples among the
continuations the recording holds (the ``branch`` most likely at each node), in
proportion to those probabilities: with top-k <= branch this is exactly the shown
distribution. A static page cannot run the model on a token it never saw.
"""

from __future__ import annotations

import base64
import functools
import itertools
import secrets
from importlib import resources
from typing import Any

import numpy as np
import torch

from attnkit.viz._page import HtmlPage
from attnkit.viz.maps import AttentionMaps
from attnkit.viz.record import ModelRecording, NextTokenNode

__all__ = ["ModelView", "encode_weights"]

_COUNTER = itertools.count()
_VIEWS = ("model", "head", "neuron", "next")


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _fixed16(w: torch.Tensor) -> np.ndarray:
    """Weights in [0, 1] as little-endian uint16 ``round(w * 65535)``."""
    return np.round(w.double().clamp(0.0, 1.0).numpy() * 65535).astype("<u2")


def encode_weights(w: torch.Tensor, n_tokens: int) -> dict[str, Any]:
    """One layer's ``(h, q, t)`` weights as the page stores them.

    Returns:
        ``{"qn": q, "tri": causal, "w": base64}``: with ``tri`` only each query row's keys
        up to its own position are stored (every later weight is exactly 0).
    """
    h, qn, t = w.shape
    off = n_tokens - qn
    later = torch.ones(qn, t, dtype=torch.bool).triu(off + 1)  # (q, t): keys after the query
    tri = bool((w[:, later] == 0).all())
    fixed = _fixed16(w)  # (h, q, t)
    if tri:
        keep = (~later).numpy()  # (q, t)
        flat = np.concatenate([fixed[i][keep] for i in range(h)]) if h else fixed.ravel()
    else:
        flat = fixed.ravel()
    return {"qn": qn, "tri": tri, "w": _b64(flat)}


def _tree(node: NextTokenNode) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ids": node.top_ids,
        "logits": node.top_logits,  # as recorded: the page's probabilities are exact
        "label": node.label,
        "rows": _b64(_fixed16(node.rows).ravel()),  # (l, h, t)
    }
    if node.token is not None:
        out["t"] = node.token
    if node.children:
        out["c"] = [_tree(c) for c in node.children]
    return out


@functools.cache
def _assets() -> tuple[Any, str, str]:
    import jinja2

    here = resources.files("attnkit.viz.page")
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string((here / "templates" / "page.html.j2").read_text(encoding="utf-8"))
    js = (here / "static" / "views.js").read_text(encoding="utf-8")
    css = (here / "static" / "views.css").read_text(encoding="utf-8")
    return template, js, css


class ModelView(HtmlPage):
    """The model, head, neuron and next-token views of a recording, as one offline page.

    Args:
        recording: a :class:`~attnkit.viz.record.ModelRecording` (:func:`record_hf`,
            :func:`record_gpt`), or plain :class:`~attnkit.viz.AttentionMaps` (model and
            head views only).
        title: the page's heading.
        start: the view shown first: ``"model"``, ``"head"``, ``"neuron"`` or ``"next"``.

    Example:
        >>> rec = attnkit.viz.record_hf(model, ids, qk=True, steps=3)  # doctest: +SKIP
        >>> attnkit.viz.ModelView(rec).save("views.html")             # doctest: +SKIP
    """

    def __init__(
        self,
        recording: ModelRecording | AttentionMaps,
        *,
        title: str = "attention",
        start: str = "model",
    ) -> None:
        if isinstance(recording, AttentionMaps):
            recording = ModelRecording(recording, model=f"{len(recording.weights)} layers")
        if not isinstance(recording, ModelRecording):
            raise TypeError(
                f"recording must be a ModelRecording or AttentionMaps, got {type(recording).__name__}"
            )
        heads = {int(w.shape[0]) for w in recording.maps.weights}
        if len(heads) != 1:
            raise ValueError(f"every layer needs the same number of heads, got {sorted(heads)}")
        if start not in _VIEWS:
            raise ValueError(f"start must be one of {_VIEWS}, got {start!r}")
        if start == "neuron" and recording.queries is None:
            raise ValueError("start='neuron' needs a recording with qk=True")
        if start == "next" and recording.next_token is None:
            raise ValueError("start='next' needs a recording with steps > 0")
        self.recording = recording
        self.title = title
        self.start = start
        self.element_id = f"akp-{next(_COUNTER)}-{secrets.token_hex(4)}"

    def data(self) -> dict[str, Any]:
        """The JSON the page reads."""
        rec = self.recording
        tokens = list(rec.maps.tokens)
        out: dict[str, Any] = {
            "tokens": tokens,
            "heads": rec.num_heads,
            "layers": [encode_weights(w, len(tokens)) for w in rec.maps.weights],
            "rope": rec.rope,
            "start": self.start,
            "file": "attention",
            "qk": None,
            "next": None,
        }
        if rec.queries is not None and rec.keys is not None and rec.scales is not None:
            out["qk"] = {
                "d": int(rec.queries[0].shape[-1]),
                "scales": rec.scales,
                "q": [_b64(q.float().numpy().astype("<f4")) for q in rec.queries],  # (h, t, d)
                "k": [_b64(k.float().numpy().astype("<f4")) for k in rec.keys],
            }
        if rec.next_token is not None:
            out["next"] = {
                "vocab": {str(k): v for k, v in rec.vocab.items()},
                "tree": _tree(rec.next_token),
            }
        return out

    def fragment(self) -> str:
        """The views as one HTML ``<div>`` with inline style and scripts."""
        template, js, css = _assets()
        rec = self.recording
        top = len(rec.next_token.top_ids) if rec.next_token is not None else 0
        branch = len(rec.next_token.children) if rec.next_token is not None else 0
        note = (
            f"The probabilities come from the recorded logits of the {top} most likely tokens "
            f"(of {rec.vocab_size}), with temperature, then top-k, then top-p applied here. "
            f"Step samples among the {branch} continuations recorded at each position "
            "(renormalised): this page holds the model's output for those only, it does not "
            "run the model."
        )
        return str(
            template.render(
                eid=self.element_id,
                css=css,
                js=js,
                title=self.title,
                model=rec.model,
                n_tokens=len(rec.maps.tokens),
                has_qk=rec.queries is not None,
                has_next=rec.next_token is not None,
                rope=rec.rope,
                top=top,
                next_note=note,
                data=self.data(),
            )
        )
