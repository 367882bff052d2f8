"""DeepSpeed's own MoE (``deepspeed.moe.layer.MoE``, issue #18): real engines on CPU (gloo) at
EP1/EP2 over DP2, ZeRO-1/2, one AdamW step, saved by ``engine.save_checkpoint``. DeepSpeed
itself loads such a checkpoint only at the EP and DP it was saved at; ckptool reshards it to
another EP, DP or ZeRO stage, and DeepSpeed's own ``load_checkpoint`` at the new topology
holds the saved weights, fp32 masters and Adam moments bit for bit and takes the same next step.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import peer

peer("deepspeed")

from tests.harness import deepspeed_moe_ep as H  # noqa: E402

STATE = ("param", "master", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_moe")
    for ep in (1, 2):
        H.save(root / f"ep{ep}", ep=ep)
    return root


def state(dumps) -> dict:
    return {k: v for k, v in H.canonical(dumps).items() if k[0] in STATE}


def assert_same(got: dict, want: dict):
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_deepspeed_itself_loads_only_at_the_saved_ep(runs):
    """The wall ckptool takes down: DeepSpeed refuses its EP2 checkpoint at EP1."""
    dumps = H.load(runs / "ep2", ep=1)
    assert "parameter-alignment layout does not match" in dumps[0]["error"], dumps[0]["error"]


RESHARDS = [("ep2", dict(ep=1, dp=2)), ("ep1", dict(ep=2, dp=2)), ("ep2", dict(ep=2, dp=2, zero=2)),
            ("ep2", dict(ep=1, dp=1)), ("ep2", dict(ep=4, dp=4)), ("ep1", dict(ep=2, dp=4))]


@pytest.mark.parametrize("case,to", RESHARDS, ids=[f"{c}-to-" + "-".join(f"{k}{v}" for k, v in t.items())
                                                  for c, t in RESHARDS])
def test_reshard_loads_in_deepspeed_bit_equal_and_steps_on(runs, case, to, tmp_path, run_cli):
    dst = tmp_path / "out"
    r = run_cli("reshard", runs / case, dst, *[a for k, v in to.items() for a in (f"--to-{k}", v)])
    assert r.code == 0, r.err
    files = sorted(p.name for p in (dst / H.TAG).iterdir())
    assert [f for f in files if f.startswith("layer_")] == \
        [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(H.NUM_EXPERTS)]
    assert sum(f.startswith("zero_pp_rank_") for f in files) == to["dp"]
    loaded = H.load(dst, ep=to["ep"], dp=to["dp"], zero=to.get("zero", 1))
    assert not loaded[0].get("error"), loaded[0]["error"]
    saved = H.truth(runs / case)
    assert_same(state(loaded), state(saved))
    want = saved[0]["loss"]
    assert abs(loaded[0]["loss"] - want) / abs(want) < 1e-5
    assert run_cli("verify", "--deep", dst).code == 0


def test_the_same_step_at_ep1_and_ep2_gives_the_same_state(runs, tmp_path, run_cli):
    """What the comparison means: the EP1 and EP2 runs of the same global model hold the same
    state but for float summation order; two experts' files swapped are caught."""
    ep1, ep2 = state(H.truth(runs / "ep1")), state(H.truth(runs / "ep2"))
    assert set(ep1) == set(ep2)
    assert max((ep1[k] - ep2[k]).abs().max().item() for k in ep1) < 1e-6
    bad = tmp_path / "bad"
    shutil.copytree(runs / "ep2", bad)
    a, b = (bad / H.TAG / f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in (0, 3))
    sa, sb = torch.load(a), torch.load(b)
    torch.save({k.replace(".3.", ".0.", 1): v for k, v in sb.items()}, a)
    torch.save({k.replace(".0.", ".3.", 1): v for k, v in sa.items()}, b)
    dst = tmp_path / "out"
    assert run_cli("reshard", bad, dst, "--to-ep", 1).code == 0
    got = state(H.load(dst, ep=1))
    want = state(H.truth(runs / "ep2"))
    assert any(not torch.equal(got[k], want[k]) for k in want if k[0] == "param")


def test_inspect_shows_the_experts(runs, run_cli):
    report = json.loads(run_cli("inspect", runs / "ep2", "--json").out)
    assert report["topology"]["ep"] == 2 and report["topology"]["dp"] == 2
    # 3 dense + 4 experts x 4 parameters, each with its fp32 master and two moments
    assert report["tensor_count"] == 19 * 4


@pytest.mark.parametrize("args,says", [(("--to-ep", 3, "--to-dp", 3), "must be divisible by EP (3)"),
                                       (("--to-zero", 3), "written at ZeRO-1/2")])
def test_impossible_targets_are_refused_before_anything_is_written(runs, tmp_path, run_cli, args, says):
    dst = tmp_path / "out"
    r = run_cli("reshard", runs / "ep2", dst, *args)
    assert r.code == 2 and says in r.err and "Traceback" not in r.err, r.err
    assert not dst.exists()


def test_a_stage0_moe_engine_is_refused_not_half_read(tmp_path, run_cli):
    src = tmp_path / "z0"
    H.save(src, ep=2, zero=0)
    r = run_cli("reshard", src, tmp_path / "out", "--to-ep", 1)
    assert r.code == 2 and "ZeRO-1/2 only" in r.err and "Traceback" not in r.err, r.err
    assert not (tmp_path / "out").exists()
