"""DeepSpeed stage 0 (no ZeRO) of a bf16 engine: FP16_UnfusedOptimizer checkpoints, read and
written with the exact optimizer state.

A bf16 engine without ZeRO (and not a pipeline) wraps the client optimizer in DeepSpeed's
FP16_UnfusedOptimizer (``DDP_BFLOAT16``; the fused FP16_Optimizer needs FusedAdam, which a
CPU build lacks). Its ``optimizer`` entry in ``mp_rank_00_model_states.pt`` holds the torch
state dict, the fp32 masters (``fp32_groups``) and the loss-scale entries. Real DeepSpeed
trains at DP=2 (``tests/harness/deepspeed_engine.py``, precision ``bf16``); ckptool reshards to DP=3 and DP=1,
to ZeRO-2, and a bf16 ZeRO-2 run to stage 0; plain ``engine.load_checkpoint`` loads each.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.conftest import peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")

from converters.deepspeed.zero import Layout  # noqa: E402
from tests.harness import deepspeed_engine as H  # noqa: E402

RESHARDS = {  # name -> (source run, target DP, target stage)
    "s0_dp3": ("z0_bf16", 3, 0),
    "s0_dp1": ("z0_bf16", 1, 0),
    "s0_dp3_zero2": ("z0_bf16", 3, 2),
    "s0_dp1_zero1": ("z0_bf16", 1, 1),
    "s0_dp3_zero3": ("z0_bf16", 3, 3),
    "z2_dp1_zero0": ("z2_bf16", 1, 0),
    "z3_dp3_zero0": ("z3_bf16", 3, 0),
}
SWAPPED = "s0_dp1_swapped"
"""``s0_dp1`` with the exp_avg of ``norm.weight`` and ``norm.bias`` (one shape) exchanged: the
checks below must reject what DeepSpeed loads from it."""


def _swap_moment(ckpt) -> None:
    path = ckpt / "global_step2" / "mp_rank_00_model_states.pt"
    ms = torch.load(path, weights_only=False)  # our own test output
    inner = ms["optimizer"]["optimizer_state_dict"]
    w, b = inner["param_groups"][1]["params"][2:4]  # fc1.bias, fc2.bias, norm.weight, norm.bias
    state = inner["state"]
    state[w]["exp_avg"], state[b]["exp_avg"] = state[b]["exp_avg"], state[w]["exp_avg"]
    torch.save(ms, path)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """Real bf16 DeepSpeed runs at DP=2 (stage 0, ZeRO-2, ZeRO-3), their reshards, and what
    DeepSpeed made of each."""
    import ckptool

    root = tmp_path_factory.mktemp("ds_stage0_bf16")
    H.save(root, (0, 2, 3), dp=2, precision="bf16")
    for name, (src, dp, zero) in RESHARDS.items():
        ckptool.reshard(str(root / src), str(root / name), to={"dp": dp, "zero": zero})
    shutil.copytree(root / "s0_dp1", root / SWAPPED)
    _swap_moment(root / SWAPPED)
    jobs = {name: (zero, dp) for name, (_, dp, zero) in RESHARDS.items()}
    jobs[SWAPPED] = (0, 1)
    for dp in (3, 1):
        H.load(dp, [(zero, root / name, root / f"{name}.loaded.pt")
                    for name, (zero, d) in jobs.items() if d == dp], precision="bf16")
    return root


def update_gap(got: dict, truth: dict) -> float:
    """How far the step DeepSpeed took from the loaded state is from the step of the run
    that never stopped: the largest difference of the two updates (masters after minus the
    same masters before), over the mean size of the reference update.

    Why not bit-equal: a bf16 engine accumulates and all-reduces its gradients in bf16, so
    the gradient of one global batch depends on how it is cut across ranks (3 or 1 shares
    instead of 2): its elements differ in bf16's last bits (2^-8 relative). Adam divides by
    sqrt(exp_avg_sq), so an element whose gradient is tiny (tokens absent from the batch)
    turns such a difference into a visible part of its step; measured: at most ~0.15 of the
    mean update (0.06 of the learning rate), the mean difference ~0.2% of it. A wrong
    moment or master changes whole tensors' steps by their own size (gap near 1 or more)."""
    before = truth["saved"]["params"]
    diff = max((got["after"][k] - truth["after"][k]).abs().max().item() for k in before)
    size = torch.cat([(truth["after"][k] - before[k]).abs().flatten() for k in before]).mean().item()
    return diff / size


