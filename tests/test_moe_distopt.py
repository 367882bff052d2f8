"""Mixture of Experts with Megatron-Core's distributed optimizer (issue #18): real mcore MoE
runs (DDP + DistributedOptimizer over gloo, one Adam step from seeded gradients) saved in
Megatron-LM's legacy layout, where at EP > 1 the experts have an optimizer of their own
(ChainedOptimizer: ``distrib_optim.pt`` and ``optimizer`` are lists [dense, expert]).
ckptool reshards across EP; mcore's own loader reads the output at the new topology and
its masters and moments are bit-equal to the saved run's.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import peer

peer("megatron.core")

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


@pytest.mark.parametrize("case,to_ep", [("ep2", 1), ("ep1", 2), ("ep2", 2), ("ep2_bf16", 1)])
def test_reshard_across_ep_loads_in_megatron_core_bit_equal(runs, case, to_ep, tmp_path, run_cli):
    """EP2 -> EP1: the expert optimizer's state joins the dense buffer; EP1 -> EP2: it
    leaves it for a ChainedOptimizer of its own; mcore's load_state_dict and
    load_parameter_state take the output at the new EP, masters and moments bit-equal."""
    dst = tmp_path / "out"
    r = run_cli("reshard", runs / case, dst, "--to-ep", to_ep, "--to-dp", 2,
                "--true-vocab-size", H.MOE["vocab_size"])
    assert r.code == 0, r.err
    names = sorted(p.name for p in (dst / "iter_0000001").iterdir())
    assert names == (["mp_rank_00"] if to_ep == 1 else ["mp_rank_00_000", "mp_rank_00_001"])
    loaded, = H.load([dst])
    assert {d["ep"] for d in loaded} == set(range(to_ep))
    assert_equal_states(H.canonical_state(loaded), H.canonical_state(H.truth(runs, case)))
    assert run_cli("verify", "--deep", dst).code == 0


def test_the_same_step_at_ep1_and_ep2_gives_the_same_state(runs, tmp_path, run_cli):
    """The harness's own check that the comparison means something: the EP1 and EP2 runs of
    the same global model and gradients hold the same state, and a resharded EP2 run equals
    the EP1 run; a swap of two experts' moments in the file is caught."""
    ep1, ep2 = (H.canonical_state(H.truth(runs, c)) for c in ("ep1", "ep2"))
    assert_equal_states(ep2, ep1)
    bad = tmp_path / "bad"
    import shutil
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
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(runs / "ep2", bad)
    f = bad / "iter_0000001" / "mp_rank_00_001" / "distrib_optim.pt"
    states = torch.load(f, weights_only=False)
    torch.save([states[0], None], f)
    r = run_cli("reshard", bad, tmp_path / "out", "--to-ep", 1, "--to-dp", 2)
    assert r.code == 2 and "holds no expert optimizer state" in r.err and "Traceback" not in r.err, r.err
    assert not (tmp_path / "out").exists()


def test_torch_dist_with_the_chained_optimizer_is_refused_not_half_written(runs, tmp_path, run_cli):
    r = run_cli("convert", runs / "ep2", tmp_path / "dist", "--to", "megatron-dist", "--ep", 2, "--dp", 2)
    assert r.code == 2 and "not written as torch_dist yet" in r.err, r.err
    assert not (tmp_path / "dist").exists()
