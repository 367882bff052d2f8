"""Model families as data (issue #17), proven by logits on both sides: a tiny real
transformers model of each family (``save_pretrained``) converts to Megatron and runs in
real megatron-core with the same logits; it converts back to Hugging Face, and through
dcp and deepspeed, with the same logits and the feature still in config.json. And a real
megatron-core model with the feature converts to the family that expresses it.

Each case turns on one feature: a sliding window (Mistral), a QKV bias and tied embeddings
(Qwen2), QK norms and an explicit head_dim (Qwen3), Llama 3.1's RoPE scaling. A case whose
feature were dropped would give other logits: each is checked to matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import peer

transformers = peer("transformers")
peer("megatron.core")

from safetensors.torch import load_file  # noqa: E402

from tests.harness import mcore as H  # noqa: E402
from tests.harness.hf import hf_logits, load_hf  # noqa: E402

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
            ffn_hidden_size=48, vocab_size=250, swiglu=True, tied=False, bias=False,
            norm="RMSNorm", pos="rope", max_pos=H.SEQ, divisible_by=128)
"""The Megatron side of every case (harness dict), before its feature."""

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}

CASES = {
    # name: (transformers classes, HF config fields, harness features, what must be in config.json)
    "mistral-window": ("Mistral", dict(sliding_window=4), dict(window=4), ("sliding_window", 4)),
    "qwen2-bias-tied": ("Qwen2", dict(tie_word_embeddings=True), dict(qkv_bias=True, tied=True),
                        ("tie_word_embeddings", True)),
    "qwen3-qk-norm": ("Qwen3", dict(head_dim=16), dict(qk_layernorm=True, kv_channels=16),
                      ("head_dim", 16)),
    "llama31-rope": ("Llama", dict(rope_parameters=dict(LLAMA31, rope_theta=10000.0), head_dim=16),
                     dict(rope_scaling=True, kv_channels=16), ("rope_parameters", "llama3")),
    "phi3-fused": ("Phi3", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2), {},
                   ("architectures", ["Phi3ForCausalLM"])),
}
PLAIN = {"mistral-window": dict(sliding_window=None), "qwen2-bias-tied": {}, "qwen3-qk-norm": {},
         "llama31-rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})}
"""Each feature case without its feature (Phi-3's is its tensor layout: the round trips)."""


def _hf_config(name: str, **changes):
    family, fields, _, _ = CASES[name]
    m = BASE
    fields = {**dict(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                     intermediate_size=m["ffn_hidden_size"], num_hidden_layers=m["num_layers"],
                     num_attention_heads=m["num_attention_heads"],
                     num_key_value_heads=m["num_query_groups"], rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1),
              **({"use_sliding_window": False} if family in ("Qwen2", "Qwen3") else {}), **fields}
    fields.update(changes)
    config = getattr(transformers, f"{family}Config")(**fields)
    config._attn_implementation = "eager"
    return getattr(transformers, f"{family}ForCausalLM"), config


def make_hf(root: Path, name: str):
    cls, config = _hf_config(name)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up cannot hide
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(pname))) * 0.3)
            if "q_proj.weight" in pname or "k_proj.weight" in pname:
                p.mul_(4)  # sharp attention: position effects (RoPE scaling, windows) show
    model.save_pretrained(root)
    return model


def harness(name: str) -> dict:
    return {**BASE, **CASES[name][2]}


def config_of(root: Path) -> dict:
    return json.loads((root / "config.json").read_text())


def has_feature(config: dict, name: str) -> bool:
    key, value = CASES[name][3]
    got = config.get(key)
    return got.get("rope_type") == value if isinstance(got, dict) else got == value


def assert_close(a, b, atol=2e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a - b).abs().max().item()
    assert diff < atol, diff


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("families")
    return {name: (base / name, make_hf(base / name, name)) for name in CASES}


def test_each_feature_changes_the_logits(models):
    """The cases test something: the same weights without the feature compute otherwise."""
    for name, plain in PLAIN.items():
        root, model = models[name]
        cls, config = _hf_config(name, **plain)
        other = cls(config).eval()
        state = model.state_dict()
        if name == "qwen2-bias-tied":  # the bias is the feature: zero it
            state = {k: torch.zeros_like(v) if k.endswith("bias") else v for k, v in state.items()}
        if name == "qwen3-qk-norm":
            state = {k: torch.ones_like(v) if "q_norm" in k or "k_norm" in k else v for k, v in state.items()}
        other.load_state_dict(state)
        want = hf_logits(model, BASE["vocab_size"])
        assert (hf_logits(other, BASE["vocab_size"]) - want).abs().max() > 1e-3, name


@pytest.mark.parametrize("name", list(CASES))
def test_hf_to_megatron_runs_in_megatron_core_with_the_same_logits(models, name, tmp_path, run_cli):
    root, model = models[name]
    dst = tmp_path / "mg"
    r = run_cli("convert", root, dst, "--to", "megatron", "--tp", 2, "--pp", 2)
    assert r.code == 0, r.err
    if name == "mistral-window":  # how Megatron must run it to apply the window
        assert "--no-masked-softmax-fusion" in r.out + r.err
    assert_close(H.load_logits(harness(name), 2, 2, dst), hf_logits(model, BASE["vocab_size"]))
    back = tmp_path / "back"
    r = run_cli("convert", dst, back, "--to", "hf")
    assert r.code == 0, r.err
    assert name not in PLAIN or has_feature(config_of(back), name), config_of(back)
    assert_close(hf_logits(load_hf(back, dtype=torch.float32), BASE["vocab_size"]),
                 hf_logits(model, BASE["vocab_size"]))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fmt", ["dcp", "deepspeed", "megatron-dist"])
