"""The tiny GPT's checkpoint: what goes in it, written through :mod:`attnkit.checkpoints`.

A checkpoint is a directory: ``model.safetensors``, ``optimizer.safetensors`` (for
``--resume``), ``config.json`` (model config, tokenizer, run metadata) and ``manifest.json``
(sizes and SHA-256 of the others, written last). :func:`attnkit.checkpoints.write_directory`
swaps a whole new directory into place, so an interrupted save leaves the previous checkpoint
whole; a directory whose files do not match its manifest is refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from attnkit.checkpoints import (
    MANIFEST,
    CheckpointError,
    read_directory,
    write_directory,
)
from attnkit.checkpoints import load_checkpoint as load_state
from attnkit.checkpoints import save_checkpoint as save_state
from attnkit.models import GPT, GPTConfig
from attnkit.train.data import ByteTokenizer, CharTokenizer, tokenizer_from_dict

__all__ = ["CheckpointError", "is_checkpoint", "load_checkpoint", "save_checkpoint"]

FORMAT = "attnkit-gpt/2"
_FORMATS = ("attnkit-gpt/1", FORMAT)  # /1: written before manifests


def is_checkpoint(directory: str | Path) -> bool:
    """True if ``directory`` holds an attnkit GPT checkpoint (whole or not)."""
    d = Path(directory)
    return (d / "config.json").is_file() or (d / MANIFEST).is_file()


def save_checkpoint(
    directory: str | Path,
    model: GPT,
    tokenizer: CharTokenizer | ByteTokenizer,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and ``optimizer``) to ``directory``, atomically as a whole.

    Args:
        directory: created if missing; other files in it (pictures) are kept.
        model: the GPT.
        tokenizer: saved in ``config.json`` so ``attnkit generate`` can encode prompts.
        optimizer: AdamW-like optimizer whose state is saved for ``--resume``.
        meta: JSON-ready extras (step, task, losses, ...).
    """
    config: dict[str, Any] = {
        "format": FORMAT,
        "model": model.cfg.to_dict(),
        "tokenizer": tokenizer.to_dict(),
        "meta": meta or {},
    }
    files: dict[str, Any] = {"model.safetensors": lambda p: save_state(model, p)}
    if optimizer is not None:
        opt = optimizer.state_dict()
        tensors = {
            f"{i}.{name}": t.detach()
            for i, s in opt["state"].items()
            for name, t in s.items()
            if isinstance(t, torch.Tensor)
        }
        files["optimizer.safetensors"] = lambda p: save_state(tensors, p)
        config["optimizer"] = {"param_groups": opt["param_groups"]}
    files["config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    return write_directory(directory, files)


def _check_meta(meta: Any) -> dict[str, Any]:
    """The run metadata with the types ``--resume`` relies on, or ValueError naming the key."""
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be an object, got {type(meta).__name__}")
    for key in ("step", "length"):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"meta.{key} must be an int, got {value!r}")
        if isinstance(value, int) and value < 0:
            raise ValueError(f"meta.{key} must be >= 0, got {value}")
    losses = meta.get("losses", [])
    if not isinstance(losses, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in losses
    ):
        raise ValueError("meta.losses must be a list of numbers")
    for key in ("task", "text"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ValueError(f"meta.{key} must be a string or null, got {meta[key]!r}")
    return meta


def _check_param_groups(groups: Any) -> list[dict[str, Any]]:
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError("optimizer.param_groups must be a list of objects")
    for g in groups:
        params = g.get("params")
        if not isinstance(params, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in params
        ):
            raise ValueError("optimizer.param_groups[].params must be a list of ints")
        lr = g.get("lr")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr):
            raise ValueError(f"optimizer.param_groups[].lr must be a finite number, got {lr!r}")
    return groups


