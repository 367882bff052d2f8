"""Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v bias) and a
MoE MLP in every layer: the router (``mlp.gate``), ``num_experts`` SwiGLU experts
(``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``) and one shared expert
(``mlp.shared_expert.*``) whose output is scaled by sigmoid(``mlp.shared_expert_gate``):
Megatron-Core's ``shared_experts`` with ``moe_shared_expert_gate``. ``norm_topk_prob``
false is Megatron's ``moe_router_pre_softmax`` (softmax over every expert, top-k, not
renormalised); true is Mixtral's router."""

from converters.schemas.families.base import Family, Feature, Fixed, Mapped, T
from converters.schemas.families.llama import FINAL, LLAMA_CORE, NORMS, PROJ, SILU
from converters.schemas.families.qwen2 import LAYER as QWEN2_LAYER
from converters.schemas.families.rules import ROPE, llama_sizes, tie, window

ATTENTION = tuple(t for t in QWEN2_LAYER if t.name.startswith("self_attn.") and t not in PROJ)
MOE = (T("mlp.gate.weight", "router"),
       T("mlp.experts.{e}.gate_proj.weight", "expert_gate"),
       T("mlp.experts.{e}.up_proj.weight", "expert_up"),
       T("mlp.experts.{e}.down_proj.weight", "expert_fc2"),
       T("mlp.shared_expert.gate_proj.weight", "shared_gate", when="moe_shared_expert_size"),
       T("mlp.shared_expert.up_proj.weight", "shared_up", when="moe_shared_expert_size"),
       T("mlp.shared_expert.down_proj.weight", "shared_fc2", when="moe_shared_expert_size"),
       T("mlp.shared_expert_gate.weight", "shared_expert_gate", when="moe_shared_expert_size"))


def _shared(config: dict) -> dict:
    size = config.get("shared_expert_intermediate_size")
    return {"moe_shared_expert_size": int(size) if size else None, "moe_shared_expert_gate": bool(size)}


def qwen_experts() -> tuple:
    """The MoE config rules Qwen2-MoE and Qwen3-MoE share (what each takes for a field left out
    is the family's ``absent``). Every layer MoE; the aux loss is training-only."""
    return (
        Mapped("num_experts_per_tok", "moe_router_topk"),
        Mapped("moe_intermediate_size", "moe_ffn_hidden_size"),
        Feature(("norm_topk_prob",),
                lambda c: {"moe_router_pre_softmax": not c.get("norm_topk_prob", False)},
                lambda s, v, b: {"norm_topk_prob": not s.moe_router_pre_softmax}),
        Feature(("intermediate_size",), lambda c: {"ffn_hidden_size": int(c["intermediate_size"])},
                lambda s, v, b: {"intermediate_size": s.ffn}),  # the dense MLP of mlp_only_layers: none
        Fixed("decoder_sparse_step", (1, None)),
        Fixed("mlp_only_layers", ([], None)),
        Feature(("router_aux_loss_coef", "output_router_logits"), lambda c: {}, lambda s, v, b: {}),
    )


EXPERTS = (
    Mapped("num_experts", "num_experts"),
    *qwen_experts(),
    Feature(("shared_expert_intermediate_size",), _shared,
            lambda s, v, b: {"shared_expert_intermediate_size": s.moe_shared_expert_size or 0}),
    Fixed("qkv_bias", (True, None)),
)

FAMILY = Family(
    name="qwen2_moe", architecture="Qwen2MoeForCausalLM", model_types=("qwen2_moe",),
    fixed=dict(LLAMA_CORE, qkv_bias=True),
    features=("tied_embeddings", "grouped_query_attention", "head_dim", "rope_scaling", "window_size",
              "experts", "shared_experts", "shared_expert_gate", "router_pre_softmax"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.",
    layer_tensors=ATTENTION + PROJ + MOE + NORMS, final=FINAL, head="lm_head.weight",
    config=(*[r for r in llama_sizes() if "intermediate_size" not in r.fields], *EXPERTS,
            tie(False), ROPE, SILU, window(qwen="qwen2_moe")),
    traits="Qwen2's attention, a MoE MLP with a gated shared expert",
    absent=dict(max_position_embeddings=32768, num_key_value_heads=16, sliding_window=4096,
                max_window_layers=28, num_experts_per_tok=4, shared_expert_intermediate_size=5632),
)
