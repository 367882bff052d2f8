"""examples/slurm/rehearse.sh: the Slurm restart flow on one machine (CPU torchrun, gloo):
train at 4 ranks, crash, corrupt the newest checkpoint, restart at 2 ranks, resume from the
previous good one, with the same prelaunch logic train.sbatch uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def rehearse(tmp_path: Path, mode: str, trainer: str = "examples/train_tiny.py") -> subprocess.CompletedProcess:
    script, *extra = trainer.split()
    env = dict(os.environ, PY=sys.executable, RESHARD_MODE=mode, PORT=str(free_port()), TRAINER=script,
               TRAINER_ARGS=" ".join(extra))
    return subprocess.run(["bash", str(ROOT / "examples" / "slurm" / "rehearse.sh"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.parametrize("mode,trainer", [
    ("hook", "examples/train_tiny.py"),
    pytest.param("offline", "examples/train_tiny.py", marks=pytest.mark.slow),
    # a Megatron-DeepSpeed PipelineEngine (TP2 x PP2, ZeRO-1) resumed at TP1 x PP2 by the hook
    ("hook", "examples/train_megatron_deepspeed.py"),
    # Megatron-Core with its distributed optimizer (fp32: the redone steps are exact)
    ("hook", "examples/train_megatron_core.py --fp32"),
], ids=["hook", "offline", "megatron-deepspeed", "megatron-core"])
def test_rehearsal_resumes_from_the_previous_good_checkpoint(tmp_path, mode, trainer):
    if "deepspeed" in trainer:
        pytest.importorskip("deepspeed")
    if "megatron_core" in trainer:
        pytest.importorskip("megatron.core")
    proc = rehearse(tmp_path, mode, trainer)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rehearsal passed" in proc.stdout
    losses = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    by_step: dict[int, list[float]] = {}
    for d in losses:
        by_step.setdefault(d["step"], []).append(d["loss"])
    # Steps redone after the restart (on the new topology) give the losses of the first run.
    redone = {s: v for s, v in by_step.items() if len(v) == 2}
    assert redone, by_step
    for step, (first, again) in redone.items():
        assert abs(first - again) <= 1e-5 * abs(first), (step, first, again)
    assert max(by_step) == 10
    # The crashed save's temporary directory was swept once that step was committed again.
    assert not [p.name for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name]


def test_prelaunch_refuses_a_run_with_no_valid_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "step_00000002").mkdir(parents=True)  # something saved, nothing valid
    script = (f"source {ROOT}/examples/slurm/prelaunch.sh; prelaunch {run} 1 1 1; echo launched")
    env = dict(os.environ, CKPTOOL=f"{sys.executable} -m ckptool", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3 and "launched" not in proc.stdout
    assert "none is valid" in proc.stderr
    fresh = tmp_path / "fresh"
    proc = subprocess.run(["bash", "-c", script.replace(str(run), str(fresh))], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "starting fresh" in proc.stdout and "launched" in proc.stdout


def _prelaunch(run: Path, tp: int, pp: int, dp: int, mode: str = "hook") -> subprocess.CompletedProcess:
    script = (f"source {ROOT}/examples/slurm/prelaunch.sh; prelaunch {run} {tp} {pp} {dp}; "
              f"echo \"launched LOAD_ROOT=$LOAD_ROOT\"")
    env = dict(os.environ, CKPTOOL=f"{sys.executable} -m ckptool", PYTHON=sys.executable,
               RESHARD_MODE=mode)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=300)


def test_prelaunch_starts_fresh_when_the_only_save_never_committed(tmp_path):
    """A first save killed before its commit leaves only ``step_X.tmp-*``: nothing was saved, so
    the (requeued) job starts fresh (it refused to start, every time: exit 3)."""
    run = tmp_path / "run"
    (run / "step_00000004.tmp-0123abcd").mkdir(parents=True)
    proc = _prelaunch(run, 1, 1, 1)
    assert proc.returncode == 0 and "starting fresh" in proc.stdout, proc.stdout + proc.stderr


def test_prelaunch_offline_reshards_once_per_target_topology(tmp_path, make_ckpt):
    """RESHARD_MODE=offline keeps one resharded copy per job size: a restart at DP4 after one at
    DP2 loads a DP4 checkpoint (it reused the DP2 one, whose name was the same)."""
    from ckptool import inspect

    run = tmp_path / "run"
    make_ckpt(run / "step_00000008", iteration=8)  # saved at TP1/PP1/DP1
    for dp in (2, 4):
        proc = _prelaunch(run, 1, 1, dp, "offline")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        load_root = proc.stdout.split("LOAD_ROOT=")[-1].strip()
        assert inspect(str(Path(load_root) / "step_00000008")).topology["dp"] == dp


def test_prelaunch_offline_loads_a_megatron_root_as_the_root_its_reshard_is(tmp_path):
    """``latest`` prints a Megatron root itself (its tracker names the iteration): offline mode
    must load the resharded root, whose tracker Megatron's --load reads (LOAD_ROOT was the
    directory above it, with no tracker: Megatron would have started from random)."""
    from tests.harness import mcore as H

    run = tmp_path / "gpt"
    H.save_real(H.GPT, 1, run)
    proc = _prelaunch(run, 2, 1, 1, "offline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    load_root = Path(proc.stdout.split("LOAD_ROOT=")[-1].strip())
    assert (load_root / "latest_checkpointed_iteration.txt").read_text().strip() == "10"


def test_prelaunch_under_pipefail_with_many_saves(tmp_path):
    """train.sbatch runs with ``set -euo pipefail``: with hundreds of saves, ``find | head -1``
    died of SIGPIPE and took the script with it (exit 141, no message)."""
    run = tmp_path / "run"
    for i in range(1, 400):
        (run / f"step_{i:08d}").mkdir(parents=True)  # saved, none valid: exit 3, said why
    script = (f"set -euo pipefail; source {ROOT}/examples/slurm/prelaunch.sh; prelaunch {run} 1 1 1")
    env = dict(os.environ, CKPTOOL=f"{sys.executable} -m ckptool", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 3 and "none is valid" in proc.stderr, (proc.returncode, proc.stderr[-500:])
