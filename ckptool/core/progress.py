"""Progress of long metadata work (reading a ``.metadata``, indexing, planning) on stderr.

A 405B checkpoint of 512 ranks has 1.75M chunks: reading and planning it takes minutes,
and a command that prints nothing for minutes looks hung. Each such step is a
:func:`step`; nothing is shown unless the command turned progress on (:func:`enable`, the
CLI does for a human at a terminal and for batch logs) and the step has taken more than a
second. A terminal gets a tqdm bar; a log (Slurm's, a file) one line every ~10 s::

    ckptool: reading .metadata: 41% (17.3 MB of 42.0 MB, 3 s)

The library itself is silent: :func:`step` costs a counter per call until enabled.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

_ENABLED: dict[str, Any] = {}
_DELAY = 1.0
_LOG_EVERY = 10.0


def enable(stream=None) -> None:
    """Show steps that take more than a second on ``stream`` (default: the ``sys.stderr`` of
    the moment each step begins)."""
    _ENABLED["stream"] = stream


def disable() -> None:
    _ENABLED.clear()


class Step:
    """One step's progress: :meth:`advance` by units done (bytes, chunks...) of ``total``."""

    __slots__ = ("what", "total", "unit", "done", "_start", "_bar", "_next_log", "_stream")

    def __init__(self, what: str, total: int | None, unit: str):
        self.what, self.total, self.unit, self.done = what, total, unit, 0
        self._start = time.monotonic()
        self._bar = None
        self._stream = (_ENABLED["stream"] or sys.stderr) if _ENABLED else None
        self._next_log = self._start + _DELAY

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._stream is None:
            return
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(n)
        elif now >= self._next_log:
            if _is_tty(self._stream):
                from tqdm import tqdm

                self._bar = tqdm(total=self.total, initial=self.done, desc=self.what, unit=self.unit,
                                 unit_scale=True, file=self._stream, leave=False)
            else:
                self._log(now)
                self._next_log = now + _LOG_EVERY

    def _log(self, now: float) -> None:
        seconds = f"{now - self._start:.0f} s"
        if self.total:
            text = (f"{100 * self.done / self.total:.0f}% ({_amount(self.done, self.unit)} of "
                    f"{_amount(self.total, self.unit)}, {seconds})")
        else:
            text = f"{_amount(self.done, self.unit)} ({seconds})"
        print(f"ckptool: {self.what}: {text}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextmanager
def step(what: str, total: int | None = None, unit: str = "") -> Iterator[Step]:
    """A step of ``total`` units; shown only when enabled and slow. A step that cannot count
    (``unit`` empty: one call does the work) says it is still running, every ~10 s."""
    s = Step(what, total, unit)
    beat = _Heartbeat(s) if not unit and s._stream is not None else None
    try:
        yield s
    finally:
        if beat is not None:
            beat.stop()
        s.close()


class _Heartbeat(threading.Thread):
    def __init__(self, step: Step):
        super().__init__(daemon=True, name="ckptool-progress")
        self._step, self._done = step, threading.Event()
        self.start()

    def run(self) -> None:
        wait = _DELAY
        while not self._done.wait(wait):
            print(f"ckptool: {self._step.what} ({time.monotonic() - self._step._start:.0f} s)",
                  file=self._step._stream, flush=True)
            wait = _LOG_EVERY

    def stop(self) -> None:
        self._done.set()
        self.join()


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _amount(n: int, unit: str) -> str:
    if unit == "B":
        return f"{n / 1e6:.1f} MB"
    return f"{n:,} {unit}".rstrip()
