"""Hugging Face models trained by DeepSpeed (what the HF Trainer and accelerate save):
``ckptool convert --to hf`` gives a model that transformers loads with no missing or
unexpected keys and the same logits, its weights bit-equal to DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint``; the same checkpoint converts to Megatron.

The module's names are the HF model's, so ckptool reads them through the hf schema
(``converters.schemas.hf.named_view``), with ``config.json`` beside ``latest`` as the HF Trainer
lays it out.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")
peer("transformers")

from tests.harness import deepspeed_engine as H  # noqa: E402
from tests.harness.hf import load_hf  # noqa: E402

FAMILIES = ("llama", "gpt2")
STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_hf")
    H.save_hf(root, [(f, s, "fp32") for f in FAMILIES for s in STAGES] +
              [("llama", s, "bf16") for s in (2, 3)])
    return root


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_to_hf_loads_with_the_same_logits(runs, run_cli, tmp_path, family, stage):
    src, out = runs / f"{family}_z{stage}", tmp_path / "hf"
    res = run_cli("convert", src, out, "--to", "hf", "--dtype", "fp32")
    assert res.code == 0, res.err
    assert_is_the_trained_module(out, src, family)


def assert_is_the_trained_module(out, src, family: str):
    """The HF model at ``out`` loads strictly, gives the DeepSpeed module's logits, and its
    weights are bit-equal to DeepSpeed's own zero_to_fp32; returns it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = load_hf(out, attn_implementation="eager")
    vocab = H.HF_CONFIGS[family]["vocab_size"]
    with torch.no_grad():
        logits = model(input_ids=H.hf_tokens(vocab, H.NEXT_STEP)).logits
    assert (logits - torch.load(f"{src}.logits.pt")).abs().max() < 1e-5
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(src))
    ours = model.state_dict()
    assert set(theirs) <= set(ours)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    return model


