"""The save hook on real DeepSpeed ZeRO engines: save at DP=2, load at DP=3.

Real DeepSpeed (``tests/harness/deepspeed_engine.py``) trains ZeRO-1/2/3 at DP=2 and saves through
``AsyncCheckpointer`` with ``training.deepspeed.sharded_state(engine)``; then takes one more
step on a fixed global batch (the uninterrupted run). A DP=3 job builds fresh engines,
``load_latest`` into their description, and takes the same step: the loss and the updated
parameters must match, and the loaded fp32 masters and moments equal the saved ones exactly.
bf16 and fp16 engines too (ZeRO-2 and ZeRO-3): there the next step differs by rounding only,
because gradients are reduced over another number of ranks; fp16's dynamic loss scaler
resumes in the state it was saved in.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")

from tests.harness import deepspeed_engine as H  # noqa: E402

STAGES = (1, 2, 3)
CASES = [(stage, "fp32") for stage in STAGES] + [(2, "bf16"), (3, "bf16"), (2, "align"),
                                                  (2, "fp16"), (3, "fp16")]
"""``align``: bf16 with ZeRO's parameter_alignment (zeros between parameters). ``fp16``: a
dynamic loss scale that has overflowed and dropped before the save."""
NAMES = [f"z{stage}" + ("" if p == "fp32" else f"_{p}") for stage, p in CASES]


def _save_worker(rank: int, dp: int, root: str, port: int) -> None:
    from training import AsyncCheckpointer
    from training.deepspeed import sharded_state

    H._init(rank, dp, port)
    for (stage, precision), name in zip(CASES, NAMES):
        eng = H.engine(stage, dp, precision)
        for s in range(H.STEPS):
            H.train_step(eng, s, rank, dp)
        ckpt = AsyncCheckpointer(f"{root}/{name}", topology={"dp": dp, "zero": stage})
        ckpt.save(H.STEPS, sharded_state(eng))
        ckpt.wait()
        eng.save_checkpoint(f"{root}/ds_{name}")  # the same state, as DeepSpeed writes it
        saved, scaler = H.full_state(eng), H.scaler_state(eng)
        loss = H.train_step(eng, H.NEXT_STEP, rank, dp)
        after = H.full_state(eng)["params"]
        if rank == 0:
            torch.save({"saved": saved, "loss": loss, "after": after, "scaler": scaler},
                       f"{root}/{name}.truth.pt")


def _load_worker(rank: int, dp: int, root: str, port: int) -> None:
    from training import AsyncCheckpointer
    from training.deepspeed import restore, sharded_state

    H._init(rank, dp, port)
    for (stage, precision), name in zip(CASES, NAMES):
        eng = H.engine(stage, dp, precision)
        state = sharded_state(eng)
        step = AsyncCheckpointer(f"{root}/{name}").load_latest(state)
        restore(eng, state)
        loaded, steps, scaler = H.full_state(eng), eng.global_steps, H.scaler_state(eng)
        loss = H.train_step(eng, H.NEXT_STEP, rank, dp)
        after = H.full_state(eng)["params"]
        if rank == 0:
            torch.save({"loaded": loaded, "loss": loss, "after": after, "step": step,
                        "global_steps": steps, "scaler": scaler}, f"{root}/{name}.dp{dp}.pt")


@pytest.fixture(scope="module")
def hook(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_hook")
    H._spawn(_save_worker, 2, str(root))
    H._spawn(_load_worker, 3, str(root))
    return root


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item() < tol


@pytest.mark.parametrize("name", NAMES)
def test_dp2_hook_checkpoint_resumes_at_dp3(hook, name):
    truth = torch.load(hook / f"{name}.truth.pt", weights_only=False)
    got = torch.load(hook / f"{name}.dp3.pt", weights_only=False)
    assert got["step"] == H.STEPS and got["global_steps"] == H.STEPS
    for kind in ("params", "exp_avg", "exp_avg_sq", "frozen"):
        assert truth["saved"][kind].keys() == got["loaded"][kind].keys(), kind
        for key, value in truth["saved"][kind].items():
            assert torch.equal(got["loaded"][kind][key], value), (kind, key)
    assert abs(got["loss"] - truth["loss"]) / abs(truth["loss"]) < 1e-5
    tol = 1e-5 if name in {f"z{s}" for s in STAGES} else 1e-2  # bf16/fp16: reduced over 3 ranks
    for key, value in truth["after"].items():
        assert _close(got["after"][key], value, tol), key
    # fp16: the scaler as saved. Whether the next step overflows is then DeepSpeed's affair:
    # fp16 gradients summed over 3 ranks can overflow where 2 did not.
    assert got["scaler"] == truth["scaler"]


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("fp16")])
def test_fp16_loss_scaler_resumes_where_it_was(hook, name):
    """The saved scaler is not the one a fresh engine starts with, so the test above tells a
    restored scaler from a fresh one."""
    truth = torch.load(hook / f"{name}.truth.pt", weights_only=False)
    scaler = truth["scaler"]
    assert scaler["cur_scale"] < 2.0 ** 16 and scaler["last_overflow_iter"] >= 0, scaler
    assert 1 <= scaler["skipped_steps"] < H.STEPS, scaler  # a step was taken: moments are set


@pytest.mark.parametrize("stage,name", list(zip([s for s, _ in CASES], NAMES)), ids=NAMES)
def test_hook_checkpoint_verifies_and_converts(hook, stage, name, run_cli, tmp_path):
    import ckptool

    newest = ckptool.latest(str(hook / name)).path
    res = run_cli("verify", newest, "--deep")
    assert res.code == 0 and "committed" in res.out, res.out + res.err
    res = run_cli("convert", newest, tmp_path / "dcp", "--to", "dcp")
    assert res.code == 0, res.out + res.err
    from torch.distributed.checkpoint import FileSystemReader
    keys = set(FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata)
    assert "emb.weight" in keys and "optimizer.state.exp_avg.fc1.weight" in keys
    assert "head.weight" not in keys  # tied: once, under its owner
    assert ("optimizer.state.fp32_param.fc1.weight" in keys) == (stage < 3)


@pytest.mark.parametrize("name", NAMES)
def test_hook_keys_are_the_offline_readers(hook, name):
    """The hook's global tensors are those ckptool reads from DeepSpeed's own checkpoint of
    the same engine, with the same shapes and dtypes (plus the per-parameter step)."""
    import ckptool
    from ckptool.checkpoints.open import open_checkpoint

    ours = open_checkpoint(ckptool.latest(str(hook / name)).path).index.tensors
    theirs = open_checkpoint(str(hook / f"ds_{name}")).index.tensors
    steps = {k for k in ours if k.startswith("optimizer.state.step.")}
    assert {k: (tuple(v.shape), v.dtype) for k, v in ours.items() if k not in steps} == \
        {k: (tuple(v.shape), v.dtype) for k, v in theirs.items()}
    trainable = {k for k in theirs if k.startswith("optimizer.state.exp_avg.")}
    assert steps == {k.replace(".exp_avg.", ".step.") for k in trainable}
