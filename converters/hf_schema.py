"""The Hugging Face name and config schemas: which canonical regions each HF tensor holds,
and what an HF ``config.json`` says about the model. Not a format: the ``hf`` reader and
writer (:mod:`converters.hf`) and the DeepSpeed reader and writer (an engine whose module
is an HF model, the HF Trainer's ``config.json`` beside ``latest``) share it.

One table per model family says which regions of the canonical (Megatron-Core) global
tensors each HF tensor holds, in the HF tensor's row order; the reader and the writer
both use it, so a quirk is written once:

* Llama family (``LlamaForCausalLM``; Mistral is the same schema): Megatron's fused QKV is
  grouped per query group ``[q_1..q_{nh/ng}, k, v]``, so ``q_proj`` is ``ng`` row blocks
  of it, ``k_proj`` and ``v_proj`` one block per group; ``gate_proj``/``up_proj`` are the
  halves of ``linear_fc1``. RoPE is the same (non-interleaved) rotation in both.
* GPT-2 (``GPT2LMHeadModel``): ``Conv1D`` weights are stored transposed (``[in, out]``);
  ``c_attn`` is ``[q; k; v]`` over all heads, not per head; the head is tied to ``wte``;
  positions are learned.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import torch

from ckptool.core.errors import UnreadableInput, UsageError
from ckptool.core.index import CheckpointIndex, ObjectInfo
from ckptool.core.layout import FINAL_NORM, OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS, ModelSpec
from ckptool.core.regions import Region
from ckptool.core.view import Entry as HfTensor
from ckptool.core.view import remap

CONFIG = "config.json"
CONFIG_KEY = "hf.config"
FAMILY_KEY = "hf.family"
FAMILIES = ("llama", "gpt2")
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "gpt2": "gpt2"}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}


# --------------------------------------------------------------------------- the tables


def _rows(key: str, shape: tuple[int, ...], blocks: list[tuple[int, int]]) -> tuple:
    """Row blocks ``(start, count)`` of global tensor ``key``, laid one after another."""
    row = math.prod(shape[1:])
    parts, at = [], 0
    for start, count in blocks:
        parts.append((at * row, Region(key, shape, (start, *(0,) * (len(shape) - 1)),
                                       (count, *shape[1:]))))
        at += count
    return tuple(parts)


def _whole(name: str, key: str, shape: tuple[int, ...], transposed: bool = False) -> HfTensor:
    return HfTensor(name, shape, ((0, Region.whole(key, shape)),), transposed)


def _qkv_blocks(spec: ModelSpec, which: str, grouped_output: bool) -> list[tuple[int, int]]:
    """Rows of Megatron's grouped QKV holding q, k or v, in the HF tensor's order."""
    d, ng = spec.head_dim, spec.groups
    per = spec.num_attention_heads // ng
    group_rows = (per + 2) * d
    first, count = {"q": (0, per * d), "k": (per * d, d), "v": ((per + 1) * d, d)}[which]
    return [(g * group_rows + first, count) for g in range(ng)]


def family_of(spec: ModelSpec) -> str:
    """The HF family that can express ``spec``, or a UsageError naming what does not fit."""
    if spec.swiglu and spec.normalization == "RMSNorm" and not spec.learned_positions \
            and not spec.add_bias:
        return "llama"
    if not spec.swiglu and spec.normalization == "LayerNorm" and spec.learned_positions \
            and spec.add_bias and spec.tied_embeddings and spec.groups == spec.num_attention_heads:
        return "gpt2"
    raise UsageError(
        f"no Hugging Face family fits this model (swiglu={spec.swiglu}, normalization="
        f"{spec.normalization}, learned positions={spec.learned_positions}, bias={spec.add_bias}, "
        f"tied={spec.tied_embeddings}, query groups={spec.groups}/{spec.num_attention_heads} heads)",
        hint="Supported: llama (RMSNorm, SwiGLU, RoPE, no bias) and gpt2 (LayerNorm, GELU, "
             "learned positions, bias, tied)")


def hf_tensors(spec: ModelSpec, family: str, vocab: int) -> list[HfTensor]:
    """Every tensor of the HF model, with the canonical regions it holds, in the model's
    ``named_parameters()`` order (the order a DeepSpeed engine flattens them in)."""
    h, rows = spec.hidden_size, spec.global_vocab_rows
    emb_shape = (rows, h)
    out = []
    if family == "llama":
        out.append(HfTensor("model.embed_tokens.weight", (vocab, h),
                            _rows(WORD_EMBEDDINGS, emb_shape, [(0, vocab)])))
        for i in range(spec.num_layers):
            p, m = f"decoder.layers.{i}.", f"model.layers.{i}."
            qkv = (p + "self_attention.linear_qkv.weight",
                   ((spec.num_attention_heads + 2 * spec.groups) * spec.head_dim, h))
            fc1 = (p + "mlp.linear_fc1.weight", (2 * spec.ffn, h))
            out += [
                *[HfTensor(m + f"self_attn.{x}_proj.weight",
                           (sum(n for _, n in _qkv_blocks(spec, x, True)), h),
                           _rows(*qkv, _qkv_blocks(spec, x, True))) for x in "qkv"],
                _whole(m + "self_attn.o_proj.weight", p + "self_attention.linear_proj.weight",
                       (h, spec.num_attention_heads * spec.head_dim)),
                HfTensor(m + "mlp.gate_proj.weight", (spec.ffn, h), _rows(*fc1, [(0, spec.ffn)])),
                HfTensor(m + "mlp.up_proj.weight", (spec.ffn, h), _rows(*fc1, [(spec.ffn, spec.ffn)])),
                _whole(m + "mlp.down_proj.weight", p + "mlp.linear_fc2.weight", (h, spec.ffn)),
                _whole(m + "input_layernorm.weight", p + "self_attention.linear_qkv.layer_norm_weight", (h,)),
                _whole(m + "post_attention_layernorm.weight", p + "mlp.linear_fc1.layer_norm_weight", (h,)),
            ]
        out.append(_whole("model.norm.weight", f"{FINAL_NORM}.weight", (h,)))
        if not spec.tied_embeddings:
            out.append(HfTensor("lm_head.weight", (vocab, h), _rows(OUTPUT_LAYER, emb_shape, [(0, vocab)])))
        return out
    if family == "gpt2":
        out += [HfTensor("transformer.wte.weight", (vocab, h), _rows(WORD_EMBEDDINGS, emb_shape, [(0, vocab)])),
                _whole("transformer.wpe.weight", POSITION_EMBEDDINGS, (spec.max_position_embeddings, h))]
        d, nh = spec.head_dim, spec.num_attention_heads
        # c_attn is [q; k; v] over all heads; Megatron groups per head: [q_g, k_g, v_g].
        qkv_blocks = [(g * 3 * d + j * d, d) for j in range(3) for g in range(nh)]
        for i in range(spec.num_layers):
            p, m = f"decoder.layers.{i}.", f"transformer.h.{i}."
            qkv_w = (p + "self_attention.linear_qkv.weight", (3 * nh * d, h))
            qkv_b = (p + "self_attention.linear_qkv.bias", (3 * nh * d,))
            out += [
                _whole(m + "ln_1.weight", p + "self_attention.linear_qkv.layer_norm_weight", (h,)),
                _whole(m + "ln_1.bias", p + "self_attention.linear_qkv.layer_norm_bias", (h,)),
                HfTensor(m + "attn.c_attn.weight", qkv_w[1], _rows(*qkv_w, qkv_blocks), transposed=True),
                HfTensor(m + "attn.c_attn.bias", qkv_b[1], _rows(*qkv_b, qkv_blocks)),
                _whole(m + "attn.c_proj.weight", p + "self_attention.linear_proj.weight", (h, nh * d), True),
                _whole(m + "attn.c_proj.bias", p + "self_attention.linear_proj.bias", (h,)),
                _whole(m + "ln_2.weight", p + "mlp.linear_fc1.layer_norm_weight", (h,)),
                _whole(m + "ln_2.bias", p + "mlp.linear_fc1.layer_norm_bias", (h,)),
                _whole(m + "mlp.c_fc.weight", p + "mlp.linear_fc1.weight", (spec.ffn, h), True),
                _whole(m + "mlp.c_fc.bias", p + "mlp.linear_fc1.bias", (spec.ffn,)),
                _whole(m + "mlp.c_proj.weight", p + "mlp.linear_fc2.weight", (h, spec.ffn), True),
                _whole(m + "mlp.c_proj.bias", p + "mlp.linear_fc2.bias", (h,)),
            ]
        out += [_whole("transformer.ln_f.weight", f"{FINAL_NORM}.weight", (h,)),
                _whole("transformer.ln_f.bias", f"{FINAL_NORM}.bias", (h,))]
        return out
    raise UsageError(f"unknown model family {family!r}", hint=f"Use one of {', '.join(FAMILIES)}")


def tied_aliases(spec: ModelSpec, family: str) -> dict[str, str]:
    """State-dict names the HF model ties to another parameter (safetensors stores the owner
    only): ``{alias: owner}``."""
    if not spec.tied_embeddings:
        return {}
    return {"lm_head.weight": "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"}


# --------------------------------------------------------------------------- config.json


def spec_from_config(config: dict, family: str) -> ModelSpec:
    """The model an HF ``config.json`` describes."""
    try:
        if family == "llama":
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            kv = int(config.get("num_key_value_heads") or heads)
            return ModelSpec(
                num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
                num_attention_heads=heads, vocab_size=int(config["vocab_size"]),
                num_query_groups=kv if kv != heads else None,
                ffn_hidden_size=int(config["intermediate_size"]),
                kv_channels=int(config.get("head_dim") or hidden // heads), swiglu=True,
                tied_embeddings=bool(config.get("tie_word_embeddings", False)), add_bias=False,
                normalization="RMSNorm", learned_positions=False,
                max_position_embeddings=int(config.get("max_position_embeddings") or 0),
                norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
                rotary_base=float(_rope_theta(config)))
        hidden = int(config["n_embd"])
        act = config.get("activation_function", "gelu_new")
        return ModelSpec(
            num_layers=int(config["n_layer"]), hidden_size=hidden,
            num_attention_heads=int(config["n_head"]), vocab_size=int(config["vocab_size"]),
            ffn_hidden_size=int(config.get("n_inner") or 4 * hidden), swiglu=False,
            tied_embeddings=True, add_bias=True, normalization="LayerNorm", learned_positions=True,
            max_position_embeddings=int(config["n_positions"]),
            norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
            activation="gelu" if act == "gelu" else "gelu_tanh")
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableInput(f"config.json lacks a {family} field ({exc})") from None


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return params.get("rope_theta") or config.get("rope_theta") or 10000.0


def config_for(spec: ModelSpec, family: str, vocab: int, dtype: torch.dtype, base: dict | None) -> dict:
    """The ``config.json`` for ``spec``; fields of a carried source config are kept."""
    config = dict(base or {})
    if family == "llama":
        config.update(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=spec.hidden_size,
            intermediate_size=spec.ffn, num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.groups, num_hidden_layers=spec.num_layers, vocab_size=vocab,
            head_dim=spec.head_dim, rms_norm_eps=spec.norm_epsilon, rope_theta=spec.rotary_base,
            tie_word_embeddings=spec.tied_embeddings, hidden_act="silu", attention_bias=False,
            mlp_bias=False, max_position_embeddings=spec.max_position_embeddings or
            config.get("max_position_embeddings", 4096))
        if "rope_parameters" in config:
            config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": spec.rotary_base}
    else:
        config.update(
            architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=spec.hidden_size,
            n_head=spec.num_attention_heads, n_layer=spec.num_layers, n_inner=spec.ffn,
            n_positions=spec.max_position_embeddings, vocab_size=vocab,
            layer_norm_epsilon=spec.norm_epsilon, tie_word_embeddings=True,
            activation_function=config.get("activation_function", "gelu_new")
            if spec.activation == "gelu_tanh" else "gelu")
    config["torch_dtype" if "dtype" not in config else "dtype"] = str(dtype).replace("torch.", "")
    return config


def family_of_config(config: dict, given: str | None, where: str) -> str:
    """The family a ``config.json`` describes (``given`` wins), or a UsageError naming what
    the config says."""
    family = given or _MODEL_TYPES.get(str(config.get("model_type"))) or \
        next((_ARCHITECTURES[a] for a in config.get("architectures") or () if a in _ARCHITECTURES), None)
    if family is None:
        raise UsageError(
            f"cannot tell the model family: model_type={config.get('model_type')!r}, "
            f"architectures={config.get('architectures')}", path=where,
            hint=f"Pass --model-family ({', '.join(FAMILIES)}) if the schema is one of these")
    return family


def named_view(index: CheckpointIndex, config: dict, family: str | None, where: str,
               prefixes: tuple[str, ...] = ("",)) -> CheckpointIndex:
    """The canonical view of a checkpoint whose tensors carry a Hugging Face model's names
    (a DeepSpeed engine's module is often one), by the same table the hf reader uses.

    Every tensor must find its place: a model tensor the table lacks, or a table entry the
    checkpoint lacks, is a UsageError that lists what was found. A common prefix of the
    stored names (a wrapper's ``module.``) is allowed."""
    family = family_of_config(config, family, where)
    spec = spec_from_config(config, family)
    entries = hf_tensors(spec, family, spec.vocab_size)
    first = entries[0].name
    model = [k for k in index.tensors if not any(p and k.startswith(p) for p in prefixes)]
    prefix = min((k[:-len(first)] for k in model if k.endswith(first)), key=len, default="")
    if prefix:
        entries = [replace(e, name=prefix + e.name) for e in entries]
    view = remap(index, entries, prefixes)
    stray = [k for k in view.unused if k in model]
    if view.missing:
        found = ", ".join(sorted(index.tensors)[:3]) or "nothing"
        raise UsageError(f"the tensors are not a {family} model's ({len(view.missing)} of its "
                         f"tensors are missing, e.g. {view.missing[0]}; found e.g. {found})",
                         path=where, hint="Check --model-config / --model-family")
    if stray:
        raise UsageError(f"{len(stray)} tensors have no place in a {family} model, e.g. "
                         f"{', '.join(stray[:3])}", path=where,
                         hint="Only Hugging Face llama and gpt2 models are mapped")
    out = view.index
    out.model_config, out.true_vocab_size = asdict(spec), spec.vocab_size
    out.objects[CONFIG_KEY] = ObjectInfo(CONFIG_KEY, value=config)
    return out


__all__ = ["CONFIG", "CONFIG_KEY", "FAMILY_KEY", "FAMILIES", "hf_tensors", "family_of",
           "tied_aliases", "spec_from_config", "config_for", "family_of_config", "named_view"]
