"""Hugging Face checkpoints: ``config.json`` and safetensors (format ``hf``), in
:mod:`~converters.hf.format`; the name and config schema is :mod:`converters.schemas.hf`.
"""
