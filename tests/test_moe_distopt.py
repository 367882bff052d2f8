"""Mixture of Experts with Megatron-Core's distributed optimizer (issue #18): real mcore MoE
runs (DDP + DistributedOptimizer over gloo, one Adam step from seeded gradients) saved in
Megatron-LM's legacy layout, where at EP > 1 the experts have an optimizer of their own
(ChainedOptimizer: ``distrib_optim.pt`` and ``optimizer`` are lists [dense, expert]).
ckptool reshards across EP; mcore's own loader reads the output at the new topology and
its masters and moments are bit-equal to the saved run's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import peer

peer("megatron.core")

from tests.harness import mcore_moe_dist_distopt as HD  # noqa: E402
from tests.harness import mcore_moe_distopt as H  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_distopt")
    H.generate(root)
    return root


def assert_equal_states(got: dict, want: dict):
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
    for key in want:
        assert torch.equal(got[key], want[key]), key


RESHARDS = [
    ("ep2", dict(ep=1, dp=2)), ("ep1", dict(ep=2, dp=2)), ("ep2", dict(ep=2, dp=2)),
    ("ep2_bf16", dict(ep=1, dp=2)),
    # expert TP other than TP: TP2/ETP1/EP2 (files (tp0, ep0), (tp1, ep1)) to TP1, and back
    ("tp2_etp1_ep2", dict(tp=1, ep=2, dp=2)), ("ep1", dict(tp=2, etp=1, ep=2, dp=1)),
    ("tp2_ep1", dict(tp=1, ep=1, dp=2)), ("ep1", dict(tp=2, ep=1, dp=1)),
    # Megatron's non-distributed optimizer: a ChainedOptimizer of FP32Optimizers at EP2
    ("ep2_plain", dict(ep=1, dp=2)), ("ep1_plain", dict(ep=2, dp=2)),
]


@pytest.mark.parametrize("case,to", RESHARDS, ids=[f"{c}-to-" + "-".join(f"{k}{v}" for k, v in t.items())
                                                  for c, t in RESHARDS])
def test_reshard_loads_in_megatron_core_bit_equal_and_steps_on(runs, case, to, tmp_path, run_cli):
    """Across EP (the expert optimizer's state joins the dense buffer, or leaves it for a
    ChainedOptimizer of its own), TP and ETP: mcore's load_state_dict (and
    load_parameter_state) take the output at the new topology, masters and moments
    bit-equal, and the next step's loss is the uninterrupted run's."""
    dst = tmp_path / "out"
    args = [a for k, v in to.items() for a in (f"--to-{k}", v)]
    r = run_cli("reshard", runs / case, dst, *args, "--true-vocab-size", H.MOE["vocab_size"])
    assert r.code == 0, r.err
    tp, ep = to.get("tp", 1), to["ep"]
    names = sorted(p.name for p in (dst / "iter_0000001").iterdir())
    assert names == sorted(f"mp_rank_{t:02d}" + (f"_{e:03d}" if ep > 1 else "") for t in range(tp) for e in range(ep))
    loaded, = H.load([dst])
    assert {(d["tp"], d["ep"]) for d in loaded} <= {(t, e) for t in range(tp) for e in range(ep)}
    assert {d["ep"] for d in loaded} == set(range(ep)) and {d["tp"] for d in loaded} == set(range(tp))
    saved = H.truth(runs, case)
    assert_equal_states(H.canonical_state(loaded), H.canonical_state(saved))
    want = saved[0]["next_loss"]
    assert abs(loaded[0]["next_loss"] - want) / abs(want) < 1e-5
    assert run_cli("verify", "--deep", dst).code == 0


def test_the_same_step_at_ep1_and_ep2_gives_the_same_state(runs, tmp_path, run_cli):
    """The harness's own check that the comparison means something: the runs of the same
    global model and gradients at every topology and with either optimizer hold the same
    state; a swap of two experts' moments in the file is caught."""
    ep1 = H.canonical_state(H.truth(runs, "ep1"))
    for case in ("ep2", "tp2_etp1_ep2", "tp2_ep1", "ep1_plain", "ep2_plain"):
        assert_equal_states(H.canonical_state(H.truth(runs, case)), ep1)
    bad = tmp_path / "bad"
    shutil.copytree(runs / "ep2", bad)
    f = bad / "iter_0000001" / "mp_rank_00_000" / "distrib_optim.pt"
    states = torch.load(f, weights_only=False)
    (key, vectors), = states[1][0].items()
    half = vectors["exp_avg"].numel() // 2  # layer 1's experts and layer 0's change places
    vectors["exp_avg"] = torch.cat([vectors["exp_avg"][half:], vectors["exp_avg"][:half]])
    torch.save(states, f)
    dst = tmp_path / "out"
    assert run_cli("reshard", bad, dst, "--to-ep", 1, "--to-dp", 2).code == 0
    got = H.canonical_state(H.load([dst])[0])
    assert any(not torch.equal(got[k], ep1[k]) for k in ep1 if k[0] == "exp_avg")


