"""DeepSpeed checkpoints.

- :mod:`~converters.deepspeed.zero`: the ZeRO partition rules and the files' structure.
- :mod:`~converters.deepspeed.engine`: an engine's ``global_step*/`` files, stages 0-3 (format ``deepspeed``),
  with HF Trainer layouts and ``--init-optimizer``.
- :mod:`~converters.deepspeed.pipe`: PipelineEngine ``layer_*-model_*`` files (Megatron-DeepSpeed),
  read and written as format ``deepspeed``.
- :mod:`~converters.deepspeed.universal`: ``ds_to_universal`` output (format ``deepspeed-universal``).
"""
