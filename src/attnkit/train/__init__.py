"""Training the tiny GPT: synthetic tasks, byte-level text, a loop with a progress bar,
atomic safetensors checkpoints, and the demo's reverse-task section."""

from attnkit.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from attnkit.train.data import TASKS, ByteTokenizer, CharTokenizer, TaskData, TextData
from attnkit.train.demo import demo_section
from attnkit.train.loop import evaluate_task, train

__all__ = [
    "TASKS",
    "ByteTokenizer",
    "CharTokenizer",
    "CheckpointError",
    "TaskData",
    "TextData",
    "demo_section",
    "evaluate_task",
    "load_checkpoint",
    "save_checkpoint",
    "train",
]
