"""DeepSpeed universal checkpoints: written from real ZeRO-1/2/3 checkpoints, loaded by
real DeepSpeed with ``load_universal`` at other DP sizes and stages, equal to DeepSpeed's
own ``ds_to_universal.py``, and read back (ckptool's and ds_to_universal's).

The ZeRO checkpoints are written at DP=2 by ``tests/harness/deepspeed_engine.py``; the loads run in
``tests/harness/deepspeed_universal.py``. A load must give every fp32 master and Adam moment of
the source bit for bit, and one more step on the same global batch must give the loss and
parameters of the run that continued without stopping.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import convert_to_torch, peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")

from tests.harness import deepspeed_engine as H  # noqa: E402
from tests.harness import deepspeed_universal as U  # noqa: E402

FORMAT = "deepspeed-universal"
STAGES = (1, 2, 3)
LOADS = {  # DP size -> (stage the engine runs, universal made from the ZeRO-s run)
    3: [(1, 1), (2, 2), (3, 3), (3, 1)],  # ZeRO-1 -> 3: the plain reshard cannot do it
    1: [(2, 3), (1, 2)],
}
CASES = [(dp, stage, src) for dp, jobs in LOADS.items() for stage, src in jobs]


def _tag(run) -> str:
    return (run / "latest").read_text().strip()


@pytest.fixture(scope="module")
def ucp(tmp_path_factory):
    """ZeRO-s runs ``z{s}`` at DP=2, ckptool's universal ``c{s}``, ds_to_universal's
    ``u{s}``, what DeepSpeed loaded from ckptool's (``{dp}_{stage}_{src}.loaded.pt``), and
    an HF model trained with ZeRO-2 (``llama_z2``, HF Trainer layout)."""
    import ckptool

    root = tmp_path_factory.mktemp("universal")
    H.save(root, STAGES, dp=2)
    for s in STAGES:
        ckptool.convert(str(root / f"z{s}"), str(root / f"c{s}"), to_format=FORMAT)
    U.ds_to_universal([(root / f"z{s}" / _tag(root / f"z{s}"), root / f"u{s}" / _tag(root / f"z{s}"))
                       for s in STAGES])
    for dp, jobs in LOADS.items():
        U.load(dp, [(stage, root / f"c{src}", root / f"{dp}_{stage}_{src}.loaded.pt")
                    for stage, src in jobs])
    H.save_hf(root, [("llama", 2, "fp32")])
    return root


@pytest.mark.parametrize("dp,stage,src", CASES, ids=[f"z{s}-to-dp{d}-zero{t}" for d, t, s in CASES])
def test_deepspeed_loads_it_at_any_dp_and_stage_and_continues_the_run(ucp, dp, stage, src):
    truth = torch.load(ucp / f"z{src}.truth.pt")
    got = torch.load(ucp / f"{dp}_{stage}_{src}.loaded.pt")
    H.assert_loaded_exactly(got, truth)  # every fp32 master, moment and frozen param
    assert got["global_steps"] == H.STEPS
    assert abs(got["loss"] - truth["loss"]) / abs(truth["loss"]) < 1e-5
    assert H.rel(got["after"], truth["after"]) < 1e-5


def _zero(run):
    return run / (run / "latest_universal").read_text().strip() / "zero"


def _zero_files(run) -> dict:
    return {str(p.relative_to(_zero(run))): p for p in _zero(run).glob("*/*.pt")}


@pytest.mark.parametrize("stage", STAGES)
def test_equals_deepspeeds_own_ds_to_universal(ucp, stage):
    theirs, ours = _zero_files(ucp / f"u{stage}"), _zero_files(ucp / f"c{stage}")
    assert len(theirs) > 20
    for rel, path in theirs.items():
        a, b = torch.load(path, weights_only=False), torch.load(ours[rel], weights_only=False)
        if isinstance(a, dict):  # ZeRO-1/2: {"cat_dim": 0, "param": ...} / {"param": ...}
            assert a.keys() == b.keys(), rel
            a, b = a["param"], b["param"]
        elif isinstance(b, dict):  # ZeRO-3: a bare flat tensor; ours as every stage loads it
            b = b["param"]
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1), b.reshape(-1)), rel
    extra = set(ours) - set(theirs)
    if stage < 3:
        assert not extra
    else:  # ds_to_universal keeps no step (ZeRO-1/2 loaders need it) nor the other module entries
        assert extra == {f"{n}/step.pt" for n in ("emb.weight", "fc1.weight", "fc2.weight", "fc1.bias",
                                                  "fc2.bias", "norm.weight", "norm.bias")} \
            | {"head.weight/fp32.pt", "shift/fp32.pt", "scale/fp32.pt"}
    groups = [torch.load(_zero(ucp / f"{kind}{stage}") / "optimizer_state.pt",
                         weights_only=False)["param_groups"] for kind in "uc"]
    assert groups[0] == groups[1]


def _dcp_tensors(run_cli, src, dst) -> dict:
    loaded = convert_to_torch(run_cli, src, dst)
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("stage", STAGES)
def test_reads_ds_to_universal_and_its_own_output(ucp, run_cli, tmp_path, stage):
    """Both universal checkpoints convert to the ZeRO source's global view, bit for bit."""
    import json

    source = _dcp_tensors(run_cli, ucp / f"z{stage}", tmp_path / "z")
    for name in (f"u{stage}", f"c{stage}"):
        info = json.loads(run_cli("inspect", ucp / name, "--json").out)
        assert (info["format"], info["iteration"]) == (FORMAT, H.STEPS)
        res = run_cli("verify", ucp / name, "--deep")
        assert res.code == 0 and ("committed" if name[0] == "c" else "unsealed") in res.out, res.err
        got = _dcp_tensors(run_cli, ucp / name, tmp_path / name)
        assert got.keys() == source.keys()
        assert all(torch.equal(got[k], v) for k, v in source.items())


