"""Mixture of Experts (issue #18), first slice: expert parallelism as a layout rule, the
legacy Megatron layout with experts (``mp_rank_TT[_PPP]_EEE``, ``local_experts.{j}``),
resharded across EP and TP and proven by real megatron-core MoE models (SequentialMLP
experts, on CPU over gloo) that load the output strictly and give the original logits.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import peer

peer("megatron.core")

from tests.harness import mcore_moe as M  # noqa: E402


def assert_close(a, b, atol=1e-4):
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a - b).abs().max().item()
    assert diff < atol, diff


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """A real MoE GPTModel at TP1/EP2, its router and every expert randomised, saved by
    Megatron-LM's legacy layout, and its logits."""
    root = tmp_path_factory.mktemp("moe") / "ep2"
    return root, M.save_moe(M.MOE, 1, 2, root)


@pytest.mark.parametrize("to", [dict(tp=1, ep=1), dict(tp=2, ep=1), dict(tp=2, ep=2), dict(tp=1, ep=4)])
def test_reshard_across_ep_and_tp_loads_in_megatron_core_with_the_same_logits(ep2, to, tmp_path, run_cli):
    src, want = ep2
    dst = tmp_path / "out"
    r = run_cli("reshard", src, dst, "--to-tp", to["tp"], "--to-ep", to["ep"], "--to-dp", to["ep"],
                "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 0, r.err
    assert_close(M.load_moe_logits(M.MOE, to["tp"], to["ep"], dst), want)
    back = tmp_path / "back"
    r = run_cli("reshard", dst, back, "--to-tp", 1, "--to-ep", 2, "--to-dp", 2)
    assert r.code == 0, r.err
    assert_close(M.load_moe_logits(M.MOE, 1, 2, back), want)
    assert run_cli("verify", "--deep", back).code == 0


def test_two_experts_swapped_are_caught(ep2, tmp_path, run_cli):
    """The same check fails when two experts change places (the test can fail)."""
    src, want = ep2
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    f = bad / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    model = state["model"]
    for w in ("linear_fc1.weight", "linear_fc2.weight"):
        a, b = (f"decoder.layers.0.mlp.experts.local_experts.{j}.{w}" for j in (0, 1))
        model[a], model[b] = model[b], model[a]
    torch.save(state, f)
    dst = tmp_path / "out"
    assert run_cli("reshard", bad, dst, "--to-ep", 1, "--to-dp", 1,
                   "--true-vocab-size", M.MOE["vocab_size"]).code == 0
    got = M.load_moe_logits(M.MOE, 1, 1, dst)
    assert (got - want).abs().max().item() > 1e-3


def test_inspect_shows_the_expert_layout(ep2, run_cli):
    import json

    src, _ = ep2
    report = json.loads(run_cli("inspect", src, "--json").out)
    assert report["topology"]["ep"] == 2
    assert report["model_config"]["num_experts"] == M.MOE["num_experts"]


@pytest.mark.parametrize("args,says", [
    (("--to-ep", 3, "--to-dp", 3), "4 experts must be divisible by EP (3)"),
    (("--to-ep", 4, "--to-dp", 2), "must divide dp"),
])
def test_impossible_ep_targets_are_refused_before_anything_is_written(ep2, tmp_path, run_cli, args, says):
    src, _ = ep2
    dst = tmp_path / "out"
    r = run_cli("reshard", src, dst, *args)
    assert r.code == 2 and says in r.err and "Traceback" not in r.err, r.err
    assert not dst.exists()


@pytest.mark.parametrize("target", ["hf", "dcp"])
def test_outputs_without_megatron_args_refuse_experts(ep2, tmp_path, run_cli, target):
    """The router's settings live in Megatron args only: an output without them is refused."""
    src, _ = ep2
    dst = tmp_path / "out"
    r = run_cli("convert", src, dst, "--to", target, "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 2 and "num_experts=4" in r.err and "Traceback" not in r.err, r.err
    assert not dst.exists()
