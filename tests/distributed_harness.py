"""Run functions on W gloo ranks (127.0.0.1) in spawned processes; collect rank 0's results.

One spawn per world size runs a whole suite of cases on one process group, so the
tests pay for process start-up once. A case is ``fn(rank, world) -> dict``; an
exception becomes ``{"error": "..."}`` (raised symmetrically on every rank, as the
refusals are, so no rank is left waiting). Collectives time out after 60 s rather
than hang, and the parent kills its workers after ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Case = Callable[[int, int], dict[str, Any]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    import importlib

    module, name = suite.rsplit(":", 1)
    cases: dict[str, Case] = getattr(importlib.import_module(module), name)(world)
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}  # per case, for whoever tunes the suite
    results["_seconds"] = seconds
    try:
        for key, fn in cases.items():
            t0 = time.perf_counter()
            try:
                results[key] = fn(rank, world)
            except Exception as err:  # reported to the parent, asserted there
                results[key] = {
                    "error": f"{type(err).__name__}: {err}",
                    "tb": traceback.format_exc(),
                }
            seconds[key] = time.perf_counter() - t0
        if rank == 0:
            torch.save(results, Path(out) / "results.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_suite(suite: str, world: int, timeout: float = 240.0) -> dict[str, Any]:
    """Spawn ``world`` ranks running ``suite`` (``"module:function"``, the function
    mapping ``world`` to ``{name: case}``) and return rank 0's results by case name."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _worker,
            args=(world, free_port(), out, suite),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{suite} on {world} ranks took over {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return torch.load(Path(out) / "results.pt", weights_only=False)
