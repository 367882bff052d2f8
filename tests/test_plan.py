"""`ckptool plan`: topology math and per-GPU memory, checked against hand computations."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

LLAMA2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
              "num_hidden_layers": 80, "vocab_size": 32000, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}
LLAMA_13B_40_HEADS = dict(LLAMA2_70B, hidden_size=5120, intermediate_size=13824,
                          num_attention_heads=40, num_key_value_heads=40, num_hidden_layers=40)


def plan_json(run_cli, *args):
    r = run_cli("plan", *map(str, args), "--json")
    assert r.code == 0, r.err
    return json.loads(r.out)


def rows(res):
    return {r["strategy"]: r for r in res["memory"]}


def test_175b_on_32_gpus_tp8_pp2_zero2(run_cli):
    res = plan_json(run_cli, "--gpus", 32, "--tp", 8, "--pp", 2, "--params", "175B", "--zero", 2,
                    "--gpu-mem", "80GB")
    assert (res["tp"], res["pp"], res["dp"]) == (8, 2, 2)
    p = 175e9 / 16  # parameters per GPU: TP x PP = 16 shares
    hand = {"zero0": 16 * p, "zero1": 4 * p + 12 * p / 2, "zero2": 2 * p + 14 * p / 2,
            "zero3": 16 * p / 2, "megatron-distopt": 6 * p + 12 * p / 2}
    for name, want in hand.items():
        assert rows(res)[name]["total_gb"] == pytest.approx(want / 1e9, abs=1e-3), name
        assert rows(res)[name]["fits"] == (want / 1e9 <= 80)
    assert rows(res)["zero2"]["total_gb"] == pytest.approx(98.4375, abs=1e-3)
    # checkpoint: bf16 weights + fp32 master + Adam = 14 bytes per parameter
    assert res["checkpoint"]["bytes"] == pytest.approx(175e9 * 14, rel=1e-9)


def test_llama2_70b_config_counts_its_real_layout(tmp_path, run_cli):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA2_70B))
    res = plan_json(run_cli, "--gpus", 64, "--tp", 8, "--pp", 4, "--model", cfg, "--zero", 1)
    assert res["dp"] == 2
    # By hand. Megatron pads vocab 32000 to a multiple of 128 x TP8 = 32768 rows.
    h, ffn, d = 8192, 28672, 128
    layer = (64 + 2 * 8) * d * h + h * h + 2 * ffn * h + h * ffn  # qkv, proj, fc1 (gate;up), fc2
    norms = 2 * h
    emb = 32768 * h
    total = 80 * (layer + norms) + 2 * emb + h  # untied output layer, final norm
    assert res["params"] == total == 68_989_231_104  # Llama-2-70B: 68.98B (+ vocab padding)
    per_stage = 20 * (layer // 8 + norms)  # 20 layers per stage, TP-split, norms replicated
    busiest = per_stage + emb // 8 + h  # the last stage: output layer shard + final norm
    assert res["params_per_gpu"] == busiest
    assert rows(res)["zero1"]["total_gb"] == pytest.approx((4 * busiest + 12 * busiest / 2) / 1e9, abs=1e-3)


@pytest.mark.parametrize("args,message", [
    (["--gpus", 32, "--tp", 16, "--pp", 2], "40 attention heads are not divisible by TP16"),
    (["--gpus", 30, "--tp", 8, "--pp", 2], "30 GPUs are not divisible by TP x PP"),
    (["--gpus", 24, "--tp", 8, "--pp", 3], "num_layers (40) must be divisible by PP"),
])
def test_impossible_topologies_are_refused_with_every_rule(tmp_path, run_cli, args, message):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_13B_40_HEADS))
    r = run_cli("plan", *map(str, args), "--model", cfg)
    assert r.code == 2 and message in r.err, r.err
    assert "Traceback" not in r.err


def test_tp_beyond_a_node_warns(run_cli):
    r = run_cli("plan", "--gpus", "32", "--tp", "16", "--pp", "1", "--params", "70B")
    assert r.code == 0 and "TP16 spans more than one node" in r.err


def test_restart_options_from_a_checkpoint(tmp_path, run_cli, make_ckpt):
    from ckptool.core.layout import ModelSpec
    from converters import dcp

    spec = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                     ffn_hidden_size=128, vocab_size=1000)
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": __import__("torch").ones(2)}, str(ckpt), iteration=1,
             topology={"tp": 4, "pp": 2, "dp": 2}, model_config=asdict(spec))
    for gpus in (12, 16):  # 12: fewer nodes than the TP4 x PP2 x DP2 it was saved at
        res = plan_json(run_cli, "--gpus", gpus, "--tp", 4, "--pp", 1, "--from", ckpt)
        got = {(r["tp"], r["pp"], r["dp"]) for r in res["restarts"]}
        # TP must divide 8 heads and 4 groups; PP must divide 4 layers; TP x PP x DP = gpus.
        want = {(tp, pp, gpus // (tp * pp)) for tp in (1, 2, 4) for pp in (1, 2, 4)
                if gpus % (tp * pp) == 0}
        assert got == want
    first = res["restarts"][0]
    assert (first["tp"], first["pp"], first["same_model_parallel"]) == (4, 2, True)  # listed first


@pytest.mark.parametrize("args", [["--params", "70B", "--h2d-gbps", "0"], ["--params", "70B", "--storage-gbps", "nan"],
                                  ["--params", "70B", "--storage-gbps", "-5"], ["--params", "1e400"],
                                  ["--params", "0"]])
def test_rates_and_counts_that_are_not_are_usage_errors(args, run_cli):
    """A zero rate was a ZeroDivisionError "check the checkpoint" (there is none), nan and
    negative rates printed "~nan s" and "~-196 s" with exit 0, 1e400 parameters overflowed."""
    r = run_cli("plan", "--gpus", "64", "--tp", "8", "--pp", "2", *args)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and "Check the checkpoint" not in r.err, r.err
