"""SIGKILL a process at random moments during async saves: `latest` never returns a
checkpoint that `verify --deep` rejects."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import ckptool
from tests.conftest import REPO

SAVER = r"""
import sys, torch, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[2])
from training import AsyncCheckpointer
ckpt = AsyncCheckpointer(sys.argv[1], keep_last=3)
g = torch.Generator().manual_seed(0)
state = {"model": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(8)}, "step": 0}
print("ready", flush=True)
step = int(sys.argv[3])
while True:
    step += 1
    for t in state["model"].values():
        t.add_(1.0)
    state["step"] = step
    ckpt.save(step, state)
    if step == int(sys.argv[3]) + 1:
        ckpt.wait()
        print("committed", flush=True)  # from here on, kills land in later saves
"""


@pytest.mark.parametrize("seed", range(4))
def test_sigkill_never_leaves_an_accepted_bad_checkpoint(tmp_path, seed):
    rng = random.Random(seed)
    root = tmp_path / "run"
    start, seen = 0, 0
    for trial in range(2):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(root), str(REPO), str(start)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        assert proc.stdout.readline().strip() == "committed"
        time.sleep(rng.uniform(0.0, 1.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        start += 1000
        found = ckptool.latest(str(root))  # at least the first save is committed
        report = ckptool.verify(found.path, deep=True)
        assert report.ok, (found.path, report.problems)
        assert report.committed is True
        seen += 1
    assert seen == 2
