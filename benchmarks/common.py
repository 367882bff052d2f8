"""What the benchmarks share: timing a child process with its peak memory."""

from __future__ import annotations

import os
import subprocess
import time


def run(cmd: list[str], env=None, quiet: bool = False) -> tuple[float, float]:
    """(wall seconds, peak RSS GB) of one child process; exits if it fails."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL if quiet else None)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1e6
