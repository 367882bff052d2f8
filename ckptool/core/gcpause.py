"""Cyclic garbage collection paused while a large metadata structure is built.

Reading a DCP ``.metadata`` of 874k chunks creates millions of small objects (records,
regions, pieces) and no reference cycles. Python's collector, triggered every 700
allocations, walks the growing heap again and again: at 150k chunks it is half the time
of reading the index. Pausing it for the build costs nothing (nothing cyclic becomes
garbage there); it runs again as soon as the build is done.

Then the next young collection would walk every object built in the pause once more (they
were never collected, so all are young: 0.7 s at 291k chunks), and the older generations
again later. A command-line process (:func:`freeze_builds`) moves what it built to the
collector's permanent generation instead (``gc.freeze``, constant time): the index lives
until the command ends anyway. A library caller (a training job resuming) keeps the usual
collection: freezing would pin its own objects too.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

_FREEZE = False


def freeze_builds(on: bool = True) -> None:
    """For this process, freeze what each paused build made instead of collecting it later."""
    global _FREEZE
    _FREEZE = on


@contextmanager
def paused_gc() -> Iterator[None]:
    """Cyclic GC off inside (as it was before, after: nesting and threads are safe, at worst
    one stays collected a little later)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if _FREEZE:
                gc.freeze()
            gc.enable()
