"""Language models built on attnkit's attention: :class:`GPT` and its :class:`GPTConfig`."""

from attnkit.models.gpt import GPT, GPTConfig, TransformerBlock

__all__ = ["GPT", "GPTConfig", "TransformerBlock"]
