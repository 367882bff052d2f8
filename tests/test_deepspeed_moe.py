"""DeepSpeed's own MoE (``deepspeed.moe.layer.MoE``) runs on CPU, so its checkpoints are real
input: until ckptool reads their expert files, every command refuses them (exit 2, nothing
written) instead of resharding the dense part and leaving the experts behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port, peer

peer("deepspeed")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ds_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_moe") / "run"
    subprocess.run([sys.executable, "-m", "tests.harness.deepspeed_moe", str(root), str(free_port())],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    return root


def test_the_expert_files_are_there(ds_moe):
    tag = (ds_moe / "latest").read_text().strip()
    assert sorted(p.name for p in (ds_moe / tag).glob("layer_0_expert_*")) == [
        f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)]


@pytest.mark.parametrize("command", [("reshard", "--to-dp", 2), ("convert", "--to", "dcp"),
                                     ("convert", "--to", "hf")])
def test_deepspeed_moe_is_refused_not_half_read(ds_moe, tmp_path, run_cli, command):
    dst = tmp_path / "out"
    r = run_cli(command[0], ds_moe, dst, *command[1:])
    assert r.code == 2 and "DeepSpeed MoE checkpoints" in r.err and "Traceback" not in r.err, r.err
    assert not dst.exists()
