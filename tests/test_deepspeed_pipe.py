"""DeepSpeed pipeline checkpoints as Megatron-DeepSpeed writes them (GPTModelPipe's layer
files, ``mp_rank_*`` with Megatron args, ZeRO-1 optimizer files), from a real DeepSpeed
``PipelineEngine`` trained on CPU at TP1/PP2 (``tests/harness/deepspeed_engine.py``).

The truth comes from the engine's memory, not from the files: each stage's layer modules
(run in order in one process for the reference logits, the head with the last stage's own
tied copy) and its fp32 masters and Adam moments (``safe_get_full_*``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import convert_to_torch, peer

os.environ.setdefault("DS_ACCELERATOR", "cpu")
peer("deepspeed")
peer("transformers")

from transformers import GPT2LMHeadModel  # noqa: E402

from tests.harness import deepspeed_engine as H  # noqa: E402
from tests.harness import deepspeed_pipe as P  # noqa: E402
from tests.harness.hf import load_hf  # noqa: E402

LEGACY = {  # Megatron-DeepSpeed's local layer names -> Megatron-Core's (written out here, not imported)
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}
FINAL_NORM = 2 + H.PIPE_ARGS["num_layers"]


def canonical(name: str) -> str:
    """A PipelineModule parameter name under Megatron-Core's global name."""
    if name.startswith("tied_modules.embed."):
        return "embedding." + name[len("tied_modules.embed."):]
    idx, rest = name.split(".", 1)
    if int(idx) == FINAL_NORM:
        return f"decoder.final_layernorm.{rest}"
    return f"decoder.layers.{int(idx) - 2}.{LEGACY[rest]}"


NAMES = [name for name, _, _ in H.PIPE_RUNS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_pipe")
    H.save_pipe(root)
    return root


@pytest.fixture(params=NAMES)
def run(runs, request):
    """(run root, each rank's truth) of one pipeline run: fp32 ZeRO-1, bf16 BF16_Optimizer."""
    name = request.param
    truths = P.truths(runs, name)
    return runs / name, truths


def test_inspect_reads_the_pipeline_topology_and_model(run, run_cli):
    src, _ = run
    res = run_cli("inspect", src, "--json")  # BF16_Optimizer (stage 0) reads as ZeRO-1, as plain engines
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    assert doc["format"] == "deepspeed" and doc["iteration"] == H.STEPS
    assert doc["topology"] == {"tp": 1, "pp": 2, "dp": 1, "ep": 1, "vpp": 1, "zero": 1}
    config = doc["model_config"]
    assert (config["num_layers"], config["normalization"], config["activation"], config["vocab_rows"]) \
        == (4, "LayerNorm", "gelu_tanh", 208)
    assert "TP1/PP2/DP1" in run_cli("inspect", src).out


def test_verify_deep_checks_every_piece_and_the_tied_replica(run, run_cli):
    src, _ = run
    res = run_cli("verify", src, "--deep")
    assert res.code == 0, res.out + res.err
    assert res.out.startswith(f"OK: {src} (deepspeed, foreign, unsealed;")


def test_to_hf_gives_the_pipeline_models_logits(run, run_cli, tmp_path):
    src, truths = run
    res = run_cli("convert", src, tmp_path / "hf", "--to", "hf", "--dtype", "fp32")
    assert res.code == 0, res.err
    model = load_hf(tmp_path / "hf", GPT2LMHeadModel, attn_implementation="eager")
    tokens = H.pipe_tokens(H.NEXT_STEP, 3)[:, :-1]
    layers = {**truths[0]["layers"], **truths[1]["layers"]}
    reference = H.pipe_reference_logits(layers, tokens)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    assert logits.shape == reference.shape == (3, H.SEQ, 208)
    assert (logits - reference).abs().max() < 1e-5


def test_megatron_tp2_and_back_to_hf_is_bit_equal(run, run_cli, tmp_path):
    from safetensors.torch import load_file

    src, _ = run
    res = run_cli("convert", src, tmp_path / "meg", "--to", "megatron", "--tp", "2", "--pp", "1")
    assert res.code == 2
    assert "--megatron-lr-schedule" in res.err and "--drop-optimizer" in res.err
    res = run_cli("convert", src, tmp_path / "meg", "--to", "megatron", "--tp", "2", "--pp", "1",
                  "--drop-optimizer")
    assert res.code == 0, res.err
    assert "TP2/PP1" in run_cli("inspect", tmp_path / "meg").out
    for out, source in ((tmp_path / "hf1", src), (tmp_path / "hf2", tmp_path / "meg")):
        res = run_cli("convert", source, out, "--to", "hf")
        assert res.code == 0, res.err
    one, two = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "hf1", tmp_path / "hf2"))
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_optimizer_state_is_the_engines(run, run_cli, tmp_path):
    """Through DCP: every fp32 master and Adam moment equals the engine's own, by name; the
    last stage's tied word embeddings equal the first stage's (the replica verify checks)."""
    src, truths = run
    got = convert_to_torch(run_cli, src, tmp_path / "dcp")
    checked = 0
    for rank, truth in enumerate(truths):
        state = truth["state"]
        for name, master in state["params"].items():
            if rank == 1 and name.startswith("tied_modules."):
                if name.endswith("word_embeddings.weight"):  # the head's copy of the embedding
                    assert torch.equal(master, truths[0]["state"]["params"][name])
                continue  # the last stage's dead copy of the position embeddings
            key = canonical(name)
            assert torch.equal(got[f"optimizer.state.fp32_param.{key}"], master), key
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[f"optimizer.state.{kind}.{key}"], state[kind][name]), (kind, key)
            checked += 1
    assert checked == 4 * 12 + 2 + 2
    assert not any(k.startswith("optimizer.") and "position" in k and k not in {
        f"optimizer.state.{kind}.embedding.position_embeddings.weight"
        for kind in ("fp32_param", "exp_avg", "exp_avg_sq")} for k in got)


def test_pipeline_checkpoint_without_args_is_refused(runs, run_cli, tmp_path):
    import shutil

    src = runs / "pipe"
    copy = tmp_path / "noargs"
    shutil.copytree(src, copy)
    tag = (copy / "latest").read_text().strip()
    for f in (copy / tag).glob("mp_rank_*_model_states.pt"):
        state = torch.load(f, weights_only=False)
        del state["args"]
        torch.save(state, f)
    res = run_cli("inspect", copy)
    assert res.code == 2
    assert "a DeepSpeed pipeline checkpoint without Megatron `args`" in res.err


def test_a_missing_layer_file_fails_verify(runs, run_cli, tmp_path):
    import shutil

    src = runs / "pipe"
    copy = tmp_path / "torn"
    shutil.copytree(src, copy)
    tag = (copy / "latest").read_text().strip()
    (copy / tag / "layer_03-model_00-model_states.pt").unlink()
    res = run_cli("verify", copy)
    assert res.code == 1
    assert "layer files missing: ['layer_03']" in res.out + res.err


def test_reshard_of_a_pipeline_to_another_zero_stage_is_refused_with_the_reason(runs, run_cli, tmp_path):
    src = runs / "pipe"  # other PP/TP: tests/test_deepspeed_pipe_reshard.py
    res = run_cli("reshard", src, tmp_path / "z2", "--to-zero", "2")
    assert res.code == 2
    assert "DeepSpeed runs pipelines at ZeRO-1 (or its BF16_Optimizer); the stage stays 1" in res.err
