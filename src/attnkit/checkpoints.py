"""Persistence, in one place: every file attnkit writes and reads back.

* :func:`save_checkpoint` / :func:`load_checkpoint` / :func:`load_module`: one state dict as
  a ``.safetensors`` file (plain tensors and string metadata, no code). Tensors that share
  storage (tied weights) are written once and come back as one tensor under both names.
* :func:`safe_torch_load`: ``torch.load(..., weights_only=True)`` with one-line
  ``ValueError``\\ s: a pickle that asks to build anything but tensors and plain containers is
  refused and nothing in it runs; an empty or truncated file is a ``ValueError`` too.
* :func:`write_directory` / :func:`read_directory`: a checkpoint *directory* saved atomically
  as a whole. The files are written into a new sibling directory with a ``manifest.json``
  (names, sizes, SHA-256) written last, then swapped into place (one atomic exchange on
  Linux; two renames elsewhere). A ``kill -9`` at any moment leaves either the old checkpoint
  or the new one, never a mix; :func:`read_directory` checks every file against the manifest
  and refuses a torn directory with :class:`CheckpointError`.

Files are created with the usual permissions (``0666 & ~umask``), never ``0600``.
``import attnkit`` does not import this module; ``safetensors`` is imported when first used.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import pickle
import secrets
import shutil
import sys
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointLockedError",
    "load_checkpoint",
    "load_module",
    "lock_directory",
    "read_directory",
    "safe_torch_load",
    "save_checkpoint",
    "write_directory",
]

PathLike = str | os.PathLike
#: The file written last into a checkpoint directory: names, sizes and hashes of the others.
MANIFEST = "manifest.json"
_MANIFEST_FORMAT = "attnkit-manifest/1"
_TIED_KEY = "attnkit.tied"  # safetensors metadata: {"alias": "kept name"} as JSON


class CheckpointError(ValueError):
    """A missing, incomplete (torn) or corrupt checkpoint."""


class CheckpointLockedError(CheckpointError):
    """Another process holds the checkpoint directory's lock (:func:`lock_directory`)."""


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ImportError("attnkit checkpoints need safetensors: pip install safetensors") from exc
    return safetensors.torch


def _normal_mode(path: Path) -> None:
    """Give ``path`` the permissions a plain ``open`` would (``0666 & ~umask``): some writers,
    safetensors among them, create ``0600`` files."""
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[-1] if text else type(err).__name__


