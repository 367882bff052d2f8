"""Gemma (``GemmaForCausalLM``), Gemma 2 and Gemma 3 text (``Gemma2ForCausalLM``,
``Gemma3ForCausalLM``): Llama's tensor names, with the math of their own: norms compute
``x * (1 + w)`` (the weight is zero-centred), the embeddings are scaled by sqrt(hidden),
the MLP is GELU-gated (tanh), the head is tied, ``head_dim`` defaults to 256.

Gemma 2 and 3 add a norm after attention and after the MLP (``post_attention_layernorm``
is the one after attention here, not Llama's pre-MLP norm; ``pre_feedforward_layernorm``
is that), attention scaled by ``query_pre_attn_scalar``, a sliding window on the layers
``layer_types`` names, and final-logit soft-capping; Gemma 2 also soft-caps attention
logits. Gemma 3 adds per-head QK norms and a RoPE theta of its own on sliding layers.

Megatron-Core runs none of these extras as Megatron-LM configures it, so a Megatron output
is refused, naming the feature; ``dcp``, ``hf`` and ``deepspeed`` carry them.
"""

from converters.schemas.families.base import Family, Feature, Fixed, Problem, T
from converters.schemas.families.llama import FINAL, MLP, PROJ, QKV
from converters.schemas.families.rules import (
    NO_WINDOW,
    ROPE,
    WINDOW_PATTERN,
    fixed_false,
    llama_sizes,
    tie,
)

GEMMA_CORE = dict(swiglu=True, activation="gelu_tanh", normalization="RMSNorm", learned_positions=False,
                  add_bias=False, norm_offset=True, embedding_scale=True)
_TANH = ("gelu_pytorch_tanh", "gelu")
"""Gemma's ``hidden_act``: transformers runs "gelu" as the tanh approximation there (GemmaConfig
rewrites it). Gemma 2 and 3 read ``hidden_activation`` instead, where "gelu" is the exact erf
GELU: another model, refused."""
NOT_BIDIRECTIONAL = Fixed("use_bidirectional_attention", (None, False), schema=False, written=False)
FEATURES = ("tied_embeddings", "grouped_query_attention", "head_dim", "gated_gelu")

FAMILY = Family(
    name="gemma", architecture="GemmaForCausalLM", model_types=("gemma",),
    fixed=GEMMA_CORE, features=FEATURES + ("rope_scaling",),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.",
    layer_tensors=QKV + PROJ + MLP + (T("input_layernorm.weight", "attn_norm"),
                                      T("post_attention_layernorm.weight", "mlp_norm")),
    final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(head_dim=256), tie(True), ROPE, Fixed("hidden_act", (*_TANH, None)),
            Fixed("hidden_activation", (None, *_TANH), written=False),
            *fixed_false("attention_bias"), NOT_BIDIRECTIONAL, NO_WINDOW),
    traits="zero-centred RMSNorm, GeGLU, scaled embeddings and rotary positions",
    absent=dict(max_position_embeddings=8192, num_key_value_heads=16),
)


def _float_or_none(name: str, attr: str) -> Feature:
    def read(config):
        value = config.get(name)
        return {attr: None if value is None else float(value)}
    return Feature((name,), read, lambda s, v, b: {name: getattr(s, attr)})


SANDWICH = (T("input_layernorm.weight", "attn_norm"), T("post_attention_layernorm.weight", "post_attn_norm"),
            T("pre_feedforward_layernorm.weight", "mlp_norm"),
            T("post_feedforward_layernorm.weight", "post_mlp_norm"))
SANDWICH_FEATURES = FEATURES + ("window_size", "layer_windows", "final_softcap")
QUERY_SCALE = Feature(("query_pre_attn_scalar",),
                      lambda c: {"query_scale": float(c.get("query_pre_attn_scalar") or 256)},
                      lambda s, v, b: {"query_pre_attn_scalar": int(s.query_scale)
                                       if float(s.query_scale).is_integer() else s.query_scale})

