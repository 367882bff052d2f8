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


def test_an_etp_given_equal_to_the_tp_follows_the_tp_on_the_next_reshard(ep2, tmp_path, run_cli):
    """--to-etp 2 at TP2 is Megatron's default spelt out: the manifest recorded it, and a later
    reshard to TP1 kept ETP2, refused ("ep x etp must divide tp x dp"), where the same output
    written without --to-etp went on."""
    src, want = ep2
    tp2 = tmp_path / "tp2"
    assert run_cli("reshard", src, tp2, "--to-tp", 2, "--to-etp", 2, "--to-ep", 2, "--to-dp", 2,
                   "--true-vocab-size", M.MOE["vocab_size"]).code == 0
    tp1 = tmp_path / "tp1"
    r = run_cli("reshard", tp2, tp1, "--to-tp", 1, "--to-ep", 2, "--to-dp", 2)
    assert r.code == 0, r.err
    assert_close(M.load_moe_logits(M.MOE, 1, 2, tp1), want)


ETP = [dict(tp=2, ep=1, etp=1), dict(tp=2, ep=2, etp=1)]
"""TP2 with whole experts (ETP1), at EP1 (every rank holds every expert, expert-DP 2) and at
EP2 on two ranks, whose (TP, EP) ranks are (0, 0) and (1, 1)."""


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
@pytest.mark.parametrize("to", ETP)
def test_reshard_to_whole_experts_under_tp2_loads_in_megatron_core(ep2, fmt, to, tmp_path, run_cli):
    """Expert TP other than TP: ckptool splits the experts by ETP and the dense layers by TP;
    mcore at TP2/ETP1 loads it (each rank its own legacy file, or dist_checkpointing) with
    the original logits, and it comes back to TP1/EP2."""
    src, want = ep2
    dst = tmp_path / "out"
    load = M.load_moe_logits if fmt == "megatron" else M.load_moe_dist_logits
    r = run_cli("convert", src, dst, "--to", fmt, "--tp", to["tp"], "--ep", to["ep"], "--etp", to["etp"],
                "--dp", 1, "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 0, r.err
    assert_close(load(M.MOE, to["tp"], to["ep"], dst, etp=to["etp"]), want)
    back = tmp_path / "back"
    r = run_cli("reshard", dst, back, "--etp", to["etp"], "--to-tp", 1, "--to-etp", 1, "--to-ep", 2, "--to-dp", 2)
    assert r.code == 0, r.err
    assert_close(load(M.MOE, 1, 2, back), want)


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
def test_a_tp2_etp1_ep2_save_by_megatron_core_reshards_to_ep1(fmt, tmp_path, run_cli):
    """What mcore itself writes at TP2/ETP1/EP2: the legacy layout has only the rank files
    (TP0, EP0) and (TP1, EP1); each TP shard and each EP rank's experts is read from the one
    file that holds it."""
    src = tmp_path / "src"
    save = M.save_moe if fmt == "megatron" else M.save_moe_dist
    want = save(M.MOE, 2, 2, src, etp=1)
    if fmt == "megatron":
        assert sorted(p.name for p in (src / "iter_0000010").iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    import json
    topology = json.loads(run_cli("inspect", src, "--json").out)["topology"]
    assert (topology["tp"], topology["ep"], topology["etp"]) == (2, 2, 1)
    dst = tmp_path / "ep1"
    r = run_cli("convert", src, dst, "--to", "megatron", "--tp", 1, "--ep", 1, "--etp", 1, "--dp", 1,
                "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 0, r.err
    assert_close(M.load_moe_logits(M.MOE, 1, 1, dst), want)
    if fmt == "megatron":  # a missing shard is named
        shutil.rmtree(src / "iter_0000010" / "mp_rank_01_001")
        r = run_cli("inspect", src)
        assert r.code == 1 and "missing ['mp_rank_00_001', 'mp_rank_01_000']" in r.err, r.err


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
    (("--to-tp", 2, "--to-etp", 4, "--to-ep", 1, "--to-dp", 2), "ETP4 must divide TP2"),
])
def test_impossible_ep_targets_are_refused_before_anything_is_written(ep2, tmp_path, run_cli, args, says):
    src, _ = ep2
    dst = tmp_path / "out"
    r = run_cli("reshard", src, dst, *args)
    assert r.code == 2 and says in r.err and "Traceback" not in r.err, r.err
    assert not dst.exists()


# ----------------------------------------------------------------- Hugging Face Mixtral


def make_mixtral(root, m=M.MOE):
    transformers = peer("transformers")
    config = transformers.MixtralConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["moe_ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_query_groups"], num_local_experts=m["num_experts"],
        num_experts_per_tok=m["topk"], rms_norm_eps=1e-5, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        initializer_range=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    model.save_pretrained(root)
    return model


def test_mixtral_to_megatron_tp2_ep2_runs_in_megatron_core_and_comes_back(tmp_path, run_cli):
    """HF Mixtral -> megatron --tp 2 --ep 2 -> real megatron-core gives transformers' logits;
    -> hf again gives them too (the router and every expert in their places)."""
    from tests.harness.hf import hf_logits, load_hf

    src = tmp_path / "mixtral"
    model = make_mixtral(src)
    want = hf_logits(model, M.MOE["vocab_size"])
    dst = tmp_path / "mg"
    r = run_cli("convert", src, dst, "--to", "megatron", "--tp", 2, "--ep", 2, "--dp", 2)
    assert r.code == 0, r.err
    assert_close(M.load_moe_logits(M.MOE, 2, 2, dst), want)
    back = tmp_path / "back"
    r = run_cli("convert", dst, back, "--to", "hf")
    assert r.code == 0, r.err
    assert_close(hf_logits(load_hf(back, dtype=torch.float32, attn_implementation="eager"),
                           M.MOE["vocab_size"]), want, atol=1e-5)


@pytest.mark.parametrize("via", ["hf", "dcp"])
def test_megatron_core_moe_converts_to_mixtral_with_its_logits(ep2, tmp_path, run_cli, via):
    from tests.harness.hf import hf_logits, load_hf

    src, want = ep2
    mid = tmp_path / via
    r = run_cli("convert", src, mid, "--to", via, "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 0, r.err
    out = mid
    if via == "dcp":
        out = tmp_path / "hf"
        r = run_cli("convert", mid, out, "--to", "hf")
        assert r.code == 0, r.err
    model = load_hf(out, dtype=torch.float32, attn_implementation="eager")
    assert type(model).__name__ == "MixtralForCausalLM"
    assert_close(hf_logits(model, M.MOE["vocab_size"]), want)


@pytest.mark.parametrize("arg,value", [
    ("moe_router_score_function", "sigmoid"),  # DeepSeek-V3's scores
    ("moe_router_load_balancing_type", "sinkhorn"),  # softmax over every expert, no renormalising
    ("moe_apply_probs_on_input", True),  # the probability scales the expert's input
    ("moe_router_force_load_balancing", True),  # random logits route
])
def test_other_routers_are_refused_where_the_args_are_not_kept(ep2, tmp_path, run_cli, arg, value):
    """A router that is not Mixtral's cannot be written as an HF or dcp model: refused,
    naming the arg (each of these ran in Megatron-Core with other logits than the Mixtral
    written from it, exit 0, before they were listed)."""
    src, _ = ep2
    bad = tmp_path / "other"
    shutil.copytree(src, bad)
    for f in bad.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        setattr(state["args"], arg, value)
        torch.save(state, f)
    for target in ("hf", "dcp"):
        dst = tmp_path / target
        r = run_cli("convert", bad, dst, "--to", target, "--true-vocab-size", M.MOE["vocab_size"])
        assert r.code == 2 and f"{arg}={value!r}" in r.err, r.err
        assert not dst.exists()


def test_top1_routing_megatron_cannot_build_is_refused(tmp_path, run_cli):
    """Mixtral at top-1 weights the chosen expert by 1; Megatron-Core builds top-1 only with
    --moe-router-pre-softmax, which weights it by its probability: no Megatron form."""
    transformers = peer("transformers")
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1)).save_pretrained(tmp_path / "src")
    for target in ("megatron", "megatron-dist"):
        r = run_cli("convert", tmp_path / "src", tmp_path / target, "--to", target)
        assert r.code == 2 and "top-1 routing" in r.err and not (tmp_path / target).exists(), r.err
    assert run_cli("convert", tmp_path / "src", tmp_path / "dcp", "--to", "dcp").code == 0


