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


@pytest.mark.parametrize("seed", range(1))
def test_sigkill_of_a_megatron_core_job_never_leaves_an_accepted_bad_checkpoint(tmp_path, seed):
    """The same trials on a real Megatron-Core job (examples/train_megatron_core.py: GPTModel,
    distributed optimizer, bf16 with fp32 main params, TP1 x PP2 under torchrun, saving through
    the hook every step): every process of the job is killed at once (a node failure) at a
    random moment after its first commit, twice, the second run resuming from the first's
    newest checkpoint. ``latest`` then returns a checkpoint that ``verify --deep`` accepts."""
    from ckptool.core.errors import NoCheckpoint
    from tests.conftest import free_port, kill_job, peer

    peer("megatron.core")
    rng = random.Random(100 + seed)
    root = tmp_path / "run"
    for trial in range(2):
        before = ckptool.latest(str(root)).path if trial else None
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), str(REPO / "examples/train_megatron_core.py"),
               "--save", str(root), "--tp", "1", "--pp", "2", "--steps", "100000", "--save-every", "1"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while True:  # until this run has committed a checkpoint of its own
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint committed in 180 s"
                try:
                    if ckptool.latest(str(root)).path != before:
                        break
                except NoCheckpoint:
                    pass
                time.sleep(0.2)
            time.sleep(rng.uniform(0.0, 1.5))
        finally:
            left = kill_job(proc.pid)  # every rank at once, and torchrun
            proc.wait()
        assert left == [], f"processes of the job outlived the kill: {left}"
        found = ckptool.latest(str(root))
        report = ckptool.verify(found.path, deep=True)
        assert report.ok, (found.path, report.problems)
        assert report.committed is True
