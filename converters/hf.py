"""Hugging Face checkpoints: ``config.json`` + ``model.safetensors``, or sharded
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``.
"""

from __future__ import annotations

from ckptool.core.index import Reader
from ckptool.core.storage import Store

NAME = "hf"
CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")


class HfReader(Reader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        return store.exists(CONFIG) and any(store.exists(f) for f in WEIGHT_FILES)

    def read_index(self, store):
        from converters import not_yet

        not_yet(NAME, 6)
