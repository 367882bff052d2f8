"""DeepSpeed checkpoints.

- :mod:`~converters.deepspeed.zero`: the ZeRO partition rules and the files' structure.
- :mod:`~converters.deepspeed.engine`: an engine's ``global_step*/`` files, stages 0-3 (format ``deepspeed``),
  with HF Trainer layouts.
- :mod:`~converters.deepspeed.pipe`: PipelineEngine ``layer_*-model_*`` files (Megatron-DeepSpeed),
  read and written as format ``deepspeed``.
- :mod:`~converters.deepspeed.from_hf`: a Hugging Face model written as an engine's files
  (format ``deepspeed``), with ``--init-optimizer``'s fresh state.

The ``deepspeed`` format has three writers, registered as variants (``converters.VARIANTS``)
and picked by the source: ``pipe``'s for a pipeline, ``from_hf``'s for an HF model,
``engine``'s for an engine.
- :mod:`~converters.deepspeed.universal`: ``ds_to_universal`` output (format ``deepspeed-universal``).
"""