@pytest.mark.parametrize("name", RESHARDS)
def test_deepspeed_loads_the_bf16_stage0_reshard_exactly(ds, name):
    """Every fp32 master and Adam moment DeepSpeed loads is bit-equal to what the saving
    engine held, and so is the bf16 module (at ZeRO-3 it is partitioned: not compared); one
    more step on the same global batch gives the loss of the run that continued without
    resharding and its update within bf16's gradient rounding (:func:`update_gap`).

    The loss is computed from the bit-equal bf16 module, so only the fp32 mean over ranks is
    summed in another order (a few ulps: 1e-6). With ZeRO-3 on one side it differs by bf16
    rounding (5e-4 measured: 1e-3), because DeepSpeed's ZeRO-3 replaces ``F.linear`` by a
    matmul and a separate bias add (``zero3_linear_wrap``), rounded twice in bf16."""
    src, _, zero = RESHARDS[name]
    truth, got = torch.load(ds / f"{src}.truth.pt"), torch.load(ds / f"{name}.loaded.pt")
    H.assert_loaded_exactly(got, truth)
    zero3 = 3 in (zero, int(src[1]))
    assert zero3 or all(torch.equal(got["module"][k], v) for k, v in truth["module"].items())
    assert got["global_steps"] == H.STEPS
    assert abs(got["loss"] - truth["loss"]) / abs(truth["loss"]) < (1e-3 if zero3 else 1e-6)
    assert update_gap(got, truth) < 0.5


def test_the_checks_catch_a_swapped_moment(ds):
    """The same checks on a stage-0 file whose two moments were swapped (which DeepSpeed
    loads without complaint) fail: the bit-equal comparison, and the step too."""
    truth, got = torch.load(ds / "z0_bf16.truth.pt"), torch.load(ds / f"{SWAPPED}.loaded.pt")
    with pytest.raises(AssertionError):
        H.assert_loaded_exactly(got, truth)
    assert update_gap(got, truth) > 1.0


