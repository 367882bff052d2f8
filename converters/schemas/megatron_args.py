"""Megatron ``args`` and the model they describe: ``args`` -> :class:`ModelSpec` and back
(:func:`spec_from_args`, :func:`update_args`), the retargeting of a spec for a new TP
(vocabulary padding, uneven pipelines), and the math-affecting args that an output which
does not keep them must refuse (:data:`MATH_ARGS`). Shared by the Megatron formats and
Megatron-DeepSpeed pipeline files.
"""

from __future__ import annotations

import argparse
import copy
import re
from dataclasses import replace

from ckptool.core.errors import UnreadableInput, UnsupportedFormat, UsageError, bounded
from ckptool.core.index import CheckpointIndex
from ckptool.core.layout import ModelSpec, model_spec, padded_vocab
from ckptool.core.topology import Topology
from converters.schemas.hf import unknown_model

# ------------------------------------------------------------------------------- args


def _get(args, name, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def normalize_args(args: argparse.Namespace) -> argparse.Namespace:
    """Megatron-DeepSpeed's args under Megatron-LM's spellings, which the layout rules read
    (Megatron-LM's own args pass unchanged): ``normalization`` ``layernorm``/``rmsnorm`` ->
    ``LayerNorm``/``RMSNorm``, ``add_position_embedding`` / ``use_rotary_position_embeddings``
    -> ``position_embedding_type``, ``num_key_value_heads`` -> ``num_query_groups``, ``rope_theta``
    -> ``rotary_base``; its ``num_experts`` list of a dense model (``[1]``) -> none, of a
    DeepSpeed-MoE model refused."""
    out = copy.copy(args)
    norm = str(getattr(args, "normalization", "") or "")
    out.normalization = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(norm.lower(), norm or "LayerNorm")
    if not hasattr(args, "position_embedding_type"):
        rotary = getattr(args, "use_rotary_position_embeddings", False)
        learned = getattr(args, "add_position_embedding", True) and not rotary
        out.position_embedding_type = "learned_absolute" if learned else ("rope" if rotary else "none")
    kv = getattr(args, "num_key_value_heads", None)
    if kv and not getattr(args, "group_query_attention", False) and \
            kv != getattr(args, "num_attention_heads", kv):
        out.group_query_attention, out.num_query_groups = True, int(kv)
    if getattr(args, "rotary_base", None) is None and getattr(args, "rope_theta", None) is not None:
        out.rotary_base = args.rope_theta  # --rotary-position-embeddings-theta, which its RoPE applies
    experts = getattr(args, "num_experts", None)
    if isinstance(experts, (list, tuple)):  # --num-experts N [N ...], per layer group; default [1]
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in experts):
            raise UnreadableInput(f"Megatron-DeepSpeed args hold num_experts={str(experts)[:40]}")
        if max(experts, default=1) > 1:
            raise UnsupportedFormat(
                f"Megatron-DeepSpeed MoE (num_experts={str(experts)[:40]}): DeepSpeed's MoE layers (--topk, "
                f"--expert-interval, --mlp-type, capacity factors, deepspeed_moe names) are not laid "
                f"out by ckptool, so converting it would change the model",
                hint="Dense Megatron-DeepSpeed models (num_experts [1]) and Megatron-Core MoE are "
                     "read; nothing was written")
        out.num_experts = None  # [1]: a dense model
    return out


MODELS = ("mcore", "legacy", "megatron-deepspeed")
"""The model code a checkpoint's args ran in, where it matters for the math (:func:`spec_from_args`):
Megatron-Core, Megatron-LM's legacy model, Megatron-DeepSpeed's model."""


