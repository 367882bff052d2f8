"""Test harnesses: real peers (megatron-core, DeepSpeed, transformers) run on CPU to write
the checkpoints the tests read, and to load what ckptool writes; plus the helpers that more
than one test file needs.

Harnesses, one per peer and checkpoint kind:

- :mod:`tests.harness.mcore`: megatron-core ``GPTModel`` (local spec, gloo) at any TP/PP:
  Megatron-LM's legacy layout (``model_optim_rng.pt``) saved and loaded back with a real
  pipelined forward, ``torch_dist`` (``dist_checkpointing``) with mcore's own non-distributed
  optimizer, and ckptool's training hook on a real mcore model.
- :mod:`tests.harness.mcore_distopt`: megatron-core's distributed optimizer
  (``DistributedDataParallel(use_distributed_optimizer=True)``) saved in the legacy layout
  (``distrib_optim.pt``), its per-process shards as the truth, and the canonical view of
  those shards joined by hand.
- :mod:`tests.harness.mcore_distopt_torch_dist`: the same distributed optimizer saved and
  resumed through megatron-core's ``torch_dist`` checkpointing (``dist_checkpointing``).
- :mod:`tests.harness.deepspeed_engine`: DeepSpeed engines (``deepspeed.initialize``):
  ZeRO-0/1/2/3 runs of a tiny model saved and loaded at another DP size, Hugging Face models
  trained under DeepSpeed (HF Trainer layout), and the GPTModelPipe-shaped
  ``PipelineModule`` of Megatron-DeepSpeed pipeline checkpoints.
- :mod:`tests.harness.deepspeed_pipe`: DeepSpeed ``PipelineEngine`` runs saved at one
  pipeline size and loaded at another (TP1).
- :mod:`tests.harness.deepspeed_pipe_tp`: those ``PipelineEngine`` runs made
  tensor-parallel (TP > 1) as Megatron's legacy layers split them, for loading ckptool's
  TP reshards.
- :mod:`tests.harness.deepspeed_universal`: DeepSpeed's universal checkpoints
  (``load_universal``) and its own ``ds_to_universal.py``, for comparison.

Shared helpers:

- :mod:`tests.harness.hf`: transformers loads a Hugging Face checkpoint strictly; logits.
- :mod:`tests.harness.damage`: byte-level damage to checkpoint files (a flipped bit, a
  truncated or overwritten file).

The fixtures and readers that nearly every test file uses stay in ``tests/conftest.py``
(``run_cli``, ``make_ckpt``, ``full_tensor``, ``assembled``, ``convert_to_torch``, ``spawn``).

Worker functions are pickled by module path for the spawned processes
(``tests.conftest.spawn``), so they live at module level here. Each harness imports its
peer (``deepspeed``, ``megatron.core``) inside its functions, on purpose: the harness
modules import without the peer, so a test module can import them and still skip where
the peer is missing (``tests.conftest.peer``).
"""
