"""Recording a model's attention for the head, model, neuron and next-token views.

:func:`record_hf` runs a Hugging Face model through attnkit's transformers backend
(:mod:`attnkit.integrations.hf`), so its weights come from attnkit and not from SDPA
(which returns none); :func:`record_gpt` runs attnkit's own :class:`~attnkit.models.GPT`.
Both read one :func:`attnkit.trace.record` block per forward:

* ``weights`` of every layer: ``(heads, t, t)``;
* with ``qk=True``, the queries and keys each layer's attention receives — after RoPE
  where the model applies it — and the layer's scale, for the neuron view;
* with ``steps > 0``, a small tree of continuations for the next-token panel: the last
  position's logits (the ``top`` largest), then for each of the ``branch`` most likely
  tokens one more forward with that token appended, ``steps`` deep (budgeted: at most
  ``MAX_NODES`` forwards). Each node keeps the attention row of its last token.

Shapes: l layers, h heads, t tokens, d head_dim, v vocab_size.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit import trace
from attnkit._validate import check_bool, check_int
from attnkit.viz.maps import AttentionMaps

__all__ = [
    "MAX_NODES",
    "ModelRecording",
    "Neuron",
    "NextTokenNode",
    "neuron",
    "record_gpt",
    "record_hf",
]

#: The most forwards a next-token tree may take (nodes of the tree).
MAX_NODES = 400


@dataclass
class NextTokenNode:
    """One position of the next-token tree.

    Attributes:
        token: the token id this node appended (None at the root: the prompt itself).
        label: its text.
        top_ids: the ``top`` most likely next tokens, most likely first.
        top_logits: their logits (raw, before any temperature).
        rows: the attention of this node's last token over every token before it and
            itself, ``(l, h, t)``.
        children: one node per recorded continuation (a subset of ``top_ids``).
    """

    token: int | None
    label: str
    top_ids: list[int]
    top_logits: list[float]
    rows: torch.Tensor
    children: list[NextTokenNode] = field(default_factory=list)

    def count(self) -> int:
        """The number of nodes in this subtree."""
        return 1 + sum(c.count() for c in self.children)


@dataclass
class ModelRecording:
    """What the views draw.

    Attributes:
        maps: one ``(h, t, t)`` weight map per layer, and the token labels.
        queries: per layer ``(h, t, d)`` (after RoPE), or None when not recorded.
        keys: per layer ``(h, t, d)``, one per *query* head (a GQA key head repeated).
        scales: per layer, the factor on ``q · k`` (``1/sqrt(d)`` unless the model says).
        rope: whether the model rotates q and k (the neuron view says so).
        next_token: the root of the continuation tree, or None.
        vocab: the text of every token id that appears in the tree.
        vocab_size: the model's vocabulary size (the tree stores the ``top`` largest logits).
        model: a short description (class name, layers, heads).
    """

    maps: AttentionMaps
    queries: list[torch.Tensor] | None = None
    keys: list[torch.Tensor] | None = None
    scales: list[float] | None = None
    rope: bool = False
    next_token: NextTokenNode | None = None
    vocab: dict[int, str] = field(default_factory=dict)
    vocab_size: int = 0
    model: str = "model"

    @property
    def num_layers(self) -> int:
        return len(self.maps.weights)

    @property
    def num_heads(self) -> int:
        return int(self.maps.weights[0].shape[0])


@dataclass
class Neuron:
    """How one score is made: ``score = scale * sum(q * k)``.

    Attributes:
        q: the query vector ``(d,)`` (float64).
        k: the key vector ``(d,)``.
        products: ``q * k`` element by element.
        dot: their sum.
        scale: the layer's scale.
        score: ``scale * dot``.
        recorded_score: the score the attention computed (``scaled_scores``), if recorded.
        weight: the recorded attention weight of the pair.
    """

    q: torch.Tensor
    k: torch.Tensor
    products: torch.Tensor
    dot: float
    scale: float
    score: float
    weight: float


def neuron(rec: ModelRecording, layer: int, head: int, query: int, key: int) -> Neuron:
    """The neuron view's numbers for one query/key pair.

    Raises:
        ValueError: no q/k recorded, or an index out of range.
    """
    if rec.queries is None or rec.keys is None or rec.scales is None:
        raise ValueError("this recording holds no queries and keys: record it with qk=True")
    t = len(rec.maps.tokens)
    for name, value, size in (
        ("layer", layer, rec.num_layers),
        ("head", head, rec.num_heads),
        ("query", query, t),
        ("key", key, t),
    ):
        check_int(value, name, minimum=0)
        if value >= size:
            raise ValueError(f"{name} {value} out of range: there are {size}")
    q = rec.queries[layer][head, query].double()  # (d,)
    k = rec.keys[layer][head, key].double()  # (d,)
    products = q * k  # (d,)
    dot = float(products.sum())
    scale = rec.scales[layer]
    weight = float(rec.maps.weights[layer][head, query, key])
    return Neuron(q, k, products, dot, scale, scale * dot, weight)


# -- one forward, read from a trace recording --------------------------------------------------

_LAYER = re.compile(r"^(?:layers|blocks)\.(\d+)\.(weights|queries|keys|scale)$")


@dataclass
class _Forward:
    logits: torch.Tensor  # (v,) of the last position
    weights: list[torch.Tensor]  # per layer (h, t, t)
    queries: list[torch.Tensor] | None
    keys: list[torch.Tensor] | None
    scales: list[float] | None


def _read(rec: trace.Recording, logits: torch.Tensor, qk: bool, head_dim_scale: bool) -> _Forward:
    """The per-layer tensors of one forward from its trace ``rec``."""
    found: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in rec.items():
        m = _LAYER.match(name)
        if m:
            found.setdefault(m.group(2), {})[int(m.group(1))] = tensor
    weights_by_layer = found.get("weights", {})
    if not weights_by_layer:
        raise ValueError(
            "the forward recorded no attention weights: is the model running through attnkit "
            "(attnkit.models.GPT, or a transformers model with attn_implementation='attnkit')?"
        )
    layers = sorted(weights_by_layer)
    weights = [weights_by_layer[i][0].float() for i in layers]  # (h, t, t) each
    queries = keys = None
    scales: list[float] | None = None
    if qk:
        q_by, k_by = found.get("queries", {}), found.get("keys", {})
        if sorted(q_by) != layers or sorted(k_by) != layers:
            raise ValueError("the forward recorded no queries/keys for some layers (qk=True)")
        queries, keys, scales = [], [], []
        for i in layers:
            q, k = q_by[i][0].float(), k_by[i][0].float()  # (h, t, d), (h_kv, t, d)
            keys.append(k.repeat_interleave(q.shape[0] // k.shape[0], dim=0))  # (h, t, d)
            queries.append(q)
            if head_dim_scale or i not in found.get("scale", {}):
                scales.append(q.shape[-1] ** -0.5)
            else:
                scales.append(float(found["scale"][i]))
    return _Forward(logits.detach().float(), weights, queries, keys, scales)


def _build(
    forward: Callable[[list[int], bool], _Forward],
    ids: list[int],
    *,
    labels: list[str],
    decode: Callable[[int], str],
    qk: bool,
    steps: int,
    branch: int,
    top: int,
    model: str,
    rope: bool,
) -> ModelRecording:
    first = forward(ids, qk)
    maps = AttentionMaps([f"layer {i}" for i in range(len(first.weights))], first.weights, labels)
    rec = ModelRecording(
        maps,
        first.queries,
        first.keys,
        first.scales,
        rope=rope,
        vocab_size=int(first.logits.shape[-1]),
        model=model,
    )
    if steps:
        nodes = sum(branch**i for i in range(steps + 1))
        if nodes > MAX_NODES:
            raise ValueError(
                f"steps={steps}, branch={branch} needs {nodes} forwards; the budget is {MAX_NODES}"
            )
        top = min(top, rec.vocab_size)
        rec.next_token = _node(forward, ids, None, first, steps, branch, top, decode, rec.vocab)
    return rec


def _node(
    forward: Callable[[list[int], bool], _Forward],
    ids: list[int],
    token: int | None,
    fwd: _Forward,
    depth: int,
    branch: int,
    top: int,
    decode: Callable[[int], str],
    vocab: dict[int, str],
) -> NextTokenNode:
    logits, order = torch.topk(fwd.logits, top)  # (top,)
    rows = torch.stack([w[:, -1, :] for w in fwd.weights])  # (l, h, t)
    top_ids = [int(i) for i in order]
    for i in top_ids:
        vocab.setdefault(i, decode(i))
    label = "" if token is None else vocab[token]
    node = NextTokenNode(token, label, top_ids, [float(x) for x in logits], rows)
    if depth > 0:
        for child in top_ids[:branch]:
            longer = [*ids, child]
            node.children.append(
                _node(
                    forward,
                    longer,
                    child,
                    forward(longer, False),
                    depth - 1,
                    branch,
                    top,
                    decode,
                    vocab,
                )
            )
    return node


def _check(qk: Any, steps: Any, branch: Any, top: Any) -> None:
    check_bool(qk, "qk")
    check_int(steps, "steps", minimum=0)
    check_int(branch, "branch")
    check_int(top, "top")
    if branch > top:
        raise ValueError(f"branch ({branch}) must be at most top ({top})")


def _ids(input_ids: Any) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise ValueError(
                f"input_ids must be integer ids (t,) or (1, t), got {input_ids.dtype} "
                f"of shape {tuple(input_ids.shape)}"
            )
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        raise ValueError(f"input_ids must be a non-empty sequence of ids, got {input_ids!r}")
    for i in input_ids:
        check_int(i, "input_ids", minimum=0)
    return list(input_ids)


# -- Hugging Face ---------------------------------------------------------------------------


@contextlib.contextmanager
def _through_attnkit(model: Any) -> Iterator[None]:
    """Run ``model`` with attnkit's attention for the block, then restore its implementation."""
    from attnkit.integrations import hf

    name = hf.register()
    before = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        if before is not None and before != name:
            model.set_attn_implementation(before)