def test_reader_maps_masters_moments_and_loss_scale(ds):
    """What ckptool reads from the FP16_UnfusedOptimizer file is DeepSpeed's state by name:
    masters and moments bit-equal, the Adam step as the wrapped optimizer counts it (one more
    than the engine's steps: FP16_UnfusedOptimizer initializes its state with a step on zero
    gradients), the loss-scale entries kept."""
    from ckptool.checkpoints.open import open_checkpoint

    opened = open_checkpoint(str(ds / "z0_bf16"))
    index, truth = opened.index, torch.load(ds / "z0_bf16.truth.pt")["saved"]
    assert index.unmapped is None and index.topology.zero == 0
    layout = index.layout(Layout)
    assert layout.scaler == {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": H.STEPS}
    assert [float(s) for s in layout.steps] == [H.STEPS + 1.0] * 2
    for kind, key in (("params", "fp32_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        for name, value in truth[kind].items():
            info = index.tensors[f"optimizer.state.{key}.{name}"]
            stored = opened.reader.read_piece(opened.store, info.pieces[0], info.dtype)
            assert torch.equal(stored, value), (kind, name)


def test_hf_fp32_of_a_bf16_stage0_run_is_its_masters(tmp_path, run_cli):
    """`convert --to hf --dtype fp32` of an HF model trained by a bf16 stage-0 engine gives
    its fp32 masters bit for bit (the default dtype gives the bf16 module)."""
    from safetensors.torch import load_file

    peer("transformers")
    H.save_hf(tmp_path, [("llama", 0, "bf16")])
    src = tmp_path / H.hf_run_name("llama", 0, "bf16")
    masters = torch.load(f"{src}.masters.pt")
    assert run_cli("convert", src, tmp_path / "fp32", "--to", "hf", "--dtype", "fp32").code == 0
    fp32 = load_file(tmp_path / "fp32" / "model.safetensors")
    assert masters.keys() == fp32.keys()
    for name, value in masters.items():
        assert value.dtype == torch.float32 and torch.equal(fp32[name], value), name
    assert not all(torch.equal(v.to(torch.bfloat16).float(), v) for v in masters.values())  # not bf16


def test_bf16_stage0_verifies(ds, run_cli):
    for name in ("z0_bf16", "s0_dp3", "z2_dp1_zero0"):
        res = run_cli("verify", ds / name, "--deep")
        assert res.code == 0, res.err


FP16_REFUSED = "an fp16 engine without ZeRO (FP16_UnfusedOptimizer) is written only at stage 0"


@pytest.mark.parametrize("edit,command,message", [
    ("fp16", ("reshard", "--to-zero", "2"), FP16_REFUSED),
    ("fused", ("reshard", "--to-dp", "3"),
     "FP16_Optimizer's flat fp32 groups (a fused-Adam fp16/bf16 engine) are not mapped"),
])
def test_what_is_not_written_is_refused_with_the_reason(ds, run_cli, tmp_path, edit, command, message):
    """An fp16 stage-0 engine (the same FP16_UnfusedOptimizer file, fp16 module) is not written
    at another ZeRO stage: its loss-scale state and ZeRO's do not map onto each other (fp16
    at stage 0 itself: ``tests/test_deepspeed_fp16.py``). The fused FP16_Optimizer's flat
    groups carry no parameter boundaries, so they are not mapped."""
    src = tmp_path / "src"
    shutil.copytree(ds / "z0_bf16", src)
    path = src / "global_step2" / "mp_rank_00_model_states.pt"
    ms = torch.load(path, weights_only=False)  # our own test fixture
    if edit == "fp16":
        ms["module"] = {k: v.half() if v.dtype == torch.bfloat16 else v for k, v in ms["module"].items()}
        ms["module"]["head.weight"] = ms["module"]["emb.weight"]
    else:  # FP16_Optimizer (FusedAdam): one flat master per group, clip_grad
        opt = ms["optimizer"]
        opt["fp32_groups_flat"] = [torch.cat([t.flatten() for t in g]) for g in opt.pop("fp32_groups")]
        opt["clip_grad"] = 1.0
    torch.save(ms, path)
    if edit == "fp16":
        assert run_cli("convert", src, tmp_path / "dcp", "--to", "dcp").code == 0
    verb, *flags = command
    res = run_cli(verb, src, tmp_path / "out", *flags)
    assert res.code == 2 and message in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_zero3_source_written_to_zero2_keeps_the_bf16_module(ds, tmp_path, run_cli):
    """ZeRO-3 files hold no module weights, only the fp32 masters: written to ZeRO-2, the
    module takes the engine's dtype (bf16, each master rounded as DeepSpeed rounds it), as
    DeepSpeed's own ZeRO-2 file of the same run does, not fp32 at twice the size."""
    assert run_cli("reshard", ds / "z3_bf16", tmp_path / "z2", "--to-zero", "2").code == 0
    own = torch.load(next((ds / "z2_bf16").rglob("mp_rank_00_model_states.pt")), weights_only=False)
    ours = torch.load(next((tmp_path / "z2").rglob("mp_rank_00_model_states.pt")), weights_only=False)
    assert {k: v.dtype for k, v in ours["module"].items()} == \
        {k: v.dtype for k, v in own["module"].items()}
    assert any(v.dtype == torch.bfloat16 for v in ours["module"].values())
    masters = torch.load(ds / "z3_bf16.truth.pt", weights_only=False)["saved"]["params"]
    for name, master in masters.items():
        assert torch.equal(ours["module"][name], master.to(torch.bfloat16)), name