def test_inspect_reads_the_chained_optimizer(runs, run_cli):
    report = json.loads(run_cli("inspect", runs / "ep2", "--json").out)
    assert report["topology"]["ep"] == 2
    # 13 dense parameters and the 4 stacked expert tensors, each with master and moments
    assert "fp32_param of 17 parameters" in report["optimizer"], report["optimizer"]


def test_a_missing_expert_state_is_a_clear_refusal(runs, tmp_path, run_cli):
    """A file of the EP rank 1 directory without its expert optimizer state: nothing else
    holds those experts' moments, so the optimizer is not mapped (never half-written)."""
    bad = tmp_path / "bad"
    shutil.copytree(runs / "ep2", bad)
    f = bad / "iter_0000001" / "mp_rank_00_001" / "distrib_optim.pt"
    states = torch.load(f, weights_only=False)
    torch.save([states[0], None], f)
    r = run_cli("reshard", bad, tmp_path / "out", "--to-ep", 1, "--to-dp", 2)
    assert r.code == 2 and "holds no expert optimizer state" in r.err and "Traceback" not in r.err, r.err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ torch_dist


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    """The same runs saved by Megatron-LM's torch_dist save (ChainedOptimizer at EP > 1), in
    both distributed-optimizer forms."""
    root = tmp_path_factory.mktemp("moe_dist_distopt")
    HD.generate(root, HD.cases(("ep2", "ep1"), HD.FORMS))
    return root


@pytest.mark.parametrize("form", ["dp_reshardable", "fully_reshardable"])
@pytest.mark.parametrize("case,to", [("ep2", 1), ("ep1", 2), ("ep2", 2)])
def test_torch_dist_reshards_across_ep_and_loads_in_megatron_core(dist_runs, case, to, form, tmp_path, run_cli):
    """Megatron-Core itself does not load its EP2 torch_dist optimizer at EP1 or the other way
    (dp_reshardable: chained_0./chained_1. bucket keys per expert-parallel group; fully_reshardable:
    the chained {0, 1} param groups against one optimizer's); ckptool's output at the new EP
    loads through Megatron-LM's torch_dist load path, bit-equal, the same next loss."""
    src = dist_runs / f"{case}-{form}"
    dst = tmp_path / "out"
    r = run_cli("reshard", src, dst, "--to-ep", to, "--to-dp", 2)
    assert r.code == 0, r.err
    loaded, = HD.load([dst])  # Megatron-LM's default flags: the args say no_save_rng
    saved = HD.truth(dist_runs, f"{case}-{form}")
    assert {d["ep"] for d in loaded} == set(range(to))
    assert_equal_states(H.canonical_state(loaded), H.canonical_state(saved))
    assert abs(loaded[0]["next_loss"] - saved[0]["next_loss"]) / abs(saved[0]["next_loss"]) < 1e-5


