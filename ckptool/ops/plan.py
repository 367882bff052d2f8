"""``ckptool plan``: pick a TP x PP x DP topology for a GPU count and see what it costs.

* Topology math: ``dp = gpus / (tp * pp)``; every rule that fails is listed (GPUs not
  divisible, heads / query groups / ffn vs TP, layers vs PP); TP beyond one node warns.
* Memory per GPU for training state, the standard accounting for mixed-precision Adam
  (bytes per parameter: 2 weights + 2 gradients + 12 optimizer = 4 fp32 master + 4 + 4
  moments; with ``--dtype fp32``: 4 + 4 + 8). A GPU holds ``p`` parameters, its TP x PP
  share (with a model config: the heaviest stage, embeddings included). What each
  strategy shards over DP:

  ==============  ===========================================
  ZeRO-0          ``(2 + 2 + 12) p``
  ZeRO-1          ``(2 + 2) p + 12 p / dp``
  ZeRO-2          ``2 p + (2 + 12) p / dp``
  ZeRO-3          ``(2 + 2 + 12) p / dp``
  Megatron dist.  ``(2 + 4) p + 12 p / dp`` (fp32 main gradients, Megatron's own table)
  ==============  ===========================================

  Activations and buffers are not counted.
* Checkpoint size (weights in the training dtype plus fp32 master and Adam moments), the
  stall of an async save (the busiest rank's bytes over ``--h2d-gbps``) and the background
  write (everything over ``--storage-gbps``, the aggregate bandwidth).
* ``--from CKPT``: the topologies that checkpoint can be resharded to for ``--gpus``.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import asdict, dataclass, field, replace

from ckptool.checkpoints.open import open_checkpoint
from ckptool.core.errors import TopologyError, UsageError
from ckptool.core.jsonfile import json_object
from ckptool.core.layout import ModelSpec, ep_sizes, global_params, layout, model_spec, stage_layers
from ckptool.core.storage import Store
from ckptool.core.topology import Topology
from converters.schemas.hf import family_of_config, spec_from_config
from converters.schemas.megatron_args import spec_from_args

STRATEGIES = ("zero0", "zero1", "zero2", "zero3", "megatron-distopt")
GB = 1e9


@dataclass(frozen=True, slots=True)
class MemoryRow:
    strategy: str
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    total_gb: float
    fits: bool | None
    """Against --gpu-mem (None when not given)."""


@dataclass(frozen=True, slots=True)
class CheckpointCost:
    bytes: int
    per_gpu_bytes: int
    """What the busiest rank stages and writes."""
    stall_s: float
    write_s: float


@dataclass(frozen=True, slots=True)
class PlanResult:
    gpus: int
    tp: int
    pp: int
    dp: int
    zero: int
    dtype: str
    params: int
    params_per_gpu: int
    memory: list[MemoryRow] = field(default_factory=list)
    checkpoint: CheckpointCost | None = None
    warnings: list[str] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    """With --from: topologies the checkpoint reshards to for --gpus."""
    model: dict | None = None


def bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter."""
    return (2, 2, 12) if dtype in ("bf16", "fp16") else (4, 4, 8)


def memory_rows(p: int, dp: int, dtype: str, gpu_mem_gb: float | None) -> list[MemoryRow]:
    w, g, o = bytes_per_param(dtype)
    main_grad = 4  # Megatron keeps fp32 main gradients
    shares = {
        "zero0": (w, g, o),
        "zero1": (w, g, o / dp),
        "zero2": (w, g / dp, o / dp),
        "zero3": (w / dp, g / dp, o / dp),
        "megatron-distopt": (w, main_grad, o / dp),
    }
    rows = []
    for name in STRATEGIES:
        a, b, c = (x * p / GB for x in shares[name])
        total = a + b + c
        rows.append(MemoryRow(name, round(a, 3), round(b, 3), round(c, 3), round(total, 3),
                              None if gpu_mem_gb is None else total <= gpu_mem_gb))
    return rows


