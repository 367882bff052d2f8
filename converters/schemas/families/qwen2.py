"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's layer with a bias on q, k and v (not on
o_proj or the MLP); tied embeddings in the small sizes; a window only through
``use_sliding_window`` (on every layer: ``max_window_layers`` 0)."""

from converters.schemas.families.base import Family, T
from converters.schemas.families.llama import FINAL, LLAMA_CORE, MLP, NORMS, PROJ, SILU
from converters.schemas.families.rules import ROPE, llama_sizes, tie, window

LAYER = (*(row for x in "qkv" for row in (T(f"self_attn.{x}_proj.weight", x),
                                         T(f"self_attn.{x}_proj.bias", f"{x}_bias"))),
         *PROJ, *MLP, *NORMS)

FAMILY = Family(
    name="qwen2", architecture="Qwen2ForCausalLM", model_types=("qwen2",),
    fixed=dict(LLAMA_CORE, qkv_bias=True),
    features=("tied_embeddings", "grouped_query_attention", "head_dim", "rope_scaling", "window_size"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.", layer_tensors=LAYER,
    final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(), tie(False), ROPE, SILU, window(qwen="qwen2")),
    traits="RMSNorm, SwiGLU, rotary positions and a QKV bias",
    absent=dict(max_position_embeddings=32768, num_key_value_heads=32, sliding_window=4096,
                max_window_layers=28),
)