def spec_from_args(args: argparse.Namespace, true_vocab_size: int | None = None, *,
                   model: str | None = None) -> tuple[ModelSpec, Topology, bool]:
    """The model and topology Megatron ``args`` describe, and whether the true vocab is known.

    ``model`` (one of :data:`MODELS`; None: not known) is the code that ran them: the same args
    compute differently in Megatron-Core and in the legacy models (the GELU, RoPE's base)."""
    args = normalize_args(args)
    try:
        layers = int(args.num_layers)
        hidden = int(args.hidden_size)
        heads = int(args.num_attention_heads)
        padded = int(args.padded_vocab_size)
    except (AttributeError, TypeError, ValueError) as exc:
        raise UnreadableInput(f"Megatron args lack a model field ({exc})",
                              hint="Pass --model-config with the model's args") from None
    true_vocab = true_vocab_size or _get(args, "ckptool_true_vocab_size") or \
        (_get(args, "vocab_size") if isinstance(_get(args, "vocab_size"), int) else None)
    tp = int(_get(args, "tensor_model_parallel_size", 1))
    pp = int(_get(args, "pipeline_model_parallel_size", 1))
    vpp = _get(args, "virtual_pipeline_model_parallel_size")
    if vpp is None and _get(args, "num_layers_per_virtual_pipeline_stage"):
        vpp = layers // pp // int(args.num_layers_per_virtual_pipeline_stage)
    pos = str(_get(args, "position_embedding_type", "learned_absolute"))
    try:
        spec = ModelSpec(
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            vocab_size=int(true_vocab or padded), vocab_rows=padded,
            num_query_groups=int(args.num_query_groups) if _get(args, "group_query_attention", False)
            and _get(args, "num_query_groups") else None,
            ffn_hidden_size=_get(args, "ffn_hidden_size"), kv_channels=_get(args, "kv_channels"),
            make_vocab_size_divisible_by=int(_get(args, "make_vocab_size_divisible_by", 128)),
            swiglu=bool(_get(args, "swiglu", False)),
            tied_embeddings=not bool(_get(args, "untie_embeddings_and_output_weights", False)),
            add_bias=bool(_get(args, "add_bias_linear", True)),
            normalization=str(_get(args, "normalization", "LayerNorm")),
            learned_positions=pos == "learned_absolute",
            max_position_embeddings=int(_get(args, "max_position_embeddings", 0)),
            first_stage_layers=_get(args, "decoder_first_pipeline_num_layers"),
            last_stage_layers=_get(args, "decoder_last_pipeline_num_layers"),
            norm_epsilon=float(_get(args, "norm_epsilon", _get(args, "layernorm_epsilon", 1e-5))),
            rotary_base=float(_get(args, "rotary_base", 10000)),
            activation=_activation(args, model),
            **_features(args),
        )
    except ValueError as exc:  # ModelSpec's bounds: the args are untrusted
        raise UnreadableInput(f"Megatron args describe no model ckptool lays out ({exc})") from None
    if true_vocab and spec.padded_vocab(tp) != padded:
        raise UnreadableInput(f"args say padded_vocab_size={padded}, but vocab {true_vocab} at TP{tp} "
                              f"pads to {spec.padded_vocab(tp)}",
                              hint="Check --true-vocab-size")
    dp = int(_get(args, "data_parallel_size", 0) or
             max(1, int(_get(args, "world_size", tp * pp)) // (tp * pp)))
    ep = int(_get(args, "expert_model_parallel_size", 1))
    etp = _get(args, "expert_tensor_parallel_size")
    topo = Topology(tp=tp, pp=pp, dp=dp, vpp=int(vpp or 1), ep=ep,
                    etp=None if etp is None or int(etp) == tp else int(etp))
    return spec, topo, bool(true_vocab)


def _activation(args: argparse.Namespace, model: str | None) -> str:
    """The GELU the MLP of a model trained with ``args`` computed: ``gelu_tanh`` or ``gelu``.

    Megatron-LM's fused bias-GELU (``--bias-gelu-fusion``, its default, which validate_args turns
    off in an MLP without biases) is the tanh approximation, in the legacy model and in
    Megatron-Core alike. Megatron-Core reads nothing else (its TransformerConfig has no
    ``openai_gelu`` or ``onnx_safe``: ``core_transformer_config_from_args`` passes only the
    fusion). The legacy models (Megatron-LM's, Megatron-DeepSpeed's) take ``--openai-gelu`` (tanh),
    then ``--onnx-safe`` (exact), then the fusion. With ``--swiglu`` the MLP gates with SiLU.
    Args without ``bias_gelu_fusion`` (not written by Megatron-LM: ckptool's own before it wrote
    the flag) mean no fusion."""
    if _get(args, "swiglu", False):
        return "gelu"
    fused = bool(_get(args, "bias_gelu_fusion", False) and _get(args, "add_bias_linear", True))
    if model != "mcore":
        if _get(args, "openai_gelu", False):
            return "gelu_tanh"
        if _get(args, "onnx_safe", False):
            return "gelu"
    return "gelu_tanh" if fused else "gelu"


def unapplied_by_legacy(spec: ModelSpec) -> tuple[str, object, str, str] | None:
    """What of ``spec`` Megatron-LM's legacy model would not apply (its RotaryEmbedding takes no
    base or scaling, its attention no window): ``(its arg, the arg's value, the feature, what
    that model runs instead)``; None when nothing. The one rule behind reading a legacy
    checkpoint's args (:func:`ignored_by_legacy`) and writing legacy names
    (:func:`refuse_unapplied_by_legacy`)."""
    if not spec.learned_positions and spec.rotary_base != 10000:
        return "rotary_base", spec.rotary_base, "RoPE at base %g" % spec.rotary_base, "RoPE at base 10000"
    if spec.rope_scaling:
        return "use_rope_scaling", True, "RoPE scaling", "RoPE without scaling"
    if spec.window_size is not None:
        return "window_size", (spec.window_size - 1, 0), "a sliding window", "full attention"
    return None


def megatron_deepspeed(args) -> bool:
    """Whether Megatron ``args`` are Megatron-DeepSpeed's (its ``rope_theta``, which its legacy-named
    model applies, where Megatron-LM's legacy model applies no RoPE base at all)."""
    return hasattr(args, "rope_theta")


def ignored_by_legacy(args: argparse.Namespace, spec: ModelSpec | None = None) -> str | None:
    """What Megatron-LM ``args`` of a legacy-model checkpoint set that its code never applied,
    in words (:func:`unapplied_by_legacy` of ``spec``, the args' model); None when nothing. The
    stored args then say one model and the weights were trained as another. Megatron-DeepSpeed's
    args (``rope_theta``, which its model applies) are not Megatron-LM's."""
    if megatron_deepspeed(args):
        return None
    found = unapplied_by_legacy(spec or spec_from_args(args, model="legacy")[0])
    if found is None:
        return None
    name, value, _, ran = found
    return (f"its args set {name}={str(value)[:40]}, which Megatron-LM's legacy model (its tensor "
            f"names) does not apply: it ran {ran}")


def refuse_unapplied_by_legacy(spec: ModelSpec) -> None:
    """Refuse (UsageError, exit 2) legacy tensor names for a model Megatron-LM's legacy model
    would compute differently (:func:`unapplied_by_legacy`)."""
    found = unapplied_by_legacy(spec)
    if found is not None:
        raise UsageError(f"the model has {found[2]}, which Megatron-LM's legacy model (legacy "
                         f"names) does not apply: it would compute differently",
                         hint="Use --megatron-names mcore-local or mcore-te; nothing was written")


def refuse_contradicted(index: CheckpointIndex, fmt: str, source_format: str, names: str | None) -> None:
    """Refuse (UsageError, exit 2) to convert a source whose metadata contradicts what its code
    computed (:attr:`CheckpointIndex.contradicts`, a legacy-model checkpoint's): the output would
    compute what the metadata says. A reshard in its own format and legacy tensor names keeps it
    as it is (the same code runs it)."""
    if index.contradicts is None or (fmt == source_format and names in (None, "legacy")):
        return
    raise UsageError(f"the checkpoint cannot be converted faithfully: {index.contradicts}, so the "
                     f"output would compute another model than the one trained", path=index.url,
                     hint="A reshard that keeps its format and tensor names keeps it as it is; "
                          "nothing was written")


MCORE_ROPE_SCALING = {"rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0,
                      "rope_high_freq_factor": 4.0, "rope_original_max_positions": 8192}
"""Llama 3.1 RoPE scaling as Megatron runs it (``--use-rope-scaling``): Megatron-Core's
RotaryEmbedding fixes the low/high frequency factors and the original context, and
Megatron-LM's model builder passes only ``rope_scaling`` (GPTModel's factor default, 8,
applies whatever ``--rope-scaling-factor`` says). So only these values are written."""


def _window(value) -> int | None:
    """The window (tokens attended, the query's own included) of Megatron's ``window_size``
    ``(left, right)``: ``(W - 1, 0)``; None for full attention or another form."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[1] == 0 and \
            isinstance(value[0], int) and value[0] >= 0:
        return value[0] + 1
    return None


def _get_skip(args) -> int | None:
    """``window_attn_skip_freq``: a window on some layers only (not one window per model)."""
    return _get(args, "window_attn_skip_freq")


def _features(args: argparse.Namespace) -> dict:
    """The ModelSpec features Megatron args set (see :data:`MATH_ARGS` for those refused)."""
    out = {}
    if _get(args, "add_qkv_bias", False) and not _get(args, "add_bias_linear", True):
        out["qkv_bias"] = True
    if _get(args, "qk_layernorm", False):
        out["qk_layernorm"] = True
    window = _window(_get(args, "window_size")) if _get_skip(args) is None else None
    if window is not None:
        out["window_size"] = window
    if _get(args, "use_rope_scaling", False) and _has_rope(args):  # a no-op without RoPE
        out.update(rope_scaling="llama3", **MCORE_ROPE_SCALING)
    experts = _get(args, "num_experts")
    if experts:
        out.update(num_experts=int(experts), moe_ffn_hidden_size=_get(args, "moe_ffn_hidden_size"),
                   moe_shared_expert_size=_get(args, "moe_shared_expert_intermediate_size"),
                   moe_router_topk=int(_get(args, "moe_router_topk", 2)),
                   moe_router_pre_softmax=bool(_get(args, "moe_router_pre_softmax", False)),
                   moe_shared_expert_gate=bool(_get(args, "moe_shared_expert_gate", False)))
    return out


_NOT_IN_MEGATRON = (
    (lambda s: s.norm_placement != "pre", "norms after attention and the MLP ({norm_placement})",
     "pre-norm layers"),
    (lambda s: s.norm_offset, "zero-centred norm weights (x * (1 + w))", "plain norm weights"),
    (lambda s: s.embedding_scale, "embeddings scaled by sqrt(hidden_size)", "unscaled embeddings"),
    (lambda s: s.swiglu and s.activation == "gelu_tanh", "a GELU-gated MLP (GeGLU)",
     "SwiGLU (--swiglu) as its gated MLP"),
    (lambda s: s.qk_norm_whole, "q/k norms over the whole projection",
     "per-head QK norms (--qk-layernorm)"),
    (lambda s: s.attn_softcap is not None, "attention logit soft-capping ({attn_softcap})", "none"),
    (lambda s: s.final_softcap is not None, "final logit soft-capping ({final_softcap})", "none"),
    (lambda s: s.query_scale is not None, "attention scaled by query_pre_attn_scalar ({query_scale})",
     "head_dim ** -0.5 (or --softmax-scale, which ckptool does not map yet)"),
    (lambda s: s.layer_windows is not None, "a per-layer window pattern ({layer_windows})",
     "one window on every layer (--window-size)"),
    (lambda s: s.rope_local_base is not None, "a RoPE theta of its own on sliding layers ({rope_local_base})",
     "one --rotary-base"),
    (lambda s: s.num_experts is not None and s.moe_router_topk == 1 and not s.moe_router_pre_softmax,
     "top-1 routing that weights the chosen expert by 1 (a softmax over one logit)",
     "top-1 with --moe-router-pre-softmax, which weights it by its probability (Megatron-Core "
     "builds no top-1 router without it)"),
)
"""Model features Megatron args cannot express: (is it on, the feature, what Megatron takes)."""


def unexpressed(spec: ModelSpec) -> tuple[str, str] | None:
    """A feature of ``spec`` Megatron args cannot express: ``(feature, what they can)``."""
    for on, feature, can in _NOT_IN_MEGATRON:
        if on(spec):
            return feature.format(**{k: getattr(spec, k) for k in spec.__dataclass_fields__}), can
    if spec.rope_scaling not in (None, "llama3"):
        return f"rope_scaling={spec.rope_scaling}", "llama3 scaling (use_rope_scaling) or none"
    if spec.rope_scaling == "llama3":
        fixed = {k: getattr(spec, k) for k in MCORE_ROPE_SCALING}
        if fixed != MCORE_ROPE_SCALING:
            return ("llama3 RoPE scaling with factor={rope_scaling_factor}, low_freq_factor="
                    "{rope_low_freq_factor}, high_freq_factor={rope_high_freq_factor}, "
                    "original_max_position_embeddings={rope_original_max_positions}".format(**fixed),
                    "factor 8, low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings "
                    "8192 (Megatron-Core's RotaryEmbedding fixes the last three, and Megatron-LM's "
                    "model builder passes no factor)")
    return None


def feature_notes(index: CheckpointIndex) -> list[str]:
    """What a Megatron job resuming from an output with these features must run with."""
    if index.model_config is None:
        return []
    spec, notes = model_spec(index.model_config, index.url), []
    if spec.window_size is not None:
        notes.append(f"sliding window {spec.window_size} written as --window-size {spec.window_size - 1} 0: "
                     "Transformer Engine's attention and the unfused softmax apply it, Megatron-Core's "
                     "fused local softmax kernel (bf16/fp16 with --masked-softmax-fusion) does not; "
                     "with the local spec run --no-masked-softmax-fusion")
    if spec.rope_scaling == "llama3":
        notes.append("Llama 3.1 RoPE scaling written as --use-rope-scaling (Megatron-Core's factors: "
                     "8, 1, 4, original context 8192)")
    if not spec.swiglu and spec.activation in ("gelu", "gelu_tanh"):
        notes.append(_GELU_NOTES[spec.activation, bool(spec.add_bias)])
    return notes


_GELU_NOTES = {
    ("gelu", True): "the MLP's GELU is the exact (erf) form: run Megatron with --no-bias-gelu-fusion "
                    "(its default fused bias-GELU computes the tanh approximation)",
    ("gelu", False): "the MLP's GELU is the exact (erf) form, which Megatron runs without --openai-gelu",
    ("gelu_tanh", True): "the MLP's GELU is the tanh approximation (gelu_new): Megatron runs it with its "
                         "default --bias-gelu-fusion (the fused bias-GELU is the tanh form), the legacy "
                         "model also with --openai-gelu; --no-bias-gelu-fusion would run the exact GELU "
                         "in Megatron-Core",
    ("gelu_tanh", False): "the MLP's GELU is the tanh approximation (gelu_new): only Megatron-LM's legacy "
                          "model runs it (--openai-gelu); Megatron-Core runs the exact GELU here",
}
"""Which GELU a resumed Megatron job runs is set by its launch flags, which Megatron-LM never
reads from a checkpoint's args: Megatron-Core ignores --openai-gelu, and its fused bias-GELU
(--bias-gelu-fusion, on by default where the MLP has biases) is the tanh form."""


def refuse_unexpressed(spec: ModelSpec, target: str, where: str) -> None:
    """Refuse (UsageError, exit 2) a model whose math Megatron args cannot express, naming
    the feature, before anything is written."""
    lost = unexpressed(spec)
    if lost is not None:
        feature, can = lost
        raise UsageError(f"the model has {feature}, which {target} output cannot express, so the "
                         f"converted model would compute differently: Megatron takes only {can}", path=where,
                         hint="Convert to dcp, hf or deepspeed, which keep it; nothing was written")


# Which Megatron args change the math. Megatron-LM stores hundreds of args (data, logging,
# parallelism, fusions, precision...), almost all of them irrelevant to what the weights
# compute, so unlike HF config fields (converters.schemas.hf) an unknown arg is not refused:
# the rule is this explicit list of the math-affecting args with their no-op values, plus
# every arg spec_from_args maps into the ModelSpec (layers, sizes, heads, groups, kv_channels,
# ffn, vocab, swiglu, openai_gelu, bias, normalization, positions, rotary_base, epsilon, tied).

def _off(value, args) -> bool:
    return value in (None, False)


def _moe_only(test):
    """A router setting: a no-op in a model without experts (Megatron-LM stores its defaults)."""
    return lambda value, args: test(value, args) or not _get(args, "num_experts")


def _has_rope(args) -> bool:
    return str(_get(args, "position_embedding_type", "learned_absolute")) == "rope"


def _rope_only(test):
    """A RoPE setting: a no-op when the model has no rotary positions."""
    return lambda value, args: test(value, args) or not _has_rope(args)


MATH_ARGS = {
    # mapped by spec_from_args, for these values only
    "position_embedding_type": ("learned_absolute or rope",
                                lambda v, a: str(v) in ("learned_absolute", "rope")),
    "normalization": ("LayerNorm or RMSNorm", lambda v, a: str(v) in ("LayerNorm", "RMSNorm")),
    # no-op values
    "use_rope_scaling": ("any (llama3 scaling with factor 8)", _rope_only(lambda v, a: True)),
    "rope_scaling_factor": ("8.0 (the factor Megatron-LM's model builder applies)",
                            lambda v, a: not _get(a, "use_rope_scaling", False) or v in (None, 8, 8.0)),
    "rotary_percent": ("1.0", _rope_only(lambda v, a: v in (None, 1))),
    "rotary_interleaved": ("false", _rope_only(_off)),
    "rotary_seq_len_interpolation_factor": ("null", _rope_only(lambda v, a: v in (None, 1))),
    "no_rope_freq": ("null", _rope_only(lambda v, a: v is None)),
    "window_size": ("null or (W - 1, 0) on every layer", lambda v, a: v is None or
                    (isinstance(v, (list, tuple)) and tuple(v) == (-1, -1)) or
                    (_window(v) is not None and _get_skip(a) is None)),
    "window_attn_skip_freq": ("null", lambda v, a: v is None),
    "add_qkv_bias": ("any", lambda v, a: True),
    "qk_layernorm": ("any", lambda v, a: True),
    "qk_l2_norm": ("false", _off),
    "attention_output_gate": ("false", _off),
    "softmax_scale": ("null", lambda v, a: v is None),
    "softmax_type": ("vanilla", lambda v, a: v in (None, "vanilla")),
    "apply_layernorm_1p": ("false", _off),
    "layernorm_zero_centered_gamma": ("false", _off),
    "apply_residual_connection_post_layernorm": ("false", _off),
    "squared_relu": ("false", _off),
    "quick_geglu": ("false", _off),
    "glu_linear_offset": ("0", lambda v, a: v in (None, 0)),
    "activation_func_clamp_value": ("null", lambda v, a: v is None),
    # experts: mapped with Mixtral's router (softmax over the chosen experts' logits, every
    # layer MoE, no token dropping); any other router setting is refused
    "num_moe_experts": ("null", lambda v, a: not v),
    "moe_router_score_function": ("softmax", lambda v, a: v in (None, "softmax")),
    "moe_router_pre_softmax": ("any (Qwen2-MoE's router when true)", lambda v, a: True),
    "moe_router_topk_scaling_factor": ("null", lambda v, a: v in (None, 1, 1.0)),
    "moe_router_enable_expert_bias": ("false", _off),
    "moe_router_num_groups": ("null", lambda v, a: not v),
    "moe_router_group_topk": ("null", lambda v, a: not v),
    "moe_expert_capacity_factor": ("null (no token dropping)", lambda v, a: v is None),
    # the auxiliary losses shape training only; sinkhorn routes otherwise (softmax over every
    # expert's logit, no renormalisation over the chosen ones)
    "moe_router_load_balancing_type": ("aux_loss, seq_aux_loss, global_aux_loss or none", _moe_only(
        lambda v, a: all(t in (None, "aux_loss", "seq_aux_loss", "global_aux_loss", "none")
                         for t in (v if isinstance(v, (list, tuple)) else [v])))),
    "moe_apply_probs_on_input": ("false (the probability scales the expert's output)", _moe_only(_off)),
    "moe_router_force_load_balancing": ("false (routing by the router's logits)", _moe_only(_off)),
    "moe_router_topk_limited_devices": ("null", _moe_only(lambda v, a: not v)),
    "moe_input_jitter_eps": ("null", lambda v, a: v is None),
    "moe_layer_freq": ("1 (every layer MoE)", lambda v, a: v in (None, 1) or (
        isinstance(v, (list, tuple)) and all(x == 1 for x in v))),
    "moe_shared_expert_intermediate_size": ("any (with its sigmoid gate, Qwen2-MoE's)",
                                            lambda v, a: not v or bool(_get(a, "moe_shared_expert_gate", False))),
    "multi_latent_attention": ("false", _off),
    "experimental_attention_variant": ("null", lambda v, a: v is None),
    "linear_attention_freq": ("null", lambda v, a: v is None),
    "heterogeneous_layers_config_path": ("null", lambda v, a: v is None),
    "heterogeneous_layers_config_encoded_json": ("null", lambda v, a: v is None),
    "hybrid_override_pattern": ("null", lambda v, a: v is None),
    "hybrid_layer_pattern": ("null", lambda v, a: v is None),  # the newer Megatron-LM's name
    "is_hybrid_model": ("false", _off),
    "retro_add_retriever": ("false", _off),
}
"""Megatron arg -> (its no-op value, in words; test of a value the output loses nothing by)."""

ARGS_KEPT_BY = ("megatron", "megatron-dist", "deepspeed")
"""Outputs that write the source's ``args`` themselves (:func:`update_args` changes only the
topology and vocab padding): megatron, megatron-dist, and DeepSpeed pipeline (layer) files."""


def uncarried_arg(args: argparse.Namespace) -> tuple[str, object, str] | None:
    """The first math-affecting arg whose value an output without the args would lose:
    ``(name, value, its no-op value)``; None when the ModelSpec says it all."""
    args = normalize_args(args)
    for name, (noop, ok) in MATH_ARGS.items():
        value = getattr(args, name, None)
        if value is not None and not ok(value, args):
            return name, value, noop
    return None


def refuse_per_layer_keys(index: CheckpointIndex) -> None:
    """Refuse (UsageError, exit 2) ``torch_dist`` output for args under which Megatron-Core
    keys every layer apart (``moe_layer_freq`` a list: ``TransformerBlock``'s
    ``non_homogeneous_layers``): ckptool writes layers stacked (``decoder.layers.*``), which
    such a model cannot load."""
    obj = index.objects.get("args")
    freq = _get(obj.value, "moe_layer_freq", None) if obj is not None and \
        isinstance(obj.value, argparse.Namespace) else None
    if isinstance(freq, (list, tuple)):
        raise UsageError(f"Megatron arg moe_layer_freq={bounded(freq, 80)} (a list) makes Megatron-Core "
                         "key each layer apart in torch_dist, which ckptool does not write yet",
                         path=index.url, hint="--to megatron (legacy) keeps it; nothing was written")


def refuse_uncarried_args(index: CheckpointIndex, target: str) -> None:
    """Refuse (UsageError, exit 2) to write ``target`` output, which carries only the
    ModelSpec, from a source whose Megatron ``args`` set a math-affecting arg the spec does
    not express (RoPE scaling, a window, QK norms, MoE...): the output would compute
    differently. Outputs in :data:`ARGS_KEPT_BY` keep every arg and pass."""
    obj = index.objects.get("args")
    if target in ARGS_KEPT_BY or obj is None or not isinstance(obj.value, argparse.Namespace):
        return
    lost = uncarried_arg(obj.value)
    if lost is not None:
        name, value, noop = lost
        raise UsageError(f"Megatron arg {name}={value!r} is not carried to {target} output by "
                         "ckptool yet, so the converted model would compute differently",
                         path=index.url,
                         hint=f"ckptool maps {name} to {target} only as {noop}; --to megatron or "
                              "--to megatron-dist keeps the args as they are; nothing was written")


def retarget_spec(spec: ModelSpec, source_tp: int, target_tp: int, vocab_known: bool,
                  first: int | None = None, last: int | None = None) -> ModelSpec:
    """The same model laid out for ``target_tp``; refuses a vocab padding it cannot know.

    Without the true vocab size the global embedding is the source's padded rows. If the
    true size could be any of several values that pad differently at the target TP, the
    target padding is unknowable and the user must say (--true-vocab-size).
    """
    if not vocab_known:
        div = spec.make_vocab_size_divisible_by
        src_padded = spec.global_vocab_rows
        lowest = src_padded - div * source_tp + 1
        if padded_vocab(lowest, div, target_tp) != padded_vocab(src_padded, div, target_tp):
            raise UsageError(
                f"the true vocabulary size is unknown and the padded size {src_padded} (TP"
                f"{source_tp}) pads differently at TP{target_tp}",
                hint="Pass --true-vocab-size N (the tokenizer's vocabulary size)")
    changes = {}
    if first is not None or last is not None:
        changes = {"first_stage_layers": first, "last_stage_layers": last}

    return replace(spec, **changes) if changes else spec


def update_args(args: argparse.Namespace | None, spec: ModelSpec, topo: Topology,
                true_vocab_size: int | None, index: CheckpointIndex | None = None, *,
                model: str = "mcore") -> argparse.Namespace:
    """Megatron args for the target topology (Megatron asserts they match the job's).

    Args made for a source without them (DeepSpeed, HF) say how many samples it trained on
    (``consumed_train_samples``, from DeepSpeed's ``global_samples``): Megatron's loader
    restarts the data loader there, at 0 without it."""
    samples = index.objects.get("global_samples") if args is None and index is not None else None
    new = copy.deepcopy(args) if args is not None else argparse.Namespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, ffn_hidden_size=spec.ffn,
        group_query_attention=spec.num_query_groups is not None,
        num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by, swiglu=spec.swiglu,
        untie_embeddings_and_output_weights=not spec.tied_embeddings,
        add_bias_linear=spec.add_bias, normalization=spec.normalization,
        position_embedding_type="learned_absolute" if spec.learned_positions else "rope",
        max_position_embeddings=spec.max_position_embeddings, norm_epsilon=spec.norm_epsilon,
        rotary_base=spec.rotary_base, openai_gelu=spec.activation == "gelu_tanh",
        # what the model computes, as Megatron-LM records it: its fused bias-GELU is the tanh form
        bias_gelu_fusion=spec.activation == "gelu_tanh" and spec.add_bias and not spec.swiglu,
        add_qkv_bias=spec.qkv_bias or spec.add_bias, qk_layernorm=spec.qk_layernorm,
        window_size=None if spec.window_size is None else (spec.window_size - 1, 0),
        use_rope_scaling=spec.rope_scaling == "llama3",
        rope_scaling_factor=8.0)
    if samples is not None and isinstance(samples.value, int):
        new.consumed_train_samples = samples.value
    new.tensor_model_parallel_size = topo.tp
    new.pipeline_model_parallel_size = topo.pp
    new.data_parallel_size = topo.dp
    new.world_size = topo.world
    new.padded_vocab_size = spec.padded_vocab(topo.tp)
    new.virtual_pipeline_model_parallel_size = topo.vpp if topo.vpp > 1 else None
    # the virtual pipeline in the spelling the source used (Megatron refuses both at once), set
    # for the target: a source's layers per virtual stage, kept at VPP1, made ckptool read its
    # own output as VPP2 again
    if _get(new, "num_virtual_stages_per_pipeline_rank") is not None:
        new.num_virtual_stages_per_pipeline_rank = topo.vpp if topo.vpp > 1 else None
        new.num_layers_per_virtual_pipeline_stage = None
    else:
        new.num_layers_per_virtual_pipeline_stage = spec.num_layers // topo.pp // topo.vpp \
            if topo.vpp > 1 else None
    if spec.num_experts:
        if args is None:  # Mixtral's router, which the spec means (see MATH_ARGS)
            new.num_experts, new.moe_ffn_hidden_size = spec.num_experts, spec.moe_ffn
            new.moe_router_topk, new.moe_router_score_function = spec.moe_router_topk, "softmax"
            new.moe_router_pre_softmax, new.moe_layer_freq = spec.moe_router_pre_softmax, 1
            new.moe_shared_expert_intermediate_size = spec.moe_shared_expert_size
            new.moe_shared_expert_gate = spec.moe_shared_expert_gate
            new.moe_grouped_gemm, new.moe_expert_capacity_factor = False, None
        new.expert_model_parallel_size = topo.ep
        new.expert_tensor_parallel_size = topo.expert_tp
    new.decoder_first_pipeline_num_layers = spec.first_stage_layers
    new.decoder_last_pipeline_num_layers = spec.last_stage_layers
    if true_vocab_size:
        new.ckptool_true_vocab_size = int(true_vocab_size)
    _set_activation(new, spec, model)
    return new


def refuse_unrunnable_gelu(spec: ModelSpec, model: str) -> None:
    """Refuse (before anything is written) a tanh GELU without biases for Megatron-Core's names:
    its only tanh GELU is the fused bias kernel."""
    if model == "mcore" and not spec.swiglu and spec.activation == "gelu_tanh" and not spec.add_bias:
        raise UsageError("the MLP's GELU is the tanh approximation without biases, which "
                         "Megatron-Core cannot run (its only tanh GELU is the fused bias kernel)",
                         hint="Write legacy tensor names (--megatron-names legacy, Megatron-LM's "
                              "legacy model with --openai-gelu); nothing was written")


def _set_activation(args: argparse.Namespace, spec: ModelSpec, model: str) -> None:
    """Set the GELU flags of ``args`` so that ``model`` (the code the output's tensor names are
    for: ``mcore`` or ``legacy``) computes ``spec.activation``: the same flags compute
    differently in the two (:func:`_activation`), so a source's flags are not copied as they are
    into the other's names. Megatron-Core has the tanh GELU only as its fused bias kernel, so a
    tanh GELU without biases is refused there."""
    if getattr(args, "swiglu", False):
        return
    refuse_unrunnable_gelu(spec, model)
    tanh = spec.activation == "gelu_tanh"
    args.openai_gelu, args.onnx_safe = tanh, False
    args.bias_gelu_fusion = tanh and spec.add_bias
    if _activation(args, model) != spec.activation:  # the rule above and the reader disagree
        raise UsageError(f"Megatron args cannot say the {spec.activation} GELU for {model}")


class UnevenStages:
    """Writer options of both Megatron formats: Megatron's own
    ``--decoder-first/last-pipeline-num-layers`` for the target's pipeline split."""

    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def configure(self, *, first_stage_layers: int | None = None,
                  last_stage_layers: int | None = None, **unknown) -> None:
        super().configure(**unknown)
        self.first_stage_layers, self.last_stage_layers = first_stage_layers, last_stage_layers

    def target_spec(self, index, source: Topology, target: Topology,
                    true_vocab_size: int | None) -> ModelSpec:
        if index.model_config is None:
            raise unknown_model(index)
        return target_spec(index, source, target, true_vocab_size, self.first_stage_layers,
                           self.last_stage_layers)


def target_spec(index, source: Topology, target: Topology, true_vocab_size: int | None,
                first: int | None = None, last: int | None = None) -> ModelSpec:
    """The model of ``index`` laid out for ``target`` (vocab padding checked; ``first`` /
    ``last``: an uneven pipeline split for the target)."""

    spec = model_spec(index.model_config, index.url)
    refuse_unexpressed(spec, "Megatron", index.url)
    known = index.true_vocab_size is not None
    if true_vocab_size:
        if true_vocab_size > spec.global_vocab_rows:
            raise UsageError(f"--true-vocab-size {true_vocab_size} exceeds the checkpoint's "
                             f"{spec.global_vocab_rows} embedding rows")
        spec, known = replace(spec, vocab_size=int(true_vocab_size)), True
    if first is None and last is None and target.pp != source.pp and \
            (spec.first_stage_layers is not None or spec.last_stage_layers is not None):
        # the source's uneven split was for its own PP: the target splits evenly unless told
        spec = replace(spec, first_stage_layers=None, last_stage_layers=None)
    return retarget_spec(spec, source.tp, target.tp, known, first, last)


def source_dtype(index, key: str):
    """The source dtype of ``key``, or of the same parameter in any layer."""
    if key in index.tensors:
        return index.tensors[key].dtype
    pattern = re.sub(r"layers\.\d+\.", "layers.*.", key)
    for other, info in index.tensors.items():
        if re.sub(r"layers\.\d+\.", "layers.*.", other) == pattern:
            return info.dtype
    raise UsageError(f"source has no tensor for {key!r}")


# ------------------------------------------- Megatron-Core distributed (torch_dist and zarr)

