"""Real DeepSpeed ZeRO checkpoints on CPU (gloo): train, save, load at another DP size.

``save`` trains a tiny model with ZeRO-1/2/3 at DP=2, saves with ``engine.save_checkpoint``
and records the truth from the engine itself (fp32 masters and Adam moments gathered by
name, frozen parameters), then takes one more step with a fixed global batch: the run that
continued without resharding. ``load`` builds the same engine at another DP size (and
stage), calls plain ``engine.load_checkpoint``, records the loaded state and takes the same
step. Several stages run one after another in the same processes, to keep the spawns few.

The same engines train the other models the DeepSpeed tests need: Hugging Face models
under ZeRO, saved as the HF Trainer lays them out (``save_hf``, ``hf_start``), and a
GPTModelPipe-shaped ``PipelineModule`` saved as Megatron-DeepSpeed saves its pipeline runs
(``pipe_specs``, ``save_pipe``; :mod:`tests.harness.deepspeed_pipe` runs it at any pipeline
size).

DeepSpeed would JIT-build a CPU shared-memory comm op on first use (minutes); the harness
marks it unavailable, since gloo does the collectives.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.conftest import free_port, spawn  # noqa: E402

VOCAB, HIDDEN, FFN, SEQ, GLOBAL_BATCH = 29, 7, 9, 6, 6
"""Sizes that are not multiples of 2*DP for DP 1-3; the global batch divides by 1, 2 and 3."""
STEPS = 2
NEXT_STEP = 100


class Tiny(nn.Module):
    """Embedding, two Linear layers, a LayerNorm, a head tied to the embedding, a frozen
    parameter and a persistent buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.shift = nn.Parameter(torch.randn(HIDDEN) * 0.1, requires_grad=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, SEQ))

    def forward(self, x, y):
        h = self.emb(x)
        h = h * self.scale[None, :, None].to(h.dtype) + self.shift.to(h.dtype)
        h = self.norm(h + self.fc2(F.gelu(self.fc1(h))))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB).float(), y.reshape(-1))


PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    # ZeRO-1 + bf16 + fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
    "bf16opt": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
    # fp32, the flat buffers in round-robin order (which depends on the DP size)
    "rr": {"zero_optimization": {"round_robin_gradients": True}},
    # bf16, each parameter of the flat buffers aligned to 16 bytes (zeros in between)
    "align": {"bf16": {"enabled": True}, "zero_optimization": {"parameter_alignment": True}},
    # a constant learning rate (no scheduler): a schedule Megatron's can continue exactly
    "fp32_const": {"scheduler": None},
    "bf16_const": {"bf16": {"enabled": True}, "scheduler": None},
    # fp16 with a dynamic loss scale that overflows in the first step of the tiny models, so
    # the scaler's state (scale, iteration, last overflow) is not its initial one and the
    # second step is taken
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000,
                      "hysteresis": 1, "min_loss_scale": 1}},
}
SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def scaler_state(eng) -> dict | None:
    """The loss scaler's state (fp16), with the engine's count of skipped steps: ZeRO's
    DynamicLossScaler, or stage 0's FP16_UnfusedOptimizer's scale config (which has no
    hysteresis)."""
    if not eng.fp16_enabled():
        return None
    scaler = getattr(eng.optimizer, "loss_scaler", None)
    if scaler is None:  # FP16_UnfusedOptimizer
        scaler = eng.optimizer.loss_scale_config
        state = {k: float(getattr(scaler, k)) for k in SCALER if k != "cur_hysteresis"}
        state["dynamic"] = bool(scaler.dynamic_loss_scale)
    else:
        state = {k: float(getattr(scaler, k)) for k in SCALER}
        state["dynamic"] = bool(getattr(scaler, "dynamic", False))
    return {**state, "skipped_steps": int(eng.skipped_steps)}


def config(stage: int, dp: int, precision: str = "fp32") -> dict:
    cfg = {**PRECISIONS[precision],
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {**PRECISIONS[precision].get("zero_optimization", {}), "stage": stage},
    }
    if "scheduler" in PRECISIONS[precision]:
        del cfg["scheduler"]
    return cfg


