"""Run-root rules shared by both Megatron formats (legacy and Megatron-Core distributed).

Not a format: the tracker file and the iteration directory names, written once.
"""

from __future__ import annotations

import re

from ckptool.core.storage import Store

TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")


def iteration_dir(iteration: int | str) -> str:
    """``iter_0000200`` for 200, ``release`` for a release checkpoint."""
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def tracked_dir(store: Store) -> str | None:
    """The directory the tracker file points at, or None when there is no usable tracker."""
    if not store.exists(TRACKER):
        return None
    text = store.read_bytes(TRACKER).decode(errors="replace").strip()
    if text == "release" or text.isdigit():
        return iteration_dir(text)
    return None
