"""Context parallelism: one sequence split across processes (and machines).

Built on torch.distributed only (process groups, ``batch_isend_irecv``,
``all_to_all_single``, ``all_gather``), launched by torchrun. Every function takes
``group=`` (None = the default world group).

* :func:`shard` / :func:`unshard`: this rank's part of a sequence and back
  (:mod:`~attnkit.distributed.layout`: ``"zigzag"`` or ``"contiguous"``);
* :func:`context_parallel_attention`: exact attention over the split sequence, by a
  ring of K/V pieces (:mod:`~attnkit.distributed.ring`) or by re-sharding to heads
  (:mod:`~attnkit.distributed.all_to_all`), forward and backward;
* :func:`init_process_group`: join torchrun's group, NCCL for CUDA and gloo for CPU.
"""

from attnkit.distributed.comm import (
    Traffic,
    backend_for,
    init_process_group,
    rank_and_size,
    record_traffic,
)
from attnkit.distributed.context_parallel import STRATEGIES, context_parallel_attention
from attnkit.distributed.layout import LAYOUTS, Layout, shard, unshard

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "Layout",
    "Traffic",
    "backend_for",
    "context_parallel_attention",
    "init_process_group",
    "rank_and_size",
    "record_traffic",
    "shard",
    "unshard",
]
