"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a Mixture-of-Experts MLP in
every layer: a router (``block_sparse_moe.gate``, Megatron-Core's ``mlp.router``) and
``num_local_experts`` SwiGLU experts (``experts.{e}.w1`` gate, ``w3`` up, ``w2`` down: the
slices of Megatron-Core's stacked ``mlp.experts.experts.linear_fc1``/``fc2``), each token
sent to ``num_experts_per_tok`` of them (softmax, top-k, renormalise: Megatron's softmax
router without pre-softmax). Names are the Hub's, as ``save_pretrained`` writes them."""

from converters.schemas.families.base import Family, Feature, Fixed, Mapped, T
from converters.schemas.families.llama import FINAL, LLAMA_CORE, NORMS, PROJ, QKV, SILU
from converters.schemas.families.rules import ROPE, llama_sizes, tie, window

MOE = (T("block_sparse_moe.gate.weight", "router"),
       T("block_sparse_moe.experts.{e}.w1.weight", "expert_gate"),
       T("block_sparse_moe.experts.{e}.w2.weight", "expert_fc2"),
       T("block_sparse_moe.experts.{e}.w3.weight", "expert_up"))

EXPERTS = (
    Mapped("num_local_experts", "num_experts"),
    Mapped("num_experts_per_tok", "moe_router_topk", default=2),
    Feature(("intermediate_size",), lambda c: {"moe_ffn_hidden_size": int(c["intermediate_size"]),
                                               "ffn_hidden_size": int(c["intermediate_size"])},
            lambda s, v, b: {"intermediate_size": s.moe_ffn}),
    Fixed("router_jitter_noise", (0, 0.0, None), schema=False, written=False),
    Feature(("router_aux_loss_coef", "output_router_logits"), lambda c: {}, lambda s, v, b: {}),
)
"""The experts; the aux loss (its coefficient, the router logits output) is training-only."""

FAMILY = Family(
    name="mixtral", architecture="MixtralForCausalLM", model_types=("mixtral",),
    fixed=LLAMA_CORE,
    features=("tied_embeddings", "grouped_query_attention", "head_dim", "rope_scaling", "window_size",
              "experts"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.",
    layer_tensors=QKV + PROJ + MOE + NORMS, final=FINAL, head="lm_head.weight",
    config=(*[r for r in llama_sizes() if "intermediate_size" not in r.fields], *EXPERTS,
            tie(False), ROPE, SILU, window(layer_types=False)),
    traits="Mistral's, with a Mixture-of-Experts MLP",
    absent=dict(max_position_embeddings=131072, num_key_value_heads=8, rms_norm_eps=1e-5,
                rope_theta=1e6),
)
