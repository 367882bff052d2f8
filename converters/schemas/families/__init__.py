"""Hugging Face model families as data: one module per family, each a
:class:`~converters.schemas.families.base.Family` table (tensors and config rules), and
this registry. Adding a family is adding a module here and its tests; the machinery
(:mod:`.base`, :mod:`.rules`) and the formats do not change.

The order is the preference when a model without a config.json (a Megatron or DCP
source) is written as Hugging Face: the first family that can express it.
"""

from __future__ import annotations

from converters.schemas.families import (
    gemma,
    gpt2,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from converters.schemas.families.base import FEATURES, Family, Problem

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, gpt2.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, phi3.FAMILY,
    gemma.FAMILY, gemma.GEMMA2, gemma.GEMMA3, olmo2.FAMILY, mixtral.FAMILY,
    qwen2_moe.FAMILY, qwen3_moe.FAMILY)}

__all__ = ["FAMILIES", "FEATURES", "Family", "Problem"]
