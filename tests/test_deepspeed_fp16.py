"""DeepSpeed fp16 engines with a dynamic loss scale: resharded with the scaler as it was.

Real DeepSpeed trains fp16 engines at DP=2 (``tests/harness/deepspeed_engine.py``, precision
``fp16``: the scale starts at 2^16, and the ZeRO-2 run overflows in its first step), at
stage 0 (FP16_UnfusedOptimizer) and ZeRO-2 (DeepSpeedZeroOptimizer with a DynamicLossScaler).
ckptool reshards them to DP=1 and DP=3 (ZeRO-2 also to ZeRO-1); plain ``engine.load_checkpoint``
loads each: every fp32 master and Adam moment bit-equal, the fp16 module bit-equal, the
loss scaler in the state it was saved in, and the next loss the uninterrupted run's.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")

from tests.harness import deepspeed_engine as H  # noqa: E402

RESHARDS = {  # name -> (source run, target DP, target stage)
    "s0_dp1": ("z0_fp16", 1, 0),
    "s0_dp3": ("z0_fp16", 3, 0),
    "z2_dp1": ("z2_fp16", 1, 2),
    "z2_dp3_zero1": ("z2_fp16", 3, 1),
}


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    import ckptool

    root = tmp_path_factory.mktemp("ds_fp16")
    H.save(root, (0, 2), dp=2, precision="fp16")
    for name, (src, dp, zero) in RESHARDS.items():
        ckptool.reshard(str(root / src), str(root / name), to={"dp": dp, "zero": zero})
    for dp in (1, 3):
        H.load(dp, [(zero, root / name, root / f"{name}.loaded.pt")
                    for name, (_, d, zero) in RESHARDS.items() if d == dp], precision="fp16")
    return root


@pytest.mark.parametrize("name", RESHARDS)
def test_deepspeed_loads_the_fp16_reshard_with_its_loss_scaler(ds, name):
    src = RESHARDS[name][0]
    truth = torch.load(ds / f"{src}.truth.pt", weights_only=False)
    got = torch.load(ds / f"{name}.loaded.pt", weights_only=False)
    H.assert_loaded_exactly(got, truth)
    assert all(torch.equal(got["module"][k], v) for k, v in truth["module"].items())
    assert got["global_steps"] == H.STEPS
    assert got["scaler"] == truth["scaler"] and truth["scaler"]["dynamic"]
    assert abs(got["loss"] - truth["loss"]) / abs(truth["loss"]) < 1e-6


def test_the_saved_scalers_are_not_fresh(ds):
    """So the test above tells a carried scaler from the one a fresh engine starts with."""
    z0 = torch.load(ds / "z0_fp16.truth.pt", weights_only=False)["scaler"]
    z2 = torch.load(ds / "z2_fp16.truth.pt", weights_only=False)["scaler"]
    assert z0["cur_iter"] == H.STEPS  # a fresh one: 0
    assert z2["cur_scale"] < 2.0 ** 16 and z2["skipped_steps"] == 1 and z2["last_overflow_iter"] == 0


@pytest.mark.parametrize("src,zero", [("z0_fp16", "2"), ("z2_fp16", "0")])
def test_fp16_between_stage0_and_zero_is_refused(ds, run_cli, tmp_path, src, zero):
    res = run_cli("reshard", ds / src, tmp_path / "out", "--to-zero", zero)
    assert res.code == 2 and "is written only at stage 0" in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
