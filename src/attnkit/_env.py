"""Environment variables read on every call (the lanes' keys, the build a call uses).

``os.environ.get`` encodes the name, looks it up and, for the usual unset variable,
raises and catches a ``KeyError``: about 0.5 us a read, and 5-6 us once a long kernel
call has pushed the interpreter's data out of the caches (two reads, measured on the
Xeon of session 30 after a 40 MB sum: 11.2 us against 2.5 for two dictionary lookups).
A decode step's lane reads three. On POSIX, ``os.environ`` keeps its variables in a
dictionary of bytes that every change through ``os.environ`` (``monkeypatch.setenv``
included) updates with the process's environment; :func:`get` looks the name up there.
Elsewhere it is ``os.environ.get``.
"""

from __future__ import annotations

import os

__all__ = ["get"]

# (CPython's os._Environ on POSIX: bytes names to bytes values, as os.environb reads)
_DATA: dict | None = getattr(os.environ, "_data", None) if os.name == "posix" else None
_NAMES: dict[str, bytes] = {}  # name -> its bytes


def get(name: str) -> str | None:
    """``os.environ.get(name)``, faster where the names are few and mostly unset."""
    if _DATA is None:
        return os.environ.get(name)
    raw = _NAMES.get(name)
    if raw is None:
        raw = _NAMES[name] = os.fsencode(name)
    value = _DATA.get(raw)
    return None if value is None else os.fsdecode(value)