def record_hf(
    model: Any,
    input_ids: Any,
    *,
    tokenizer: Any = None,
    tokens: Sequence[str] | None = None,
    qk: bool = False,
    steps: int = 0,
    branch: int = 3,
    top: int = 20,
) -> ModelRecording:
    """Record a transformers model's attention through attnkit's backend.

    The model runs with ``attn_implementation="attnkit"`` for the call (its previous
    implementation is restored after), in eval mode under ``torch.no_grad()``.

    Args:
        model: a transformers ``PreTrainedModel`` (``...ForCausalLM`` for ``steps > 0``).
        input_ids: token ids ``(t,)`` or ``(1, t)``.
        tokenizer: turns ids into token labels (``convert_ids_to_tokens``), if given.
        tokens: explicit labels, one per id (default: the tokenizer's, else the ids).
        qk: also record each layer's queries and keys (after RoPE) for the neuron view.
        steps: depth of the next-token tree (0 = none).
        branch: continuations recorded per node.
        top: logits kept per node (the ``top`` largest).

    Returns:
        A :class:`ModelRecording`.

    Raises:
        ValueError / TypeError: bad ids, options or budget; a model that records nothing.
    """
    _check(qk, steps, branch, top)
    ids = _ids(input_ids)
    decode = _hf_decoder(tokenizer)
    labels = _labels(tokens, ids, decode)
    cfg = model.config
    rope = any(
        getattr(cfg, a, None) is not None for a in ("rope_theta", "rope_parameters", "rope_scaling")
    )

    def forward(seq: list[int], want_qk: bool) -> _Forward:
        x = torch.tensor([seq], dtype=torch.long)  # (1, t)
        with torch.no_grad(), trace.record() as rec:
            out = model(input_ids=x, use_cache=False)
        logits = getattr(out, "logits", None)
        if logits is None:
            if steps:
                raise ValueError(
                    f"{type(model).__name__} returns no logits: steps needs a causal LM"
                )
            logits = torch.zeros(1, 1, 1)
        return _read(rec, logits[0, -1], want_qk, head_dim_scale=False)  # (v,)

    was_training = model.training
    model.eval()
    try:
        with _through_attnkit(model):
            return _build(
                forward,
                ids,
                labels=labels,
                decode=decode,
                qk=qk,
                steps=steps,
                branch=branch,
                top=top,
                model=_describe(type(model).__name__, cfg),
                rope=rope,
            )
    finally:
        model.train(was_training)