def decay_groups(model) -> list[dict]:
    """The trainable parameters in two param groups, as Megatron groups them: the matrices
    with weight decay 0.01, the rest (biases, norms) without."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() == 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def engine(stage: int, dp: int, precision: str = "fp32"):
    import deepspeed

    torch.manual_seed(0)
    model = Tiny()
    groups = decay_groups(model)
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config(stage, dp, precision))
    return eng


def train_step(eng, step: int, rank: int, dp: int) -> float:
    """One step on the global batch of ``step`` (each rank its share); the mean loss."""
    import deepspeed.comm as dist

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    share = GLOBAL_BATCH // dp
    tokens = tokens[rank * share:(rank + 1) * share]
    loss = eng(tokens[:, :-1], tokens[:, 1:])
    eng.backward(loss)
    eng.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / dp).item()


def full_state(eng) -> dict:
    """fp32 masters, Adam moments and frozen parameters by name (collective at ZeRO-3)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = eng.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 links ZeRO-1/2 optimizer-state fragments only after the first
        # group's first step, so later groups read as missing: relink before reading.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    out = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "frozen": {}}
    masters, inner = _stage0_masters(eng)
    for name, p in eng.module.named_parameters():
        if not p.requires_grad:
            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                out["frozen"][name] = p.detach().clone()
            continue
        out["params"][name] = (masters[p] if masters else safe_get_full_fp32_param(p)).detach().clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            value = inner.state[masters[p]][kind] if masters else safe_get_full_optimizer_state(p, kind)
            out[kind][name] = value.detach().clone()
    return out


def _stage0_masters(eng):
    """Without ZeRO: ``({parameter: its fp32 master}, the torch optimizer)``. An fp32 engine
    steps the client's optimizer on the parameters themselves; a bf16 one (not a pipeline)
    wraps it in FP16_UnfusedOptimizer, which keeps an fp32 copy of each parameter
    (``fp32_groups``, parallel to ``fp16_groups``). ``(None, None)`` under ZeRO or
    BF16_Optimizer, which safe_get_full_fp32_param reads."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = eng.optimizer
    if isinstance(opt, FP16_UnfusedOptimizer):
        return {p: q for lp, hp in zip(opt.fp16_groups, opt.fp32_groups) for p, q in zip(lp, hp)}, \
            opt.optimizer
    if eng.zero_optimization() or eng.bfloat16_enabled() or eng.fp16_enabled():
        return None, None
    return {p: p for p in eng.module.parameters()}, opt


def assert_loaded_exactly(got: dict, truth: dict) -> None:
    """Every fp32 master, Adam moment and frozen parameter the saving engine held is in the
    loading engine, bit for bit (``truth["saved"]`` vs ``got["loaded"]`` of save/load)."""
    for kind, tensors in truth["saved"].items():
        for key, value in tensors.items():
            assert torch.equal(got["loaded"][kind][key], value), (kind, key)


def rel(a: dict, b: dict) -> float:
    """The largest relative difference between same-named tensors."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def module_state(eng) -> dict:
    """The module's own tensors (stages 1/2: full; what the forward uses). Under
    round_robin_gradients DeepSpeed 0.19.8's safe_get_full_fp32_param maps fragments in the
    wrong order, so tests of that mode compare these instead."""
    return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}


def _quiet():
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _save_worker(rank: int, dp: int, root: str, stages: list[int], precision: str,
                 port: int) -> None:
    _init(rank, dp, port)
    for stage in stages:
        eng = engine(stage, dp, precision)
        for s in range(STEPS):
            train_step(eng, s, rank, dp)
        name = f"z{stage}" + ("" if precision == "fp32" else f"_{precision}")
        eng.save_checkpoint(f"{root}/{name}")
        saved, module, scaler = full_state(eng), module_state(eng), scaler_state(eng)
        loss = train_step(eng, NEXT_STEP, rank, dp)
        after = full_state(eng)["params"]
        if rank == 0:
            torch.save({"saved": saved, "module": module, "loss": loss, "after": after,
                        "module_after": module_state(eng), "scaler": scaler},
                       f"{root}/{name}.truth.pt")


