"""Language models built on attnkit's attention: :class:`GPT`, its :class:`GPTConfig`,
the LLM attention layers (:class:`CausalSelfAttention`, :class:`MultiHeadLatentAttention`)
and their :class:`KVCache`."""

from attnkit.kv_cache import KVCache
from attnkit.models.attention import AttentionInputs, CausalSelfAttention
from attnkit.models.config import GPTConfig
from attnkit.models.gpt import GPT, TransformerBlock
from attnkit.models.mla import MultiHeadLatentAttention

__all__ = [
    "GPT",
    "AttentionInputs",
    "CausalSelfAttention",
    "GPTConfig",
    "KVCache",
    "MultiHeadLatentAttention",
    "TransformerBlock",
]
