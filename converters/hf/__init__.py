"""Hugging Face checkpoints: ``config.json`` and safetensors (format ``hf``).

- :mod:`~converters.hf.format`: the reader, and the writer of a model with a family table
  (:mod:`converters.schemas.families`, through :mod:`converters.schemas.hf`).
- :mod:`~converters.hf.stored`: the writer for an architecture without a table (a DeepSpeed
  run of one): names and config.json kept, as ``zero_to_fp32`` gives them. A registered
  variant of ``hf`` (``converters.VARIANTS``), picked by the source.
"""
