"""Context-parallel benchmark: memory per rank, bytes on the wire, step time.

Run: ``python -m attnkit.bench.context_parallel [--seq-len 32768] [--time-seq-len 16384]``.
It spawns its own gloo ranks on 127.0.0.1 (no torchrun needed); every number is a
ratio measured in this run. Causal attention, float32, ``(1, heads, T, head_dim)``,
forward + backward, zigzag layout.

* **memory**: peak RSS of each rank (``VmHWM``) minus its RSS before the inputs exist
  (inputs, outputs and gradients included), each configuration in fresh processes with
  ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors leave the RSS at once, so the peak is
  the live peak); reported as the largest rank's over one process's (goal <= 0.55 at W = 2).
* **bytes**: K/V bytes each rank sends per pass (:func:`attnkit.distributed.record_traffic`)
  over the ring's theoretical ``(W-1)/W * (|K| + |V|)`` = ``2(W-1)/W * |K|``.
* **time**: one fwd+bwd step with W = 2 ranks of 1 thread each vs one process of
  2 threads, alternated (round-robin) ``--repeats`` times; the median ratio. These
  runs keep glibc's default allocator settings: the memory runs' low mmap threshold
  makes every freed temporary's pages fault in anew on the next allocation (it charged
  the ring's many tile-sized temporaries about 20% more time). On a machine of 2
  shared cores the ring cannot win on time: it does the same work plus the messages;
  it wins on memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnkit.bench.report import check_output

__all__ = ["main", "run"]


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")


def _inputs(t: int, heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, t, head_dim, generator=g) for _ in range(4))


def _step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gout: torch.Tensor, world: int, strategy: str
) -> dict[str, Any]:
    """One fwd+bwd on this process's part; returns seconds and traffic."""
    from attnkit import attention
    from attnkit.distributed import context_parallel_attention, record_traffic

    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    t0 = time.perf_counter()
    with record_traffic() as log:
        if world == 1:
            out = attention(q, k, v, causal=True)
        else:
            out = context_parallel_attention(q, k, v, causal=True, strategy=strategy)  # type: ignore[assignment]
        out.backward(gout)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "kv_forward": log.nbytes("kv", "forward"),
        "kv_backward": log.nbytes("kv", "backward"),
        "dkv": log.nbytes("dkv"),
        "a2a_forward": log.nbytes("a2a", "forward"),
        "a2a_backward": log.nbytes("a2a", "backward"),
    }


