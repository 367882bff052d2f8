"""OLMo 2 (``Olmo2ForCausalLM``): Llama's projections with norms after attention and after
the MLP only (no norm before either: ``post_attention_layernorm`` and
``post_feedforward_layernorm``), and q/k norms over the whole projection
(``q_norm`` is ``[heads * head_dim]``) before it is cut into heads. Megatron-Core's QK norm
is per head, so a Megatron output is refused; ``dcp``, ``hf`` and ``deepspeed`` carry it."""

from converters.schemas.families.base import Family, T
from converters.schemas.families.llama import FINAL, LLAMA_CORE, MLP, PROJ, QKV, SILU
from converters.schemas.families.rules import (
    NO_WINDOW,
    ROPE,
    fixed_false,
    llama_sizes,
    tie,
)

FAMILY = Family(
    name="olmo2", architecture="Olmo2ForCausalLM", model_types=("olmo2",),
    fixed=dict(LLAMA_CORE, norm_placement="post", qk_norm_whole=True),
    features=("tied_embeddings", "grouped_query_attention", "rope_scaling"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.",
    layer_tensors=QKV + PROJ + (T("self_attn.q_norm.weight", "q_norm_whole"),
                                T("self_attn.k_norm.weight", "k_norm_whole"))
    + MLP + (T("post_attention_layernorm.weight", "post_attn_norm"),
             T("post_feedforward_layernorm.weight", "post_mlp_norm")),
    final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(head_dim=False), tie(False), ROPE, SILU, *fixed_false("attention_bias"), NO_WINDOW),
    traits="RMSNorm after attention and the MLP only, and q/k norms over the whole projection",
    absent=dict(max_position_embeddings=2048, rms_norm_eps=1e-5),
)