def _load_worker(rank: int, dp: int, jobs: list[tuple[int, str, str]], precision: str,
                 port: int) -> None:
    _init(rank, dp, port)
    for stage, ckpt, result in jobs:
        eng = engine(stage, dp, precision)
        eng.load_checkpoint(ckpt)
        loaded, module, steps = full_state(eng), module_state(eng), eng.global_steps
        scaler = scaler_state(eng)
        loss = train_step(eng, NEXT_STEP, rank, dp)
        after = full_state(eng)["params"]
        if rank == 0:
            torch.save({"loaded": loaded, "module": module, "loss": loss, "after": after,
                        "module_after": module_state(eng), "global_steps": steps,
                        "scaler": scaler}, result)


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    _quiet()
    # Test shim: gloo does the collectives; skip JIT-building DeepSpeed's CPU shared-memory
    # comm op (minutes on a fresh machine, unused here).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # Test shim: DeepSpeed's CPU accelerator admits fp16 engines only where oneDNN has fp16
    # kernels (AVX512-FP16/AMX CPUs); torch's CPU fp16 ops, which these tiny engines use, run
    # on any CPU. DeepSpeed's fp16 optimizers and loss scaler are unchanged.
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True
    deepspeed.init_distributed("gloo")


def _spawn(fn, nprocs: int, *args) -> None:
    spawn(fn, nprocs, (nprocs, *args, free_port()), "DeepSpeed harness")


def save(root: Path, stages=(1, 2, 3), dp: int = 2, precision: str = "fp32") -> None:
    """``root/z{stage}[_{precision}]``: a DeepSpeed run root per stage, and beside it
    ``<name>.truth.pt``."""
    _spawn(_save_worker, dp, str(root), list(stages), precision)


def load(dp: int, jobs: list[tuple[int, Path, Path]], precision: str = "fp32") -> None:
    """For each ``(stage, checkpoint, result)``: load at ``dp``, step, save the result."""
    _spawn(_load_worker, dp, [(s, str(c), str(r)) for s, c, r in jobs], precision)


# ------------------------------------------------- Hugging Face models trained by DeepSpeed

