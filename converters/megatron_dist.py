"""Megatron-Core distributed checkpoints: ``metadata.json`` + ``common.pt`` + a backend.

The ``torch_dist`` backend is DCP with layers stacked on a leading axis; the older
``zarr`` backend has one zarr array per ShardedTensor key. A run root holds
``latest_checkpointed_iteration.txt`` and ``iter_*`` directories, as in legacy Megatron.
"""

from __future__ import annotations

import json

from ckptool.core.index import Reader
from ckptool.core.storage import Store
from converters.megatron_common import tracked_dir

NAME = "megatron-dist"
METADATA_JSON = "metadata.json"


def _is_dist_dir(store: Store, rel: str = "") -> bool:
    path = f"{rel}/{METADATA_JSON}" if rel else METADATA_JSON
    if not store.exists(path):
        return False
    try:
        meta = json.loads(store.read_bytes(path))
    except ValueError:
        return False
    return isinstance(meta, dict) and "sharded_backend" in meta


class MegatronDistReader(Reader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        if _is_dist_dir(store):
            return True
        tracked = tracked_dir(store)
        return tracked is not None and _is_dist_dir(store, tracked)

    def read_index(self, store):
        from converters import not_yet

        not_yet(NAME, 3)
