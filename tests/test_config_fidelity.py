"""No conversion silently changes the model's math (issue #15).

Every Hugging Face config field, and every math-affecting Megatron arg, is carried to the
output, or is on the short list of fields that do not change what the weights compute, or
the conversion is refused (exit 2, one line naming the field and its value) before anything
is written. Proven on real ``save_pretrained`` output (transformers 5 keeps RoPE scaling in
``rope_parameters``, older files in ``rope_scaling``), on real megatron-core checkpoints
(tests/harness/mcore.py) with their args changed, and by logits where a conversion goes on.

Also: ``--model-family`` names the HF schema on whichever side is HF, so a Megatron-Core
``torch_dist`` source converts ``--to hf --model-family llama`` (and a wrong family is
refused with the model's traits).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import peer

transformers = peer("transformers")
peer("megatron.core")

from tests.harness import mcore as H  # noqa: E402
from tests.harness.hf import hf_logits, load_hf  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1)
"""A tiny Llama/Mistral: GQA (4 heads, 2 kv groups), untied, head_dim 8."""
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
"""Llama 3.1's RoPE scaling, cut down: wavelengths above 16 tokens are stretched, so it changes
the logits well inside 64 tokens."""
TOKENS = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(3))


# ------------------------------------------------------------------------------ helpers


def save_hf(root: Path, cls=None, config_cls=None, **config) -> Path:
    """A real transformers model with random weights, saved by ``save_pretrained``."""
    config_cls = config_cls or transformers.LlamaConfig
    cls = cls or transformers.LlamaForCausalLM
    torch.manual_seed(0)
    cls(config_cls(**{**SMALL, **config})).eval().save_pretrained(root)
    return root


def edit_config(root: Path, dst: Path, **changes) -> Path:
    """A copy of the HF checkpoint ``root`` whose config.json has ``changes`` (None pops)."""
    shutil.copytree(root, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def logits(root: Path) -> torch.Tensor:
    model = load_hf(root, dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


def assert_refused(r, dst: Path, what: str) -> None:
    """Exit 2, one line on stderr naming ``what``, no traceback, no DST and no DST.tmp-*."""
    assert r.code == 2, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptool: error: "), r.err
    assert what in lines[0], lines[0]
    assert "would compute differently" in lines[0] or "--model-family" in lines[0], lines[0]
    assert "Traceback" not in r.err + r.out
    assert not dst.exists()
    assert not list(dst.parent.glob(f"{dst.name}.tmp-*"))


def rewrite_args(path: Path, **changes) -> None:
    """Set Megatron ``args`` fields in a torch.save file (a rank file, or common.pt)."""
    state = torch.load(path, weights_only=False)
    for key, value in changes.items():
        setattr(state["args"], key, value)
    torch.save(state, path)


# ------------------------------------------------------------------ HF config: refused


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Real save_pretrained output of each model the guard must catch, and plain ones."""
    base = tmp_path_factory.mktemp("hf")
    out = {
        "llama": save_hf(base / "llama"),
        "llama3": save_hf(base / "llama3", rope_scaling=dict(LLAMA3)),
        "mistral-window": save_hf(base / "mistral-window", transformers.MistralForCausalLM,
                                  transformers.MistralConfig, sliding_window=4),
        "mistral": save_hf(base / "mistral", transformers.MistralForCausalLM,
                           transformers.MistralConfig, sliding_window=None),
        "attention-bias": save_hf(base / "attention-bias", attention_bias=True),
        "partial-rotary": save_hf(base / "partial-rotary", partial_rotary_factor=0.5),
    }
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        activation_function="relu")).save_pretrained(base / "gpt2-relu")
    out["gpt2-relu"] = base / "gpt2-relu"
    return out


