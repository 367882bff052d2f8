"""What a model family is, as data: a :class:`Family` is a table of its Hugging Face
tensors (each a canonical *part* of Megatron-Core's global tensors) and a list of config
rules (each ``config.json`` field it knows, read into and written from the
:class:`~ckptool.core.layout.ModelSpec`). The machinery here reads the tables; the
families (one module each) only fill them in.

Parts are written once (:data:`PARTS`): ``q``/``k``/``v`` are row blocks of Megatron's
grouped QKV ``[q_1..q_{nh/ng}, k, v]`` per query group, ``qkv`` the concatenated
``[q_all; k_all; v_all]`` of a fused projection (Phi-3, GPT-2's ``c_attn``), ``gate``/``up``
the halves of ``linear_fc1`` and ``fc1`` the whole of it (a fused ``gate_up_proj`` is
``[gate; up]`` already), ``*_norm`` the norms. A tensor can depend on a model feature
(``when="qkv_bias"``), and be stored transposed (GPT-2's ``Conv1D``).

Config rules say, for each field, what it means. A rule reads its fields into spec values,
writes them back, and names a value the spec cannot express (:class:`Problem`): a ``schema``
problem means the table itself would be wrong (bias tensors it lacks), so no output can
hold the model; otherwise only outputs that keep ``config.json`` as it is carry it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptool.core.layout import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    ModelSpec,
)
from ckptool.core.regions import Region
from ckptool.core.view import Entry as HfTensor

# --------------------------------------------------------------------------- parts


def rows(key: str, shape: tuple[int, ...], blocks: list[tuple[int, int]]) -> tuple:
    """Row blocks ``(start, count)`` of global tensor ``key``, laid one after another."""
    row = math.prod(shape[1:])
    parts, at = [], 0
    for start, count in blocks:
        parts.append((at * row, Region(key, shape, (start, *(0,) * (len(shape) - 1)),
                                       (count, *shape[1:]))))
        at += count
    return tuple(parts)


def qkv_blocks(spec: ModelSpec, which: str) -> list[tuple[int, int]]:
    """Rows of Megatron's grouped QKV holding q, k or v, in the HF tensor's (head) order."""
    d, ng = spec.head_dim, spec.groups
    per = spec.num_attention_heads // ng
    group_rows = (per + 2) * d
    first, count = {"q": (0, per * d), "k": (per * d, d), "v": ((per + 1) * d, d)}[which]
    return [(g * group_rows + first, count) for g in range(ng)]


def _qkv_rows(spec: ModelSpec) -> int:
    return (spec.num_attention_heads + 2 * spec.groups) * spec.head_dim


def _fc1_rows(spec: ModelSpec) -> int:
    return 2 * spec.ffn if spec.swiglu else spec.ffn


Part = Callable[[ModelSpec, str], tuple[tuple[int, ...], tuple]]
"""(spec, the canonical layer prefix ``decoder.layers.{i}.``) -> (the HF tensor's shape,
its parts: ``(offset, Region)`` of the canonical tensors, in the HF tensor's row order)."""


def _whole(suffix: str, shape: Callable[[ModelSpec], tuple[int, ...]]) -> Part:
    def part(spec, p):
        s = shape(spec)
        return s, ((0, Region.whole(p + suffix, s)),)
    return part


def _blocks(suffix: str, shape: Callable[[ModelSpec], tuple[int, ...]],
            blocks: Callable[[ModelSpec], list[tuple[int, int]]]) -> Part:
    def part(spec, p):
        s, b = shape(spec), blocks(spec)
        return (sum(n for _, n in b), *s[1:]), rows(p + suffix, s, b)
    return part


def _qkv(which: str, bias: bool) -> Part:
    suffix = "self_attention.linear_qkv." + ("bias" if bias else "weight")
    shape = (lambda s: (_qkv_rows(s),)) if bias else (lambda s: (_qkv_rows(s), s.hidden_size))
    if which == "qkv":
        return _blocks(suffix, shape, lambda s: [b for x in "qkv" for b in qkv_blocks(s, x)])
    return _blocks(suffix, shape, lambda s: qkv_blocks(s, which))


def _fc1_half(which: str) -> Part:
    return _blocks("mlp.linear_fc1.weight", lambda s: (2 * s.ffn, s.hidden_size),
                   lambda s: [(0 if which == "gate" else s.ffn, s.ffn)])


_H = lambda s: (s.hidden_size,)  # noqa: E731
_D = lambda s: (s.head_dim,)  # noqa: E731

PARTS: dict[str, Part] = {
    **{x: _qkv(x, False) for x in ("q", "k", "v", "qkv")},
    **{x + "_bias": _qkv(x, True) for x in ("q", "k", "v", "qkv")},
    "proj": _whole("self_attention.linear_proj.weight",
                   lambda s: (s.hidden_size, s.num_attention_heads * s.head_dim)),
    "proj_bias": _whole("self_attention.linear_proj.bias", _H),
    "gate": _fc1_half("gate"),
    "up": _fc1_half("up"),
    "fc1": _whole("mlp.linear_fc1.weight", lambda s: (_fc1_rows(s), s.hidden_size)),
    "fc1_bias": _whole("mlp.linear_fc1.bias", lambda s: (_fc1_rows(s),)),
    "fc2": _whole("mlp.linear_fc2.weight", lambda s: (s.hidden_size, s.ffn)),
    "fc2_bias": _whole("mlp.linear_fc2.bias", _H),
    "attn_norm": _whole("self_attention.linear_qkv.layer_norm_weight", _H),
    "attn_norm_bias": _whole("self_attention.linear_qkv.layer_norm_bias", _H),
    "mlp_norm": _whole("mlp.linear_fc1.layer_norm_weight", _H),
    "mlp_norm_bias": _whole("mlp.linear_fc1.layer_norm_bias", _H),
    "q_norm": _whole("self_attention.q_layernorm.weight", _D),
    "k_norm": _whole("self_attention.k_layernorm.weight", _D),
    "q_norm_whole": _whole("self_attention.q_proj_layernorm.weight",
                           lambda s: (s.num_attention_heads * s.head_dim,)),
    "k_norm_whole": _whole("self_attention.k_proj_layernorm.weight", lambda s: (s.groups * s.head_dim,)),
    "post_attn_norm": _whole("post_self_attn_layernorm.weight", _H),
    "post_mlp_norm": _whole("post_mlp_layernorm.weight", _H),
}
"""Every canonical part of a transformer layer an HF tensor can be."""
PARTS["router"] = _whole("mlp.router.weight", lambda s: (s.num_experts, s.hidden_size))
PARTS["shared_gate"] = _blocks("mlp.shared_experts.linear_fc1.weight",
                               lambda s: (2 * s.moe_shared_expert_size, s.hidden_size),
                               lambda s: [(0, s.moe_shared_expert_size)])
PARTS["shared_up"] = _blocks("mlp.shared_experts.linear_fc1.weight",
                             lambda s: (2 * s.moe_shared_expert_size, s.hidden_size),
                             lambda s: [(s.moe_shared_expert_size, s.moe_shared_expert_size)])
PARTS["shared_fc2"] = _whole("mlp.shared_experts.linear_fc2.weight",
                             lambda s: (s.hidden_size, s.moe_shared_expert_size))
PARTS["shared_expert_gate"] = _whole("mlp.shared_experts.gate_weight", lambda s: (1, s.hidden_size))


def _expert(which: str):
    """Expert ``e``'s slice of a stacked expert tensor: fc1's gate or up half, or fc2."""
    def part(spec, p, e):
        f, h, n = spec.moe_ffn, spec.hidden_size, spec.num_experts
        if which == "fc2":
            shape = (n, h, f)
            return (h, f), ((0, Region(p + "mlp.experts.experts.linear_fc2.weight", shape, (e, 0, 0), (1, h, f))),)
        shape = (n, 2 * f, h)
        start = 0 if which == "gate" else f
        return (f, h), ((0, Region(p + "mlp.experts.experts.linear_fc1.weight", shape, (e, start, 0), (1, f, h))),)
    return part


EXPERT_PARTS = {"expert_gate": _expert("gate"), "expert_up": _expert("up"), "expert_fc2": _expert("fc2")}
"""Parts of one expert (``{e}`` in the HF name): Mixtral's w1, w3 and w2."""


@dataclass(frozen=True)
class T:
    """One HF tensor: its name (``{i}`` is the layer index) and the part it is."""

    name: str
    part: str
    when: str | None = None
    """A ModelSpec feature that must be on for the model to have this tensor."""
    transposed: bool = False
    """Stored ``[in, out]`` (GPT-2's ``Conv1D``)."""


# --------------------------------------------------------------------------- config rules


@dataclass(frozen=True)
class Problem:
    """A config value the spec cannot express."""

    field: str
    value: Any
    hint: str
    """What ckptool can express, in words (completes "ckptool maps FIELD ... only as ...")."""
    schema: bool = False
    """The family's tensor table assumes another value: no output can hold the model."""


class Rule:
    """What a family knows of some config fields: their names (``fields``), how they read
    into spec values (``read``, lenient: a value it cannot express reads as the nearest
    spec, and ``problem`` names it), and how a spec writes them (``write``)."""

    fields: tuple[str, ...] = ()

    def read(self, config: dict) -> dict:
        return {}

    def write(self, spec: ModelSpec, vocab: int, base: dict) -> dict:
        return {}

    def problem(self, config: dict) -> Problem | None:
        return None


@dataclass(frozen=True)
class Mapped(Rule):
    """A field that is a spec value (an int or float; ``default`` when the field is absent,
    None: the field is required)."""

    name: str
    attr: str
    cast: Callable = int
    default: Any = None
    out: Callable[[ModelSpec], Any] | None = None
    """The value written (default: the spec's ``attr``)."""

    @property
    def fields(self):
        return (self.name,)

    def read(self, config):
        value = config.get(self.name)
        if value is None:
            if self.default is None:
                raise KeyError(self.name)
            value = self.default(config) if callable(self.default) else self.default
        return {self.attr: self.cast(value)}

    def write(self, spec, vocab, base):
        return {self.name: self.out(spec) if self.out else getattr(spec, self.attr)}


@dataclass(frozen=True)
class Fixed(Rule):
    """A field the family's table assumes: only ``values`` (None: absent) are accepted, the
    first is written (unless it is None). ``schema``: another value means other tensors."""

    name: str
    values: tuple
    schema: bool = True
    written: bool = True

    @property
    def fields(self):
        return (self.name,)

    def write(self, spec, vocab, base):
        return {self.name: self.values[0]} if self.written and self.values[0] is not None else {}

    def problem(self, config):
        value = config.get(self.name)
        if self.name in config and value not in self.values:
            shown = " or ".join("null" if v is None else repr(v).lower() if isinstance(v, bool)
                                else str(v) for v in self.values)
            return Problem(self.name, value, shown, self.schema)
        return None


@dataclass(frozen=True)
class Feature(Rule):
    """Fields that together set spec features (RoPE, the window, ties...): ``read_fn``
    returns the spec values, ``write_fn`` the fields, ``problem_fn`` what cannot be
    expressed."""

    names: tuple[str, ...]
    read_fn: Callable[[dict], dict]
    write_fn: Callable[[ModelSpec, int, dict], dict]
    problem_fn: Callable[[dict], Problem | None] = lambda config: None

    @property
    def fields(self):
        return self.names

    def read(self, config):
        return self.read_fn(config)

    def write(self, spec, vocab, base):
        return self.write_fn(spec, vocab, base)

    def problem(self, config):
        return self.problem_fn(config)


# --------------------------------------------------------------------------- the family


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family as data (see the module docstring)."""

    name: str
    architecture: str
    """The ``architectures`` entry written (and recognised)."""
    model_types: tuple[str, ...]
    """``model_type`` values recognised; the first is written."""
    fixed: dict
    """ModelSpec values every model of the family has (swiglu, normalization...)."""
    features: tuple[str, ...]
    """ModelSpec features beyond ``fixed`` the family can express (``qkv_bias``, ...)."""
    embedding: str
    layer: str
    """The prefix of layer ``{i}``'s tensors."""
    layer_tensors: tuple[T, ...]
    final: tuple[T, ...]
    """The final norm's tensors (parts ``final_norm``, ``final_norm_bias``)."""
    head: str
    """The output layer, when not tied to the embedding."""
    config: tuple[Rule, ...]
    positions: str | None = None
    """Learned position embeddings' tensor (GPT-2)."""
    architectures: tuple[str, ...] = ()
    """Other ``architectures`` recognised as this family."""
    traits: str = ""
    """The family's traits in words (for a refusal that names them)."""
    extra: dict = field(default_factory=dict)
    """Config fields written as they are (``hidden_act``...)."""
    absent: dict = field(default_factory=dict)
    """What the family's transformers config class (5.24) takes for a field ``config.json``
    leaves out, where that is not what the rules assume alone (a value, or a function of the
    config read so far). A file written by hand or by an older transformers often leaves them
    out; read otherwise, the converted model computes something else (Mixtral's RoPE theta is
    1e6, Qwen3-MoE routes to 8 experts, ...). ``tests/test_config_fidelity.py`` checks it against the
    installed transformers."""

    def complete(self, config: dict) -> dict:
        """``config`` with :attr:`absent`'s values for the fields it leaves out."""
        out = dict(config)
        for name, value in self.absent.items():
            if name not in out:
                out[name] = value(out) if callable(value) else value
        return out

    def tensors(self, spec: ModelSpec, vocab: int) -> list[HfTensor]:
        """Every tensor of the HF model with the canonical regions it holds, in its
        ``named_parameters()`` order (the order a DeepSpeed engine flattens them in)."""
        h, vocab_rows = spec.hidden_size, spec.global_vocab_rows
        out = [HfTensor(self.embedding, (vocab, h), rows(WORD_EMBEDDINGS, (vocab_rows, h), [(0, vocab)]))]
        if self.positions:
            shape = (spec.max_position_embeddings, h)
            out.append(HfTensor(self.positions, shape, ((0, Region.whole(POSITION_EMBEDDINGS, shape)),)))
        for i in range(spec.num_layers):
            prefix = self.layer.format(i=i)
            for t in self.layer_tensors:
                if t.when and not getattr(spec, t.when):
                    continue
                if t.part in EXPERT_PARTS:  # one HF tensor per expert: {e}
                    for e in range(spec.num_experts):
                        shape, parts = EXPERT_PARTS[t.part](spec, f"decoder.layers.{i}.", e)
                        out.append(HfTensor(prefix + t.name.format(e=e), shape, parts, t.transposed))
                    continue
                shape, parts = PARTS[t.part](spec, f"decoder.layers.{i}.")
                out.append(HfTensor(prefix + t.name, shape, parts, t.transposed))
        for t in self.final:
            key = f"{FINAL_NORM}.{'bias' if t.part.endswith('bias') else 'weight'}"
            out.append(HfTensor(t.name, (h,), ((0, Region.whole(key, (h,))),)))
        if not spec.tied_embeddings:
            out.append(HfTensor(self.head, (vocab, h), rows(OUTPUT_LAYER, (vocab_rows, h), [(0, vocab)])))
        return out

    def tied_aliases(self, spec: ModelSpec) -> dict[str, str]:
        """State-dict names the HF model ties to another parameter (safetensors stores the
        owner only): ``{alias: owner}``."""
        return {self.head: self.embedding} if spec.tied_embeddings else {}

    def spec(self, config: dict) -> ModelSpec:
        """The model a ``config.json`` of this family describes (KeyError, TypeError or
        ValueError when a required field is missing or not a number)."""
        values = dict(self.fixed)
        config = self.complete(config)
        for rule in self.config:
            values.update(rule.read(config))
        return ModelSpec(**values)

    def config_json(self, spec: ModelSpec, vocab: int, base: dict | None) -> dict:
        """The ``config.json`` for ``spec``: the family's fields from the spec, over the
        fields of a carried source config."""
        kept = base is not None and base.get("model_type", self.model_types[0]) == self.model_types[0]
        base = self.complete(base) if kept else base  # the values it left out are written as read
        out = dict(base or {})
        out.update(self.extra)
        out.update(architectures=[self.architecture], model_type=self.model_types[0])
        for rule in self.config:
            if kept and rule.problem(base) is not None:
                continue  # the spec holds this value only approximately: the source's fields stay
            out.update(rule.write(spec, vocab, base or {}))
        return out

    def expresses(self, spec: ModelSpec) -> str | None:
        """None when the family can express ``spec``; else what does not fit, in words."""
        for name, value in self.fixed.items():
            if getattr(spec, name) != value:
                return f"{name}={getattr(spec, name)}"
        for name, on in FEATURES.items():
            if name not in self.fixed and name not in self.features and on(spec):
                return name.replace("_", " ")
        return None

    def rule_of(self, name: str) -> Rule | None:
        return next((r for r in self.config if name in r.fields), None)


FEATURES: dict[str, Callable[[ModelSpec], bool]] = {
    "qkv_bias": lambda s: s.qkv_bias and not s.add_bias,
    "qk_layernorm": lambda s: s.qk_layernorm,
    "window_size": lambda s: s.window_size is not None,
    "rope_scaling": lambda s: s.rope_scaling is not None,
    "tied_embeddings": lambda s: s.tied_embeddings,
    "grouped_query_attention": lambda s: s.groups != s.num_attention_heads,
    "head_dim": lambda s: s.head_dim != s.hidden_size // s.num_attention_heads,
    "gated_gelu": lambda s: s.swiglu and s.activation == "gelu_tanh",
    "layer_windows": lambda s: s.layer_windows is not None,
    "rope_local_base": lambda s: s.rope_local_base is not None,
    "norm_placement": lambda s: s.norm_placement != "pre",
    "norm_offset": lambda s: s.norm_offset,
    "embedding_scale": lambda s: s.embedding_scale,
    "qk_norm_whole": lambda s: s.qk_norm_whole,
    "attn_softcap": lambda s: s.attn_softcap is not None,
    "final_softcap": lambda s: s.final_softcap is not None,
    "query_scale": lambda s: s.query_scale is not None,
    "experts": lambda s: s.num_experts is not None,
    "shared_experts": lambda s: s.moe_shared_expert_size is not None,
    "shared_expert_gate": lambda s: s.moe_shared_expert_gate,
    "router_pre_softmax": lambda s: s.moe_router_pre_softmax,
}
"""Features a model may have (each: is it on?); a family fixes one, or lists the ones it
can express in ``features``."""