HF_CONFIGS = {
    # GQA, untied, a vocabulary that is not a multiple of 128
    "llama": dict(model_type="llama", vocab_size=203, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=SEQ, tie_word_embeddings=False, rms_norm_eps=1e-5),
    # tied lm_head, Conv1D weights, learned positions
    "gpt2": dict(model_type="gpt2", vocab_size=211, n_embd=32, n_layer=2, n_head=4,
                 n_positions=SEQ, n_inner=64),
    # the other family tables, in the order of their own named_parameters()
    "qwen3": dict(model_type="qwen3", vocab_size=203, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=SEQ, use_sliding_window=False),
    "phi3": dict(model_type="phi3", vocab_size=203, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma2": dict(model_type="gemma2", vocab_size=203, hidden_size=32, intermediate_size=48,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=SEQ, sliding_window=4, query_pre_attn_scalar=8),
    "olmo2": dict(model_type="olmo2", vocab_size=203, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=SEQ),
    # architectures ckptool has no family table for (exported by names, as zero_to_fp32 does):
    # Granite's embedding/residual/attention multipliers and logit scaling; StarCoder2's
    # LayerNorm with biases, GELU MLP and sliding window
    "granite": dict(model_type="granite", vocab_size=197, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=SEQ, embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.3, logits_scaling=2.0),
    "starcoder2": dict(model_type="starcoder2", vocab_size=199, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=SEQ, sliding_window=4),
}


def hf_model(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(HF_CONFIGS[family])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def hf_tokens(vocab: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)


def _hf_save_worker(rank: int, dp: int, root: str, jobs: list[tuple[str, int, str]], port: int) -> None:
    """An HF model trained by DeepSpeed per ``(family, stage, precision)``, saved as the HF
    Trainer lays it out (``config.json`` beside ``latest``), with the module's logits on a
    fixed batch and the fp32 masters by name."""
    import deepspeed

    _init(rank, dp, port)
    for family, stage, precision in jobs:
        model = hf_model(family)
        groups = decay_groups(model)
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                            config=config(stage, dp, precision))
        vocab = model.config.vocab_size
        share = GLOBAL_BATCH // dp
        for s in range(STEPS):
            tok = hf_tokens(vocab, s)[rank * share:(rank + 1) * share]
            eng.backward(eng(input_ids=tok, labels=tok).loss)
            eng.step()
        out = f"{root}/{hf_run_name(family, stage, precision)}"
        eng.save_checkpoint(out)
        masters = fp32_masters(eng)
        eng.eval()
        with torch.no_grad():
            logits = eng(input_ids=hf_tokens(vocab, NEXT_STEP)).logits
        if rank == 0:
            model.config.save_pretrained(out)
            torch.save(logits, f"{out}.logits.pt")
            torch.save(masters, f"{out}.masters.pt")


def fp32_masters(eng) -> dict:
    """The fp32 master of every trainable parameter by name (collective at ZeRO-3); unlike
    :func:`full_state` it needs no optimizer state (an engine before its first step)."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters, _ = _stage0_masters(eng)
    return {name: (masters[p] if masters else safe_get_full_fp32_param(p)).detach().clone()
            for name, p in eng.module.named_parameters() if p.requires_grad}


def _hf_groups(model, groups: str):
    if groups == "single":
        return [p for p in model.parameters() if p.requires_grad]
    return decay_groups(model)


def _hf_start_worker(rank: int, dp: int, jobs: list[tuple], port: int) -> None:
    """Per ``(family, stage, groups, precision, checkpoint, how, result)``: an engine built
    from the HF model itself (the reference), and one built from other weights that loads
    ``checkpoint`` (``how``: ``module`` = load_module_only, ``fresh`` = no optimizer states,
    ``files`` = every optimizer file read, the job's hyperparameters put back);
    each records its fp32 masters and logits, then takes the same training step. A bf16
    reference starts from the model rounded to bf16, as the checkpoint holds it."""
    import deepspeed

    _init(rank, dp, port)
    for family, stage, groups, precision, ckpt, how, result in jobs:
        out = {}
        for name, seed in (("reference", 0), ("loaded", 1)):
            model = hf_model(family, seed)
            if precision == "bf16":
                model = model.to(torch.bfloat16).float()
            eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=_hf_groups(model, groups),
                                                config=config(stage, dp, precision))
            if name == "loaded":
                if how == "module":
                    eng.load_checkpoint(ckpt, load_module_only=True)
                elif how == "fresh":
                    eng.load_checkpoint(ckpt, load_optimizer_states=False,
                                        load_lr_scheduler_states=False)
                else:  # "files": DeepSpeed reads every optimizer file; the hyperparameters
                    groups = eng.optimizer.optimizer.param_groups  # (not in them) are the job's
                    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
                    eng.load_checkpoint(ckpt, load_lr_scheduler_states=False)
                    for group, h in zip(eng.optimizer.optimizer.param_groups, hyper):
                        group.update(h)
            vocab = model.config.vocab_size
            masters = fp32_masters(eng)
            eng.eval()
            with torch.no_grad():
                logits = eng(input_ids=hf_tokens(vocab, NEXT_STEP)).logits
            eng.train()
            torch.manual_seed(1234 + rank)  # GPT-2's dropout: the same masks in both engines
            share = GLOBAL_BATCH // dp
            tok = hf_tokens(vocab, 0)[rank * share:(rank + 1) * share]
            loss = eng(input_ids=tok, labels=tok).loss
            eng.backward(loss)
            eng.step()
            out[name] = {"masters": masters, "logits": logits, "loss": loss.item(),
                         "after": fp32_masters(eng)}
            del eng
        if rank == 0:
            torch.save(out, result)


def hf_start(dp: int, jobs: list[tuple]) -> None:
    """Run :func:`_hf_start_worker` jobs at ``dp``."""
    _spawn(_hf_start_worker, dp, [tuple(str(x) if isinstance(x, Path) else x for x in j) for j in jobs])


def hf_run_name(family: str, stage: int, precision: str = "fp32") -> str:
    return f"{family}_z{stage}" + ("" if precision == "fp32" else f"_{precision}")


def save_hf(root: Path, jobs: list[tuple[str, int, str]], dp: int = 2) -> None:
    """``root/<hf_run_name>`` per ``(family, stage, precision)``: HF-Trainer-style DeepSpeed
    run roots, and beside each ``.logits.pt`` (the trained module's logits on
    ``hf_tokens(vocab, NEXT_STEP)``) and ``.masters.pt`` (:func:`fp32_masters`)."""
    _spawn(_hf_save_worker, dp, str(root), list(jobs))


# ------------------------------- Megatron-DeepSpeed pipeline checkpoints (GPTModelPipe-shaped)

PIPE_ARGS = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                 kv_channels=8, max_position_embeddings=8, seq_length=SEQ, padded_vocab_size=208,
                 make_vocab_size_divisible_by=8, layernorm_epsilon=1e-5, normalization="layernorm",
                 openai_gelu=True, untie_embeddings_and_output_weights=False, add_bias_linear=True,
                 add_position_embedding=True, use_rotary_position_embeddings=False,
                 num_key_value_heads=4, swiglu=False, fp16=False, bf16=False)
"""Megatron-DeepSpeed's own argument names and spellings (``normalization="layernorm"``,
``num_key_value_heads``, ``add_position_embedding``); GPT-2 math: LayerNorm, tanh GELU
(``--openai-gelu``, HF ``gelu_new``), learned positions, tied embeddings, biases."""
PIPE_MICRO, PIPE_GAS = 2, 2


class _Embedding(nn.Module):
    """Megatron-DeepSpeed's EmbeddingPipe: word + learned position embeddings."""

    def __init__(self):
        super().__init__()
        a = PIPE_ARGS
        self.word_embeddings = nn.Embedding(a["padded_vocab_size"], a["hidden_size"])
        self.position_embeddings = nn.Embedding(a["max_position_embeddings"], a["hidden_size"])

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.word_embeddings(ids) + self.position_embeddings(pos)[None]


class _Attention(nn.Module):
    """Legacy ParallelAttention (checkpoint_version 3.0): ``query_key_value`` rows are
    grouped per head, ``[q_h; k_h; v_h]``."""

    def __init__(self):
        super().__init__()
        h = PIPE_ARGS["hidden_size"]
        self.query_key_value = nn.Linear(h, 3 * h)
        self.dense = nn.Linear(h, h)

    def forward(self, x):
        b, s, h = x.shape
        nh = PIPE_ARGS["num_attention_heads"]
        d = h // nh
        q, k, v = self.query_key_value(x).view(b, s, nh, 3 * d).split(d, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / d ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return self.dense((probs @ v).transpose(1, 2).reshape(b, s, h))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        h, f = PIPE_ARGS["hidden_size"], PIPE_ARGS["ffn_hidden_size"]
        self.dense_h_to_4h = nn.Linear(h, f)
        self.dense_4h_to_h = nn.Linear(f, h)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class ParallelTransformerLayerPipe(nn.Module):
    """A pre-LN GPT layer under Megatron-DeepSpeed's legacy local names."""

    def __init__(self):
        super().__init__()
        h, eps = PIPE_ARGS["hidden_size"], PIPE_ARGS["layernorm_epsilon"]
        self.input_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attention = _Attention()
        self.post_attention_layernorm = nn.LayerNorm(h, eps=eps)
        self.mlp = _MLP()

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def _to_float16(inputs):
    return inputs  # fp32 run: GPTModelPipe's first spec is this function (layer index 0)


def _logits_helper(embedding, hidden):
    return hidden @ embedding.word_embeddings_weight.t()


def _cross_entropy(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def pipe_specs() -> list:
    """GPTModelPipe's spec list, so the layer indices are Megatron-DeepSpeed's: 0 the fp16
    cast (a function), 1 the embedding (tied 'embed'), 2.. the transformer layers, then the
    final LayerNorm, then the tied head (a forward_fn of 'embed': no layer file)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    a = PIPE_ARGS
    return [_to_float16,
            TiedLayerSpec("embed", _Embedding, tied_weight_attr="word_embeddings_weight"),
            *[LayerSpec(ParallelTransformerLayerPipe) for _ in range(a["num_layers"])],
            LayerSpec(nn.LayerNorm, a["hidden_size"], eps=a["layernorm_epsilon"]),
            TiedLayerSpec("embed", _Embedding, forward_fn=_logits_helper,
                          tied_weight_attr="word_embeddings_weight")]


def pipe_tokens(step: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 203, (batch, SEQ + 1), generator=g)


def pipe_reference_logits(layers: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The pipeline model's forward in one process: the spec's modules in order, each with
    the state a stage held in memory (``layers``: spec index -> state dict; the head uses
    the last stage's own tied copy of the embedding)."""
    out = tokens
    for idx, spec in enumerate(pipe_specs()):
        if idx not in layers:
            out = spec(out)
            continue
        module = spec.build()
        module.load_state_dict(layers[idx])
        out = spec.forward_fn(module, out) if getattr(spec, "forward_fn", None) else module(out)
    return out


def _pipe_save_worker(rank: int, world: int, root: str, pp: int, port: int) -> None:
    _init(rank, world, port)
    for name, stage, precision in PIPE_RUNS:
        _pipe_run(rank, world, root, pp, name, stage, precision)


PIPE_RUNS = (("pipe", 1, "fp32"), ("pipe_bf16", 0, "bf16"))
"""(name, ZeRO stage, precision): fp32 at ZeRO-1, and bf16 at stage 0, which DeepSpeed runs
with its BF16_Optimizer for pipelines (``bf16_zero_pp_rank_*`` files), as Megatron-DeepSpeed's
bf16 runs do."""


def _pipe_run(rank: int, world: int, root: str, pp: int, name: str, stage: int, precision: str) -> None:
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = world // pp
    torch.manual_seed(0)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=1, num_dp=dp)
    model = PipelineModule(layers=pipe_specs(), loss_fn=_cross_entropy, topology=topo,
                           partition_method="type:transformer")
    groups = decay_groups(model)
    cfg = config(stage, dp, precision)
    cfg.update(train_batch_size=PIPE_MICRO * PIPE_GAS * dp, train_micro_batch_size_per_gpu=PIPE_MICRO,
               gradient_accumulation_steps=PIPE_GAS)
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    for step in range(STEPS):
        tokens = pipe_tokens(step, PIPE_MICRO * PIPE_GAS)
        batches = iter([(t[:, :-1], t[:, 1:]) for t in tokens.split(PIPE_MICRO)])
        eng.train_batch(batches)
    args = argparse.Namespace(**PIPE_ARGS, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=pp, world_size=world,
                              data_parallel_size=dp, iteration=STEPS)
    args.bf16 = precision == "bf16"
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]
    eng.save_checkpoint(f"{root}/{name}", client_state={"args": args, "checkpoint_version": 3.0,
                                                        "iteration": STEPS, "tokens": 0,
                                                        "rng_state": rng})
    if rank == 0:
        (Path(root) / name / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    module = eng.module
    layers = {module._local_start + i: f.state_dict() for i, f in enumerate(module.forward_funcs)
              if isinstance(f, nn.Module)}
    if eng.is_last_stage():  # the head: this stage's own copy of the tied embedding
        layers[len(pipe_specs()) - 1] = module.tied_modules["embed"].state_dict()
    truth = {"layers": {k: {n: t.detach().clone() for n, t in v.items()} for k, v in layers.items()},
             "state": full_state(eng)}
    torch.save(truth, f"{root}/{name}.rank{rank}.truth.pt")


def save_pipe(root: Path, pp: int = 2, dp: int = 1) -> None:
    """``root/{name}`` per :data:`PIPE_RUNS`: Megatron-DeepSpeed-style pipeline run roots
    (TP1), and beside each ``{name}.rank{r}.truth.pt`` per rank: the stage's layer modules'
    state in memory (spec index -> state dict), its fp32 masters and Adam moments by
    parameter name."""
    _spawn(_pipe_save_worker, pp * dp, str(root), pp)
