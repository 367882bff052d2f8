"""DeepSpeed checkpoints: ``latest`` + ``global_step{N}/`` with ``*_model_states.pt`` and
``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``; pipeline engines add
``layer_{idx:02d}-model_{tp:02d}-model_states.pt``.
"""

from __future__ import annotations

from ckptool.core.index import Reader
from ckptool.core.storage import Store

NAME = "deepspeed"
LATEST = "latest"
MODEL_STATES_SUFFIX = "_model_states.pt"


def _has_model_states(store: Store, rel: str = "") -> bool:
    return any(not d and n.endswith(MODEL_STATES_SUFFIX) for n, d in store.ls(rel))


class DeepSpeedReader(Reader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        if store.isdir("zero"):
            return False  # universal
        if _has_model_states(store):
            return True
        if store.exists(LATEST) and not store.isdir(LATEST):
            tag = store.read_bytes(LATEST).decode(errors="replace").strip()
            return bool(tag) and "/" not in tag and _has_model_states(store, tag) \
                and not store.isdir(f"{tag}/zero")
        return False

    def read_index(self, store):
        from converters import not_yet

        not_yet(NAME, 5)
