"""DeepSpeed universal checkpoints: ``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``
beside the ``mp_rank_*_model_states.pt`` files; loaded by DeepSpeed's ``load_universal``.
"""

from __future__ import annotations

from ckptool.core.index import Reader
from ckptool.core.storage import Store

NAME = "deepspeed-universal"
LATEST_UNIVERSAL = "latest_universal"


class UniversalReader(Reader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        if store.isdir("zero"):
            return True
        if store.exists(LATEST_UNIVERSAL):
            tag = store.read_bytes(LATEST_UNIVERSAL).decode(errors="replace").strip()
            return bool(tag) and "/" not in tag and store.isdir(f"{tag}/zero")
        return False

    def read_index(self, store):
        from converters import not_yet

        not_yet(NAME, 5)
