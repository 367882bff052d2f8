"""Model schemas shared by the frameworks: what each family's tensors and config mean
in the canonical (Megatron-Core) view. Not formats; they import only the core.

- :mod:`converters.schemas.hf`: Hugging Face names and ``config.json``; the families as data in
  :mod:`converters.schemas.families` (one table per family).
- :mod:`converters.schemas.megatron`: Megatron's name schemas and run-root layout.
- :mod:`converters.schemas.megatron_args`: Megatron ``args`` <-> the model.
- :mod:`converters.schemas.megatron_ranks`: a Megatron rank file's tensors as regions.
"""