def test_torch_dist_and_legacy_distributed_optimizers_convert_into_each_other(
        runs, dist_runs, tmp_path, run_cli):
    """torch_dist (EP2) -> legacy at EP1, and legacy (EP2) -> torch_dist at EP2, each loaded by
    mcore's own loader of the target format, bit-equal."""
    legacy = tmp_path / "legacy"
    r = run_cli("convert", dist_runs / "ep2-fully_reshardable", legacy, "--to", "megatron", "--ep", 1, "--dp", 2)
    assert r.code == 0, r.err
    want = H.canonical_state(HD.truth(dist_runs, "ep2-fully_reshardable"))
    assert_equal_states(H.canonical_state(H.load([legacy])[0]), want)
    dist = tmp_path / "dist"
    r = run_cli("convert", runs / "ep2", dist, "--to", "megatron-dist", "--ep", 2, "--dp", 2)
    assert r.code == 0, r.err
    loaded, = HD.load([dist])
    assert_equal_states(H.canonical_state(loaded), H.canonical_state(H.truth(runs, "ep2")))


def test_chained_buckets_that_do_not_fit_the_args_are_refused_and_the_weights_still_convert(
        dist_runs, tmp_path, run_cli):
    """dp_reshardable buckets laid out for other DDP buckets than the args say: the optimizer
    is not mapped (refused, naming it, nothing written); --drop-optimizer drops its
    chained_0./chained_1. tensors and carries the weights."""
    src = tmp_path / "src"
    shutil.copytree(dist_runs / "ep2-dp_reshardable", src)
    common = src / "iter_0000001" / "common.pt"
    state = torch.load(common, weights_only=False)
    vars(state["args"]).update(overlap_grad_reduce=True, ddp_bucket_size=4000)
    torch.save(state, common)
    r = run_cli("reshard", src, tmp_path / "out", "--to-ep", 1, "--to-dp", 2)
    assert r.code == 2 and "Megatron's layout rule gives" in r.err and "--drop-optimizer" in r.err, r.err
    assert not (tmp_path / "out").exists()
    r = run_cli("reshard", src, tmp_path / "w", "--to-ep", 1, "--to-dp", 2, "--drop-optimizer")
    assert r.code == 0, r.err


# ------------------------------------------------------------------- the training hook


@pytest.fixture(scope="module")
def hook_run(tmp_path_factory):
    """The ep2 run (ChainedOptimizer, distributed) saved through the training hook, described
    by Megatron-Core's own sharded_state_dict, with Megatron's opt_param_scheduler state."""
    root = tmp_path_factory.mktemp("moe_hook")
    HD.hook_save(root / "ep2", HD.CASES["ep2-fully_reshardable"])
    return root


@pytest.mark.parametrize("ep", [1, 2])
def test_hook_checkpoint_converted_loads_through_megatron_lm_default_flags(hook_run, ep, tmp_path, run_cli):
    """``ckptool convert STEP --to megatron-dist`` of the hook's checkpoint, loaded by
    Megatron-LM 0.16.1's torch_dist ``load_checkpoint`` logic with default flags (args check,
    no --no-load-rng, the optimizer and its opt_param_scheduler, which the hook stored one
    object per field) at EP1 and EP2: bit-equal masters and moments, the same next loss."""
    import ckptool

    step = ckptool.latest(str(hook_run / "ep2")).path
    r = run_cli("verify", step, "--deep")
    assert r.code == 0, r.out + r.err
    dst = tmp_path / "dist"
    r = run_cli("convert", step, dst, "--to", "megatron-dist", "--to-ep", ep, "--to-dp", 2)
    assert r.code == 0, r.err
    case = dict(HD.CASES["ep2-fully_reshardable"], ep=ep)
    loaded, = HD.load([dst], at=case)
    saved = [torch.load(hook_run / "ep2.truth" / f"rank{r}.pt", weights_only=False)
             for r in range(HD.WORLD)]
    assert {d["ep"] for d in loaded} == set(range(ep))
    assert_equal_states(H.canonical_state(loaded), H.canonical_state(saved))
    assert loaded[0]["next_loss"] == pytest.approx(saved[0]["next_loss"], rel=1e-5)