def plan(gpus: int, tp: int, pp: int, *, params: int | None = None, spec: ModelSpec | None = None,
         zero: int = 1, dtype: str = "bf16", gpu_mem_gb: float | None = None, ep: int = 1,
         etp: int | None = None, gpus_per_node: int = 8, h2d_gbps: float = 20.0, storage_gbps: float = 10.0,
         source: ModelSpec | None = None, source_topology: Topology | None = None) -> PlanResult:
    """The plan for ``gpus`` at TP ``tp`` x PP ``pp``; raises TopologyError listing every
    rule that fails."""
    if spec is None and params is None:
        raise UsageError("give the model: --model CONFIG (HF config.json, Megatron args or a "
                         "checkpoint) or --params N")
    problems = []
    if gpus % (tp * pp):
        problems.append(f"{gpus} GPUs are not divisible by TP x PP = {tp} x {pp} = {tp * pp}")
    dp = max(1, gpus // (tp * pp))
    if spec is not None:
        problems += rule_problems(spec, tp, pp, ep, dp, etp)
    elif ep > 1 or etp is not None:
        problems.append("--ep/--etp need the model (--model or --from), to know its experts")
    if problems:
        raise TopologyError("; ".join(problems),
                            hint="Pick TP dividing heads, query groups and ffn, and PP dividing layers")
    warnings = []
    if tp > gpus_per_node:
        warnings.append(f"TP{tp} spans more than one node of {gpus_per_node} GPUs: its all-reduces "
                        "leave NVLink for the inter-node network")
    if spec is not None:
        total, per_gpu = count_params(spec, tp, pp, ep, etp, dp)
    else:
        total, per_gpu = params, -(-params // (tp * pp))
    w, _, o = bytes_per_param(dtype)
    size = total * (w + o)
    share = {0: w + o, 1: w + o / dp, 2: w + o / dp, 3: (w + o) / dp}[zero]
    busiest = int(per_gpu * share)
    cost = CheckpointCost(int(size), busiest, round(busiest / (h2d_gbps * GB), 3),
                          round(size / (storage_gbps * GB), 1))
    restarts = []
    if source is not None:
        restarts = restart_options(source, gpus, gpus_per_node, source_topology)
    return PlanResult(gpus, tp, pp, dp, zero, dtype, int(total), int(per_gpu),
                      memory_rows(per_gpu, dp, dtype, gpu_mem_gb), cost, warnings, restarts,
                      asdict(spec) if spec is not None else None)


def rule_problems(spec: ModelSpec, tp: int, pp: int, ep: int = 1, dp: int | None = None,
                  etp: int | None = None) -> list[str]:
    """Every layout rule ``(tp, pp, ep, etp)`` breaks for ``spec`` (the rules reshard enforces)."""
    problems = []
    expert_tp = tp if etp is None else etp
    if spec.num_experts:
        if spec.num_experts % ep:
            problems.append(f"{spec.num_experts} experts are not divisible by EP{ep} "
                            f"(EP sizes that work: {', '.join(map(str, ep_sizes(spec)))})")
        if dp is not None and (tp * dp) % (expert_tp * ep):
            problems.append(f"EP{ep} x ETP{expert_tp} does not divide TP{tp} x DP{dp} (expert "
                            "parallelism re-divides the TP x DP ranks)")
        if spec.moe_ffn % expert_tp:
            problems.append(f"moe_ffn_hidden_size {spec.moe_ffn} is not divisible by ETP{expert_tp}")
        if tp % expert_tp:
            problems.append(f"ETP{expert_tp} does not divide TP{tp}")
    elif ep > 1 or etp is not None:
        problems.append(f"EP{ep}/ETP{expert_tp} need a model with experts")
    if spec.num_attention_heads % tp:
        problems.append(f"{spec.num_attention_heads} attention heads are not divisible by TP{tp}")
    if spec.groups % tp and spec.groups != spec.num_attention_heads:
        problems.append(f"{spec.groups} query groups (kv heads) are not divisible by TP{tp}")
    if spec.ffn % tp and not spec.num_experts:
        problems.append(f"ffn_hidden_size {spec.ffn} is not divisible by TP{tp}")
    try:
        stage_layers(spec, pp)
    except TopologyError as exc:
        problems.append(exc.message)
    return problems


def count_params(spec: ModelSpec, tp: int, pp: int, ep: int = 1, etp: int | None = None,
                 dp: int | None = None) -> tuple[int, int]:
    """(total parameters, parameters on the heaviest GPU), from the layout rules (experts
    split over EP and inside by ETP, dense tensors whole on every EP rank)."""
    padded = replace(spec, vocab_rows=spec.padded_vocab(tp))
    ranks = layout(padded, Topology(tp=tp, pp=pp, ep=ep, dp=dp or ep, etp=etp))
    per_rank = [sum(math.prod(t.shard.shape) for t in r.tensors) for r in ranks]
    total = sum(math.prod(p.shape) for p in global_params(padded))
    return total, max(per_rank)


def restart_options(spec: ModelSpec, gpus: int, gpus_per_node: int,
                    current: Topology | None) -> list[dict]:
    """Every TP x PP x DP for ``gpus`` that the model's layout rules allow."""
    out = []
    for tp in range(1, gpus + 1):
        if gpus % tp:
            continue
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp or rule_problems(spec, tp, pp):
                continue
            dp = gpus // (tp * pp)
            eps = [e for e in ep_sizes(spec) if dp % e == 0] if spec.num_experts else [1]
            out.append({"tp": tp, "pp": pp, "dp": dp, "ep": eps,
                        "within_node": tp <= gpus_per_node,
                        "same_model_parallel": current is not None and (tp, pp) == (current.tp, current.pp)})
    out.sort(key=lambda r: (not r["same_model_parallel"], not r["within_node"], r["pp"], -r["tp"]))
    return out


def parse_count(text: str) -> int:
    """``175B``, ``70b``, ``1.3B``, ``350M``, ``7e9`` -> parameters."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([KMBT]?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise UsageError(f"{text!r} is not a parameter count", hint="Use e.g. 70B, 1.3B, 350M")
    scale = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2).upper()]
    count = float(m.group(1)) * scale
    if not 1 <= count < 1e16:  # zero, or past any model (1e400 is inf)
        raise UsageError(f"{text!r} is not a parameter count of a model", hint="Use e.g. 70B, 1.3B, 350M")
    return int(count)


def model_from(path: str) -> tuple[ModelSpec, Topology | None]:
    """The model of an HF ``config.json``, a Megatron args file (JSON) or any checkpoint."""

    store = Store.open(path)
    if not store.isdir() and store.exists():
        config = json_object(store.read_small(""), path, "--model (neither a checkpoint directory nor "
                             "a JSON config)", UsageError)
        return _spec_from_json(config, path), None

    index = open_checkpoint(path).index
    if index.model_config is None:
        raise UsageError("the checkpoint does not say what model it holds", path=path,
                         hint="Give --params N or a config.json")
    return model_spec(index.model_config, index.url), index.topology


def _spec_from_json(config: dict, path: str) -> ModelSpec:
    if "model_type" in config or "architectures" in config:
        return spec_from_config(config, family_of_config(config, None, path))
    if "num_layers" in config:  # Megatron args as JSON
        args = argparse.Namespace(**config)
        if not hasattr(args, "padded_vocab_size"):
            args.padded_vocab_size = config.get("vocab_size")
        return spec_from_args(args)[0]
    if all(k in ModelSpec.__dataclass_fields__ for k in config):
        return ModelSpec(**config)
    raise UsageError("--model JSON is not an HF config, Megatron args or a ckptool model config",
                     path=path)


__all__ = ["plan", "PlanResult", "MemoryRow", "CheckpointCost", "parse_count", "model_from"]
