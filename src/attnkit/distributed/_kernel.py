"""The kernel layer's segment API, as the ring uses it: one merge, shared with blockwise."""

from attnkit.backends.blockwise import (
    SegmentMask,
    merge_partials,
    segment_backward,
    segment_forward,
)

__all__ = ["SegmentMask", "merge_partials", "segment_backward", "segment_forward"]