def test_transformers_saves_what_the_guard_reads(hf_models):
    """The fixtures hold the fields as transformers 5 writes them (else the tests below
    would test nothing): RoPE scaling and partial rotary in rope_parameters."""
    cfg = lambda name: json.loads((hf_models[name] / "config.json").read_text())  # noqa: E731
    assert cfg("llama3")["rope_parameters"]["rope_type"] == "llama3"
    assert cfg("llama")["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert cfg("mistral-window")["sliding_window"] == 4 and cfg("mistral")["sliding_window"] is None
    assert cfg("attention-bias")["attention_bias"] is True
    assert cfg("partial-rotary")["rope_parameters"]["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("target", ["megatron", "megatron-dist"])
def test_llama3_rope_scaling_megatron_cannot_run_is_refused(hf_models, tmp_path, run_cli, target):
    """Megatron runs Llama 3.1 scaling only with its fixed factors (original context 8192):
    this model's (16) is refused, naming it, rather than written as another model."""
    dst = tmp_path / "out"
    r = run_cli("convert", hf_models["llama3"], dst, "--to", target)
    assert_refused(r, dst, "original_max_position_embeddings=16, which Megatron output cannot express")
    assert "Convert to dcp, hf or deepspeed" in r.err


def test_llama3_rope_scaling_is_carried_by_dcp(hf_models, tmp_path, run_cli):
    """dcp carries the model's features in its manifest: back to hf with the same logits."""
    mid, back = tmp_path / "dcp", tmp_path / "back"
    assert run_cli("convert", hf_models["llama3"], mid, "--to", "dcp").code == 0
    assert run_cli("convert", mid, back, "--to", "hf").code == 0
    assert json.loads((back / "config.json").read_text())["rope_parameters"] == \
        json.loads((hf_models["llama3"] / "config.json").read_text())["rope_parameters"]
    assert (logits(back) - logits(hf_models["llama3"])).abs().max() < 1e-5


@pytest.mark.parametrize("case,target,field,value", [
    ("attention-bias", "megatron", "attention_bias", "True"),
    ("attention-bias", "hf", "attention_bias", "True"),  # the llama table has no bias tensors
    ("attention-bias", "deepspeed", "attention_bias", "True"),
    ("partial-rotary", "megatron", "rope_parameters", "{'partial_rotary_factor': 0.5"),
    ("gpt2-relu", "megatron", "activation_function", "'relu'"),
])
def test_math_changing_fields_of_real_configs_are_refused(hf_models, tmp_path, run_cli, case, target,
                                                          field, value):
    dst = tmp_path / "out"
    r = run_cli("convert", hf_models[case], dst, "--to", target)
    assert_refused(r, dst, f"config.json field {field}={value}")
    assert f"not carried to {target} output" in r.err


@pytest.mark.parametrize("changes,field", [
    # Llama 3.1's config.json as the Hub has it (transformers 4 layout), with factors
    # Megatron-Core cannot run: the feature is named
    (dict(rope_parameters=None, rope_theta=500000.0, rope_scaling=LLAMA3),
     "original_max_position_embeddings=16, which Megatron output cannot express"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling=linear, which Megatron"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(my_new_feature=3), "my_new_feature=3"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(sliding_window=16), "sliding_window=16"),
    (dict(use_sliding_window=True, sliding_window=16), "sliding_window=16"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types=["),
])
def test_edited_configs_are_refused_naming_the_field(hf_models, tmp_path, run_cli, changes, field):
    src = edit_config(hf_models["llama"], tmp_path / "src", **changes)
    dst = tmp_path / "out"
    what = field if "Megatron" in field else f"config.json field {field}"
    assert_refused(run_cli("convert", src, dst, "--to", "megatron"), dst, what)


def test_unknown_field_is_carried_where_config_json_is_kept(hf_models, tmp_path, run_cli):
    """An unknown field survives hf -> hf and hf -> deepspeed (the file is kept as it is)."""
    src = edit_config(hf_models["llama"], tmp_path / "src", my_new_feature=3)
    for target in ("hf", "deepspeed"):
        dst = tmp_path / target
        r = run_cli("convert", src, dst, "--to", target)
        assert r.code == 0, r.err
        assert json.loads((dst / "config.json").read_text())["my_new_feature"] == 3


# --------------------------------------------------- HF config: carried, or a no-op


def test_llama3_scaling_survives_hf_and_deepspeed_round_trips(hf_models, tmp_path, run_cli):
    """Outputs that keep config.json carry the scaling: the same logits, which the scaling
    does change (the same weights without it compute something else)."""
    src = hf_models["llama3"]
    want = logits(src)
    plain = edit_config(src, tmp_path / "plain",
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert (logits(plain) - want).abs().max() > 1e-2  # the scaling matters at 64 tokens
    hf = tmp_path / "hf"
    assert run_cli("convert", src, hf, "--to", "hf").code == 0
    assert json.loads((hf / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    assert (logits(hf) - want).abs().max() < 1e-5
    ds, back = tmp_path / "ds", tmp_path / "back"
    assert run_cli("convert", src, ds, "--to", "deepspeed").code == 0
    r = run_cli("convert", ds, back, "--to", "hf")
    assert r.code == 0, r.err
    assert (logits(back) - want).abs().max() < 1e-5
    # deepspeed (HF names + config.json) to a format that keeps only the ModelSpec: refused
    dst = tmp_path / "mg"
    assert_refused(run_cli("convert", ds, dst, "--to", "megatron"), dst,
                   "original_max_position_embeddings=16, which Megatron output cannot express")


LOSSY = {
    "llama-yarn": (None, None, dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                     "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 8})),
    "phi3-longrope": ("Phi3ForCausalLM", "Phi3Config", dict(
        pad_token_id=0, original_max_position_embeddings=16, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 2.5],
            "long_factor": [2.0, 3.0, 4.0, 5.0], "original_max_position_embeddings": 16})),
    "qwen2-window-pattern": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        use_sliding_window=True, sliding_window=4, max_window_layers=1)),
}
"""Fields the ModelSpec reads only approximately (RoPE types ckptool does not map, a per-layer
window pattern): formats that carry the spec alone refuse them."""


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_fields_the_spec_cannot_hold_survive_hf_and_deepspeed_as_they_are(name, tmp_path, run_cli):
    """An output that keeps config.json keeps these fields as the source has them: they were
    rewritten from the spec's approximate reading (yarn or longrope as default RoPE, the
    window pattern as none), exit 0 with logits off by 1-3."""
    cls, config_cls, config = LOSSY[name]
    src = save_hf(tmp_path / "src", cls and getattr(transformers, cls),
                  config_cls and getattr(transformers, config_cls), **config)
    want = logits(src)
    field = "layer_types" if "window" in name else "rope_parameters"
    source_field = json.loads((src / "config.json").read_text())[field]
    hf, ds, back = tmp_path / "hf", tmp_path / "ds", tmp_path / "back"
    for step in (("convert", src, hf, "--to", "hf"), ("convert", src, ds, "--to", "deepspeed"),
                 ("convert", ds, back, "--to", "hf")):
        r = run_cli(*step)
        assert r.code == 0, r.err
    for out in (hf, back):
        assert json.loads((out / "config.json").read_text())[field] == source_field
        assert (logits(out) - want).abs().max() < 1e-5
    dst = tmp_path / "mg"
    r = run_cli("convert", src, dst, "--to", "megatron")
    assert r.code == 2 and not dst.exists(), r.err


QWEN_WINDOWS = {  # (model, config edits, what transformers runs)
    # no use_sliding_window key: transformers' default, False: no window
    "qwen2-no-use-key": ("Qwen2", dict(use_sliding_window=None, sliding_window=4, layer_types=None),
                         "none"),
    # Qwen2-MoE windows the even layers below max_window_layers: 0 is no window at all
    "qwen2_moe-below-0": ("Qwen2Moe", dict(use_sliding_window=True, sliding_window=4,
                                           max_window_layers=0, layer_types=None), "none"),
    # ... and 2 is layer 0 alone of 2: a pattern, refused
    "qwen2_moe-below-2": ("Qwen2Moe", dict(use_sliding_window=True, sliding_window=4,
                                           max_window_layers=2, layer_types=None), "refused"),
    # Qwen2 windows the layers from max_window_layers on: 0 is every layer
    "qwen2-from-0": ("Qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                                   layer_types=None), "every layer"),
    # no max_window_layers: transformers' 28, so Qwen2's 2 layers have none (read as 0, every
    # layer had the window), and Qwen2-MoE's layer 0 alone has it (a pattern: refused)
    "qwen2-default-28": ("Qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=None,
                                       layer_types=None), "none"),
    "qwen2_moe-default-28": ("Qwen2Moe", dict(use_sliding_window=True, sliding_window=4,
                                              max_window_layers=None, layer_types=None), "refused"),
}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=40)


@pytest.mark.parametrize("name", sorted(QWEN_WINDOWS))
def test_qwen_windows_are_read_as_transformers_reads_them(name, tmp_path, run_cli):
    """Each Qwen class reads use_sliding_window / max_window_layers its own way (a config
    without layer_types, as transformers 4 wrote them): through Megatron (the spec) and back,
    the model computes what transformers computes, or the conversion is refused."""
    model, edits, runs = QWEN_WINDOWS[name]
    extra = MOE if model == "Qwen2Moe" else {}
    src = save_hf(tmp_path / "made", getattr(transformers, f"{model}ForCausalLM"),
                  getattr(transformers, f"{model}Config"), **extra)
    src = edit_config(src, tmp_path / "src", **edits)
    want = logits(src)
    plain = edit_config(src, tmp_path / "plain", use_sliding_window=False)
    assert ((logits(plain) - want).abs().max() < 1e-6) == (runs == "none")  # the premise
    mid, back = tmp_path / "mg", tmp_path / "back"
    r = run_cli("convert", src, mid, "--to", "megatron")
    if runs == "refused":
        assert_refused(r, mid, "max_window_layers")
        return
    assert r.code == 0, r.err
    assert run_cli("convert", mid, back, "--to", "hf").code == 0
    assert (logits(back) - want).abs().max() < 1e-5


IGNORED_WINDOW_FIELDS = {  # (model, fields its transformers class does not read)
    "mistral-use_sliding_window": ("Mistral", dict(use_sliding_window=False)),
    "phi3-use_sliding_window": ("Phi3", dict(use_sliding_window=False)),
    "phi3-layer_types": ("Phi3", dict(layer_types=["full_attention"] * 2)),
    "mixtral-use_sliding_window": ("Mixtral", dict(use_sliding_window=False)),
    "mixtral-layer_types": ("Mixtral", dict(layer_types=["full_attention"] * 2)),
}


@pytest.mark.parametrize("name", sorted(IGNORED_WINDOW_FIELDS))
def test_window_fields_a_family_ignores_do_not_drop_its_window(name, tmp_path, run_cli):
    """Only Qwen's classes read use_sliding_window, and Phi-3's and Mixtral's ignore
    layer_types: beside sliding_window they leave the window on every layer. ckptool read
    them as full attention (exit 0, logits off by 4-5)."""
    model, edits = IGNORED_WINDOW_FIELDS[name]
    extra = {"Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "Phi3": dict(pad_token_id=0)}.get(model, {})
    src = save_hf(tmp_path / "made", getattr(transformers, f"{model}ForCausalLM"),
                  getattr(transformers, f"{model}Config"), sliding_window=4, **extra)
    want = logits(src)
    edited = edit_config(src, tmp_path / "src", **edits)
    full = edit_config(src, tmp_path / "full", sliding_window=None)
    assert (logits(edited) - want).abs().max() < 1e-6  # the premise: the window is still on
    assert (logits(full) - want).abs().max() > 1e-3  # ... and it matters
    mid, back = tmp_path / "mg", tmp_path / "back"
    r = run_cli("convert", edited, mid, "--to", "megatron-dist")
    assert r.code == 0, r.err
    assert run_cli("convert", mid, back, "--to", "hf").code == 0
    assert (logits(back) - want).abs().max() < 1e-5


MALFORMED = {  # a value transformers would not run as ckptool would have read it
    "window 0": (dict(sliding_window=0), "sliding_window=0"),
    "negative window": (dict(sliding_window=-3), "sliding_window=-3"),
    "fractional llama3 context": (dict(rope_parameters={**LLAMA3, "rope_theta": 10000.0,
                                                        "original_max_position_embeddings": 16.5}),
                                  "rope_parameters="),
    "rope_type a list": (dict(rope_parameters={**LLAMA3, "rope_theta": 10000.0, "rope_type": ["llama3"]}),
                         "rope_parameters="),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_attention_fields_are_refused_naming_them(case, hf_models, tmp_path, run_cli):
    """A window of 0 or less was written as Megatron's (-1, 0), which is full attention, or
    (-4, 0); a fractional original context was cut to an int (another model); an unhashable
    rope_type read as ckptool's own crash."""
    edits, what = MALFORMED[case]
    src = edit_config(hf_models["mistral-window"], tmp_path / "src", **edits)
    for target in ("megatron", "megatron-dist"):  # hf and dcp keep config.json as it is
        assert_refused(run_cli("convert", src, tmp_path / target, "--to", target),
                       tmp_path / target, what)


@pytest.mark.parametrize("model", ["Gemma2", "Gemma3Text"])
def test_gemma2_and_3_with_the_exact_gelu_are_refused(model, tmp_path, run_cli):
    """Gemma 2/3 read hidden_activation, where "gelu" is the exact GELU (only Gemma 1's
    hidden_act="gelu" means the tanh form): it was written back as gelu_pytorch_tanh, exit 0."""
    cls = transformers.Gemma2ForCausalLM if model == "Gemma2" else transformers.Gemma3ForCausalLM
    src = save_hf(tmp_path / "src", cls, getattr(transformers, f"{model}Config"), head_dim=8,
                  hidden_activation="gelu")
    tanh = edit_config(src, tmp_path / "tanh", hidden_activation="gelu_pytorch_tanh")
    assert (logits(tanh) - logits(src)).abs().max() > 1e-4  # the premise: another model
    for target in ("hf", "dcp"):
        assert_refused(run_cli("convert", src, tmp_path / target, "--to", target), tmp_path / target,
                       "hidden_activation='gelu'")
    assert run_cli("convert", tanh, tmp_path / "ok", "--to", "hf").code == 0


def test_no_op_fields_convert_with_the_same_logits(hf_models, tmp_path, run_cli):
    """Fields at their no-op values (and neutral ones) do not stop hf -> megatron -> hf,
    which gives the source's logits."""
    src = hf_models["llama"]
    want = logits(src)
    edited = edit_config(src, tmp_path / "src", attention_bias=False, mlp_bias=False,
                         sliding_window=4096, use_sliding_window=False, max_window_layers=28,
                         rope_scaling=None, partial_rotary_factor=1.0,
                         layer_types=["full_attention"] * 2, pretraining_tp=1, bos_token_id=5,
                         attention_dropout=0.1, _name_or_path="somewhere/llama")
    mid, back = tmp_path / "mg", tmp_path / "back"
    r = run_cli("convert", edited, mid, "--to", "megatron", "--tp", "2")
    assert r.code == 0, r.err
    r = run_cli("convert", mid, back, "--to", "hf")
    assert r.code == 0, r.err
    assert (logits(back) - want).abs().max() < 1e-5


def test_mistral_without_a_window_converts_and_round_trips(hf_models, tmp_path, run_cli):
    src = hf_models["mistral"]
    mid, back = tmp_path / "mg", tmp_path / "back"
    assert run_cli("convert", src, mid, "--to", "megatron").code == 0
    assert run_cli("convert", mid, back, "--to", "hf").code == 0
    assert (logits(back) - logits(src)).abs().max() < 1e-5


@pytest.mark.parametrize("case", ["llama3", "mistral-window", "attention-bias"])
def test_inspect_and_verify_still_read_such_checkpoints(hf_models, run_cli, case):
    assert run_cli("inspect", hf_models[case]).code == 0
    r = run_cli("verify", "--deep", hf_models[case])
    assert r.code == 0, r.out + r.err


# ------------------------------------------------------------------- Megatron args


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """A real megatron-core Llama (TP1) in the legacy layout, and its logits."""
    root = tmp_path_factory.mktemp("mg") / "legacy"
    return root, H.save_real(H.LLAMA, 1, root)


RANK0 = Path("iter_0000010") / "mp_rank_00" / "model_optim_rng.pt"

MATH_ARGS = [("window_size", (4, 2)), ("window_attn_skip_freq", 2), ("rotary_percent", 0.5),
             ("apply_layernorm_1p", True),
             ("apply_residual_connection_post_layernorm", True),
             ("multi_latent_attention", True), ("rotary_interleaved", True), ("squared_relu", True),
             ("position_embedding_type", "none"), ("hybrid_layer_pattern", "M*M*")]


@pytest.mark.parametrize("name,value", MATH_ARGS)
def test_math_args_are_refused_going_out_of_megatron(legacy, tmp_path, run_cli, name, value):
    src = tmp_path / "src"
    shutil.copytree(legacy[0], src)
    rewrite_args(src / RANK0, **{name: value})
    for target in ("hf", "dcp"):
        dst = tmp_path / target
        r = run_cli("convert", src, dst, "--to", target, "--true-vocab-size", 1000)
        assert_refused(r, dst, f"Megatron arg {name}={value!r} is not carried to {target} output")


def test_no_op_math_args_convert_to_hf(legacy, tmp_path, run_cli):
    """Math args at their no-op values (as Megatron-LM stores them by default) pass."""
    src = tmp_path / "src"
    shutil.copytree(legacy[0], src)
    rewrite_args(src / RANK0, use_rope_scaling=False, rope_scaling_factor=8.0, window_size=None,
                 rotary_percent=1.0, num_experts=None, add_qkv_bias=False, qk_layernorm=False,
                 apply_layernorm_1p=False, rotary_interleaved=False, softmax_type="vanilla",
                 hidden_dropout=0.1, lr=3e-4, seed=1234)
    dst = tmp_path / "hf"
    r = run_cli("convert", src, dst, "--to", "hf", "--true-vocab-size", 1000)
    assert r.code == 0, r.err
    assert (logits_of(dst, 1000) - legacy[1]).abs().max() < 1e-5


def logits_of(root: Path, vocab: int) -> torch.Tensor:
    return hf_logits(transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval(),
                     vocab)


def test_megatron_outputs_keep_the_args_so_reshard_and_inspect_work(legacy, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(legacy[0], src)
    rewrite_args(src / RANK0, use_rope_scaling=True)
    assert run_cli("inspect", src).code == 0
    assert run_cli("verify", src).code == 0
    resharded = tmp_path / "pp2"
    r = run_cli("reshard", src, resharded, "--to-pp", 2, "--true-vocab-size", 1000)
    assert r.code == 0, r.err
    args = torch.load(resharded / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt",
                      weights_only=False)["args"]
    assert args.use_rope_scaling is True and args.pipeline_model_parallel_size == 2
    dist = tmp_path / "dist"
    r = run_cli("convert", src, dist, "--to", "megatron-dist", "--true-vocab-size", 1000)
    assert r.code == 0, r.err
    common = torch.load(dist / "iter_0000010" / "common.pt", weights_only=False)
    assert common["args"].use_rope_scaling is True
    # ... and that megatron-dist copy goes to hf with the scaling Megatron runs (llama3, factor 8)
    dst = tmp_path / "hf"
    r = run_cli("convert", dist, dst, "--to", "hf")
    assert r.code == 0, r.err
    assert json.loads((dst / "config.json").read_text())["rope_parameters"] == {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# ------------------------------------------------- --model-family on the HF side


@pytest.fixture(scope="module")
def dist(tmp_path_factory, legacy):
    """A real Megatron-Core torch_dist checkpoint of the same model as ``legacy``."""
    root = tmp_path_factory.mktemp("dist") / "dist"
    H.save_dist(H.LLAMA, 1, root)
    return root


def test_torch_dist_to_hf_with_model_family_llama(dist, legacy, tmp_path, run_cli):
    dst = tmp_path / "hf"
    r = run_cli("convert", dist, dst, "--to", "hf", "--model-family", "llama", "--true-vocab-size", 1000)
    assert r.code == 0, r.err
    assert json.loads((dst / "config.json").read_text())["model_type"] == "llama"
    assert (logits_of(dst, 1000) - legacy[1]).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["gpt2", "gpt"])
def test_torch_dist_to_hf_with_a_wrong_family_is_refused(dist, tmp_path, run_cli, family):
    dst = tmp_path / "hf"
    r = run_cli("convert", dist, dst, "--to", "hf", "--model-family", family, "--true-vocab-size", 1000)
    assert_refused(r, dst, "it has RMSNorm, SwiGLU and rotary positions; it is llama, not gpt2")


def test_model_family_without_an_hf_side_is_refused(dist, tmp_path, run_cli):
    dst = tmp_path / "mg"
    r = run_cli("convert", dist, dst, "--to", "megatron", "--model-family", "llama")
    assert_refused(r, dst, "--model-family names a Hugging Face schema, and neither the "
                           "megatron-dist input nor the megatron output has one")


def test_gpt2_model_named_llama_is_refused_with_its_traits(tmp_path, run_cli):
    """A gpt2 model carried through dcp (no config.json left) cannot be written as llama."""
    src = tmp_path / "gpt2"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)).save_pretrained(src)
    mid, dst = tmp_path / "dcp", tmp_path / "hf"
    assert run_cli("convert", src, mid, "--to", "dcp").code == 0
    r = run_cli("convert", mid, dst, "--to", "hf", "--model-family", "llama")
    assert_refused(r, dst, "it has LayerNorm, GELU and learned positions; it is gpt2, not llama")
    r = run_cli("convert", mid, dst, "--to", "hf", "--model-family", "gpt2")
    assert r.code == 0, r.err


# ---- what the same Megatron args compute in each model code (Megatron-Core, the legacy
# models); upstream: megatron/training/arguments.py core_transformer_config_from_args, the
# legacy ParallelMLP and RotaryEmbedding, Megatron-DeepSpeed's arguments.py


def _args(m: dict = H.GPT, **over):
    """Megatron-LM's stored args of the harness model ``m``, with ``over``."""
    import argparse

    return argparse.Namespace(**{**vars(H.megatron_args(m, 1, 1)), **over})


@pytest.mark.parametrize("over,model,want", [
    (dict(openai_gelu=True, bias_gelu_fusion=False), "mcore", "gelu"),  # Megatron-Core reads only the fusion
    (dict(openai_gelu=True, bias_gelu_fusion=False), "legacy", "gelu_tanh"),
    (dict(onnx_safe=True, bias_gelu_fusion=True), "mcore", "gelu_tanh"),
    (dict(onnx_safe=True, bias_gelu_fusion=True), "legacy", "gelu"),  # taken before the fusion
    (dict(bias_gelu_fusion=True), "megatron-deepspeed", "gelu_tanh"),
    (dict(bias_gelu_fusion=True, add_bias_linear=False), "mcore", "gelu"),  # no fused kernel without biases
])
def test_the_gelu_of_megatron_args_is_the_one_its_model_code_runs(over, model, want):
    from converters.schemas.megatron_args import spec_from_args

    assert spec_from_args(_args(**over), model=model)[0].activation == want


def test_megatron_core_ignores_openai_gelu_so_hf_gets_the_exact_gelu(tmp_path, run_cli):
    """A Megatron-Core GPT whose args say --openai-gelu (which Megatron-Core never reads) ran the
    exact GELU: it converts to HF ``gelu`` with the model's logits (it was converted as
    ``gelu_new``)."""
    m = dict(H.GPT, openai_gelu=True)
    src = tmp_path / "mg"
    want = H.save_real(m, 1, src)
    r = run_cli("convert", src, tmp_path / "hf", "--to", "hf", "--true-vocab-size", m["vocab_size"])
    assert r.code == 0, r.err
    model = load_hf(tmp_path / "hf", dtype=torch.float32)
    assert model.config.activation_function == "gelu"
    got = hf_logits(model, m["vocab_size"])
    assert (got - want).abs().max().item() < 1e-5


def test_megatron_deepspeed_args_rope_theta_and_dense_num_experts():
    """Megatron-DeepSpeed stores its RoPE base as ``rope_theta`` (--rotary-position-embeddings-theta,
    which its model applies; ckptool read 10000) and ``num_experts`` as a list, ``[1]`` for every
    dense model (ckptool stopped with a TypeError); DeepSpeed-MoE models are refused by name."""
    from ckptool.core.errors import UnsupportedFormat
    from converters.schemas.megatron_args import spec_from_args

    args = _args(H.LLAMA, use_rotary_position_embeddings=True, normalization="rmsnorm",
                 rope_theta=500000, num_experts=[1], topk=1, expert_interval=2, mlp_type="standard")
    del args.position_embedding_type  # Megatron-DeepSpeed's spelling is the flag above
    spec = spec_from_args(args, model="megatron-deepspeed")[0]
    assert spec.rotary_base == 500000 and not spec.num_experts and not spec.learned_positions
    args.num_experts = [8]
    with pytest.raises(UnsupportedFormat, match=r"Megatron-DeepSpeed MoE \(num_experts=\[8\]"):
        spec_from_args(args, model="megatron-deepspeed")


@pytest.mark.parametrize("over", [dict(rotary_base=500000), dict(use_rope_scaling=True),
                                  dict(window_size=(3, 0))])
def test_args_the_legacy_model_ignores_are_named(over):
    """Megatron-LM's legacy model applies no RoPE base, scaling or window: args of a legacy
    checkpoint that set one disagree with what ran (ckptool carried the args' value: wrong
    logits); Megatron-DeepSpeed's args (rope_theta, which its model applies) do not."""
    from converters.schemas.megatron_args import ignored_by_legacy

    assert next(iter(over)) in ignored_by_legacy(_args(H.LLAMA, **over))
    assert ignored_by_legacy(_args(H.LLAMA, rope_theta=10000, **over)) is None
    assert ignored_by_legacy(_args(H.LLAMA)) is None


def test_a_legacy_checkpoint_whose_args_the_model_ignored_reshards_but_never_converts(tmp_path, run_cli):
    """A legacy-named Megatron-LM checkpoint whose args say --rotary-base 500000 (which its
    model never applied): latest, verify and inspect read it (inspect warns), a reshard that
    keeps its format and names keeps it as it is, and a conversion is refused (it would
    compute base 500000, not the 10000 that ran)."""
    src = save_hf(tmp_path / "hf", num_key_value_heads=4)  # legacy names hold no GQA
    mg = tmp_path / "run"
    assert run_cli("convert", src, mg, "--to", "megatron", "--megatron-names", "legacy").code == 0
    for rank in mg.glob("iter_*/mp_rank_*/model_optim_rng.pt"):  # as Megatron-LM saved it
        rewrite_args(rank, rotary_base=500000.0)
        state = torch.load(rank, weights_only=False)
        del state["ckptool"]
        torch.save(state, rank)
    (mg / "ckptool.json").unlink()
    assert run_cli("latest", mg).code == 0 and run_cli("verify", mg).code == 0
    r = run_cli("inspect", mg)
    assert r.code == 0 and "rotary_base=500000.0" in r.err, r.err
    assert run_cli("reshard", mg, tmp_path / "tp2", "--to-tp", "2").code == 0
    for argv in (["convert", mg, tmp_path / "out", "--to", "hf"],
                 ["convert", mg, tmp_path / "out", "--to", "megatron", "--megatron-names", "mcore-local"]):
        r = run_cli(*argv)
        assert r.code == 2 and "cannot be converted faithfully" in r.err and not (tmp_path / "out").exists(), r.err


def test_legacy_names_are_not_written_for_a_rope_base_the_legacy_model_ignores(tmp_path, run_cli):
    src = save_hf(tmp_path / "llama3", num_key_value_heads=4,  # legacy names hold no GQA
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    r = run_cli("convert", src, tmp_path / "mg", "--to", "megatron", "--megatron-names", "legacy")
    assert r.code == 2 and "RoPE at base 500000" in r.err, r.err
    assert not (tmp_path / "mg").exists()
    assert run_cli("convert", src, tmp_path / "mg", "--to", "megatron").code == 0


def test_megatron_deepspeed_legacy_names_with_rope_theta_reshard_and_convert(tmp_path, run_cli):
    """Megatron-DeepSpeed writes legacy tensor names too, and its model applies ``rope_theta``:
    such a checkpoint reshards in its names (the legacy writer refused the base, as for
    Megatron-LM's legacy model) and converts to HF with that base."""
    import json as _json

    src = save_hf(tmp_path / "hf", num_key_value_heads=4)
    mg = tmp_path / "run"
    assert run_cli("convert", src, mg, "--to", "megatron", "--megatron-names", "legacy").code == 0
    for rank in mg.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(rank, weights_only=False)
        del state["ckptool"], state["args"].rotary_base
        state["args"].rope_theta, state["args"].num_experts = 500000.0, [1]
        torch.save(state, rank)
    (mg / "ckptool.json").unlink()
    r = run_cli("reshard", mg, tmp_path / "tp2", "--to-tp", "2")
    assert r.code == 0, r.err
    assert run_cli("convert", tmp_path / "tp2", tmp_path / "out", "--to", "hf").code == 0
    cfg = _json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta")) == 500000.0, cfg


def test_megatron_rewritten_for_the_other_model_code_keeps_its_gelu(tmp_path, run_cli):
    """The same GELU flags compute differently in Megatron-Core and the legacy model, so a
    checkpoint rewritten under the other code's tensor names gets flags for that code: a
    Megatron-Core GPT whose args say --openai-gelu (ignored there: it ran the exact GELU) keeps
    the exact GELU under legacy names (it read back as tanh), and back under mcore names."""
    import json as _json

    m = dict(H.GPT, openai_gelu=True)
    src = tmp_path / "mg"
    H.save_real(m, 1, src)

    def activation(path):
        return _json.loads(run_cli("inspect", "--json", path).out)["model_config"]["activation"]

    assert activation(src) == "gelu"
    legacy = tmp_path / "legacy"
    assert run_cli("convert", src, legacy, "--to", "megatron", "--megatron-names", "legacy").code == 0
    assert activation(legacy) == "gelu"
    back = tmp_path / "back"
    assert run_cli("convert", legacy, back, "--to", "megatron-dist").code == 0
    assert activation(back) == "gelu"


def test_a_tanh_gelu_without_biases_is_not_written_for_megatron_core():
    """Megatron-Core's only tanh GELU is its fused bias kernel: args for its names cannot say
    a tanh GELU without biases (they said --openai-gelu, which it ignores: the exact GELU ran)."""
    from dataclasses import replace

    from ckptool.core.errors import UsageError
    from ckptool.core.topology import Topology
    from converters.schemas.megatron_args import spec_from_args, update_args

    spec = replace(spec_from_args(_args())[0], add_bias=False, activation="gelu_tanh")
    with pytest.raises(UsageError, match="tanh approximation without biases"):
        update_args(None, spec, Topology(), None, model="mcore")
    legacy = update_args(None, spec, Topology(), None, model="legacy")
    assert spec_from_args(legacy, model="legacy")[0].activation == "gelu_tanh"


# ------------------------------------------------------- fields config.json leaves out

FAMILY_CONFIGS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
                  "gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3Text", "olmo2": "Olmo2",
                  "gpt2": "GPT2", "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}
WINDOWED = {"qwen2": dict(use_sliding_window=True, max_window_layers=3),
            "qwen3": dict(use_sliding_window=True, max_window_layers=3),
            "qwen2_moe": dict(use_sliding_window=True, max_window_layers=99)}
"""Window settings under which the window's own defaults (sliding_window...) count."""


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_a_field_config_json_leaves_out_is_read_as_transformers_takes_it(family):
    """Every field a family's rules read, left out of a config.json, means what the family's
    transformers class takes for it, or the config is refused: Mixtral's RoPE theta (1e6) was
    read as 10000, Qwen3-MoE's top-k (8) as 2, Qwen2-MoE's shared expert as none, several norm
    epsilons as 1e-6, Gemma 2's soft-capping as none... (exit 0, other logits)."""
    from converters.schemas.families import FAMILIES
    from converters.schemas.hf import spec_from_config
    from ckptool.core.errors import UnreadableInput

    config_cls = getattr(transformers, f"{FAMILY_CONFIGS[family]}Config")
    fields = {f for rule in FAMILIES[family].config for f in rule.fields}
    for setting in ({}, WINDOWED.get(family)):
        if setting is None:
            continue
        full = json.loads(config_cls(**setting).to_json_string(use_diff=False))
        want = spec_from_config(full, family)
        for name in sorted(fields & set(full) - set(setting)):
            left_out = {k: v for k, v in full.items() if k != name}
            try:
                got = spec_from_config(left_out, family)
            except UnreadableInput as exc:  # a field ckptool requires: refused, never guessed
                assert "lacks" in str(exc), (name, exc)
                continue
            assert got == want, (family, name, full[name])


LEFT_OUT = {
    # name: (model, its config, the fields then left out, route)
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6),
                ("rope_parameters", "rope_theta", "rms_norm_eps"), "megatron"),
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=8, num_experts_per_tok=8, norm_topk_prob=False,
                                   moe_intermediate_size=24, head_dim=8),
                  ("num_experts_per_tok", "norm_topk_prob"), "megatron"),
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=5632),
                  ("num_experts_per_tok", "shared_expert_intermediate_size"), "megatron"),
    "qwen3-head-dim": ("Qwen3", dict(head_dim=128), ("head_dim",), "megatron"),
    "gemma2-softcaps": ("Gemma2", dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                       head_dim=8, query_pre_attn_scalar=8),
                        ("attn_logit_softcapping", "final_logit_softcapping"), "dcp"),
}