@pytest.mark.parametrize("stage", (2, 3))
def test_bf16_run_gives_its_fp32_masters_or_its_bf16_weights(runs, run_cli, tmp_path, stage):
    """A bf16 run: `--dtype fp32` gives the fp32 masters (bit-equal to zero_to_fp32). The
    default is the model's dtype, bf16, at every stage: at ZeRO-2 the module's own weights, at
    ZeRO-3 (whose fp32 partitions are the only stored copy) the masters rounded as DeepSpeed
    rounds them into its bf16 parameters."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    src = runs / H.hf_run_name("llama", stage, "bf16")
    assert run_cli("convert", src, tmp_path / "fp32", "--to", "hf", "--dtype", "fp32").code == 0
    assert run_cli("convert", src, tmp_path / "bf16", "--to", "hf").code == 0
    masters = get_fp32_state_dict_from_zero_checkpoint(str(src))
    fp32 = load_file(tmp_path / "fp32" / "model.safetensors")
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    assert masters.keys() == fp32.keys() == bf16.keys()
    default = torch.bfloat16
    for name, value in masters.items():
        assert torch.equal(fp32[name], value), name
        assert bf16[name].dtype == default and torch.equal(bf16[name], value.to(default)), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == str(default).split(".")[1]
    load_hf(tmp_path / "bf16", attn_implementation="eager")


def test_deepspeed_to_megatron_and_back_is_exact(runs, run_cli, tmp_path):
    """The same canonical view feeds every writer: a DeepSpeed-trained Llama becomes a
    Megatron TP2 checkpoint whose weights, converted on to HF, equal the direct conversion's
    bit for bit. (Its ZeRO optimizer state needs the resuming job's LR schedule, which a
    DeepSpeed checkpoint does not hold: refused without --megatron-lr-schedule.)"""
    src = runs / "llama_z2"
    refused = run_cli("convert", src, tmp_path / "m0", "--to", "megatron", "--tp", "2")
    assert refused.code == 2 and "--drop-optimizer" in refused.err and "--megatron-lr-schedule" in refused.err
    assert not (tmp_path / "m0").exists()
    assert run_cli("convert", src, tmp_path / "hf", "--to", "hf", "--dtype", "fp32").code == 0
    res = run_cli("convert", src, tmp_path / "meg", "--to", "megatron", "--tp", "2",
                  "--drop-optimizer")
    assert res.code == 0, res.err
    # Megatron's loader restarts the data where the args say: DeepSpeed's sample count
    samples = torch.load(next(src.rglob("mp_rank_00_model_states.pt")), weights_only=False)["global_samples"]
    args = torch.load(next((tmp_path / "meg").rglob("model_optim_rng.pt")), weights_only=False)["args"]
    assert samples > 0 and args.consumed_train_samples == samples
    back = run_cli("convert", tmp_path / "meg", tmp_path / "hf2", "--to", "hf")
    assert back.code == 0, back.err
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k].float()) for k in a)


def test_without_a_config_the_error_says_what_to_pass(runs, run_cli, tmp_path):
    import shutil

    src = tmp_path / "noconfig"
    shutil.copytree(runs / "llama_z1", src)
    (src / "config.json").unlink()
    res = run_cli("convert", src, tmp_path / "hf", "--to", "hf")
    assert res.code == 2 and "--model-config" in res.err and "Traceback" not in res.err
    assert not (tmp_path / "hf").exists()
    cfg = tmp_path / "config.json"
    cfg.write_text((runs / "llama_z1" / "config.json").read_text())
    assert run_cli("convert", src, tmp_path / "hf", "--to", "hf", "--model-config", cfg).code == 0
    wrong = tmp_path / "gpt2.json"
    wrong.write_text((runs / "gpt2_z1" / "config.json").read_text())
    res = run_cli("convert", src, tmp_path / "hf3", "--to", "hf", "--model-config", wrong)
    assert res.code == 2 and "not a gpt2 model's" in res.err, res.err
    # a config that ties the output layer to the embedding, for a run that trained its own
    # (a separate parameter, not one of DeepSpeed's shared_params): tying would drop it
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps({**json.loads(cfg.read_text()), "tie_word_embeddings": True}))
    for to in ("hf", "dcp"):
        res = run_cli("convert", src, tmp_path / f"tied-{to}", "--to", to, "--drop-optimizer",
                      "--model-config", tied)
        assert res.code == 2 and "ties lm_head.weight to its owner" in res.err, res.err
        assert not (tmp_path / f"tied-{to}").exists()


@pytest.fixture(scope="module")
def untabled(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_hf_any")
    H.save_hf(root, [("granite", 2, "fp32"), ("starcoder2", 3, "fp32")])
    return root


@pytest.mark.parametrize("family,stage", [("granite", 2), ("starcoder2", 3)])
def test_any_architecture_exports_to_hf_as_zero_to_fp32_does(untabled, run_cli, tmp_path, family, stage):
    """A DeepSpeed run of an HF model ckptool has no table for (Granite, StarCoder2): the HF export
    keeps the module's names and config.json, bit-equal to zero_to_fp32, with the module's
    logits; a layout change that needs the table is refused, naming it."""
    src, out = untabled / f"{family}_z{stage}", tmp_path / "hf"
    res = run_cli("convert", src, out, "--to", "hf", "--dtype", "fp32")
    assert res.code == 0, res.err
    assert "has no table for model_type" in res.out + res.err
    model = assert_is_the_trained_module(out, src, family)
    assert type(model).__name__ == {"granite": "GraniteForCausalLM",
                                    "starcoder2": "Starcoder2ForCausalLM"}[family]
    for target, says in (("megatron", f"no family table for model_type '{family}'"),
                         ("dcp", "cannot lay the model out for dcp"),
                         # granite's names are llama's, but its multipliers are refused;
                         # starcoder2's biases and c_fc-style MLP have no place in llama's table
                         ("hf --model-family llama", "would compute differently|not a llama")):
        dst = tmp_path / "refused"
        res = run_cli("convert", src, dst, "--to", *target.split())
        assert res.code == 2 and any(s in res.err for s in says.split("|")), res.err
        assert "Traceback" not in res.err
        assert not dst.exists()
