"""Attention maps to draw: named layers of ``(heads, q, k)`` weights plus token labels.

Sources: an :class:`~attnkit.explain.Explanation` (one "layer" per stage), a
saved ``attnkit explain --format json`` run, a saved :mod:`attnkit.trace`
recording, or Hugging Face's ``outputs.attentions`` (a tuple of
``(batch, heads, q, k)`` per layer) saved with ``torch.save``, numpy ``.npz``
or safetensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnkit.checkpoints import safe_torch_load

__all__ = ["AttentionMaps", "from_explanation", "from_hf", "load_attentions"]


@dataclass
class AttentionMaps:
    """Attention weights to draw.

    Attributes:
        names: one label per layer (``"layer 0"``, or a stage name).
        weights: one float tensor ``(heads, q, k)`` per layer.
        tokens: the key tokens; query tokens are the last ``q`` of them.
        kind: what a layer is called in titles and pickers (``"layer"`` or ``"stage"``).
    """

    names: list[str]
    weights: list[torch.Tensor]
    tokens: list[str]
    kind: str = "layer"

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("no attention maps to draw")
        if len(self.names) != len(self.weights):
            raise ValueError(f"{len(self.names)} names for {len(self.weights)} layers")
        for name, w in zip(self.names, self.weights, strict=True):
            if w.dim() != 3:
                raise ValueError(f"{name}: weights must be (heads, q, k), got {tuple(w.shape)}")
            if w.shape[-1] != len(self.tokens) or w.shape[-2] > len(self.tokens):
                raise ValueError(
                    f"{name}: weights of shape {tuple(w.shape)} need {w.shape[-1]} tokens, "
                    f"got {len(self.tokens)}"
                )

    def label(self, layer: int) -> str:
        """Title of ``layer``: ``"stage causal"``, ``"layer 3"``."""
        name = self.names[layer]
        return name if name.startswith(self.kind) else f"{self.kind} {name}"

    def query_tokens(self, layer: int) -> list[str]:
        """Token labels of the query axis of ``layer``."""
        return self.tokens[len(self.tokens) - self.weights[layer].shape[-2] :]


def from_explanation(expl: Any) -> AttentionMaps:
    """One map per stage of an :class:`~attnkit.explain.Explanation` (weights after dropout)."""
    maps = expl.attention_maps()
    return AttentionMaps(list(maps), list(maps.values()), list(expl.tokens), kind="stage")


def from_hf(
    attentions: Sequence[torch.Tensor] | torch.Tensor,
    tokens: Sequence[str],
    *,
    batch_index: int = 0,
    names: Sequence[str] | None = None,
) -> AttentionMaps:
    """Maps from Hugging Face's ``outputs.attentions``.

    Args:
        attentions: a sequence of ``(batch, heads, q, k)`` tensors (one per layer), or
            one tensor ``(layers, batch, heads, q, k)``, or a single layer ``(batch, heads, q, k)``;
            or the output of ``model.generate(..., output_attentions=True,
            return_dict_in_generate=True)`` (or its ``.attentions``: one tuple of layers per
            generated token), whose steps are stitched into one causal map per layer.
        tokens: one label per key position (for a ``generate`` output, the whole sequence;
            the last token, never attended to, may be included).
        batch_index: which sequence of the batch to draw.
        names: layer labels (default ``"layer 0"``, ``"layer 1"``, ...).

    Raises:
        ValueError: wrong ranks, mismatched token count or batch index; no weights at all
            (``outputs.attentions`` of a model on SDPA, which computes none: the message
            says to load it with ``attn_implementation="attnkit"`` or ``"eager"``).
    """
    if not isinstance(attentions, (torch.Tensor, np.ndarray, list, tuple)) and hasattr(
        attentions, "attentions"
    ):
        attentions = attentions.attentions  # a model output or a generate() output
    if _holds_no_weights(attentions):
        raise ValueError(_NO_WEIGHTS.format(type(attentions).__name__))
    if _is_generate_steps(attentions):
        attentions = _stitch_generate_steps(attentions)
        total = attentions[0].shape[-1]
        if len(tokens) == total + 1:  # the last generated token was never attended to
            tokens = list(tokens)[:-1]
    layers = _as_layers(attentions)
    weights = []
    for i, layer in enumerate(layers):
        if not 0 <= batch_index < layer.shape[0]:
            raise ValueError(
                f"batch_index {batch_index} out of range for a batch of {layer.shape[0]}"
            )
        weights.append(layer[batch_index].detach().to(torch.float32).cpu())  # (heads, q, k)
        if not torch.isfinite(weights[-1]).all():
            raise ValueError(f"layer {i} has inf or NaN attention weights")
    labels = list(names) if names is not None else [f"layer {i}" for i in range(len(weights))]
    return AttentionMaps(labels, weights, list(tokens))


def _is_generate_steps(attentions: Any) -> bool:
    return (
        isinstance(attentions, (list, tuple))
        and len(attentions) > 0
        and all(isinstance(step, (list, tuple)) for step in attentions)
    )


def _stitch_generate_steps(steps: Any) -> list[torch.Tensor]:
    """``generate`` attentions (per step, per layer ``(b, h, q_i, k_i)``) -> per layer
    ``(b, h, T, T)``: the prompt's rows, then one row per generated token, zero-padded keys."""
    n_layers = len(steps[0])
    if n_layers == 0 or any(len(step) != n_layers for step in steps):
        raise ValueError("generate attentions must have the same number of layers at every step")
    out = []
    for layer in range(n_layers):
        rows = [torch.as_tensor(step[layer]) for step in steps]
        if any(r.dim() != 4 for r in rows):
            raise ValueError("generate attentions must be (batch, heads, q, k) per layer and step")
        total = rows[-1].shape[-1]
        padded = []
        for r in rows:
            if r.shape[-1] > total:
                raise ValueError("generate attentions: a step has more keys than the last one")
            padded.append(torch.nn.functional.pad(r.float(), (0, total - r.shape[-1])))
        full = torch.cat(padded, dim=2)  # (b, h, q_total, total)
        if full.shape[2] != total:
            raise ValueError(
                f"generate attentions: {full.shape[2]} query rows for {total} keys; "
                "pass every step of one generate() call"
            )
        out.append(full)
    return out


