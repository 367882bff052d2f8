"""Llama 2 / 3 / 3.1+ (``LlamaForCausalLM``): RMSNorm, SwiGLU, RoPE (with Llama 3.1's
``llama3`` scaling), grouped-query attention, no biases; ``head_dim`` may be explicit."""

from converters.schemas.families.base import Family, Fixed, T
from converters.schemas.families.rules import (
    NO_WINDOW,
    ROPE,
    fixed_false,
    llama_sizes,
    tie,
)

QKV = tuple(T(f"self_attn.{x}_proj.weight", x) for x in "qkv")
PROJ = (T("self_attn.o_proj.weight", "proj"),)
MLP = (T("mlp.gate_proj.weight", "gate"), T("mlp.up_proj.weight", "up"), T("mlp.down_proj.weight", "fc2"))
NORMS = (T("input_layernorm.weight", "attn_norm"), T("post_attention_layernorm.weight", "mlp_norm"))
LAYER = QKV + PROJ + MLP + NORMS
"""A Llama-style decoder layer, in ``named_parameters()`` order (the other families put
these rows, and their own, in their order)."""

FINAL = (T("model.norm.weight", "final_norm"),)
LLAMA_CORE = dict(swiglu=True, normalization="RMSNorm", learned_positions=False, add_bias=False)
SILU = Fixed("hidden_act", ("silu", None))

FAMILY = Family(
    name="llama", architecture="LlamaForCausalLM", model_types=("llama",),
    fixed=LLAMA_CORE,
    features=("tied_embeddings", "grouped_query_attention", "head_dim", "rope_scaling"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.", layer_tensors=LAYER,
    final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(), tie(False), ROPE, SILU, *fixed_false("attention_bias", "mlp_bias"),
            NO_WINDOW),
    traits="RMSNorm, SwiGLU and rotary positions",
    absent=dict(max_position_embeddings=2048),
)
