"""What the benchmarks share: timing a child process with its peak memory."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

# Linux counts a forked child's peak RSS from its parent's at the fork, and exec keeps it:
# a command started straight from a benchmark that holds gigabytes would report them too.
# So a small Python process starts the command and reports that grandchild's peak alone.
_MEASURE = r"""
import os, subprocess, sys
out, cmd = sys.argv[1], sys.argv[2:]
proc = subprocess.Popen(cmd)
_, status, usage = os.wait4(proc.pid, 0)
with open(out, "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run(cmd: list[str], env=None, quiet: bool = False) -> tuple[float, float]:
    """(wall seconds, peak RSS GB) of one child process; exits if it fails."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _MEASURE, rss.name, *cmd], env=env,
                              stdout=subprocess.DEVNULL if quiet else None)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}")
        return wall, int(rss.read() or 0) / 1e6
