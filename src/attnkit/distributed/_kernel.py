"""The kernel layer's segment API, as the ring uses it: one merge, shared with blockwise."""

from attnkit.backends.blockwise import (
    SegmentMask,
    merge_partials,
    segment_backward,
    segment_forward,
)
from attnkit.backends.blockwise.plan import acc_dtype

__all__ = ["SegmentMask", "acc_dtype", "merge_partials", "segment_backward", "segment_forward"]
