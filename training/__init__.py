"""The in-training save hook: ``AsyncCheckpointer`` (asynchronous, atomic, checksummed DCP).

``training.megatron.sharded_state`` and ``training.deepspeed.sharded_state`` describe a
Megatron-style TP/PP model or a DeepSpeed ZeRO-1/2/3 engine in the shared global layout
(``training.deepspeed.restore`` puts the loaded engine counters and LR schedule back).
``examples/train_tiny.py`` is a real TP x PP x DP trainer built on them.
"""

from training.async_checkpointer import AsyncCheckpointer

__all__ = ["AsyncCheckpointer"]
