"""`ckptool reshard` on real megatron-core checkpoints (legacy layout), proven by logits.

Sources are real mcore GPTModels built at TP=1 and TP=2 on CPU and saved as Megatron-LM
saves them; results are loaded into real mcore stage models at the new TP/PP (strict
load_state_dict, pipelined forward) and must give the same logits.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import peer
import torch

peer("megatron.core")

from tests.harness import mcore as H  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama") / "tp2"
    return root, H.save_real(H.LLAMA, 2, root)


@pytest.fixture(scope="module")
def gpt_tp1(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt") / "tp1"
    return root, H.save_real(H.GPT, 1, root)


def _close(a, b):
    return (a - b).abs().max().item() < TOL


def test_llama_gqa_swiglu_tp2_to_tp1_pp2(llama_tp2, tmp_path, run_cli):
    src, ref = llama_tp2
    dst = tmp_path / "tp1pp2"
    res = run_cli("reshard", src, dst, "--to-tp", 1, "--to-pp", 2, "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    assert _close(H.load_logits(H.LLAMA, 1, 2, dst), ref)
    report = json.loads(run_cli("verify", dst, "--deep", "--json").out)
    assert report["ok"] and report["committed"] is True and report["format"] == "megatron"


def test_llama_tp2_to_tp4(llama_tp2, tmp_path, run_cli):
    src, ref = llama_tp2
    dst = tmp_path / "tp4"
    assert run_cli("reshard", src, dst, "--to-tp", 4, "--true-vocab-size", 1000).code == 0
    assert _close(H.load_logits(H.LLAMA, 4, 1, dst), ref)


def test_gpt_tied_tp1_to_tp2_pp2(gpt_tp1, tmp_path, run_cli):
    src, ref = gpt_tp1
    dst = tmp_path / "tp2pp2"
    res = run_cli("reshard", src, dst, "--to-tp", 2, "--to-pp", 2)
    assert res.code == 0, res.err  # TP1 pads 1003 to 1024: every TP2 padding is known
    last = torch.load(dst / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt",
                      weights_only=False)
    assert "output_layer.weight" in last["model"]  # the last stage's copy of the tied embedding
    assert _close(H.load_logits(H.GPT, 2, 2, dst), ref)


@pytest.mark.slow
def test_literal_tp8_pp2_to_tp4_pp4(gpt_tp1, tmp_path, run_cli):
    src, ref = gpt_tp1
    tp8 = tmp_path / "tp8pp2"
    # ckptool records the true vocab it was told in args, so the second reshard knows it
    assert run_cli("reshard", src, tp8, "--to-tp", 8, "--to-pp", 2, "--true-vocab-size", 1003).code == 0
    dst = tmp_path / "tp4pp4"
    res = run_cli("reshard", tp8, dst, "--tp", 8, "--pp", 2, "--to-tp", 4, "--pp", 4)
    assert res.code == 0, res.err
    assert "(TP8/PP2/DP1) ->" in res.out and "(TP4/PP4/DP1)" in res.out
    assert _close(H.load_logits(H.GPT, 4, 4, dst), ref)


def _tensors(root):
    out = {}
    for f in sorted(root.rglob("model_optim_rng.pt")):
        data = torch.load(f, weights_only=False)
        out[str(f.relative_to(root))] = {k: v for k, v in data["model"].items()
                                        if isinstance(v, torch.Tensor)}
    return out


def test_round_trip_is_bit_exact_file_by_file(llama_tp2, tmp_path, run_cli):
    src, _ = llama_tp2
    mid, back = tmp_path / "tp1pp2", tmp_path / "back"
    assert run_cli("reshard", src, mid, "--to-tp", 1, "--to-pp", 2, "--true-vocab-size", 1000).code == 0
    assert run_cli("reshard", mid, back, "--to-tp", 2, "--to-pp", 1).code == 0
    a, b = _tensors(src), _tensors(back)
    assert a.keys() == b.keys()
    for f in a:
        assert a[f].keys() == b[f].keys(), f
        for k in a[f]:
            # padding rows too: Megatron trains them, and both TP2 and TP1 pad 1000 to 1024
            assert torch.equal(a[f][k], b[f][k]), (f, k)


def test_impossible_targets_are_refused_before_writing(llama_tp2, tmp_path, run_cli):
    src, _ = llama_tp2
    dst = tmp_path / "never"
    res = run_cli("reshard", src, dst, "--to-tp", 8, "--true-vocab-size", 1000)
    assert res.code == 2 and "query groups / kv heads (4) must be divisible by TP (8)" in res.err
    assert res.err.rstrip().endswith("TP sizes that work: 1, 2, 4")  # heads 8, groups 4, and the ffn
    res = run_cli("reshard", src, dst, "--to-pp", 3, "--true-vocab-size", 1000)
    assert res.code == 2 and "num_layers (4) must be divisible by PP x VPP (3 x 1)" in res.err
    res = run_cli("reshard", src, dst, "--tp", 4, "--to-tp", 1)
    assert res.code == 2 and "--tp 4 does not match the checkpoint, which is TP2" in res.err
    res = run_cli("reshard", src, dst, "--to-tp", 1)
    assert res.code == 2 and "--true-vocab-size" in res.err
    assert not dst.exists() and not list(tmp_path.glob("never*"))
    assert "Traceback" not in res.err


def test_dry_run_prints_the_plan_and_writes_nothing(llama_tp2, tmp_path, run_cli):
    src, _ = llama_tp2
    dst = tmp_path / "plan"
    res = run_cli("reshard", src, dst, "--to-pp", 2, "--dry-run", "--json")
    assert res.code == 0
    plan = json.loads(res.out)
    assert [f["path"] for f in plan["files"]] == [
        "iter_0000010/mp_rank_00_000/model_optim_rng.pt", "iter_0000010/mp_rank_01_000/model_optim_rng.pt",
        "iter_0000010/mp_rank_00_001/model_optim_rng.pt", "iter_0000010/mp_rank_01_001/model_optim_rng.pt"]
    assert plan["bytes_read"] > 0 and plan["bytes_written"] >= plan["bytes_read"]
    assert not dst.exists()


def test_existing_destination_is_left_untouched(llama_tp2, tmp_path, run_cli):
    src, _ = llama_tp2
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    res = run_cli("reshard", src, dst, "--to-pp", 2)
    assert res.code == 2 and "already exists" in res.err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]


def test_virtual_pipeline_round_trip_is_bit_exact(llama_tp2, tmp_path, run_cli):
    src, _ = llama_tp2
    mid, back = tmp_path / "vpp", tmp_path / "back"
    res = run_cli("reshard", src, mid, "--to-tp", 1, "--to-pp", 2, "--to-vpp", 2,
                  "--true-vocab-size", 1000)
    assert res.code == 0, res.err
    stage0 = torch.load(mid / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt",
                        weights_only=False)
    # 4 layers, PP2 x VPP2: stage 0 holds global layers 0 and 2 as model0 / model1
    assert set(stage0) >= {"model0", "model1"} and "model" not in stage0
    assert stage0["args"].virtual_pipeline_model_parallel_size == 2
    src_tp0 = torch.load(src / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    src_tp1 = torch.load(src / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt", weights_only=False)
    key = "decoder.layers.0.self_attention.linear_proj.weight"   # row-parallel: TP concat on dim 1
    layer2 = key.replace("layers.0", "layers.2")
    assert torch.equal(stage0["model1"][key],
                       torch.cat([src_tp0["model"][layer2], src_tp1["model"][layer2]], dim=1))
    assert run_cli("reshard", mid, back, "--to-tp", 2, "--to-pp", 1).code == 0
    a, b = _tensors(src), _tensors(back)
    for f in a:
        for k in a[f]:
            assert torch.equal(a[f][k], b[f][k]), (f, k)


def test_optimizer_state_is_never_dropped_silently(llama_tp2, tmp_path, run_cli):
    import shutil

    src, _ = llama_tp2
    with_optim = tmp_path / "with-optim"
    shutil.copytree(src, with_optim)
    for f in with_optim.rglob("model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        state["optimizer"] = {"optimizer": {"state": {0: {"exp_avg": torch.ones(3)}},
                                            "param_groups": [{"params": [0]}]}}
        torch.save(state, f)
    dst = tmp_path / "out"
    res = run_cli("reshard", with_optim, dst, "--to-pp", 2)
    assert res.code == 2
    assert ("the optimizer state cannot be carried: optimizer state is not a Megatron "
            "FP32/Float16 optimizer state dict") in res.err
    assert "--drop-optimizer" in res.err and not dst.exists()
    res = run_cli("reshard", with_optim, dst, "--to-pp", 2, "--drop-optimizer")
    assert res.code == 0 and "left out: optimizer state is not" in res.out
    out = torch.load(dst / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)
    assert "optimizer" not in out and out["opt_param_scheduler"] == {"num_steps": 10, "max_lr": 3e-4}


@pytest.mark.parametrize("model,src_tp,dst_tp", [("GPT", 2, 1), ("LLAMA", 2, 4)])
def test_optimizer_state_resumes_exactly_at_new_tp(model, src_tp, dst_tp, tmp_path, run_cli):
    """Adam moments follow their parameters: one more step after the reshard gives the same
    loss and the same updated weights (logits) as the run that never stopped."""
    m = getattr(H, model)
    src = tmp_path / "src"
    after = H.train_and_save(m, src_tp, src)
    dst = tmp_path / "dst"
    res = run_cli("reshard", src, dst, "--to-tp", dst_tp, "--true-vocab-size", m["vocab_size"])
    assert res.code == 0, res.err
    resumed = H.resume_one_step(m, dst_tp, dst)
    assert abs(resumed["loss"] - after["loss"]) / abs(after["loss"]) < 1e-5
    assert (resumed["logits"] - after["logits"]).abs().max().item() < 1e-4


def test_deep_verify_checks_replicas_are_equal(llama_tp2, tmp_path, run_cli):
    import shutil

    src, _ = llama_tp2
    assert run_cli("verify", src, "--deep").code == 0
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    f = bad / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["model"]["decoder.layers.1.input_layernorm.weight"][3] += 1.0  # a TP-replicated norm
    torch.save(state, f)
    res = run_cli("verify", bad, "--deep")
    assert res.code == 1
    assert (f"replica differs from the primary copy ({f}, tensor "
            "'decoder.layers.1.self_attention.linear_qkv.layer_norm_weight')") in res.out


# Pre-mcore (Megatron-DeepSpeed style) names, written out by hand here so that the test does not
# share ckptool's own name table.
_TO_LEGACY_LAYER = {
    "input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attention.query_key_value",
    "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h",
}


def _to_legacy(model: dict) -> dict:
    """mcore local-spec state dict -> nested pre-mcore state dict (MHA, checkpoint_version 3)."""
    out = {"language_model": {"embedding": {}, "encoder": {}}}
    for k, v in model.items():
        if k.endswith("_extra_state"):
            continue
        if k.startswith("embedding."):
            _, module, param = k.split(".")
            out["language_model"]["embedding"][module] = {param: v}
        elif k.startswith("decoder.layers."):
            _, _, i, rest = k.split(".", 3)
            module, param = rest.rsplit(".", 1)
            out["language_model"]["encoder"][f"layers.{i}.{_TO_LEGACY_LAYER[module]}.{param}"] = v
        elif k.startswith("decoder.final_layernorm."):
            out["language_model"]["encoder"][k.removeprefix("decoder.")] = v
        elif k == "output_layer.weight":
            out["word_embeddings_for_head"] = {"weight": v}  # the last stage's tied copy
    return out


def _from_legacy(nested: dict, template: dict) -> dict:
    """The inverse, onto the keys of a real mcore state dict (``template``)."""
    back = {v: k for k, v in _TO_LEGACY_LAYER.items()}
    out = {}
    lm = nested["language_model"]
    for module, params in lm.get("embedding", {}).items():
        for p, v in params.items():
            out[f"embedding.{module}.{p}"] = v
    for k, v in lm.get("encoder", {}).items():
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            module, param = rest.rsplit(".", 1)
            out[f"decoder.layers.{i}.{back[module]}.{param}"] = v
        else:
            out[f"decoder.{k}"] = v
    if "word_embeddings_for_head" in nested:
        out["output_layer.weight"] = nested["word_embeddings_for_head"]["weight"]
    for k, v in template.items():
        if k.endswith("_extra_state"):
            out[k] = v
    return out


def test_pre_mcore_legacy_names_reshard_tp1_to_tp2_pp2(gpt_tp1, tmp_path, run_cli):
    import shutil

    src, ref = gpt_tp1
    legacy = tmp_path / "legacy"
    shutil.copytree(src, legacy)
    f = legacy / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    template = state["model"]
    state["model"] = _to_legacy(template)
    torch.save(state, f)
    out = tmp_path / "out"
    res = run_cli("reshard", legacy, out, "--to-tp", 2, "--to-pp", 2)
    assert res.code == 0, res.err
    last = torch.load(out / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert "word_embeddings_for_head" in last["model"]          # legacy names are kept
    assert "language_model" in last["model"] and "layers.0.self_attention.query_key_value.weight" in \
        last["model"]["language_model"]["encoder"]
    # Translate back by hand and load into real mcore stage models at TP2/PP2.
    mcore = tmp_path / "mcore"
    shutil.copytree(out, mcore)
    for g in mcore.rglob("model_optim_rng.pt"):
        s = torch.load(g, weights_only=False)
        pp_rank = int(g.parent.name.split("_")[-1])
        tmpl = {k: None for k in _mcore_keys(pp_rank)}
        s["model"] = _from_legacy(s["model"], tmpl)
        torch.save(s, g)
    assert (H.load_logits(H.GPT, 2, 2, mcore) - ref).abs().max().item() < 1e-5


def _mcore_keys(pp_rank: int) -> list[str]:
    """The _extra_state keys a 2-stage mcore local-spec GPT stage expects (2 layers each)."""
    keys = [f"decoder.layers.{i}.{m}._extra_state" for i in range(2)
            for m in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                      "mlp.linear_fc2")]
    return keys + (["output_layer._extra_state"] if pp_rank == 1 else [])


def test_uneven_pipeline_split_on_request(llama_tp2, tmp_path, run_cli):
    """4 layers over PP3 are refused, unless the split is given as Megatron spells it; the
    uneven checkpoint holds 2+1+1 layers, records the split in args, and comes back
    bit-exact and with the same logits."""
    src, ref = llama_tp2
    dst = tmp_path / "pp3"
    res = run_cli("reshard", src, dst, "--to-pp", 3, "--true-vocab-size", 1000)
    assert res.code == 2 and "--decoder-first-pipeline-num-layers" in res.err
    res = run_cli("reshard", src, dst, "--to-tp", 1, "--to-pp", 3, "--true-vocab-size", 1000,
                  "--decoder-first-pipeline-num-layers", 2)
    assert res.code == 0, res.err
    layers = []
    for pp in range(3):
        data = torch.load(dst / "iter_0000010" / f"mp_rank_00_{pp:03d}" / "model_optim_rng.pt",
                          weights_only=False)
        assert data["args"].decoder_first_pipeline_num_layers == 2
        layers.append(len({k.split(".")[2] for k in data["model"] if k.startswith("decoder.layers.")}))
    assert layers == [2, 1, 1]
    back = tmp_path / "back"
    assert run_cli("reshard", dst, back, "--to-tp", 2, "--to-pp", 1).code == 0
    a, b = _tensors(src), _tensors(back)
    assert all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])
    assert _close(H.load_logits(H.LLAMA, 2, 1, back), ref)
    # Hugging Face has one stage (the split says nothing there): refused as "cannot be split
    # over PP (1) with first=2", so ckptool could not convert its own output
    flat, again = tmp_path / "hf", tmp_path / "again"
    assert run_cli("convert", dst, flat, "--to", "hf").code == 0
    assert run_cli("convert", flat, again, "--to", "megatron", "--tp", 2, "--pp", 1).code == 0
    assert _close(H.load_logits(H.LLAMA, 2, 1, again), ref)


def test_a_true_vocab_size_that_contradicts_the_checkpoint_is_refused(gpt_tp1, tmp_path, run_cli):
    """Once a checkpoint records its vocabulary (ckptool writes it into the args; Megatron's own
    args.vocab_size), ``--true-vocab-size`` smaller dropped real rows (896..1002 of the word
    embeddings, masters and moments) with exit 0; larger would make padding rows tokens."""
    root, _ = gpt_tp1
    recorded = tmp_path / "tp2"
    assert run_cli("reshard", root, recorded, "--to-tp", "2", "--true-vocab-size", "1003").code == 0
    for wrong in ("800", "1024"):
        dst = tmp_path / f"tp1-{wrong}"
        r = run_cli("reshard", recorded, dst, "--to-tp", "1", "--true-vocab-size", wrong)
        assert r.code == 2 and "contradicts the checkpoint" in r.err and "1003" in r.err, r.err
        assert not dst.exists()
    assert run_cli("reshard", recorded, tmp_path / "same", "--to-tp", "1", "--true-vocab-size", "1003").code == 0


@pytest.mark.parametrize("flags", [["--to-vpp", "1"], ["--to-pp", "1"]])
def test_leaving_the_virtual_pipeline_clears_its_args(gpt_tp1, flags, tmp_path, run_cli):
    """VPP2 to none kept args.num_layers_per_virtual_pipeline_stage: exit 0, then ckptool read
    its own output as VPP2 again (verify exit 1; reshard to PP2 exit 2), and Megatron's
    --use-checkpoint-args would have taken it too."""
    root, _ = gpt_tp1
    vpp = tmp_path / "vpp"
    assert run_cli("reshard", root, vpp, "--to-pp", "2", "--to-vpp", "2").code == 0
    out = tmp_path / "out"
    assert run_cli("reshard", vpp, out, *flags).code == 0
    args = torch.load(next(out.glob("iter_*/mp_rank_00*/model_optim_rng.pt")), weights_only=False)["args"]
    assert args.num_layers_per_virtual_pipeline_stage is None and args.virtual_pipeline_model_parallel_size is None
    assert run_cli("verify", out, "--deep").code == 0
    again = tmp_path / "again"
    assert run_cli("reshard", out, again, "--to-pp", "2" if flags[0] == "--to-pp" else "1").code == 0
    assert run_cli("verify", again, "--deep").code == 0