def safe_torch_load(path: PathLike, *, map_location: str | torch.device = "cpu") -> Any:
    """Load a ``torch.save`` file with ``weights_only=True``.

    Args:
        path: the file.
        map_location: where to put the tensors (``"cpu"`` by default).

    Returns:
        The loaded object (tensors, and dicts/lists/tuples/numbers/strings of them).

    Raises:
        ValueError: the file is empty, truncated or not a ``torch.save`` file, or holds anything
            that would need code to rebuild (its ``__reduce__`` is not run). One line.
        FileNotFoundError: ``path`` does not exist.
    """
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"no such file: {name!r}")
    if os.path.getsize(name) == 0:
        raise ValueError(f"{name!r} is empty, not a torch.save file")
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": not the user's concern
            warnings.simplefilter("ignore")
            return torch.load(name, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is paragraphs advising weights_only=False: keep only its reason
        text = str(exc)
        detail = text.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation")[0]
        detail = " ".join(detail.split()) or _first_line(exc)
        raise ValueError(
            f"refusing to load {name!r}: not a plain tensor file (the safe unpickler rejected "
            f"it: {detail}; nothing in it was run). Convert trusted files to safetensors"
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise ValueError(
            f"cannot read {name!r}: truncated or not a torch.save file ({_first_line(exc)})"
        ) from None


def _as_state_dict(obj: Mapping[str, torch.Tensor] | nn.Module) -> Mapping[str, torch.Tensor]:
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if not isinstance(obj, Mapping):
        raise TypeError(f"expected a state dict or an nn.Module, got {type(obj).__name__}")
    return obj


def _dedupe(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """CPU, contiguous tensors, each storage written once; returns ``(tensors, aliases)``."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state dict keys must be strings, got {name!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict value {name!r} is a {type(value).__name__}, not a tensor")
        key = (
            value.device,
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            value.stride(),
            value.dtype,
        )
        if value.numel() > 0 and key in seen:  # tied: the very same view under a second name
            aliases[name] = seen[key]
            continue
        seen[key] = name
        t = value.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view into a larger buffer (or another tensor): its own storage
        tensors[name] = t
    # distinct views that still overlap one storage: safetensors refuses those, so copy them
    by_storage: dict[int, int] = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and by_storage.setdefault(ptr, id(t)) != id(t):
            tensors[name] = t.clone()
    return tensors, aliases


def save_checkpoint(
    obj: Mapping[str, torch.Tensor] | nn.Module,
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a state dict (or ``obj.state_dict()``) to a ``.safetensors`` file.

    Tensors are moved to CPU and made contiguous. Tied weights (the same tensor under two
    names) are written once; :func:`load_checkpoint` gives both names the same tensor back.
    The file is written to a temporary name in the same folder and moved into place.

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
    tensors, aliases = _dedupe(_as_state_dict(obj))
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError("metadata must map strings to strings")
    meta = dict(metadata or {})
    if aliases:
        meta[_TIED_KEY] = json.dumps(aliases, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        _safetensors().save_file(tensors, str(tmp), metadata=meta or None)
        _normal_mode(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _load_safetensors(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    st = _safetensors()
    try:
        tensors = st.load_file(str(path), device=str(device))
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        aliases = json.loads(meta.get(_TIED_KEY, "{}"))
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(
            f"{str(path)!r} is not a valid safetensors file: {_first_line(exc)}"
        ) from None
    if not isinstance(aliases, dict) or not all(
        isinstance(v, str) and v in tensors for v in aliases.values()
    ):
        raise ValueError(f"{str(path)!r} has a corrupt {_TIED_KEY!r} entry")
    for alias, kept in aliases.items():
        tensors[str(alias)] = tensors[kept]
    return tensors


def load_checkpoint(
    path: PathLike, *, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` (or, safely, from a ``torch.save`` file).

    Args:
        path: a ``.safetensors`` file, or a ``.pt``/``.bin`` file read with
            :func:`safe_torch_load`.
        device: where to put the tensors.

    Returns:
        A dict of names to tensors (tied names share one tensor).

    Raises:
        ValueError: the file is not a valid checkpoint, or a pickle that needs code.
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    if path.suffix == ".safetensors":
        return _load_safetensors(path, device)
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


# --- checkpoint directories, atomic as a whole ------------------------------------------------

#: ``name -> bytes`` or ``name -> writer(path)`` for :func:`write_directory`.
FileSource = bytes | Callable[[Path], None]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _stale_siblings(d: Path) -> list[Path]:
    return [
        p for p in d.parent.glob(f".{d.name}.*-*") if p.name.split(".")[-1][:4] in {"new-", "old-"}
    ]


def _carry_over(old: Path, new: Path) -> None:
    """Hard-link (or copy) entries of ``old`` that the new save does not replace into ``new``."""
    for entry in old.iterdir():
        target = new / entry.name
        if target.exists() or (entry.name.startswith(".") and entry.name.endswith(".tmp")):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, copy_function=_link_or_copy, symlinks=True)
        else:
            _link_or_copy(entry, target)


def _link_or_copy(src: Any, dst: Any) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _real_directory(directory: PathLike) -> Path:
    """``directory`` as an absolute path, a symbolic link replaced by its target: the atomic
    exchange must swap the real directory, never the link (which would be replaced by a
    directory, its target left behind)."""
    d = Path(directory).absolute()
    return d.resolve() if d.is_symlink() else d


@contextlib.contextmanager
def lock_directory(directory: PathLike) -> Iterator[Path]:
    """Hold an exclusive lock on the checkpoint directory ``directory`` while in the block.

    The lock is ``flock`` on a file ``.NAME.lock`` beside the directory (a link is resolved
    first, so a link and its target share one lock), removed on leaving the block; after a
    ``kill -9`` the file stays, but the lock went with the process. Two writers of one directory would each remove the
    other's in-progress save as stale: a run that saves there should hold this lock.

    Args:
        directory: the checkpoint directory (it need not exist yet; its parent is created).

    Yields:
        The lock file's path.

    Raises:
        CheckpointLockedError: another process (or another open of the lock) holds it.
    """
    d = _real_directory(directory)
    path = d.parent / f".{d.name}.lock"
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield path
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointLockedError(
                f"{str(d)!r} is in use by another process "
                f"(it holds {str(path)!r}); wait for it to finish or save elsewhere"
            ) from None
        try:  # the holder before us may have removed the file between our open and flock
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # still locked: whoever opens it next makes (and locks) a new file
        os.close(fd)  # releases the lock


def write_directory(directory: PathLike, files: Mapping[str, FileSource]) -> Path:
    """Write ``files`` as the checkpoint directory ``directory``, atomically as a whole.

    The files go into a new sibling directory, then ``manifest.json`` (each file's size and
    SHA-256, written last), then the new directory is swapped with the old one. Other entries
    of an existing directory (pictures, notes) are kept: they are hard-linked into the new
    one before the swap. Temporary directories of an earlier interrupted save are removed.

    A ``directory`` that is a symbolic link is resolved first: the files are saved into the
    link's target (swapped beside it), and the link itself is left as it is.

    Args:
        directory: the checkpoint directory (created, with its parents, if missing), or a
            symbolic link to it.
        files: file name (no folders) to its bytes, or to a function that writes that path.

    Returns:
        The directory written (a link's target, as an absolute path).

    Raises:
        ValueError: a file name with a folder in it, or ``manifest.json`` given as a file.
        NotADirectoryError: ``directory`` exists and is not a directory.
    """
    d = _real_directory(directory)
    for name in files:
        if name == MANIFEST or Path(name).name != name or name.startswith("."):
            raise ValueError(f"bad checkpoint file name {name!r}")
    if d.exists() and not d.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(d))
    d.parent.mkdir(parents=True, exist_ok=True)
    for stale in _stale_siblings(d):
        shutil.rmtree(stale, ignore_errors=True)
    token = secrets.token_hex(4)
    new = d.parent / f".{d.name}.new-{token}"
    new.mkdir()  # normal permissions (0777 & ~umask), unlike mkdtemp's 0700
    try:
        entries = {}
        for name, source in files.items():
            path = new / name
            if isinstance(source, bytes):
                path.write_bytes(source)
            else:
                source(path)
            _normal_mode(path)
            _fsync(path)
            entries[name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        manifest = json.dumps({"format": _MANIFEST_FORMAT, "files": entries}, indent=2)
        (new / MANIFEST).write_text(manifest + "\n")
        _fsync(new / MANIFEST)
        if d.is_dir():
            _carry_over(d, new)
        _fsync(new)
        if not d.exists():
            os.rename(new, d)
        elif _exchange(new, d):
            shutil.rmtree(new)  # now the old directory
        else:  # two renames: a kill in between leaves `.<name>.old-*`, named by read_directory
            old = d.parent / f".{d.name}.old-{token}"
            os.rename(d, old)
            os.rename(new, d)
            shutil.rmtree(old, ignore_errors=True)
        _fsync(d.parent)
    finally:
        if new.exists():
            shutil.rmtree(new, ignore_errors=True)
    return d


def read_directory(directory: PathLike, *, require_manifest: bool = True) -> dict[str, Path]:
    """Check a checkpoint directory against its manifest; return ``{file name: path}``.

    Args:
        directory: a directory written by :func:`write_directory`.
        require_manifest: refuse a directory without ``manifest.json`` (written before
            attnkit kept manifests); when False, such a directory's files are returned unchecked.

    Raises:
        CheckpointError: no such directory, no manifest, or a file missing, resized or changed
            since the manifest was written (a torn save): one line naming the file.
    """
    d = Path(directory)
    if not d.is_dir():
        hint = ""
        if d.name and any(p.name.split(".")[-1].startswith("old-") for p in _stale_siblings(d)):
            hint = "; an interrupted save left the previous one as a hidden '.NAME.old-*' sibling"
        raise CheckpointError(f"no checkpoint directory {str(d)!r}{hint}")
    mpath = d / MANIFEST
    if not mpath.is_file():
        if require_manifest:
            raise CheckpointError(
                f"{str(d)!r} has no {MANIFEST}: not a complete attnkit checkpoint"
            )
        return {p.name: p for p in d.iterdir() if p.is_file()}
    try:
        manifest = json.loads(mpath.read_text())
        entries = manifest["files"]
        if manifest.get("format") != _MANIFEST_FORMAT or not isinstance(entries, dict):
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        expected = {str(n): (int(e["bytes"]), str(e["sha256"])) for n, e in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"corrupt {str(mpath)!r}: {_first_line(err)}") from None
    out = {}
    for name, (size, digest) in expected.items():
        path = d / name
        if Path(name).name != name or not path.is_file():
            raise CheckpointError(f"torn checkpoint {str(d)!r}: {name} is missing")
        if path.stat().st_size != size or _sha256(path) != digest:
            raise CheckpointError(
                f"torn checkpoint {str(d)!r}: {name} does not match {MANIFEST} "
                "(changed after the save, or an interrupted save)"
            )
        out[name] = path
    return out
