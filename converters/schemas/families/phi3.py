"""Phi-3 (``Phi3ForCausalLM``): Llama's math with fused projections: ``qkv_proj`` is
``[q_all; k_all; v_all]`` (not grouped per query group, so its rows are regrouped for
Megatron), ``gate_up_proj`` is ``[gate; up]`` (Megatron's ``linear_fc1`` as it is); o_proj
is registered first. A window is on every layer when ``sliding_window`` is set; RoPE
``longrope`` (Phi-3's long-context variants) is refused."""

from converters.schemas.families.base import Family, Feature, T
from converters.schemas.families.llama import FINAL, LLAMA_CORE, NORMS, SILU
from converters.schemas.families.rules import ROPE, llama_sizes, tie, window

LAYER = (T("self_attn.o_proj.weight", "proj"), T("self_attn.qkv_proj.weight", "qkv"),
         T("mlp.gate_up_proj.weight", "fc1"), T("mlp.down_proj.weight", "fc2"), *NORMS)

ORIGINAL_CONTEXT = Feature(("original_max_position_embeddings",), lambda c: {}, lambda s, v, b: {})
"""Read by ``longrope`` scaling only, which :data:`ROPE` refuses: a no-op otherwise."""

FAMILY = Family(
    name="phi3", architecture="Phi3ForCausalLM", model_types=("phi3",),
    fixed=LLAMA_CORE,
    features=("tied_embeddings", "grouped_query_attention", "head_dim", "rope_scaling", "window_size"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.", layer_tensors=LAYER,
    final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(), tie(False), ROPE, SILU, window(layer_types=False), ORIGINAL_CONTEXT),
    traits="RMSNorm, SwiGLU and rotary positions, fused qkv_proj and gate_up_proj",
    absent=dict(max_position_embeddings=4096, rms_norm_eps=1e-5),
)