def _layer_types(config: dict, every) -> list[str] | None:
    """The ``layer_types`` Gemma 2/3's transformers class derives when the file has none: a full
    attention layer every ``every``-th, sliding ones between (None: no sane layer count, which
    is then refused as a pattern ckptool cannot read)."""
    n = config.get("num_hidden_layers")
    if type(n) is not int or not 0 < n <= 1 << 12 or type(every) is not int or every < 1:
        return None
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]


GEMMA2 = Family(
    name="gemma2", architecture="Gemma2ForCausalLM", model_types=("gemma2",),
    fixed=dict(GEMMA_CORE, norm_placement="sandwich"),
    features=SANDWICH_FEATURES + ("attn_softcap", "query_scale", "rope_scaling"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.",
    layer_tensors=QKV + PROJ + MLP + SANDWICH, final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(head_dim=256), tie(True), ROPE,
            Fixed("hidden_activation", (_TANH[0], None)), Fixed("hidden_act", (None, *_TANH), written=False),
            *fixed_false("attention_bias"), NOT_BIDIRECTIONAL, WINDOW_PATTERN, QUERY_SCALE,
            _float_or_none("attn_logit_softcapping", "attn_softcap"),
            _float_or_none("final_logit_softcapping", "final_softcap")),
    traits="Gemma's, with norms after attention and the MLP, soft-capping and a window pattern",
    absent=dict(max_position_embeddings=8192, num_key_value_heads=4, sliding_window=4096,
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                layer_types=lambda c: _layer_types(c, 2)),
)

# --------------------------------------------------------------------------- Gemma 3


def _rope3(config: dict) -> tuple[dict, dict]:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return params.get("full_attention") or {}, params.get("sliding_attention") or {}
    return ({"rope_theta": config.get("rope_theta", 1e6), **(config.get("rope_scaling") or {})},
            {"rope_theta": config.get("rope_local_base_freq", 1e4)})


def _read_rope3(config: dict) -> dict:
    full, sliding = _rope3(config)
    return {"rotary_base": float(full.get("rope_theta") or 1e6),
            "rope_local_base": float(sliding.get("rope_theta") or 1e4)}


def _rope3_problem(config: dict) -> Problem | None:
    for params in _rope3(config):
        if params.get("rope_type", params.get("type")) not in (None, "default") or \
                set(params) - {"rope_type", "type", "rope_theta"}:
            field = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
            return Problem(field, config.get(field), "the default type with a rope_theta per layer type")
    return None


def _write_rope3(spec, vocab, base) -> dict:
    return {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": spec.rotary_base},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": spec.rope_local_base}},
            "rope_theta": spec.rotary_base, "rope_local_base_freq": spec.rope_local_base}


ROPE3 = Feature(("rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq"),
                _read_rope3, _write_rope3, _rope3_problem)
"""Gemma 3: one RoPE theta for full-attention layers, another for sliding ones."""
IGNORED_SOFTCAP = Feature(("attn_logit_softcapping",), lambda c: {}, lambda s, v, b: {})
"""Gemma 3 stores it, and transformers 5.24 does not apply it (checked): no math."""

GEMMA3 = Family(
    name="gemma3", architecture="Gemma3ForCausalLM", model_types=("gemma3_text",),
    fixed=dict(GEMMA_CORE, norm_placement="sandwich", qk_layernorm=True),
    features=SANDWICH_FEATURES + ("query_scale", "rope_local_base"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.",
    layer_tensors=QKV + PROJ + (T("self_attn.q_norm.weight", "q_norm"), T("self_attn.k_norm.weight", "k_norm"))
    + MLP + SANDWICH, final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(head_dim=256), tie(True), ROPE3,
            Fixed("hidden_activation", (_TANH[0], None)), Fixed("hidden_act", (None, *_TANH), written=False),
            *fixed_false("attention_bias"), NOT_BIDIRECTIONAL, WINDOW_PATTERN, QUERY_SCALE,
            IGNORED_SOFTCAP, _float_or_none("final_logit_softcapping", "final_softcap")),
    traits="Gemma 2's, with per-head QK norms and a RoPE theta per layer type",
    absent=dict(max_position_embeddings=131072, num_key_value_heads=4, sliding_window=4096,
                layer_types=lambda c: _layer_types(c, c.get("sliding_window_pattern", 6))),
)
