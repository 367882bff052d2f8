"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head QK norms, explicit
``head_dim``, no bias) and a MoE MLP in every layer (``mlp.gate``, ``mlp.experts.{e}.*``,
no shared expert); ``norm_topk_prob`` true is Mixtral's router, false (transformers' default)
is Megatron's ``moe_router_pre_softmax``. Unlike Qwen3, no ``head_dim`` means hidden / heads."""

from converters.schemas.families.base import Family, Feature
from converters.schemas.families.llama import FINAL, LLAMA_CORE, NORMS, SILU
from converters.schemas.families.qwen2_moe import MOE, qwen_experts
from converters.schemas.families.qwen3 import LAYER as QWEN3_LAYER
from converters.schemas.families.rules import (
    ROPE,
    fixed_false,
    llama_sizes,
    tie,
    window,
)

ATTENTION = tuple(t for t in QWEN3_LAYER if t.name.startswith("self_attn."))
EXPERTS = (
    # transformers 5 writes num_local_experts (num_experts is its alias)
    Feature(("num_local_experts", "num_experts"),
            lambda c: {"num_experts": int(c.get("num_local_experts") or c["num_experts"])},
            lambda s, v, b: {"num_experts" if "num_experts" in b else "num_local_experts": s.num_experts}),
    *qwen_experts(),
)

FAMILY = Family(
    name="qwen3_moe", architecture="Qwen3MoeForCausalLM", model_types=("qwen3_moe",),
    fixed=dict(LLAMA_CORE, qk_layernorm=True),
    features=("tied_embeddings", "grouped_query_attention", "head_dim", "rope_scaling", "window_size",
              "experts", "router_pre_softmax"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.",
    layer_tensors=ATTENTION + tuple(t for t in MOE if t.when is None) + NORMS, final=FINAL,
    head="lm_head.weight",
    config=(*[r for r in llama_sizes() if "intermediate_size" not in r.fields], *EXPERTS,
            tie(False), ROPE, SILU, window(qwen="qwen3_moe"), *fixed_false("attention_bias")),
    traits="Qwen3's attention (QK norms) and a MoE MLP",
    absent=dict(max_position_embeddings=32768, num_key_value_heads=4, sliding_window=4096,
                num_experts_per_tok=8, norm_topk_prob=False),
)
