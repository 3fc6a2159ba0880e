"""Process groups and point-to-point traffic: the only place that talks to torch.distributed.

Every function takes ``group=`` (None = the default world group) and reads the rank
and size from it, never from globals of its own. :func:`record_traffic` counts the
messages and bytes the ring sends (a test checks them; the benchmark reports them).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "Message",
    "Traffic",
    "backend_for",
    "global_rank",
    "init_process_group",
    "rank_and_size",
    "record_collective",
    "record_traffic",
]

Group = dist.ProcessGroup | None


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for tensors on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(device: torch.device | str = "cpu") -> tuple[int, int]:
    """Join the world group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).

    Picks the backend with :func:`backend_for`; for CUDA it also selects the GPU
    ``LOCAL_RANK``. A no-op when a default group exists already.

    Returns:
        ``(rank, world_size)`` of the world group.

    Raises:
        RuntimeError: not launched by torchrun (no ``RANK``/``WORLD_SIZE`` in the environment).
    """
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    if not dist.is_initialized():
        missing = [
            v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"no process group: launch with torchrun (environment lacks {', '.join(missing)})"
            )
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend_for(device))
    return dist.get_rank(), dist.get_world_size()


def rank_and_size(group: Group = None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size.

    Raises:
        RuntimeError: no process group has been initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "attnkit.distributed needs an initialised process group "
            "(torch.distributed.init_process_group, or attnkit.distributed.init_process_group "
            "under torchrun)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: Group, rank: int) -> int:
    """The world rank of ``group``'s member ``rank`` (what point-to-point calls take)."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


# ---------------------------------------------------------------------------------------
# Traffic accounting
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One send: what (``"kv"``, ``"dkv"``; ``"a2a"`` for an all-to-all, peer -1), the
    pass, the ring step, the peer, the bytes, and which K/V piece it carries (the ring
    circulates its shards in pieces: :mod:`attnkit.distributed.ring`)."""

    kind: str
    phase: str  # "forward" / "backward"
    step: int
    peer: int
    nbytes: int
    piece: int = 0


@dataclass
class Traffic:
    """The messages this process sent while recording (see :func:`record_traffic`)."""

    messages: list[Message] = field(default_factory=list)

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        """Number of messages, optionally of one kind and/or phase."""
        return len(self.select(kind, phase))

    def nbytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes sent, optionally of one kind and/or phase."""
        return sum(m.nbytes for m in self.select(kind, phase))

    def select(self, kind: str | None = None, phase: str | None = None) -> list[Message]:
        return [
            m
            for m in self.messages
            if (kind is None or m.kind == kind) and (phase is None or m.phase == phase)
        ]


_TRAFFIC: contextvars.ContextVar[Traffic | None] = contextvars.ContextVar(
    "attnkit_traffic", default=None
)


@contextlib.contextmanager
def record_traffic() -> Iterator[Traffic]:
    """Record every message the ring sends from this process inside the ``with`` block."""
    log = Traffic()
    token = _TRAFFIC.set(log)
    try:
        yield log
    finally:
        _TRAFFIC.reset(token)


def record_collective(kind: str, phase: str, nbytes: int) -> None:
    """Record ``nbytes`` this process sends in a collective (``peer`` -1: every rank);
    a no-op outside :func:`record_traffic`."""
    log = _TRAFFIC.get()
    if log is not None:
        log.messages.append(Message(kind, phase, 0, -1, nbytes))


def exchange(
    sends: Sequence[tuple[tuple[torch.Tensor, ...], int, str]],
    recvs: Sequence[tuple[tuple[torch.Tensor, ...], int, str]],
    *,
    group: Group,
    phase: str,
    step: int,
    piece: int = 0,
) -> list[dist.Work]:
    """Post sends and receives ``(tensors, group_peer, kind)`` with ``batch_isend_irecv``.

    One item is one message (a K/V piece is its K and its V, sent as two tensors with
    their own tags, so no packing copy is made). Returns the pending works (empty when
    there is nothing to do); the caller waits. Sends are recorded by
    :func:`record_traffic`.
    """
    ops = []
    log = _TRAFFIC.get()
    for tensors, peer, kind in sends:
        for i, tensor in enumerate(tensors):
            ops.append(
                dist.P2POp(dist.isend, tensor, global_rank(group, peer), group, _TAGS[kind] + i)
            )
        if log is not None:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            log.messages.append(Message(kind, phase, step, peer, nbytes, piece))
    for tensors, peer, kind in recvs:
        for i, tensor in enumerate(tensors):
            ops.append(
                dist.P2POp(dist.irecv, tensor, global_rank(group, peer), group, _TAGS[kind] + i)
            )
    if not ops:
        return []
    return list(dist.batch_isend_irecv(ops))


_TAGS = {"kv": 10, "dkv": 20}  # + the tensor's index in its message


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a local group of spawned processes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
