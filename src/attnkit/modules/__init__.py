"""The seed tutorial's attention modules, each computing through :func:`attnkit.attention`."""

from attnkit.modules.causal import CausalAttention
from attnkit.modules.interop import from_torch_mha, load_seed_state_dict, to_torch_mha
from attnkit.modules.multihead import MultiHeadAttention, MultiHeadAttentionWrapper
from attnkit.modules.self_attention import SelfAttentionV1, SelfAttentionV2
from attnkit.modules.simplified import SimplifiedSelfAttention

__all__ = [
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "SimplifiedSelfAttention",
    "from_torch_mha",
    "load_seed_state_dict",
    "to_torch_mha",
]