def _worker(rank: int, world: int, port: int, job: dict[str, Any], out: str) -> None:
    torch.set_num_threads(job["threads"])
    if world > 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from attnkit.distributed import shard

    t, heads, d = job["t"], job["heads"], job["head_dim"]
    if world > 1:  # warm the process group and the kernels on a small problem
        sq, sk, sv, sg = (shard(x, 2) for x in _inputs(8 * world, heads, d))
        _step(sq, sk, sv, sg, world, job["strategy"])
    else:
        wq, wk, wv, wg = _inputs(16, heads, d)
        _step(wq, wk, wv, wg, 1, "ring")
    base = _rss_mb("VmRSS")
    full = _inputs(t, heads, d)
    parts = [shard(x, 2).clone() for x in full] if world > 1 else list(full)
    del full  # a rank keeps its shard only
    _reset_peak()  # the peak from here on starts at the RSS with the inputs
    res = _step(parts[0], parts[1], parts[2], parts[3], world, job["strategy"])
    res["peak_mb"] = _rss_mb("VmHWM") - base
    res["rank"] = rank
    results: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(results, res)
        dist.destroy_process_group()
    else:
        results = [res]
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _launch(
    world: int, job: dict[str, Any], mmap_threshold: int | None = 65536
) -> list[dict[str, Any]]:
    """Run ``job`` on ``world`` fresh processes; ``mmap_threshold`` is glibc's
    ``MALLOC_MMAP_THRESHOLD_`` for them (None: glibc's default, for the time runs)."""
    from attnkit.distributed.comm import free_port

    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold is not None:  # read by glibc when a child starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "out.json")
            mp.start_processes(
                _worker, args=(world, free_port(), job, out), nprocs=world, start_method="spawn"
            )
            return json.loads(Path(out).read_text())
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def run(
    seq_len: int = 32768,
    time_seq_len: int = 16384,
    heads: int = 2,
    head_dim: int = 64,
    repeats: int = 3,
    strategy: str = "ring",
) -> dict[str, Any]:
    """Measure memory, bytes and time (see the module docs); returns the numbers."""
    shape = {"heads": heads, "head_dim": head_dim, "strategy": strategy}
    report: dict[str, Any] = {"shape": shape, "seq_len": seq_len, "time_seq_len": time_seq_len}
    one = _launch(1, {**shape, "t": seq_len, "threads": 1})[0]
    two = _launch(2, {**shape, "t": seq_len, "threads": 1})
    kv_bytes = 2 * heads * seq_len * head_dim * 4  # |K| + |V|, float32
    theory = (2 - 1) / 2 * kv_bytes
    report["memory"] = {
        "one_process_mb": one["peak_mb"],
        "per_rank_mb": [r["peak_mb"] for r in two],
        "ratio": max(r["peak_mb"] for r in two) / one["peak_mb"],
    }
    if strategy == "all_to_all":
        # Ulysses: q, k, v out (sequence -> heads) and the output back, (W-1)/W of a shard each
        theory = 4 * (2 - 1) / 2 * kv_bytes / 2 / 2
        report["bytes"] = {
            "theory_per_pass": theory,
            "forward_per_rank": [r["a2a_forward"] for r in two],
            "forward_ratio": max(r["a2a_forward"] for r in two) / theory,
            "backward_per_rank": [r["a2a_backward"] for r in two],
        }
    else:
        report["bytes"] = {
            "theory_per_pass": theory,
            "forward_per_rank": [r["kv_forward"] for r in two],
            "forward_ratio": max(r["kv_forward"] for r in two) / theory,
            "backward_kv_per_rank": [r["kv_backward"] for r in two],
            "backward_dkv_per_rank": [r["dkv"] for r in two],
        }
    one_t, two_t = [], []
    for _ in range(repeats):  # round-robin: the two configurations alternate
        single = _launch(1, {**shape, "t": time_seq_len, "threads": 2}, mmap_threshold=None)
        one_t.append(single[0]["seconds"])
        ranks = _launch(2, {**shape, "t": time_seq_len, "threads": 1}, mmap_threshold=None)
        two_t.append(max(r["seconds"] for r in ranks))
    report["time"] = {
        "one_process_2_threads_s": one_t,
        "two_ranks_1_thread_s": two_t,
        "ratio_median": statistics.median(b / a for a, b in zip(one_t, two_t, strict=True)),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--time-seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--strategy", choices=["ring", "all_to_all"], default="ring")
    p.add_argument("--json", metavar="FILE", help="also write the numbers here")
    args = p.parse_args(argv)
    check_output(p, "--json", args.json)
    report = run(
        args.seq_len, args.time_seq_len, args.heads, args.head_dim, args.repeats, args.strategy
    )
    mem, byt, tim = report["memory"], report["bytes"], report["time"]
    print(f"causal fwd+bwd, (1, {args.heads}, T, {args.head_dim}) float32, zigzag, {args.strategy}")
    print(
        f"memory   T={args.seq_len}: one process {mem['one_process_mb']:.0f} MB, "
        f"W=2 ranks {', '.join(f'{m:.0f}' for m in mem['per_rank_mb'])} MB -> "
        f"ratio {mem['ratio']:.2f} (goal <= 0.55)"
    )
    if args.strategy == "all_to_all":
        print(
            f"bytes    forward all-to-all per rank {byt['forward_per_rank']} vs theory "
            f"(W-1)/W * (|q|+|k|+|v|+|out|)/W = {byt['theory_per_pass']:.0f} -> ratio "
            f"{byt['forward_ratio']:.2f}; backward {byt['backward_per_rank']}"
        )
    else:
        print(
            f"bytes    forward K/V per rank {byt['forward_per_rank']} vs theory "
            f"{byt['theory_per_pass']:.0f} -> ratio {byt['forward_ratio']:.2f}; backward K/V "
            f"{byt['backward_kv_per_rank']}, dK/dV {byt['backward_dkv_per_rank']}"
        )
    print(
        f"time     T={args.time_seq_len}: W=2 x 1 thread / W=1 x 2 threads = "
        f"{tim['ratio_median']:.2f} (median of {args.repeats}; one {tim['one_process_2_threads_s']}, "
        f"two {tim['two_ranks_1_thread_s']})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
