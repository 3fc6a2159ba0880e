"""attnkit: attention mechanisms for PyTorch, from the first dot product to fast kernels.

The functional core is :func:`attention`; the seed tutorial's modules
(:class:`SimplifiedSelfAttention` ... :class:`MultiHeadAttention`) all compute
through it. Masks follow one convention, documented in :mod:`attnkit.masks`.
"""

from attnkit import backends, masks, trace
from attnkit.attention import attention, explain_dispatch
from attnkit.backends import available_backends, register_backend
from attnkit.block_mask import BlockMask, create_block_mask
from attnkit.cascade import cascade_attention
from attnkit.document_mask import document_block_mask
from attnkit.kv_cache import KVCache
from attnkit.masks import causal_mask
from attnkit.modules import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
    SimplifiedSelfAttention,
    load_seed_state_dict,
)
from attnkit.paged_attention import paged_attention
from attnkit.paged_kv_cache import PagedKVCache
from attnkit.tree import DraftTree, build_tree, tree_attention

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "CausalAttention",
    "DraftTree",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "PagedKVCache",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "SimplifiedSelfAttention",
    "__version__",
    "attention",
    "available_backends",
    "backends",
    "build_tree",
    "cascade_attention",
    "causal_mask",
    "create_block_mask",
    "document_block_mask",
    "explain_dispatch",
    "load_seed_state_dict",
    "masks",
    "paged_attention",
    "register_backend",
    "trace",
    "tree_attention",
]