def test_round_trips_keep_the_weights_bit_exact_and_the_feature(models, name, fmt, tmp_path, run_cli):
    root, model = models[name]
    mid, back = tmp_path / "mid", tmp_path / "back"
    assert run_cli("convert", root, mid, "--to", fmt).code == 0
    r = run_cli("convert", mid, back, "--to", "hf")
    assert r.code == 0, r.err
    if name in PLAIN or fmt == "deepspeed":  # else: Phi-3's math is Llama's, and without the
        # source's config.json it comes back as the first family that expresses it
        assert config_of(back)["architectures"] == config_of(root)["architectures"]
        assert has_feature(config_of(back), name)
        got, want = load_file(back / "model.safetensors"), load_file(root / "model.safetensors")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    else:
        assert config_of(back)["architectures"] == ["LlamaForCausalLM"]
    assert_close(hf_logits(load_hf(back, dtype=torch.float32), BASE["vocab_size"]),
                 hf_logits(model, BASE["vocab_size"]))


@pytest.mark.parametrize("name", list(PLAIN))
def test_megatron_core_model_with_the_feature_converts_to_its_family(name, tmp_path, run_cli):
    m = harness(name)
    src = tmp_path / "mg"
    want = H.save_real(m, 2, src)
    dst = tmp_path / "hf"
    r = run_cli("convert", src, dst, "--to", "hf", "--true-vocab-size", m["vocab_size"])
    assert r.code == 0, r.err
    config = config_of(dst)
    assert config["architectures"] == [f"{CASES[name][0]}ForCausalLM"], config
    assert_close(hf_logits(load_hf(dst, dtype=torch.float32), m["vocab_size"]), want)


@pytest.mark.parametrize("name", list(CASES))
def test_hf_to_torch_dist_loads_in_megatron_core_with_the_same_logits(models, name, tmp_path, run_cli):
    """Megatron-Core's own dist_checkpointing.load reads the torch_dist output (stacked
    layers, the q/k norms and the QKV bias among them) into a model with the feature."""
    root, model = models[name]
    dst = tmp_path / "dist"
    r = run_cli("convert", root, dst, "--to", "megatron-dist", "--tp", 2)
    assert r.code == 0, r.err
    assert_close(H.load_dist_logits(harness(name), 2, dst), hf_logits(model, BASE["vocab_size"]))


# ------------------------------------------------ families Megatron-Core cannot run

NATIVE = {
    # name: (config class, model class, config fields, the feature a Megatron output refuses)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8), "zero-centred norm weights"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                    query_pre_attn_scalar=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
               "norms after attention and the MLP (sandwich)"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                    query_pre_attn_scalar=8, final_logit_softcapping=3.0,
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
               "norms after attention and the MLP (sandwich)"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "norms after attention and the MLP (post)"),
}
"""Families whose math Megatron-Core (as Megatron-LM configures it) cannot express: each goes
through dcp and deepspeed and back exactly, and a Megatron output is refused naming why."""


def make_native(root: Path, name: str):
    config_cls, model_cls, fields, _ = NATIVE[name]
    m = BASE
    config = getattr(transformers, config_cls)(**{**dict(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_query_groups"], max_position_embeddings=64, initializer_range=0.1),
        **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(pname))) * 0.3)
            if "q_proj.weight" in pname or "k_proj.weight" in pname:
                p.mul_(4)
    model.save_pretrained(root)
    return model


@pytest.fixture(scope="module")
def natives(tmp_path_factory):
    base = tmp_path_factory.mktemp("native")
    return {name: (base / name, make_native(base / name, name)) for name in NATIVE}


@pytest.mark.parametrize("name", list(NATIVE))
@pytest.mark.parametrize("fmt", ["dcp", "deepspeed"])
def test_families_megatron_cannot_run_round_trip_exactly(natives, name, fmt, tmp_path, run_cli):
    root, model = natives[name]
    mid, back = tmp_path / "mid", tmp_path / "back"
    r = run_cli("convert", root, mid, "--to", fmt)
    assert r.code == 0, r.err
    r = run_cli("convert", mid, back, "--to", "hf")
    assert r.code == 0, r.err
    want_config, got_config = config_of(root), config_of(back)
    assert got_config["architectures"] == want_config["architectures"]
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "rope_parameters", "head_dim", "tie_word_embeddings"):
        assert got_config.get(key) == want_config.get(key), key
    got, want = load_file(back / "model.safetensors"), load_file(root / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert_close(hf_logits(load_hf(back, dtype=torch.float32, attn_implementation="eager"),
                           BASE["vocab_size"]), hf_logits(model, BASE["vocab_size"]))


@pytest.mark.parametrize("name", list(NATIVE))
def test_families_megatron_cannot_run_are_refused_naming_the_feature(natives, name, tmp_path, run_cli):
    root, _ = natives[name]
    dst = tmp_path / "mg"
    r = run_cli("convert", root, dst, "--to", "megatron")
    assert r.code == 2, r.out + r.err
    assert NATIVE[name][3] in r.err and "cannot express" in r.err, r.err
    assert "Traceback" not in r.err and not dst.exists()
