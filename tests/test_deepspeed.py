"""DeepSpeed ZeRO-1/2/3 checkpoints: read, reshard across DP sizes and ZeRO stages, and
load the result with real DeepSpeed.

The checkpoints are written by real DeepSpeed on CPU (``tests/harness/deepspeed_engine.py``) at DP=2.
ckptool reshards them to DP=3 and DP=1; DeepSpeed's plain ``engine.load_checkpoint`` loads
each at its new size, and one more step on the same global batch must give the loss and the
parameters of the run that continued without resharding. The fp32 weights ckptool extracts
must equal DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` bit for bit.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import convert_to_torch, peer
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")

from tests.harness import deepspeed_engine as H  # noqa: E402

STAGES = (1, 2, 3)
SAVED = (0, *STAGES)
TIED = {"head.weight": "emb.weight"}
RESHARDS = {  # name -> (source stage, target DP, target stage)
    **{f"z{s}_dp{dp}": (s, dp, s) for s in STAGES for dp in (3, 1)},
    "z1_dp3_zero2": (1, 3, 2),
    "z3_dp3_zero2": (3, 3, 2),
    "z3_dp1_zero1": (3, 1, 1),
    "z1_dp3_zero3": (1, 3, 3),
    "z2_dp1_zero3": (2, 1, 3),
    # stage 0: the client's torch optimizer state dict, mapped to names by the grouping rule
    "z0_dp3": (0, 3, 0),
    "z0_dp3_zero2": (0, 3, 2),
    "z0_dp1_zero3": (0, 1, 3),
    "z2_dp3_zero0": (2, 3, 0),
    "z3_dp1_zero0": (3, 1, 0),
}
LOADS = {dp: [(to, name, src) for name, (src, d, to) in RESHARDS.items() if d == dp] for dp in (3, 1)}
"""DP size -> (stage the engine runs, checkpoint, stage of the run it continues)."""


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """Real DeepSpeed checkpoints at DP=2, their reshards, and what DeepSpeed made of them."""
    import ckptool

    root = tmp_path_factory.mktemp("deepspeed")
    H.save(root, SAVED, dp=2)
    for name, (stage, dp, zero) in RESHARDS.items():
        ckptool.reshard(str(root / f"z{stage}"), str(root / name), to={"dp": dp, "zero": zero})
    for dp, jobs in LOADS.items():
        H.load(dp, [(stage, root / name, root / f"{name}.loaded.pt") for stage, name, _ in jobs])
    return root


@pytest.mark.parametrize("dp,case", [(dp, i) for dp, jobs in LOADS.items() for i in range(len(jobs))],
                         ids=[name for jobs in LOADS.values() for _, name, _ in jobs])
def test_deepspeed_loads_the_reshard_and_continues_the_run(ds, dp, case):
    _, name, source_stage = LOADS[dp][case]
    truth = torch.load(ds / f"z{source_stage}.truth.pt")
    got = torch.load(ds / f"{name}.loaded.pt")
    H.assert_loaded_exactly(got, truth)  # every fp32 master, moment and frozen param
    assert got["global_steps"] == H.STEPS
    assert abs(got["loss"] - truth["loss"]) / abs(truth["loss"]) < 1e-5
    assert H.rel(got["after"], truth["after"]) < 1e-5


def _ckptool_fp32(run_cli, src, dst) -> dict:
    """The fp32 weights by module name, through `ckptool convert --to dcp`."""
    tensors = convert_to_torch(run_cli, src, dst)

    def fp32(name):
        name = TIED.get(name, name)
        return tensors.get(f"optimizer.state.fp32_param.{name}", tensors[name])

    return fp32


@pytest.mark.parametrize("stage", STAGES)
def test_fp32_weights_equal_deepspeeds_zero_to_fp32(ds, run_cli, tmp_path, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    theirs = get_fp32_state_dict_from_zero_checkpoint(str(ds / f"z{stage}"))
    assert {"emb.weight", "head.weight", "fc1.bias", "scale"} <= set(theirs)
    assert ("shift" in theirs) == (stage > 1)  # DeepSpeed saves frozen params from stage 2
    ours = _ckptool_fp32(run_cli, ds / f"z{stage}", tmp_path / "dcp")
    for name, value in theirs.items():
        assert torch.equal(ours(name), value), name
    for name in (n for n, (src, _, to) in RESHARDS.items() if src == stage and to):  # ZeRO output
        again = get_fp32_state_dict_from_zero_checkpoint(str(ds / name))  # the same weights
        assert theirs.keys() ^ again.keys() <= {"shift"}  # ZeRO-1 files keep no frozen params
        assert all(torch.equal(again[k], theirs[k]) for k in theirs.keys() & again.keys())


def test_inspect_and_deep_verify(ds, run_cli):
    import json

    res = run_cli("inspect", ds / "z3", "--json")
    assert res.code == 0
    info = json.loads(res.out)
    assert (info["format"], info["iteration"]) == ("deepspeed", H.STEPS)
    assert info["topology"]["dp"] == 2 and info["topology"]["zero"] == 3
    for name in ("z1", "z2", "z3", "z2_dp3", "z3_dp1", "z1_dp3_zero3"):
        res = run_cli("verify", ds / name, "--deep")
        assert res.code == 0, res.err
    assert "committed" in run_cli("verify", ds / "z2_dp3").out


@pytest.mark.parametrize("args,message", [
    (("reshard", "z3", "--to-tp", "2"), "DeepSpeed output with TP2 is not supported yet"),
    (("reshard", "z2", "--to-dp", "3", "--drop-optimizer"), "--drop-optimizer cannot apply"),
    (("convert", "z2_dcp", "--to", "deepspeed"), "written only from a DeepSpeed checkpoint or a "
                                                  "Hugging Face model"),
])
def test_impossible_targets_are_refused_before_writing(ds, run_cli, tmp_path, args, message):
    if not (ds / "z2_dcp").exists():
        assert run_cli("convert", ds / "z2", ds / "z2_dcp", "--to", "dcp").code == 0
    command, src, *rest = args
    dst = tmp_path / "out"
    res = run_cli(command, ds / src, dst, *rest)
    assert res.code == 2, res.err
    assert message in res.err and len(res.err.strip().splitlines()) == 1
    assert not dst.exists() and not list(tmp_path.iterdir())


def test_zero3_sub_groups_are_refused(ds, run_cli, tmp_path):
    """A ZeRO-3 target whose param group, per rank, exceeds the config's sub_group_size
    would be split by DeepSpeed into sub-groups: refused before writing."""
    import shutil

    src = tmp_path / "z1"
    shutil.copytree(ds / "z1", src)
    states = src / "global_step2" / "mp_rank_00_model_states.pt"
    tree = torch.load(states, weights_only=False)
    tree["ds_config"]["zero_optimization"]["sub_group_size"] = 100
    torch.save(tree, states)
    res = run_cli("reshard", src, tmp_path / "out", "--to-dp", "3", "--to-zero", "3")
    assert res.code == 2, res.err
    assert "param group 0 has 110 elements per rank at DP3, over ZeRO-3's sub_group_size 100" in res.err
    assert len(res.err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert run_cli("reshard", src, tmp_path / "out", "--to-dp", "2", "--to-zero", "2").code == 0


@pytest.mark.slow
@pytest.mark.parametrize("precision,stage,zero", [("bf16", 2, 2), ("bf16", 1, 1), ("bf16opt", 1, 1),
                                                  ("bf16", 2, 3)])
def test_bf16_reshard_loads_exactly(tmp_path, precision, stage, zero):
    """bf16 runs (ZeRO-1/2 with bf16_ file names, and BF16_Optimizer, whose fp32 partitions
    keep the padding), resharded to DP3 at stage ``zero``: the loaded state is exact. The
    next step differs by bf16 rounding, because gradients are reduced over another number of
    ranks; at ZeRO-3 its loss does too, since DeepSpeed's ZeRO-3 replaces ``F.linear`` by a
    matmul and a separate bias add (``zero3_linear_wrap``), rounded twice in bf16."""
    import ckptool

    H.save(tmp_path, [stage], dp=2, precision=precision)
    name = f"z{stage}_{precision}"
    ckptool.reshard(str(tmp_path / name), str(tmp_path / "dp3"), to={"dp": 3, "zero": zero})
    H.load(3, [(zero, tmp_path / "dp3", tmp_path / "loaded.pt")], precision=precision)
    truth, got = torch.load(tmp_path / f"{name}.truth.pt"), torch.load(tmp_path / "loaded.pt")
    H.assert_loaded_exactly(got, truth)
    assert abs(got["loss"] - truth["loss"]) / abs(truth["loss"]) < (1e-5 if zero == stage else 1e-3)
    assert H.rel(got["after"], truth["after"]) < 1e-2


def test_round_robin_gradients_order_follows_the_new_dp_size(tmp_path):
    """ZeRO-2 with round_robin_gradients: DeepSpeed flattens each group in an order that
    depends on the DP size. A DP2 checkpoint resharded to DP3 is written in DP3's order, so a
    DP3 engine gets every weight back and its next step (masters and Adam moments at work)
    gives the loss and the weights of the run that continued at DP2.

    The module's tensors are compared, not DeepSpeed's safe_get_full_fp32_param: in this mode
    DeepSpeed 0.19.8 maps its fragments in the wrong order (its own zero_to_fp32 and the
    module agree with ckptool, not with it)."""
    import ckptool

    H.save(tmp_path, [2], dp=2, precision="rr")
    ckptool.reshard(str(tmp_path / "z2_rr"), str(tmp_path / "dp3"), to={"dp": 3})
    H.load(3, [(2, tmp_path / "dp3", tmp_path / "loaded.pt")], precision="rr")
    truth, got = torch.load(tmp_path / "z2_rr.truth.pt"), torch.load(tmp_path / "loaded.pt")
    assert got["global_steps"] == H.STEPS
    assert abs(got["loss"] - truth["loss"]) / abs(truth["loss"]) < 1e-5
    assert H.rel(got["module_after"], truth["module_after"]) < 1e-5


@pytest.mark.parametrize("stage", (1, 2))
def test_parameter_alignment_padding_is_laid_out_by_the_rule(tmp_path, stage):
    """parameter_alignment: zeros after each parameter up to 16 bytes. A bf16 DP2 checkpoint
    resharded to DP3 loads exactly (and the rule's paddings equal DeepSpeed's own)."""
    import ckptool
    from ckptool.checkpoints.open import open_checkpoint
    from converters.deepspeed.zero import Layout

    H.save(tmp_path, [stage], dp=2, precision="align")
    layout = open_checkpoint(str(tmp_path / f"z{stage}_align")).index.layout(Layout)
    assert layout.align == 8 and any(any(p) for p in layout.osd["param_alignment_paddings"])
    ckptool.reshard(str(tmp_path / f"z{stage}_align"), str(tmp_path / "dp3"), to={"dp": 3})
    H.load(3, [(stage, tmp_path / "dp3", tmp_path / "loaded.pt")], precision="align")
    truth, got = torch.load(tmp_path / f"z{stage}_align.truth.pt"), torch.load(tmp_path / "loaded.pt")
    H.assert_loaded_exactly(got, truth)
    assert abs(got["loss"] - truth["loss"]) / abs(truth["loss"]) < 1e-5


@pytest.mark.parametrize("edit,message", [
    ("three_groups", "3 param groups: only one group or the weight-decay split"),
    ("ambiguous", "do not match the model's weight-decay parameters in one way only"),
    ("amsgrad", "max_exp_avg_sq (amsgrad?) is not carried"),
])
def test_stage0_optimizer_that_cannot_be_named_is_refused(ds, run_cli, tmp_path, edit, message):
    """Stage 0 numbers parameters by position; a grouping ckptool cannot map by its rule, or
    can map in two ways, is refused with the reason, never guessed."""
    import shutil

    src = tmp_path / "z0"
    shutil.copytree(ds / "z0", src)
    path = src / "global_step2" / "mp_rank_00_model_states.pt"
    ms = torch.load(path, weights_only=False)  # our own test fixture
    groups = ms["optimizer"]["param_groups"]
    if edit == "three_groups":
        groups.append(dict(groups[1], params=groups[1]["params"][2:]))
        groups[1]["params"] = groups[1]["params"][:2]
    elif edit == "amsgrad":  # AdamW(amsgrad=True) keeps a third tensor per parameter
        for entry in ms["optimizer"]["state"].values():
            entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()
    else:  # fc1.weight given fc2.weight's shape and dropped: the state left fits either
        ms["module"]["fc1.weight"] = ms["module"]["fc2.weight"].clone()
        first = groups[0]["params"].pop(1)
        del ms["optimizer"]["state"][first]
    torch.save(ms, path)
    res = run_cli("reshard", src, tmp_path / "out", "--to-dp", "3")
    assert res.code == 2 and message in res.err, res.err
    assert not (tmp_path / "out").exists()


def test_a_legacy_stage1_checkpoint_is_refused_by_its_ds_version(ds, run_cli, tmp_path):
    """ZeRO-1 changed its partitioning in DeepSpeed 0.3.17; the reader keys on ds_version."""
    import shutil

    src = tmp_path / "z1"
    shutil.copytree(ds / "z1", src)
    for path in (src / "global_step2").glob("*optim_states.pt"):
        sd = torch.load(path, weights_only=False)  # our own test fixture
        sd["optimizer_state_dict"]["ds_version"] = sd["ds_version"] = "0.3.16"
        torch.save(sd, path)
    res = run_cli("inspect", src)
    assert res.code == 2 and "legacy stage-1 partitioning" in res.err, res.err


def test_unique_subsequence_matches_brute_force():
    """The stage-0 name mapping's one-way-only rule, against counting every embedding."""
    import itertools
    import random

    from converters.deepspeed.engine import _unique_subsequence

    rng = random.Random(0)
    for _ in range(2000):
        pool = [rng.randint(0, 2) for _ in range(rng.randint(0, 8))]
        want = [rng.randint(0, 2) for _ in range(rng.randint(0, len(pool)))]
        found = [list(c) for c in itertools.combinations(range(len(pool)), len(want))
                 if all(pool[c[i]] == want[i] for i in range(len(want)))]
        assert _unique_subsequence(want, pool) == (found[0] if len(found) == 1 else None)


def test_zero_amsgrad_state_is_never_dropped_silently(ds, run_cli, tmp_path):
    """AdamW(amsgrad=True) keeps max_exp_avg_sq beside the moments: not carried, so refused
    (with --drop-optimizer named), never written without it."""
    import shutil

    src = tmp_path / "z2"
    shutil.copytree(ds / "z2", src)
    for path in (src / "global_step2").glob("*optim_states.pt"):
        sd = torch.load(path, weights_only=False)  # our own test fixture
        for entry in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()
        torch.save(sd, path)
    res = run_cli("reshard", src, tmp_path / "out", "--to-dp", "3")
    assert res.code == 2 and "max_exp_avg_sq (amsgrad?) is not carried" in res.err, res.err
    assert "--drop-optimizer" in res.err and not (tmp_path / "out").exists()