@pytest.mark.parametrize("args,message,code", [
    (("convert", "c1", "--to", FORMAT), "written only from a DeepSpeed ZeRO-1/2/3 checkpoint", 2),
    (("convert", "z1", "--to", FORMAT, "--dp", "3"), "--dp does not apply to deepspeed-universal", 2),
    (("convert", "z2", "--to", FORMAT, "--drop-optimizer"), "--drop-optimizer cannot apply", 2),
    (("convert", "broken", "--to", "dcp"), "file is missing", 1),
])
def test_bad_input_one_line_and_nothing_written(ucp, run_cli, tmp_path, args, message, code):
    import shutil

    broken = ucp / "broken"
    if not broken.exists():
        shutil.copytree(ucp / "u2", broken)
        (broken / _tag(ucp / "z2") / "zero" / "fc1.weight" / "exp_avg.pt").unlink()
    command, src, *rest = args
    dst = tmp_path / "out"
    res = run_cli(command, ucp / src, dst, *rest)
    assert res.code == code, res.err
    assert message in res.err and len(res.err.strip().splitlines()) == 1, res.err
    assert not dst.exists() and not list(tmp_path.iterdir())


def test_hf_model_run_converts_to_hf_through_universal(ucp, run_cli, tmp_path):
    """An HF Trainer run (config.json beside latest): its universal checkpoint keeps the
    module's names and carries config.json beside latest_universal, so it converts on to an
    HF model whose logits are the trainer's."""
    from transformers import AutoModelForCausalLM

    res = run_cli("convert", ucp / "llama_z2", tmp_path / "u", "--to", FORMAT)
    assert res.code == 0, res.err
    assert (tmp_path / "u" / "config.json").read_bytes() == (ucp / "llama_z2" / "config.json").read_bytes()
    res = run_cli("convert", tmp_path / "u", tmp_path / "hf", "--to", "hf")
    assert res.code == 0, res.err
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=H.hf_tokens(model.config.vocab_size, H.NEXT_STEP)).logits
    assert torch.equal(logits, torch.load(ucp / "llama_z2.logits.pt"))


def test_zero1_written_from_a_zero3_run_feeds_deepspeeds_ds_to_universal(ucp, tmp_path):
    """ZeRO-1/2 files written from a ZeRO-3 (or stage-0) source lacked ``param_slice_mappings``,
    which DeepSpeed's loader does not need and its ds_to_universal does (KeyError). Now
    ds_to_universal reads them, and what it makes equals what it made from the ZeRO-3 run."""
    import ckptool

    z1 = tmp_path / "z1-from-z3"
    ckptool.reshard(str(ucp / "z3"), str(z1), to={"zero": 1})
    tag = _tag(z1)
    U.ds_to_universal([(z1 / tag, tmp_path / "u" / tag)])
    (tmp_path / "u" / "latest_universal").write_text(tag)
    ours, theirs = _zero_files(tmp_path / "u"), _zero_files(ucp / "u3")
    assert len(theirs) > 20 and set(theirs) <= set(ours)
    for rel, path in theirs.items():
        a, b = torch.load(path, weights_only=False), torch.load(ours[rel], weights_only=False)
        a, b = (x["param"] if isinstance(x, dict) else x for x in (a, b))
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1), b.reshape(-1)), rel
