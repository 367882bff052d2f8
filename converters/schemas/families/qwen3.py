"""Qwen3 (``Qwen3ForCausalLM``): Llama's layer with a norm of each query and key head
over ``head_dim`` before RoPE (``q_norm``/``k_norm``, Megatron's ``qk_layernorm``) and an
explicit ``head_dim``; no biases (``attention_bias`` false)."""

from converters.schemas.families.base import Family, T
from converters.schemas.families.llama import (
    FINAL,
    LLAMA_CORE,
    MLP,
    NORMS,
    PROJ,
    QKV,
    SILU,
)
from converters.schemas.families.rules import (
    ROPE,
    fixed_false,
    llama_sizes,
    tie,
    window,
)

LAYER = (*QKV, *PROJ, T("self_attn.q_norm.weight", "q_norm"), T("self_attn.k_norm.weight", "k_norm"),
         *MLP, *NORMS)

FAMILY = Family(
    name="qwen3", architecture="Qwen3ForCausalLM", model_types=("qwen3",),
    fixed=dict(LLAMA_CORE, qk_layernorm=True),
    features=("tied_embeddings", "grouped_query_attention", "head_dim", "rope_scaling", "window_size"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.", layer_tensors=LAYER,
    final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(), tie(False), ROPE, SILU, window(qwen="qwen2"), *fixed_false("attention_bias")),
    traits="RMSNorm, SwiGLU, rotary positions and QK norms",
    absent=dict(max_position_embeddings=32768, num_key_value_heads=32, head_dim=128,
                sliding_window=4096, max_window_layers=28),
)
