"""Hugging Face conversion, proven by logits: transformers on one side, real megatron-core
on the other (tests/harness/mcore.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import peer  # noqa: E402

transformers = peer("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.harness import mcore as H  # noqa: E402
from tests.harness.hf import hf_logits, load_hf  # noqa: E402

LLAMA_250 = dict(H.LLAMA, vocab_size=250)
"""GQA (8 heads, 4 kv groups), SwiGLU, untied, vocab 250 (not a multiple of 128)."""
GPT_250 = dict(H.GPT, vocab_size=250)


def _perturb_norms(model):
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up cannot hide
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)


def make_llama(root: Path, m=LLAMA_250):
    cfg = transformers.LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_query_groups"], rms_norm_eps=1e-5, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _perturb_norms(model)
    model.save_pretrained(root)
    return model


def make_gpt2(root: Path, m=GPT_250):
    cfg = transformers.GPT2Config(
        vocab_size=m["vocab_size"], n_embd=m["hidden_size"], n_head=m["num_attention_heads"],
        n_layer=m["num_layers"], n_positions=m["max_pos"], n_inner=m["ffn_hidden_size"],
        activation_function="gelu", layer_norm_epsilon=1e-5, initializer_range=0.1,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    _perturb_norms(model)
    model.save_pretrained(root)
    return model


def weights(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_close(a, b, atol=1e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a - b).abs().max().item()
    assert diff < atol, diff


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "llama"
    return root, make_llama(root)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "gpt2"
    return root, make_gpt2(root)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_to_megatron_tp2_pp2_gives_transformers_logits(family, llama, gpt2, tmp_path, run_cli):
    (root, model), m = (llama, LLAMA_250) if family == "llama" else (gpt2, GPT_250)
    dst = tmp_path / "mg"
    r = run_cli("convert", root, dst, "--to", "megatron", "--tp", "2", "--pp", "2")
    assert r.code == 0, r.err
    # GPT-2 here has the exact GELU, which Megatron runs only with this launch flag
    assert ("--no-bias-gelu-fusion" in r.out) == (family == "gpt2"), r.out
    got = H.load_logits(m, 2, 2, dst)
    assert_close(got, hf_logits(model, m["vocab_size"]))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_megatron_to_hf_loads_in_transformers_with_the_same_logits(family, tmp_path, run_cli):
    m, tp = (H.LLAMA, 2) if family == "llama" else (H.GPT, 1)
    src = tmp_path / "mg"
    want = H.save_real(m, tp, src)
    dst = tmp_path / "hf"
    r = run_cli("convert", src, dst, "--to", "hf", "--true-vocab-size", m["vocab_size"])
    assert r.code == 0, r.err
    model = load_hf(dst, dtype=torch.float32)
    assert model.config.vocab_size == m["vocab_size"]
    assert_close(hf_logits(model, m["vocab_size"]), want)


def test_megatron_fused_bias_gelu_is_the_tanh_gelu_both_ways(tmp_path, run_cli):
    """Megatron-LM's default --bias-gelu-fusion runs the MLP's GELU as the tanh approximation
    (its fused kernel): a GPT-2 trained so converts to HF ``gelu_new`` with the model's logits
    (it was converted as the exact GELU), and back to Megatron with the args saying so."""
    m = dict(H.GPT, gelu_fusion=True)
    src = tmp_path / "mg"
    want = H.save_real(m, 1, src)
    dst = tmp_path / "hf"
    r = run_cli("convert", src, dst, "--to", "hf", "--true-vocab-size", m["vocab_size"])
    assert r.code == 0, r.err
    model = load_hf(dst, dtype=torch.float32)
    assert model.config.activation_function == "gelu_new"
    assert_close(hf_logits(model, m["vocab_size"]), want)
    back = tmp_path / "mg2"
    r = run_cli("convert", dst, back, "--to", "megatron", "--tp", "2")
    assert r.code == 0 and "default --bias-gelu-fusion" in r.out, (r.out, r.err)
    assert_close(H.load_logits(m, 2, 1, back), want)
    r = run_cli("inspect", "--json", back)
    assert r.code == 0 and r.out  # and its args read back as the same model:
    r = run_cli("convert", back, tmp_path / "hf2", "--to", "hf")
    assert r.code == 0, r.err
    assert load_hf(tmp_path / "hf2", dtype=torch.float32).config.activation_function == "gelu_new"


def test_unknown_true_vocab_keeps_every_stored_row(tmp_path, run_cli):
    src = tmp_path / "mg"
    want = H.save_real(H.GPT, 1, src)  # vocab 1003 padded to 1024; its args do not say 1003
    dst = tmp_path / "hf"
    assert run_cli("convert", src, dst, "--to", "hf").code == 0
    model = load_hf(dst, dtype=torch.float32)
    assert model.config.vocab_size == 1024
    assert_close(hf_logits(model, 1003)[..., :1003], want)


@pytest.mark.parametrize("fmt,topo", [("megatron", ["--tp", "2", "--pp", "2"]),
                                      ("megatron-dist", ["--tp", "2"]), ("dcp", ["--dp", "3"]),
                                      ("deepspeed", []),
                                      ("deepspeed", ["--zero", "3", "--dp", "2", "--init-optimizer"])])
def test_hf_round_trip_through_each_format_is_bit_exact(fmt, topo, llama, tmp_path, run_cli):
    root, _ = llama
    mid, back = tmp_path / "mid", tmp_path / "back"
    assert run_cli("convert", root, mid, "--to", fmt, *topo).code == 0
    r = run_cli("convert", mid, back, "--to", "hf")
    assert r.code == 0, r.err
    a, b = weights(root), weights(back)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_sharded_output_loads_in_transformers(gpt2, tmp_path, run_cli):
    root, model = gpt2
    dst = tmp_path / "sharded"
    r = run_cli("convert", root, dst, "--to", "hf", "--max-shard-size", "40KB")
    assert r.code == 0, r.err
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 3 and all(p.stat().st_size <= 40_000 + 4096 for p in dst.glob("*.safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert_close(hf_logits(load_hf(dst, dtype=torch.float32), 250), hf_logits(model, 250))
    # ... and ckptool reads the sharded form back.
    assert run_cli("verify", "--deep", dst).code == 0
    # Without the manifest that commits it (an object store's output killed just before it)
    # it is an uncommitted ckptool output, never a sound foreign model: the weight files say
    # who wrote them.
    (dst / "ckptool.json").unlink()
    r = run_cli("verify", dst)
    assert r.code == 1 and "not committed" in r.err, r.out + r.err
    assert run_cli("latest", tmp_path).code == 1
    assert run_cli("verify", root).code == 0  # transformers' own save: foreign, and sound


def test_dtype_option_writes_bf16(llama, tmp_path, run_cli):
    root, _ = llama
    dst = tmp_path / "bf16"
    assert run_cli("convert", root, dst, "--to", "hf", "--dtype", "bf16").code == 0
    w = weights(dst)
    assert {t.dtype for t in w.values()} == {torch.bfloat16}
    assert torch.equal(w["model.norm.weight"], weights(root)["model.norm.weight"].bfloat16())
    load_hf(dst, dtype=torch.float32)


def test_unknown_family_is_refused_then_named(llama, tmp_path, run_cli):
    root, _ = llama
    custom = tmp_path / "custom"
    custom.mkdir()
    for f in root.iterdir():
        (custom / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((custom / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "my-llama", ["MyLlamaForCausalLM"]
    (custom / "config.json").write_text(json.dumps(cfg))
    r = run_cli("convert", custom, tmp_path / "out", "--to", "megatron")
    assert r.code == 2 and "my-llama" in r.err and "--model-family" in r.err
    assert not (tmp_path / "out").exists()
    r = run_cli("convert", custom, tmp_path / "out", "--to", "megatron", "--model-family", "llama")
    assert r.code == 0, r.err


def test_hf_output_refuses_model_parallel_targets(llama, tmp_path, run_cli):
    root, _ = llama
    r = run_cli("convert", root, tmp_path / "out", "--to", "hf", "--tp", "2")
    assert r.code == 2 and "not model-parallel" in r.err
    r = run_cli("convert", root, tmp_path / "out", "--to", "dcp", "--max-shard-size", "1GB")
    assert r.code == 2 and "--max-shard-size" in r.err


@pytest.mark.parametrize("extra,refused", [
    ({"v_head.summary.weight": (1, 32)}, True),  # a value head saved in the same file
    ({"model.layers.{n}.self_attn.q_proj.weight": (32, 32)}, True),  # a layer beyond num_hidden_layers
    ({"model.layers.0.self_attn.rotary_emb.inv_freq": (4,)}, False),  # a buffer old saves kept
])
def test_stored_tensors_without_a_place_in_the_family_are_refused_not_dropped(extra, refused, llama,
                                                                              tmp_path, run_cli):
    """A tensor the family's table has no place for used to be left out of every output, exit 0
    and not a word (41 tensors in, 39 out). Now conversions refuse it naming it (exit 2, nothing
    written); inspect and verify read the checkpoint and inspect says why it will not convert.
    Buffers every transformers recomputes (RoPE's inv_freq) are no weights: not refused."""
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "src"
    shutil.copytree(llama[0], src)
    state = load_file(src / "model.safetensors")
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    added = {k.format(n=n): torch.randn(shape) for k, shape in extra.items()}
    save_file({**state, **added}, src / "model.safetensors", metadata={"format": "pt"})
    for fmt in ("dcp", "megatron", "hf"):
        dst = tmp_path / fmt
        r = run_cli("convert", src, dst, "--to", fmt)
        if not refused:
            assert r.code == 0, r.err
            continue
        assert r.code == 2 and "have no place in a llama model" in r.err and next(iter(added)) in r.err, r.err
        assert len(r.err.strip().splitlines()) == 1 and not dst.exists()
    assert run_cli("verify", src).code == 0
    report = json.loads(run_cli("inspect", src, "--json").out)
    assert any("no place" in w for w in report["warnings"]) == refused, report["warnings"]


def test_fp16_output_of_values_beyond_its_range_is_refused(llama, tmp_path, run_cli):
    """``--dtype fp16`` of a weight of 1e6 wrote inf (exit 0): not a rounding but other math.
    Refused naming the tensor; bf16 holds it; an Inf the source holds is no overflow."""
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "src"
    shutil.copytree(llama[0], src)
    state = load_file(src / "model.safetensors")
    state["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    dst = tmp_path / "fp16"
    r = run_cli("convert", src, dst, "--to", "hf", "--dtype", "fp16")
    assert r.code == 2 and "beyond float16's range" in r.err and "mlp.down_proj" in r.err, r.err
    assert not dst.exists() and not list(tmp_path.glob("fp16.tmp-*"))
    assert run_cli("convert", src, tmp_path / "bf16", "--to", "hf", "--dtype", "bf16").code == 0
    state["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    assert run_cli("convert", src, tmp_path / "inf", "--to", "hf", "--dtype", "fp16").code == 0


def test_an_fp16_target_filled_from_a_wider_source_refuses_an_overflow():
    """The engine's own cast (a target tensor of another dtype than its source, as a Megatron
    fp16 model from fp32 masters) applies the same rule."""
    from ckptool.core.engine import TargetTensor, fill_tensor
    from ckptool.core.errors import UsageError
    from ckptool.core.index import CheckpointIndex, Location, Piece, TensorInfo
    from ckptool.core.regions import Region, Shard

    source = torch.tensor([1.0, 7e4, -3.0])
    index = CheckpointIndex(format="dcp", url="mem")
    index.tensors["w"] = TensorInfo("w", (3,), torch.float32, [Piece(Region.whole("w", (3,)), Location("f"))])

    def read_box(piece, dtype, box, out):
        out.copy_(source[box[0][0]:box[0][0] + box[1][0]])

    target = TargetTensor("w", Shard.of(Region.whole("w", (3,))), torch.float16)
    with pytest.raises(UsageError, match="beyond float16's range"):
        fill_tensor(target, index, read_box)
    source[1] = 6e4
    assert fill_tensor(target, index, read_box).tolist() == [1.0, 6e4, -3.0]
