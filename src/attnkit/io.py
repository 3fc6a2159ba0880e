"""Checkpoints in and out, safely: safetensors for everything attnkit writes.

* :func:`save_checkpoint` writes a state dict (or a module's) as ``.safetensors``: plain
  tensors and string metadata, no code.
* :func:`load_checkpoint` reads ``.safetensors``, and for files from elsewhere (``.pt``,
  ``.bin``) falls back to :func:`safe_torch_load`.
* :func:`safe_torch_load` is ``torch.load(..., weights_only=True)``: a pickle that asks to
  build anything but tensors and plain containers (e.g. one whose ``__reduce__`` would open
  a file or run a command) is refused with a ``ValueError`` and nothing is executed.

``import attnkit`` does not import this module; ``safetensors`` is imported when first used.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["load_checkpoint", "load_module", "safe_torch_load", "save_checkpoint"]

PathLike = str | os.PathLike


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ImportError("attnkit checkpoints need safetensors: pip install safetensors") from exc
    return safetensors.torch


def safe_torch_load(path: PathLike, *, map_location: str | torch.device = "cpu") -> Any:
    """Load a ``torch.save`` file with ``weights_only=True``.

    Args:
        path: the file.
        map_location: where to put the tensors (``"cpu"`` by default).

    Returns:
        The loaded object (tensors, and dicts/lists/tuples/numbers/strings of them).

    Raises:
        ValueError: the file holds anything that would need code to rebuild; its
            ``__reduce__`` is not run.
        FileNotFoundError: ``path`` does not exist.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise ValueError(
            f"refusing to load {os.fspath(path)!r}: it is not a plain tensor checkpoint "
            "(weights_only=True unpickling rejected it, and no code in it was run). "
            f"Convert trusted files to safetensors. Detail: {first_line}"
        ) from exc


def _as_state_dict(obj: Mapping[str, torch.Tensor] | nn.Module) -> Mapping[str, torch.Tensor]:
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if not isinstance(obj, Mapping):
        raise TypeError(f"expected a state dict or an nn.Module, got {type(obj).__name__}")
    return obj


def save_checkpoint(
    obj: Mapping[str, torch.Tensor] | nn.Module,
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a state dict (or ``obj.state_dict()``) to a ``.safetensors`` file.

    Tensors are moved to CPU and made contiguous; tensors sharing storage (tied weights)
    are written as separate copies, so loading needs no special care.

    Args:
        obj: a mapping of names to tensors, or a module.
        path: the destination, which must end in ``.safetensors``.
        metadata: optional string-to-string metadata stored in the header.

    Returns:
        The path written.

    Raises:
        ValueError: ``path`` does not end in ``.safetensors``.
        TypeError: a key is not a string, a value not a tensor, or metadata not strings.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"checkpoints are written as .safetensors, got path {str(path)!r}")
    state = _as_state_dict(obj)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state dict keys must be strings, got {name!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict value {name!r} is a {type(value).__name__}, not a tensor")
        t = value.detach().to("cpu").contiguous()
        storage = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if storage in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # tied or a view into a larger buffer: give it its own storage
        seen.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        tensors[name] = t
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError("metadata must map strings to strings")
    path.parent.mkdir(parents=True, exist_ok=True)
    _safetensors().save_file(tensors, str(path), metadata=dict(metadata) if metadata else None)
    return path


def load_checkpoint(
    path: PathLike, *, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` (or, safely, from a ``torch.save`` file).

    Args:
        path: a ``.safetensors`` file, or a ``.pt``/``.bin`` file read with
            :func:`safe_torch_load`.
        device: where to put the tensors.

    Returns:
        A dict of names to tensors.

    Raises:
        ValueError: the file is not a valid checkpoint, or a pickle that needs code.
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    if path.suffix == ".safetensors":
        st = _safetensors()
        try:
            return st.load_file(str(path), device=str(device))
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"{str(path)!r} is not a valid safetensors file: {exc}") from exc
    loaded = safe_torch_load(path, map_location=device)
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise ValueError(
            f"{str(path)!r} does not hold a state dict (a mapping of names to tensors)"
        )
    return dict(loaded)


def load_module(module: nn.Module, path: PathLike, *, strict: bool = True) -> nn.Module:
    """Load the checkpoint at ``path`` into ``module`` (on the module's device) and return it.

    Raises:
        RuntimeError: missing or unexpected keys when ``strict`` (from ``load_state_dict``).
    """
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    module.load_state_dict(load_checkpoint(path, device=device), strict=strict)
    return module
