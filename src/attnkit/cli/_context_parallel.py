"""``attnkit train --context-parallel``: the training command under torchrun, sequences split.

    torchrun --nproc_per_node 2 -m attnkit.cli train --task reverse --out runs/cp --context-parallel

Every rank builds the same model and draws the same batches (same seed); each holds a
shard of every sequence (:mod:`attnkit.train.context_parallel`). Rank 0 prints, draws
the progress bar and writes ``--out``; the other ranks write to a private temporary
directory and print nothing.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from attnkit.cli import CliError

__all__ = ["add_arguments", "context_parallel_trainer"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The context-parallel options of ``attnkit train``."""
    from attnkit.distributed import LAYOUTS, STRATEGIES

    g = p.add_argument_group("context parallelism (launch with torchrun)")
    g.add_argument(
        "--context-parallel",
        action="store_true",
        help="split every sequence across the torchrun ranks (attnkit.distributed)",
    )
    g.add_argument("--cp-strategy", choices=STRATEGIES, default="ring")
    g.add_argument("--cp-layout", choices=LAYOUTS, default="zigzag")


def context_parallel_trainer(args: argparse.Namespace) -> Callable[..., list[float]]:
    """Join torchrun's process group and return a drop-in for :func:`attnkit.train.train`.

    On ranks other than 0, stdout goes to /dev/null and ``args.out`` to a temporary copy.

    Raises:
        CliError: not launched by torchrun.
    """
    import torch.distributed as dist

    from attnkit.distributed import init_process_group
    from attnkit.train.context_parallel import train_context_parallel

    try:
        rank, world = init_process_group("cpu")
    except RuntimeError as err:
        raise CliError(f"--context-parallel: {err}") from None
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        private = tempfile.mkdtemp(prefix=f"attnkit-rank{rank}-")
        atexit.register(shutil.rmtree, private, True)
        if args.resume and os.path.isdir(args.out):
            shutil.copytree(args.out, private, dirs_exist_ok=True)
        args.out = private

    def fit(model: Any, batches: Any, steps: int, **kwargs: Any) -> list[float]:
        heads = model.cfg.n_heads
        if args.cp_strategy == "all_to_all" and heads % world:
            raise CliError(
                f"--cp-strategy all_to_all needs n_heads ({heads}) divisible by the "
                f"{world} ranks; use --cp-strategy ring"
            )
        if model.cfg.drop_rate > 0:
            raise CliError("--context-parallel needs a model without dropout")
        chunks = 2 * world if args.cp_layout == "zigzag" else world

        def checked() -> Any:
            inputs, targets = batches()
            if inputs.shape[1] < chunks:
                raise CliError(
                    f"sequences of {inputs.shape[1]} tokens cannot be split into {chunks} "
                    f"chunks (--cp-layout {args.cp_layout} over {world} ranks)"
                )
            return inputs, targets

        kwargs.setdefault("progress", rank == 0)
        return train_context_parallel(
            model, checked, steps, strategy=args.cp_strategy, layout=args.cp_layout, **kwargs
        )

    print(
        f"context parallel: {world} ranks ({dist.get_backend()}), "
        f"strategy {args.cp_strategy}, layout {args.cp_layout}"
    )
    return fit
