"""Legacy Megatron-LM checkpoints: ``iter_{:07d}/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``.

A run root has ``latest_checkpointed_iteration.txt`` (an iteration number or ``release``)
beside the ``iter_*``/``release`` directories. At PP=1 the rank directories have no
``_PPP`` part.
"""

from __future__ import annotations

import re

from ckptool.core.index import Reader
from ckptool.core.storage import Store
from converters.megatron_common import ITER_DIR, tracked_dir

NAME = "megatron"
RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")


def _has_rank_dirs(store: Store, rel: str = "") -> bool:
    return any(d and RANK_DIR.match(n) for n, d in store.ls(rel))


class MegatronReader(Reader):
    name = NAME

    @classmethod
    def detect(cls, store: Store) -> bool:
        if _has_rank_dirs(store):
            return True
        tracked = tracked_dir(store)
        if tracked is not None:
            return _has_rank_dirs(store, tracked)
        iters = [n for n, d in store.ls() if d and ITER_DIR.match(n)]
        return bool(iters) and _has_rank_dirs(store, iters[-1])

    def read_index(self, store):
        from converters import not_yet

        not_yet(NAME, 3)