_NO_WEIGHTS = (
    "no attention tensors found in {} (None, empty, or None for every layer): a transformers "
    "model loaded the default way (SDPA) returns no attention weights; load it with "
    "attn_implementation='attnkit' (after attnkit.integrations.hf.register(): weights from "
    "the fast path) or attn_implementation='eager', and call it with output_attentions=True"
)


def _holds_no_weights(attentions: Any) -> bool:
    """True for None, an empty sequence, or sequences (of sequences) holding only None."""
    if attentions is None:
        return True
    if isinstance(attentions, (list, tuple)):
        return all(_holds_no_weights(a) for a in attentions)
    return False


def _as_layers(attentions: Any) -> list[torch.Tensor]:
    if isinstance(attentions, (np.ndarray, torch.Tensor)):
        t = torch.as_tensor(attentions)
        if t.dim() == 4:
            return [t]
        if t.dim() == 5:
            return list(t.unbind(0))
        raise ValueError(
            f"attentions must be (batch, heads, q, k) per layer or (layers, batch, heads, q, k), "
            f"got shape {tuple(t.shape)}"
        )
    if isinstance(attentions, (list, tuple)) and attentions:
        out = []
        for i, a in enumerate(attentions):
            t = torch.as_tensor(a)
            if t.dim() != 4 or not t.is_floating_point():
                raise ValueError(
                    f"layer {i} must be a float (batch, heads, q, k) tensor, got shape {tuple(t.shape)}"
                )
            out.append(t)
        return out
    raise ValueError(_NO_WEIGHTS.format(type(attentions).__name__))


def _natural(key: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def load_attentions(
    path: str | Path, tokens: Sequence[str] | None = None, *, batch_index: int = 0
) -> AttentionMaps:
    """Read attention maps from a file.

    ``.json``: an ``attnkit explain --format json`` run (tokens included).
    ``.npz`` / ``.safetensors``: one array per layer (keys in natural order) or a
    single ``attentions`` array ``(layers, batch, heads, q, k)``.
    Anything else is read with :func:`attnkit.checkpoints.safe_torch_load`
    (``torch.load(weights_only=True)``): a tuple/list of
    layers (``outputs.attentions``), a tensor, or a dict — a saved
    :class:`attnkit.trace.Recording` (every ``*weights`` entry becomes a layer) or
    ``{"attentions": ..., "tokens": [...]}``.

    Args:
        path: the file.
        tokens: token labels; required unless the file carries them.
        batch_index: which sequence of a batch to draw.

    Raises:
        ValueError: unreadable file, unknown layout, no or wrong tokens.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such file: {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _from_explain_json(path, tokens)
    try:
        if suffix == ".npz":
            with np.load(path) as z:
                data: Any = {k: torch.from_numpy(z[k]) for k in z.files}
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            data = load_file(str(path))
        else:
            data = safe_torch_load(path)
    except ValueError as err:  # safe_torch_load's one-line refusal or read error
        raise ValueError(f"cannot read {path.name!r} as attention maps: {err}") from None
    except Exception as err:  # any reader's failure is a user error: the file is not what we read
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot read {path.name!r} as attention maps: {first}") from None
    names = None
    if isinstance(data, Mapping):
        if tokens is None and isinstance(data.get("tokens"), (list, tuple)):
            tokens = [str(t) for t in data["tokens"]]
        if "attentions" in data:
            data = data["attentions"]
        else:
            keys = sorted((k for k in data if isinstance(data[k], torch.Tensor)), key=_natural)
            weight_keys = [k for k in keys if k.split(".")[-1].split("#")[0] == "weights"]
            if weight_keys:  # a trace recording: (b, h, t, s) or (b, t, s) per entry
                names = weight_keys
                data = [_four_d(data[k]) for k in weight_keys]
            else:
                names = keys
                data = [data[k] for k in keys]
    if tokens is None:
        raise ValueError(f"{path.name!r} has no token labels: pass --tokens")
    return from_hf(data, tokens, batch_index=batch_index, names=names)


def _four_d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2:  # (t, s)
        return t[None, None]
    if t.dim() == 3:  # (b, t, s): one head
        return t.unsqueeze(1)
    return t


def _from_explain_json(path: Path, tokens: Sequence[str] | None) -> AttentionMaps:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        stages = data["stages"]
        names, weights = [], []
        for name, stage in stages.items():
            if "heads" in stage:
                w = torch.tensor([h["weights"] for h in stage["heads"]], dtype=torch.float32)
            else:
                w = torch.tensor([stage["weights"]], dtype=torch.float32)
            names.append(name)
            weights.append(w)  # (heads, t, t)
        labels = list(tokens) if tokens is not None else [str(t) for t in data["tokens"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        msg = "nested too deeply" if isinstance(err, RecursionError) else err
        raise ValueError(f"{path.name!r} is not an attnkit explain JSON run: {msg}") from None
    return AttentionMaps(names, weights, labels, kind="stage")
