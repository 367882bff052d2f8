"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, GELU, learned positions, biases everywhere, the
head tied to ``wte``. ``Conv1D`` weights are stored transposed (``[in, out]``); ``c_attn``
is ``[q; k; v]`` over all heads (Megatron groups per head)."""

from converters.schemas.families.base import Family, Feature, Fixed, Mapped, Problem, T
from converters.schemas.families.rules import VOCAB

LAYER = (
    T("ln_1.weight", "attn_norm"),
    T("ln_1.bias", "attn_norm_bias"),
    T("attn.c_attn.weight", "qkv", transposed=True),
    T("attn.c_attn.bias", "qkv_bias"),
    T("attn.c_proj.weight", "proj", transposed=True),
    T("attn.c_proj.bias", "proj_bias"),
    T("ln_2.weight", "mlp_norm"),
    T("ln_2.bias", "mlp_norm_bias"),
    T("mlp.c_fc.weight", "fc1", transposed=True),
    T("mlp.c_fc.bias", "fc1_bias"),
    T("mlp.c_proj.weight", "fc2", transposed=True),
    T("mlp.c_proj.bias", "fc2_bias"),
)

_GELUS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
"""What the spec maps: erf GELU, and the tanh approximation (Megatron --openai-gelu)."""


def _activation_problem(config):
    value = config.get("activation_function")
    if value is not None and value not in _GELUS:
        return Problem("activation_function", value, " or ".join(_GELUS))
    return None


ACTIVATION = Feature(
    ("activation_function",),
    lambda c: {"activation": _GELUS.get(c.get("activation_function", "gelu_new"), "gelu_tanh")},
    lambda s, v, b: {"activation_function": b.get("activation_function", "gelu_new")
                     if s.activation == "gelu_tanh" and b.get("activation_function") in _GELUS
                     else "gelu_new" if s.activation == "gelu_tanh" else "gelu"},
    _activation_problem)

FAMILY = Family(
    name="gpt2", architecture="GPT2LMHeadModel", model_types=("gpt2",),
    fixed=dict(swiglu=False, normalization="LayerNorm", learned_positions=True, add_bias=True,
               tied_embeddings=True),
    features=(),
    embedding="transformer.wte.weight", positions="transformer.wpe.weight",
    layer="transformer.h.{i}.", layer_tensors=LAYER,
    final=(T("transformer.ln_f.weight", "final_norm"), T("transformer.ln_f.bias", "final_norm_bias")),
    head="lm_head.weight",
    config=(
        Mapped("n_layer", "num_layers"), Mapped("n_embd", "hidden_size"), Mapped("n_head", "num_attention_heads"),
        VOCAB, Mapped("n_inner", "ffn_hidden_size", default=lambda c: 4 * int(c["n_embd"]),
                      out=lambda s: s.ffn),
        Mapped("n_positions", "max_position_embeddings"),
        Mapped("layer_norm_epsilon", "norm_epsilon", float, default=1e-5),
        ACTIVATION,
        Fixed("tie_word_embeddings", (True, None)),
        Fixed("scale_attn_weights", (True, None), schema=False, written=False),
        Fixed("scale_attn_by_inverse_layer_idx", (False, None), schema=False, written=False),
        Fixed("add_cross_attention", (False, None), schema=False, written=False),
    ),
    traits="LayerNorm, GELU and learned positions",
)
