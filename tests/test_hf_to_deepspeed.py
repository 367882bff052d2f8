"""Hugging Face -> DeepSpeed: ``ckptool convert HF DST --to deepspeed [--zero S --dp N
--init-optimizer]``, loaded by real DeepSpeed engines on CPU.

Without ``--init-optimizer`` the output is the module alone, which an engine loads with
``load_module_only=True``; with it, ZeRO-S files at DP N hold the fp32 masters (the HF
weights), zero Adam moments and step 0, which an engine loads with
``load_optimizer_states=False`` or reads whole (its hyperparameters put back). Either way the
engine then holds exactly what an engine built from the HF model itself holds, and its next
training step is the same. HF -> deepspeed -> HF is bit-exact.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import full_tensor, peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")
peer("transformers")

from tests.harness import deepspeed_engine as H  # noqa: E402

# (family, ZeRO stage, param groups, --init-optimizer)
# (family, ZeRO stage, param groups, how DeepSpeed loads it, precision of weights and engine):
# "module" = the module alone (no --init-optimizer), load_module_only=True; "fresh" =
# --init-optimizer, load_optimizer_states=False (ZeRO-3 then reads the masters from the files,
# ZeRO-1/2 from the module); "files" = --init-optimizer, every optimizer file read
CASES = [("llama", 2, "decay", "module", "fp32"), ("llama", 1, "decay", "files", "fp32"),
         ("llama", 3, "decay", "fresh", "fp32"), ("gpt2", 1, "single", "module", "fp32"),
         ("gpt2", 2, "single", "files", "fp32"), ("gpt2", 3, "decay", "files", "fp32"),
         ("llama", 2, "decay", "fresh", "bf16"), ("llama", 3, "decay", "files", "bf16"),
         # the family tables' parameter order is each model's own (QK norms, Phi-3's o_proj
         # first, Gemma 2's four norms and tied head, OLMo 2's post-norms)
         ("qwen3", 1, "decay", "files", "fp32"), ("phi3", 1, "single", "files", "fp32"),
         ("gemma2", 2, "decay", "files", "fp32"), ("olmo2", 3, "decay", "files", "fp32")]


def _hf(root, family, dtype=torch.float32):
    path = root / f"{family}_{str(dtype)[6:]}"
    if not path.exists():
        H.hf_model(family).to(dtype).save_pretrained(path)
    return path


def _convert(run_cli, src, dst, stage, groups, fresh, dp=2):
    args = ["convert", src, dst, "--to", "deepspeed", "--dp", str(dp)]
    if fresh:
        args += ["--zero", str(stage), "--init-optimizer", "--param-groups", groups]
    res = run_cli(*args)
    assert res.code == 0, res.err
    return res


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    from ckptool.ops.reshard import convert

    root = tmp_path_factory.mktemp("hf_ds")
    jobs = []
    for family, stage, groups, how, precision in CASES:
        fresh = how != "module"
        dst = root / f"{family}_z{stage}_{groups}_{how}_{precision}"
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        convert(str(_hf(root, family, dtype)), str(dst), to_format="deepspeed",
                to={"dp": 2, "zero": stage if fresh else None}, init_optimizer=fresh,
                options={"param_groups": groups if fresh else None})
        jobs.append((family, stage, groups, precision, dst, how, f"{dst}.result.pt"))
    H.hf_start(2, jobs)
    return {case: torch.load(job[-1]) for case, job in zip(CASES, jobs)}


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: "-".join(map(str, c)))
def test_deepspeed_starts_from_the_hf_weights_exactly(started, case):
    got = started[case]
    ref, loaded = got["reference"], got["loaded"]
    for name, value in ref["masters"].items():
        assert torch.equal(loaded["masters"][name], value), name
    assert torch.equal(loaded["logits"], ref["logits"])
    assert loaded["loss"] == ref["loss"]
    for name, value in ref["after"].items():  # the same first step: fresh Adam state, same grads
        assert torch.equal(loaded["after"][name], value), name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_hf_deepspeed_hf_is_bit_exact(run_cli, tmp_path, family, dtype, stage):
    from safetensors.torch import load_file

    src = _hf(tmp_path, family, dtype)
    _convert(run_cli, src, tmp_path / "ds", stage, "decay", bool(stage), dp=3)
    res = run_cli("convert", tmp_path / "ds", tmp_path / "back", "--to", "hf")
    assert res.code == 0, res.err
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == a[k].dtype and torch.equal(a[k], b[k]), k


def test_a_reshard_keeps_the_config_so_the_result_still_converts_back(run_cli, tmp_path):
    from safetensors.torch import load_file

    src = _hf(tmp_path, "gpt2", torch.bfloat16)
    _convert(run_cli, src, tmp_path / "ds", 2, "decay", True, dp=2)
    res = run_cli("reshard", tmp_path / "ds", tmp_path / "ds3", "--to-dp", "3", "--to-zero", "3")
    assert res.code == 0, res.err
    assert (tmp_path / "ds3" / "config.json").read_bytes() == (tmp_path / "ds" / "config.json").read_bytes()
    res = run_cli("convert", tmp_path / "ds3", tmp_path / "back", "--to", "hf")
    assert res.code == 0, res.err
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_fresh_state_is_zero_moments_and_masters_equal_to_the_weights(run_cli, tmp_path):
    from ckptool.checkpoints.open import open_checkpoint

    src = _hf(tmp_path, "llama", torch.bfloat16)
    res = _convert(run_cli, src, tmp_path / "ds", 2, "decay", True, dp=3)
    import re

    # read: the bf16 weights once for the module and once (counted as fp32) for the masters;
    # the zero moments (2 x 4 bytes per element) read nothing
    weights = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1024
    read = float(re.search(r"read ([\d.]+) KiB", res.out).group(1))
    assert 2.5 * weights < read < 3.1 * weights, res.out
    opened = open_checkpoint(str(tmp_path / "ds"))
    assert opened.index.topology.dp == 3 and opened.index.topology.zero == 2
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = full_tensor(opened, name)
    assert weight.dtype == torch.bfloat16
    master = full_tensor(opened, f"optimizer.state.fp32_param.{name}")
    assert master.dtype == torch.float32 and torch.equal(master, weight.float())
    for kind in ("exp_avg", "exp_avg_sq"):
        assert not full_tensor(opened, f"optimizer.state.{kind}.{name}").any()


def test_refusals_name_the_fix(run_cli, tmp_path):
    src = _hf(tmp_path, "gpt2")
    res = run_cli("convert", src, tmp_path / "a", "--to", "deepspeed", "--zero", "2")
    assert res.code == 2 and "--init-optimizer" in res.err, res.err
    res = run_cli("convert", src, tmp_path / "b", "--to", "deepspeed", "--init-optimizer")
    assert res.code == 2 and "--zero" in res.err, res.err
    res = run_cli("convert", src, tmp_path / "c", "--to", "megatron", "--init-optimizer")
    assert res.code == 2 and "--finetune" in res.err, res.err
    _convert(run_cli, src, tmp_path / "ds", 2, "decay", True)
    res = run_cli("convert", tmp_path / "ds", tmp_path / "d", "--to", "hf", "--init-optimizer")
    assert res.code == 2 and "does not apply to hf" in res.err, res.err
    res = run_cli("convert", src, tmp_path / "e", "--to", "deepspeed", "--tp", "2")
    assert res.code == 2 and "TP2" in res.err, res.err
    res = run_cli("convert", src, tmp_path / "f", "--to", "deepspeed", "--param-groups", "single")
    assert res.code == 2 and "--param-groups applies to a fresh optimizer state" in res.err, res.err
    half = _hf(tmp_path, "llama", torch.float16)
    res = run_cli("convert", half, tmp_path / "g", "--to", "deepspeed", "--zero", "2", "--init-optimizer")
    assert res.code == 2 and "dynamic loss scaler" in res.err and "load_module_only" in res.err, res.err
    assert run_cli("convert", half, tmp_path / "module", "--to", "deepspeed").code == 0
    for name in "abcdefg":
        assert not (tmp_path / name).exists()
