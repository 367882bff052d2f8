"""Megatron's model as data: the run-root layout (tracker, iteration directories) and the
name schemas (Megatron-Core Transformer Engine and local specs, pre-mcore legacy /
Megatron-DeepSpeed), each mapping a generation's local tensor names to the canonical keys.
Shared by the Megatron formats, Megatron-DeepSpeed pipeline files and the training hook.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ckptool.core.layout import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    ModelSpec,
    Param,
    global_params,
)
from ckptool.core.storage import Store, pointed_dir

TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")
_LAYER = re.compile(r"^(?P<prefix>.*?layers\.)(?P<i>\d+)\.(?P<rest>.+)$")


def iteration_dir(iteration: int | str) -> str:
    """``iter_0000200`` for 200, ``release`` for a release checkpoint."""
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def tracked_dir(store: Store) -> str | None:
    """The directory the tracker file points at (``iter_0000200`` or ``release``), None when
    there is no tracker; a tracker naming a missing iteration is an error, as in Megatron-LM."""
    return pointed_dir(store, TRACKER, _tracked_name)


def _tracked_name(text: str) -> str | None:
    return iteration_dir(text) if text == "release" or text.isdigit() else None


# ------------------------------------------------------------------------- name schemas


@dataclass(frozen=True)
class Schema:
    """How one generation of Megatron names the canonical tensors, as data tables."""

    name: str
    layer_prefix: str
    layer: dict[str, str] = field(default_factory=dict)
    """Canonical in-layer suffix -> this schema's suffix (identity when absent)."""
    top: dict[str, str] = field(default_factory=dict)
    """Canonical top-level name -> this schema's name (identity when absent)."""
    tied_head: str = OUTPUT_LAYER
    """What the last stage calls its copy of the word embeddings when they are tied."""
    nested: bool = False
    """Pre-mcore state dicts nest modules as dicts."""

    def from_canonical(self, name: str, layers: range, pp_rank: int, pp: int,
                       replica: bool = False) -> str:
        """Local name of a canonical tensor (with its local layer index)."""
        if replica and name == WORD_EMBEDDINGS and pp_rank == pp - 1 and pp_rank > 0:
            return self.tied_head
        m = _LAYER.match(name)
        if m and m.group("prefix") == "decoder.layers.":
            rest = m.group("rest")
            return f"{self.layer_prefix}{m.group('i')}.{self.layer.get(rest, rest)}"
        return self.top.get(name, name)

    def to_canonical(self, local: str, tied: bool) -> tuple[str | None, int | None, bool]:
        """(canonical name with local layer index or None, local layer, is the tied copy)."""
        if local.endswith("_extra_state"):
            return None, None, False
        if tied and local == self.tied_head:
            return WORD_EMBEDDINGS, None, True
        m = _LAYER.match(local)
        if m and m.group("prefix") == self.layer_prefix:
            rest = self._layer_back.get(m.group("rest"), m.group("rest"))
            return f"decoder.layers.{m.group('i')}.{rest}", int(m.group("i")), False
        return self._top_back.get(local, local), None, False

    @property
    def _layer_back(self) -> dict[str, str]:
        return {v: k for k, v in self.layer.items()}

    @property
    def _top_back(self) -> dict[str, str]:
        return {v: k for k, v in self.top.items()}


_NORMS_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}

SCHEMAS = {
    "mcore-te": Schema("mcore-te", "decoder.layers."),
    "mcore-local": Schema("mcore-local", "decoder.layers.", layer=_NORMS_LOCAL),
    "legacy": Schema(
        "legacy", "language_model.encoder.layers.", nested=True,
        tied_head="word_embeddings_for_head.weight",
        layer={
            "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "self_attention.linear_qkv.weight": "self_attention.query_key_value.weight",
            "self_attention.linear_qkv.bias": "self_attention.query_key_value.bias",
            "self_attention.linear_proj.weight": "self_attention.dense.weight",
            "self_attention.linear_proj.bias": "self_attention.dense.bias",
            "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
            "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
            "mlp.linear_fc1.bias": "mlp.dense_h_to_4h.bias",
            "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
            "mlp.linear_fc2.bias": "mlp.dense_4h_to_h.bias",
        },
        top={
            WORD_EMBEDDINGS: "language_model.embedding.word_embeddings.weight",
            POSITION_EMBEDDINGS: "language_model.embedding.position_embeddings.weight",
            f"{FINAL_NORM}.weight": "language_model.encoder.final_layernorm.weight",
            f"{FINAL_NORM}.bias": "language_model.encoder.final_layernorm.bias",
            OUTPUT_LAYER: "language_model.output_layer.weight",
        }),
}


_LOCAL_EXPERTS = "mlp.experts.local_experts"
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

# Module registration order inside one transformer layer, per schema: Megatron numbers
# optimizer state by named_parameters() order, so a writer must emit parameters in it.
_LAYER_ORDER = {
    "mcore-local": ["input_layernorm.weight", "input_layernorm.bias",
                    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
                    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                    # a MoE layer's MLP: the router, the experts (by local index), shared experts
                    "mlp.router.weight", _LOCAL_EXPERTS,
                    "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
                    "mlp.shared_experts.gate_weight",
                    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                    "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"],
    "mcore-te": ["self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                 "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
                 "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                 "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
                 "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
                 "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                 "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"],
    "legacy": ["input_layernorm.weight", "input_layernorm.bias",
               "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
               "self_attention.dense.weight", "self_attention.dense.bias",
               "post_attention_layernorm.weight", "post_attention_layernorm.bias",
               "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
               "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias"],
}


def parameter_order(schema: str, local: str) -> tuple:
    """Sort key of a local parameter name in the model's named_parameters() order."""
    s = SCHEMAS[schema]
    m = _LAYER.match(local)
    if m and m.group("prefix") == s.layer_prefix:
        order = _LAYER_ORDER[schema]
        rest = m.group("rest")
        expert = _LOCAL_EXPERT.match(rest)
        if expert and _LOCAL_EXPERTS in order:  # expert j's linear_fc1, then its linear_fc2
            return (1, int(m.group("i")), order.index(_LOCAL_EXPERTS), (int(expert.group(1)), expert.group(2)))
        return (1, int(m.group("i")), order.index(rest) if rest in order else len(order), rest)
    if "embedding" in local and local != s.tied_head:
        return (0, 0, 0 if "word" in local else 1, local)
    if "final_layernorm" in local:
        return (2, 0, 0 if local.endswith("weight") else 1, local)
    return (3, 0, 0, local)


def detect_schema(names) -> str:
    names = list(names)
    if any(n.startswith("language_model.") or n.startswith("word_embeddings_for_head") for n in names):
        return "legacy"
    if any(".input_layernorm." in n or ".pre_mlp_layernorm." in n for n in names):
        return "mcore-local"
    return "mcore-te"


def to_canonical(schema: str, local: str, layers: range, tied: bool) -> tuple[str | None, bool]:
    """(global canonical key, is a replica) of a local name on a stage holding ``layers``."""
    name, layer, replica = SCHEMAS[schema].to_canonical(local, tied)
    if name is None:
        return None, False
    if layer is not None:
        if layer >= len(layers):
            return f"<layer {layer} beyond this stage's {len(layers)}>", False
        name = name.replace(f"decoder.layers.{layer}.", f"decoder.layers.{layers[layer]}.", 1)
    return name, replica


def params_by_key(spec: ModelSpec) -> dict[str, Param]:
    return {p.key: p for p in global_params(spec)}


