"""Benchmark of generated block masks: building a fully partial block mask, and attending
through it, with the mask_mod generated into the native kernel against stored tiles.

The mask is ``dilated`` (every tile mixed: every third key below the diagonal, and a
striped pattern far above it), so every tile of a stored mask holds a 128 x 128 bool tile.
For ``create_block_mask`` at T=16,384 (B=H=None, 128 x 128 tiles): seconds (best of
``reps``) and the bytes the block mask holds, generated (``create_block_mask(mod, ...)``:
tile kinds and indices only, O(tiles)) and stored (``generated=False``: also every partial
tile, O(partial tiles x 128^2)). Then the native forward at T=4,096 (B=1, H=4, d=64,
fp32) through either mask, once per build this CPU runs. Run with
``python -m attnkit.bench.block_masks`` (``--quick``: toy sizes, not graded).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from attnkit import attention
from attnkit.backends.blockwise.native import build
from attnkit.bench.auto_grid import env
from attnkit.bench.native_kernel import _best
from attnkit.block_mask import BlockMask, create_block_mask


def dilated(b, h, q_idx, kv_idx):
    """A mask whose every 128 x 128 tile is PARTIAL."""
    below = ((q_idx - kv_idx) % 3 == 0) & (kv_idx <= q_idx)
    return below | (((q_idx // 7) % 2 == (kv_idx // 5) % 2) & (kv_idx > q_idx + 40))


def held_bytes(bm: BlockMask) -> int:
    """Bytes a block mask holds: kinds, tile indices and its stored tiles (if any)."""
    tiles = bm.partial_masks.nbytes if bm.stored else 0
    return bm.block_kind.nbytes + bm.partial_index.nbytes + tiles


def build_row(t: int, reps: int) -> dict:
    """``{"generated" | "stored": {"seconds", "bytes", "partial_tiles"}}`` of building the
    mask at ``t`` (best of ``reps``)."""
    out = {}
    for name, generated in (("generated", True), ("stored", False)):
        best, bm = float("inf"), None
        for _ in range(reps):
            start = time.perf_counter()
            bm = create_block_mask(dilated, None, None, t, t, generated=generated)
            best = min(best, time.perf_counter() - start)
        assert bm is not None
        out[name] = {
            "seconds": best,
            "bytes": held_bytes(bm),
            "partial_tiles": int((bm.block_kind == 1).sum()),
        }
    return out


def forward_row(t: int, reps: int) -> dict:
    """Forward seconds through the generated and the stored mask, per build."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, t, 64, generator=g) for _ in range(3))
    masks = {
        "generated": create_block_mask(dilated, None, None, t, t),
        "stored": create_block_mask(dilated, None, None, t, t, generated=False),
    }

    def step(bm: BlockMask) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return attention(q, k, v, block_mask=bm, backend="blockwise")

        return run

    out: dict = {}
    for isa in build.host_isas():
        with env(ATTNKIT_NATIVE_ISA=isa, ATTNKIT_NATIVE_SPEED=None):
            if build.library() is None:
                continue
            times = _best({name: step(bm) for name, bm in masks.items()}, reps)
            out[isa] = {**times, "generated / stored": times["generated"] / times["stored"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes: seconds, not graded")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds per case")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    t_build, t_fwd = (2048, 512) if args.quick else (16384, 4096)
    built = build_row(t_build, args.reps)
    print(f"create_block_mask(dilated), T={t_build}, 128 x 128 tiles:")
    for name, r in built.items():
        print(
            f"  {name:9s} {r['seconds'] * 1e3:8.1f} ms  {r['bytes'] / 2**20:8.2f} MiB held  "
            f"({r['partial_tiles']} partial tiles)"
        )
    print(f"native forward through the mask, T={t_fwd}, B=1, H=4, d=64, fp32:")
    for isa, r in forward_row(t_fwd, args.reps).items():
        print(
            f"  {isa:12s} generated {r['generated'] * 1e3:7.1f} ms  stored "
            f"{r['stored'] * 1e3:7.1f} ms  ({r['generated / stored']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