@pytest.mark.parametrize("name", sorted(LEFT_OUT))
def test_a_model_whose_config_json_leaves_fields_out_converts_with_its_logits(name, tmp_path, run_cli):
    """The same models, end to end: transformers computes the same with the fields left out
    (the premise), and so does the round trip through ckptool."""
    model, config, left_out, route = LEFT_OUT[name]
    made = save_hf(tmp_path / "made", getattr(transformers, f"{model}ForCausalLM"),
                   getattr(transformers, f"{model}Config"), **config)
    want = logits(made)
    src = edit_config(made, tmp_path / "src", **{f: None for f in left_out})
    assert (logits(src) - want).abs().max() < 1e-6  # transformers takes the same values
    mid, back = tmp_path / "mid", tmp_path / "back"
    r = run_cli("convert", src, mid, "--to", route, *(["--tp", "2"] if route == "megatron" else []))
    assert r.code == 0, r.err
    assert run_cli("convert", mid, back, "--to", "hf").code == 0
    assert (logits(back) - want).abs().max() < 1e-5


def test_rope_scaling_without_a_theta_takes_the_top_level_or_default_theta(tmp_path, run_cli):
    """transformers 5 takes ``rope_scaling`` whole: with no theta in it, theta is the top-level
    ``rope_theta``, else the class default, never the ``rope_parameters`` beside it (a file
    transformers 5 saved, with a scaling added by hand). ckptool took rope_parameters' 3000."""
    made = save_hf(tmp_path / "made", rope_parameters={"rope_type": "default", "rope_theta": 3000.0})
    src = edit_config(made, tmp_path / "src", rope_scaling={"rope_type": "linear", "factor": 2.0})
    want = logits(src)
    plain = save_hf(tmp_path / "plain", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 10000.0})
    assert (logits(plain) - want).abs().max() < 1e-6  # what transformers runs: theta 10000
    mid, back = tmp_path / "mid", tmp_path / "back"
    assert run_cli("convert", src, mid, "--to", "dcp").code == 0
    assert run_cli("convert", mid, back, "--to", "hf").code == 0
    assert (logits(back) - want).abs().max() < 1e-5