def _describe(name: str, cfg: Any) -> str:
    layers = getattr(cfg, "num_hidden_layers", getattr(cfg, "n_layer", "?"))
    heads = getattr(cfg, "num_attention_heads", getattr(cfg, "n_head", "?"))
    return f"{name} ({layers} layers, {heads} heads)"


def _hf_decoder(tokenizer: Any) -> Callable[[int], str]:
    if tokenizer is None:
        return str
    return lambda i: str(tokenizer.convert_ids_to_tokens(int(i)))


def _labels(
    tokens: Sequence[str] | None, ids: list[int], decode: Callable[[int], str]
) -> list[str]:
    if tokens is None:
        return [decode(i) for i in ids]
    labels = [str(t) for t in tokens]
    if len(labels) != len(ids):
        raise ValueError(f"{len(labels)} tokens for {len(ids)} input_ids")
    return labels


# -- attnkit's GPT ------------------------------------------------------------------------------


def record_gpt(
    model: Any,
    input_ids: Any,
    *,
    decode: Callable[[int], str] | None = None,
    tokens: Sequence[str] | None = None,
    qk: bool = False,
    steps: int = 0,
    branch: int = 3,
    top: int = 20,
) -> ModelRecording:
    """Record an :class:`attnkit.models.GPT` (arguments as :func:`record_hf`).

    Args:
        decode: turns one id into its text (default ``str``), e.g. a byte tokenizer's.

    Raises:
        ValueError: an MLA model with ``qk=True`` (its scores are not one ``q · k``).
    """
    from attnkit.models import GPT

    if not isinstance(model, GPT):
        raise TypeError(f"model must be an attnkit.models.GPT, got {type(model).__name__}")
    if qk and model.cfg.mla_kv_rank is not None:
        raise ValueError("qk=True: an MLA model's score is not one q · k per head")
    _check(qk, steps, branch, top)
    ids = _ids(input_ids)
    if len(ids) + steps > model.cfg.context_length:
        raise ValueError(
            f"{len(ids)} tokens + {steps} steps exceed context_length {model.cfg.context_length}"
        )
    dec = decode or str
    labels = _labels(tokens, ids, dec)

    def forward(seq: list[int], want_qk: bool) -> _Forward:
        with torch.no_grad(), trace.record() as rec:
            logits = model(torch.tensor([seq], dtype=torch.long))  # (1, t, v)
        return _read(rec, logits[0, -1], want_qk, head_dim_scale=True)

    cfg = model.cfg
    was_training = model.training
    model.eval()
    try:
        return _build(
            forward,
            ids,
            labels=labels,
            decode=dec,
            qk=qk,
            steps=steps,
            branch=branch,
            top=top,
            model=f"attnkit GPT ({cfg.n_layers} layers, {cfg.n_heads} heads)",
            rope=bool(cfg.rope),
        )
    finally:
        model.train(was_training)
