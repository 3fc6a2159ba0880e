"""Generated mod modules: written once per graph into a private cache directory, imported,
and handed to the kernels.

``@triton.jit`` reads a function's source from its file, so :func:`compile_mods` writes
:func:`.codegen.module_source` to ``<cache>/triton/mod_<hash>.py`` (the cache directory
of the native kernel, :func:`attnkit.backends.blockwise.native.build.cache_dir`, used
only when it is this user's and writable by nobody else; else a private temporary
directory of the process), named by the SHA-256 of the source, written atomically, and
executed only after its bytes are read back equal to the source. Modules are kept per
source hash for the process: a graph traced again (a new step, the same mod) reuses
them; the packed captured values (:func:`packed`) are kept per graph and device.
"""

from __future__ import annotations

import atexit
import hashlib
import shutil
import sys
import tempfile
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnkit.backends.triton import codegen
from attnkit.mod_graph import ModGraph

__all__ = ["CompiledMod", "compile_mods", "packed"]


@dataclass(eq=False)
class CompiledMod:
    """The generated functions for one call's score graph and mask graph."""

    score: ModGraph | None
    mask: ModGraph | None
    layout: codegen.Layout
    module: types.ModuleType
    path: Path
    grad_slots: tuple[int, ...]  # the score graph's captured tensors that get a gradient

    @property
    def score_fn(self) -> Any:
        return getattr(self.module, "score_mod", None)

    @property
    def grads_fn(self) -> Any:
        return getattr(self.module, "score_grads", None)

    @property
    def mask_fn(self) -> Any:
        return getattr(self.module, "mask_mod", None)


_MODULES: dict[str, tuple[types.ModuleType, Path]] = {}
_PACKED: weakref.WeakKeyDictionary[CompiledMod, dict[str, tuple[torch.Tensor, torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)
_COMPILED: weakref.WeakKeyDictionary[ModGraph, dict[Any, CompiledMod]] = weakref.WeakKeyDictionary()
_fallback_dir: list[Path] = []


def _directory() -> Path:
    """The private directory generated modules go to (see the module docs)."""
    from attnkit.backends.blockwise.native import build

    path = build.cache_dir() / "triton"
    if build._private_dir(path) is None:
        return path
    if not _fallback_dir:
        tmp = Path(tempfile.mkdtemp(prefix="attnkit-triton-"))
        atexit.register(shutil.rmtree, tmp, True)
        _fallback_dir.append(tmp)
    return _fallback_dir[0]


def _load_source(source: str) -> tuple[types.ModuleType, Path]:
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    hit = _MODULES.get(digest)
    if hit is not None:
        return hit
    from attnkit.backends.blockwise.native import build

    path = _directory() / f"mod_{digest}.py"
    if not path.is_file() or path.read_text() != source:
        build._write_atomic(path, source)
    if path.read_text() != source:  # pragma: no cover - someone else wrote it just now
        raise RuntimeError(f"generated Triton module {path} changed under us")
    name = f"attnkit_triton_mod_{digest}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # triton's source lookup finds the module by name
    exec(compile(source, str(path), "exec"), module.__dict__)
    _MODULES[digest] = (module, path)
    return module, path


def compile_mods(score: ModGraph | None, mask: ModGraph | None) -> CompiledMod:
    """The generated functions for ``score`` and/or ``mask`` (cached per graph pair and the
    captured tensors that require grad now)."""
    grad_slots = tuple(score.grad_slots()) if score is not None else ()
    anchor = score if score is not None else mask
    if anchor is None:
        raise ValueError("compile_mods needs a score graph or a mask graph")
    key = (id(mask) if anchor is score else None, grad_slots)
    per = _COMPILED.setdefault(anchor, {})
    hit = per.get(key)
    if hit is not None and hit.mask is mask:
        return hit
    lay = codegen.layout((score, mask))
    module, path = _load_source(codegen.module_source(score, mask, lay))
    out = CompiledMod(score, mask, lay, module, path, grad_slots)
    per[key] = out
    return out


def packed(cm: CompiledMod, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CF, CI)``: the captured values packed for the kernels (once per device)."""
    per = _PACKED.setdefault(cm, {})
    key = str(device)
    if key not in per:
        per[key] = _pack((cm.score, cm.mask), cm.layout, device)
    return per[key]


def _pack(
    graphs: Sequence[ModGraph | None], lay: codegen.Layout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CF float32, CI int32)``: the captured tensors' values, packed as ``lay`` says
    (each at least one element long: the kernels take a valid pointer)."""
    fl: list[torch.Tensor] = [torch.zeros(1, device=device)]
    il: list[torch.Tensor] = [torch.zeros(1, dtype=torch.int32, device=device)]
    for g in graphs:
        for t in g.tensors if g is not None else ():
            flat = t.detach().reshape(-1).to(device)
            if t.is_floating_point():
                fl.insert(-1, flat.float())
            else:
                il.insert(-1, flat.to(torch.int32))
    return torch.cat(fl), torch.cat(il)