def test_plan_accounts_experts_by_ep_and_lists_the_ep_sizes_a_restart_can_use(ep2, run_cli):
    import json

    src, _ = ep2
    one = json.loads(run_cli("plan", "--gpus", 4, "--tp", 1, "--pp", 1, "--from", src, "--json").out)
    two = json.loads(run_cli("plan", "--gpus", 4, "--tp", 1, "--pp", 1, "--ep", 2, "--from", src,
                             "--json").out)
    m = M.MOE
    expert = 3 * m["moe_ffn_hidden_size"] * m["hidden_size"]  # fc1 (gate, up) + fc2
    assert one["params"] == two["params"]
    assert one["params_per_gpu"] - two["params_per_gpu"] == m["num_layers"] * 2 * expert  # 2 of 4 experts
    restart = {(r["tp"], r["pp"]): r["ep"] for r in one["restarts"]}
    assert restart[(1, 1)] == [1, 2, 4] and restart[(2, 1)] == [1, 2]  # EP divides experts and DP
    assert (4, 1) not in restart  # 2 query groups: TP4 breaks a rule
    r = run_cli("plan", "--gpus", 4, "--tp", 1, "--pp", 1, "--ep", 3, "--from", src)
    assert r.code == 2 and "4 experts are not divisible by EP3" in r.err, r.err
    # TP2 with whole experts (ETP1): each GPU holds its EP rank's experts unsplit
    split, whole = (json.loads(run_cli("plan", "--gpus", 4, "--tp", 2, "--pp", 1, "--ep", 2, *etp, "--from", src,
                                       "--json").out) for etp in ((), ("--etp", 1)))
    assert whole["params_per_gpu"] - split["params_per_gpu"] == m["num_layers"] * 2 * expert // 2
    r = run_cli("plan", "--gpus", 4, "--tp", 2, "--pp", 1, "--etp", 4, "--from", src)
    assert r.code == 2 and "ETP4 does not divide TP2" in r.err, r.err


