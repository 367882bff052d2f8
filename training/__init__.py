"""The in-training save hook: ``AsyncCheckpointer`` (asynchronous, atomic, checksummed DCP).

The Megatron/DeepSpeed adapters and the tiny TP x PP trainer are still to come (issue #4).
"""

from training.async_checkpointer import AsyncCheckpointer

__all__ = ["AsyncCheckpointer"]