def load_checkpoint(
    directory: str | Path, *, require_manifest: bool = False
) -> tuple[GPT, CharTokenizer | ByteTokenizer, dict[str, Any], dict[str, Any] | None]:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Args:
        directory: the checkpoint directory.
        require_manifest: refuse a checkpoint from before manifests (``attnkit-gpt/1``), whose
            files cannot be checked against each other (``--resume`` asks for this).

    Returns:
        ``(model, tokenizer, meta, optimizer_state)``; the optimizer state (for
        ``optimizer.load_state_dict``) is None when none was saved.

    Raises:
        CheckpointError: a missing directory or file, a torn save, or unreadable / mistyped
            contents; the message is one line naming the file.
    """
    d = Path(directory)
    if not (d / "config.json").is_file() and not (d / MANIFEST).is_file():
        raise CheckpointError(f"no checkpoint in {str(d)!r} (config.json not found)")
    files = read_directory(d, require_manifest=require_manifest)
    if "config.json" not in files or "model.safetensors" not in files:
        raise CheckpointError(f"incomplete checkpoint {str(d)!r}: config.json or weights missing")
    try:
        config = json.loads(files["config.json"].read_text())
        if not isinstance(config, dict) or config.get("format", _FORMATS[0]) not in _FORMATS:
            raise ValueError(
                f"unknown format {config.get('format') if isinstance(config, dict) else config!r}"
            )
        if not isinstance(config.get("model"), dict) or not isinstance(
            config.get("tokenizer"), dict
        ):
            raise ValueError("'model' and 'tokenizer' must be objects")
        cfg = GPTConfig.from_dict(config["model"])
        _check_backend(cfg.attn_backend)
        tokenizer = tokenizer_from_dict(config["tokenizer"])
        meta = _check_meta(dict(config.get("meta", {})))
        groups = None
        if "optimizer" in config:
            groups = _check_param_groups(config["optimizer"].get("param_groups"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"corrupt checkpoint config {str(d / 'config.json')!r}: {msg}"
        ) from None
    _check_sizes(cfg, d / "config.json", files["model.safetensors"])
    try:
        model = GPT(cfg)
    except (RuntimeError, MemoryError) as err:  # e.g. a RoPE table for a huge context_length
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint config {str(d / 'config.json')!r} asks for a model that cannot be "
            f"allocated: {msg}"
        ) from None
    try:
        model.load_state_dict(load_state(files["model.safetensors"]), strict=True)
    except (ValueError, RuntimeError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"corrupt or mismatched weights {str(d / 'model.safetensors')!r}: {msg}"
        ) from None
    model.eval()
    opt_state = None
    if groups is not None and "optimizer.safetensors" in files:
        opt_state = _optimizer_state(files["optimizer.safetensors"], groups, model)
    return model, tokenizer, meta, opt_state


def _check_sizes(cfg: GPTConfig, config_path: Path, weights: Path) -> None:
    """Refuse a config whose sizes differ from the weights' shapes, before allocating.

    The shapes come from the safetensors header (nothing is loaded); the model is laid out
    on the ``meta`` device (no memory) once the layer count and the embedding, the sizes a
    config could make absurd, are known to match.

    Raises:
        CheckpointError: one line naming the first tensor that differs.
    """
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"corrupt or mismatched weights {str(weights)!r}: {msg}") from None

    def differ(what: str, wanted: object, held: object) -> CheckpointError:
        return CheckpointError(
            f"{str(config_path)!r} does not match {weights.name}: {what} would be {wanted} "
            f"by the config, the weights hold {held}"
        )

    blocks = {n.split(".")[1] for n in shapes if n.startswith("trf_blocks.")}
    if len(blocks) != cfg.n_layers:
        raise differ("the number of blocks (n_layers)", cfg.n_layers, len(blocks))
    wanted = (cfg.vocab_size, cfg.emb_dim)
    if "tok_emb.weight" in shapes and shapes["tok_emb.weight"] != wanted:
        raise differ("tok_emb.weight (vocab_size, emb_dim)", wanted, shapes["tok_emb.weight"])
    with torch.device("meta"):
        layout = GPT(cfg).state_dict()
    for name, tensor in layout.items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise differ(name, tuple(tensor.shape), shapes[name])


def _check_backend(name: str) -> None:
    from attnkit.backends import available_backends

    if name != "auto" and name not in available_backends():
        raise ValueError(
            f"unknown attn_backend {name!r}; available: auto, {', '.join(available_backends())}"
        )


def _optimizer_state(path: Path, groups: list[dict[str, Any]], model: GPT) -> dict[str, Any]:
    try:
        tensors = load_state(path)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    n_params = sum(len(g["params"]) for g in groups)
    state_by_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        i, sep, name = key.partition(".")
        if not sep or not name or not i.isdigit() or int(i) >= n_params:
            raise CheckpointError(
                f"corrupt optimizer state {str(path)!r}: key {key!r} is not '<param index>.<name>'"
            )
        state_by_param.setdefault(int(i), {})[name] = t
    params = list(model.parameters())
    if n_params != len(params):
        raise CheckpointError(
            f"corrupt optimizer state {str(path)!r}: {n_params} parameters for a model of "
            f"{len(params)}"
        )
    for index, state in state_by_param.items():  # moments must have their parameter's shape
        for name, t in state.items():
            if t.dim() > 0 and t.shape != params[index].shape:
                raise CheckpointError(
                    f"corrupt optimizer state {str(path)!r}: {index}.{name} has shape "
                    f"{tuple(t.shape)}, its parameter {tuple(params[index].shape)}"
                )
    return {"state": state_by_param, "param_groups": groups}