@pytest.mark.parametrize("edit", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[1])])
def test_a_moe_with_dense_layers_is_refused_naming_the_field(edit, tmp_path, run_cli):
    """Qwen2-MoE with dense MLP layers (``decoder_sparse_step`` 2, ``mlp_only_layers``) has tensors
    the table lacks: refused naming the field (exit 2), where the reader failed first with
    "N tensors are missing" (exit 1)."""
    src = save_hf(tmp_path / "src", transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig,
                  **MOE, **edit)
    dst = tmp_path / "dst"
    r = run_cli("convert", src, dst, "--to", "dcp")
    assert r.code == 2 and next(iter(edit)) in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert not dst.exists()


def test_rope_args_of_a_model_without_rope_change_nothing():
    """--use-rope-scaling on a learned-position GPT does nothing in Megatron: the spec has no
    RoPE scaling (it made the conversion refused, blaming RoPE scaling on a model without
    RoPE), and an all-MoE layer frequency spelt as a list is every layer's 1."""
    from converters.schemas.megatron_args import spec_from_args, uncarried_arg

    args = _args(H.GPT, use_rope_scaling=True)
    assert args.position_embedding_type == "learned_absolute"
    assert spec_from_args(args)[0].rope_scaling is None
    assert uncarried_arg(_args(H.GPT, moe_layer_freq=[1, 1])) is None
    assert uncarried_arg(_args(H.GPT, moe_layer_freq=[0, 1]))[0] == "moe_layer_freq"