# ------------------------------------------------------------ torch_dist with experts


@pytest.fixture(scope="module")
def dist_ep2(tmp_path_factory):
    """The same MoE model saved by Megatron-Core's own dist_checkpointing at TP1/EP2."""
    root = tmp_path_factory.mktemp("moe_dist") / "ep2"
    return root, M.save_moe_dist(M.MOE, 1, 2, root)


@pytest.mark.parametrize("to", [dict(tp=1, ep=1), dict(tp=2, ep=2)])
def test_torch_dist_with_experts_converts_to_any_ep(dist_ep2, to, tmp_path, run_cli):
    src, want = dist_ep2
    dst = tmp_path / "legacy"
    r = run_cli("convert", src, dst, "--to", "megatron", "--tp", to["tp"], "--ep", to["ep"],
                "--dp", to["ep"], "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 0, r.err
    assert_close(M.load_moe_logits(M.MOE, to["tp"], to["ep"], dst), want)


@pytest.mark.parametrize("to", [dict(tp=1, ep=1), dict(tp=2, ep=2)])
def test_experts_written_as_torch_dist_load_in_megatron_core(ep2, to, tmp_path, run_cli):
    """Megatron-Core's own dist_checkpointing.load reads ckptool's torch_dist with experts
    (stacked [L, E, ...] tensors, gate and up chunks, the experts' extra states)."""
    src, want = ep2
    dst = tmp_path / "dist"
    r = run_cli("convert", src, dst, "--to", "megatron-dist", "--tp", to["tp"], "--ep", to["ep"],
                "--dp", to["ep"], "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 0, r.err
    assert_close(M.load_moe_dist_logits(M.MOE, to["tp"], to["ep"], dst), want)


QWEN2_MOE = dict(M.MOE, shared=40, pre_softmax=True, qkv_bias=True)
"""Qwen2-MoE's math in Megatron-Core: a gated shared expert, softmax before top-k, QKV bias."""


def test_qwen2_moe_to_megatron_runs_in_megatron_core_and_comes_back(tmp_path, run_cli):
    """HF Qwen2-MoE (shared expert with its sigmoid gate, norm_topk_prob false) ->
    megatron --tp 2 --ep 2 -> real megatron-core gives transformers' logits; -> hf back too."""
    transformers = peer("transformers")

    m = QWEN2_MOE
    config = transformers.Qwen2MoeConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
        moe_intermediate_size=m["moe_ffn_hidden_size"], shared_expert_intermediate_size=m["shared"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_query_groups"], num_experts=m["num_experts"],
        num_experts_per_tok=m["topk"], norm_topk_prob=False, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "shared_expert_gate" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    dst = hf_moe_round_trip(model, m, tmp_path, run_cli)
    args = torch.load(next(dst.glob("iter_*/mp_rank_00_000/model_optim_rng.pt")), weights_only=False)["args"]
    assert (args.moe_router_pre_softmax, args.moe_shared_expert_gate,
            args.moe_shared_expert_intermediate_size, args.add_qkv_bias) == (True, True, 40, True)


def hf_moe_round_trip(model, m: dict, tmp_path, run_cli):
    """``model`` saved by save_pretrained -> megatron --tp 2 --ep 2 -> real megatron-core
    (built from the harness dict ``m``) gives transformers' logits; -> hf back gives them, as
    the same architecture. Returns the Megatron checkpoint."""
    from tests.harness.hf import hf_logits, load_hf

    src = tmp_path / "hf"
    model.save_pretrained(src)
    want = hf_logits(model, m["vocab_size"])
    dst = tmp_path / "mg"
    r = run_cli("convert", src, dst, "--to", "megatron", "--tp", 2, "--ep", 2, "--dp", 2)
    assert r.code == 0, r.err
    assert_close(M.load_moe_logits(m, 2, 2, dst), want)
    back = tmp_path / "back"
    r = run_cli("convert", dst, back, "--to", "hf")
    assert r.code == 0, r.err
    got = load_hf(back, dtype=torch.float32, attn_implementation="eager")
    assert type(got).__name__ == type(model).__name__
    assert_close(hf_logits(got, m["vocab_size"]), want, atol=1e-5)
    return dst


def test_qwen3_moe_to_megatron_runs_in_megatron_core_and_comes_back(tmp_path, run_cli):
    """HF Qwen3-MoE (QK norms, norm_topk_prob true: Mixtral's router) -> megatron --tp 2
    --ep 2 -> real megatron-core gives transformers' logits; -> hf back too."""
    transformers = peer("transformers")

    m = dict(M.MOE, qk_layernorm=True)
    config = transformers.Qwen3MoeConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
        moe_intermediate_size=m["moe_ffn_hidden_size"], num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_query_groups"],
        head_dim=m["hidden_size"] // m["num_attention_heads"], num_experts=m["num_experts"],
        num_experts_per_tok=m["topk"], norm_topk_prob=True, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    hf_moe_round_trip(model, m, tmp_path, run_cli)


# ------------------------------------------------------ with the optimizer state


@pytest.fixture(scope="module")
def trained_ep2(tmp_path_factory):
    """A real MoE run at TP1/EP2 trained 2 steps with Adam (Megatron-Core's param groups:
    dense, expert-parallel, no decay), saved with its optimizer state; the uninterrupted
    run's next step."""
    root = tmp_path_factory.mktemp("moe_train") / "ep2"
    return root, M.train_and_save_moe(M.MOE, 1, 2, root)


@pytest.mark.parametrize("to", [dict(tp=1, ep=2), dict(tp=1, ep=1), dict(tp=1, ep=4)])
def test_reshard_with_adam_state_resumes_exactly_at_another_ep(trained_ep2, to, tmp_path, run_cli):
    """EP2 -> EP2 (a rewrite) / EP1 / EP4 with the optimizer: Megatron-Core's groups at the new EP
    (experts leave or join the expert-parallel group), the moments and steps carried, and the
    next step equals the uninterrupted run's."""
    src, after = trained_ep2
    dst = tmp_path / "out"
    r = run_cli("reshard", src, dst, "--to-tp", to["tp"], "--to-ep", to["ep"], "--to-dp", to["ep"],
                "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 0, r.err
    resumed = M.resume_one_step_moe(M.MOE, to["tp"], to["ep"], dst)
    assert abs(resumed["loss"] - after["loss"]) / abs(after["loss"]) < 1e-5
    assert_close(resumed["logits"], after["logits"])


def test_torch_dist_reshards_its_experts_in_place(dist_ep2, tmp_path, run_cli):
    """megatron-dist -> megatron-dist at EP1: mcore's own load gives the save's logits."""
    src, want = dist_ep2
    dst = tmp_path / "ep1"
    r = run_cli("reshard", src, dst, "--to-ep", 1, "--to-dp", 1, "--true-vocab-size", M.MOE["vocab_size"])
    assert r.code == 0, r.err
    assert_close(M.load_moe_dist_logits(M.MOE, 1, 1, dst), want)


def test_args_that_claim_more_experts_than_the_files_hold_are_refused(ep2, tmp_path, run_cli):
    """A checkpoint is untrusted: args naming experts (or EP ranks) the files do not hold are
    a bad checkpoint (exit 1), before anything is laid out for them."""
    src, _ = ep2
    for change, says in ((dict(num_experts=400000), "the layout from args says [400000"),
                         (dict(expert_model_parallel_size=1024, data_parallel_size=1024),
                          "rank directories, 2 found")):
        bad = tmp_path / f"bad{len(says)}"
        shutil.copytree(src, bad)
        for f in bad.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
            state = torch.load(f, weights_only=False)
            vars(state["args"]).update(change)
            torch.save(state, f)
        r = run_cli("inspect", bad)
        assert r.code == 1 and says in r.err and "Traceback" not in r.err, r.err
    bad = tmp_path / "missing"
    shutil.copytree(src, bad)
    f = bad / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["model"] = {k: v for k, v in state["model"].items() if ".local_experts.1." not in k}
    torch.save(state, f)
    r = run_cli("inspect", bad)
    assert r.code == 1 and "experts args name" in r.err and "Traceback" not in r.err, r.err


def test_moe_layer_freq_as_a_list_is_not_written_as_stacked_torch_dist(ep2, tmp_path, run_cli):
    """``--moe-layer-freq "([1]*L)"`` stores a list, under which Megatron-Core keys every layer
    apart in torch_dist (non-homogeneous layers): ckptool's stacked layers would not load there
    (exit 0, then Megatron's KeyError). Refused for torch_dist, kept by legacy output."""
    src, _ = ep2
    listed = tmp_path / "listed"
    shutil.copytree(src, listed)
    for f in listed.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        state["args"].moe_layer_freq = [1] * state["args"].num_layers
        torch.save(state, f)
    dst = tmp_path / "dist"
    r = run_cli("convert", listed, dst, "--to", "megatron-dist", "--ep", "2", "--dp", "2")
    assert r.code == 2 and "moe_layer_freq=[1, 1] (a list)" in r.err and not dst.exists(), r.err
    assert run_cli("reshard", listed, tmp_path / "ep1", "--to-ep", "1", "--to-dp", "1").code == 0


@pytest.mark.parametrize("extra, feature", [
    ("decoder.layers.0.mlp.router.expert_bias", "the router's expert bias"),
    ("decoder.layers.0.mlp.router.bias", "a router bias"),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight0", "grouped-GEMM expert weight"),
])
def test_moe_features_not_laid_out_yet_are_named_not_called_damage(ep2, extra, feature, tmp_path,
                                                                   run_cli):
    """A valid Megatron-Core MoE feature the expert layout does not hold yet is refused naming
    it (exit 2), not reported as a checkpoint that "does not fit" its args (exit 1)."""
    src, _ = ep2
    featured = tmp_path / "featured"
    shutil.copytree(src, featured)
    for f in featured.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        state["model"][extra] = torch.zeros(4)
        torch.save(state, f)
    dst = tmp_path / "out"
    r = run_cli("reshard", featured, dst, "--to-ep", "1", "--to-dp", "1")
    assert r.code == 2 and feature in r.err and "does not lay out yet" in r.err, r.err
    assert not dst.exists()


# ------------------------------------------------------------------ the training hook


@pytest.fixture(scope="module")
def hook_ep2(tmp_path_factory):
    """A real MoE run at TP1/EP2 saved through the training hook after 2 Adam steps."""
    root = tmp_path_factory.mktemp("moe_hook") / "run"
    return root, M.hook_train_save_moe(M.MOE, 1, 2, root)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_the_hook_saves_experts_at_ep2_and_resumes_at_another_ep(hook_ep2, ep):
    """training.megatron.sharded_state describes an EP rank's experts by the layout rule, so
    the run resumes at EP1/EP4 through load_latest: rank 0's expert moments hold the saved
    experts' (rank 0 holds experts 0..E/EP-1 at any EP), and the next loss is the
    uninterrupted run's."""
    root, after = hook_ep2
    resumed = M.hook_resume_moe(M.MOE, 1, ep, root)
    assert resumed["step"] == 2
    assert abs(resumed["loss"] - after["loss"]) / abs(after["loss"]) < 1e-5
    experts = [k for k in after["state"] if ".local_experts." in k]
    assert experts and any(".local_experts.1." in k for k in experts)
    shared = [k for k in experts if k in resumed["state"]]
    assert shared, "rank 0 holds expert 0 at any EP"
    for k in shared:
        assert torch.equal(resumed["state"][k], after["state"][k]), k


def test_the_hooks_moe_checkpoint_converts_offline(hook_ep2, tmp_path, run_cli):
    """ckptool convert reads the hook's MoE checkpoint (per-expert keys) like any other: to
    Megatron at EP4, loaded strictly by mcore with the saved model's logits. (The hook's
    optimizer state converts to Megatron only with #19: one step per parameter.)"""
    root, after = hook_ep2
    latest = run_cli("latest", root)
    assert latest.code == 0, latest.err
    assert run_cli("verify", "--deep", latest.out.strip()).code == 0
    dst = tmp_path / "meg"
    r = run_cli("convert", latest.out.strip(), dst, "--to", "megatron", "--tp", 1, "--ep", 4, "--dp", 4,
                "--drop-optimizer")
    assert r.code == 0, r.err
    assert_close(M.load_moe_logits(M.MOE, 1, 4, dst), after["logits"])


def test_mixtral_through_megatron_tp2_pp2_ep2_comes_back_with_its_logits(tmp_path, run_cli):
    """EP with PP names rank directories ``mp_rank_TT_PPP_EEE``: ckptool wrote them and then
    refused to read them ("expert-parallel Megatron checkpoints are not supported yet")."""
    from tests.harness.hf import hf_logits, load_hf

    src = tmp_path / "mixtral"
    want = hf_logits(make_mixtral(src), M.MOE["vocab_size"])
    dst, back = tmp_path / "mg", tmp_path / "back"
    r = run_cli("convert", src, dst, "--to", "megatron", "--tp", 2, "--pp", 2, "--ep", 2, "--dp", 2)
    assert r.code == 0, r.err
    assert (dst / "iter_0000000" / "mp_rank_01_001_001").is_dir()
    assert run_cli("verify", dst, "--deep").code == 0
    r = run_cli("convert", dst, back, "--to", "hf")
    assert r.code == 0, r.err
    assert_close(hf_logits(load_hf(back, dtype=torch.float32, attn_implementation="eager"),
                           M.MOE["vocab_size"]), want, atol=1e-5)
