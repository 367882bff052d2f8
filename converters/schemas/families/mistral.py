"""Mistral (``MistralForCausalLM``): Llama's layer, with a sliding window on every layer
(``sliding_window``; null for full attention)."""

from converters.schemas.families.base import Family
from converters.schemas.families.llama import FINAL, LAYER, LLAMA_CORE, SILU
from converters.schemas.families.rules import ROPE, llama_sizes, tie, window

FAMILY = Family(
    name="mistral", architecture="MistralForCausalLM", model_types=("mistral",),
    fixed=LLAMA_CORE,
    features=("tied_embeddings", "grouped_query_attention", "head_dim", "rope_scaling", "window_size"),
    embedding="model.embed_tokens.weight", layer="model.layers.{i}.", layer_tensors=LAYER,
    final=FINAL, head="lm_head.weight",
    config=(*llama_sizes(), tie(False), ROPE, SILU, window()),
    traits="RMSNorm, SwiGLU, rotary positions and a sliding window",
    absent=dict(max_position_embeddings=131072, num_key_value_heads=8, sliding_window=4096),
)
