"""Checkpoints: ``model.safetensors`` + ``optimizer.safetensors`` + ``config.json``.

Each file is written to a temporary name and moved into place with ``os.replace``;
``config.json`` is written last, so a directory with a readable ``config.json``
holds a complete checkpoint, and an interrupted save leaves the previous one intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from attnkit.models import GPT, GPTConfig
from attnkit.train.data import ByteTokenizer, CharTokenizer, tokenizer_from_dict

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint."""


def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(
    directory: str | Path,
    model: GPT,
    tokenizer: CharTokenizer | ByteTokenizer,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and ``optimizer``) to ``directory``, atomically file by file.

    Args:
        directory: created if missing.
        model: the GPT.
        tokenizer: saved in ``config.json`` so ``attnkit generate`` can encode prompts.
        optimizer: AdamW-like optimizer whose state is saved for ``--resume``.
        meta: JSON-ready extras (step, task, losses, ...).
    """
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    _atomic_write(d / "model.safetensors", lambda p: save_file(state, p))
    config: dict[str, Any] = {
        "format": "attnkit-gpt/1",
        "model": model.cfg.to_dict(),
        "tokenizer": tokenizer.to_dict(),
        "meta": meta or {},
    }
    if optimizer is not None:
        opt = optimizer.state_dict()
        tensors = {
            f"{i}.{name}": t.detach().contiguous()
            for i, s in opt["state"].items()
            for name, t in s.items()
            if isinstance(t, torch.Tensor)
        }
        _atomic_write(d / "optimizer.safetensors", lambda p: save_file(tensors, p))
        config["optimizer"] = {"param_groups": opt["param_groups"]}
    text = json.dumps(config, indent=2)
    _atomic_write(d / "config.json", lambda p: Path(p).write_text(text))
    return d


def load_checkpoint(
    directory: str | Path,
) -> tuple[GPT, CharTokenizer | ByteTokenizer, dict[str, Any], dict[str, Any] | None]:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Returns:
        ``(model, tokenizer, meta, optimizer_state)``; the optimizer state (for
        ``optimizer.load_state_dict``) is None when none was saved.

    Raises:
        CheckpointError: a missing directory or file, or unreadable / mismatched contents.
    """
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"no checkpoint in {str(d)!r} (config.json not found)")
    try:
        config = json.loads((d / "config.json").read_text())
        cfg = GPTConfig.from_dict(config["model"])
        tokenizer = tokenizer_from_dict(config["tokenizer"])
        meta = dict(config.get("meta", {}))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"corrupt checkpoint config {str(d / 'config.json')!r}: {err}"
        ) from None
    model = GPT(cfg)
    try:
        state = load_file(str(d / "model.safetensors"))
        model.load_state_dict(state, strict=True)
    except Exception as err:  # safetensors raises its own error types
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"corrupt or missing weights {str(d / 'model.safetensors')!r}: {msg}"
        ) from None
    model.eval()
    opt_state = None
    if "optimizer" in config and (d / "optimizer.safetensors").is_file():
        try:
            tensors = load_file(str(d / "optimizer.safetensors"))
        except Exception as err:
            raise CheckpointError(f"corrupt optimizer state in {str(d)!r}: {err}") from None
        state_by_param: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            i, name = key.split(".", 1)
            state_by_param.setdefault(int(i), {})[name] = t
        opt_state = {"state": state_by_param, "param_groups": config["optimizer"]["param_groups"]}
    return model, tokenizer, meta, opt_state
