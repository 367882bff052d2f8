"""Layout rules for Megatron-style GPT models: which regions of which global tensors each
(pipeline stage, tensor-parallel rank) holds. Each quirk is one rule, written once here and
used by readers, writers, reshard and the training hook.

Global (canonical) keys are Megatron-Core's distributed-checkpoint names with a global
layer index, e.g. ``decoder.layers.{i}.self_attention.linear_qkv.weight``.

Rules:

* ``column``: split dim 0 over TP (QKV, fc1 without gating, their biases).
* ``row``: split dim 1 over TP (``linear_proj``, ``linear_fc2``).
* ``replicated``: every TP rank holds the whole tensor (norms, row-parallel biases).
* ``gated``: SwiGLU fc1. The global tensor is ``[gate; up]``; TP rank r holds
  ``[gate_r; up_r]``, which is **two** regions.
* ``vocab``: dim 0 over TP after padding the vocabulary to a multiple of
  ``make_vocab_size_divisible_by * tp``. The global tensor has ``vocab_rows`` rows: the
  rows the source stores (its padded size), so that padding rows, which Megatron trains
  like any other (they take part in the softmax), survive whenever the target keeps them.
  A target that pads to fewer rows drops only rows past the true vocabulary; one that
  pads to more fills the new rows with zeros.
* Fused QKV with GQA is grouped per query group, ``[q_1..q_{nh/ng}, k, v]`` per group,
  so its TP split is a plain ``column`` split once ``ng % tp == 0``.
* Pipeline: stage p holds its layers numbered from 0 locally; the first stage holds the
  embeddings, the last the final norm and output layer, and with tied embeddings (PP > 1)
  also a copy of the word embeddings. Virtual pipeline chunk c of stage p holds the
  (c*pp + p)-th block of layers.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

from ckptool.core.errors import TopologyError, UnreadableInput
from ckptool.core.regions import Region, Shard
from ckptool.core.topology import Topology

COLUMN, ROW, REPLICATED, GATED, VOCAB = "column", "row", "replicated", "gated", "vocab"
EXPERT_GATED, EXPERT_ROW, EXPERT_COLUMN = "expert_gated", "expert_row", "expert_column"
EXPERT_RULES = (EXPERT_GATED, EXPERT_ROW, EXPERT_COLUMN)
"""The experts of a MoE layer, stacked ``[E, ...]``: EP rank e holds experts
``[e*E/EP, (e+1)*E/EP)``, each as its own local tensor; inside an expert, expert tensor
parallelism (ETP) splits fc1 as ``gated`` and fc2 as ``row``."""
_LOCAL_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.local_experts\.(?P<j>\d+)\.(?P<rest>linear_fc[12]\.weight)$")

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm"
OUTPUT_LAYER = "output_layer.weight"


SIZE_BOUNDS = {"num_layers": 1 << 16, "hidden_size": 1 << 24, "num_attention_heads": 1 << 16,
          "vocab_size": 1 << 28, "vocab_rows": 1 << 28, "num_query_groups": 1 << 16,
          "ffn_hidden_size": 1 << 28, "kv_channels": 1 << 16}
"""Bounds of a :class:`ModelSpec`'s sizes: far above any model, far below what would exhaust
memory when a list or plan is sized by them."""
_OPTIONAL = {"vocab_rows", "num_query_groups", "ffn_hidden_size", "kv_channels"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the layout rules need to know of a GPT-style model."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    """The true vocabulary size (without Megatron's padding)."""
    vocab_rows: int | None = None
    """Rows of the global embedding as stored (the source's padded size); default vocab_size."""
    num_query_groups: int | None = None
    """GQA groups (kv heads); None means plain multi-head attention."""
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    make_vocab_size_divisible_by: int = 128
    swiglu: bool = False
    tied_embeddings: bool = True
    add_bias: bool = True
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only)."""
    learned_positions: bool = True
    max_position_embeddings: int = 0
    first_stage_layers: int | None = None
    """``decoder_first_pipeline_num_layers`` for uneven pipelines."""
    last_stage_layers: int | None = None
    """``decoder_last_pipeline_num_layers`` for uneven pipelines."""
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    """RoPE theta (Megatron ``rotary_base``, HF ``rope_theta``)."""
    activation: str = "gelu"
    """MLP activation without gating: ``gelu`` (erf) or ``gelu_tanh`` (Megatron
    ``--openai-gelu``, GPT-2's ``gelu_new``). With ``swiglu`` it is SiLU."""
    # Features beyond the GPT/Llama core: each is off by default, is carried by every
    # output that can express it, and is refused (named) by one that cannot.
    qkv_bias: bool = False
    """A bias on the fused QKV projection only (Megatron ``add_qkv_bias``, Qwen2); with
    ``add_bias`` every linear layer has one."""
    qk_layernorm: bool = False
    """A norm of each query and key head over ``head_dim`` before RoPE (Megatron
    ``qk_layernorm``, Qwen3's ``q_norm``/``k_norm``): ``self_attention.q_layernorm`` and
    ``k_layernorm``, replicated."""
    window_size: int | None = None
    """Sliding-window attention on every layer: a query attends to the ``window_size`` keys
    ending at its own position (HF ``sliding_window``; Megatron ``window_size`` =
    ``(window_size - 1, 0)``). None: full causal attention."""
    rope_scaling: str | None = None
    """RoPE frequency scaling: None, or ``llama3`` (Llama 3.1+) with the factors below."""
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    layer_windows: str | None = None
    """Per layer, ``S`` (the sliding window) or ``F`` (full attention): Gemma 2/3 patterns.
    None: ``window_size`` (if any) on every layer."""
    rope_local_base: float | None = None
    """RoPE theta of the sliding-window layers when it differs (Gemma 3; ``rotary_base`` is
    the full-attention layers')."""
    norm_placement: str = "pre"
    """``pre``: a norm before attention and before the MLP (Llama, GPT); ``sandwich``: also
    one after each (Gemma 2/3: ``post_self_attn_layernorm``, ``post_mlp_layernorm``);
    ``post``: only the ones after (OLMo 2)."""
    norm_offset: bool = False
    """Norms compute ``x * (1 + w)``: the stored weight is zero-centred (Gemma)."""
    embedding_scale: bool = False
    """Embeddings are multiplied by sqrt(hidden_size) (Gemma)."""
    qk_norm_whole: bool = False
    """OLMo 2's q/k norms: over the whole projection (``[heads * head_dim]``) before it is
    cut into heads, not per head (``self_attention.q_proj_layernorm``, ``k_proj_layernorm``)."""
    attn_softcap: float | None = None
    """Attention logits soft-capped: ``cap * tanh(scores / cap)`` (Gemma 2)."""
    final_softcap: float | None = None
    """Output logits soft-capped (Gemma 2/3)."""
    query_scale: float | None = None
    """Attention scores scaled by ``query_scale ** -0.5`` instead of ``head_dim ** -0.5``
    (Gemma 2/3's ``query_pre_attn_scalar``); None: head_dim."""
    # Mixture of Experts: every layer's MLP is ``num_experts`` experts and a router
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    """Each expert's intermediate size (default ``ffn_hidden_size``)."""
    moe_shared_expert_size: int | None = None
    """The shared experts' intermediate size (``mlp.shared_experts``); None: none."""
    moe_router_topk: int = 2
    """Experts per token. The router is Mixtral's: softmax over the chosen experts' logits
    (= softmax, top-k, renormalise); other routers are refused where they cannot be written."""
    moe_router_pre_softmax: bool = False
    """Softmax over every expert, then top-k, not renormalised (Qwen2-MoE's
    ``norm_topk_prob`` false; Megatron ``moe_router_pre_softmax``)."""
    moe_shared_expert_gate: bool = False
    """The shared experts' output is scaled by sigmoid(x · gate_weight) (Qwen2-MoE;
    Megatron ``moe_shared_expert_gate``): ``mlp.shared_experts.gate_weight`` ``[1, h]``."""

    def __post_init__(self):
        # a config or args a checkpoint holds is untrusted: sizes beyond any model would size
        # lists and plans (one entry per head or group) before anything else looks at them
        for name, most in SIZE_BOUNDS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise ValueError(f"{name}={value!r} is not a size of a model (1 to {most})")
        if self.num_query_groups is not None and self.num_query_groups > self.num_attention_heads:
            raise ValueError(f"num_query_groups={self.num_query_groups} exceeds the "
                             f"{self.num_attention_heads} attention heads")

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def global_vocab_rows(self) -> int:
        return self.vocab_rows or self.vocab_size

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab(self.vocab_size, self.make_vocab_size_divisible_by, tp)


def model_spec(config: dict, where: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` a stored ``model_config`` describes. A manifest's is the
    training job's own dict (the hook takes any), so one that is not a ModelSpec (unknown or
    missing fields) is refused here, naming them, where the layout rules are needed."""
    if not isinstance(config, dict):
        raise UnreadableInput("the checkpoint records no model config, which this output needs "
                              "to lay the tensors out", path=where,
                              hint="Save it with AsyncCheckpointer(..., model_config=asdict(spec)), "
                                   "or convert to dcp")
    fields = ModelSpec.__dataclass_fields__
    unknown = sorted(str(k) for k in config if k not in fields)
    if unknown:
        raise UnreadableInput(f"the checkpoint's model_config is not a model ckptool lays out: it has "
                              f"fields ckptool does not know: {', '.join(unknown[:5])}", path=where)
    try:
        return ModelSpec(**config)
    except (TypeError, ValueError) as exc:
        raise UnreadableInput(f"the checkpoint's model_config is not a model ckptool lays out: {exc}",
                              path=where) from None


def padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Param:
    """A global tensor and the rule that splits it."""

    key: str
    shape: tuple[int, ...]
    rule: str


def layer_params(spec: ModelSpec, i: int) -> list[Param]:
    """The global tensors of transformer layer ``i``."""
    h, d = spec.hidden_size, spec.head_dim
    qkv_rows = (spec.num_attention_heads + 2 * spec.groups) * d
    fc1_rows = 2 * spec.ffn if spec.swiglu else spec.ffn
    p = f"decoder.layers.{i}."
    pre = spec.norm_placement != "post"
    params = [
        *(_norm(spec, p + "self_attention.linear_qkv.layer_norm") if pre else []),
        Param(p + "self_attention.linear_qkv.weight", (qkv_rows, h), COLUMN),
        Param(p + "self_attention.linear_proj.weight", (h, spec.num_attention_heads * d), ROW),
        *(_norm(spec, p + "mlp.linear_fc1.layer_norm") if pre else []),
        *(_moe_params(spec, p) if spec.num_experts else [
            Param(p + "mlp.linear_fc1.weight", (fc1_rows, h), GATED if spec.swiglu else COLUMN),
            Param(p + "mlp.linear_fc2.weight", (h, spec.ffn), ROW)]),
    ]
    if spec.norm_placement != "pre":  # after attention and after the MLP, before each residual add
        params += [*_norm(spec, p + "post_self_attn_layernorm"), *_norm(spec, p + "post_mlp_layernorm")]
    if spec.qk_norm_whole:  # over the whole projection: no TP split keeps its statistics
        params += [Param(p + "self_attention.q_proj_layernorm.weight", (spec.num_attention_heads * d,), REPLICATED),
                   Param(p + "self_attention.k_proj_layernorm.weight", (spec.groups * d,), REPLICATED)]
    if spec.qk_layernorm:  # over head_dim, the same for every head: replicated
        for x in "qk":
            params.append(Param(p + f"self_attention.{x}_layernorm.weight", (d,), REPLICATED))
            if spec.normalization == "LayerNorm":
                params.append(Param(p + f"self_attention.{x}_layernorm.bias", (d,), REPLICATED))
    if spec.qkv_bias and not spec.add_bias:
        params.append(Param(p + "self_attention.linear_qkv.bias", (qkv_rows,), COLUMN))
    if spec.add_bias:
        params += [
            Param(p + "self_attention.linear_qkv.bias", (qkv_rows,), COLUMN),
            Param(p + "self_attention.linear_proj.bias", (h,), REPLICATED),
        ]
        if not spec.num_experts:
            params += [Param(p + "mlp.linear_fc1.bias", (fc1_rows,), GATED if spec.swiglu else COLUMN),
                       Param(p + "mlp.linear_fc2.bias", (h,), REPLICATED)]
    return params


def _moe_params(spec: ModelSpec, p: str) -> list[Param]:
    """A MoE layer's MLP: the router (fp32 in Megatron-Core, every rank's), the experts
    stacked ``[E, ...]`` (Megatron-Core's ``torch_dist`` view, one layer), shared experts
    like a dense MLP."""
    h, e, f = spec.hidden_size, spec.num_experts, spec.moe_ffn
    params = [Param(p + "mlp.router.weight", (e, h), REPLICATED),
              Param(p + "mlp.experts.experts.linear_fc1.weight", (e, 2 * f if spec.swiglu else f, h),
                    EXPERT_GATED if spec.swiglu else EXPERT_COLUMN),
              Param(p + "mlp.experts.experts.linear_fc2.weight", (e, h, f), EXPERT_ROW)]
    if spec.moe_shared_expert_size:
        s = spec.moe_shared_expert_size
        params += [Param(p + "mlp.shared_experts.linear_fc1.weight", (2 * s if spec.swiglu else s, h),
                         GATED if spec.swiglu else COLUMN),
                   Param(p + "mlp.shared_experts.linear_fc2.weight", (h, s), ROW)]
        if spec.moe_shared_expert_gate:
            params.append(Param(p + "mlp.shared_experts.gate_weight", (1, h), REPLICATED))
    return params


def expert_name(key: str, j: int) -> str:
    """The local name of local expert ``j``'s slice of the stacked expert tensor ``key``
    (``...mlp.experts.experts.linear_fc1.weight`` -> ``...mlp.experts.local_experts.{j}.linear_fc1.weight``)."""
    prefix, _, rest = key.partition(".mlp.experts.experts.")
    return f"{prefix}.mlp.experts.local_experts.{j}.{rest}"


def expert_of(local: str) -> tuple[str, int] | None:
    """(the stacked expert tensor's key, the local expert index) of a local expert name;
    None for any other name."""
    m = _LOCAL_EXPERT.match(local)
    return (f"{m.group('prefix')}.experts.{m.group('rest')}", int(m.group("j"))) if m else None


def local_experts(spec: ModelSpec, topo: Topology, ep_rank: int) -> range:
    """The global experts EP rank ``ep_rank`` holds."""
    n = spec.num_experts // topo.ep
    return range(ep_rank * n, (ep_rank + 1) * n)


def _norm(spec: ModelSpec, prefix: str) -> list[Param]:
    h = spec.hidden_size
    params = [Param(prefix + "_weight" if prefix.endswith("layer_norm") else prefix + ".weight",
                    (h,), REPLICATED)]
    if spec.normalization == "LayerNorm":
        params.append(Param(params[0].key.replace("weight", "bias"), (h,), REPLICATED))
    return params


def first_stage_params(spec: ModelSpec) -> list[Param]:
    params = [Param(WORD_EMBEDDINGS, (spec.global_vocab_rows, spec.hidden_size), VOCAB)]
    if spec.learned_positions:
        params.append(Param(POSITION_EMBEDDINGS, (spec.max_position_embeddings, spec.hidden_size),
                            REPLICATED))
    return params


def last_stage_params(spec: ModelSpec) -> list[Param]:
    h = spec.hidden_size
    params = [Param(f"{FINAL_NORM}.weight", (h,), REPLICATED)]
    if spec.normalization == "LayerNorm":
        params.append(Param(f"{FINAL_NORM}.bias", (h,), REPLICATED))
    if not spec.tied_embeddings:
        params.append(Param(OUTPUT_LAYER, (spec.global_vocab_rows, h), VOCAB))
    return params


def check(spec: ModelSpec, topo: Topology) -> None:
    """Refuse a topology that breaks a layout rule, naming the rule."""
    tp, pp = topo.tp, topo.pp
    tp_hint = f"TP sizes that work: {', '.join(map(str, tp_sizes(spec)))}"
    if spec.num_attention_heads % tp:
        raise TopologyError(f"attention heads ({spec.num_attention_heads}) must be divisible by "
                            f"TP ({tp})", hint=tp_hint)
    if spec.groups % tp:
        raise TopologyError(f"query groups / kv heads ({spec.groups}) must be divisible by TP ({tp})",
                            hint=tp_hint)
    if spec.ffn % tp and not spec.num_experts:
        raise TopologyError(f"ffn_hidden_size ({spec.ffn}) must be divisible by TP ({tp})", hint=tp_hint)
    if spec.num_experts:
        if spec.num_experts % topo.ep:
            raise TopologyError(f"the {spec.num_experts} experts must be divisible by EP ({topo.ep})",
                                hint=f"EP sizes that work: {', '.join(map(str, ep_sizes(spec)))}")
        if spec.moe_ffn % topo.expert_tp:
            raise TopologyError(f"moe_ffn_hidden_size ({spec.moe_ffn}) must be divisible by ETP "
                                f"({topo.expert_tp})")
        if tp % topo.expert_tp:
            raise TopologyError(f"expert tensor parallelism ETP{topo.expert_tp} must divide TP{tp} "
                                "(a rank's expert TP rank is its TP rank modulo ETP, and Megatron "
                                "names a rank file by its TP and EP rank alone)",
                                hint="Pick an --etp/--to-etp that divides the TP")
        if spec.moe_shared_expert_size and spec.moe_shared_expert_size % tp:
            raise TopologyError(f"the shared experts' size ({spec.moe_shared_expert_size}) must be "
                                f"divisible by TP ({tp})", hint=tp_hint)
    elif topo.ep > 1:
        raise TopologyError(f"EP{topo.ep} needs a model with experts; this one has none",
                            hint="Drop --ep/--to-ep")
    stage_layers(spec, pp, topo.vpp)  # raises for layers vs PP


def stage_layers(spec: ModelSpec, pp: int, vpp: int = 1) -> list[list[range]]:
    """Global layer ranges for each stage, one per virtual chunk (``model0``, ``model1``...)."""
    L = spec.num_layers
    first, last = spec.first_stage_layers, spec.last_stage_layers
    if first is None and last is None:
        if L % (pp * vpp):
            raise TopologyError(
                f"num_layers ({L}) must be divisible by PP x VPP ({pp} x {vpp})",
                hint="Give an uneven split (--decoder-first-pipeline-num-layers N and/or "
                     "--decoder-last-pipeline-num-layers N) or another --pp")
        n = L // (pp * vpp)
        return [[range((c * pp + p) * n, (c * pp + p + 1) * n) for c in range(vpp)]
                for p in range(pp)]
    if vpp > 1:
        raise TopologyError("uneven pipeline stages with virtual pipeline chunks are not supported")
    counts = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last if pp > 1 or first is None else counts[0]
    rest = L - sum(c for c in counts if c is not None)
    middle = [i for i, c in enumerate(counts) if c is None]
    if rest < 0 or (middle and rest % len(middle)) or (not middle and rest):
        raise TopologyError(f"num_layers ({L}) cannot be split over PP ({pp}) with first={first} "
                            f"and last={last} layers")
    for i in middle:
        counts[i] = rest // len(middle)
    starts = [sum(counts[:p]) for p in range(pp)]
    return [[range(starts[p], starts[p] + counts[p])] for p in range(pp)]


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """One tensor as a rank stores it."""

    chunk: int
    """Virtual pipeline chunk (``model{chunk}``); 0 without VPP."""
    name: str
    """Canonical key with the *local* layer index."""
    shard: Shard
    replica: bool = False
    """True when another rank holds the primary copy of the same regions."""


@dataclass(frozen=True, slots=True)
class RankLayout:
    pp_rank: int
    tp_rank: int
    tensors: list[LocalTensor] = field(default_factory=list)
    ep_rank: int = 0


def tp_sizes(spec: ModelSpec) -> list[int]:
    """The TP sizes the rules of :func:`check` allow for ``spec`` (heads, query groups, the
    dense FFN or the shared experts split evenly)."""
    sizes = [spec.num_attention_heads, spec.groups]
    if not spec.num_experts:
        sizes.append(spec.ffn)
    elif spec.moe_shared_expert_size:
        sizes.append(spec.moe_shared_expert_size)
    common = math.gcd(*sizes)
    return [n for n in range(1, common + 1) if common % n == 0]


def ep_sizes(spec: ModelSpec) -> list[int]:
    """The EP sizes a model's experts can be split into."""
    return [n for n in range(1, spec.num_experts + 1) if spec.num_experts % n == 0]


def expert_tp_rank(topo: Topology, tp_rank: int) -> int:
    """The expert tensor-parallel rank of TP rank ``tp_rank``. Megatron-Core orders both the
    dense ranks (TP innermost) and the expert ranks (ETP innermost) from the global rank, so
    with ETP dividing TP (:func:`check`) it is ``tp_rank % ETP``: the TP ranks ``>= ETP``
    hold copies of the expert shards of the first ETP ones."""
    return tp_rank % topo.expert_tp


def expert_ranks(topo: Topology, tp_rank: int, dp_rank: int) -> tuple[int, int, int]:
    """(expert TP rank, EP rank, expert-DP rank) of the rank at TP rank ``tp_rank``, DP rank
    ``dp_rank`` of a pipeline stage, in Megatron-Core's default order (``tp-cp-ep-dp-pp``,
    CP = 1): the stage's rank ``dp_rank·TP + tp_rank`` counted as ``etp + ETP·(ep + EP·edp)``."""
    r, etp = dp_rank * topo.tp + tp_rank, topo.expert_tp
    return r % etp, (r // etp) % topo.ep, r // (etp * topo.ep)


def split(param: Param, tp_rank: int, tp: int, padded_rows: int | None = None,
          expert: int | None = None) -> Shard:
    """The shard of ``param`` that TP rank ``tp_rank`` of ``tp`` holds, per its rule; for an
    expert rule, of global expert ``expert`` (``tp_rank``/``tp``: the expert TP rank and size)."""
    shape, key = param.shape, param.key
    if param.rule in EXPERT_RULES:
        if expert is None:
            raise ValueError(f"{key} is split per expert: give the expert")
        inner_rule = {EXPERT_GATED: GATED, EXPERT_ROW: ROW, EXPERT_COLUMN: COLUMN}[param.rule]
        inner = split(Param(key, shape[1:], inner_rule), tp_rank, tp)
        return Shard(inner.shape, tuple(
            (offset, Region(key, shape, (expert, *r.offsets), (1, *r.lengths))) for offset, r in inner.parts))
    if param.rule == REPLICATED:
        return Shard.of(Region.whole(key, shape))
    if param.rule == ROW:
        n = shape[1] // tp
        return Shard.of(Region(key, shape, (0, tp_rank * n), (shape[0], n)))
    if param.rule == COLUMN:
        n = shape[0] // tp
        rest = shape[1:]
        return Shard.of(Region(key, shape, (tp_rank * n, *(0,) * len(rest)), (n, *rest)))
    if param.rule == GATED:
        half = shape[0] // 2
        n = half // tp
        rest = shape[1:]
        row = math.prod(rest)
        zeros = (0,) * len(rest)
        gate = Region(key, shape, (tp_rank * n, *zeros), (n, *rest))
        up = Region(key, shape, (half + tp_rank * n, *zeros), (n, *rest))
        return Shard((2 * n, *rest), ((0, gate), (n * row, up)))
    if param.rule == VOCAB:
        assert padded_rows is not None
        n = padded_rows // tp
        lo, hi = tp_rank * n, min((tp_rank + 1) * n, shape[0])
        rest = shape[1:]
        parts = ((0, Region(key, shape, (lo, *(0,) * len(rest)), (hi - lo, *rest))),) if hi > lo else ()
        return Shard((n, *rest), parts)
    raise ValueError(f"unknown layout rule {param.rule!r} for {key}")


def layout(spec: ModelSpec, topo: Topology) -> list[RankLayout]:
    """Every (pp_rank, tp_rank, ep_rank)'s local tensors. DP replicas are not listed; the
    dense tensors of EP rank > 0 (EP re-divides data-parallel ranks) are replicas, and so are
    the experts of TP ranks past the ETP (:func:`expert_tp_rank`). Every (tp, ep) pair is
    listed: which of them a job's ranks hold depends on its DP size, and any may be asked for."""
    check(spec, topo)
    vocab_rows = spec.padded_vocab(topo.tp)
    stages = stage_layers(spec, topo.pp, topo.vpp)
    out = []
    for p, t, e in itertools.product(range(topo.pp), range(topo.tp), range(topo.ep)):
        rank = RankLayout(p, t, ep_rank=e)
        for chunk, layers in enumerate(stages[p]):
            for local, i in enumerate(layers):
                for param in layer_params(spec, i):
                    name = _local_name(param.key, i, local)
                    if param.rule in EXPERT_RULES:
                        r = expert_tp_rank(topo, t)
                        rank.tensors.extend(LocalTensor(chunk, expert_name(name, j),
                                                        split(param, r, topo.expert_tp, expert=g), replica=t != r)
                                            for j, g in enumerate(local_experts(spec, topo, e)))
                    else:
                        rank.tensors.append(LocalTensor(chunk, name, split(param, t, topo.tp),
                                                        replica=(param.rule == REPLICATED and t > 0) or e > 0))
        first, last = p == 0, p == topo.pp - 1
        if first:
            for param in first_stage_params(spec):
                rank.tensors.append(_whole(param, t, topo, vocab_rows, 0, replica=e > 0))
        if last:
            last_chunk = len(stages[p]) - 1
            for param in last_stage_params(spec):
                rank.tensors.append(_whole(param, t, topo, vocab_rows, last_chunk, replica=e > 0))
            if spec.tied_embeddings and not first:
                # The last stage keeps its own copy of the word embeddings for the head.
                emb = first_stage_params(spec)[0]
                rank.tensors.append(_whole(emb, t, topo, vocab_rows, last_chunk, replica=True))
        out.append(rank)
    return out


def _whole(param: Param, t: int, topo: Topology, vocab_rows: int, chunk: int, replica: bool) -> LocalTensor:
    shard = split(param, t, topo.tp, vocab_rows)
    return LocalTensor(chunk, param.key, shard,
                       replica=replica or (param.rule == REPLICATED and t > 0))


def _local_name(key: str, global_index: int, local_index: int) -> str:
    return key.replace(f"decoder.layers.{global_index}.", f"decoder.layers.{local_index}.", 1)


def global_params(spec: ModelSpec) -> list[Param]:
    """Every global tensor of the model, once."""
    params = first_stage_params(spec)
    for i in range(spec.num_layers):
        params += layer_params(spec, i)
    return params + last_stage_params(spec)
