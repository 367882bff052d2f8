"""The Hugging Face name and config schemas: which canonical regions each HF tensor holds,
and what an HF ``config.json`` says about the model. Not a format: the ``hf`` reader and
writer (:mod:`converters.hf.format`) and the DeepSpeed reader and writer (an engine whose module
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
from dataclasses import asdict, dataclass, replace

import torch

from ckptool.core.errors import UnreadableInput, UsageError
from ckptool.core.index import CheckpointIndex
from ckptool.core.layout import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    ModelSpec,
)
from ckptool.core.regions import Region
from ckptool.core.view import Entry as HfTensor
from ckptool.core.view import remap

CONFIG = "config.json"


@dataclass(frozen=True)
class HfModel:
    """The layout record of a source whose tensors are a Hugging Face model's (the hf
    reader's index, or a DeepSpeed module's canonical view): its ``config.json`` and family."""

    config: dict
    family: str

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


_TRAITS = {"llama": "RMSNorm, SwiGLU and rotary positions",
           "gpt2": "LayerNorm, GELU and learned positions"}


def family_of(spec: ModelSpec, named: str | None = None) -> str:
    """The HF family that can express ``spec``, or a UsageError naming what does not fit.

    ``named`` (``--model-family`` for an hf output) must be that family: the schema of the
    output is the model's, so a name that contradicts it is refused with the model's traits
    rather than written as a model that would not load (or would compute something else)."""
    fits = _family_fit(spec)
    if named is not None and named != fits:
        raise UsageError(f"--model-family {named} does not fit the model: it has {_TRAITS[fits]}; "
                         f"it is {fits}, not {named}",
                         hint=f"Pass --model-family {fits}, or leave it out")
    return fits


def _family_fit(spec: ModelSpec) -> str:
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


# --------------------------------------------------------------------------- config fidelity
#
# One rule for every HF config field, whatever the path (hf, deepspeed with HF names, an HF
# --model-config): the field is carried to the output, or it does not change what the weights
# compute, or the conversion is refused before anything is written. What each field is:
#
# * mapped: read into the ModelSpec, which every output carries (Megatron args, manifest...);
#   only the values the spec can express are accepted;
# * schema: the family's tensor table and config_for assume one value (no bias tensors, SiLU):
#   any other value is refused whatever the output, since even config.json would be rewritten;
# * default: changes the math unless it has its no-op value; an output that keeps config.json
#   fields as they are (KEEPS_CONFIG) carries any value;
# * neutral (_NEUTRAL): token ids, caching, dtype, dropout... never change what the model computes;
# * anything else is unknown: carried only by an output that keeps config.json as it is.

KEEPS_CONFIG = {"deepspeed": "whole", "hf": "unset"}
"""Outputs that keep the source's config.json fields. ``deepspeed`` writes the file itself
beside ``latest``; ``hf`` keeps every field :func:`config_for` does not set, when the source's
``model_type`` is the one it writes (a Mistral source becomes a llama config, in which a
Mistral-only field means nothing). Every other output carries the ModelSpec alone."""

_WRITTEN_TYPE = {"llama": "llama", "gpt2": "gpt2"}
"""The model_type config_for writes for each family."""

_NEUTRAL = frozenset({
    "architectures", "model_type", "_name_or_path", "transformers_version", "torch_dtype",
    "dtype", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "initializer_factor", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "tokenizer_class", "task_specific_params", "prefix", "_attn_implementation",
    "attn_implementation", "chunk_size_feed_forward", "max_length", "min_length", "do_sample",
    "temperature", "top_k", "top_p", "num_beams", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "early_stopping", "num_return_sequences",
    # GPT-2: the sequence-summary head of GPT2DoubleHeadsModel (not a causal LM's); n_ctx is
    # unused by transformers; reorder_and_upcast_attn computes the same softmax in fp32
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "n_ctx", "reorder_and_upcast_attn",
    # Llama: pretraining_tp > 1 slices the same matmuls and sums them (the same math)
    "pretraining_tp",
})
"""Fields that never change what the weights compute (dropout probabilities too, by name)."""


def _any(value, config) -> bool:
    return True


def _off(value, config) -> bool:
    return value in (None, False)


def _plain_rope(value, config) -> bool:
    """No RoPE scaling: null, or the default type with at most theta (and a full rotary dim)."""
    if value is None:
        return True
    if not isinstance(value, dict) or value.get("rope_type", value.get("type")) not in (None, "default"):
        return False
    return all(k in ("rope_type", "type", "rope_theta") or
               (k == "partial_rotary_factor" and value[k] in (None, 1)) for k in value)


def _no_window(value, config) -> bool:
    return value is None or config.get("use_sliding_window") is False


def _full_attention(value, config) -> bool:
    return value is None or (isinstance(value, list) and all(t == "full_attention" for t in value))


_MAPPED_LLAMA = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "vocab_size", "intermediate_size", "head_dim", "tie_word_embeddings",
                 "max_position_embeddings", "rms_norm_eps", "rope_theta")
_MAPPED_GPT2 = ("n_layer", "n_embd", "n_head", "vocab_size", "n_inner", "n_positions",
                "layer_norm_epsilon")
_GPT2_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
"""What spec_from_config maps: erf GELU, and the tanh approximation (Megatron --openai-gelu)."""

_FIELDS = {
    "llama": {
        **{name: ("mapped", _any, None) for name in _MAPPED_LLAMA},
        "hidden_act": ("schema", lambda v, c: v in (None, "silu"), "silu"),
        "attention_bias": ("schema", _off, "false"),
        "mlp_bias": ("schema", _off, "false"),
        "rope_parameters": ("default", _plain_rope, "the default type with rope_theta"),
        "rope_scaling": ("default", _plain_rope, "null"),
        "partial_rotary_factor": ("default", lambda v, c: v in (None, 1), "1.0"),
        "sliding_window": ("default", _no_window, "null (or with use_sliding_window false)"),
        "use_sliding_window": ("default", _off, "false"),
        "max_window_layers": ("default", lambda v, c: not c.get("use_sliding_window"),
                              "unused (use_sliding_window false)"),
        "layer_types": ("default", _full_attention, "all 'full_attention'"),
    },
    "gpt2": {
        **{name: ("mapped", _any, None) for name in _MAPPED_GPT2},
        "tie_word_embeddings": ("schema", lambda v, c: v in (None, True), "true"),
        "activation_function": ("default", lambda v, c: v in _GPT2_ACTIVATIONS,
                                " or ".join(_GPT2_ACTIVATIONS)),
        "scale_attn_weights": ("default", lambda v, c: v in (None, True), "true"),
        "scale_attn_by_inverse_layer_idx": ("default", _off, "false"),
        "add_cross_attention": ("default", _off, "false"),
    },
}


def uncarried_field(config: dict, family: str, target: str) -> tuple[str, object, str] | None:
    """The first field of ``config`` (a ``family`` model's) that ``target`` output would lose
    although it changes what the model computes: ``(name, value, hint)``; None when nothing
    is lost."""
    keeps = _keeps(config, family, target)
    for name, value in config.items():
        if name in _NEUTRAL or name.endswith(("dropout", "_pdrop")):
            continue
        kind, ok, noop = _FIELDS.get(family, {}).get(name, ("unknown", None, None))
        if kind != "unknown" and ok(value, config):
            continue
        if kind in ("default", "unknown") and keeps:
            continue
        if kind == "schema":
            return name, value, (f"ckptool's {family} schema holds {name} only as {noop}, so no "
                                 "output can hold this model yet")
        keepers = [t for t in KEEPS_CONFIG if _keeps(config, family, t)]
        hint = f"ckptool maps {name} to {target} only as {noop}" if noop else \
            f"ckptool does not map it to {target}"
        if keepers:
            hint += f"; --to {' or --to '.join(sorted(keepers))} keeps it as it is"
        return name, value, hint
    return None


def _keeps(config: dict, family: str, target: str) -> bool:
    how = KEEPS_CONFIG.get(target)
    return how == "whole" or (how == "unset" and
                              config.get("model_type", _WRITTEN_TYPE[family]) == _WRITTEN_TYPE[family])


def refuse_uncarried_config(index: CheckpointIndex, target: str) -> None:
    """Refuse (UsageError, exit 2) to write ``target`` output from a source whose HF config
    (the ``hf.config`` object an hf reader or a DeepSpeed HF-model view puts in the index) has
    a field the output would lose although it changes the math; see the rule above."""
    model = index.layout(HfModel)
    if model is None or not isinstance(model.config, dict):
        return
    lost = uncarried_field(model.config, model.family, target)
    if lost is not None:
        name, value, hint = lost
        raise UsageError(f"config.json field {name}={_short(value)} is not carried to {target} "
                         "output by ckptool yet, so the converted model would compute differently",
                         path=index.url, hint=f"{hint}; nothing was written")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


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
    out.set_layout(HfModel(config, family))
    return out


__all__ = ["CONFIG", "HfModel", "FAMILIES", "KEEPS_CONFIG", "hf_tensors", "family_of",
           "tied_aliases", "spec_from_config", "config_for", "family_of_config", "named_view",
           "uncarried_field", "refuse_uncarried_config"]
